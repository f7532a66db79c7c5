"""Settings: read from ``app.conf``, overridden per worker by its command-line options and per
task by task options (``lock_ttl=...`` on the decorator), validated into one frozen object.

Precedence, most specific first: task option, worker option (``--lock-ttl``), ``app.conf``
(``celery_lock_ttl``, else ``CELERY_LOCK_TTL``), default.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, fields
from functools import cached_property, lru_cache
from typing import Any, Literal, cast
from urllib.parse import unquote

import redis
from redis import connection

from .exceptions import ConfigurationError
from .sentinel import SentinelURL, is_sentinel_url, split_url
from .store import client_for_url

__all__ = [
    "DUPLICATE_POLICIES",
    "MAX_SECONDS",
    "MIN_SECONDS",
    "LockSettings",
    "check_option_names",
    "check_value",
    "conf_value",
    "validate_redis_url",
]

OnDuplicate = Literal["skip", "retry", "raise"]
DUPLICATE_POLICIES: tuple[OnDuplicate, ...] = ("skip", "retry", "raise")
_REDIS_SCHEMES = ("redis", "rediss", "unix")

#: The longest TTL or interval a setting accepts: ten years, in seconds. A choice: longer than
#: any TTL that means something (a done TTL of ten years is "for ever"), and far inside what the
#: scripts' Lua numbers hold exactly (whole milliseconds up to 2**53, some 285,000 years).
MAX_SECONDS = 10 * 365 * 24 * 3600.0
#: The shortest each duration may be, in seconds. A lease shorter than a tenth of a second
#: lapses within a stall of the pool process; and the heartbeat waits the shortest interval it
#: has seen even while no lease is held, so an interval of microseconds kept a core busy for
#: good. The done TTL is in whole milliseconds.
MIN_SECONDS = {"ttl": 0.1, "heartbeat_interval": 0.01, "done_ttl": 0.001}

# redis-py's own URL parser (what Redis.from_url runs), typed: redis-py leaves it unannotated.
_parse_redis_url: Callable[[str], dict[str, Any]] = connection.parse_url


def validate_redis_url(setting: str, url: str) -> str:
    """Return ``url`` if redis-py can connect with it, else raise :class:`ConfigurationError`.

    The URL is parsed as ``redis.Redis.from_url`` parses it, and one connection object is built
    from it (without connecting), so what passes here does not fail there: ``redis://`` and
    ``redis:///0`` are localhost, and a query argument redis-py cannot read
    (``?socket_timeout=abc``) or cannot use (``?ssl_cert_reqs=CERT_REQUIRED``, ``?protocol=4``)
    is refused here instead of when the first task connects. So is ``?max_connections=1``:
    the lock store keeps one connection for itself and the heartbeat needs another; and so is
    ``?decode_responses=...``, since the store reads bytes. A
    ``sentinel://`` URL is read as :class:`celery_lock.sentinel.SentinelURL` reads it.
    """
    if not isinstance(url, str) or not url:
        raise ConfigurationError(setting, f"expected a redis:// URL, got {url!r}")
    if is_sentinel_url(url):
        try:
            SentinelURL.parse(url)
        except ValueError as exc:
            text = str(exc)
            for part in url.split(";"):  # urllib's message may quote any sentinel's password
                text = passwords_masked(text, part)
            raise ConfigurationError(setting, f"malformed sentinel URL: {text}") from None
    else:
        _check_redis_url(setting, url)
    problem = _connection_problem(url)
    if problem is not None:
        raise ConfigurationError(setting, problem)
    return url


def _check_redis_url(setting: str, url: str) -> None:
    """Refuse a ``redis://``, ``rediss://`` or ``unix://`` URL that redis-py would misread."""
    try:
        split = split_url(url)
        split.port  # noqa: B018 - read to be checked: a port that is not a number raises here
    except ValueError as exc:  # an unclosed "[", a host no IP address, a port not a number
        problem = f"malformed URL: {passwords_masked(str(exc), url)}"
        raise ConfigurationError(setting, problem) from None
    scheme = split.scheme
    if scheme not in _REDIS_SCHEMES:
        raise ConfigurationError(
            setting,
            f"expected a redis://, rediss://, unix:// or sentinel:// URL, got scheme {scheme!r}",
        )
    try:
        options = _parse_redis_url(url)
    except ValueError as exc:  # never the URL itself in the message: it may hold a password
        raise ConfigurationError(setting, f"malformed URL: {exc}") from exc
    if scheme == "unix" and not options.get("path"):
        raise ConfigurationError(setting, "the unix:// URL names no socket path")
    # redis-py takes the path as the database only when it is a number, and ignores any other
    # (while ?db=locks is an error): redis://host/locks would put the leases in database 0.
    database = unquote(split.path).replace("/", "")
    if scheme != "unix" and database and "db" not in options and not database.isdigit():
        raise ConfigurationError(
            setting,
            f"the URL's path {database!r} is not a database number: redis-py would ignore it "
            "and use database 0 (write redis://host:port/2)",
        )


