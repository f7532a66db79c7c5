"""A lock store behind Redis Sentinel: ``sentinel://`` URLs, the broker's sentinels, a failover.

Real servers: a master, its replica and a ``redis-server --sentinel`` watching them, each on a
free port and stopped by pid at the end of its test.
"""

from __future__ import annotations

import json
import logging
import ssl
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from celery import Celery
from conftest import granted, wait_for
from redis.sentinel import SentinelManagedSSLConnection
from test_cli import celery_lock_cli
from test_storm import run_storm
from tls import TlsFiles, start_with_tls

from celery_lock.config import LockSettings, validate_redis_url
from celery_lock.exceptions import ConfigurationError, LockStoreError, LockStoreUnavailableError
from celery_lock.keys import RequestKeys
from celery_lock.lease import Held, Holder, Lease, new_token
from celery_lock.runtime import lock_store_url
from celery_lock.sentinel import SentinelURL
from celery_lock.store import LockStore, _check_out, address_of
from celery_lock.testing import (
    CeleryWorker,
    RedisServer,
    _terminate,
    free_port,
)

MASTER_NAME = "locks"
HOLDER = Holder("task-1", "shop.charge", "host-a", 4242)


class SentinelProcess:
    """``redis-server <conf> --sentinel`` watching one master as ``locks`` with a quorum of one,
    quick to call it down (1 s), in a directory of its own (a sentinel rewrites its config).

    With ``tls``, it reaches the master and its replicas over TLS (the master is watched on its
    ``tls_port``), and listens with TLS on :attr:`tls_port` besides its plain :attr:`port`.
    """

    def __init__(
        self,
        master: RedisServer,
        password: str | None = None,
        tls: TlsFiles | None = None,
        tls_port: int | None = None,
    ) -> None:
        self.port = free_port()
        self.tls_port = free_port() if tls else None
        self._dir = tempfile.TemporaryDirectory(prefix="celery-lock-sentinel-")
        conf = Path(self._dir.name, "sentinel.conf")
        lines = [f"port {self.port}", "bind 127.0.0.1", f"dir {self._dir.name}"]
        lines.append("logfile sentinel.log")
        if tls is not None:
            options = [*tls.server_args(self.tls_port or 0), "--tls-replication", "yes"]
            pairs = zip(options[::2], options[1::2], strict=True)
            lines += [f"{name.removeprefix('--')} {value}" for name, value in pairs]
        lines += [
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {tls_port or master.port} 1",
            f"sentinel down-after-milliseconds {MASTER_NAME} 1000",
            f"sentinel failover-timeout {MASTER_NAME} 5000",
        ]
        if master.password:
            lines.append(f"sentinel auth-pass {MASTER_NAME} {master.password}")
        if password:
            lines.append(f"requirepass {password}")
        conf.write_text("\n".join(lines) + "\n")
        self._proc = subprocess.Popen(
            [master.executable, str(conf), "--sentinel"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        self.client = redis.Redis(port=self.port, password=password, socket_timeout=2)

    def master_port(self) -> int:
        _, port = self.client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
        return int(port)

    def knows_a_replica(self) -> bool:
        """Whether it knows a replica fit to promote: seen up and linked to the master (until
        then ``SENTINEL FAILOVER`` answers ``NOGOODSLAVE``)."""
        try:
            replicas = self.client.execute_command("SENTINEL", "REPLICAS", MASTER_NAME)
        except redis.RedisError:
            return False
        return any(
            fields.get("flags") == "slave" and fields.get("master-link-status") == "ok"
            for fields in map(_fields, replicas)
        )

    def stop(self) -> None:
        self.client.close()
        _terminate(self._proc, 5.0)  # as RedisServer stops its own: SIGTERM, then SIGKILL
        self._dir.cleanup()


def _fields(reply: Any) -> dict[str, str]:
    """One instance of a ``SENTINEL REPLICAS`` reply as text, however this redis-py parsed it:
    a flat list of names and values, or a dict (its flags a set, in some releases)."""
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)

    def text(value: Any) -> str:
        if isinstance(value, (set, frozenset)):
            return ",".join(sorted(map(text, value)))
        return value.decode() if isinstance(value, bytes) else str(value)

    return {text(name): text(value) for name, value in pairs}


class Group:
    """A master, its replica and a sentinel; with ``password``, the master and the replica
    require it, and with ``sentinel_password``, the sentinel requires that. With ``tls``, all
    three also listen with TLS, on ports of their own, and talk to each other over TLS."""

    def __init__(
        self,
        password: str | None = None,
        sentinel_password: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        auth = ["--requirepass", password, "--masterauth", password] if password else []
        self.tls = tls
        self.tls_ports: dict[int, int] = {}  # plain port -> TLS port, with tls
        self.sentinel_password = sentinel_password
        self.sentinel: SentinelProcess | None = None
        if tls is None:
            self.master = self._server(auth)
        else:  # started here: from a redis-server built with TLS, which the others then run
            self.master = start_with_tls(lambda executable: self._server(auth, executable))
        self.replica = self._server(
            ["--replicaof", "127.0.0.1", str(self.port_of(self.master)), *auth],
            self.master.executable,
        )
        try:
            self.master.start()
            self.replica.start()
            with self.replica.client() as replica:
                wait_for("the replica to sync", lambda: replica.info("replication").get(
                    "master_link_status") == "up")  # fmt: skip
            self.sentinel = SentinelProcess(
                self.master, sentinel_password, tls, self.tls_ports.get(self.master.port)
            )
            wait_for("the sentinel to know the replica", self.sentinel.knows_a_replica)
        except BaseException:
            self.stop()
            raise

    def _server(self, args: list[str], executable: str | None = None) -> RedisServer:
        """A server of the group (not started); with TLS, listening on a TLS port too. A
        replica syncs from a file, at once: Redis 7 waits 5 s for more replicas before a sync
        over the socket. (With that wait set to 0, two failover tests on Redis 7.0.15 found a
        write that WAIT had acknowledged missing on the promoted replica: not chased.)"""
        server = RedisServer(
            extra_args=[*args, "--repl-diskless-sync", "no"], executable=executable
        )
        if self.tls is not None:
            self.tls_ports[server.port] = free_port()
            server.extra_args += self.tls.server_args(self.tls_ports[server.port])
            server.extra_args += ["--tls-replication", "yes"]
        return server

    def port_of(self, server: RedisServer) -> int:
        """The port the group's servers and sentinel reach ``server`` on (its TLS one, with
        TLS), and the sentinel names it by."""
        return self.tls_ports.get(server.port, server.port)

    @property
    def watcher(self) -> SentinelProcess:
        assert self.sentinel is not None
        return self.sentinel

    def url(self, db: int = 2, sentinel_tls: bool = True) -> str:
        """The lock store URL of database ``db`` of the master, with both passwords; with TLS,
        trusting the group's CA, and reaching the sentinel over TLS too unless not
        ``sentinel_tls``."""
        auth = f":{self.master.password}@" if self.master.password else ""
        query = f"?master_name={MASTER_NAME}"
        if self.sentinel_password:
            query += f"&sentinel_password={self.sentinel_password}"
        port = self.watcher.port
        if self.tls is not None:
            ca = quote(self.tls.ca_file, safe="")
            query += f"&ssl=true&ssl_ca_certs={ca}"
            if sentinel_tls and self.watcher.tls_port:
                port = self.watcher.tls_port
                query += f"&sentinel_ssl=true&sentinel_ssl_ca_certs={ca}"
        return f"sentinel://{auth}127.0.0.1:{port}/{db}{query}"

    def stop(self) -> None:
        # The first master first: after a failover it is the replica, and a master that stops
        # waits (up to 10 s) for a replica still syncing, while a replica stops at once.
        if self.sentinel is not None:
            self.sentinel.stop()
        self.master.stop()
        self.replica.stop()


@pytest.fixture
def group(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Group]:
    """A group; over TLS where the test gives ``"tls"`` as its (indirect) parameter."""
    tls = TlsFiles.issue(tmp_path) if getattr(request, "param", None) == "tls" else None
    started = Group(tls=tls)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def tls_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    """A group over TLS, shared by the tests that change nothing but their own keys in it."""
    started = Group(tls=TlsFiles.issue(tmp_path_factory.mktemp("tls")))
    yield started
    started.stop()


@pytest.fixture
def store(group: Group) -> Iterator[LockStore]:
    """A lock store on the group's sentinel URL."""
    opened = LockStore.from_url(group.url())
    yield opened
    opened.close()


def keys(request: str) -> RequestKeys:
    return RequestKeys.build("celery-lock", "shop.charge", request, "shop.charge")


def grant_or_none(store: LockStore, request: RequestKeys) -> int | None:
    """The fence of a grant of ``request``; ``None`` while the store is unavailable."""
    try:
        return granted(store.acquire(request, new_token(), 60_000, HOLDER, 60_000))
    except LockStoreUnavailableError:
        return None


# -- URLs ---------------------------------------------------------------------------------------


def test_a_sentinel_url_is_read_as_kombu_reads_a_sentinel_broker() -> None:
    url = (
        "sentinel://:s%3Bcret@10.0.0.1:26380/2;sentinel://10.0.0.2;"
        "sentinel://10.0.0.3:26381?master_name=locks&sentinel_password=watch&min_other_sentinels=1"
    )
    read = SentinelURL.parse(url)
    assert read.sentinels == (("10.0.0.1", 26380), ("10.0.0.2", 26379), ("10.0.0.3", 26381))
    assert (read.master_name, read.db, read.username, read.password) == ("locks", 2, None, "s;cret")
    assert (read.sentinel_username, read.sentinel_password) == (None, "watch")
    assert read.min_other_sentinels == 1
    assert (read.master_tls, read.sentinel_tls) == (None, None)
    assert validate_redis_url("celery_lock_redis_url", url) == url


def test_a_sentinel_urls_tls_options_are_read_for_the_master_and_the_sentinels_apart() -> None:
    url = (
        "sentinel://10.0.0.1?master_name=locks&ssl=true&ssl_ca_certs=%2Fca.pem"
        "&ssl_check_hostname=false&ssl_cert_reqs=optional"
        "&sentinel_ssl=true&sentinel_ssl_certfile=%2Fme.pem&sentinel_ssl_keyfile=%2Fme.key"
    )
    read = SentinelURL.parse(url)
    assert read.master_tls == {
        "ssl_ca_certs": "/ca.pem", "ssl_check_hostname": False, "ssl_cert_reqs": "optional"
    }  # fmt: skip
    assert read.sentinel_tls == {"ssl_certfile": "/me.pem", "ssl_keyfile": "/me.key"}
    assert SentinelURL.parse("sentinel://h?master_name=m&ssl=true").master_tls == {}
    assert SentinelURL.parse("sentinel://h?master_name=m&sentinel_ssl=false").sentinel_tls is None


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("sentinel://10.0.0.1:26379", "names no master: add ?master_name="),
        ("sentinel://10.0.0.1?master_name=", "names no master"),
        ("sentinel://10.0.0.1?master_name=a&db=2", "unknown query argument 'db'"),
        ("sentinel://10.0.0.1?master_name=a&master_name=b", "given more than once"),
        ("sentinel://10.0.0.1;sentinel://:pw@10.0.0.2?master_name=a", "sentinel 2 gives a user"),
        ("sentinel://10.0.0.1;sentinel://10.0.0.2/3?master_name=a", "give them on the first"),
        ("sentinel://10.0.0.1/locks?master_name=a", "database 'locks' is not a number"),
        ("sentinel://10.0.0.1:port?master_name=a", "sentinel 1 has a port that is no number"),
        ("sentinel://:pw@/0?master_name=a", "sentinel 1 names no host"),
        ("sentinel://10.0.0.1;sentinel://[zz]?master_name=a", "'zz' does not appear to be an IPv4"),
        ("sentinel://10.0.0.1;redis://10.0.0.2?master_name=a", "part 2 of the sentinel list"),
        ("sentinel://10.0.0.1?master_name=a&min_other_sentinels=one", "a whole number"),
        ("sentinel://10.0.0.1?master_name=a&ssl=yes", "ssl must be true or false, got 'yes'"),
        ("sentinel://10.0.0.1?master_name=a&ssl_ca_certs=/ca.pem", "without ssl=true"),
        ("sentinel://10.0.0.1?master_name=a&ssl=true&sentinel_ssl_ca_certs=/c", "sentinel_ssl="),
        ("sentinel://10.0.0.1?master_name=a&ssl=true&ssl_cert_reqs=CERT_REQUIRED", "none, opt"),
        ("sentinel://10.0.0.1?master_name=a&ssl=true&ssl_check_hostname=no", "not true or false"),
        ("sentinel://10.0.0.1?master_name=a&ssl=true&ssl_ocsp_context=x", "unknown query"),
        ("sentinel://10.0.0.1?master_name=a&sentinel_ssl_verify=x", "unknown query argument"),
    ],
)
def test_a_malformed_sentinel_url_is_refused_with_what_is_wrong(url: str, problem: str) -> None:
    with pytest.raises(ConfigurationError, match="malformed sentinel URL") as refused:
        validate_redis_url("celery_lock_redis_url", url)
    assert problem in str(refused.value)
    assert "pw" not in str(refused.value)


