"""Start-up checks: settings that contradict the guarantees get a warning at worker start.

* a done-marker that lives shorter than the broker's visibility timeout: a message redelivered
  after the marker expired would run its request again;
* a task that changes a delivery default ``LockedTask`` sets (``acks_late=False``,
  ``reject_on_worker_lost=False``, ``retry_on_worker_lost=True``): a killed holder's message
  would not come back as itself, and its request might never run;
* a task whose request class is not derived from ``LockedRequest``: its skips send no
  ``task-skipped``, and its deferred copies take the task's serializer;
* a heartbeat interval above a third of the lease TTL (fewer than three beats per TTL): after
  one missed beat, the next has less than an interval's margin before the lease lapses;
* a lock store that may evict keys (``maxmemory`` with a policy other than ``noeviction``):
  an evicted lease lets a second copy in while the first still runs;
* a lock store that is a replica (a reader endpoint): it refuses every grant (``READONLY``),
  and tasks are deferred until it is promoted;
* a lock store that is a node of a Redis Cluster of several masters is refused, not warned
  about (:class:`~celery_lock.exceptions.ConfigurationError`): its client talks to that node
  alone, which answers ``MOVED`` for the keys of the other masters' slots, so their tasks fail.
  Unlike the states warned about here, which the store may leave while the worker runs
  (promoted, reachable again, its ACL or policy changed), only another URL makes it right;
* so is a lock store URL the server refuses as it stands (:func:`url_mistake`): a wrong user
  or password, a database the server does not have, or a port that does not speak Redis (a
  protocol error). Every task would fail unrun, and its message be acked;
* a lock store that cannot be reached (or times out, or refuses the connection for a
  ``SELECT`` the user may not send): until it can, tasks are deferred (or fail); a warning,
  since it may come up later, or its user be given the permission;
* a lock store URL whose ``?max_connections=`` is below the task bodies a process runs at once
  (threads, gevent and eventlet pools) plus the heartbeat;
* a lock store whose user may not use the keys under a task's key prefix (a Redis ACL that keeps
  it to other keys): every acquire would be refused;
* a worker whose threads gevent or eventlet patched (``-P gevent``, ``-P eventlet``): the
  heartbeat is then a greenlet, which a body that does not yield to the hub holds back;
* a ``beat_schedule`` entry that sends a ``LockedTask`` at an interval no longer than its done
  TTL: an entry's ticks all carry the same arguments, so they are one request, and every tick
  after the first run would be skipped as done;
* a setting that lost its ``celery_`` prefix (``lock_ttl`` in ``app.conf``), or is misspelled
  (``celery_lock_redis``), which nothing reads. (Django's
  ``config_from_object("django.conf:settings", namespace="CELERY")`` shows a
  ``CELERY_LOCK_TTL`` setting as ``lock_ttl`` too, but it is read, as ``CELERY_LOCK_TTL``: see
  :meth:`celery_lock.LockSettings.resolve`.)

Each check reads settings, plus, on each lock store, one connection, one ``CONFIG GET`` (where
the server refuses it, as managed services often do, ``INFO memory`` instead; the eviction check
is skipped where both are refused), one ``CLUSTER INFO`` (the cluster check is skipped where it
is refused), one ``INFO replication`` and one ``EXISTS`` per key prefix.

Before the warnings, one line at INFO per lock store in use says which it is (its URL with any
password masked, and where the URL came from), with its key prefix and lease TTL
(:func:`store_lines`): workers that run the same tasks on different stores or prefixes run one
request twice, and their logs tell them apart.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import redis
from celery import Celery
from celery.schedules import schedule as celery_schedule
from kombu.utils.imports import symbol_by_name
from redis.connection import parse_url

from .config import LockSettings, conf_value, passwords_masked
from .delivery import visibility_timeout
from .exceptions import ConfigurationError
from .heartbeat import green_pool
from .keys import RequestKeys
from .request import LockedRequest
from .runtime import lock_store_url
from .store import (
    REFUSED_ERRORS,
    TRANSIENT_ERRORS,
    LockStore,
    address_of,
    cluster_masters,
    connect,
    is_transient_reply,
    reply_code,
)

__all__ = [
    "beat_warnings",
    "bodies_per_process",
    "check_single_endpoint",
    "connection_warnings",
    "delivery_warnings",
    "green_heartbeat_warnings",
    "misnamed_settings",
    "request_class_warnings",
    "scope_warnings",
    "settings_warnings",
    "store_lines",
    "store_prefixes",
    "store_warnings",
    "unknown_settings",
    "url_mistake",
    "warn_at_startup",
]

logger = logging.getLogger(__name__)


def settings_warnings(app: Celery, name: str, settings: LockSettings) -> list[str]:
    """What in ``settings`` (of task ``name``) contradicts the guarantees."""
    found = []
    visibility = visibility_timeout(app)
    if visibility is not None and settings.done_ttl < visibility:
        found.append(
            f"{name}: done TTL ({settings.done_ttl:g}s) is shorter than the broker's visibility "
            f"timeout ({visibility:g}s): a late redelivery would run a finished request again"
        )
    # The default interval, a third of the TTL, passes (give or take its rounding).
    if settings.interval * 3 > settings.ttl * (1 + 1e-9):
        found.append(
            f"{name}: heartbeat interval ({settings.interval:g}s) is above a third of the lease "
            f"TTL ({settings.ttl:g}s): after one missed beat, the next has less than an "
            "interval's margin before the lease lapses while the task runs"
        )
    return found


#: The delivery options LockedTask sets, and what a task that changes one loses.
_DELIVERY_COSTS: dict[str, str] = {
    "acks_late": "its message is acked before the body runs, so a holder killed mid-run takes "
    "its request with it",
    "reject_on_worker_lost": "a killed holder's message is not brought back, so its request "
    "never runs",
    "retry_on_worker_lost": "a killed holder's message becomes a Celery retry, counted against "
    "max_retries",
}


def beat_warnings(app: Celery) -> list[str]:
    """Which ``beat_schedule`` entries send a ``LockedTask`` at an interval no longer than its
    done TTL. Beat sends an entry's fixed arguments at every tick, so the ticks are one
    request: once a run succeeds, every tick is skipped as done until the marker expires.
    Entries on a ``crontab`` or ``solar`` schedule, and tasks keyed by a function (which may
    read the clock), are not checked."""
    from .task import LockedTask  # noqa: PLC0415 - task imports worker, which imports this

    found = []
    for entry_name, entry in (app.conf.beat_schedule or {}).items():
        task = app.tasks.get(entry.get("task"))
        if not isinstance(task, LockedTask) or callable(task.lock_key):
            continue
        every = _interval(entry.get("schedule"))
        done_ttl = task.lock_settings().done_ttl
        if every is not None and done_ttl >= every:
            found.append(
                f"beat entry {entry_name!r} sends {task.name} the same arguments every "
                f"{every:g}s, within its done TTL ({done_ttl:g}s): its ticks are one request, "
                "and each tick after the first run is skipped as done. Set lock_done_ttl below "
                "the period for runs that must not overlap, or key the task by the period "
                "(docs/concepts.md, Periodic tasks)"
            )
    return found


def _interval(schedule: Any) -> float | None:
    """The seconds between a beat entry's ticks, for an interval schedule (a number, a
    ``timedelta``, a ``celery.schedules.schedule``); ``None`` for any other."""
    if isinstance(schedule, (int, float)) and not isinstance(schedule, bool):
        return float(schedule)
    if isinstance(schedule, timedelta):
        return schedule.total_seconds()
    if type(schedule) is celery_schedule:  # exactly: a subclass may tick otherwise
        return float(schedule.run_every.total_seconds())  # type: ignore[attr-defined]
    return None


def delivery_warnings(task: Any) -> list[str]:
    """Which delivery defaults of :class:`~celery_lock.LockedTask` ``task`` changes (a task
    option, a subclass or ``task_annotations``)."""
    from .task import LockedTask  # noqa: PLC0415 - task imports worker, which imports this

    found = []
    for option, cost in _DELIVERY_COSTS.items():
        default = bool(getattr(LockedTask, option))
        if bool(getattr(task, option, default)) != default:
            found.append(
                f"{task.name}: {option}={not default} contradicts LockedTask's delivery "
                f"default: {cost}"
            )
    return found


def request_class_warnings(task: Any) -> list[str]:
    """Whether ``task``'s request class (its ``Request``) is not derived from
    :class:`~celery_lock.request.LockedRequest`, which sends ``task-skipped`` from the worker's
    main process and carries the message's content type to the pool process."""
    request_class = task.Request
    if isinstance(request_class, str):
        request_class = symbol_by_name(request_class)
    if isinstance(request_class, type) and issubclass(request_class, LockedRequest):
        return []
    name = getattr(request_class, "__qualname__", request_class)
    return [
        f"{task.name}: its request class {name} is not derived from "
        "celery_lock.request.LockedRequest: a skipped copy sends no task-skipped event (Flower "
        "shows it as SKIPPED without one), and a deferred copy is published with the task's "
        "serializer, not its message's"
    ]


