"""LockedTask: effectively-once processing per request.

Worker side::

    from celery_lock import LockedTask

    @app.task(base=LockedTask, bind=True, lock_key="request_idx")
    def process(self, request_idx):
        fence = self.request.lock_fence   # strictly increasing per request
        store.write(request_idx, result, fence=fence)

Before the body runs, ``__call__`` takes the request's lease (one Lua script), so ``delay``,
``send_task``, beat, canvas and eager calls are all covered; the per-process heartbeat extends the
lease while the body runs; a ``finally`` releases it and, on success, records the request as done.

What a copy does when it cannot take the lease:

=====================================  ==========================================================
the lease is                           the copy
=====================================  ==========================================================
done, by this same task id             is acked quietly; the task keeps its SUCCESS state
done, by another task id               is skipped (state ``SKIPPED``, reason ``done``)
held by this same task id              is deferred: a broker redelivery of a running message, or
                                       a message whose holder died; it runs once the outcome is
                                       known, without using up ``max_retries``
held by another copy of this task      follows ``lock_on_duplicate``: ``skip`` (state
                                       ``SKIPPED``, reason ``running``), ``retry`` or ``raise``
held by another task in the scope      is deferred: contention, not a duplicate
=====================================  ==========================================================

Caller side: a skipped copy's state ``SKIPPED`` is not a ready state, so ``.get()`` would wait
for ever; :func:`celery_lock.follow` follows it to the holder's result instead::

    from celery_lock import follow

    result = process.delay(42)
    value = follow(result, timeout=30)   # the holder's return value if this copy was skipped
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import random
import sys
import traceback
import weakref
from collections.abc import Callable, Mapping
from time import monotonic as _monotonic
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import redis
from amqp.exceptions import MessageNacked
from celery import Signature, Task
from celery._state import _task_stack  # type: ignore[attr-defined]
from celery.app.amqp import AMQP
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded
from celery.states import STARTED
from celery.utils.threads import LocalStack
from kombu.exceptions import OperationalError

try:
    from celery.app.trace import (  # type: ignore[attr-defined]  # not in celery-types
        get_actual_ignore_result as _get_actual_ignore_result,
    )
except ImportError:  # Celery before 5.6.3
    _get_actual_ignore_result = None

from . import signals
from .bases import check_call_order
from .config import LockSettings, check_option_names
from .delivery import copy_delivery, returns_uncounted, within_visibility
from .events import TASK_LOCK_LOST, TASK_SKIPPED, send_task_event_apart
from .exceptions import (
    ConfigurationError,
    DuplicateTaskError,
    LockContendedError,
    LockKeyError,
    LockLostError,
    LockStoreError,
    LockStoreUnavailableError,
)
from .heartbeat import Heartbeat, green_pool
from .keys import NAMED_POSITIONAL, KeyDeriver, LockKeySpec, RefusedKeyDeriver, RequestKeys
from .lease import Acquired, Done, HandOn, Held, Holder, Lease, new_token
from .request import EXPIRED_FIELD, ExpiredCopy, SkippedCopy
from .runtime import get_runtime
from .states import skipped_marker, store_skipped
from .store import LockStore

__all__ = ["DEFERRALS_HEADER", "LockedContext", "LockedTask"]

logger = logging.getLogger(__name__)

#: Message header counting how often a copy was deferred (kept apart from ``retries``).
DEFERRALS_HEADER = "celery_lock_deferrals"
#: Set on a request once a call has taken it over: a call that finds it set is a nested one.
_ENTERED = "_celery_lock_entered"
#: Set on a request whose acquire withdrew an unsent hand-on marker of its own message's.
_WITHDREW = "_celery_lock_withdrew_hand_on"
#: RabbitMQ's dead-lettering headers, which Celery drops from a message it publishes again
#: (``celery.app.task.X_DEATH_HEADERS``, Celery 5.6+): RabbitMQ before 4.0.1 takes a copy that
#: carries them, sent through native delayed delivery, for a dead-letter cycle and drops it.
X_DEATH_HEADERS = frozenset(
    {
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    }
)
#: Whether this Celery sends a replacement with its depth in the message headers, where the
#: worker reads it (``replaced_task_nesting``, since 5.3.5; before, it went out as a message
#: property, and every replacement arrived at depth 0).
_REPLACEMENTS_KEEP_THEIR_DEPTH = (
    "replaced_task_nesting" in inspect.signature(AMQP.as_task_v2).parameters
)
#: ``Task.retry``'s parameters in their order, before its publish options.
_RETRY_PARAMETERS = ("args", "kwargs", "exc", "throw", "eta", "countdown", "max_retries")
#: What a publish raises when the broker could not take the message for now: a lost or
#: refused connection, a nack under publisher confirms.
_BROKER_FOR_NOW = (
    OperationalError,
    OSError,
    MessageNacked,
    redis.ConnectionError,
    redis.TimeoutError,
)
#: First and longest wait before a deferred copy is tried again, in seconds.
DEFER_MIN_DELAY = 0.5
DEFER_MAX_DELAY = 60.0


class _Ignored:
    """What the lock path returns for a copy that ends as Celery's ``Ignore`` (raised by
    ``__call__``): a value of a private class, which no task body can return."""

    __slots__ = ("exception",)

    def __init__(self, exception: Ignore) -> None:
        self.exception = exception


def _run_signature(cls: type[Task[Any, Any]]) -> inspect.Signature | None:
    """The signature callers use: ``run``'s parameters, without ``self`` for a bound task.

    ``run`` is looked up in ``cls`` and its bases below :class:`LockedTask`, so a subclass that
    keeps its parent's ``run`` but sets its own ``lock_key`` gets a key of its own; ``None``
    when none of them defines it (an abstract base)."""
    run = None
    for klass in cls.__mro__:
        if klass is LockedTask:
            break
        if "run" in klass.__dict__:
            run = klass.__dict__["run"]
            break
    if run is None:
        return None
    if isinstance(run, staticmethod):
        return inspect.signature(run.__func__)
    signature = inspect.signature(run)
    parameters = list(signature.parameters.values())
    # ``self`` is the first parameter, unless that is ``*args`` (a wrapper written without
    # functools.wraps), which takes ``self`` and the caller's positional arguments alike.
    if parameters and parameters[0].kind in NAMED_POSITIONAL:
        parameters = parameters[1:]
    return signature.replace(parameters=parameters)


def _shown_arguments(request: Any) -> dict[str, Any]:
    """What the caller showed of the arguments instead of them (``argsrepr``, ``kwargsrepr``),
    for a copy of ``request``: Celery's copy of a request leaves them out, and the copy's
    events (and Flower) would show the arguments they hide."""
    return {
        shown: value
        for shown in ("argsrepr", "kwargsrepr")
        if (value := getattr(request, shown, None)) is not None
    }


def _shown_name(task: Task[Any, Any], request: Any) -> str:
    """The name Celery's own events give a call (``task-received``'s ``name``): its shadow name
    (``apply_async(shadow=...)``, ``Task.shadow_name``) if it has one, else the task's. Flower
    lists and counts a call under the name of its events: the same for all of them."""
    return getattr(request, "shadow", None) or task.name


def _ignores_result(task: Task[Any, Any], request: Any) -> bool:
    """Whether Celery stores no result for this call, as it decides for the call's own result:
    since Celery 5.6.3 a call's ``ignore_result`` (every message carries one) overrides the
    task's; before, the task's and the call's each ignore it."""
    if _get_actual_ignore_result is not None:
        return bool(_get_actual_ignore_result(task, request))
    return bool(task.ignore_result or getattr(request, "ignore_result", False))