def broker_app(broker: Any, **conf: Any) -> Celery:
    app = Celery("sentinel_broker", broker=broker, set_as_current=False)
    app.conf.update(conf)
    return app


def test_the_brokers_sentinels_and_master_name_give_the_lock_store_when_no_url_is_set() -> None:
    app = broker_app(
        ["sentinel://:pw@10.0.0.1:26379/4", "sentinel://10.0.0.2:26379?heartbeat=10"],
        broker_transport_options={
            "master_name": "queues",
            "min_other_sentinels": 1,
            "sentinel_kwargs": {"password": "watch", "socket_timeout": 1},
        },
    )
    url = lock_store_url(app, LockSettings())
    assert url == (
        "sentinel://:pw@10.0.0.1:26379/4;sentinel://10.0.0.2:26379"
        "?master_name=queues&sentinel_password=watch&min_other_sentinels=1"
    )
    read = SentinelURL.parse(url)
    assert (read.master_name, read.db, read.password, read.sentinel_password) == (
        "queues", 4, "pw", "watch")  # fmt: skip
    assert read.min_other_sentinels == 1
    # TLS: broker_use_ssl for the master, the ssl options of sentinel_kwargs for the sentinels.
    app.conf.broker_use_ssl = {"ssl_cert_reqs": "CERT_REQUIRED", "ssl_ca_certs": "/ca.pem"}
    app.conf.broker_transport_options["sentinel_kwargs"].update(ssl=True, ssl_check_hostname=False)
    read = SentinelURL.parse(lock_store_url(app, LockSettings()))
    assert read.master_tls == {"ssl_cert_reqs": "required", "ssl_ca_certs": "/ca.pem"}
    assert read.sentinel_tls == {"ssl_check_hostname": False}
    app.conf.broker_use_ssl = True  # kombu reads only a dict here, and connects without TLS
    assert SentinelURL.parse(lock_store_url(app, LockSettings())).master_tls is None
    # celery_lock_redis_url still wins.
    assert lock_store_url(app, LockSettings(redis_url="redis://elsewhere/2")) == (
        "redis://elsewhere/2"
    )