_USERINFO = re.compile(r"^[^:/?#]*://([^/?#]*)@")
# A value ends at "&", "#" or the ";" before the next sentinel's URL: redis-py reads a ";" of
# its own as part of the password.
_PASSWORD_PARAM = re.compile(r"[?&](?:sentinel_)?password=((?:[^&#;]|;(?![a-z][a-z0-9+.-]*://))*)")


def passwords_masked(text: str, url: str) -> str:
    """``text`` (an error about ``url``) with each password ``url`` holds masked, the one of its
    user part and any ``password=`` query argument (redis-py takes both), and a sentinel URL's
    ``sentinel_password=`` (a sentinel broker's ``sentinel_kwargs`` password ends up there):
    urllib quotes the part of a URL it rejects, user and password included."""
    found = [match.group(1) for match in _PASSWORD_PARAM.finditer(url)]
    user = _USERINFO.match(url)
    if user:
        found.append(user.group(1).partition(":")[2])
    for password in filter(None, found):
        text = text.replace(password, "***")
    return text


@lru_cache(maxsize=64)
def _connection_problem(url: str) -> str | None:
    """What redis-py refuses when it builds a connection pool and a connection for ``url``;
    ``None`` if nothing.

    redis-py checks some query arguments only there (``ssl_cert_reqs``, ``protocol``, an
    argument it does not know), when the first command connects. The connection is built and
    dropped without I/O to the server; cached per URL, since building one reads redis-py's
    package metadata (about half a millisecond).
    """
    try:
        pool = client_for_url(url).connection_pool
        pool.make_connection()
    except (redis.RedisError, ValueError, TypeError) as exc:
        # redis-py's message, never the URL itself: it may hold a password.
        text = str(exc)
        hint = ""
        if "ssl_cert_reqs" in text or "Certificate Requirements" in text:
            # CERT_REQUIRED is how Celery's own settings (and error messages) spell it.
            hint = " (redis-py spells ssl_cert_reqs none, optional or required, on rediss:// only)"
        return f"redis-py cannot connect with this URL: {text}{hint}"
    problem = _connection_value_problem(pool.connection_kwargs)
    if problem is not None:
        return problem
    if pool.connection_kwargs.get("decode_responses"):
        # redis-py passes the query's text on as it is, so "False" decodes too. The lock store
        # reads bytes: a hand-on marker is not UTF-8, and decoding it would fail every copy.
        return (
            "decode_responses is not for the lock store, which reads the replies as bytes "
            "(redis-py takes any value given in the URL, False too, as on); leave it out"
        )
    if pool.max_connections < 2:
        return (
            f"max_connections={pool.max_connections} is too few: the lock store keeps one "
            "connection of each process for itself, and the heartbeat needs another (a threads "
            "pool one more per thread); use at least 2, or leave it out"
        )
    return None


def _connection_value_problem(kwargs: Mapping[str, Any]) -> str | None:
    """A value redis-py takes from the URL without a check, which then fails every connection
    (a negative or NaN timeout raises in the socket call) or every command (a negative
    database, a client name with a space: the server's error reply to the handshake)."""
    for name in ("socket_timeout", "socket_connect_timeout"):
        seconds = kwargs.get(name)
        # 0 would make the socket non-blocking: every read would fail at once.
        if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
            return f"{name} must be a positive number of seconds, got {seconds!r}"
    database = kwargs.get("db", 0)
    if isinstance(database, int) and database < 0:
        return f"the database must be 0 or more, got {database}"
    client_name = kwargs.get("client_name")
    # What CLIENT SETNAME accepts: printable ASCII, no space.
    if client_name and not all("!" <= char <= "~" for char in str(client_name)):
        return f"client_name {client_name!r} holds a space or a character Redis refuses"
    return None


def conf_value(conf: Mapping[str, Any], setting: str) -> tuple[Any, str]:
    """The value of ``setting`` in ``conf`` and the name it was found under: the lower-case
    name, else the upper-case one (``CELERY_LOCK_TTL``), as Celery reads its own old names."""
    value = conf.get(setting)
    if value is None:
        return conf.get(setting.upper()), setting.upper()
    return value, setting


