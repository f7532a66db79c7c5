"""Lease lost while running: a real prefork worker's body loses its lease, finds out, and its
fenced write is turned away.

A real ``celery worker -P prefork -E`` subprocess runs ``tests/apps/lost_app.py`` (lease TTL
4.5 s, a heartbeat every 1.5 s) against the session's redis-server. The body writes a "started"
record (its pool pid among it), then runs in small sleep steps until the test lets it go on; the
test takes the lease away meanwhile, by SIGSTOPping the pool process past its TTL or by
overwriting the lease, and lets a newer holder write to the fenced sink first.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from conftest import close_producer, wait_for

from celery_lock.fencing import FencedValue, fenced_get, fenced_set
from celery_lock.keys import RequestKeys
from celery_lock.lease import Holder, encode_lock
from celery_lock.testing import CeleryWorker, EventTap

pytestmark = pytest.mark.worker

ROOT = Path(__file__).resolve().parent.parent
TASK = "lost.write"
#: Long enough that the bounds on when a loss is detected leave a loaded machine seconds, not
#: fractions of one, for its scheduling delays. (lost_app gives the body 3 s after the go for the
#: loss to show: an interval and more.)
TTL = 4.5
INTERVAL = TTL / 3
WAIT = 20.0


@pytest.fixture
def lost_env(worker_env: dict[str, str]) -> dict[str, str]:
    """``worker_env``'s emptied databases, under the names ``lost_app`` reads."""
    return {
        "LOST_BROKER_URL": worker_env["STORM_BROKER_URL"],
        "LOST_BACKEND_URL": worker_env["STORM_BACKEND_URL"],
        "LOST_LOCK_URL": worker_env["STORM_LOCK_URL"],
        "LOST_RECORD_URL": worker_env["STORM_RECORD_URL"],
        "LOST_TTL": str(TTL),
        "PYTHONPATH": worker_env["PYTHONPATH"],
    }


@pytest.fixture
def worker(spawn_worker: Callable[..., CeleryWorker], lost_env: dict[str, str]) -> CeleryWorker:
    # Stopped at the end with a warm shutdown that SIGCONTs the group first: a stopped pool
    # process cannot hang it.
    return spawn_worker("tests.apps.lost_app", lost_env, "-E", concurrency=2)


@pytest.fixture
def producer(lost_env: dict[str, str]) -> Iterator[Celery]:
    app = Celery("lost-producer", broker=lost_env["LOST_BROKER_URL"],
                 backend=lost_env["LOST_BACKEND_URL"], set_as_current=False)  # fmt: skip
    yield app
    close_producer(app)


@pytest.fixture
def records(lost_env: dict[str, str]) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(lost_env["LOST_RECORD_URL"])
    yield client
    client.close()


@pytest.fixture
def locks(lost_env: dict[str, str]) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(lost_env["LOST_LOCK_URL"])
    yield client
    client.close()


def entries(records: redis.Redis, key: str, task_id: str) -> list[dict[str, Any]]:
    rows = (json.loads(raw) for raw in records.lrange(key, 0, -1))
    return [row for row in rows if row["task_id"] == task_id]


def entry(records: redis.Redis, key: str, task_id: str) -> dict[str, Any] | None:
    found = entries(records, key, task_id)
    return found[0] if found else None


def start_waiting_holder(producer: Celery, records: redis.Redis, idx: int) -> Any:
    """Send a copy that runs until its go key is set; return it with its "started" record."""
    result = producer.send_task(TASK, args=(idx, "from-stale"), kwargs={"wait_for_go": True})
    started = wait_for(
        "the holder to start", lambda: entry(records, "lost:started", result.id), WAIT
    )
    return result, started


