"""LockSettings: defaults, ``celery_lock_*`` from the app conf, ``lock_*`` task options on top,
and a :class:`ConfigurationError` naming the setting for every invalid value."""

from __future__ import annotations

import inspect
import math
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from celery import Celery
from conftest import cluster_node, granted, wait_for
from redis.crc import key_slot

from celery_lock import (
    ConfigurationError,
    LockedTask,
    LockSettings,
    LockStoreError,
    checks,
    config,
    delivery,
)
from celery_lock.checks import misnamed_settings, settings_warnings
from celery_lock.config import MAX_SECONDS, passwords_masked
from celery_lock.keys import RequestKeys
from celery_lock.lease import Acquired, HandOn, Holder, Lease, encode_done, new_token
from celery_lock.runtime import lock_store_url
from celery_lock.sentinel import split_url
from celery_lock.store import LockStore
from celery_lock.testing import RedisServer

# One valid, non-default value per setting, and the value it resolves to.
VALID = {
    "redis_url": ("redis://cache:6380/2", "redis://cache:6380/2"),
    "ttl": (30, 30.0),
    "heartbeat_interval": (5, 5.0),
    "on_duplicate": ("raise", "raise"),
    "done_ttl": (600, 600.0),
    "key_prefix": ("myapp:locks", "myapp:locks"),
    "fail_open": (True, True),
    "skip_as_success": (True, True),
}
# Another valid value per setting, for the conf a task option overrides.
OTHER = {
    "redis_url": "redis://other:6379/0",
    "ttl": 45,
    "heartbeat_interval": 7,
    "on_duplicate": "retry",
    "done_ttl": 60,
    "key_prefix": "other",
    "fail_open": False,
    "skip_as_success": False,
}

# Invalid values, each with the setting it belongs to.
INVALID = [
    ("ttl", 0),
    ("ttl", -1),
    ("ttl", math.nan),
    ("ttl", math.inf),
    ("ttl", "abc"),
    ("ttl", True),
    ("ttl", [60]),
    ("ttl", 1e100),
    ("ttl", MAX_SECONDS + 1),
    ("heartbeat_interval", 0),
    ("heartbeat_interval", 0.005),  # the heartbeat would wake 200 times a second, held or not
    ("ttl", 0.05),  # a lease that lapses within a stall of the pool process
    ("done_ttl", 0.0001),
    ("heartbeat_interval", -5),
    ("on_duplicate", "maybe"),
    ("on_duplicate", "SKIP"),
    ("done_ttl", -1),
    ("done_ttl", 0),
    ("done_ttl", 1e100),
    ("done_ttl", "1e14"),
    ("key_prefix", "{locks}"),
    ("key_prefix", "locks}"),
    ("key_prefix", ""),
    ("key_prefix", "my locks"),
    ("key_prefix", 5),
    ("fail_open", "yes"),
    ("fail_open", 1),
    ("skip_as_success", "no"),
    ("redis_url", "http://x"),
    ("redis_url", "redis://host:notaport"),
    ("redis_url", "redis://host:99999"),
    ("redis_url", "redis://localhost:6379/0?socket_timeout=abc"),
    ("redis_url", "redis://localhost/0?db=two"),
    ("redis_url", "redis://localhost/two"),
    ("redis_url", "rediss://localhost/0?ssl_cert_reqs=CERT_REQUIRED"),
    ("redis_url", "redis://localhost/0?protocol=4"),
    ("redis_url", "redis://localhost/0?max_connections=1"),
    ("redis_url", "redis://localhost/0?decode_responses=False"),
    # Values redis-py takes unchecked, which then fail every connection or every command.
    ("redis_url", "redis://localhost/0?socket_timeout=-1"),
    ("redis_url", "redis://localhost/0?socket_timeout=nan"),
    ("redis_url", "redis://localhost/0?socket_timeout=0"),
    ("redis_url", "redis://localhost/0?socket_connect_timeout=inf"),
    ("redis_url", "redis://localhost/-1"),
    ("redis_url", "redis://localhost/?db=-1"),
    ("redis_url", "redis://localhost/0?client_name=lock%20store"),
    ("redis_url", "redis://[::1"),  # urllib's ValueError, not a traceback
    ("redis_url", "redis://[zz]/0"),
    ("redis_url", "unix://"),
    ("redis_url", ""),
    ("redis_url", 6379),
]
INVALID_IDS = [f"{name}={value!r}" for name, value in INVALID]


def test_defaults() -> None:
    settings = LockSettings.resolve({})
    assert settings == LockSettings()
    assert settings.redis_url is None
    assert settings.ttl == 60.0
    assert settings.heartbeat_interval is None
    assert settings.interval == 20.0
    assert settings.on_duplicate == "skip"
    assert settings.done_ttl == 24 * 3600.0
    assert settings.key_prefix == "celery-lock"
    assert settings.fail_open is False
    assert settings.skip_as_success is False
    assert (settings.ttl_ms, settings.done_ttl_ms) == (60_000, 86_400_000)


def test_every_setting_has_a_test_value() -> None:
    assert sorted(f"celery_lock_{name}" for name in VALID) == sorted(LockSettings.setting_names())


@pytest.mark.parametrize(("name", "value", "expected"), [(n, *v) for n, v in VALID.items()])
def test_setting_is_read_from_conf(name: str, value: Any, expected: Any) -> None:
    settings = LockSettings.resolve({f"celery_lock_{name}": value})
    assert getattr(settings, name) == expected


def test_settings_are_read_from_a_celery_app_conf() -> None:
    app = Celery("config_tests", broker="memory://", set_as_current=False)
    app.conf.celery_lock_ttl = 30
    app.conf.celery_lock_on_duplicate = "retry"
    settings = LockSettings.resolve(app.conf)
    assert (settings.ttl, settings.on_duplicate) == (30.0, "retry")


@pytest.mark.parametrize(("name", "value", "expected"), [(n, *v) for n, v in VALID.items()])
def test_task_option_overrides_conf(name: str, value: Any, expected: Any) -> None:
    conf = {f"celery_lock_{name}": OTHER[name]}
    assert getattr(LockSettings.resolve(conf), name) != expected
    settings = LockSettings.resolve(conf, {f"lock_{name}": value}, "tasks.t")
    assert getattr(settings, name) == expected


def test_task_option_left_none_falls_back_to_conf() -> None:
    settings = LockSettings.resolve({"celery_lock_ttl": 30}, {"lock_ttl": None}, "tasks.t")
    assert settings.ttl == 30.0


def test_task_option_false_overrides_conf_true() -> None:
    settings = LockSettings.resolve({"celery_lock_fail_open": True}, {"lock_fail_open": False})
    assert settings.fail_open is False


def test_heartbeat_interval_defaults_to_a_third_of_the_ttl() -> None:
    assert LockSettings.resolve({"celery_lock_ttl": 9}).interval == 3.0
    assert LockSettings.resolve({"celery_lock_heartbeat_interval": 2}).interval == 2.0


def test_numeric_strings_are_seconds() -> None:
    assert LockSettings.resolve({"celery_lock_ttl": "12.5"}).ttl == 12.5


