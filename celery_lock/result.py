"""Waiting on a copy that may have been skipped.

``SKIPPED`` is not a ready state, so ``AsyncResult.get()`` of a skipped copy would wait for ever.
:func:`follow` waits for the copy to be ready *or* skipped, and follows a skipped copy to the task
that holds (or completed) its request::

    result = process.delay(42)
    value = follow(result, timeout=30)
"""

from __future__ import annotations

import logging
import math
import numbers
import time
import weakref
from typing import Any

import redis
from celery import Celery
from celery.backends.base import DisabledBackend
from celery.backends.rpc import RPCBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult, EagerResult, assert_will_not_block  # type: ignore[attr-defined]

from .config import LockSettings
from .exceptions import ConfigurationError, LockStoreUnavailableError, ResultUnavailableError
from .keys import RequestKeys
from .lease import decode_done
from .request import SkippedCopy
from .runtime import get_runtime
from .states import SKIPPED
from .store import LockStore
from .task import LockedTask

__all__ = ["follow"]


logger = logging.getLogger(__name__)
#: The apps follow() has warned for that it cannot tell where their lock store is: once per
#: app and process, not per call (follow may run on every web request).
_warned_no_store: weakref.WeakSet[Celery] = weakref.WeakSet()


def follow(
    result: AsyncResult[Any],
    timeout: float | None = None,
    interval: float = 0.1,
    propagate: bool = True,
    max_hops: int = 8,
    grace: float = 5.0,
    disable_sync_subtasks: bool = True,
) -> Any:
    """The return value of ``result``, or of the task its skipped copy deferred to.

    Args:
        result: the ``AsyncResult`` of a :class:`~celery_lock.LockedTask` call.
        timeout: seconds to wait in all, ``None`` for no limit.
        interval: seconds between polls of the result backend.
        propagate: re-raise the task's exception, as ``AsyncResult.get`` does.
        max_hops: how many skipped copies to follow before giving up.
        grace: seconds a finished holder's result may take to reach the backend.
        disable_sync_subtasks: refuse to wait inside a task, as ``AsyncResult.get`` does
            (``False``: wait there too, at the risk Celery's docs describe).

    Raises:
        TypeError: ``result`` is not one ``AsyncResult`` (a group's ``GroupResult``: follow each
            of its ``results``).
        ValueError: ``timeout`` or ``grace`` is negative or not finite, ``interval`` is not
            more than 0, or ``max_hops`` is not a whole number of 0 or more (TypeError where
            one is not a number at all), before any wait.
        RuntimeError: called inside a task (with ``disable_sync_subtasks``), before any wait.
        celery.exceptions.TimeoutError: nothing was ready within ``timeout``.
        celery_lock.ConfigurationError: the copy was skipped, and the result backend is
            ``rpc://``, from which a holder's result cannot be had reliably.
        celery_lock.ResultUnavailableError: the holder completed the request, but its result
            did not reach the backend within ``grace`` (it ignores results, they expired, or
            it died before storing its result).

    The result of a call that ignores its result (``ignore_result``) is ``None`` at once, as
    ``AsyncResult.get`` returns it.

    When this app cannot tell where the lock store is (no ``celery_lock_redis_url``, and a
    broker that is not Redis), ``follow`` cannot read whether a holder completed: it logs a
    warning (once per app and process) and waits for the holder's result, up to ``timeout``.
    """
    if not isinstance(result, AsyncResult):  # an EagerResult is one
        raise TypeError(
            f"follow() takes one AsyncResult, not a {type(result).__name__}: follow each of "
            "its results instead"
        )
    _check_arguments(timeout=timeout, interval=interval, max_hops=max_hops, grace=grace)
    if getattr(result, "ignored", False):
        # A call made with ignore_result stores no state to wait for, skipped or not:
        # AsyncResult.get returns None for it at once, and so does follow.
        return None
    if disable_sync_subtasks:
        # At once, as AsyncResult.get checks: the polls below would otherwise hold a pool
        # process for the holder's whole run before the last get() refused.
        assert_will_not_block()
    deadline = None if timeout is None else time.monotonic() + timeout
    current = result
    holding: _Holding | None = None
    for _ in range(max_hops + 1):
        finished_at: float | None = None
        while True:
            # The state and the skip's meta in one read, as AsyncResult.state reads them (from
            # its cache once ready; an EagerResult's own): an rpc:// backend hands each state
            # message to one read only, so reading .state then .info found the skip gone.
            meta = current._get_task_meta()  # type: ignore[attr-defined]
            state = meta["status"]
            if state == SKIPPED or current.ready():  # ready: from the cache, an Eager's own
                break
            now = time.monotonic()
            if holding is not None:
                # A state that is not ready may never change: PENDING is what a result that a
                # finished holder did not store (it ignores results), or that expired, looks
                # like; and under task_track_started a holder killed after writing its
                # done-marker but before storing its result stays STARTED for ever.
                if finished_at is None and holding.finished():
                    finished_at = now
                if finished_at is not None and now - finished_at >= grace:
                    raise ResultUnavailableError(current.id, holding.lock_key)
            if deadline is not None and now >= deadline:
                raise CeleryTimeoutError(f"task {current.id} not ready after {timeout}s")
            time.sleep(interval)
        if isinstance(current, EagerResult) and isinstance(current.result, SkippedCopy):
            return _eager_skip_followed(current, current.result, propagate)
        if state != SKIPPED:
            return current.get(
                timeout=_left(deadline),
                interval=interval,
                propagate=propagate,
                disable_sync_subtasks=disable_sync_subtasks,
            )
        skipped = meta.get("result") or {}
        holder = skipped.get("holder")
        if not holder or holder == current.id:
            return None
        if isinstance(current.backend, RPCBackend):
            # Each state reaches one reader of the sender's reply queue, once: the holder's
            # result may have gone to another client, or to an earlier read of this one.
            raise ConfigurationError(
                "result_backend",
                f"follow() cannot follow skipped task {current.id} to its holder {holder} on "
                "an rpc:// backend, which hands each result to one reader once; use a result "
                "backend that stores results (Redis, a database)",
            )
        holding = _Holding(result.app, holder, skipped)
        # In the copy's backend: a task with a result backend of its own stores its holders'
        # results there too, not in the app's.
        current = AsyncResult(holder, backend=current.backend, app=result.app)
    raise CeleryTimeoutError(f"followed {max_hops} skipped copies from task {result.id}")


