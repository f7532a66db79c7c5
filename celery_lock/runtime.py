"""What celery-lock keeps per app and per process: lock stores, the heartbeat, settings.

One :class:`Runtime` per app per process, created on first use and created again in a forked
child (its pid no longer matches), so no Redis connection or heartbeat thread crosses a fork.
It lives on the app object itself: no module-global client.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode

from celery import Celery

from .config import LockSettings, validate_redis_url
from .exceptions import ConfigurationError
from .heartbeat import Heartbeat
from .sentinel import is_sentinel_url
from .store import LockStore

__all__ = ["Runtime", "get_runtime", "lock_store_url", "reset_runtime"]

_ATTRIBUTE = "_celery_lock_runtime"
_create_guard = threading.Lock()


def first_broker_url(app: Celery) -> str:
    """The broker URL Celery connects to first, as kombu reads ``broker_url``: the first of a
    list (failover brokers), and of that the part before a ``;`` (the string form of the list);
    ``""`` when there is none."""
    broker: Any = app.conf.broker_url or ""
    if isinstance(broker, (list, tuple)):
        broker = broker[0] if broker else ""
    return broker.split(";", 1)[0] if isinstance(broker, str) else ""


def lock_store_url(app: Celery, settings: LockSettings) -> str:
    """The lock store URL: ``celery_lock_redis_url``, else the broker URL when it is Redis
    (the first URL, where ``broker_url`` lists failover brokers; a ``rediss://`` one, or a
    ``redis://`` one that ``broker_use_ssl`` puts on TLS, with the options of
    ``broker_use_ssl``; every sentinel of a ``sentinel://`` one, with the ``master_name`` of
    ``broker_transport_options``).

    Raises:
        ConfigurationError: where the broker is not Redis, or its URL gives what the lock store
            cannot follow (a ``credential_provider``).
    """
    if settings.redis_url:
        return settings.redis_url
    sentinels = _broker_sentinels(app)
    if sentinels is not None:
        return validate_redis_url("broker_url", _with_broker_master(app, sentinels))
    broker = _without_kombus_own_arguments(first_broker_url(app), _KOMBU_URL_ARGUMENTS)
    scheme = broker.split("://", 1)[0]
    if scheme == "redis" and _broker_tls_options(app):
        # kombu puts a redis:// broker on TLS when broker_use_ssl gives it options: the lock
        # store on the same server must not send its password and leases in plain text.
        broker, scheme = "rediss" + broker.removeprefix("redis"), "rediss"
    if scheme == "redis+socket":
        return validate_redis_url("broker_url", _socket_broker_as_redis_url(broker))
    if scheme == "rediss":
        return validate_redis_url("broker_url", _with_broker_ssl(app, broker))
    if scheme in ("redis", "unix"):
        return validate_redis_url("broker_url", broker)
    raise ConfigurationError(
        "celery_lock_redis_url",
        "not set, and the broker is not Redis: set it to the lock store's redis:// URL",
    )


#: What kombu reads from any broker URL's query for its own connection, none of which redis-py
#: takes (it refuses an argument it does not know). The connect timeout is kombu's Connection's
#: (its Redis transport takes socket_connect_timeout from the transport options instead): the
#: lock store reads it as redis-py's socket_connect_timeout, the nearest it has.
_KOMBU_URL_ARGUMENTS: Mapping[str, str | None] = {
    "connect_timeout": "socket_connect_timeout",
    "heartbeat": None,
    "insist": None,
    "login_method": None,
}

#: The same for a sentinel broker URL, which has no place for a socket option (SentinelURL
#: refuses one): its connect timeout is dropped, and the store's own applies.
_KOMBU_SENTINEL_URL_ARGUMENTS: Mapping[str, str | None] = {
    **_KOMBU_URL_ARGUMENTS,
    "connect_timeout": None,
}

#: kombu (5.6 and later) builds a redis-py CredentialProvider from this argument, a dotted class
#: path. A URL can only carry a fixed user and password, and a provider exists to change them
#: (rotating tokens): the lock store cannot follow it, and must not connect without it.
_CREDENTIAL_PROVIDER = "credential_provider"


#: A URL query as ``(name, value)`` pairs, in order.
_Query = list[tuple[str, str]]


def _with_query(url: str, rewrite: Callable[[_Query], _Query]) -> str:
    """``url`` with its query's ``(name, value)`` pairs rewritten; ``url`` itself, untouched,
    where ``rewrite`` changes nothing (so a URL redis-py took before is passed on as it was)."""
    base, _, _ = url.partition("?")
    pairs = _query_of(url)
    rewritten = rewrite(pairs)
    if rewritten == pairs:
        return url
    return f"{base}?{urlencode(rewritten)}" if rewritten else base


def _query_of(url: str) -> _Query:
    """The ``(name, value)`` pairs of one URL's query."""
    return parse_qsl(url.partition("?")[2], keep_blank_values=True)