@pytest.mark.parametrize(
    "url",
    [
        "redis://h",
        "rediss://:pw@h:6380/1",
        "unix:///tmp/redis.sock",
        "redis://",  # redis-py: localhost
        "redis:///0",
        "redis://h/0?socket_timeout=5",
        "rediss://h/0?ssl_cert_reqs=required",
        "redis://h/0?protocol=3&max_connections=2",
    ],
)
def test_redis_urls_redis_py_accepts_are_valid(url: str) -> None:
    # Checked without I/O: there is no host h.
    assert LockSettings.resolve({"celery_lock_redis_url": url}).redis_url == url
    redis.Redis.from_url(url).close()  # and redis-py does accept it


def test_a_url_redis_py_cannot_read_is_a_configuration_error_not_a_value_error() -> None:
    url = "redis://localhost:6379/0?socket_timeout=abc"
    with pytest.raises(ValueError, match="socket_timeout"):  # what a task would meet unchecked
        redis.Redis.from_url(url)
    with pytest.raises(ConfigurationError, match=r"^celery_lock_redis_url: malformed URL: "):
        LockSettings.resolve({"celery_lock_redis_url": url})


def test_a_url_path_that_is_no_database_number_is_refused(lock_url: str) -> None:
    """redis-py reads a URL's path as its database only when it is a number, and ignores any
    other path: ``redis://host/locks`` was taken, and its leases landed in database 0, the one
    a Redis broker's messages live in by default, while ``?db=locks`` was refused."""
    base = lock_url.rsplit("/", 1)[0]
    client = redis.Redis.from_url(f"{base}/locks")
    client.set("celery-lock:test-path", "1")
    database_0 = redis.Redis.from_url(f"{base}/0")
    assert database_0.getdel("celery-lock:test-path") == b"1"  # it was database 0
    database_0.close()
    client.close()
    with pytest.raises(ConfigurationError) as raised:
        LockSettings.resolve({"celery_lock_redis_url": f"{base}/locks"})
    assert raised.value.setting == "celery_lock_redis_url"
    assert "'locks' is not a database number" in raised.value.problem
    for url in (f"{base}/3", f"{base}/", f"{base}/3?db=4", base):  # what redis-py reads as asked
        assert LockSettings.resolve({"celery_lock_redis_url": url}).redis_url == url


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        # How Celery's own settings spell it, and what its Redis backend's error message asks for.
        (
            "rediss://h/0?ssl_cert_reqs=CERT_REQUIRED",
            "Invalid SSL Certificate Requirements Flag: CERT_REQUIRED (redis-py spells "
            "ssl_cert_reqs none, optional or required, on rediss:// only)",
        ),
        ("redis://h/0?protocol=4", "protocol must be either 2 or 3"),
        (
            "redis://h/0?ssl_cert_reqs=required",
            "unexpected keyword argument 'ssl_cert_reqs' (redis-py spells ssl_cert_reqs none, "
            "optional or required, on rediss:// only)",
        ),
    ],
)
def test_a_url_redis_py_will_not_connect_with_is_refused_up_front(url: str, problem: str) -> None:
    """redis-py reads these URLs, and refuses them only as it builds the first connection: every
    task would fail (a RedisError, not a LockStoreError) or defer for ever (a ConnectionError)."""
    client = redis.Redis.from_url(url)
    with pytest.raises((redis.RedisError, TypeError)):
        client.ping()  # refused as the first command builds its connection
    client.close()
    with pytest.raises(ConfigurationError) as raised:
        LockSettings.resolve({"celery_lock_redis_url": url})
    assert raised.value.setting == "celery_lock_redis_url"
    assert raised.value.problem.startswith("redis-py cannot connect with this URL: ")
    assert problem in raised.value.problem