@pytest.mark.parametrize(
    "broker",
    [
        "sentinel://a:26379?heartbeat=10;sentinel://b:26379;sentinel://c:26379",
        ["sentinel://a:26379?heartbeat=10", "sentinel://b:26379", "sentinel://c:26379?insist=1"],
        "sentinel://a:26379?sentinel_password=watch;sentinel://b:26379;sentinel://c:26379",
    ],
    ids=repr,
)
def test_every_sentinel_of_the_broker_is_kept_whichever_one_has_a_query(broker: Any) -> None:
    app = broker_app(broker, broker_transport_options={"master_name": "queues"})
    read = SentinelURL.parse(lock_store_url(app, LockSettings()))
    assert read.sentinels == (("a", 26379), ("b", 26379), ("c", 26379))
    assert read.master_name == "queues"


def test_a_sentinel_brokers_connect_timeout_does_not_stop_the_lock_store() -> None:
    """kombu reads ``connect_timeout`` from any broker URL; a sentinel URL has no socket option
    (the store's own connect timeout applies), so it is dropped rather than refused."""
    app = broker_app(
        "sentinel://a:26379;sentinel://b:26379?connect_timeout=2",
        broker_transport_options={"master_name": "queues"},
    )
    url = lock_store_url(app, LockSettings())
    assert url == "sentinel://a:26379;sentinel://b:26379?master_name=queues"


