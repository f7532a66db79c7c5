"""Credentials, TLS URLs, and what logs may carry."""

from __future__ import annotations

import logging
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

import pytest
import redis
from celery import Celery
from conftest import wait_for
from redis.connection import SSLConnection
from tls import TlsFiles, start_with_tls

from celery_lock import SKIPPED, LockedTask, LockSettings, LockStoreUnavailableError, checks
from celery_lock.exceptions import ConfigurationError
from celery_lock.keys import RequestKeys
from celery_lock.lease import Acquired, Done, Holder, Lease, encode_lock, new_token
from celery_lock.runtime import lock_store_url, reset_runtime
from celery_lock.store import LockStore, _check_out
from celery_lock.testing import RedisServer, free_port

HOLDER = Holder("task-1", "shop.process", "host", 1)
KEYS = RequestKeys.build("celery-lock", "shop.process", "42", "shop.process")
PASSWORD = "s3cret-pw"


@pytest.fixture(scope="module")
def guarded_server() -> Iterator[RedisServer]:
    """A redis-server that wants a password, with an ACL user limited to our key prefix."""
    with RedisServer(extra_args=["--requirepass", PASSWORD]) as server:
        admin = server.client()
        admin.acl_setuser(
            "locker", enabled=True, passwords=[f"+{PASSWORD}"], keys=["celery-lock:*"],
            commands=["+@read", "+@write", "+@scripting", "+@connection", "-@dangerous"],
        )  # fmt: skip
        # Only what the scripts need: no @connection, so no PING.
        admin.acl_setuser(
            "scripter", enabled=True, passwords=[f"+{PASSWORD}"], keys=["celery-lock:*"],
            commands=["+@read", "+@write", "+@scripting", "-@dangerous"],
        )  # fmt: skip
        admin.close()
        yield server


def full_cycle(store: LockStore) -> None:
    """Acquire, heartbeat, release with done-marker, then see DONE."""
    token = new_token()
    outcome = store.acquire(KEYS, token, 5_000, HOLDER, 60_000)
    assert isinstance(outcome, Acquired)
    lease = Lease(store, KEYS, token, 5_000, outcome.fence, HOLDER)
    assert store.extend_all([lease]) == [True]
    assert store.release(lease, success=True, done_ttl_ms=60_000)
    assert store.acquire(KEYS, new_token(), 5_000, HOLDER, 60_000) == Done("task-1")
    store.client.delete(KEYS.done, KEYS.fence)


def test_password_url_works(guarded_server: RedisServer) -> None:
    store = LockStore.from_url(f"redis://:{PASSWORD}@127.0.0.1:{guarded_server.port}/0")
    try:
        full_cycle(store)
    finally:
        store.client.close()


def test_acl_user_limited_to_the_prefix_runs_every_script(guarded_server: RedisServer) -> None:
    store = LockStore.from_url(f"redis://locker:{PASSWORD}@127.0.0.1:{guarded_server.port}/0")
    try:
        full_cycle(store)
        with pytest.raises(redis.exceptions.NoPermissionError):
            store.client.set("elsewhere", 1)  # the ACL is real: only our prefix is writable
    finally:
        store.client.close()


def idle_checked_store(server: RedisServer, user: str) -> LockStore:
    """A store for ``user`` whose connections are health-checked after one second idle
    (30 s in use), so that a test can outwait the check."""
    store = LockStore.from_url(f"redis://{user}:{PASSWORD}@127.0.0.1:{server.port}/0")
    store.client.connection_pool.connection_kwargs["health_check_interval"] = 1
    return store


def test_user_refused_ping_keeps_working_after_its_connections_idle(
    guarded_server: RedisServer,
) -> None:
    """redis-py PINGs a connection idle for its health-check interval before the next command;
    refused that PING, an extend after a quiet interval (the heartbeat's pooled connection) or
    a release after a long body (the store's own) failed, and the lease was lost or held on."""
    store = idle_checked_store(guarded_server, "scripter")
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            store.client.ping()  # the ACL is real: this user may not PING
        token = new_token()
        outcome = store.acquire(KEYS, token, 5_000, HOLDER, 60_000)
        assert isinstance(outcome, Acquired)
        lease = Lease(store, KEYS, token, 5_000, outcome.fence, HOLDER)
        assert store.extend_all([lease]) == [True]
        time.sleep(1.5)
        assert store.extend_all([lease]) == [True]
        assert store.release(lease, success=True, done_ttl_ms=60_000)
        time.sleep(1.5)
        assert store.acquire(KEYS, new_token(), 5_000, HOLDER, 60_000) == Done("task-1")
    finally:
        store.client.delete(KEYS.done, KEYS.fence)
        store.client.close()