def test_a_lock_store_pool_of_one_connection_is_refused_saying_why(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    """The store holds one connection of its pool for good: with one in all, the heartbeat's
    extend finds none, and its leases would be lost while their tasks run."""
    url = f"{lock_url}?max_connections=1"
    store = LockStore.from_url(url)
    try:
        # Loaded beforehand: loading them (after NOSCRIPT) would take a second connection too.
        for script in (store.scripts.acquire, store.scripts.extend):
            lock_redis.script_load(script.script)
        keys = RequestKeys.build("celery-lock", "config_tests.t", "7", "config_tests.t")
        holder, token = Holder("id-1", "config_tests.t", "h", 1), new_token()
        fence = granted(store.acquire(keys, token, 60_000, holder, 60_000))
        with pytest.raises(redis.ConnectionError, match="Too many connections"):
            store.extend_all([Lease(store, keys, token, 60_000, fence, holder)])
    finally:
        store.client.close()
    with pytest.raises(ConfigurationError) as raised:
        LockSettings.resolve({"celery_lock_redis_url": url})
    assert raised.value.problem == (
        "max_connections=1 is too few: the lock store keeps one connection of each process for "
        "itself, and the heartbeat needs another (a threads pool one more per thread); use at "
        "least 2, or leave it out"
    )
    assert LockSettings.resolve({"celery_lock_redis_url": f"{lock_url}?max_connections=2"})


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://:secret@[::1/0", "malformed URL: Invalid IPv6 URL"),
        ("redis://:secret@[zz]/0", "malformed URL: 'zz' does not appear to be an IPv4 or IPv6"),
        # Refused by celery_lock itself where urllib does not (before 3.11.4 and 3.10.16).
        ("redis://:secret@[127.0.0.1]/0", "malformed URL: An IPv4 address cannot be in brackets"),
        ("redis://:secret@[v1]/0", "malformed URL: IPvFuture address is invalid"),
        # A FULLWIDTH COMMERCIAL AT: urllib quotes the netloc it refuses, password and all.
        ("redis://:s\uff20cret@localhost/0", "malformed URL: netloc ':***@localhost'"),
        ("sentinel://:s\uff20cret@h:26379?master_name=m", "malformed sentinel URL: netloc ':***@h"),
        ("sentinel://h1:26379;sentinel://:s\uff20cret@h2:26379?master_name=m",
         "malformed sentinel URL: netloc ':***@h2"),
        # A newer urllib quotes the bracketed part of a password: a bracket there is refused
        # first, on every Python.
        ("redis://:top[secret]@h/0", "malformed URL: the URL's user or password holds '['"),
        ("sentinel://:top[secret]@h:26379?master_name=m",
         "malformed sentinel URL: the URL's user or password holds '['"),
    ],
)  # fmt: skip
def test_a_url_urllib_cannot_split_is_refused_without_its_password(url: str, problem: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        LockSettings.resolve({"celery_lock_redis_url": url})
    assert raised.value.problem.startswith(problem)
    assert "cret" not in str(raised.value)


@pytest.mark.parametrize(
    ("url", "refused"),
    [("redis://[zz]/0", "'zz' does not appear to be an IPv4 or IPv6 address"),
     ("redis://h[x]/0", "'x' does not appear to be an IPv4 or IPv6 address"),
     ("redis://[127.0.0.1]/0", "An IPv4 address cannot be in brackets"),
     ("redis://[v1]/0", "IPvFuture address is invalid"),
     ("redis://[::1]:6379/0", None), ("redis://[v1.x]/0", None),
     ("redis://[fe80::1%25eth0]/0", None), ("redis://u:p@ss@[::1]/0", None),
     ("unix:///tmp/r.sock", None)],
)  # fmt: skip
def test_brackets_in_a_url_are_checked_where_urllib_does_not(
    url: str, refused: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python's urllib checks a bracketed host only from 3.11.4 and 3.10.16: before, the worker
    took redis://[zz]/0 for the host zz and failed every connection. celery_lock checks it
    itself, here with urllib's own check taken away, as an older Python has none."""
    monkeypatch.setattr("urllib.parse._check_bracketed_host", lambda host: None, raising=False)
    if refused is None:
        assert split_url(url) == urlsplit(url)
    else:
        with pytest.raises(ValueError, match=re.escape(refused)):
            split_url(url)


@pytest.mark.parametrize("flag", ["True", "False", "0"])
def test_a_lock_store_url_asking_for_decoded_replies_is_refused_saying_why(
    flag: str, lock_url: str
) -> None:
    """redis-py passes the query's text on as it is, so any value decodes; the store reads a
    hand-on marker, which is not UTF-8, and every later copy of that request would fail on it
    with a UnicodeDecodeError instead of being skipped."""
    url = f"{lock_url}?decode_responses={flag}"
    store = LockStore.from_url(url)
    try:
        keys = RequestKeys.build("celery-lock", "config_tests.t", "8", "config_tests.t")
        store.client.set(keys.done, encode_done("id-1", HandOn(0, "id-1")), px=60_000)
        with pytest.raises(UnicodeDecodeError):
            store.acquire(keys, new_token(), 60_000, Holder("id-2", "config_tests.t", "h", 1), 0)
    finally:
        store.client.delete(keys.done)
        store.client.close()
    with pytest.raises(ConfigurationError) as raised:
        LockSettings.resolve({"celery_lock_redis_url": url})
    assert raised.value.problem == (
        "decode_responses is not for the lock store, which reads the replies as bytes (redis-py "
        "takes any value given in the URL, False too, as on); leave it out"
    )


@pytest.mark.parametrize(
    ("prefix", "found"),
    [
        ("my locks", "a space"),
        ("{locks}", "a brace"),
        ("locks\n", "a newline"),
        ("my {locks}", "a space, a brace"),
    ],
)
def test_a_key_prefix_refused_for_what_it_contains_names_it(prefix: str, found: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        LockSettings.resolve({"celery_lock_key_prefix": prefix})
    assert raised.value.problem == (
        f"must not contain braces, spaces or newlines, got {prefix!r} ({found})"
    )


@pytest.mark.parametrize("prefix", ["", 5])
def test_a_key_prefix_that_is_no_string_or_empty_is_named_so(prefix: Any) -> None:
    with pytest.raises(ConfigurationError) as raised:
        LockSettings.resolve({"celery_lock_key_prefix": prefix})
    assert raised.value.problem == f"must be a non-empty string, got {prefix!r}"


@pytest.mark.parametrize("name", ["ttl", "heartbeat_interval", "done_ttl"])
def test_a_duration_above_ten_years_is_refused_naming_the_bound(name: str) -> None:
    setting = f"celery_lock_{name}"
    with pytest.raises(ConfigurationError, match=r"at most 315360000 seconds \(ten years\)"):
        LockSettings.resolve({setting: 1e100}, check_together=False)
    settings = LockSettings.resolve({setting: MAX_SECONDS}, check_together=False)
    assert getattr(settings, name) == MAX_SECONDS


def test_the_longest_durations_are_ones_redis_accepts(lock_url: str) -> None:
    """Settings at the bound go through every script: grant, extend, release, done-marker."""
    settings = LockSettings.resolve(
        {"celery_lock_ttl": MAX_SECONDS, "celery_lock_done_ttl": MAX_SECONDS}
    )
    assert settings.fence_ttl_ms < 10**14
    store = LockStore.from_url(lock_url)
    try:
        keys = RequestKeys.build("celery-lock", "config_tests.t", "7", "config_tests.t")
        holder, token = Holder("id-1", "config_tests.t", "h", 1), new_token()
        outcome = store.acquire(keys, token, settings.ttl_ms, holder, settings.fence_ttl_ms)
        assert isinstance(outcome, Acquired)
        lease = Lease(
            store, keys, token, settings.ttl_ms, outcome.fence, holder, settings.fence_ttl_ms
        )
        assert store.extend_all([lease]) == [True]
        store.release(lease, success=True, done_ttl_ms=settings.done_ttl_ms)
        assert store.client.pttl(keys.done) > settings.done_ttl_ms - 60_000
        assert store.client.pttl(keys.fence) > settings.fence_ttl_ms - 60_000
    finally:
        store.client.close()


@pytest.mark.parametrize(("name", "value"), INVALID, ids=INVALID_IDS)
def test_invalid_conf_value_names_the_setting(name: str, value: Any) -> None:
    setting = f"celery_lock_{name}"
    with pytest.raises(ConfigurationError) as raised:
        LockSettings.resolve({setting: value})
    assert raised.value.setting == setting
    assert str(raised.value).startswith(f"{setting}: ")


@pytest.mark.parametrize(("name", "value"), INVALID, ids=INVALID_IDS)
def test_invalid_task_option_names_the_option(name: str, value: Any) -> None:
    with pytest.raises(ConfigurationError) as raised:
        LockSettings.resolve({}, {f"lock_{name}": value}, "tasks.t")
    assert raised.value.setting == f"tasks.t.lock_{name}"
    assert str(raised.value).startswith(f"tasks.t.lock_{name}: ")


@pytest.mark.parametrize(
    ("name", "value", "least"),
    [("done_ttl", 0, 0.001), ("done_ttl", -1, 0.001), ("ttl", math.nan, 0.1),
     ("heartbeat_interval", 0.005, 0.01)],
)  # fmt: skip
def test_a_duration_below_its_least_value_is_told_that_value(
    name: str, value: float, least: float
) -> None:
    """A user who wants no done-marker tries ``lock_done_ttl=0``: the error says what comes
    closest (the migration guide's one-second marker, or the least the setting takes)."""
    with pytest.raises(ConfigurationError) as raised:
        LockSettings.resolve({}, {f"lock_{name}": value})
    assert str(raised.value) == f"lock_{name}: must be at least {least} seconds, got {value!r}"


@pytest.mark.parametrize(("name", "value"), INVALID[:3], ids=INVALID_IDS[:3])
def test_invalid_task_option_without_task_name_names_the_option(name: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=rf"^lock_{name}: "):
        LockSettings.resolve({}, {f"lock_{name}": value})


def test_invalid_task_option_is_reported_even_when_conf_is_valid() -> None:
    with pytest.raises(ConfigurationError, match=r"^tasks\.t\.lock_ttl: "):
        LockSettings.resolve({"celery_lock_ttl": 30}, {"lock_ttl": -1}, "tasks.t")


@pytest.mark.parametrize("interval", [30, 45])
def test_heartbeat_interval_not_shorter_than_ttl_names_the_setting(interval: int) -> None:
    conf = {"celery_lock_ttl": 30, "celery_lock_heartbeat_interval": interval}
    with pytest.raises(ConfigurationError, match=r"^celery_lock_heartbeat_interval: .*shorter"):
        LockSettings.resolve(conf)


def test_heartbeat_interval_task_option_not_shorter_than_ttl_names_the_option() -> None:
    with pytest.raises(ConfigurationError, match=r"^tasks\.t\.lock_heartbeat_interval: .*shorter"):
        LockSettings.resolve({"celery_lock_ttl": 30}, {"lock_heartbeat_interval": 30}, "tasks.t")


@pytest.mark.parametrize(
    ("conf", "options", "message"),
    [
        (
            {"celery_lock_heartbeat_interval": 10},
            {"lock_ttl": 5},
            "celery_lock_heartbeat_interval: must be shorter than the lease TTL "
            "(5.0s, tasks.t.lock_ttl), got 10.0s",
        ),
        (
            {"celery_lock_ttl": 5},
            {"lock_heartbeat_interval": 10},
            "tasks.t.lock_heartbeat_interval: must be shorter than the lease TTL "
            "(5.0s, celery_lock_ttl), got 10.0s",
        ),
        (
            {},
            {"lock_ttl": 5, "lock_heartbeat_interval": 10},
            "tasks.t.lock_heartbeat_interval: must be shorter than the lease TTL (5.0s), got 10.0s",
        ),
        (
            {},
            {"lock_heartbeat_interval": 90},
            "tasks.t.lock_heartbeat_interval: must be shorter than the lease TTL (60.0s), "
            "got 90.0s",
        ),
    ],
)
def test_a_ttl_from_elsewhere_than_the_interval_is_named_with_it(
    conf: dict[str, Any], options: dict[str, Any], message: str
) -> None:
    # Each setting is valid where it was written: the error says where the other one is.
    with pytest.raises(ConfigurationError) as raised:
        LockSettings.resolve(conf, options, "tasks.t")
    assert str(raised.value) == message


def test_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="celery_lock_ttl"):
        LockSettings.resolve({"celery_lock_ttl": -1})


# -- on a LockedTask ---------------------------------------------------------------------------


@pytest.fixture
def app() -> Celery:
    app = Celery("config_tests", broker="memory://", set_as_current=False)
    app.conf.celery_lock_redis_url = "redis://127.0.0.1:1/0"
    return app


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("lock_ttl", -1),
        ("lock_on_duplicate", "nope"),
        ("lock_done_ttl", "abc"),
        ("lock_key_prefix", "{x}"),
        ("lock_fail_open", "yes"),
        ("lock_redis_url", "http://x"),
    ],
)
def test_invalid_task_option_fails_at_class_creation(app: Celery, option: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=rf"^config_tests\.bad\.{option}: "):
        # shared=False: a shared task would be added to every app finalized later on.
        @app.task(
            base=LockedTask, name="config_tests.bad", shared=False, lazy=False, **{option: value}
        )
        def bad(request_idx: Any) -> None:
            pass