@pytest.mark.parametrize(
    ("conf", "setting", "problem"),
    [
        ({}, "broker_transport_options", "no master_name"),
        (
            {"broker_transport_options": {"master_name": "q", "sentinel_kwargs": {"db": 1}}},
            "celery_lock_redis_url",
            "sentinel_kwargs give db, which the lock store does not read",
        ),
        (
            {"broker_transport_options": {"master_name": "q"}, "broker_use_ssl": {"a": 1}},
            "broker_url",
            "unknown query argument 'a'",
        ),
    ],
)
def test_a_sentinel_broker_the_lock_store_cannot_follow_is_refused(
    conf: dict[str, Any], setting: str, problem: str
) -> None:
    app = broker_app("sentinel://10.0.0.1:26379", **conf)
    with pytest.raises(ConfigurationError, match=setting) as refused:
        lock_store_url(app, LockSettings())
    assert problem in str(refused.value)


# -- real servers -------------------------------------------------------------------------------


def test_a_lease_taken_through_the_sentinel_lives_on_its_master(
    group: Group, store: LockStore
) -> None:
    token = new_token()
    granted(store.acquire(keys("1"), token, 60_000, HOLDER, 60_000))
    assert address_of(store.client) == f"master {MASTER_NAME} at 127.0.0.1:{group.master.port}"
    with group.master.client(2) as master:
        assert master.get(keys("1").lock).startswith(token.encode())
    assert isinstance(store.acquire(keys("1"), new_token(), 60_000, HOLDER, 60_000), Held)


