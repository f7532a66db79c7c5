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

from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult

from .states import SKIPPED

__all__ = ["follow"]


def follow(
    result: AsyncResult[Any],
    timeout: float | None = None,
    interval: float = 0.1,
    propagate: bool = True,
    max_hops: int = 8,
) -> Any:
    """The return value of ``result``, or of the task its skipped copy deferred to.

    Args:
        result: the ``AsyncResult`` of a :class:`~celery_lock.LockedTask` call.
        timeout: seconds to wait in all, ``None`` for no limit.
        interval: seconds between polls of the result backend.
        propagate: re-raise the task's exception, as ``AsyncResult.get`` does.
        max_hops: how many skipped copies to follow before giving up.

    Raises:
        celery.exceptions.TimeoutError: nothing was ready within ``timeout``.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    current = result
    for _ in range(max_hops + 1):
        while True:
            state = current.state
            if state == SKIPPED or current.ready():
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise CeleryTimeoutError(f"task {current.id} not ready after {timeout}s")
            time.sleep(interval)
        if state != SKIPPED:
            return current.get(timeout=_left(deadline), interval=interval, propagate=propagate)
        holder = (current.info or {}).get("holder")
        if not holder or holder == current.id:
            return None
        current = AsyncResult(holder, app=result.app)
    raise CeleryTimeoutError(f"followed {max_hops} skipped copies from task {result.id}")


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