def test_a_task_s_interval_not_shorter_than_its_own_ttl_fails_at_class_creation(
    app: Celery,
) -> None:
    # Both from the decorator: the clash need not wait for the first call, or for the worker
    # to refuse to start for every task of the app.
    with pytest.raises(
        ConfigurationError,
        match=r"^config_tests\.clash\.lock_heartbeat_interval: must be shorter than the lease "
        r"TTL \(10\.0s\), got 100\.0s",
    ):

        @app.task(
            base=LockedTask,
            name="config_tests.clash",
            shared=False,
            lazy=False,
            lock_ttl=10,
            lock_heartbeat_interval=100,
        )
        def clash(request_idx: Any) -> None:
            pass


def test_valid_task_options_are_applied(app: Celery) -> None:
    @app.task(
        base=LockedTask,
        name="config_tests.good",
        shared=False,
        lazy=False,
        lock_ttl=10,
        lock_on_duplicate="retry",
    )
    def good(request_idx: Any) -> None:
        pass

    app.conf.celery_lock_ttl = 99
    app.conf.celery_lock_done_ttl = 7
    settings = good.lock_settings()
    assert (settings.ttl, settings.on_duplicate, settings.done_ttl) == (10.0, "retry", 7.0)


def test_task_heartbeat_interval_is_checked_against_the_conf_ttl(app: Celery) -> None:
    app.conf.celery_lock_ttl = 600

    @app.task(
        base=LockedTask,
        name="config_tests.long",
        shared=False,
        lazy=False,
        lock_heartbeat_interval=120,
    )
    def long(request_idx: Any) -> None:
        pass

    assert long.lock_settings().interval == 120.0


@pytest.mark.parametrize(
    ("broker", "visibility"),
    [
        ("redis://h:6379/0", 3600),
        ("rediss://h:6379/0", 3600),
        ("redis+socket:///run/redis.sock", 3600),
        ("sentinel://h:26379;sentinel://h2:26379", 3600),
        (["redis://h:6379/0", "redis://h2:6379/0"], 3600),  # failover brokers, as a list
        ("sqs://", 1800),
        ("SQS://", 1800),
        ("slmq://", 1800),
        ("pgmq://", 1800),
    ],
)
def test_a_done_ttl_below_kombus_visibility_timeout_is_warned(
    broker: str | list[str], visibility: int
) -> None:
    app = Celery("config_tests", broker=broker, set_as_current=False)
    below = LockSettings(done_ttl=visibility - 1)
    [warning] = settings_warnings(app, "t", below)
    assert f"visibility timeout ({visibility}s)" in warning
    assert settings_warnings(app, "t", LockSettings(done_ttl=visibility)) == []
    app.conf.broker_transport_options = {"visibility_timeout": 7200}
    assert "(7200s)" in settings_warnings(app, "t", LockSettings(done_ttl=visibility))[0]


@pytest.mark.parametrize(
    ("ttl", "interval", "warned"),
    [(10, 4, True), (10, 3.4, True), (10, 10 / 3, False), (0.7, None, False), (60, 20, False)],
)
def test_fewer_than_three_heartbeats_per_ttl_are_warned(
    ttl: float, interval: float | None, warned: bool
) -> None:
    """DESIGN.md: warn when the TTL is below three heartbeats; the default interval, a third of
    the TTL (rounded as a float), passes."""
    app = Celery("config_tests", broker="memory://", set_as_current=False)
    found = settings_warnings(app, "t", LockSettings(ttl=ttl, heartbeat_interval=interval))
    assert bool(found) is warned, found
    if warned:
        assert found == [
            f"t: heartbeat interval ({interval:g}s) is above a third of the lease TTL ({ttl:g}s): "
            "after one missed beat, the next has less than an interval's margin before the "
            "lease lapses while the task runs"
        ]


@pytest.mark.parametrize("broker", ["amqp://guest@h//", "memory://", "filesystem://"])
def test_no_visibility_warning_where_the_broker_has_no_visibility_timeout(broker: str) -> None:
    app = Celery("config_tests", broker=broker, set_as_current=False)
    assert settings_warnings(app, "t", LockSettings(done_ttl=1)) == []


