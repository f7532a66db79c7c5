"""Waiting on a copy that may have been skipped.

``SKIPPED`` is not a ready state, so ``AsyncResult.get()`` of a skipped copy would wait for ever.
:func:`follow` waits for the copy to be ready *or* skipped, and follows a skipped copy to the task
that holds (or completed) its request::

    result = process.delay(42)
    value = follow(result, timeout=30)
"""

from __future__ import annotations

import time
from typing import Any

import redis
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult
from celery.states import PENDING

from .config import LockSettings
from .exceptions import CeleryLockError, ResultUnavailableError
from .lease import decode_lock
from .runtime import get_runtime
from .states import SKIPPED
from .store import LockStore

__all__ = ["follow"]


def follow(
    result: AsyncResult[Any],
    timeout: float | None = None,
    interval: float = 0.1,
    propagate: bool = True,
    max_hops: int = 8,
    grace: float = 5.0,
) -> Any:
    """The return value of ``result``, or of the task its skipped copy deferred to.

    Args:
        result: the ``AsyncResult`` of a :class:`~celery_lock.LockedTask` call.
        timeout: seconds to wait in all, ``None`` for no limit.
        interval: seconds between polls of the result backend.
        propagate: re-raise the task's exception, as ``AsyncResult.get`` does.
        max_hops: how many skipped copies to follow before giving up.
        grace: seconds a holder's result may take to reach the backend once its lease is gone.

    Raises:
        celery.exceptions.TimeoutError: nothing was ready within ``timeout``.
        celery_lock.ResultUnavailableError: the holder no longer holds the request and its
            result did not reach the backend within ``grace`` (it ignores results, they
            expired, or it died and was not redelivered yet).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    current = result
    holding: _Holding | None = None
    for _ in range(max_hops + 1):
        released_at: float | None = None
        while True:
            state = current.state
            if state == SKIPPED or current.ready():
                break
            now = time.monotonic()
            if holding is not None and state == PENDING:
                # PENDING is also what a result that never comes looks like: ask the lock store.
                if holding.still_held():
                    released_at = None
                elif released_at is None:
                    released_at = now
                elif now - released_at >= grace:
                    raise ResultUnavailableError(current.id, holding.lock_key)
            if deadline is not None and now >= deadline:
                raise CeleryTimeoutError(f"task {current.id} not ready after {timeout}s")
            time.sleep(interval)
        if state != SKIPPED:
            return current.get(timeout=_left(deadline), interval=interval, propagate=propagate)
        skipped = current.info or {}
        holder = skipped.get("holder")
        if not holder or holder == current.id:
            return None
        holding = _Holding(result.app, holder, skipped)
        current = AsyncResult(holder, app=result.app)
    raise CeleryTimeoutError(f"followed {max_hops} skipped copies from task {result.id}")


class _Holding:
    """Whether the task a skipped copy named still holds the copy's request."""

    def __init__(self, app: Celery, holder: str, skipped: dict[str, Any]) -> None:
        self.app = app
        self.holder = holder
        self.lock_key = str(skipped.get("lock_key", ""))
        self.task_name = skipped.get("task")
        # A copy skipped as done was skipped after its holder had finished.
        self.finished = skipped.get("reason") == "done"

    def still_held(self) -> bool:
        if self.finished:
            return False
        try:
            value = self._store().client.get(self.lock_key)
            return value is not None and decode_lock(value).holder.task_id == self.holder
        except (redis.RedisError, CeleryLockError):
            return True  # the store cannot tell: keep waiting, as for a running holder
        except (ValueError, KeyError, TypeError):
            return False  # not a lock celery-lock wrote: nobody holds it for the holder

    def _store(self) -> LockStore:
        """The lock store of the skipped copy's task: its own settings when this app knows
        the task, else the app's."""
        runtime = get_runtime(self.app)
        task = self.app.tasks.get(self.task_name) if self.task_name else None
        options = getattr(task, "_lock_task_options", None)
        if task is None or options is None:
            return runtime.store_for(LockSettings.resolve(self.app.conf))
        return runtime.store_for(runtime.settings(task.name, options))


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