def test_the_cli_works_for_a_user_refused_ping(guarded_server: RedisServer) -> None:
    """``celery lock`` checked the store with PING, and called a store it could not PING
    unreachable (exit status 1)."""
    admin = guarded_server.client()
    holder = Holder("task-1", "shop.process", "host-a", 4242)
    admin.set(KEYS.lock, encode_lock("token", 1, holder, 0), px=60_000)
    url = f"redis://scripter:{PASSWORD}@127.0.0.1:{guarded_server.port}/0"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "celery", "lock", "--url", url, "ls"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        admin.delete(KEYS.lock)
        admin.close()
    assert done.returncode == 0, done.stderr
    assert KEYS.lock in done.stdout


def test_a_store_whose_user_may_not_select_the_database_is_warned_about_at_start(
    guarded_server: RedisServer,
) -> None:
    """Every task fails unrun on a store whose connection is refused; the start-up check took
    the refusal of its CONFIG GET for a managed service's and said nothing. A warning, not a
    refusal: the user may be given the permission while the worker runs (ACL SETUSER)."""
    store = LockStore.from_url(f"redis://scripter:{PASSWORD}@127.0.0.1:{guarded_server.port}/2")
    try:
        [warning] = checks.store_warnings(store)
    finally:
        store.client.close()
    assert warning.startswith(f"lock store 127.0.0.1:{guarded_server.port} refused the connection")
    assert "no permissions to run the 'select' command" in warning


@pytest.mark.parametrize(
    ("userinfo", "db", "refusal", "fix"),
    [(":wrong-pw@", 0, "refused the user or password: invalid username-password pair",
      "put the user and password the server expects in the URL"),
     ("", 0, "refused the user or password: Authentication required",
      "put the user and password the server expects in the URL"),
     (f"default:{PASSWORD}@", 99, "refused the URL's database: DB index is out of range",
      "use a database the server has")],
)  # fmt: skip
def test_a_store_that_refuses_what_its_url_asks_for_stops_the_worker(
    guarded_server: RedisServer, userinfo: str, db: int, refusal: str, fix: str
) -> None:
    """A wrong password (WRONGPASS), none where the server wants one (NOAUTH), a database the
    server does not have: every task failed unrun (LockStoreError) and was acked, the queue
    drained into FAILURE behind one warning at start. Only another URL mends them, as for a
    node of a cluster of several masters: the check refuses them, naming the setting."""
    store = LockStore.from_url(f"redis://{userinfo}127.0.0.1:{guarded_server.port}/{db}")
    try:
        with pytest.raises(ConfigurationError) as refused:
            checks.store_warnings(store, setting="--lock-redis-url")
    finally:
        store.client.close()
    assert refused.value.setting == "--lock-redis-url"
    assert refused.value.problem.startswith(f"lock store 127.0.0.1:{guarded_server.port} {refusal}")
    assert f"every task would fail unrun: {fix}" in refused.value.problem
    assert "wrong-pw" not in str(refused.value)


def test_a_store_that_only_refuses_config_gets_no_warning(guarded_server: RedisServer) -> None:
    store = LockStore.from_url(f"redis://scripter:{PASSWORD}@127.0.0.1:{guarded_server.port}/0")
    try:
        assert checks.store_warnings(store) == []  # CONFIG is refused: the check cannot tell
    finally:
        store.client.close()


def test_user_allowed_ping_keeps_the_health_check(guarded_server: RedisServer) -> None:
    store = idle_checked_store(guarded_server, "locker")
    admin = guarded_server.client()

    def pings() -> int:
        return int(admin.info("commandstats").get("cmdstat_ping", {}).get("calls", 0))

    try:
        token = new_token()
        outcome = store.acquire(KEYS, token, 5_000, HOLDER, 60_000)
        assert isinstance(outcome, Acquired)
        lease = Lease(store, KEYS, token, 5_000, outcome.fence, HOLDER)
        time.sleep(1.5)
        before = pings()
        assert store.release(lease, success=False, done_ttl_ms=60_000)
        assert pings() == before + 1  # the health check ran before the release
    finally:
        store.client.delete(KEYS.fence)
        store.client.close()
        admin.close()