def green_heartbeat_warnings() -> list[str]:
    """Whether gevent or eventlet has patched ``threading`` in this process (``celery worker
    -P gevent`` or ``-P eventlet`` patches it first thing), making the heartbeat a greenlet."""
    green = green_pool()
    if green is None:
        return []
    return [
        f"under {green} the heartbeat is a greenlet, not a thread: a body that holds the hub "
        "(CPU-bound work, a C driver that cannot yield) for a whole lease TTL loses its lease "
        "unnoticed, and another copy may run beside it; keep lock_ttl above the longest such "
        "stretch, and call self.check_lock() before writes that must not be done twice"
    ]


def misnamed_settings(conf: Mapping[str, Any]) -> list[str]:
    """Keys of ``conf`` that are celery-lock settings without their ``celery_`` prefix, set
    where neither the setting nor its upper-case name (which is read instead) is."""
    found = []
    for setting in LockSettings.setting_names():
        stripped, upper = setting.removeprefix("celery_"), setting.upper()
        if conf.get(stripped) is not None and conf_value(conf, setting)[0] is None:
            found.append(
                f"app.conf has {stripped} but no {setting}, and nothing reads {stripped}: write "
                f"{setting} or {upper} (in Django settings loaded with namespace='CELERY', "
                f"write CELERY_{upper} or {upper})"
            )
    return found


