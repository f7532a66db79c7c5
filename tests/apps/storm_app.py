"""A Celery app for the worker tests: every run records its interval in a Redis list.

Configured from the environment so a test can point it at its own servers:
``STORM_BROKER_URL``, ``STORM_BACKEND_URL``, ``STORM_LOCK_URL`` and ``STORM_RECORD_URL``
(where runs are recorded), ``STORM_WORK_SECONDS`` (how long each body sleeps).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery_lock import LockedTask
from tests.apps.common import Recorder, worker_test_app

app = worker_test_app(
    "storm",
    "STORM",
    task_default_queue=os.environ.get("STORM_QUEUE", "celery"),
    # Extra settings for one test, e.g. '{"worker_soft_shutdown_timeout": 1}'.
    **json.loads(os.environ.get("STORM_CONF", "{}")),
)

RUNS_KEY = "storm:runs"
STARTED_KEY = "storm:started"
_record = Recorder("STORM")
WORK_SECONDS = float(os.environ.get("STORM_WORK_SECONDS", "0.05"))


def record(task: Any, request_idx: int, started: float) -> None:
    """Append one run's interval (CLOCK_MONOTONIC is system-wide on Linux) to the record."""
    _record.append(
        RUNS_KEY,
        task=task.name,
        request_idx=request_idx,
        task_id=task.request.id,
        fence=task.request.lock_fence,
        ttl=task.lock_settings().ttl,
        start=started,
        end=time.monotonic(),
    )


def _recording(name: str, **options: Any) -> Any:
    """A LockedTask keyed by ``request_idx`` whose body sleeps and records its run."""

    @app.task(base=LockedTask, bind=True, lock_key="request_idx", name=name, **options)
    def run(self: Any, request_idx: int) -> int:
        started = time.monotonic()
        time.sleep(WORK_SECONDS)
        record(self, request_idx, started)
        return request_idx

    return run


process = _recording("storm.process")
process_as_success = _recording("storm.process_as_success", lock_skip_as_success=True)
# Three stages of one request: they exclude each other, each keeps its own done-marker.
pending = _recording("storm.pending", lock_scope="request")
process_stage = _recording("storm.process_stage", lock_scope="request")
callback = _recording("storm.callback", lock_scope="request")


@app.task(base=LockedTask, bind=True, lock_key="request_idx", lock_ttl=2.0, name="storm.long")
def long(self: Any, request_idx: int, seconds: float = 8.0, fail: bool = False) -> int:
    """Runs four times its lease TTL: only the heartbeat keeps the lease alive. With ``fail``,
    it raises once it has run (and recorded) to its end.

    The TTL is 2 s rather than 1 s so that a loaded CI machine stalling the heartbeat thread
    for most of a second does not lose the lease: the test is about renewal, not about stalls.
    """
    started = time.monotonic()
    time.sleep(seconds)
    record(self, request_idx, started)
    if fail:
        raise ValueError("the body's own error, after its run")
    return request_idx


@app.task(base=LockedTask, bind=True, lock_key="request_idx", lock_ttl=2.0, name="storm.busy")
def busy(self: Any, request_idx: int, seconds: float = 6.0) -> int:
    """Computes for three times its lease TTL, never sleeping: under a green pool it holds the
    hub throughout; under the others only the heartbeat thread keeps the lease alive."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        pass
    record(self, request_idx, started)
    return request_idx


@app.task(base=LockedTask, bind=True, lock_key="request_idx", lock_ttl=30.0, name="storm.hold")
def hold(self: Any, request_idx: int, seconds: float = 20.0) -> int:
    """Holds its request for ``seconds`` in the first body the record sees start (a test's
    first grant), briefly in any later one."""
    started = time.monotonic()
    starts = _record.append(STARTED_KEY, task_id=self.request.id, fence=self.request.lock_fence)
    time.sleep(seconds if starts == 1 else 0.1)
    record(self, request_idx, started)
    return request_idx


@app.task(base=LockedTask, bind=True, lock_key="request_idx", name="storm.handoff")
def handoff(self: Any, request_idx: int) -> Any:
    """Hands its request on to ``storm.process`` with ``self.replace``."""
    return self.replace(process.si(request_idx))


@app.task(
    base=LockedTask, lock_key="request_idx", lock_ttl=10.0, lock_heartbeat_interval=6.0,
    name="storm.slow_heartbeat",
)  # fmt: skip
def slow_heartbeat(request_idx: int) -> int:
    """Beats less than twice per TTL: the worker warns about it at start."""
    return request_idx


@app.task(
    base=LockedTask, lock_key="{tenant}:{request_idx}", lock_scope="billing:eu",
    name="storm.tenant_order",
)  # fmt: skip
def tenant_order(tenant: str, request_idx: int) -> int:
    """Keyed by a template, in a scope holding ':': its keys digest, which `lock key` finds."""
    return request_idx
