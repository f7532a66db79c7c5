"""The pipeline's Celery app: three stages, three queues, one lock scope per request.

A request moves through *pending*, *process* and *callback*. Each stage is a task of its own,
routed to a queue of its own (``pending``, ``process``, ``callback``) and served by a worker
pool of its own::

    celery -A examples.pipeline.app worker -Q pending -c 2 \\
        --lock-redis-url "$PIPELINE_LOCK_URL" --lock-ttl 30 --lock-on-duplicate skip
    # the same with -Q process, and with -Q callback

The three tasks share ``lock_scope="request"`` and ``lock_key="request_idx"``: while one stage
works on request 7, a message of another stage for request 7 is deferred (contention), and a
second copy of the *same* stage is skipped. Done-markers stay per stage, so finishing *pending*
does not make *process* count as done; the fence counter is shared, so it grows across the
stages of one request.

Configured from the environment:

- ``PIPELINE_BROKER_URL``: ``redis://...`` or ``amqp://...`` (default redis://localhost:6379/0)
- ``PIPELINE_BACKEND_URL``: result backend (default redis://localhost:6379/1)
- ``PIPELINE_LOCK_URL``: lock store, a Redis (default redis://localhost:6379/2)
- ``PIPELINE_RECORD_URL``: where runs are recorded for verify (default redis://localhost:6379/3)
- ``PIPELINE_WORK_SECONDS``: how long each stage's body works (default 0.2)
- ``PIPELINE_QUEUE_SUFFIX``: appended to the queue names (default none: ``pending``...)

Every execution of a stage body appends one JSON record (stage, request_idx, task id, fence,
monotonic start and end, host, pid, whether its lease was lost) to the Redis list
``pipeline:executions``; every delivery's outcome, every skip or deferral, every release and every
fenced write is recorded too, so ``verify`` and ``chaos`` can tell what happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import redis
from celery import Celery, Task
from celery.signals import before_task_publish, task_postrun

import celery_lock
from celery_lock import FencedRedis, LockedTask
from celery_lock.signals import lock_deferred, lock_released, lock_skipped

BROKER_URL = os.environ.get("PIPELINE_BROKER_URL", "redis://localhost:6379/0")
BACKEND_URL = os.environ.get("PIPELINE_BACKEND_URL", "redis://localhost:6379/1")
LOCK_URL = os.environ.get("PIPELINE_LOCK_URL", "redis://localhost:6379/2")
RECORD_URL = os.environ.get("PIPELINE_RECORD_URL", "redis://localhost:6379/3")
WORK_SECONDS = float(os.environ.get("PIPELINE_WORK_SECONDS", "0.2"))
# Appended to each stage's queue name, so that a run on a shared broker (chaos.py on RabbitMQ)
# has queues of its own; its workers then consume -Q pending<suffix>, and so on.
QUEUE_SUFFIX = os.environ.get("PIPELINE_QUEUE_SUFFIX", "")

STAGES = ("pending", "process", "callback")
TASK_NAMES = {f"pipeline.{stage}": stage for stage in STAGES}
QUEUES = {stage: f"{stage}{QUEUE_SUFFIX}" for stage in STAGES}

app = Celery("pipeline", broker=BROKER_URL, backend=BACKEND_URL)
app.conf.update(
    celery_lock_redis_url=LOCK_URL,
    # One queue per stage: each stage is served by its own worker pool (-Q <stage>).
    task_routes={name: {"queue": QUEUES[stage]} for name, stage in TASK_NAMES.items()},
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=3600,
)
# Before any worker reads its command line: this is what adds --lock-redis-url, --lock-ttl and
# --lock-on-duplicate to `celery worker`.
celery_lock.install(app)

# -- the record verify reads (Redis lists and counters) ------------------------------------------

EXECUTIONS_KEY = "pipeline:executions"  # one entry per run of a stage body, at its end
STARTED_KEY = "pipeline:started"  # one entry per run of a stage body, at its start
DELIVERIES_KEY = "pipeline:deliveries"  # one entry per delivery: its final state
LOCK_EVENTS_KEY = "pipeline:lock-events"  # one entry per skip or deferral
PUBLISHED_KEY = "pipeline:published"  # messages published (producer, next stage, deferrals)
FINISHED_KEY = "pipeline:finished"  # deliveries that finished, whatever their outcome
NEXT_REQUEST_KEY = "pipeline:next-request-idx"  # the producer takes fresh request numbers here
LAST_RUN_KEY = "pipeline:last-run"
RELEASES_KEY = "pipeline:releases"  # one entry per release that got an answer
WRITES_KEY = "pipeline:writes"  # one entry per fenced write of a stage body


def run_key(run_id: str) -> str:
    """Key of the manifest the producer writes for one run."""
    return f"pipeline:run:{run_id}"


def state_key(request_idx: int) -> str:
    """Key of a request's state, which every stage writes with its fence."""
    return f"pipeline:state:{request_idx}"


records = redis.Redis.from_url(RECORD_URL)
# The stages' "downstream store": a write carrying a smaller fence than the one stored is refused.
fenced_records = FencedRedis(records)
HOST = socket.gethostname()