def unknown_settings(conf: Mapping[str, Any]) -> list[str]:
    """Keys of ``conf`` named like celery-lock settings (``celery_lock_*``, ``CELERY_LOCK_*``)
    that are none of them, such as ``celery_lock_redis`` for ``celery_lock_redis_url``: nothing
    reads them, and the setting meant keeps its default."""
    known = LockSettings.setting_names()
    found = []
    for key in list(conf.keys()):
        name = str(key).lower()
        # Django settings loaded with namespace="CELERY" keep their prefix in the keys, and
        # CELERY_CELERY_LOCK_TTL is read as celery_lock_ttl (settings.md).
        namespaced = name.startswith("celery_celery_lock_")
        name = name.removeprefix("celery_") if namespaced else name
        if name.startswith("celery_lock_") and name not in known:
            meant = difflib.get_close_matches(name, known, n=1)
            # Spelled as the key was: Django settings keep only upper-case names.
            upper = str(key).isupper()
            spelled = [
                f"CELERY_{m.upper()}" if namespaced else m.upper() if upper else m for m in meant
            ]
            hint = f" (did you mean {spelled[0]}?)" if spelled else ""
            found.append(
                f"app.conf has {key}, which is no celery-lock setting, and nothing reads it{hint}"
            )
    return found


def store_warnings(
    store: LockStore, prefixes: Iterable[str] = (), setting: str = "celery_lock_redis_url"
) -> list[str]:
    """Whether the lock store cannot be reached, may evict leases, is a replica, or shuts its
    user out of the keys under one of ``prefixes``; empty if it cannot tell.

    Raises:
        ConfigurationError: naming ``setting`` (where the store's URL came from): the store
            refuses the connection the URL asks for in a way only another URL mends (see
            :func:`url_mistake`), or is a node of a Redis Cluster of several masters (see
            :func:`check_single_endpoint`).
    """
    address = address_of(store.client)
    try:
        connect(store.client)
    except redis.RedisError as exc:
        mistake = url_mistake(exc)
        if mistake is not None:
            raise ConfigurationError(setting, f"lock store {address} {mistake}") from exc
        if isinstance(exc, TRANSIENT_ERRORS) or (
            isinstance(exc, redis.ResponseError) and is_transient_reply(exc)
        ):  # BUSY (a long script) refuses the URL's SELECT for now, as tasks would
            return [
                f"lock store {address} not reachable: {_text(exc)}; tasks will be deferred (or "
                "run unlocked under fail_open) until it is"
            ]
        # NOPERM for the URL's SELECT: the user's permissions may change while the worker
        # runs, as they may for its keys (see _key_permission_warnings).
        return [
            f"lock store {address} refused the connection: {_text(exc)}; tasks will fail until "
            "the user's permissions, or the lock store URL, are fixed"
        ]
    try:
        config: dict[Any, Any] = store.client.config_get("maxmemory*")
    except REFUSED_ERRORS as exc:  # a password asked for at the first command, not connecting
        raise ConfigurationError(setting, f"lock store {address} {url_mistake(exc)}") from exc
    except TRANSIENT_ERRORS as exc:  # gone since it connected
        return [
            f"lock store {address} not reachable: {_text(exc)}; tasks will be deferred (or run "
            "unlocked under fail_open) until it is"
        ]
    except redis.RedisError:
        config = _memory_settings_from_info(store.client)  # CONFIG denied: a managed service
    # Asked once the store answered: an unreachable one would cost a connect timeout more.
    check_single_endpoint(store.client, setting)
    found = _replica_warnings(store) + _key_permission_warnings(store, prefixes)
    policy = str(config.get("maxmemory-policy", "noeviction"))
    if int(config.get("maxmemory", 0) or 0) > 0 and policy != "noeviction":
        found.append(
            f"the lock store may evict keys (maxmemory-policy {policy}): an evicted lease lets "
            "a second copy run; use maxmemory-policy noeviction"
        )
    return found


