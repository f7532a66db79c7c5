"""A Celery app for the lease-lost fault tests: a body that can be made to lose its lease.

Configured from the environment so a test can point it at its own servers: ``LOST_BROKER_URL``,
``LOST_BACKEND_URL``, ``LOST_LOCK_URL``, ``LOST_RECORD_URL`` (records and the fenced sink) and
``LOST_TTL`` (the lease TTL in seconds).

``lost.write`` records that it started (task id, pid, fence, lock key), optionally waits for the
test's go key and then for its heartbeat to report a loss, records what it saw
(``request.lock_lost``, ``check_lock()``), and writes its value to a fenced sink with its fence,
whatever it saw, so the test can tell whether the sink turned a stale holder away.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from celery_lock import LockedTask, LockLostError, signals
from celery_lock.fencing import fenced_set
from tests.apps.common import Recorder, worker_test_app

app = worker_test_app("lost", "LOST")

TTL = float(os.environ.get("LOST_TTL", "1.5"))
#: Sleep step of the waiting loops. The loops count steps rather than watch a clock, so a
#: process paused past its TTL still has its whole budget left when it resumes.
STEP = 0.01
GO_STEPS = 3000  # up to 30 s of running for the test's go
LOSS_STEPS = 300  # then up to 3 s for the heartbeat to report the loss

STARTED_KEY = "lost:started"
SEEN_KEY = "lost:seen"
SIGNALS_KEY = "lost:signals"
RELEASED_KEY = "lost:released"
_recorder = Recorder("LOST")
_record = _recorder.client  # also the fenced sink's store
_push = _recorder.append


def go_key(task_id: str) -> str:
    """Key the test sets when a waiting body may go on."""
    return f"lost:go:{task_id}"


def sink_key(request_idx: int) -> str:
    """The fenced record the bodies of one request write to."""
    return f"lost:sink:{request_idx}"


def _wait(condition: Callable[[], Any], steps: int) -> bool:
    for _ in range(steps):
        if condition():
            return True
        time.sleep(STEP)
    return bool(condition())


@signals.lock_lost.connect
def _record_lock_lost(sender: Any, task_id: str, lock_key: str, **_: Any) -> None:
    _push(SIGNALS_KEY, task_id=task_id, lock_key=lock_key)


@signals.lock_released.connect
def _record_lock_released(sender: Any, task_id: str, lock_key: str, **fields: Any) -> None:
    _push(RELEASED_KEY, task_id=task_id, lock_key=lock_key, owned=fields.get("owned"))


@app.task(base=LockedTask, bind=True, lock_key="request_idx", lock_ttl=TTL, name="lost.write")
def write(self: Any, request_idx: int, value: str, wait_for_go: bool = False) -> bool:
    request = self.request
    _push(STARTED_KEY, task_id=request.id, fence=request.lock_fence, lock_key=request.lock_key)
    waited_for_loss = None
    if wait_for_go:
        got_go = _wait(lambda: _record.exists(go_key(request.id)), GO_STEPS)
        went_on = time.monotonic()
        if got_go and _wait(lambda: request.lock_lost, LOSS_STEPS):
            waited_for_loss = time.monotonic() - went_on
    try:
        self.check_lock()
        check = "passed"
    except LockLostError:
        check = "raised LockLostError"
    # A body that skipped check_lock, or paused right after it: only the fence stops this write.
    accepted = fenced_set(_record, sink_key(request_idx), value, request.lock_fence)
    _push(
        SEEN_KEY,
        task_id=request.id,
        fence=request.lock_fence,
        lock_lost=bool(request.lock_lost),
        check_lock=check,
        waited_for_loss=waited_for_loss,
        accepted=accepted,
    )
    return accepted