@contextlib.contextmanager
def execution(task: Task[Any, Any], request_idx: int) -> Iterator[dict[str, Any]]:
    """Record one run of a stage body: its interval (CLOCK_MONOTONIC), fence, task id, pid."""
    entry: dict[str, Any] = {
        "stage": TASK_NAMES[task.name],
        "request_idx": request_idx,
        "task_id": task.request.id,
        "fence": task.request.lock_fence,
        "host": HOST,
        "pid": os.getpid(),
        "next_task_id": None,
        "start": time.monotonic(),
    }
    records.rpush(STARTED_KEY, json.dumps(entry))
    yield entry
    entry["end"] = time.monotonic()
    entry["lost"] = bool(getattr(task.request, "lock_lost", False))
    records.rpush(EXECUTIONS_KEY, json.dumps(entry))


# -- the three stages ------------------------------------------------------------------------------

LOCKED = {"base": LockedTask, "bind": True, "lock_scope": "request", "lock_key": "request_idx"}


def work(task: Task[Any, Any], request_idx: int) -> None:
    """A stage's work: a while of it, then one write of the request's state with the stage's
    fence, so that a holder that outlived its lease cannot overwrite a later one. Each write is
    recorded with its outcome and the monotonic times around it (for ``chaos``)."""
    time.sleep(WORK_SECONDS)
    fence = int(task.request.lock_fence)
    before = time.monotonic()
    accepted = fenced_records.set(state_key(request_idx), TASK_NAMES[task.name], fence)
    entry = {
        "stage": TASK_NAMES[task.name],
        "request_idx": request_idx,
        "task_id": task.request.id,
        "fence": fence,
        "accepted": accepted,
        "before": before,
        "after": time.monotonic(),
    }
    records.rpush(WRITES_KEY, json.dumps(entry))


@app.task(name="pipeline.pending", **LOCKED)
def pending(self: Task[Any, Any], request_idx: int) -> int:
    """Stage 1: accept the request, then hand it to *process*."""
    with execution(self, request_idx) as run:
        work(self, request_idx)
        # Sent inside the body, while the lease is held: if this worker dies after the send, the
        # redelivered copy runs again and sends again, and the lease turns the second *process*
        # message into a skip. (Sent after the body, a crash in between would lose the request.)
        # The new message usually arrives before the lease is released: it is deferred for a
        # moment (contention), never skipped.
        run["next_task_id"] = process.delay(request_idx).id
    return int(self.request.lock_fence)


@app.task(name="pipeline.process", **LOCKED)
def process(self: Task[Any, Any], request_idx: int) -> int:
    """Stage 2: do the work, then hand the request to *callback*."""
    with execution(self, request_idx) as run:
        work(self, request_idx)
        run["next_task_id"] = callback.delay(request_idx).id
    return int(self.request.lock_fence)


@app.task(name="pipeline.callback", **LOCKED)
def callback(self: Task[Any, Any], request_idx: int) -> int:
    """Stage 3: report the outcome; the request is finished."""
    with execution(self, request_idx):
        work(self, request_idx)
    return int(self.request.lock_fence)


# -- bookkeeping for verify: what was published, what finished, what the lock did ------------------


def _request_idx(task: Task[Any, Any]) -> Any:
    args, kwargs = task.request.args or (), task.request.kwargs or {}
    return args[0] if args else kwargs.get("request_idx")


@before_task_publish.connect
def count_published(sender: str | None = None, **_: Any) -> None:
    """Every publish of a stage message, wherever it happens (producer, stage, deferral)."""
    if sender in TASK_NAMES:
        records.incr(PUBLISHED_KEY)


@task_postrun.connect
def count_finished(
    sender: Task[Any, Any] | None = None,
    task_id: str | None = None,
    args: Any = None,
    kwargs: Any = None,
    state: str | None = None,
    **_: Any,
) -> None:
    """Every delivery's outcome: SUCCESS (ran), IGNORED (skipped or acked), RETRY (deferred)."""
    if sender is None or sender.name not in TASK_NAMES:
        return
    entry = {
        "stage": TASK_NAMES[sender.name],
        "request_idx": args[0] if args else (kwargs or {}).get("request_idx"),
        "task_id": task_id,
        "state": state,
    }
    with records.pipeline() as pipe:
        pipe.rpush(DELIVERIES_KEY, json.dumps(entry))
        pipe.incr(FINISHED_KEY)
        pipe.execute()


def _lock_event(event: str, sender: Task[Any, Any], task_id: str, reason: str) -> None:
    if sender.name in TASK_NAMES:
        entry = {
            "event": event,
            "stage": TASK_NAMES[sender.name],
            "reason": reason,
            "request_idx": _request_idx(sender),
            "task_id": task_id,
        }
        records.rpush(LOCK_EVENTS_KEY, json.dumps(entry))


@lock_skipped.connect
def record_skip(sender: Task[Any, Any], task_id: str, reason: str, **_: Any) -> None:
    _lock_event("skipped", sender, task_id, reason)


@lock_released.connect
def record_release(
    sender: Task[Any, Any], task_id: str, success: bool, owned: bool, **_: Any
) -> None:
    """A release that got an answer; ``success``: the stage's done-marker was written. Sent
    from the pool process (its heartbeat thread, for a release tried again later), so the pid
    tells two runs of one task id apart."""
    if sender.name in TASK_NAMES:
        entry = {
            "stage": TASK_NAMES[sender.name],
            "task_id": task_id,
            "pid": os.getpid(),
            "success": success,
            "owned": owned,
        }
        records.rpush(RELEASES_KEY, json.dumps(entry))


@lock_deferred.connect
def record_deferral(sender: Task[Any, Any], task_id: str, reason: str, **_: Any) -> None:
    _lock_event("deferred", sender, task_id, reason)