def url_mistake(exc: BaseException) -> str | None:
    """What an error connecting to the lock store says is wrong with its URL, and what to fix,
    where only another URL mends it; ``None`` for any other error.

    Such errors are a wrong user or password (``WRONGPASS``, ``NOAUTH``: also where the first
    command, rather than connecting, meets them), a server that does not speak Redis (a protocol
    error: another service's port), and a connection the server refuses as the URL asks for it
    (a database out of range, or other than 0 on a Redis Cluster node). Every task would fail
    unrun on such a store, as long as the URL stays. Not such errors: a store unreachable or
    timing out, or refusing for now, which it may stop doing while the worker runs (tasks are
    deferred until then), and ``NOPERM`` for the URL's ``SELECT``, which a change of the user's
    permissions mends.
    """
    if isinstance(exc, REFUSED_ERRORS):
        return (
            f"refused the user or password: {_text(exc)}; every task would fail unrun: put the "
            "user and password the server expects in the URL (redis://user:password@host:port/db)"
        )
    if isinstance(exc, redis.InvalidResponse):
        return (
            f"does not speak Redis ({_text(exc)}): wrong host or port? Every task would fail "
            "unrun: point the URL at the lock store's Redis server"
        )
    if isinstance(exc, redis.ResponseError) and not isinstance(
        exc, redis.exceptions.NoPermissionError
    ):
        if is_transient_reply(exc) or reply_code(exc) == "DENIED":
            # "Not now" (BUSY: a script running past busy-reply-threshold refuses SELECT), or
            # the server's own configuration (protected mode): no other URL mends either.
            return None
        if "DB index" in str(exc) or "SELECT" in str(exc):
            return (
                f"refused the URL's database: {_text(exc)}; every task would fail unrun: use a "
                "database the server has (0 to 15 unless its databases setting says otherwise; "
                "0 alone on a Redis Cluster node)"
            )
        return (
            f"refused the connection the URL asks for: {_text(exc)}; every task would fail "
            "unrun: fix the URL's options"
        )
    return None