@pytest.mark.parametrize(
    ("broker", "read_from", "uncounted"),
    [("redis://h:6379/0", None, True), ("REDISS://h:6380/0", None, True),
     ("redis+socket:///tmp/r", None, True), ("sentinel://s1:26379;sentinel://s2:26379", None, True),
     (["redis://a:6379/0", "redis://b:6379/0"], None, True), ("amqp://guest@h//", None, False),
     ("pyamqp://guest@h//", None, False), ("amqps://guest@h//", None, False),
     ("memory://", None, False), ("filesystem://", None, False),
     ("redis://h:6379/0", "amqp://guest@h//", False), ("amqp://guest@h//", "redis://h/0", True)],
)  # fmt: skip
def test_only_redis_brokers_take_a_message_back_without_counting_a_delivery(
    broker: Any, read_from: str | None, uncounted: bool
) -> None:
    """A soft time limit in the acquire hands the message back: by Reject with requeue where
    the broker counts nothing (Redis, which may be the very store that hangs), else as a
    republished deferral, which a quorum queue's delivery limit does not count against it. The
    broker is the one the worker consumes from, broker_read_url where it is set."""
    app = Celery("config_tests", broker=broker, set_as_current=False)
    app.conf.broker_read_url = read_from
    assert delivery.returns_uncounted(app) is uncounted


@pytest.mark.parametrize(
    "broker",
    [
        ["redis://a:6379/0", "redis://b:6379/0"],
        ("redis://a:6379/0",),
        "redis://a:6379/0;redis://b:6379/0",
        ["redis://a:6379/0;redis://b:6379/0", "redis://c:6379/0"],
    ],
    ids=repr,
)
def test_the_lock_store_is_the_first_of_failover_redis_brokers(broker: Any) -> None:
    """``broker_url`` as a list, or as a ``;``-separated string: Celery connects to the first
    first, and so does the lock store, where no ``celery_lock_redis_url`` is set."""
    app = Celery("config_tests", broker=broker, set_as_current=False)
    assert lock_store_url(app, LockSettings()) == "redis://a:6379/0"
    assert lock_store_url(app, LockSettings(redis_url="redis://l/0")) == "redis://l/0"


def test_the_lock_store_follows_a_redis_broker_on_a_unix_socket(tmp_path: Path) -> None:
    """Celery writes a Redis broker on a unix socket ``redis+socket://``, its database as
    ``virtual_host``; redis-py, ``unix://`` and ``db``."""
    socket = tmp_path / "redis.sock"
    broker = f"redis+socket://{socket}?virtual_host=2"
    app = Celery("config_tests", broker=broker, set_as_current=False)
    url = lock_store_url(app, LockSettings())
    assert url == f"unix://{socket}?db=2"
    keys = RequestKeys.build("celery-lock", "t", "1", "t")
    with RedisServer(extra_args=["--unixsocket", str(socket), "--unixsocketperm", "700"]):
        store = LockStore.from_url(url)
        database_2 = redis.Redis(unix_socket_path=str(socket), db=2)
        try:
            outcome = store.acquire(keys, new_token(), 5_000, Holder("a", "t", "h", 1), 60_000)
            assert isinstance(outcome, Acquired)
            assert database_2.exists(keys.lock)
        finally:
            store.client.close()
            database_2.close()


@pytest.mark.parametrize("broker", [["amqp://guest@h//", "redis://b:6379/0"], [], "memory://"])
def test_failover_brokers_that_start_with_no_redis_give_no_lock_store(broker: Any) -> None:
    app = Celery("config_tests", broker=broker, set_as_current=False)
    with pytest.raises(ConfigurationError, match="not set, and the broker is not Redis"):
        lock_store_url(app, LockSettings())


def test_an_unreachable_lock_store_is_warned_about() -> None:
    store = LockStore.from_url("redis://127.0.0.1:1/0")
    try:
        [warning] = checks.store_warnings(store)
    finally:
        store.client.close()
    assert warning.startswith("lock store 127.0.0.1:1 not reachable: Error ")
    assert warning.endswith(
        "; tasks will be deferred (or run unlocked under fail_open) until it is"
    )


def test_a_lock_store_that_times_out_is_warned_about() -> None:
    """A server that takes the connection and never answers (hung, or behind a firewall that
    drops its replies) may answer later: a warning, as for one unreachable."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nothing reads
        port = silent.getsockname()[1]
        store = LockStore.from_url(f"redis://127.0.0.1:{port}/0?socket_timeout=0.3")
        try:
            [warning] = checks.store_warnings(store)
        finally:
            store.client.close()
    assert warning.startswith(f"lock store 127.0.0.1:{port} not reachable: Timeout ")
    assert warning.endswith("until it is")


def test_a_lock_store_url_at_a_port_that_does_not_speak_redis_stops_the_worker(
    not_redis: str,
) -> None:
    """RabbitMQ's port (5672) answers a Redis client with its protocol header: every task
    failed unrun (a protocol error, a LockStoreError) and was acked. The check refuses the URL,
    saying what it most likely is."""
    store = LockStore.from_url(f"redis://{not_redis}/0")
    try:
        with pytest.raises(ConfigurationError) as refused:
            checks.store_warnings(store, setting="celery_lock_redis_url")
    finally:
        store.client.close()
    assert str(refused.value).startswith(
        f"celery_lock_redis_url: lock store {not_redis} does not speak Redis (Protocol error"
    )
    assert "): wrong host or port? Every task would fail unrun" in refused.value.problem


@pytest.mark.parametrize(
    ("error", "refused"),
    [(redis.AuthenticationError("WRONGPASS invalid username-password pair"), True),
     (redis.InvalidResponse('Protocol error, got "H" as reply type byte'), True),
     (redis.ResponseError("DB index is out of range"), True),
     (redis.ResponseError("SELECT is not allowed in cluster mode"), True),
     (redis.exceptions.NoPermissionError("no permissions to run the 'select' command"), False),
     (redis.ConnectionError("Error 111 connecting to h:6379. Connection refused."), False),
     (redis.TimeoutError("Timeout reading from socket"), False),
     (redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"), False),
     # A script running past busy-reply-threshold: SELECT (db != 0) is refused for now.
     (redis.ResponseError("BUSY Redis is busy running a script. You can only call SCRIPT "
                          "KILL or SHUTDOWN NOSAVE."), False),
     (redis.ResponseError("DENIED Redis is running in protected mode because protected mode "
                          "is enabled and no password is set for the default user."), False)],
)  # fmt: skip
def test_only_errors_another_url_mends_refuse_the_lock_store(
    error: redis.RedisError, refused: bool
) -> None:
    """The worker refuses to start for these; a store unreachable, timing out or loading may
    come back, and a user's permissions may change, while it runs (tasks wait or fail)."""
    assert (checks.url_mistake(error) is not None) is refused