def _with_each_query(urls: str, rewrite: Callable[[_Query], _Query]) -> str:
    """``urls``, ``;``-separated (a list of sentinels), with each one's query rewritten on its
    own: split at its first ``?``, the whole list would lose every later URL into the query of
    the one that has it."""
    return ";".join(_with_query(url, rewrite) for url in urls.split(";"))


def _without_kombus_own_arguments(broker: str, kombus_own: Mapping[str, str | None]) -> str:
    """A broker URL (or ``;``-separated list) with the query arguments kombu reads for itself
    (``?heartbeat=10``) taken off, or given as redis-py names them, as ``kombus_own`` maps
    them, so that a URL the broker's connection takes gives a lock store URL redis-py takes.

    Raises:
        ConfigurationError: where it names a ``credential_provider``.
    """

    def rewrite(pairs: _Query) -> _Query:
        given = {name for name, _ in pairs}
        if _CREDENTIAL_PROVIDER in given:
            raise ConfigurationError(
                "celery_lock_redis_url",
                "not set, and the broker URL names a credential_provider, which the lock store "
                "cannot take from it: set it to the lock store's URL, with its user and password",
            )
        kept: _Query = []
        for name, value in pairs:
            if name not in kombus_own:
                kept.append((name, value))
                continue
            redis_name = kombus_own[name]
            if redis_name is not None and redis_name not in given:
                kept.append((redis_name, value))
        return kept

    return _with_each_query(broker, rewrite)


# kombu reads a broker URL's ssl_cert_reqs in Celery's spelling too; redis-py only in its own.
_CERT_REQS_SPELLED_BY_REDIS_PY = {
    "CERT_REQUIRED": "required",
    "CERT_OPTIONAL": "optional",
    "CERT_NONE": "none",
}


def _with_broker_ssl(app: Celery, broker: str) -> str:
    """A ``rediss://`` broker URL as redis-py reads it, with what kombu reads into it: its
    ``ssl_cert_reqs`` in redis-py's spelling (``CERT_REQUIRED`` is ``required``), and the
    options of ``broker_use_ssl`` (a dict) that it does not give itself added to its query, so
    that the lock store on the broker's server connects as kombu does, trusting the same CA
    (``ssl_ca_certs``) and showing the same client certificate."""

    def rewrite(pairs: _Query) -> _Query:
        query = [(name, _query_value(value, name)) for name, value in pairs]
        given = {name for name, _ in query}
        query += [
            (name, _query_value(value, name))
            for name, value in _broker_tls_options(app).items()
            if name not in given and value is not None
        ]
        return query

    return _with_query(broker, rewrite)


def _broker_tls_options(app: Celery) -> Mapping[str, Any]:
    """The options of ``broker_use_ssl`` where kombu reads them: a dict, not ``True``; empty
    where there are none (kombu then leaves a ``redis://`` broker without TLS)."""
    options = app.conf.broker_use_ssl
    return options if isinstance(options, Mapping) else {}


def _query_value(value: Any, name: str) -> str:
    """The value of option ``name`` as redis-py reads it from a URL's query; ``ssl_cert_reqs``
    spelled as Celery spells it (``CERT_REQUIRED``) as redis-py does."""
    if name.endswith("ssl_cert_reqs") and isinstance(value, str):
        return _CERT_REQS_SPELLED_BY_REDIS_PY.get(value, value)
    if isinstance(value, ssl.VerifyMode):
        return {ssl.CERT_NONE: "none", ssl.CERT_OPTIONAL: "optional"}.get(value, "required")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):  # an IntEnum too (ssl.TLSVersion): its number
        return str(int(value))
    return str(value)


def _broker_sentinels(app: Celery) -> str | None:
    """The broker URL when it lists sentinels (``sentinel://a;sentinel://b``, or a list of
    such URLs): all of them, ``;``-separated, as kombu asks each in turn; else ``None``."""
    broker: Any = app.conf.broker_url or ""
    if isinstance(broker, (list, tuple)):
        broker = ";".join(str(url) for url in broker)
    if not isinstance(broker, str) or not is_sentinel_url(broker):
        return None
    return _without_kombus_own_arguments(broker, _KOMBU_SENTINEL_URL_ARGUMENTS)