def check_single_endpoint(client: redis.Redis, setting: str = "celery_lock_redis_url") -> None:
    """Refuse a lock store that is a node of a Redis Cluster of more than one master.

    The lock store client is a plain ``redis.Redis``: it talks to the node its URL names alone,
    and a node answers ``MOVED`` for every key of a slot another master serves. The tasks whose
    requests hash to such a slot would fail unrun while the others ran, and ``celery lock ls``
    would list that node's leases alone. A cluster of one master serves every slot, as a plain
    server does. One ``CLUSTER INFO``; nothing is checked where it is refused (a server not in
    cluster mode, an ACL that denies ``CLUSTER``) or fails.

    Args:
        client: the lock store's client.
        setting: the setting or option the URL came from, as the error names it
            (``broker_url`` where the broker's URL stands in for ``celery_lock_redis_url``;
            several joined by ``" / "``).

    Raises:
        ConfigurationError: naming ``setting``: the store is such a node.
    """
    masters = cluster_masters(client)
    if masters is None or masters <= 1:
        return
    use = "Use"
    if "broker_url" in setting.split(" / "):
        # The broker stays where it is: the lock store needs a URL of its own.
        use = "Set celery_lock_redis_url, for which the broker's URL stands in while unset, to"
    raise ConfigurationError(
        setting,
        f"lock store {address_of(client)} is a node of a Redis Cluster of {masters} masters, "
        "and celery-lock's client talks to that node alone: it refuses (MOVED) the keys of the "
        f"slots the other masters serve, and their tasks would fail. {use} a single endpoint (a "
        "plain Redis server, or a cluster of one master)",
    )


def _replica_warnings(store: LockStore) -> list[str]:
    """Whether the lock store is a replica (a reader endpoint, a node demoted before the worker
    started): it refuses every grant (``READONLY``), which the store takes for a failover in
    progress and defers, for as long as the worker runs. Empty where ``INFO`` is refused."""
    try:
        info = store.client.info("replication")
    except redis.RedisError:
        return []
    if info.get("role") != "slave":
        return []
    primary = f"{info.get('master_host', '?')}:{info.get('master_port', '?')}"
    if cluster_masters(store.client) is not None:
        # A cluster's replica answers MOVED, which the store follows to the master.
        return [
            f"lock store {address_of(store.client)} is a replica of {primary} in a Redis "
            "Cluster: each process's first command there is redirected (MOVED) to the master, "
            "which the store then uses; point the lock store URL at the master"
        ]
    return [
        f"lock store {address_of(store.client)} is a replica of {primary}: point the lock "
        "store URL at the primary. A read-only replica refuses every grant (READONLY), so "
        "tasks are deferred until it is promoted; a writable one keeps the leases from workers "
        "that use the primary, and loses them at its next resync"
    ]