class TlsServer(NamedTuple):
    server: RedisServer
    tls_port: int
    ca_file: str


def start_tls_server(directory: Path) -> TlsServer:
    """A redis-server that also listens with TLS, on a certificate of a CA of its own."""
    files = TlsFiles.issue(directory)
    tls_port = free_port()
    server = start_with_tls(
        lambda executable: RedisServer(
            extra_args=files.server_args(tls_port), executable=executable
        )
    )
    return TlsServer(server, tls_port, files.ca_file)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    tls = start_tls_server(tmp_path_factory.mktemp("tls"))
    yield tls
    tls.server.stop()


def test_a_rediss_broker_lends_the_lock_store_its_broker_use_ssl(tls_server: TlsServer) -> None:
    """The lock store that defaults to a ``rediss://`` broker connects as the broker does: with
    ``broker_use_ssl``'s CA, which no system trusts, it verifies the server; without it, the
    server cannot be verified and every task would be deferred."""
    broker = f"rediss://127.0.0.1:{tls_server.tls_port}/0"
    app = Celery("tls", broker=broker, set_as_current=False)
    app.conf.broker_use_ssl = {
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
        "ssl_ca_certs": tls_server.ca_file,
    }
    url = lock_store_url(app, LockSettings())
    ca = quote(tls_server.ca_file, safe="")
    assert url == f"{broker}?ssl_cert_reqs=required&ssl_ca_certs={ca}"
    store = LockStore.from_url(url, retry_attempts=1)
    try:
        full_cycle(store)
    finally:
        store.client.close()

    app.conf.broker_use_ssl = None  # the system's CAs: this server's certificate is refused
    unverified = LockStore.from_url(lock_store_url(app, LockSettings()), retry_attempts=1)
    try:
        with pytest.raises(LockStoreUnavailableError, match="CERTIFICATE_VERIFY_FAILED"):
            unverified.acquire(KEYS, new_token(), 5_000, HOLDER, 60_000)
    finally:
        unverified.client.close()


@pytest.mark.parametrize(
    ("spelling", "mode"),
    [("CERT_REQUIRED", ssl.CERT_REQUIRED), ("CERT_OPTIONAL", ssl.CERT_OPTIONAL)],
)
def test_a_rediss_broker_url_in_celerys_spelling_gives_the_lock_store(
    tls_server: TlsServer, spelling: str, mode: ssl.VerifyMode
) -> None:
    # Celery's docs and errors spell ssl_cert_reqs CERT_REQUIRED, and kombu reads it so;
    # redis-py only reads required, optional or none.
    ca = quote(tls_server.ca_file, safe="")
    broker = (
        f"rediss://127.0.0.1:{tls_server.tls_port}/0?ssl_cert_reqs={spelling}&ssl_ca_certs={ca}"
    )
    app = Celery("tls", broker=broker, set_as_current=False)
    with app.connection_for_write() as connection:
        assert connection.ssl == {"ssl_cert_reqs": mode, "ssl_ca_certs": tls_server.ca_file}
    store = LockStore.from_url(lock_store_url(app, LockSettings()), retry_attempts=1)
    try:
        full_cycle(store)
        pooled = _check_out(store.client.connection_pool)
        try:
            assert pooled.cert_reqs == mode
        finally:
            store.client.connection_pool.release(pooled)
    finally:
        store.client.close()


def test_a_url_of_its_own_is_not_given_the_brokers_ssl_options() -> None:
    app = Celery("tls", broker="rediss://broker:6380/0", set_as_current=False)
    app.conf.broker_use_ssl = {"ssl_cert_reqs": ssl.CERT_NONE, "ssl_check_hostname": False}
    assert lock_store_url(app, LockSettings()) == (
        "rediss://broker:6380/0?ssl_cert_reqs=none&ssl_check_hostname=false"
    )
    mine = "rediss://locks:6380/0?ssl_cert_reqs=required"
    assert lock_store_url(app, LockSettings(redis_url=mine)) == mine
    app.conf.broker_url = "rediss://broker:6380/0?ssl_cert_reqs=optional"  # the URL's own wins
    assert lock_store_url(app, LockSettings()) == (
        "rediss://broker:6380/0?ssl_cert_reqs=optional&ssl_check_hostname=false"
    )
    # Celery's spelling as text, in broker_use_ssl as in the URL: redis-py's in the store's URL.
    app.conf.broker_url = "rediss://broker:6380/0"
    app.conf.broker_use_ssl = {"ssl_cert_reqs": "CERT_OPTIONAL"}
    assert lock_store_url(app, LockSettings()) == "rediss://broker:6380/0?ssl_cert_reqs=optional"