#: Deferrals that store no state (``RETRY`` would overwrite the holder's): a redelivered copy of
#: a running message, and the copy a run that lost its lease sends of its message.
_UNSTORED_REASONS = frozenset({"redelivered", "lost"})


def _made_inside(holder: str, lock_key: str, request: Any) -> bool:
    """Whether ``request`` is a call made inside a running call that holds the request: a
    request below it on a task's request stack in this thread (an eager or direct call) whose
    lease at ``lock_key`` is still held, of task id ``holder`` (``""``: a direct call's)."""
    for task in _task_stack.stack:
        for running in task.request_stack.stack:
            if running is request:
                continue
            lease = running.__dict__.get("lock_lease")
            if lease is None or lease.released or lease.lost or lease.keys.lock != lock_key:
                continue  # not a holder of this request, or no more
            if not holder or running.id == holder:
                return True
    return False


def _check_scope(task_name: str, scope: Any) -> None:
    """Refuse a ``lock_scope`` that is neither ``None`` nor a non-empty string.

    Checked when the class is created: otherwise every message would fail on the worker (a
    number or a list), or an empty scope would quietly mean the task's own name.

    Raises:
        ConfigurationError: naming ``<task name>.lock_scope``.
    """
    if scope is not None and (not isinstance(scope, str) or not scope):
        raise ConfigurationError(
            f"{task_name}.lock_scope", f"must be a non-empty string or None, got {scope!r}"
        )


def _check_scope_has_a_key(task_name: str, scope: str | None, key_spec: LockKeySpec) -> None:
    """Refuse a ``lock_scope`` given with the default key.

    The default key digests the task's name with its arguments, so no other task's key is ever
    equal to it: a scope shared with the default key would exclude nothing, in silence. Checked
    when the task binds to its app, after ``task_annotations``, which may give the ``lock_key``.

    Raises:
        ConfigurationError: naming ``<task name>.lock_scope``.
    """
    if scope is not None and key_spec is None:
        raise ConfigurationError(
            f"{task_name}.lock_scope",
            f"{scope!r} needs a lock_key: the default key digests the task's name with its "
            "arguments, so no other task of the scope would ever have the same key; give the "
            "tasks of the scope a lock_key (an argument name, a template or a callable) that "
            "yields the same key for the same request",
        )


class LockedContext(Context):
    """``self.request`` in a :class:`LockedTask`'s body, as type checkers see it: Celery's
    ``Context`` with the lease's attributes. (At run time the request is a plain ``Context``
    that carries them.)"""

    #: The grant's fencing token; ``None`` for a body run unlocked under ``fail_open``.
    lock_fence: int | None
    #: The lease's Redis key.
    lock_key: str
    #: Whether the heartbeat found the lease lost.
    lock_lost: bool