@pytest.mark.parametrize("sentinel_tls", [True, False], ids=["sentinel-tls", "sentinel-plain"])
def test_a_lease_taken_over_tls_lives_on_the_master_the_sentinel_names(
    tls_group: Group, sentinel_tls: bool
) -> None:
    """The master over TLS, asked for through a sentinel over TLS or not: the sentinel names the
    master's TLS port, where a connection without TLS would be dropped."""
    with closing(LockStore.from_url(tls_group.url(sentinel_tls=sentinel_tls))) as store:
        token = new_token()
        granted(store.acquire(keys(f"tls-{sentinel_tls}"), token, 60_000, HOLDER, 60_000))
        master_port = tls_group.port_of(tls_group.master)
        assert master_port != tls_group.master.port
        assert address_of(store.client) == f"master {MASTER_NAME} at 127.0.0.1:{master_port}"
        pooled = _check_out(store.client.connection_pool)
        try:
            assert isinstance(pooled, SentinelManagedSSLConnection)
        finally:
            store.client.connection_pool.release(pooled)
    with tls_group.master.client(2) as master:
        assert master.get(keys(f"tls-{sentinel_tls}").lock).startswith(token.encode())


def test_a_store_over_tls_trusts_only_the_ca_its_url_names(tls_group: Group) -> None:
    """Without the group's CA (the system's CAs instead), neither the master's certificate nor
    the sentinel's is trusted: a call fails as "not now", as while no server is reachable."""
    assert tls_group.tls is not None
    ca = quote(tls_group.tls.ca_file, safe="")
    for untrusting, problem in [
        (tls_group.url(sentinel_tls=False).replace(f"&ssl_ca_certs={ca}", ""), "CERTIFICATE"),
        (tls_group.url().replace(f"&sentinel_ssl_ca_certs={ca}", ""), "No master found"),
    ]:
        with (
            closing(LockStore.from_url(untrusting, retry_deadline=0.2)) as store,
            pytest.raises(LockStoreUnavailableError, match=problem),
        ):
            store.acquire(keys("untrusted"), new_token(), 60_000, HOLDER, 60_000)
    with tls_group.master.client(2) as master:
        assert not master.exists(keys("untrusted").lock)


