"""A Celery app for the ``celery beat`` tests: periodic LockedTasks that record their runs.

Configured from the environment: ``BEAT_BROKER_URL``, ``BEAT_BACKEND_URL``, ``BEAT_LOCK_URL``,
``BEAT_RECORD_URL`` (see ``tests/apps/common.py``); ``BEAT_WORK_SECONDS`` (how long a body
sleeps); ``BEAT_TASK_OPTIONS`` (JSON, the periodic task's options, e.g.
``{"lock_done_ttl": 0.5}``); ``BEAT_SCHEDULE`` (JSON: entry name to ``task``, ``every``
seconds, ``args``, ``options``, as ``beat_schedule`` takes them).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery_lock import LockedTask
from tests.apps.common import Recorder, worker_test_app

_entries = json.loads(os.environ.get("BEAT_SCHEDULE", "{}"))
app = worker_test_app(
    "beat",
    "BEAT",
    beat_schedule={
        name: {
            "task": entry["task"],
            "schedule": float(entry["every"]),
            "args": entry.get("args", ()),
            "options": entry.get("options", {}),
        }
        for name, entry in _entries.items()
    },
    beat_max_loop_interval=0.5,
    worker_send_task_events=True,
    task_send_sent_event=True,
)

RUNS_KEY = "beat:runs"
_record = Recorder("BEAT")
WORK_SECONDS = float(os.environ.get("BEAT_WORK_SECONDS", "0.05"))
TASK_OPTIONS = json.loads(os.environ.get("BEAT_TASK_OPTIONS", "{}"))


@app.task(base=LockedTask, bind=True, name="beat.sweep", **TASK_OPTIONS)
def sweep(self: Any) -> str:
    """A periodic job without arguments: every run is the same request."""
    started = time.monotonic()
    time.sleep(WORK_SECONDS)
    _record.append(RUNS_KEY, task_id=self.request.id, start=started, end=time.monotonic())
    return "swept"


@app.task(base=LockedTask, bind=True, name="beat.report", lock_key="period", **TASK_OPTIONS)
def report(self: Any, period: str) -> str:
    """A periodic job keyed by the period it is for."""
    started = time.monotonic()
    time.sleep(WORK_SECONDS)
    _record.append(
        RUNS_KEY, task_id=self.request.id, period=period, start=started, end=time.monotonic()
    )
    return period


@app.task(name="beat.dispatch")
def dispatch(every: float) -> str:
    """What a beat entry runs to key ``report`` by the period it falls in: beat's arguments are
    fixed, so the period is read from the clock here, where the tick is sent."""
    period = str(int(time.time() // every))
    report.delay(period)
    return period