def _memory_settings_from_info(client: redis.Redis) -> dict[str, Any]:
    """``maxmemory`` and ``maxmemory-policy`` as ``INFO memory`` shows them, for a store that
    refuses ``CONFIG GET``: managed services (ElastiCache, whose default policy is
    ``volatile-lru``, Memorystore) disable ``CONFIG`` but answer ``INFO``. Empty (cannot tell)
    where ``INFO`` is refused too (an ACL user kept to ``@read @write @scripting``)."""
    try:
        info = client.info("memory")
    except redis.RedisError as exc:
        logger.debug("celery-lock: cannot read the lock store's eviction policy: %s", exc)
        return {}
    return {
        "maxmemory": info.get("maxmemory", 0),
        "maxmemory-policy": info.get("maxmemory_policy", "noeviction"),
    }


#: The pools that run several task bodies in one process, each with a lock store connection
#: of its own while it acquires or releases.
_SHARED_PROCESS_POOLS = frozenset(
    {"celery.concurrency.thread", "celery.concurrency.gevent", "celery.concurrency.eventlet"}
)


def bodies_per_process(pool_cls: Any, concurrency: int) -> int:
    """How many task bodies a worker process runs at once: ``concurrency`` under the threads,
    gevent and eventlet pools, one under prefork and solo (``pool_cls``: the worker's pool
    class)."""
    return concurrency if getattr(pool_cls, "__module__", "") in _SHARED_PROCESS_POOLS else 1


def connection_warnings(store: LockStore, bodies: int) -> list[str]:
    """Whether the lock store's connection pool (``?max_connections=``) has fewer connections
    than ``bodies`` task bodies of one process and its heartbeat may use at once: the rest get
    redis-py's "Too many connections", retried and then deferred as an outage would be."""
    limit = store.client.connection_pool.max_connections
    if limit >= bodies + 1:
        return []
    return [
        f"lock store {address_of(store.client)} allows {limit} connections per process "
        f"(max_connections), fewer than the {bodies} task bodies a process runs at once and its "
        f"heartbeat: tasks will wait, retry and be deferred as if the store were down; use "
        f"max_connections={bodies + 1} or more, or leave it out"
    ]


def _key_permission_warnings(store: LockStore, prefixes: Iterable[str]) -> list[str]:
    """Whether the lock store's user may not use the keys of a request under one of
    ``prefixes`` (a Redis ACL that confines it to other keys, such as a broker user kept to the
    broker's ``global_keyprefix``): every acquire would be refused. ``EXISTS`` on a request's
    three keys, which reads them and writes nothing."""
    found = []
    for prefix in prefixes:
        keys = RequestKeys.build(prefix, "celery-lock-probe", "probe", "probe")
        try:
            store.client.exists(keys.lock, keys.fence, keys.done)
        except redis.exceptions.NoPermissionError as exc:
            found.append(
                f"lock store {address_of(store.client)} refused its user the keys under "
                f"{prefix!r}: {_text(exc)}; every task will fail until the user has permission "
                f"on {prefix}:* (+@read +@write +@scripting)"
            )
        except redis.RedisError:
            break  # gone since it answered: the next task will say so
    return found


def scope_warnings(app: Celery) -> list[str]:
    """Tasks of one ``lock_scope`` whose keys land apart: another key prefix, or another lock
    store. They exclude each other only where their leases are one key in one store, so such a
    scope shares nothing across the split, and each side runs while the other holds."""
    from .task import LockedTask  # noqa: PLC0415 - task imports worker, which imports this

    where: dict[str, dict[tuple[str, str], list[str]]] = {}
    shown: dict[str, str] = {}  # a store as one of its URLs names it, password masked
    for task in app.tasks.values():
        if isinstance(task, LockedTask) and task.lock_scope is not None:
            settings = task.lock_settings()
            try:
                url = lock_store_url(app, settings)
            except ConfigurationError:
                continue  # a worker refuses such a task at start
            store = _store_identity(url)
            shown.setdefault(store, passwords_masked(url, url))
            place = (settings.key_prefix, store)
            where.setdefault(task.lock_scope, {}).setdefault(place, []).append(task.name)
    return [
        f"the tasks of lock_scope {scope!r} do not share their leases: "
        + "; ".join(
            f"{', '.join(sorted(names))} lock under key prefix {prefix!r} on {shown[store]}"
            for (prefix, store), names in sorted(places.items())
        )
        + " (give them one lock_key_prefix and one lock store)"
        for scope, places in sorted(where.items())
        if len(places) > 1
    ]