def test_a_sentinel_broker_over_tls_lends_the_lock_store_its_tls_options(tls_group: Group) -> None:
    """kombu reaches the master with ``broker_use_ssl`` and the sentinels with the TLS options
    of ``sentinel_kwargs``; the lock store found from the broker does the same."""
    assert tls_group.tls is not None
    ca_file = tls_group.tls.ca_file
    app = broker_app(
        f"sentinel://127.0.0.1:{tls_group.watcher.tls_port}/0",
        broker_transport_options={
            "master_name": MASTER_NAME,
            "sentinel_kwargs": {"ssl": True, "ssl_ca_certs": ca_file},
        },
        broker_use_ssl={"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": ca_file},
    )
    with app.connection_for_write() as connection:  # kombu itself, as the worker connects
        assert connection.default_channel.client.ping()
    url = lock_store_url(app, LockSettings())
    read = SentinelURL.parse(url)
    assert read.master_tls == {"ssl_cert_reqs": "required", "ssl_ca_certs": ca_file}
    assert read.sentinel_tls == {"ssl_ca_certs": ca_file}
    with closing(LockStore.from_url(url)) as store:
        granted(store.acquire(keys("broker-tls"), new_token(), 60_000, HOLDER, 60_000))
    with tls_group.master.client(0) as master:
        assert master.exists(keys("broker-tls").lock)