class _Holding:
    """Whether the task a skipped copy named has finished its request."""

    def __init__(self, app: Celery, holder: str, skipped: dict[str, Any]) -> None:
        self.app = app
        self.holder = holder
        self.lock_key = str(skipped.get("lock_key", ""))
        self.task_name = skipped.get("task")
        # Skipped as done: the holder had finished before the copy was skipped; unless it
        # handed the request on (self.replace), and its replacement, which stores the result
        # under the holder's task id, may still be to run.
        self._finished = skipped.get("reason") == "done" and "handed_on_at" not in skipped
        self._lock_store: LockStore | None = None
        # This app cannot tell where the lock store is (found on the first try).
        self._unreadable = False

    def finished(self) -> bool:
        """Whether the holder completed the request: its done-marker names it.

        A holder skipped as ``running`` is a copy of the same task (a copy of another task in
        the scope is deferred, never skipped), so its done-marker is the copy's task's. A holder
        that died or failed writes none: its rerun, or its ``FAILURE``, is still to come.
        """
        if self._finished or not self.task_name or self._unreadable:
            return self._finished
        done_key = RequestKeys.of_lock(self.lock_key, self.task_name).done
        try:
            if self._lock_store is None:
                self._lock_store = self._store()
            done = self._lock_store.client.get(done_key)
        except (redis.RedisError, LockStoreUnavailableError):
            # The store cannot tell: keep waiting, as for a running holder.
            return False
        except ConfigurationError as exc:
            # No lock store known here: a holder that stores its result is still followed,
            # but one that completed without storing it would be waited for in silence.
            self._unreadable = True  # nothing to ask from now on
            if self.app in _warned_no_store:
                return False
            _warned_no_store.add(self.app)
            logger.warning(
                "celery-lock: follow() cannot tell whether task %s completed %s, so it waits "
                "for its result (up to the timeout): %s; configure the lock store on the app "
                "that calls follow(), as on the workers",
                self.holder,
                self.lock_key,
                exc,
            )
            return False
        if done is not None:
            marker = decode_done(done)
            # A hand-on marker: the replacement (another task, or this one again) is to come.
            self._finished = marker.handed_on_at is None and marker.task_id == self.holder
        return self._finished

    def _store(self) -> LockStore:
        """The lock store of the skipped copy's task: its own settings when this app knows
        the task, else the app's.

        Raises:
            ConfigurationError: this app cannot tell where the lock store is.
        """
        task = self.app.tasks.get(self.task_name) if self.task_name else None
        if isinstance(task, LockedTask):
            settings = task.lock_settings()
        else:
            settings = LockSettings.resolve(self.app.conf)
        return get_runtime(self.app).store_for(settings)


def _eager_skip_followed(copy: EagerResult[Any], skipped: SkippedCopy, propagate: bool) -> Any:
    """The value of the task an eager copy was skipped in favour of, where the task stores
    eager results (``task_store_eager_result``) and the holder's is there and ready; else
    ``None``, as the copy's own ``get()``, at once: an eager call waits for nothing. One read of
    the backend; a backend that fails it, or ``rpc://`` (whose reads take a state off the reply
    queue), gives ``None`` too."""
    backend, holder = skipped.backend, skipped.holder
    if backend is None or not holder or holder == copy.id:
        return None
    if isinstance(backend, (DisabledBackend, RPCBackend)):
        return None
    held: AsyncResult[Any] = AsyncResult(holder, backend=backend, app=backend.app)
    try:
        ready = held.ready()
    except Exception as exc:  # any backend's error: nothing to follow to
        logger.debug("celery-lock: cannot read the result of %s: %s", holder, exc)
        return None
    # Ready: the get() that follows waits for nothing, inside a task or not.
    return held.get(propagate=propagate, disable_sync_subtasks=False) if ready else None


def _check_arguments(
    *, timeout: float | None, interval: float, max_hops: int, grace: float
) -> None:
    """Refuse what would wait for ever (``timeout=nan``), fail only after a first wait
    (``interval=-1``), or poll the backend without a pause (``interval=0``)."""
    if timeout is not None:
        _check_seconds("timeout", timeout, zero_allowed=True)
    _check_seconds("interval", interval, zero_allowed=False)
    _check_seconds("grace", grace, zero_allowed=True)
    if isinstance(max_hops, bool) or not isinstance(max_hops, numbers.Integral):
        raise TypeError(f"follow() max_hops must be a whole number, got {max_hops!r}")
    if max_hops < 0:
        raise ValueError(f"follow() max_hops must be 0 or more, got {max_hops!r}")


def _check_seconds(name: str, seconds: float, *, zero_allowed: bool) -> None:
    # numbers.Real: a NumPy number too; not a Decimal, which time.sleep would refuse later.
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise TypeError(f"follow() {name} must be a number of seconds, got {seconds!r}")
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero_allowed):
        bound = "0 or more" if zero_allowed else "more than 0"
        raise ValueError(f"follow() {name} must be {bound} seconds, got {seconds!r}")


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
