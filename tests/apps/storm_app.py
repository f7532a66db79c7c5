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

import redis
from celery import Celery

import celery_lock
from celery_lock import LockedTask

app = Celery(
    "storm",
    broker=os.environ.get("STORM_BROKER_URL", "redis://127.0.0.1:6379/0"),
    backend=os.environ.get("STORM_BACKEND_URL", "redis://127.0.0.1:6379/1"),
)
app.conf.celery_lock_redis_url = os.environ.get("STORM_LOCK_URL", "redis://127.0.0.1:6379/2")
app.conf.worker_prefetch_multiplier = 1
app.conf.broker_connection_retry_on_startup = True
app.conf.result_expires = 3600
app.conf.task_default_queue = os.environ.get("STORM_QUEUE", "celery")
# Extra settings for one test, e.g. '{"worker_soft_shutdown_timeout": 1}'.
app.conf.update(json.loads(os.environ.get("STORM_CONF", "{}")))
celery_lock.install(app)

RUNS_KEY = "storm:runs"
STARTED_KEY = "storm:started"
_record = redis.Redis.from_url(os.environ.get("STORM_RECORD_URL", "redis://127.0.0.1:6379/3"))
WORK_SECONDS = float(os.environ.get("STORM_WORK_SECONDS", "0.05"))


def record(task: Any, request_idx: int, started: float) -> None:
    """Append one run's interval (CLOCK_MONOTONIC is system-wide on Linux) to the record."""
    _record.rpush(
        RUNS_KEY,
        json.dumps(
            {
                "task": task.name,
                "request_idx": request_idx,
                "task_id": task.request.id,
                "fence": task.request.lock_fence,
                "ttl": task.lock_settings().ttl,
                "pid": os.getpid(),
                "start": started,
                "end": time.monotonic(),
            }
        ),
    )


@app.task(base=LockedTask, bind=True, lock_key="request_idx", name="storm.process")
def process(self: Any, request_idx: int) -> int:
    started = time.monotonic()
    time.sleep(WORK_SECONDS)
    record(self, request_idx, started)
    return request_idx


def _stage(name: str) -> Any:
    @app.task(base=LockedTask, bind=True, lock_key="request_idx", lock_scope="request", name=name)
    def stage(self: Any, request_idx: int) -> int:
        started = time.monotonic()
        time.sleep(WORK_SECONDS)
        record(self, request_idx, started)
        return request_idx

    return stage


pending = _stage("storm.pending")
process_stage = _stage("storm.process_stage")
callback = _stage("storm.callback")


@app.task(base=LockedTask, bind=True, lock_key="request_idx", lock_ttl=2.0, name="storm.long")
def long(self: Any, request_idx: int, seconds: float = 8.0) -> int:
    """Runs four times its lease TTL: only the heartbeat keeps the lease alive.

    The TTL is 2 s rather than 1 s so that a loaded CI machine stalling the heartbeat thread
    for most of a second does not lose the lease: the test is about renewal, not about stalls.
    """
    started = time.monotonic()
    time.sleep(seconds)
    record(self, request_idx, started)
    return request_idx


@app.task(base=LockedTask, bind=True, lock_key="request_idx", lock_ttl=30.0, name="storm.hold")
def hold(self: Any, request_idx: int, seconds: float = 20.0) -> int:
    """Holds its request for ``seconds`` on its first grant, briefly on any later one."""
    started = time.monotonic()
    _record.rpush(STARTED_KEY, json.dumps({"task_id": self.request.id, "pid": os.getpid(),
                                           "fence": self.request.lock_fence}))  # fmt: skip
    time.sleep(seconds if self.request.lock_fence == 1 else 0.1)
    record(self, request_idx, started)
    return request_idx


@app.task(
    base=LockedTask, lock_key="request_idx", lock_ttl=10.0, lock_heartbeat_interval=6.0,
    name="storm.slow_heartbeat",
)  # fmt: skip
def slow_heartbeat(request_idx: int) -> int:
    """Beats less than twice per TTL: the worker warns about it at start."""
    return request_idx