@pytest.mark.parametrize("group", ["plain", "tls"], indirect=True)
def test_after_a_failover_the_store_follows_the_sentinel_to_the_new_master(
    group: Group, caplog: pytest.LogCaptureFixture, store: LockStore
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_lock.store")
    token = new_token()
    first = granted(store.acquire(keys("1"), token, 60_000, HOLDER, 60_000))
    with group.master.client() as master:
        assert master.wait(1, 5_000) == 1  # the lease is on the replica

    group.watcher.client.execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
    wait_for("the replica to be promoted", lambda: group.watcher.master_port() == (
        group.port_of(group.replica)))  # fmt: skip
    # The sentinel demotes the old master once it reads its INFO again (every 10 s); until
    # then it takes writes, as any Redis does in a failover (semantics.md).
    with group.master.client() as old:
        wait_for("the old master to be demoted", lambda: old.info("replication")[
            "role"] == "slave")  # fmt: skip

    # The held connection meets READONLY; the next try asks the sentinel again.
    second = granted(store.acquire(keys("2"), new_token(), 60_000, HOLDER, 60_000))
    assert address_of(store.client).endswith(f"127.0.0.1:{group.port_of(group.replica)}")
    with group.replica.client(2) as new_master:
        assert new_master.exists(keys("2").lock)
    # The lease taken before the failover holds on the new master.
    assert isinstance(store.acquire(keys("1"), new_token(), 60_000, HOLDER, 60_000), Held)
    assert second != first
    assert (store.failovers, store.restarts) == (1, 0)
    [warning] = [r.getMessage() for r in caplog.records if "another server" in r.getMessage()]
    assert f"127.0.0.1:{group.port_of(group.replica)}" in warning
    assert "a failover" in warning


def test_a_killed_master_fails_calls_as_unavailable_until_the_sentinel_promotes_its_replica(
    group: Group,
    store: LockStore,
) -> None:
    token = new_token()
    fence = granted(store.acquire(keys("1"), token, 60_000, HOLDER, 60_000))
    lease = Lease(store, keys("1"), token, 60_000, fence, HOLDER, 60_000)
    with group.master.client() as master:
        assert master.wait(1, 5_000) == 1  # the lease is on the replica

    group.master.kill()
    # Until the sentinel calls the master down (1 s) and promotes the replica, a call
    # fails as "not now", which a task meets as a deferral (fail closed).
    with pytest.raises(LockStoreUnavailableError):
        store.acquire(keys("2"), new_token(), 60_000, HOLDER, 60_000)

    wait_for("the replica to be promoted", lambda: group.watcher.master_port() == (
        group.replica.port))  # fmt: skip
    # The connection lost with the old master is not reconnected to its address: a later
    # call (a deferred copy's) asks the sentinel again, once it names a master that is up,
    # and the heartbeat's extend reaches the new master as well.
    wait_for("a grant on the new master", lambda: grant_or_none(store, keys("2")))
    assert address_of(store.client).endswith(f"127.0.0.1:{group.replica.port}")
    assert store.extend_all([lease]) == [True]
    store.release(lease, success=True, done_ttl_ms=60_000)
    with group.replica.client(2) as new_master:
        assert new_master.exists(keys("1").done)
        assert not new_master.exists(keys("1").lock)


def test_the_master_and_the_sentinel_are_each_logged_in_to_with_their_own_password() -> None:
    guarded = Group(password="master-secret", sentinel_password="sentinel-secret")
    stores: list[LockStore] = []
    try:
        stores.append(store := LockStore.from_url(guarded.url()))
        granted(store.acquire(keys("1"), new_token(), 60_000, HOLDER, 60_000))
        # Without the sentinel's password no sentinel names a master: "not now", as when none
        # is reachable.
        unasked = guarded.url().replace("&sentinel_password=sentinel-secret", "")
        stores.append(store := LockStore.from_url(unasked, retry_deadline=0.2))
        with pytest.raises(LockStoreUnavailableError, match="No master found"):
            store.acquire(keys("2"), new_token(), 60_000, HOLDER, 60_000)
        # A wrong password of the master's is refused for good.
        wrong = guarded.url().replace("master-secret", "wrong")
        stores.append(store := LockStore.from_url(wrong))
        with pytest.raises(LockStoreError, match="check the user and password"):
            store.acquire(keys("2"), new_token(), 60_000, HOLDER, 60_000)
    finally:
        for opened in stores:
            opened.close()
        guarded.stop()


def test_min_other_sentinels_trusts_no_sentinel_that_sees_too_few_others(group: Group) -> None:
    """The group's one sentinel sees no other: asked for one more, no answer counts."""
    store = LockStore.from_url(f"{group.url()}&min_other_sentinels=1", retry_deadline=0.2)
    try:
        with pytest.raises(LockStoreUnavailableError, match="No master found"):
            store.acquire(keys("1"), new_token(), 60_000, HOLDER, 60_000)
    finally:
        store.close()


def test_celery_lock_ls_reads_the_store_through_its_sentinel(
    group: Group, store: LockStore
) -> None:
    granted(store.acquire(keys("7"), new_token(), 60_000, HOLDER, 60_000))
    done = celery_lock_cli({}, "--url", group.url(), "ls")
    assert done.returncode == 0, done.stderr
    assert keys("7").lock in done.stdout


@pytest.mark.worker
def test_a_storm_through_a_sentinel_broker_runs_each_request_once(
    group: Group,
    spawn_worker: Callable[..., CeleryWorker],
    make_producer: Callable[..., Celery],
    worker_env: dict[str, str],
) -> None:
    """The worker's broker is the sentinel's master, and its lock store is found from the
    broker's URL and ``broker_transport_options`` (``celery_lock_redis_url`` unset)."""
    options = {"master_name": MASTER_NAME}
    env = {
        **worker_env,
        "STORM_BROKER_URL": f"sentinel://127.0.0.1:{group.watcher.port}/0",  # kombu's form
        "STORM_BACKEND_URL": group.master.url_for(1),
        "STORM_RECORD_URL": group.master.url_for(3),
        "STORM_CONF": json.dumps(
            {"celery_lock_redis_url": None, "broker_transport_options": options}
        ),
    }
    spawn_worker("tests.apps.storm_app", env, concurrency=2)
    producer = make_producer(env["STORM_BROKER_URL"], env["STORM_BACKEND_URL"])
    producer.conf.broker_transport_options = options
    run_storm(producer, env)
    with group.master.client(0) as master:  # the broker's database, where the leases live too
        assert master.keys("celery-lock:*:done:storm.process")