class LockedTask(Task):  # type: ignore[type-arg]
    """A task that takes a per-request lease before its body runs.

    Every ``lock_*`` option left ``None`` is read from ``app.conf`` (``celery_lock_*``).

    Late acknowledgement is on by default: the broker keeps a message until its request is done
    or handed on, so a killed worker's message comes back and runs once its dead lease lapses.
    ``reject_on_worker_lost`` makes that redelivery happen when a pool process dies mid-task.
    The lease makes those redeliveries safe; late acks make skipping a copy safe.
    """

    #: How to derive the request key: an argument name, a ``"{a}:{b}"`` template over the bound
    #: arguments, a callable taking the task's arguments, or ``None`` for a digest of them all.
    lock_key: LockKeySpec = None
    #: Namespace of the request key; tasks sharing a scope exclude each other. Default: the name.
    lock_scope: str | None = None
    #: Lease TTL in seconds (``celery_lock_ttl``, default 60).
    lock_ttl: float | None = None
    #: Seconds between heartbeats (``celery_lock_heartbeat_interval``, default TTL / 3).
    lock_heartbeat_interval: float | None = None
    #: ``"skip"``, ``"retry"`` or ``"raise"`` (``celery_lock_on_duplicate``, default skip).
    lock_on_duplicate: str | None = None
    #: Seconds a completed request is remembered (``celery_lock_done_ttl``, default one day).
    lock_done_ttl: float | None = None
    #: Prefix of every Redis key (``celery_lock_key_prefix``, default ``celery-lock``).
    lock_key_prefix: str | None = None
    #: Run unlocked when the lock store is down (``celery_lock_fail_open``, default False).
    lock_fail_open: bool | None = None
    #: Complete a skipped copy as SUCCESS with a marker value, for canvas
    #: (``celery_lock_skip_as_success``, default False).
    lock_skip_as_success: bool | None = None
    #: Lock store URL (``celery_lock_redis_url``, default the broker's when it is Redis).
    lock_redis_url: str | None = None

    acks_late = True
    reject_on_worker_lost = True
    # Celery 5.7's task_retry_on_worker_lost, set app-wide, would turn the killed holder's
    # message into a Celery retry: acked, counted against max_retries (a FAILURE once they are
    # used up, the request never run) and sent default_retry_delay later.
    retry_on_worker_lost = False
    #: Sends ``task-skipped`` from the worker's main process; derive your own from it.
    Request = "celery_lock.request:LockedRequest"
    #: ``track_started`` (``task_track_started``) as the task was given it: :meth:`on_bound`
    #: moves it here, and the run that holds the lease stores ``STARTED`` itself.
    _lock_track_started: ClassVar[bool] = False

    _lock_deriver: ClassVar[KeyDeriver | None] = None

    if TYPE_CHECKING:

        @property
        def request(self) -> LockedContext:
            """The running call's request, with ``lock_fence``, ``lock_key``, ``lock_lost``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Check the lock options when the task class is created (decoration or finalize)."""
        super().__init_subclass__(**kwargs)
        check_call_order(cls, LockedTask)
        cls._check_lock_options()

    @classmethod
    def annotate(cls) -> None:
        """Celery's ``task_annotations``, then the lock options checked again: an annotation
        sets ``lock_key`` or ``lock_scope`` on the class after it was created, and a deriver
        built before would go on keying every call by the ``lock_key`` the annotation replaced.
        """
        super().annotate()
        try:
            cls._check_lock_options(bound=True)
        except (LockKeyError, ConfigurationError):
            # Celery's bind sets the request stack after this: left unset, a later direct or
            # eager call of the task would fail on it, not on the refusal.
            if cls.request_stack is None:
                cls.request_stack = LocalStack()
            raise

    @classmethod
    def _check_lock_options(cls, *, bound: bool = False) -> None:
        """Check the lock options and build the key deriver; ``bound``: the task is binding to
        its app, its ``task_annotations`` applied, so a scope's key is known at last."""
        spec = cls.__dict__.get("lock_key", cls.lock_key)
        if isinstance(spec, staticmethod):  # wrapped below when the class was created
            spec = spec.__func__
        elif inspect.isfunction(spec):
            # A plain function as a class attribute would become a bound method.
            cls.lock_key = staticmethod(spec)
        signature = _run_signature(cls)
        if signature is None:
            return
        name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__name__}"
        try:
            if cls.__dict__.get("_decorated"):
                # Options of the decorator (and task_annotations) are in the class Celery made
                # of the function. Attributes of a task class of the user's own are its own.
                inherited = {option for base in cls.__mro__[1:] for option in vars(base)}
                check_option_names(name, list(cls.__dict__), inherited)
            cls._lock_deriver = KeyDeriver.create(name, signature, spec)
            _check_scope(name, cls.lock_scope)
            if bound:
                _check_scope_has_a_key(name, cls.lock_scope, spec)
            LockSettings.resolve({}, cls._lock_task_options(), name, check_together=False)
        except (LockKeyError, ConfigurationError) as exc:
            if bound:  # the class exists, and the app is marked finalized: refuse every call
                cls._lock_deriver = RefusedKeyDeriver(name, signature, exc)
            raise

    @classmethod
    def _lock_task_options(cls) -> dict[str, Any]:
        return {
            name: getattr(cls, name)
            for name in (
                "lock_ttl", "lock_heartbeat_interval", "lock_on_duplicate", "lock_done_ttl",
                "lock_key_prefix", "lock_fail_open", "lock_skip_as_success", "lock_redis_url",
            )
        }  # fmt: skip

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Wire celery-lock into ``app`` (signals, bootstep) when the task binds to it
        (Celery's hook, called by ``Task.bind``)."""
        from .worker import install  # noqa: PLC0415 - worker imports this module

        super().on_bound(app)
        if "_lock_track_started" not in cls.__dict__:  # once per class: bound again, kept
            # Celery stores STARTED for every delivery, before __call__: a copy deferred, or
            # acked as its own request's redelivery, then ends with Ignore and stores nothing
            # more, and STARTED stays over the holder's SUCCESS (rpc://) or FAILURE for ever.
            # Celery reads the flag from the task; the lease's holder stores it instead.
            if cls.track_started or "track_started" in cls.__dict__:
                # Given here, by a base not bound, or by Celery from task_track_started.
                cls._lock_track_started = bool(cls.track_started)
            else:  # inherited from a bound base, which moved its own: that one is Celery's
                cls._lock_track_started = cls._lock_track_started
            cls.track_started = False
        install(app)

    # -- caller side ---------------------------------------------------------------------------

    def apply_async(self, args: Any = None, kwargs: Any = None, *a: Any, **options: Any) -> Any:
        """Publish, after checking that the call's arguments yield a request key.

        The later steps the call carries (``chain``, ``link``, ``link_error``, ``chord``) are
        checked too, when ``send_task`` publishes it, for a call of any task
        (:mod:`celery_lock.canvas`): those of a ``LockedTask`` whose arguments are fixed (an
        immutable signature, ``.si()``), not those that take their parent's result (``.s()``).

        Raises:
            LockKeyError: the call, or a later step it carries whose arguments are fixed, lacks
                an argument its key is made of; nothing is published. Except for the next step
                of a canvas, which a worker sends (with a ``parent_id``) once its parent has
                succeeded: raised there, the error would fail the parent, so the step is
                published and fails on the worker, unrun. (A caller that passes ``parent_id``
                itself is taken for such a step.) The later steps of a call published from a
                running task are left to the worker too.
            TypeError: ``task_id`` is given and is not a ``str`` (an ``int``, a ``UUID``);
                nothing is published. Except for the next step of a canvas (a ``parent_id``
                given), published with a warning, as for ``LockKeyError``: it fails on the
                worker, unrun.
        """
        task_id = options.get("task_id")
        if task_id is not None and not isinstance(task_id, str):
            if not options.get("parent_id"):
                raise TypeError(_not_a_str_id(task_id))
            logger.warning("%s; the worker will fail this step unrun", _not_a_str_id(task_id))
        if self._lock_deriver is not None:
            try:
                self._request_key(tuple(args or ()), kwargs or {})
            except LockKeyError as exc:
                if not options.get("parent_id"):
                    raise
                logger.warning("celery-lock: %s; the worker will fail this step unrun", exc)
        return super().apply_async(args, kwargs, *a, **options)

    # -- worker side ---------------------------------------------------------------------------

    def lock_settings(self) -> LockSettings:
        """The settings that apply to this task in this process."""
        return get_runtime(self.app).settings(self.name, self._lock_task_options)

    def request_keys(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> RequestKeys:
        """The Redis keys of the request a call with these arguments works on."""
        return self._request_keys(self.lock_settings(), args, kwargs)

    def _request_keys(
        self, settings: LockSettings, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> RequestKeys:
        # self._request_key(args, kwargs), with the usual case of _key_deriver() and _as_sent()
        # taken here, without their calls (this runs for every task).
        deriver = self._lock_deriver
        if deriver is None or (deriver.task_name != self.name and self.name):
            deriver = self._key_deriver()
        if getattr(self, "_dump_pydantic_arguments", None) is not None:
            args, kwargs = self._as_sent(args, kwargs)  # type: ignore[assignment]
        request_key = deriver.request_key(args, kwargs)
        return RequestKeys.build(
            settings.key_prefix, self.lock_scope or self.name, request_key, self.name
        )

    def _request_key(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The request key of a call with these arguments, derived as the worker derives it.

        Raises:
            LockKeyError: the arguments yield no request key.
        """
        return self._key_deriver().request_key(*self._as_sent(args, kwargs))

    def _key_deriver(self) -> KeyDeriver:
        """The class's key deriver, named as this task is registered: the default key digests
        that name, which every process running the task agrees on.

        The class's own deriver is named when the class is created. A class-based task given
        to ``app.register_task`` gets its name afterwards, on the instance, and not always
        ``<module>.<class>``: a worker running the module as ``__main__`` would digest
        ``__main__.<class>``, another worker ``<module>.<class>``, and the two would run one
        request once each.
        """
        deriver = self._lock_deriver
        if deriver is None:  # an abstract base's subclass without a run of its own
            return KeyDeriver.create(self.name, inspect.signature(self.run), self.lock_key)
        if (
            deriver.task_name == self.name
            or not self.name
            or isinstance(deriver, RefusedKeyDeriver)
        ):  # not registered (yet), or refused whatever its name
            return deriver
        renamed = self.__dict__.get("_lock_renamed_deriver")
        if renamed is None or renamed[0] is not deriver:  # task_annotations rebuilt the class's
            renamed = (deriver, dataclasses.replace(deriver, task_name=self.name))
            self.__dict__["_lock_renamed_deriver"] = renamed
        return renamed[1]

    def _as_sent(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[tuple[Any, ...], Mapping[str, Any]]:
        """The call's arguments as Celery sends them, which the key is derived from at the
        caller, on the worker and in a direct call alike: under ``pydantic=True``, a model
        argument is sent as its dump (a dict), so ``{order[id]}`` is the key the worker can
        derive, not ``{order.id}``, and the default key digests the dump.
        """
        dump = getattr(self, "_dump_pydantic_arguments", None)  # not in older Celery
        if dump is None:
            return args, kwargs
        sent_args, sent_kwargs = dump(args, kwargs)
        return tuple(sent_args), sent_kwargs

    def check_lock(self) -> None:
        """Raise :class:`LockLostError` if this run's lease has been lost; call it before
        writes that must not happen twice."""
        request = self.request
        lease: Lease | None = getattr(request, "lock_lease", None)
        lost = getattr(request, "lock_lost", False)
        if lease is not None and lease.expired:
            # A whole TTL unconfirmed: lost, as the heartbeat's next beat would find it; told
            # now (lock_lost, task-lock-lost, the log), for the body, stopping here, may let go
            # of it before that beat, and a lease no longer held is not reported. Not a lease
            # the task released already (self.replace hands it on; no heartbeat extends it).
            if not lease.released:
                lease.mark_lost()
            lost = True
        if lost:
            raise LockLostError(getattr(request, "lock_key", ""))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request_stack.top
        if (
            request is not None
            and not request.called_directly
            and not request.__dict__.get(_ENTERED, False)
        ):
            # The request the worker (or apply) pushed for this very call.
            setattr(request, _ENTERED, True)
            result = self._call_locked(args, kwargs, request)
        else:
            _task_stack.push(self)  # celery.current_task, as Task.__call__ sets it
            self._push_direct_call(request, args, kwargs)
            try:
                result = self._call_locked(args, kwargs, self.request_stack.top)
            finally:
                self.pop_request()
                _task_stack.pop()
        if isinstance(result, _Ignored):
            # Raised here, not where the copy is skipped: Celery copies every frame of an
            # Ignore's traceback twice (billiard's ExceptionInfo keeps each frame's code
            # positions), and two frames fewer cut a skipped copy's cost by a third.
            raise result.exception
        return result

    def _push_direct_call(
        self, running: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Give a direct call a request context of its own, as ``Task.__call__`` does.

        A call from inside this task's own body finds the running call's request on top:
        taking it over would rewrite the running call's fence and lease, and a skip would end
        the running call. ``push_request`` would copy it (id, lease and all, on Celery 5.7), so
        such a call gets a fresh context: it is a direct call like any other.
        """
        if running is not None and not running.called_directly:
            self.request_stack.push(Context(args=args, kwargs=kwargs))
        else:
            self.push_request(args=args, kwargs=kwargs)

    def _call_locked(self, args: tuple[Any, ...], kwargs: dict[str, Any], request: Any) -> Any:
        # Per task, every microsecond here is the lock's cost: settings, the store and the
        # request are looked up once and handed on.
        runtime = get_runtime(self.app)
        settings = runtime.settings(self.name, self._lock_task_options)
        keys = self._request_keys(settings, args, kwargs)
        # The per-task objects are made with positional arguments: a class called with
        # keywords builds a dict of them (2,000 instructions for the holder).
        holder = Holder(
            request.id or "",  # task id
            self.name,  # task name
            request.hostname or runtime.hostname,  # host
            runtime.pid,  # os.getpid(), as get_runtime just checked, without the syscall
        )
        store = runtime.store_for(settings)
        token = new_token()
        # The lease's TTL runs from when the script ran, somewhere after this: counting from
        # here, Lease.expired errs early, never late, however long the acquire's tries took.
        asked_at = _monotonic()
        try:
            depth = request.replaced_task_nesting or 0
            outcome = store.acquire(
                keys, token, settings.ttl_ms, holder, settings.fence_ttl_ms,
                depth, _root_id(request) if depth else "",
            )  # fmt: skip
        except LockStoreError as exc:
            return self._without_store(exc, settings, keys, args, kwargs)
        except BaseException as exc:
            if not isinstance(holder.task_id, str):
                # The holder's JSON refused it before anything was sent; a message sent by
                # name, which apply_async did not check.
                raise TypeError(_not_a_str_id(holder.task_id)) from exc
            # Raised inside the round trip, perhaps after the script ran: what this token may
            # hold (nothing changes if nothing) is given back.
            unknown_grant = Lease(store, keys, token, settings.ttl_ms, 0, holder, 0)
            self._cut_before_the_body(exc, unknown_grant, settings, args, kwargs)

        if isinstance(outcome, Acquired):
            lease = Lease(
                store, keys, token, settings.ttl_ms, outcome.fence, holder, settings.fence_ttl_ms,
                None, asked_at,  # on_lost (given once the body runs), confirmed_at
            )  # fmt: skip
            if request.expires and getattr(request, EXPIRED_FIELD, False):  # one read, mostly
                return self._revoke_expired(lease, settings, runtime.heartbeat)
            # Counted from the ask, a late grant may have so little left that the heartbeat's
            # first beat, up to an interval away, finds it expired: it is confirmed first.
            if _monotonic() - asked_at >= settings.late_after:
                unreachable = self._confirm_late_grant(lease, settings, args, kwargs)
                if unreachable is not None:
                    return self._without_store(unreachable, settings, keys, args, kwargs)
            return self._run_with_lease(lease, settings, args, kwargs, request, runtime.heartbeat)
        if isinstance(outcome, Done):
            if (
                not outcome.sent
                and outcome.task_id == request.id
                and outcome.handed_on_at == depth  # not a marker its replacement left
            ):
                return self._rerun_unsent_hand_on(
                    args, kwargs, request, settings, store, keys, outcome
                )
            if outcome.task_id and outcome.task_id == request.id:
                # A redelivery of the very message that succeeded, or that handed the request
                # on (its replacement, at a greater depth, got through): ack it, keep the
                # state the run or its replacement stored.
                logger.info(
                    "celery-lock: %s already %s by this task %s; acking the redelivery",
                    keys.lock,
                    "done" if outcome.handed_on_at is None else "handed on",
                    request.id,
                )
                return _Ignored(Ignore())
            return self._skip(keys, "done", outcome.task_id, settings, outcome.handed_on_at)
        assert isinstance(outcome, Held)
        if outcome.task_id and outcome.task_id == request.id:
            # Same message, delivered again while its first delivery runs (visibility timeout,
            # ETA) or after its holder died: wait for the outcome, never drop it.
            self._defer(args, kwargs, keys, "redelivered", outcome.task_id, outcome.pttl_ms)
        if outcome.task_name != self.name:
            self._defer(args, kwargs, keys, "contention", outcome.task_id, outcome.pttl_ms)
        if settings.on_duplicate == "retry":
            self._defer(args, kwargs, keys, "duplicate", outcome.task_id, outcome.pttl_ms)
        if settings.on_duplicate == "raise":
            raise DuplicateTaskError(keys.lock, outcome.task_id)
        return self._skip(keys, "running", outcome.task_id, settings)

    def _cut_before_the_body(
        self,
        exc: BaseException,
        lease: Lease,
        settings: LockSettings,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> NoReturn:
        """Raise ``exc``, which cut a round trip short before the body began, its lease given
        back; or, for a soft time limit in a worker, hand the message back unrun."""
        request = self.request
        if isinstance(exc, SoftTimeLimitExceeded) and not (
            request.is_eager or request.called_directly
        ):
            # The soft limit came before the body began (a hanging store takes two socket
            # timeouts, about 10 s, to give up): failed, the message would be acked unrun.
            # Handed back, it comes again; without a release, which against that store would
            # run into the hard limit, whose kill acks it too. A grant this try may have
            # made holds the request a TTL, and the message, back, waits for it as a
            # redelivery of its own.
            if not returns_uncounted(self.app):
                # A broker that counts each return would drop the message after a few such
                # tries (a quorum queue's delivery limit): republished, as a deferral, the
                # copy starts a count of its own. Not on Redis, which counts nothing, and is
                # often the very store that hangs: the publish would hang there too.
                try:
                    self._defer(args, kwargs, lease.keys, "store-unavailable", "", 0, exc)
                except Retry:
                    # Acked with no state stored, as the message given back stores none: a
                    # RETRY, in a result backend on the Redis that hangs, would wait there
                    # until the hard limit, whose FAILURE callers would read meanwhile.
                    raise Ignore() from None
            raise Reject(exc, requeue=True) from exc
        # A signal's exception (SIGTERM's SystemExit in a pool process, a soft time limit) or,
        # under gevent or eventlet, a kill or a hard time limit. A grant no heartbeat knows
        # would be held a whole TTL: give it back.
        with contextlib.suppress(LockStoreError):
            lease.store.release(lease, success=False, done_ttl_ms=settings.done_ttl_ms)
        raise exc

    def _confirm_late_grant(
        self,
        lease: Lease,
        settings: LockSettings,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> LockStoreUnavailableError | None:
        """Confirm a grant that came back late (``None``), or defer the copy, or return the
        error of a store that did not answer.

        The acquire script ran somewhere between the ask and the reply (a store that stalled,
        a try made again after a lost reply): the lease may have lapsed already. Counted from
        the ask, it may be expired, or expire before the heartbeat's first beat, which would
        take it for lost, never extend it, and another copy would run beside this one. One
        extend tells: still this token's, and its reply not late itself, the body runs under
        it, confirmed from that extend on; else the copy is deferred (a copy that took the
        request meanwhile holds it); not answered, the store is unavailable, as if the acquire
        had failed.
        """
        sent_at = _monotonic()
        owned: bool | None = None  # None: owned, but confirmed too late to keep
        try:
            [owned] = lease.store.extend_all([lease])
            if owned and _monotonic() - sent_at >= settings.late_after:
                # Late again: as late a grant, its lease would lapse before the first beat.
                owned = None
                lease.store.release(lease, success=False, done_ttl_ms=settings.done_ttl_ms)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            return LockStoreUnavailableError(
                f"the lock store granted the lease late, then did not confirm it: {exc}",
                lease.keys.lock,
            )
        except LockStoreError:
            pass  # the release of a lease confirmed too late: left to lapse
        except BaseException as exc:
            self._cut_before_the_body(exc, lease, settings, args, kwargs)
        if owned:
            lease.confirmed_at = sent_at
            return None
        late = LockStoreUnavailableError(
            "the lock store granted the lease so late that it had lapsed"
            if owned is False
            else "the lock store confirmed a late grant too late to keep it",
            lease.keys.lock,
        )
        logger.warning("celery-lock: %s; deferring task %s", late, self.request.id)
        self._defer(args, kwargs, lease.keys, "store-unavailable", holder="", pttl_ms=0, exc=late)

    def _revoke_expired(
        self, lease: Lease, settings: LockSettings, heartbeat: Heartbeat
    ) -> _Ignored:
        """A message delivered again past its ``expires``, which no run of it holds: give the
        grant back, and have the main process revoke it as Celery's would have
        (:meth:`LockedRequest.maybe_expire` let it through, since a run of its first delivery
        might have held the request)."""
        self._release(lease, settings, heartbeat, success=False)
        return _Ignored(ExpiredCopy())

    def _rerun_unsent_hand_on(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        request: Any,
        settings: LockSettings,
        store: LockStore,
        keys: RequestKeys,
        marker: Done,
    ) -> Any:
        """This very message's run began to hand the request on and ended before its
        replacement was known to be sent (its pool process killed while sending it): withdraw
        the marker, and run the request again. A replacement that did go out finds the request
        held by this run or done by it.

        A marker written less than a lease TTL ago may be a live run's, still sending (this
        delivery a visibility-timeout redelivery of its message, say): this copy is deferred
        as a redelivery of a running message is, until the run has confirmed it or died.
        """
        # Once: the next acquire finds no marker of this run's, unless another delivery of this
        # message wrote one meanwhile, which comes back itself if it dies too.
        if getattr(request, _WITHDREW, False):
            return _Ignored(Ignore())
        assert marker.handed_on_at is not None
        hand_on = HandOn(marker.handed_on_at, marker.root_id)
        most_ttl_left = max(1, settings.done_ttl_ms - settings.ttl_ms)
        try:
            withdrawn = store.withdraw_hand_on(
                keys, request.id, hand_on, most_ttl_left_ms=most_ttl_left
            )
        except LockStoreError as exc:
            return self._without_store(exc, settings, keys, args, kwargs)
        if withdrawn is None:
            self._defer(args, kwargs, keys, "redelivered", request.id, settings.ttl_ms)
        setattr(request, _WITHDREW, True)
        if withdrawn:
            logger.warning(
                "celery-lock: %s was being handed on by this task %s when its run ended, its "
                "replacement not known to be sent; running the request again",
                keys.lock,
                request.id,
            )
        return self._call_locked(args, kwargs, request)

    def _without_store(
        self,
        exc: LockStoreError,
        settings: LockSettings,
        keys: RequestKeys,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The acquire failed: fail closed (defer), or run unlocked under ``fail_open``."""
        request: Any = self.request
        run = request.id or "(a direct call)"
        if not isinstance(exc, LockStoreUnavailableError):
            # Garbage under the request's keys (LockStateError) or a command the store refuses
            # for good: deferring would loop for ever and running unlocked is not safe, so the
            # task fails, even with fail_open.
            logger.error("celery-lock: %s; task %s fails unrun", exc, run)
            raise exc
        if settings.fail_open:
            logger.warning("celery-lock: %s; running task %s unlocked (fail_open)", exc, run)
            request.lock_fence, request.lock_key, request.lock_lost = None, keys.lock, False
            if self._lock_track_started:
                self._store_started(request)
            return self.run(*args, **kwargs)
        if request.is_eager or request.called_directly:
            # Nothing to hand back to a broker: _defer raises the error itself.
            logger.warning("celery-lock: %s; task %s fails unrun (fail closed)", exc, run)
        else:
            logger.warning("celery-lock: %s; deferring task %s (fail closed)", exc, run)
        # pttl_ms=0: no lease bounds the wait, so it backs off up to DEFER_MAX_DELAY.
        self._defer(args, kwargs, keys, "store-unavailable", holder="", pttl_ms=0, exc=exc)

    def _run_with_lease(
        self,
        lease: Lease,
        settings: LockSettings,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        request: Any,
        heartbeat: Heartbeat,
    ) -> Any:
        success = requeued = False
        try:
            # Inside the try: whatever raises from here on (a signal's exception, the
            # heartbeat's thread failing to start) must not leave the lease held and extended.
            request.lock_fence = lease.fence
            request.lock_key = lease.keys.lock
            request.lock_lost = False
            request.lock_lease = lease
            lease.on_lost = self._lease_lost_callback(request)
            headers = request.headers
            if headers and DEFERRALS_HEADER in headers:
                # Deferrals count a wait for a holder, which is over: a retry the body asks for
                # (Celery copies the request's headers) must not start its backoff where it ended.
                del headers[DEFERRALS_HEADER]
            heartbeat.add(lease, settings.interval)
            if self._lock_track_started:
                self._store_started(request)
            if signals.lock_acquired.receivers:  # what send() asks first, without its call
                signals.lock_acquired.send(
                    sender=self, task_id=request.id, lock_key=lease.keys.lock, fence=lease.fence
                )
            result = self.run(*args, **kwargs)
            # A body that returns after retry(throw=False) (or after catching Retry) has sent
            # a copy of this task id on its way: a done-marker would have it acked unrun.
            success = not lease.retry_sent
            return result
        except BaseException as exc:
            if _cut_by_cold_shutdown(exc, request, lease):
                # The release below goes first: no done-marker, the lock deleted.
                requeued = True
                raise Reject(repr(exc), requeue=True) from exc
            raise
        finally:
            answered = self._release(lease, settings, heartbeat, success=success)
            if lease.lost and answered and not requeued:
                self._hand_on_after_loss(lease, settings, args, kwargs, request)

    def _hand_on_after_loss(
        self,
        lease: Lease,
        settings: LockSettings,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        request: Any,
    ) -> None:
        """Send a copy of the message of a run that lost its lease to another grant.

        Whatever the run's outcome, Celery acks its message, and that ack may take the message
        of the copy granted the request since, if that copy has the same task id: a Redis
        visibility-timeout redelivery keeps the message's delivery tag, and the ack of either
        removes both; on Celery 5.7, a copy whose worker is lost after this run stored SUCCESS
        under the shared id is acked as "succeeded before the worker was lost". Should that copy
        die, nothing would bring the request back. The copy sent here does: it waits while its
        task id holds the request, is acked quietly once a done-marker is there, and runs the
        request if the holder died. Sent when the request is held by this task id, or held by
        nobody, not done, with a fence above this run's (granted since, to a holder that died,
        its lease lapsed). Not sent for a lease lost with nobody granted since (a store down
        longer than the TTL, or restarted with its fences lost), or held by another task id, or
        done: this run's outcome stands, as before (a copy would run such requests twice).
        Called only when the release got an answer: a store that did not answer is not asked
        again (the pool process would wait out another socket timeout).
        """
        if request.is_eager or request.called_directly or lease.retry_sent:
            return  # nothing acked, or a retry of this task id is on its way already
        if lease.handed_on is not None:
            return  # the replacement carries the request on
        if not lease.store.granted_again(lease):
            return  # another task id's message is not this one's to take, or done, or nobody's
        with contextlib.suppress(Ignore):
            self._defer(args, kwargs, lease.keys, "lost", lease.holder.task_id, settings.ttl_ms)

    def _store_started(self, request: Any) -> None:
        """Store ``STARTED`` for the run that holds the lease, as Celery's trace would have
        stored it for every delivery (:meth:`on_bound`)."""
        if request.is_eager or request.called_directly or _ignores_result(self, request):
            return
        self.backend.store_result(
            request.id,
            {"pid": os.getpid(), "hostname": request.hostname},
            STARTED,
            request=request,
        )

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's :meth:`~celery.app.task.Task.retry`, noting on the run's lease that the
        retry was published, so that the lease is released without a done-marker however the
        body ends (``throw=False``, or ``Retry`` caught and a value returned).

        The retry carries this task id: released with a done-marker, the request would look
        finished by this very task, and the retry would be acked unrun as a redelivery of a
        message that succeeded.

        The retry is published as a deferred copy is (:func:`~celery_lock.delivery.copy_delivery`),
        where the call does not say otherwise: with the serializer its message came in, and,
        on RabbitMQ's native delayed delivery, a countdown in whole seconds (at least 1) and
        the queue it came from. As Celery publishes it, with the task's serializer (an
        argument only the message's can carry), a countdown under a second (refused) or
        routed by the default queue's routing key, the publish fails and Celery rejects the
        message without requeue, or the retry leaves its queue: the request is lost. Unless the
        call passes other arguments, the retry also keeps the caller's ``argsrepr`` and
        ``kwargsrepr``, which Celery's copy of the request drops (events and Flower would show
        the arguments they hide), and the call's ``ignore_result``, which Celery before 5.6.3
        drops (the retry would store the result the caller declined).

        A retry whose publish the broker cannot take for now gives the message back to the
        broker (``Reject`` with requeue), where Celery would reject it without: the request,
        neither done nor handed on, would be lost. The run's lease is left to lapse by its TTL
        rather than released, so the message, back at once, waits as a redelivery of a running
        one instead of running the body again at once, for as long as the broker refuses.
        """
        request = self.request
        if not (request.is_eager or request.called_directly):
            self._deliver_retry_as_it_came(request, args, kwargs)
        try:
            signature = super().retry(*args, **kwargs)
        except Retry:
            self._note_retry_sent()
            raise
        except Reject as rejected:
            # Celery rejects the message without requeue when the retry's publish fails: the
            # request, neither done nor handed on, would be lost. Where the broker could not
            # take it for now, it is given back, as a deferral whose publish fails is. A
            # publish that fails every time (an argument the serializer cannot encode) is left
            # to Celery: given back, the body would run again and again, with nothing to stop it.
            reason = getattr(rejected, "reason", None)  # celery-types has neither attribute
            if getattr(rejected, "requeue", True) or not isinstance(reason, _BROKER_FOR_NOW):
                raise
            self._leave_lease_to_lapse(request)
            raise Reject(reason, requeue=True) from rejected
        self._note_retry_sent()
        return signature

    def _deliver_retry_as_it_came(
        self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Add to ``retry``'s keyword arguments ``kwargs`` what its copy must keep of the
        message (see :meth:`retry`), where ``args`` and ``kwargs`` do not name it."""
        positional = dict(zip(_RETRY_PARAMETERS, args, strict=False))
        given = {**positional, **kwargs}
        eta, countdown = given.get("eta"), given.get("countdown")
        if not eta and countdown is None:
            countdown = self.default_retry_delay  # as Celery's retry does
        delay, delivery = copy_delivery(self.app, request, float(countdown or 0))
        for name, value in delivery.items():  # serializer; queue on native delayed delivery
            kwargs.setdefault(name, value)
        # Celery before 5.6.3 copies the request without the call's ignore_result.
        kwargs.setdefault("ignore_result", _ignores_result(self, request))
        if not eta and countdown and delay != countdown and "countdown" not in positional:
            kwargs["countdown"] = delay  # rounded up to whole seconds
        if given.get("args") is None and given.get("kwargs") is None:
            for name, value in _shown_arguments(request).items():
                kwargs.setdefault(name, value)

    def _leave_lease_to_lapse(self, request: Any) -> None:
        """Let this run's lease lapse by its TTL, unextended and unreleased: the message it
        gives back finds the request held by its own task id, and waits (deferred as a
        redelivery) instead of running the body again at once, on every delivery while the
        broker refuses. Once the lease lapses, a copy runs the request again."""
        lease: Lease | None = getattr(request, "lock_lease", None)
        if lease is not None and not lease.released:
            lease.released = True  # the body's release, on its way out, leaves it
            get_runtime(self.app).heartbeat.discard(lease)

    def _note_retry_sent(self) -> None:
        request = self.request
        lease: Lease | None = getattr(request, "lock_lease", None)
        # Eager or direct, Celery publishes nothing: no copy is on its way.
        if lease is not None and not (request.is_eager or request.called_directly):
            lease.retry_sent = True

    def on_replace(self, sig: Signature[Any]) -> Any:
        """Hand the request on to ``sig``: release this run's lease with a hand-on marker,
        then send ``sig`` as Celery does.

        Released first because the replacement inherits this task id: sent first, a
        replacement locked on the same request (a paginating task replacing itself) would find
        the lease held by its own task id and wait for it to lapse, or, eager, fail with
        :class:`LockContendedError`. The hand-on marker (see :class:`~celery_lock.lease.Done`)
        makes later copies of this request skip, and acks a redelivery of this message, as
        after a success; the replacement, which Celery sends one replacement deeper
        (``replaced_task_nesting``) in the same canvas (root id), gets through, and so does each
        step of it (a chain's) and each of its own replacements. The marker is written as not yet
        sent (``HANDING_ON``) and confirmed once ``sig`` went out: a redelivery of this message
        that finds it unconfirmed (its run died while sending) runs the request again. If sending
        ``sig`` fails, the marker is withdrawn: no replacement will run the request.

        Eager, in a direct call (no task id to name), and where this Celery sends a replacement
        without its depth (before 5.3.5), the lease is released without a marker, and later
        copies run the replaced body again.
        """
        request = self.request
        lease: Lease | None = getattr(request, "lock_lease", None)
        if lease is None:
            return super().on_replace(sig)
        heartbeat = get_runtime(self.app).heartbeat
        settings = self.lock_settings()
        # A direct call has no task id, and its replacement gets one of its own: a marker
        # naming no id would skip the replacement too.
        hand_on = _REPLACEMENTS_KEEP_THEIR_DEPTH and not (
            request.is_eager or request.called_directly
        )
        if hand_on:
            lease.handed_on = HandOn(request.replaced_task_nesting or 0, _root_id(request))
        marked = False
        try:
            # A release left to the heartbeat writes no marker: nothing to confirm.
            marked = self._release(lease, settings, heartbeat, success=hand_on) and hand_on
            # Eager, replace() returns and the body goes on, without the lease: check_lock()
            # must say so.
            request.lock_lost = True
            return super().on_replace(sig)
        except Ignore:  # sent: the replacement runs the request
            if marked:
                self._confirm_hand_on(lease, settings)
            raise
        except BaseException:
            # Not sent, or not known to be: a soft time limit or a signal's exception may
            # have come during the release, after it wrote the marker. The task fails and its
            # message is acked, so no redelivery would withdraw it.
            if hand_on:
                self._withdraw_hand_on(lease)
            raise

    def _confirm_hand_on(self, lease: Lease, settings: LockSettings) -> None:
        """The replacement was sent: say so in the hand-on marker, so that a redelivery of this
        message is acked unrun instead of running the request again."""
        try:
            lease.store.confirm_hand_on(lease, settings.done_ttl_ms)
        except LockStoreError as exc:
            logger.warning(
                "celery-lock: %s stays marked as being handed on by task %s, whose replacement "
                "was sent (%s): a redelivery of this message would run the request again",
                lease.keys.done,
                lease.holder.task_id,
                exc,
            )

    def _withdraw_hand_on(self, lease: Lease) -> None:
        """The replacement was not sent: delete the hand-on marker ``lease``'s release wrote,
        so that a later copy runs the request."""
        assert lease.handed_on is not None
        try:
            lease.store.withdraw_hand_on(lease.keys, lease.holder.task_id, lease.handed_on)
        except LockStoreError as exc:
            logger.error(
                "celery-lock: %s stays marked as handed on by task %s, whose replacement was "
                "not sent (%s): later copies are skipped until `celery lock forget %s`",
                lease.keys.done,
                lease.holder.task_id,
                exc,
                lease.keys.done,
            )

    def _release(
        self, lease: Lease, settings: LockSettings, heartbeat: Heartbeat, *, success: bool
    ) -> bool:
        """Stop extending ``lease`` and delete the lock, writing the done-marker on success.
        Return whether the store answered now (not: released before, or left to the heartbeat,
        or given up)."""
        if lease.released:
            return False
        try:
            lease.released = True
            # Out of the heartbeat first: an extend that meets the release is not a loss.
            heartbeat.discard(lease)
            owned = lease.store.release(lease, success=success, done_ttl_ms=settings.done_ttl_ms)
        except LockStoreError as exc:
            # The task's own outcome stands. A lease still held may well outlast the outage (a
            # failover, BUSY, a restart that keeps its data): given up now, a run that succeeded
            # would leave no done-marker, and a copy coming after the lease lapsed would run
            # again. Anything else (a lease already lapsed, a refusal for good) lapses by its TTL.
            later = isinstance(exc, LockStoreUnavailableError) and not lease.expired
            logger.error(
                "celery-lock: release of %s for task %s failed: %s%s",
                lease.keys.lock,
                lease.holder.task_id,
                exc,
                "; the heartbeat tries again while the lease lasts" if later else "",
            )
            if later:
                # A hand-on marker written later might announce a replacement whose send
                # failed meanwhile: a hand-on released late writes none.
                mark = success and lease.handed_on is None
                heartbeat.release_later(
                    lease,
                    success=mark,
                    done_ttl_ms=settings.done_ttl_ms,
                    then=lambda owned: self._released(lease, success=mark, owned=owned),
                )
            return False
        except BaseException:
            # Raised inside, perhaps before the script left: a signal's exception or a greenlet
            # killed (as at the acquire). Extended on by the heartbeat, or let go by it and
            # missed by the shutdown's hand-back, the lease would outlive the task: let go of
            # it and release once more (a first try that did run leaves nothing to do).
            heartbeat.discard(lease)
            with contextlib.suppress(LockStoreError):
                lease.store.release(lease, success=success, done_ttl_ms=settings.done_ttl_ms)
            raise
        if owned is False or signals.lock_released.receivers:  # else _released does nothing
            self._released(lease, success=success, owned=owned)
        return True

    def _released(self, lease: Lease, *, success: bool, owned: bool | None) -> None:
        """Report a release that got an answer: ``owned``, whether the lease was still held
        (``None``: a try whose reply was lost may have released it, or it was lost)."""
        if owned is False:
            # Lost while held, unseen till now (the body let go before the heartbeat's next
            # beat): told as the heartbeat would have (once: mark_lost does nothing again).
            lease.mark_lost()
            logger.warning(
                "celery-lock: lease on %s was no longer held by task %s at release",
                lease.keys.lock,
                lease.holder.task_id,
            )
        if signals.lock_released.receivers:  # what send() asks first, without its call
            signals.lock_released.send(
                sender=self, task_id=lease.holder.task_id, lock_key=lease.keys.lock,
                success=success and owned is True, owned=owned,
            )  # fmt: skip

    def _lease_lost_callback(self, request: Any) -> Callable[[Lease], None]:
        hostname = None if request.is_eager else request.hostname
        name = _shown_name(self, request)
        # Weakly: the request holds the lease (``lock_lease``) and the lease holds this
        # callback, and that cycle, left to the garbage collector once per task, grew a worker's
        # RSS by ~6 bytes per task (580 KiB over 100k tasks). Once the request is gone, nobody
        # can read its flag.
        request_ref = weakref.ref(request)

        def lease_lost(lease: Lease) -> None:
            running = request_ref()
            if running is not None:
                running.lock_lost = True
            signals.lock_lost.send(
                sender=self, task_id=lease.holder.task_id, lock_key=lease.keys.lock
            )
            send_task_event_apart(
                self,
                TASK_LOCK_LOST,
                lease.holder.task_id,
                hostname,
                name=name,
                lock_key=lease.keys.lock,
                result=f"lock lost: {lease.keys.lock}",
            )

        return lease_lost

    def _skip(
        self,
        keys: RequestKeys,
        reason: str,
        holder: str,
        settings: LockSettings,
        handed_on_at: int | None = None,
    ) -> Any:
        request: Any = self.request
        logger.info(
            "celery-lock: skipping task %s: %s %s by task %s", request.id, keys.lock, reason, holder
        )
        signals.lock_skipped.send(
            sender=self, task_id=request.id, lock_key=keys.lock, reason=reason, holder=holder
        )
        # task-skipped is sent by the worker's main process (LockedRequest), which alone knows
        # whether the worker sends task events now.
        meta = skipped_marker(keys.lock, reason, holder, self.name, handed_on_at)
        if request.called_directly:
            # A direct call is plain Python: it gets the marker, not Celery's Ignore.
            return meta
        if settings.skip_as_success:
            # A copy completed as SUCCESS reaches the main process as a success, with only its
            # result's repr: the pool process sends task-skipped itself, as the worker's
            # switch stood when the process started (like task-lock-lost). Apart: a broker
            # that hangs would hold the pool's slot as long.
            if not request.is_eager:
                fields = SkippedCopy(keys.lock, reason, holder, handed_on_at).event_fields()
                send_task_event_apart(
                    self, TASK_SKIPPED, request.id, request.hostname,
                    name=_shown_name(self, request), **fields,
                )  # fmt: skip
            return meta
        if request.id and not request.is_eager and not _ignores_result(self, request):
            store_skipped(self, request.id, meta)
        skipped = SkippedCopy(keys.lock, reason, holder, handed_on_at)
        if request.is_eager and self.store_eager_result:
            # Where an eager holder's result is stored: an EagerResult knows no backend, and
            # follow() reads the holder's result there.
            skipped.backend = self.backend
        return _Ignored(skipped)

    def _defer(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        keys: RequestKeys,
        reason: str,
        holder: str,
        pttl_ms: int,
        exc: Exception | None = None,
    ) -> NoReturn:
        """Hand the copy back to the broker to try again later; never drop it.

        The new message keeps the task id and the ``retries`` count (so deferring does not use
        up ``max_retries``); its deferrals are counted in a header of their own. A redelivered
        copy of a running message stores no state (RETRY would overwrite its holder's state);
        other deferrals show as RETRY.
        """
        request = self.request
        if request.is_eager or request.called_directly:
            if exc is not None:
                raise exc
            raise LockContendedError(keys.lock, holder, _made_inside(holder, keys.lock, request))
        headers = {
            name: value
            for name, value in (request.headers or {}).items()
            if name not in X_DEATH_HEADERS
        }
        deferrals = int(headers.get(DEFERRALS_HEADER) or getattr(request, DEFERRALS_HEADER, 0) or 0)
        headers[DEFERRALS_HEADER] = deferrals + 1
        # Celery gives whatever a running task publishes without a parent_id the running task
        # for its parent: a copy of a top-level call would be its own parent. Celery lays the
        # headers given over its own, so this one keeps the message's (None included).
        headers["parent_id"] = request.parent_id
        delay = within_visibility(self.app, self._defer_delay(deferrals, pttl_ms))
        countdown, options = copy_delivery(self.app, request, delay)
        options.update(_shown_arguments(request))
        # Celery before 5.6.3 copies a request without the call's ignore_result: the copy
        # would take the task's, and store the result the caller declined.
        options["ignore_result"] = _ignores_result(self, request)
        if reason in _UNSTORED_REASONS:
            # A copy of a message already running (or whose holder died) waits for its
            # outcome: accepted before it expired, it must not expire while it waits, which
            # would store REVOKED under the task id the original runs as.
            options["expires"] = None
        signature = self.signature_from_request(
            request, args, kwargs, countdown=countdown, retries=request.retries, headers=headers,
            **options,
        )  # fmt: skip
        logger.info(
            "celery-lock: deferring task %s by %.1fs: %s %s (holder %s)",
            request.id,
            countdown,
            keys.lock,
            reason,
            holder or "-",
        )
        try:
            signature.apply_async()
        except Exception as publish_error:
            # Not handed on: give the message back to the broker instead of acking it.
            raise Reject(publish_error, requeue=True) from publish_error
        signals.lock_deferred.send(
            sender=self,
            task_id=request.id,
            lock_key=keys.lock,
            reason=reason,
            holder=holder,
            countdown=countdown,
        )
        if reason in _UNSTORED_REASONS:
            raise Ignore()
        raise Retry(f"celery-lock: {reason}", exc, when=countdown, sig=signature)  # type: ignore[arg-type]

    @staticmethod
    def _defer_delay(deferrals: int, pttl_ms: int) -> float:
        """Exponential backoff from DEFER_MIN_DELAY, capped by the holder's remaining lease and
        by DEFER_MAX_DELAY, then jittered by ±20 %.

        With no holder (``pttl_ms <= 0``: the lock store was unreachable) only the backoff
        and DEFER_MAX_DELAY bound the wait.
        """
        backoff = DEFER_MIN_DELAY * 2 ** min(deferrals, 16)
        lapse = max(pttl_ms / 1000, DEFER_MIN_DELAY) if pttl_ms > 0 else DEFER_MAX_DELAY
        jitter = random.uniform(0.8, 1.2)
        return float(min(backoff, lapse, DEFER_MAX_DELAY) * jitter)


def _cut_by_cold_shutdown(exc: BaseException, request: Any, lease: Lease) -> bool:
    """Whether ``exc`` is how a worker's cold shutdown (``SIGQUIT``, a second Ctrl+C, the end
    of ``worker_soft_shutdown_timeout``) cut a run short in the worker's own process.

    A prefork worker's message survives a cold shutdown: its pool process dies, and the
    message goes back to the broker. Where the body runs in the worker's own process, Celery
    5.5 and later cut it short in place: under ``-P solo`` the shutdown's
    ``cancel_active_requests`` calls ``terminate_job``, which raises ``NotImplementedError``
    in the body, and Celery acks the failure; under gevent and eventlet it kills the body's
    greenlet (``GreenletExit``), and Celery acks that as a success with no result. Either way
    the request, never done, was lost. Nothing else is taken for it: a body's own error stays
    a failure (under threads, and under solo before Celery 5.5, the body runs to its end).
    """
    if request.is_eager or request.called_directly or lease.retry_sent:
        return False  # a retry sent: the request is on its way already
    if isinstance(exc, NotImplementedError):
        # Raised from the signal's handler, so the handler's frames are in the traceback.
        frames = traceback.walk_tb(exc.__traceback__)
        return any(frame.f_code.co_name == "cancel_active_requests" for frame, _ in frames)
    greenlet = sys.modules.get("greenlet")
    if greenlet is None or not isinstance(exc, greenlet.GreenletExit) or green_pool() is None:
        return False  # a GreenletExit of the body's own, under prefork or threads, is its own
    from celery.worker import state  # noqa: PLC0415 - on this exception path alone

    # A revoke(terminate=True) kills the greenlet too, and puts the task id in the worker's
    # revoked set first (and acks the message itself): that one ends REVOKED, not given back.
    return request.id not in state.revoked


def _root_id(request: Any) -> str:
    """The root task id of ``request``'s canvas, as Celery sends it: its own id when it has
    none (Celery's ``as_task_v2`` gives a message without one its task id)."""
    return str(request.root_id or request.id or "")


def _not_a_str_id(task_id: object) -> str:
    """What is wrong with a task id that is not a ``str`` (an int or a UUID a caller passed)."""
    return (
        f"celery-lock: task id {task_id!r} is a {type(task_id).__name__}, not a str: the "
        "request's lock and done-marker name their holder by it as text (pass str(task_id))"
    )