def _store_identity(url: str) -> str:
    """The database a lock store URL leads to, as redis-py reads the URL: ``redis://h`` and
    ``redis://h:6379/0`` are one; the URL itself where redis-py cannot read it (``sentinel://``)."""
    try:
        found = parse_url(url)  # type: ignore[no-untyped-call]
    except (ValueError, redis.RedisError):
        return url
    where = found.get("path") or f"{found.get('host', 'localhost')}:{found.get('port', 6379)}"
    return f"{where}/{found.get('db', 0)}"


def _text(exc: BaseException) -> str:
    return str(exc).rstrip(".")  # redis-py ends some messages with a full stop; ours go on


def store_prefixes(app: Celery) -> dict[str, set[str]]:
    """The lock stores the app's tasks use, by URL, each with the key prefixes used on it (the
    app's own settings count as a task without options of its own would use them).

    Raises:
        ConfigurationError: a ``LockedTask`` has no lock store, naming the task: it may be one
            the app never declared (a task of another app in the process, shared with every
            app by Celery's default ``shared=True``).
    """
    return {url: prefixes for url, (_, prefixes) in _stores_in_use(app).items()}


def _stores_in_use(
    app: Celery, flags: Mapping[str, str] | None = None
) -> dict[str, tuple[list[str], set[str]]]:
    """:func:`store_prefixes`, each URL also with the names of what it came from, as an error
    about it names them: the setting as written (``CELERY_LOCK_REDIS_URL`` too), the worker
    option that set it (``flags``: setting -> the option's flag, ``--lock-redis-url``), a task's
    option (``<task>.lock_redis_url``, as :meth:`LockSettings.resolve` names it), or
    ``broker_url`` where the broker's URL stands in.

    Raises:
        ConfigurationError: as :func:`store_prefixes`.
    """
    from .task import LockedTask  # noqa: PLC0415 - task imports worker, which imports this

    found: dict[str, tuple[list[str], set[str]]] = {}

    def use(url: str, source: str, prefix: str) -> None:
        sources, prefixes = found.setdefault(url, ([], set()))
        if source not in sources:
            sources.append(source)
        prefixes.add(prefix)

    app_settings = LockSettings.resolve(app.conf)
    _, conf_name = conf_value(app.conf, "celery_lock_redis_url")
    app_source = (flags or {}).get("celery_lock_redis_url") or (
        conf_name if app_settings.redis_url else "broker_url"
    )
    with contextlib.suppress(ConfigurationError):  # no app-wide store: each task names its own
        use(lock_store_url(app, app_settings), app_source, app_settings.key_prefix)
    for task in app.tasks.values():
        if not isinstance(task, LockedTask):
            continue
        settings = task.lock_settings()
        try:
            url = lock_store_url(app, settings)
        except ConfigurationError as exc:
            raise ConfigurationError(exc.setting, f"{exc.problem} (task {task.name})") from exc
        own = task._lock_task_options().get("lock_redis_url") is not None
        use(url, f"{task.name}.lock_redis_url" if own else app_source, settings.key_prefix)
    return found


def store_lines(app: Celery, flags: Mapping[str, str] | None = None) -> list[str]:
    """One line per lock store the app's tasks use, for the log at worker start: its URL
    (passwords masked), where the URL came from, the key prefix and the lease TTL, then each
    task whose own options give it another prefix or TTL there. Two workers that run the same
    tasks must show the same store and prefix: on another, their leases are other keys, and
    both run a request at once.

    Args:
        app: the app whose ``app.conf`` and registered ``LockedTask`` settings are read.
        flags: the settings a worker option set, each with the option's flag (see
            :func:`warn_at_startup`).

    Raises:
        ConfigurationError: as :func:`store_prefixes`.
    """
    return _store_lines(app, _stores_in_use(app, flags))


