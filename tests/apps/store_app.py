"""A Celery app for the lock-store fault tests: its lock store is a redis-server of its own.

The broker, the result backend and the record live on one server; the lock store on another, so
a test can stop, restart or pause the lock store alone. Configured from the environment:
``STORE_BROKER_URL``, ``STORE_BACKEND_URL``, ``STORE_LOCK_URL``, ``STORE_RECORD_URL`` (where runs
are recorded); ``STORE_LOCK_TTL`` (lease TTL in seconds, default 5); ``STORE_FAIL_OPEN`` (``1``
runs bodies unlocked while the lock store is down).

Every body appends a ``run`` entry to ``store:runs`` when it ends: its task id, fence (``None``
when it ran unlocked), how often its message had been deferred, its monotonic interval and
whether its lease was lost meanwhile. celery-lock's deferrals, lost leases and releases are
recorded from its signals in ``store:deferred``, ``store:lost`` and ``store:released``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery_lock import LockedTask
from celery_lock.signals import lock_deferred, lock_lost, lock_released
from celery_lock.task import DEFERRALS_HEADER
from tests.apps.common import Recorder, worker_test_app

RUNS_KEY = "store:runs"
DEFERRED_KEY = "store:deferred"
LOST_KEY = "store:lost"
RELEASED_KEY = "store:released"

app = worker_test_app(
    "store",
    "STORE",
    celery_lock_ttl=float(os.environ.get("STORE_LOCK_TTL", "5")),
    celery_lock_fail_open=os.environ.get("STORE_FAIL_OPEN", "") == "1",
)
_append = Recorder("STORE").append


@app.task(base=LockedTask, bind=True, lock_key="request_idx", max_retries=0, name="store.work")
def work(self: Any, request_idx: int, seconds: float = 0.05) -> int:
    """Sleeps ``seconds``; ``max_retries=0``: a deferral must not count as a retry."""
    started = time.monotonic()
    time.sleep(seconds)
    request = self.request
    deferrals = (request.headers or {}).get(DEFERRALS_HEADER) or getattr(
        request, DEFERRALS_HEADER, 0
    )
    _append(
        RUNS_KEY,
        task_id=request.id,
        request_idx=request_idx,
        fence=request.lock_fence,
        deferrals=int(deferrals or 0),
        lost=bool(request.lock_lost),
        start=started,
        end=time.monotonic(),
    )
    return request_idx


@lock_deferred.connect
def _record_deferral(sender: Any, task_id: str, reason: str, countdown: float, **_: Any) -> None:
    _append(DEFERRED_KEY, task_id=task_id, reason=reason, countdown=countdown)


@lock_lost.connect
def _record_lost(sender: Any, task_id: str, lock_key: str, **_: Any) -> None:
    _append(LOST_KEY, task_id=task_id, lock_key=lock_key)


@lock_released.connect
def _record_release(sender: Any, task_id: str, owned: bool, success: bool, **_: Any) -> None:
    _append(RELEASED_KEY, task_id=task_id, owned=owned, success=success)