@pytest.mark.parametrize(
    ("url_from", "source"),
    [("conf", "celery_lock_redis_url"), ("upper-case conf", "CELERY_LOCK_REDIS_URL"),
     ("worker option", "--lock-redis-url"),
     ("broker", "broker_url, standing in for celery_lock_redis_url")],
)  # fmt: skip
def test_the_start_up_line_names_the_lock_store_its_source_prefix_and_ttl(
    url_from: str, source: str
) -> None:
    """Workers on different stores (or prefixes) run one request twice: the line each logs at
    start tells them apart. A task with a store of its own gets a line of its own; one with
    another prefix or TTL is named on its store's line."""
    url = "redis://user:pw-in-url@locks.example:6380/2"
    app = Celery(
        "config_tests", broker=url if url_from == "broker" else "memory://", set_as_current=False
    )
    if url_from == "upper-case conf":
        app.conf.CELERY_LOCK_REDIS_URL = url
    elif url_from != "broker":
        app.conf.celery_lock_redis_url = url
    app.conf.celery_lock_ttl = 30
    app.conf.celery_lock_key_prefix = "shop"
    flags = {"celery_lock_redis_url": "--lock-redis-url"} if url_from == "worker option" else {}

    @app.task(base=LockedTask, name="config_tests.plain", lock_key="n", shared=False)
    def plain(n: int) -> None:
        pass

    @app.task(base=LockedTask, name="config_tests.longer", lock_key="n", shared=False,
              lock_ttl=120, lock_key_prefix="other")  # fmt: skip
    def longer(n: int) -> None:
        pass

    @app.task(base=LockedTask, name="config_tests.elsewhere", lock_key="n", shared=False,
              lock_redis_url="redis://elsewhere:6379/0")  # fmt: skip
    def elsewhere(n: int) -> None:
        pass

    # Shared tasks other tests declared are this app's too: they may add to the lines.
    lines = checks.store_lines(app, flags)
    masked = "redis://user:***@locks.example:6380/2"
    [app_line] = [line for line in lines if masked in line]
    assert app_line.startswith(
        f"lock store {masked} (from {source}), key prefix 'shop', lease TTL 30s; "
    )
    assert "; config_tests.longer: key prefix 'other', lease TTL 120s" in app_line
    assert "config_tests.plain" not in app_line  # the app's settings: not named
    assert (
        "lock store redis://elsewhere:6379/0 (from config_tests.elsewhere.lock_redis_url), key "
        "prefix 'shop', lease TTL 30s"
    ) in lines
    assert "pw-in-url" not in "\n".join(lines)


def test_the_start_up_line_masks_a_sentinel_password() -> None:
    """A sentinel URL's sentinel_password, and a sentinel broker's sentinel_kwargs password
    (which the lock store URL carries as sentinel_password), are masked as the master's is."""
    app = Celery(
        "config_tests",
        broker="sentinel://:master-pw@s1:26379/3;sentinel://s2:26379",
        set_as_current=False,
    )
    app.conf.broker_transport_options = {
        "master_name": "m",
        "sentinel_kwargs": {"password": "sentinel-pw"},
    }
    shown = "\n".join(checks.store_lines(app))
    assert "sentinel_password=***" in shown
    assert "sentinel-pw" not in shown
    assert "master-pw" not in shown
    app.conf.celery_lock_redis_url = "sentinel://s1:26379/2?sentinel_password=own-pw&master_name=m"
    shown = "\n".join(checks.store_lines(app))
    assert "own-pw" not in shown


def test_a_password_holding_a_semicolon_is_masked_whole() -> None:
    """redis-py reads a ";" in a password's query argument as part of it: only the ";" before
    a sentinel's next URL ends one."""
    app = Celery("config_tests", set_as_current=False)
    app.conf.celery_lock_redis_url = "redis://h:6379/0?password=top;secret"
    shown = "\n".join(checks.store_lines(app))
    assert "password=***" in shown
    assert "top" not in shown
    assert "secret" not in shown
    sentinels = "sentinel://s1:26379?sentinel_password=pw;sentinel://s2:26379"
    assert passwords_masked(sentinels, sentinels) == (
        "sentinel://s1:26379?sentinel_password=***;sentinel://s2:26379"
    )


@pytest.mark.parametrize(
    ("policy", "warned"), [("volatile-lru", True), ("allkeys-random", True), ("noeviction", False)]
)
def test_a_store_that_refuses_config_get_is_checked_for_eviction_by_info(
    policy: str, warned: bool
) -> None:
    """Managed services (ElastiCache, whose default policy is volatile-lru; Memorystore)
    disable CONFIG but answer INFO: the start-up check must not go silent there, since every
    key celery-lock writes has a TTL and any policy but noeviction can evict it."""
    disabled = ["--rename-command", "CONFIG", '""']
    with RedisServer(
        extra_args=["--maxmemory", "50mb", "--maxmemory-policy", policy, *disabled]
    ) as server:
        store = LockStore.from_url(server.url)
        try:
            with pytest.raises(redis.ResponseError, match="unknown command"):
                store.client.config_get("maxmemory*")
            found = checks.store_warnings(store)
        finally:
            store.client.close()
    if warned:
        [warning] = found
        assert f"may evict keys (maxmemory-policy {policy})" in warning
    else:
        assert found == []


def test_a_lock_store_that_is_a_replica_is_warned_about() -> None:
    """A lock store URL that leads to a replica (a reader endpoint, a node demoted before the
    worker started) refuses every grant with READONLY: each new request is deferred for as long
    as the worker runs, and each try logs "no longer a primary", as after a failover."""
    with RedisServer() as primary, RedisServer() as replica:
        with replica.client() as admin:
            admin.replicaof("127.0.0.1", primary.port)
        store = LockStore.from_url(replica.url)
        try:
            [warning] = checks.store_warnings(store)
        finally:
            store.client.close()
    assert warning.startswith(f"lock store 127.0.0.1:{replica.port} is a replica of ")
    assert f":{primary.port}" in warning


@pytest.mark.parametrize(
    ("url_from", "setting"),
    [("conf", "celery_lock_redis_url"), ("upper-case conf", "CELERY_LOCK_REDIS_URL"),
     ("task option", "config_tests.on_cluster.lock_redis_url"), ("broker", "broker_url"),
     ("conf and task option", "celery_lock_redis_url / config_tests.on_cluster.lock_redis_url")],
)  # fmt: skip
def test_a_lock_store_on_a_node_of_a_cluster_of_several_masters_stops_the_worker(
    redis_cluster: Callable[[int], list[RedisServer]], url_from: str, setting: str
) -> None:
    """The lock store client is a plain redis.Redis on one node: every key of a slot another
    master serves is answered MOVED, and its task fails unrun. The check at worker start
    (warn_at_startup) refuses such a URL rather than warn (no state of the store the worker
    could wait for makes it right), naming where the URL came from: it named
    celery_lock_redis_url also for a task's own lock_redis_url, or the broker's URL, which
    stands in while celery_lock_redis_url is unset."""
    node, *_ = redis_cluster(2)
    app = Celery(
        "config_tests",
        broker=node.url if url_from == "broker" else "memory://",
        set_as_current=False,
    )
    if url_from.startswith("conf"):
        app.conf.celery_lock_redis_url = node.url
    elif url_from == "upper-case conf":
        app.conf.CELERY_LOCK_REDIS_URL = node.url
    elif url_from == "task option":
        # Another store for the app's other tasks: the shared tasks other tests declared are
        # this app's too, and a task with no store at all would end the check before it.
        app.conf.celery_lock_redis_url = "redis://127.0.0.1:1/0"
    options = {"lock_redis_url": node.url} if url_from.endswith("task option") else {}

    @app.task(base=LockedTask, name="config_tests.on_cluster", lock_key="n", shared=False,
              **options)  # fmt: skip
    def on_cluster(n: int) -> None:
        pass

    store = LockStore.from_url(node.url)
    try:
        with pytest.raises(ConfigurationError) as refused:
            checks.warn_at_startup(app, {node.url: store})
    finally:
        store.close()
    assert refused.value.setting == setting
    assert refused.value.problem.startswith(
        f"lock store 127.0.0.1:{node.port} is a node of a Redis Cluster of 2 masters"
    )
    assert "a single endpoint (a plain Redis server, or a cluster of one master)" in str(
        refused.value
    )
    # The broker stays where it is: the lock store needs a URL of its own.
    assert ("Set celery_lock_redis_url" in refused.value.problem) == (url_from == "broker")