def _store_lines(app: Celery, in_use: dict[str, tuple[list[str], set[str]]]) -> list[str]:
    """:func:`store_lines`, of the stores :func:`_stores_in_use` found (once, at start)."""
    from .task import LockedTask  # noqa: PLC0415 - task imports worker, which imports this

    app_settings = LockSettings.resolve(app.conf)
    others: dict[str, list[str]] = {}  # a store's URL -> its tasks' other prefixes and TTLs
    for task in app.tasks.values():
        if not isinstance(task, LockedTask):
            continue
        settings = task.lock_settings()
        url = lock_store_url(app, settings)
        differs = []
        if settings.key_prefix != app_settings.key_prefix:
            differs.append(f"key prefix {settings.key_prefix!r}")
        if settings.ttl != app_settings.ttl:
            differs.append(f"lease TTL {settings.ttl:g}s")
        if differs:
            others.setdefault(url, []).append(f"{task.name}: {', '.join(differs)}")
    lines = []
    for url, (sources, _) in in_use.items():
        source = " / ".join(
            "broker_url, standing in for celery_lock_redis_url" if s == "broker_url" else s
            for s in sources
        )
        line = (
            f"lock store {passwords_masked(url, url)} (from {source}), key prefix "
            f"{app_settings.key_prefix!r}, lease TTL {app_settings.ttl:g}s"
        )
        lines.append("; ".join([line, *sorted(others.get(url, []))]))
    return lines


def warn_at_startup(
    app: Celery,
    stores: dict[str, LockStore],
    bodies: int = 1,
    flags: Mapping[str, str] | None = None,
) -> list[str]:
    """Log a warning for every contradiction found in the app's lock settings and stores,
    after, at INFO, the lock stores the tasks use (:func:`store_lines`).

    Args:
        app: the app whose ``app.conf`` and registered ``LockedTask`` settings are checked.
        stores: the lock stores to check for eviction, by URL.
        bodies: how many task bodies a worker process runs at once (see
            :func:`bodies_per_process`).
        flags: the settings a worker option set, each with the option's flag
            (``{"celery_lock_redis_url": "--lock-redis-url"}``), as errors name them.

    Returns:
        The warnings, as logged.

    Raises:
        ConfigurationError: naming where its URL came from: the server of a lock store refuses
            the connection the URL asks for (see :func:`url_mistake`), or is a node of a Redis
            Cluster of several masters (see :func:`check_single_endpoint`). The warnings
            found before it are logged all the same.
    """
    from .task import LockedTask  # noqa: PLC0415 - task imports worker, which imports this

    found = misnamed_settings(app.conf) + unknown_settings(app.conf) + green_heartbeat_warnings()
    found += settings_warnings(app, "celery_lock", LockSettings.resolve(app.conf))
    for task in app.tasks.values():
        if isinstance(task, LockedTask):
            found += delivery_warnings(task) + request_class_warnings(task)
            settings = task.lock_settings()
            if settings != LockSettings.resolve(app.conf):
                found += settings_warnings(app, task.name, settings)
    found += beat_warnings(app) + scope_warnings(app)
    try:
        in_use = _stores_in_use(app, flags)
    except ConfigurationError:
        in_use = {}  # a task without a store: a worker refuses to start before this
    else:
        for line in _store_lines(app, in_use):
            logger.info("celery-lock: %s", line)
    try:
        for url, store in stores.items():
            sources, prefixes = in_use.get(url, (["celery_lock_redis_url"], set()))
            found += connection_warnings(store, bodies)
            found += store_warnings(store, sorted(prefixes), " / ".join(sources))
    finally:
        # Logged also when a store is refused and the worker stops: the operator who mends
        # its URL meets them now, not at the next start.
        for message in found:
            logger.warning("celery-lock: %s", message)
    return found