def _seconds_of(field: str) -> Callable[[str, Any], float]:
    """The validator of the duration ``field``: seconds, from its minimum to ten years."""
    least = MIN_SECONDS[field]

    def validate(setting: str, value: Any) -> float:
        if isinstance(value, bool):
            raise ConfigurationError(setting, f"expected seconds, got {value!r}")
        seconds = value
        if not isinstance(seconds, (int, float)):
            try:
                seconds = float(seconds)
            except (TypeError, ValueError):
                raise ConfigurationError(setting, f"expected seconds, got {value!r}") from None
        # "not >=", so NaN is refused too. The least value, not "positive", for 0 as well: it
        # says what to write instead (who wants no done-marker at all tries 0 first).
        if not seconds >= least:
            raise ConfigurationError(setting, f"must be at least {least} seconds, got {value!r}")
        if seconds > MAX_SECONDS:
            raise ConfigurationError(
                setting, f"must be at most {MAX_SECONDS:.0f} seconds (ten years), got {value!r}"
            )
        return float(seconds)

    return validate


def _on_duplicate(setting: str, value: Any) -> OnDuplicate:
    if value not in DUPLICATE_POLICIES:
        raise ConfigurationError(
            setting, f"must be one of {', '.join(DUPLICATE_POLICIES)}, got {value!r}"
        )
    return cast(OnDuplicate, value)