def test_warnings_found_before_a_refused_lock_store_are_still_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker that a lock store refuses stops at once; the warnings found before (a misnamed
    setting here) were gathered to be logged after every store, and so were never logged: the
    operator mended the URL only to meet them at the next start."""
    app = Celery("config_tests", broker="memory://", set_as_current=False)
    app.conf.lock_ttl = 30  # misnamed: celery_lock_ttl
    with RedisServer(extra_args=["--requirepass", "right-pw"]) as guarded:
        url = f"redis://:wrong-pw@127.0.0.1:{guarded.port}/0"
        app.conf.celery_lock_redis_url = url
        store = LockStore.from_url(url)
        try:
            with caplog.at_level("WARNING", "celery_lock"), pytest.raises(ConfigurationError):
                checks.warn_at_startup(app, {url: store})
        finally:
            store.close()
    assert "app.conf has lock_ttl but no celery_lock_ttl" in caplog.text


def test_a_cluster_of_one_master_is_a_lock_store_like_a_plain_server(
    redis_cluster: Callable[[int], list[RedisServer]],
) -> None:
    """A cluster of one master serves every slot: every request's keys are on the node the URL
    names, so it passes the start-up check and grants every request."""
    [node] = redis_cluster(1)
    store = LockStore.from_url(node.url)
    try:
        assert checks.store_warnings(store) == []
        for request in range(20):  # requests in slots all over the range
            keys = RequestKeys.build("celery-lock", "t", str(request), "t")
            outcome = store.acquire(keys, new_token(), 5_000, Holder("a", "t", "h", 1), 60_000)
            assert isinstance(outcome, Acquired)
    finally:
        store.close()


def test_a_cluster_of_one_master_is_followed_through_a_failover(
    redis_cluster: Callable[[int], list[RedisServer]],
) -> None:
    """After a failover, the node the URL names is a replica, which answers MOVED (never
    READONLY): taken for a refusal for good, every task failed unrun, its message acked, and
    every held lease counted as lost, though it lived on at the new master."""
    [master] = redis_cluster(1)
    replica = cluster_node()
    store = LockStore.from_url(master.url)
    try:
        with master.client() as first, replica.client() as second:
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", replica.port)
            master_id = first.execute_command("CLUSTER", "MYID").decode()

            def replicating() -> bool:
                try:
                    second.execute_command("CLUSTER", "REPLICATE", master_id)
                except redis.ResponseError:  # the replica has not heard of the master yet
                    return False
                return True

            wait_for("the replica to know its master", replicating)
            wait_for(
                "the replica to be in sync",
                lambda: second.info("replication").get("master_link_status") == "up",
            )
            holder = Holder("a", "t", "h", 1)
            held_keys = RequestKeys.build("celery-lock", "t", "held", "t")
            token = new_token()
            fence = granted(store.acquire(held_keys, token, 60_000, holder, 120_000))
            lease = Lease(store, held_keys, token, 60_000, fence, holder)
            assert first.execute_command("WAIT", 1, 10_000) == 1  # the lease is on the replica
            wait_for(
                "the replica to find the cluster ok",
                lambda: b"cluster_state:ok" in second.execute_command("CLUSTER", "INFO"),
            )
            second.execute_command("CLUSTER", "FAILOVER")
            wait_for(
                "the failover",
                lambda: (
                    first.info("replication")["role"] == "slave"
                    and second.info("replication")["role"] == "master"
                ),
            )
            fresh = RequestKeys.build("celery-lock", "t", "fresh", "t")
            assert isinstance(store.acquire(fresh, new_token(), 5_000, holder, 60_000), Acquired)
            assert store.extend_all([lease]) == [True]
            assert store.release(lease, success=True, done_ttl_ms=60_000)
            assert second.get(held_keys.done) == b"a"
            demoted = LockStore.from_url(master.url)
            try:
                [warning] = checks.store_warnings(demoted)
            finally:
                demoted.close()
            assert "is a replica of" in warning
            assert "in a Redis Cluster" in warning
            # A connection the new master cuts is no reason to leave it.
            second.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            again = RequestKeys.build("celery-lock", "t", "again", "t")
            assert isinstance(store.acquire(again, new_token(), 5_000, holder, 60_000), Acquired)
            assert store.client.connection_pool.connection_kwargs["port"] == replica.port
            # The new master hangs, and the URL's node takes over: the store, which had
            # followed the redirect, goes back to the URL's address (it was pinned to the hung
            # one, every task deferred until the worker restarted).
            replica.pause()
            first.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
            wait_for("the takeover", lambda: first.info("replication")["role"] == "master")
            back = RequestKeys.build("celery-lock", "t", "back", "t")
            assert isinstance(store.acquire(back, new_token(), 5_000, holder, 60_000), Acquired)
    finally:
        store.close()
        replica.resume()
        replica.stop()


def test_the_cluster_check_is_skipped_where_an_acl_refuses_cluster_info(
    redis_cluster: Callable[[int], list[RedisServer]],
) -> None:
    """A user the store's ACL denies CLUSTER (a managed service's, or one kept to what the
    scripts need) cannot tell: the worker starts, as for any check it cannot make."""
    node, *_ = redis_cluster(2)
    with node.client() as admin:
        admin.acl_setuser("locks", enabled=True, passwords=["+pw"], keys=["*"],
                          commands=["+@all", "-cluster"])  # fmt: skip
    url = f"redis://locks:pw@127.0.0.1:{node.port}/0"
    store = LockStore.from_url(url)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            store.client.execute_command("CLUSTER", "INFO")
        assert checks.store_warnings(store) == []
        # Nor does the store follow a redirect there: with leases on two masters, it would go
        # back and forth, and the heartbeat's pipeline would never get through.
        keys = next(  # a request in a slot of the other master's half
            keys
            for keys in (RequestKeys.build("celery-lock", "t", str(i), "t") for i in range(99))
            if key_slot(keys.lock.encode()) >= 8192
        )
        with pytest.raises(LockStoreError, match="MOVED"):
            store.acquire(keys, new_token(), 5_000, Holder("a", "t", "h", 1), 60_000)
    finally:
        store.close()


def test_a_key_on_another_master_fails_naming_moved_and_the_setting(
    redis_cluster: Callable[[int], list[RedisServer]],
) -> None:
    """A worker that was not checked at start (its store became a node of a bigger cluster
    since): the error its task fails with says MOVED (which redis-py 8 strips from the
    message) and what to change, not only "error reply: 6341 127.0.0.1:40001"."""
    node, other = redis_cluster(2)
    store = LockStore.from_url(node.url)
    try:
        # A request in a slot of the other master's half.
        keys = next(
            keys
            for keys in (RequestKeys.build("celery-lock", "t", str(i), "t") for i in range(99))
            if key_slot(keys.lock.encode()) >= 8192
        )
        with pytest.raises(LockStoreError) as refused:
            store.acquire(keys, new_token(), 5_000, Holder("a", "t", "h", 1), 60_000)
    finally:
        store.close()
    assert type(refused.value) is LockStoreError  # fails, not deferred: retrying cannot help
    assert re.search(rf"MOVED \d+ 127\.0\.0\.1:{other.port}", str(refused.value))
    assert "Redis Cluster" in str(refused.value)
    assert "celery_lock_redis_url, or the task's lock_redis_url" in str(refused.value)


@pytest.mark.parametrize("module", [config, checks], ids=lambda m: m.__name__)
def test_api_page_calls_list_the_real_parameters(module: Any) -> None:
    """docs/api.md writes ``warn_at_startup(app, stores)``, not ``warn_at_startup(app)``."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    functions = [n for n in module.__all__ if inspect.isfunction(getattr(module, n))]
    checked = 0
    for name in functions:
        real = list(inspect.signature(getattr(module, name)).parameters)
        for documented in re.findall(rf"`{name}\(([^)]*)\)`", page):
            given = [p.strip() for p in documented.split(",") if p.strip()]  # f() has none
            assert given == real, f"api.md: {name}"
            checked += 1
    assert checked  # the page does show calls of this module's functions