def test_a_redis_broker_that_broker_use_ssl_puts_on_tls_gives_a_tls_lock_store(
    tls_server: TlsServer,
) -> None:
    """kombu connects a ``redis://`` broker over TLS where ``broker_use_ssl`` is a dict; a lock
    store in plain text would send its password and leases unencrypted (a TLS port refuses it)."""
    app = Celery("tls", broker=f"redis://127.0.0.1:{tls_server.tls_port}/0", set_as_current=False)
    app.conf.broker_use_ssl = {
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
        "ssl_ca_certs": tls_server.ca_file,
    }
    url = lock_store_url(app, LockSettings())
    ca = quote(tls_server.ca_file, safe="")
    assert (
        url
        == f"rediss://127.0.0.1:{tls_server.tls_port}/0?ssl_cert_reqs=required&ssl_ca_certs={ca}"
    )
    store = LockStore.from_url(url, retry_attempts=1)
    try:
        full_cycle(store)
    finally:
        store.client.close()


@pytest.mark.parametrize("use_ssl", [True, {}, None], ids=repr)
def test_a_redis_broker_that_kombu_leaves_in_plain_text_gives_a_plain_lock_store(
    use_ssl: Any,
) -> None:
    # kombu reads broker_use_ssl for a redis:// broker only as a dict of options.
    app = Celery("tls", broker="redis://broker:6379/0", set_as_current=False)
    app.conf.broker_use_ssl = use_ssl
    assert lock_store_url(app, LockSettings()) == "redis://broker:6379/0"


@pytest.mark.parametrize(
    "broker",
    [
        "redis://broker:6379/0?credential_provider=app.Credentials",
        "rediss://broker:6380/0?ssl_cert_reqs=required&credential_provider=app.Credentials",
        "sentinel://a:26379;sentinel://b:26379?credential_provider=app.Credentials",
    ],
)
def test_a_broker_url_with_a_credential_provider_gives_no_lock_store(broker: str) -> None:
    """kombu logs in with the provider's credentials, which change (that is what a provider is
    for) and which no URL can carry: the store must not connect without them."""
    app = Celery("creds", broker=broker, set_as_current=False)
    app.conf.broker_transport_options = {"master_name": "queues"}
    with pytest.raises(ConfigurationError, match="celery_lock_redis_url: not set, and the broker"):
        lock_store_url(app, LockSettings())
    mine = "redis://locker:pw@locks:6379/0"
    assert lock_store_url(app, LockSettings(redis_url=mine)) == mine


def test_rediss_url_is_passed_through_to_redis_py() -> None:
    store = LockStore.from_url("rediss://127.0.0.1:6380/0")  # no connection is made yet
    pool = store.client.connection_pool
    assert pool.connection_class is SSLConnection
    store.client.close()


@pytest.fixture
def tasks(celery_app: Celery) -> Iterator[dict[str, Any]]:
    @celery_app.task(base=LockedTask, lock_key="request_idx", name="sec.process", shared=False)
    def process(request_idx: int, email: str) -> str:
        return "ok"

    yield {"process": process}
    reset_runtime(celery_app)


def test_logs_carry_key_and_task_id_never_arguments(
    tasks: dict[str, Any], celery_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="celery_lock")
    secret = "jane.doe@example.com"
    first = tasks["process"].delay(7, email=secret)
    first.get(timeout=20)
    copy = tasks["process"].delay(7, email=secret)
    wait_for("the copy to be SKIPPED", lambda: copy.state == SKIPPED, 20)
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("celery_lock")]
    assert any(copy.id in message and "celery-lock:{sec.process:7}:lock" in message
               for message in ours)  # fmt: skip
    assert not [message for message in ours if secret in message]