def assert_holder_saw_the_loss_and_was_fenced_off(
    records: redis.Redis, tap: EventTap, worker: CeleryWorker, result: Any, lock_key: str
) -> dict[str, Any]:
    """What every lost lease must produce; returns the ``lock_lost`` signal's record."""
    assert result.get(timeout=WAIT) is False  # the stale holder's write was refused
    seen = entry(records, "lost:seen", result.id)
    assert seen is not None
    assert seen["lock_lost"] is True
    assert seen["check_lock"] == "raised LockLostError"
    assert seen["waited_for_loss"] is not None
    assert seen["accepted"] is False
    [lost] = entries(records, "lost:signals", result.id)
    assert lost["lock_key"] == lock_key
    event = wait_for("the task-lock-lost event", lambda: next(iter(tap.events), None), 10)
    assert event["uuid"] == result.id
    assert event["name"] == TASK
    assert event["lock_key"] == lock_key
    assert "lock lost" in event["result"]
    assert len(tap.events) == 1
    [released] = entries(records, "lost:released", result.id)
    assert released["owned"] is False
    log = worker.log()
    assert f"lease on {lock_key} lost while task {result.id} ran" in log
    assert f"lease on {lock_key} was no longer held by task {result.id} at release" in log
    return lost


def test_paused_holder_finds_its_lease_lost_and_its_fenced_write_rejected(
    worker: CeleryWorker, producer: Celery, records: redis.Redis, locks: redis.Redis
) -> None:
    with EventTap(producer, "task-lock-lost") as tap:
        stale, started = start_waiting_holder(producer, records, 7)
        pid, lock_key = started["pid"], started["lock_key"]
        assert pid in worker.child_pids()
        os.kill(pid, signal.SIGSTOP)  # the whole pool process: its heartbeat thread too
        try:
            stopped = time.monotonic()
            wait_for("the lease to lapse", lambda: not locks.exists(lock_key), WAIT)
            lapsed_after = time.monotonic() - stopped
            newer = producer.send_task(TASK, args=(7, "from-newer"))
            assert newer.get(timeout=WAIT) is True
            records.set(f"lost:go:{stale.id}", 1)
        finally:
            resumed = time.monotonic()
            os.kill(pid, signal.SIGCONT)
        lost = assert_holder_saw_the_loss_and_was_fenced_off(records, tap, worker, stale, lock_key)

    newer_started = entry(records, "lost:started", newer.id)
    assert newer_started is not None
    assert newer_started["fence"] > started["fence"]
    assert fenced_get(records, "lost:sink:7") == FencedValue(b"from-newer", newer_started["fence"])
    assert lapsed_after <= TTL + 1.0
    # The heartbeat's wait ran out while the process was stopped: it beats on resuming.
    detected_after = lost["at"] - resumed
    assert 0 <= detected_after < INTERVAL
    print(f"\nfences: stale {started['fence']}, newer {newer_started['fence']}; "
          f"lease lapsed {lapsed_after:.2f}s after SIGSTOP; "
          f"loss detected {detected_after * 1000:.0f} ms after SIGCONT")  # fmt: skip


def test_overwritten_lease_is_found_lost_and_the_old_holders_write_rejected(
    worker: CeleryWorker, producer: Celery, records: redis.Redis, locks: redis.Redis
) -> None:
    with EventTap(producer, "task-lock-lost") as tap:
        stale, started = start_waiting_holder(producer, records, 8)
        lock_key = started["lock_key"]
        keys = RequestKeys.build("celery-lock", TASK, "8", TASK)
        assert keys.lock == lock_key
        # Someone else takes the lease: a new token and the next fence, as a grant would.
        fence = int(locks.incr(keys.fence))
        intruder = Holder(task_id="intruder", task_name=TASK, host="elsewhere", pid=1)
        # Outlives the old holder: its release must leave it be.
        locks.set(lock_key, encode_lock("intruder", fence, intruder, 0), px=60_000)
        overwritten = time.monotonic()
        assert fenced_set(records, "lost:sink:8", "from-intruder", fence)
        records.set(f"lost:go:{stale.id}", 1)
        lost = assert_holder_saw_the_loss_and_was_fenced_off(records, tap, worker, stale, lock_key)

    assert fence > started["fence"]
    assert locks.get(lock_key).startswith(b"intruder ")
    assert fenced_get(records, "lost:sink:8") == FencedValue(b"from-intruder", fence)
    # Found at the next beat, at most an interval on: not a beat later, nor at the TTL.
    detected_after = lost["at"] - overwritten
    assert 0 <= detected_after < INTERVAL + 1.0
    print(f"\nfences: stale {started['fence']}, intruder {fence}; "
          f"loss detected {detected_after * 1000:.0f} ms after the overwrite")  # fmt: skip
