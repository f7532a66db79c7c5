"""A Celery app for the fault tests: runs record when they start and when they end.

Configured from the environment so a test can point it at its own servers:
``FAULT_BROKER_URL``, ``FAULT_BACKEND_URL``, ``FAULT_LOCK_URL``, ``FAULT_RECORD_URL`` (where runs
are recorded); ``FAULT_LOCK_TTL`` (lease TTL in seconds, default 2, so a dead lease lapses
quickly) and ``FAULT_HEARTBEAT_INTERVAL`` (default a third of the TTL);
``FAULT_VISIBILITY_TIMEOUT`` (the Redis broker's, in seconds) and ``FAULT_RESTORE_INTERVAL``
(seconds between the worker's own sweeps for unacked messages past that timeout).

Every body appends a ``started`` entry (with the pool process's pid, so a test can kill it) to
``fault:started`` as it begins, and a ``run`` entry with its interval to ``fault:runs`` when it
ends; a run killed midway leaves only the first. Deferred and skipped copies are recorded in
``fault:deferred`` and ``fault:skipped`` from celery-lock's signals. ``fault.fetch`` appends to
``fault:fetched`` and hands its request on to ``fault.work``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from celery.signals import before_task_publish, task_postrun

from celery_lock import LockedTask
from celery_lock.signals import lock_deferred, lock_skipped
from tests.apps.common import Recorder, worker_test_app

STARTED_KEY = "fault:started"
RUNS_KEY = "fault:runs"
DEFERRED_KEY = "fault:deferred"
SKIPPED_KEY = "fault:skipped"
FETCHED_KEY = "fault:fetched"

app = worker_test_app(
    "fault",
    "FAULT",
    celery_lock_ttl=float(os.environ.get("FAULT_LOCK_TTL", "2")),
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("FAULT_VISIBILITY_TIMEOUT", "3600")),
        # kombu scans for expired unacked messages every interval * throttle seconds.
        "unacked_restore_interval": float(os.environ.get("FAULT_RESTORE_INTERVAL", "10")),
        "unacked_restore_throttle": 1,
    },
    # Extra settings for one test, e.g. '{"task_retry_on_worker_lost": true}'.
    **json.loads(os.environ.get("FAULT_CONF", "{}")),
)
if os.environ.get("FAULT_HEARTBEAT_INTERVAL"):
    app.conf.celery_lock_heartbeat_interval = float(os.environ["FAULT_HEARTBEAT_INTERVAL"])
_recorder = Recorder("FAULT")
_append = _recorder.append


@app.task(base=LockedTask, bind=True, lock_key="request_idx", max_retries=0, name="fault.work")
def work(self: Any, request_idx: int, seconds: float = 3.0) -> int:
    """Sleeps ``seconds``; ``max_retries=0``: a deferral must not count as a retry."""
    started = time.monotonic()
    fence = self.request.lock_fence
    _append(STARTED_KEY, task_id=self.request.id, request_idx=request_idx, fence=fence)
    time.sleep(seconds)
    _append(
        RUNS_KEY,
        task_id=self.request.id,
        request_idx=request_idx,
        fence=fence,
        start=started,
        end=time.monotonic(),
    )
    return request_idx


@app.task(base=LockedTask, bind=True, lock_key="request_idx", name="fault.fetch")
def fetch(self: Any, request_idx: int, seconds: float = 0.0, work_seconds: float = 0.2) -> Any:
    """Sleeps ``seconds``, then hands its request on to ``fault.work`` (which sleeps
    ``work_seconds``) with ``self.replace``; with ``FAULT_KILL_AFTER_REPLACE`` set, its first
    run's pool process dies as it sends the replacement (``sending``) or after the replacement
    was sent, before its own message is acked (``sent``; see :func:`_die_once`)."""
    _append(FETCHED_KEY, task_id=self.request.id, request_idx=request_idx)
    time.sleep(seconds)
    return self.replace(work.si(request_idx, work_seconds))


def _die_once(when: str) -> None:
    """Under ``FAULT_KILL_AFTER_REPLACE=<when>``, SIGKILL this pool process, the first time
    only, as the OOM killer would."""
    if os.environ.get("FAULT_KILL_AFTER_REPLACE") == when and _recorder.client.set(
        "fault:killed-after-replace", 1, nx=True
    ):
        os.kill(os.getpid(), signal.SIGKILL)


@before_task_publish.connect
def _die_sending(sender: str | None = None, **_: Any) -> None:
    """As ``fault.fetch`` sends its replacement, ``fault.work``: nothing went out."""
    if sender == "fault.work":
        _die_once("sending")


@task_postrun.connect
def _die_having_sent(sender: Any = None, **_: Any) -> None:
    """As ``fault.fetch``'s run ends, its replacement sent, before its message is acked."""
    if getattr(sender, "name", None) == "fault.fetch":
        _die_once("sent")


@app.task(bind=True, name="fault.killed_once", default_retry_delay=0)
def killed_once(self: Any) -> str:
    """A plain task whose pool process dies on its first delivery (as the OOM killer would
    kill it), and that returns on its retry."""
    if not self.request.retries:
        os.kill(os.getpid(), signal.SIGKILL)
    return "done"


@lock_deferred.connect
def _record_deferral(sender: Any, task_id: str, reason: str, countdown: float, **_: Any) -> None:
    _append(DEFERRED_KEY, task_id=task_id, reason=reason, countdown=countdown)


@lock_skipped.connect
def _record_skip(sender: Any, task_id: str, reason: str, holder: str, **_: Any) -> None:
    _append(SKIPPED_KEY, task_id=task_id, reason=reason, holder=holder)