def test_a_setting_without_its_celery_prefix_is_named_with_the_one_to_write() -> None:
    found = misnamed_settings({"lock_ttl": 30, "lock_fail_open": True, "celery_lock_fail_open": 1})
    assert found == [
        "app.conf has lock_ttl but no celery_lock_ttl, and nothing reads lock_ttl: write "
        "celery_lock_ttl or CELERY_LOCK_TTL (in Django settings loaded with namespace='CELERY', "
        "write CELERY_CELERY_LOCK_TTL or CELERY_LOCK_TTL)"
    ]
    assert misnamed_settings({"celery_lock_ttl": 30, "broker_url": "memory://"}) == []
    assert misnamed_settings({"lock_ttl": 30, "CELERY_LOCK_TTL": 30}) == []


# -- upper-case names, as Celery reads its own old settings -----------------------------------


class UpperCaseSettings:
    """A settings module of upper-case names, as Celery 3 apps and Django projects have."""

    BROKER_URL = "memory://"
    CELERY_TASK_SERIALIZER = "json"
    CELERY_LOCK_TTL = 30
    CELERY_LOCK_REDIS_URL = "redis://locks:6379/2"
    CELERY_LOCK_ON_DUPLICATE = "retry"


def _app_from(obj: object, **options: Any) -> Celery:
    app = Celery("config_tests", set_as_current=False)
    app.config_from_object(obj, **options)
    return app


@pytest.mark.parametrize(("name", "value", "expected"), [(n, *v) for n, v in VALID.items()])
def test_setting_is_read_from_its_upper_case_name(name: str, value: Any, expected: Any) -> None:
    settings = LockSettings.resolve({f"CELERY_LOCK_{name.upper()}": value})
    assert getattr(settings, name) == expected


def test_upper_case_settings_from_config_from_object_are_read() -> None:
    app = _app_from(UpperCaseSettings)
    assert app.conf.task_serializer == "json"  # Celery reads its own from the old names
    settings = LockSettings.resolve(app.conf)
    assert (settings.ttl, settings.redis_url, settings.on_duplicate) == (
        30.0,
        "redis://locks:6379/2",
        "retry",
    )
    assert misnamed_settings(app.conf) == []


def test_django_settings_with_the_celery_namespace_are_read() -> None:
    """``config_from_object("django.conf:settings", namespace="CELERY")``: Django keeps only
    upper-case names, and the namespace shows ``CELERY_LOCK_TTL`` as ``lock_ttl``."""

    class DjangoSettings:
        CELERY_BROKER_URL = "memory://"
        CELERY_LOCK_TTL = 30
        CELERY_CELERY_LOCK_DONE_TTL = 600  # celery_lock_done_ttl, with the namespace

    app = _app_from(DjangoSettings, namespace="CELERY")
    settings = LockSettings.resolve(app.conf)
    assert (settings.ttl, settings.done_ttl) == (30.0, 600.0)
    assert misnamed_settings(app.conf) == []


def test_the_lower_case_name_wins_over_the_upper_case_one() -> None:
    app = _app_from(UpperCaseSettings)
    app.conf.celery_lock_ttl = 45
    assert LockSettings.resolve(app.conf).ttl == 45.0
    assert LockSettings.resolve({"CELERY_LOCK_TTL": 30}, {"lock_ttl": 5}).ttl == 5.0


def test_invalid_upper_case_setting_is_named_as_written() -> None:
    with pytest.raises(ConfigurationError, match=r"^CELERY_LOCK_TTL: must be at least 0.1 seconds"):
        LockSettings.resolve(_app_from(type("Bad", (), {"CELERY_LOCK_TTL": -1})).conf)
    conf = {"CELERY_LOCK_TTL": 30, "CELERY_LOCK_HEARTBEAT_INTERVAL": 30}
    with pytest.raises(ConfigurationError, match=r"^CELERY_LOCK_HEARTBEAT_INTERVAL: .*shorter"):
        LockSettings.resolve(conf)


def test_reset_runtime_is_public() -> None:
    """docs/testing.md imports it: ``from celery_lock.runtime import *`` gives it too."""
    namespace: dict[str, Any] = {}
    exec("from celery_lock.runtime import *", namespace)
    assert callable(namespace["reset_runtime"])


@pytest.mark.parametrize(
    ("option", "value"),
    [("acks_late", False), ("reject_on_worker_lost", False), ("retry_on_worker_lost", True)],
)
def test_a_task_that_changes_a_delivery_default_is_warned_at_worker_start(
    celery_app: Celery, option: str, value: bool
) -> None:
    """A killed holder's message must come back (late ack, rejected on worker loss, not turned
    into a Celery retry): a task that changes that is warned about; one that keeps LockedTask's
    defaults is not."""

    @celery_app.task(base=LockedTask, bind=True, name="t.early", **{option: value})
    def early(self: Any, x: int) -> int:
        return x

    @celery_app.task(base=LockedTask, bind=True, name="t.late")
    def late(self: Any, x: int) -> int:
        return x

    found = [w for w in checks.warn_at_startup(celery_app, {}) if " contradicts LockedTask" in w]
    assert len(found) == 1, found
    assert found[0].startswith(f"t.early: {option}={value} contradicts LockedTask's delivery")