def _flag(setting: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(setting, f"must be True or False, got {value!r}")
    return value


#: What a key prefix must not contain, and how an error names it: a brace would change the
#: hash tag Redis Cluster places the keys of a request by.
_REFUSED_IN_PREFIX = {"{": "a brace", "}": "a brace", " ": "a space", "\n": "a newline"}


def _prefix(setting: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigurationError(setting, f"must be a non-empty string, got {value!r}")
    found = list(dict.fromkeys(_REFUSED_IN_PREFIX[c] for c in value if c in _REFUSED_IN_PREFIX))
    if found:
        raise ConfigurationError(
            setting,
            f"must not contain braces, spaces or newlines, got {value!r} ({', '.join(found)})",
        )
    return value


def _url_or_none(setting: str, value: Any) -> str | None:
    return None if value is None else validate_redis_url(setting, value)


@dataclass(frozen=True)
class LockSettings:
    """The validated lock settings that apply to one task in one process."""

    #: Lock store URL; ``None`` means "the broker URL, when the broker is Redis".
    redis_url: str | None = None
    #: Lease time-to-live in seconds; the heartbeat keeps a running task's lease alive.
    ttl: float = 60.0
    #: Seconds between heartbeats; ``None`` means a third of the TTL.
    heartbeat_interval: float | None = None
    #: What a copy does when another copy of the same task holds the request.
    on_duplicate: OnDuplicate = "skip"
    #: How long a completed request is remembered (seconds).
    done_ttl: float = 24 * 3600.0
    #: Prefix of every key celery-lock writes.
    key_prefix: str = "celery-lock"
    #: Run the body unlocked when the lock store is down (default: fail closed).
    fail_open: bool = False
    #: A skipped copy completes as SUCCESS with a marker value instead of SKIPPED (canvas).
    skip_as_success: bool = False

    # Cached: every task reads them, and settings are resolved once per task and process.
    @cached_property
    def ttl_ms(self) -> int:
        """The lease TTL in milliseconds."""
        return max(1, int(self.ttl * 1000))

    @cached_property
    def done_ttl_ms(self) -> int:
        """The done-marker TTL in milliseconds."""
        return max(1, int(self.done_ttl * 1000))

    @cached_property
    def fence_ttl_ms(self) -> int:
        """How long a fence counter outlives its last grant or heartbeat, in milliseconds: the
        lease TTL plus the longer of the lease TTL and the done TTL.

        Strictly longer than the lease: a holder that pauses past its lease stops beating, so
        its lease and a counter as long-lived as the lease would lapse at the same moment, and
        the next grant would start a new counter from its own clock, below the fence the paused
        holder still writes with should that clock be behind the holder's. So a counter
        outlives a lapsed lease by at least one more lease TTL, and by at least the done
        TTL."""
        return self.ttl_ms + max(self.done_ttl_ms, self.ttl_ms)

    @cached_property
    def interval(self) -> float:
        """Seconds between heartbeats."""
        return self.heartbeat_interval or self.ttl / 3

    @cached_property
    def late_after(self) -> float:
        """Seconds after it was asked for past which a grant comes back too late to go
        unconfirmed: its lease, counted from the ask, must outlast the heartbeat's first beat
        (up to an interval after the body began) with room to spare. An interval, or half of
        what a lease has left after one if that is less (an interval above half the TTL)."""
        return min(self.interval, (self.ttl - self.interval) / 2)

    @classmethod
    def resolve(
        cls,
        conf: Mapping[str, Any],
        task_options: Mapping[str, Any] | None = None,
        task_name: str | None = None,
        *,
        check_together: bool = True,
    ) -> LockSettings:
        """Read ``celery_lock_*`` from ``conf``, overlay ``lock_*`` task options, validate.

        A setting missing from ``conf`` is read from its upper-case name (``CELERY_LOCK_TTL``),
        as Celery reads its own settings from their old upper-case names: what a settings
        module of upper-case names, or Django's settings, give ``app.conf``. The lower-case
        name wins when both are set.

        ``check_together=False`` checks each value on its own, and the values together only
        where the task options give both (``lock_ttl`` and ``lock_heartbeat_interval``): for
        task options checked at class creation, before ``app.conf`` is known.

        Raises:
            ConfigurationError: naming the first setting whose value is invalid.
        """
        values: dict[str, Any] = {}
        names: dict[str, str] = {}
        from_task: set[str] = set()
        for field in fields(cls):
            option = f"lock_{field.name}"
            setting = f"celery_{option}"
            value, name = conf_value(conf, setting)
            if task_options and task_options.get(option) is not None:
                value = task_options[option]
                name = f"{task_name}.{option}" if task_name else option
                from_task.add(field.name)
            if value is not None:
                values[field.name] = _VALIDATORS[field.name](name, value)
                names[field.name] = name
        settings = cls(**values)
        if not check_together and not {"ttl", "heartbeat_interval"} <= from_task:
            return settings
        if settings.heartbeat_interval is not None and settings.heartbeat_interval >= settings.ttl:
            # The TTL is named where it comes from elsewhere than the interval: a task's
            # lock_ttl under app.conf's interval, or app.conf's TTL under a task's interval.
            ttl = f"{settings.ttl}s"
            if "ttl" in names and ("ttl" in from_task) != ("heartbeat_interval" in from_task):
                ttl = f"{ttl}, {names['ttl']}"
            raise ConfigurationError(
                names["heartbeat_interval"],
                f"must be shorter than the lease TTL ({ttl}), got {settings.heartbeat_interval}s",
            )
        return settings

    @classmethod
    def setting_names(cls) -> list[str]:
        """The ``app.conf`` names of every setting."""
        return [f"celery_lock_{field.name}" for field in fields(cls)]


_VALIDATORS: dict[str, Callable[[str, Any], Any]] = {
    "redis_url": _url_or_none,
    "ttl": _seconds_of("ttl"),
    "heartbeat_interval": _seconds_of("heartbeat_interval"),
    "on_duplicate": _on_duplicate,
    "done_ttl": _seconds_of("done_ttl"),
    "key_prefix": _prefix,
    "fail_open": _flag,
    "skip_as_success": _flag,
}


#: Options of the peers that a task moved to ``LockedTask`` may still carry, each with what
#: stands for it here (docs/comparison.md): read by nothing, they would be dropped unsaid.
_PEER_OPTIONS = {
    "once": "celery-once's option; lock_key, lock_ttl and lock_on_duplicate stand for its "
    "keys, timeout and graceful",
    "unique_on": "celery-singleton's option; lock_key stands for it",
    "raise_on_duplicate": "celery-singleton's option; lock_on_duplicate='raise' stands for it",
    "lock_expiry": "celery-singleton's option; lock_ttl stands for it (renewed by the heartbeat)",
}


def check_option_names(task_name: str, given: Collection[str], known: Collection[str]) -> None:
    """Refuse a ``lock_*`` option of a task (``@app.task(lock_tll=30)``), or a peer's option
    (``unique_on``), that is not among ``known``, the attributes the task class inherits:
    nothing would read it, and the setting meant would keep its default.

    Raises:
        ConfigurationError: naming ``<task name>.<option>``, with the option meant.
    """
    for option in given:
        if option in known:
            continue
        if option in _PEER_OPTIONS:
            raise ConfigurationError(f"{task_name}.{option}", _PEER_OPTIONS[option])
        if option.startswith("lock_"):
            options = sorted(name for name in known if name.startswith("lock_"))
            meant = difflib.get_close_matches(option, options, n=1)
            hint = f" (did you mean {meant[0]}?)" if meant else ""
            raise ConfigurationError(
                f"{task_name}.{option}", f"no such option of LockedTask, and nothing reads it{hint}"
            )


def check_value(field: str, value: Any, name: str) -> Any:
    """Validate one setting's ``value`` on its own, naming it ``name`` in the error.

    Raises:
        ConfigurationError: the value is invalid for ``field`` (a :class:`LockSettings` field).
    """
    return _VALIDATORS[field](name, value)