def _with_broker_master(app: Celery, sentinels: str) -> str:
    """A sentinel broker URL with what kombu reads from ``broker_transport_options`` to find
    the master: ``master_name``, ``min_other_sentinels``, and the ``username``, ``password`` and
    TLS options of ``sentinel_kwargs`` (as ``sentinel_username``, ``sentinel_password``,
    ``sentinel_ssl`` and ``sentinel_ssl_*``); and ``broker_use_ssl``, which kombu gives the
    master's connections, as ``ssl=true`` and its ``ssl_*`` options."""
    options = app.conf.broker_transport_options or {}
    if not options.get("master_name"):
        raise ConfigurationError(
            "broker_transport_options",
            "the broker is Redis Sentinel, and no master_name says which master to use",
        )
    sentinel_kwargs = dict(options.get("sentinel_kwargs") or {})
    others = sorted(
        name
        for name in sentinel_kwargs
        if name not in ("username", "password") and not name.startswith(("socket_", "ssl"))
    )
    if others:
        raise ConfigurationError(
            "celery_lock_redis_url",
            f"not set, and the broker's sentinel_kwargs give {', '.join(others)}, which the lock "
            "store does not read (only username, password and ssl options): set it to the lock "
            "store's URL",
        )
    wanted: dict[str, Any] = {
        "master_name": options.get("master_name"),
        "sentinel_username": sentinel_kwargs.get("username"),
        "sentinel_password": sentinel_kwargs.get("password"),
        "min_other_sentinels": options.get("min_other_sentinels"),
    }
    wanted.update(
        (f"sentinel_{name}", value)
        for name, value in sentinel_kwargs.items()
        if name.startswith("ssl")
    )
    # kombu gives a sentinel broker's master broker_use_ssl only as a dict of options, and
    # connects without TLS where it is True: the lock store does the same.
    master_tls = app.conf.broker_use_ssl
    if isinstance(master_tls, Mapping):
        wanted.update(ssl=True, **master_tls)
    # SentinelURL reads the query of every sentinel as one: what any of them gives is given.
    given = {name for url in sentinels.split(";") for name, _ in _query_of(url)}
    added = [
        (name, _query_value(value, name))
        for name, value in wanted.items()
        if value is not None and name not in given
    ]
    *others, last = sentinels.split(";")
    return ";".join([*others, _with_query(last, lambda pairs: pairs + added)])


def _socket_broker_as_redis_url(broker: str) -> str:
    """Celery's URL of a Redis broker on a unix socket, ``redis+socket:///path?virtual_host=N``,
    as redis-py writes it: ``unix:///path?db=N``."""

    def rewrite(pairs: _Query) -> _Query:
        return [
            ("db", value.lstrip("/")) if name == "virtual_host" else (name, value)
            for name, value in pairs
        ]

    return _with_query("unix" + broker.removeprefix("redis+socket"), rewrite)


class Runtime:
    """Per-app, per-process state: one store per lock store URL and one heartbeat."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.pid = os.getpid()
        self.hostname = socket.gethostname()
        self.heartbeat = Heartbeat()
        self._stores: dict[str, LockStore] = {}
        self._settings: dict[str, LockSettings] = {}
        self._broker_store_url: str | None = None
        self._guard = threading.Lock()

    def store(self, url: str) -> LockStore:
        """The store for ``url``, created (and its scripts registered) on first use."""
        store = self._stores.get(url)
        if store is None:
            with self._guard:
                store = self._stores.get(url)
                if store is None:
                    store = self._stores[url] = LockStore.from_url(url)
        return store

    def store_for(self, settings: LockSettings) -> LockStore:
        """The store of ``settings``: :func:`lock_store_url`, with the broker's URL parsed once
        per process instead of once per task."""
        url = settings.redis_url
        if not url:
            url = self._broker_store_url
            if url is None:
                url = self._broker_store_url = lock_store_url(self.app, settings)
        return self.store(url)

    def settings(
        self, task_name: str, task_options: Callable[[], Mapping[str, Any]]
    ) -> LockSettings:
        """The settings of one task, resolved once per process (the first time, from
        ``app.conf`` and what ``task_options()`` returns)."""
        settings = self._settings.get(task_name)
        if settings is None:
            settings = LockSettings.resolve(self.app.conf, task_options(), task_name)
            self._settings[task_name] = settings
        return settings

    def close(self) -> None:
        """Stop the heartbeat and disconnect every store."""
        self.heartbeat.stop()
        for store in self._stores.values():
            store.close()
        self._stores.clear()


def get_runtime(app: Celery) -> Runtime:
    """The runtime of ``app`` in this process, created on first use (and anew after fork)."""
    runtime: Runtime | None = app.__dict__.get(_ATTRIBUTE)
    if runtime is None or runtime.pid != os.getpid():
        with _create_guard:
            runtime = app.__dict__.get(_ATTRIBUTE)
            if runtime is None or runtime.pid != os.getpid():
                runtime = Runtime(app)
                setattr(app, _ATTRIBUTE, runtime)
    return runtime


def reset_runtime(app: Celery) -> None:
    """Forget the runtime of ``app`` (settings are read again on next use); for tests."""
    runtime: Runtime | None = app.__dict__.pop(_ATTRIBUTE, None)
    if runtime is not None and runtime.pid == os.getpid():
        runtime.close()
