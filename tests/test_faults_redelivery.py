"""Faults that make the broker deliver a message again, through real prefork workers.

A pool process SIGKILLed mid-task (as the OOM killer would), a whole worker SIGKILLed, the Redis
broker's visibility timeout handing out a message that is still running, ETA/countdown copies, and
a message that handed its request on with ``self.replace`` coming back: in every case the request
runs to completion exactly once and no two runs overlap.

Each test starts real ``celery worker -P prefork`` subprocesses on ``tests/apps/fault_app.py``
against the session's redis-server. Bodies record a ``started`` entry with their pool pid (the
pid to kill) and, if they finish, their monotonic interval and fence; celery-lock's deferrals and
skips are recorded too. Leases are short (2 s; 7 s where a pool process is killed, see
``KILLED_POOL_TTL``), so a dead holder's lease lapses within the test.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, Task
from celery.result import AsyncResult
from celery.states import READY_STATES
from conftest import close_producer, wait_for
from kombu.transport.redis import Channel as RedisChannel

import celery_lock.task
from celery_lock import SKIPPED, follow
from celery_lock.testing import CeleryWorker

pytestmark = pytest.mark.worker

ROOT = Path(__file__).resolve().parent.parent
TASK = "fault.work"
#: Lease TTL and heartbeat interval where a pool process is killed. The prefork pool notices a
#: dead process at once or, when it loses the race with the exit, at its 5 s pool check; a lease
#: that outlives that check makes the returned message meet the dead lease every time.
KILLED_POOL_TTL = 7.0
KILLED_POOL_HEARTBEAT = 1.0
#: The broker's visibility timeout where a test lets it expire (seconds).
VISIBILITY_TIMEOUT = 1.5
TIMEOUT = 20.0
KILLED_POOL_ENV = {
    "FAULT_LOCK_TTL": str(KILLED_POOL_TTL),
    "FAULT_HEARTBEAT_INTERVAL": str(KILLED_POOL_HEARTBEAT),
}


@pytest.fixture
def fault_env(worker_env: dict[str, str]) -> dict[str, str]:
    """Environment for fault_app workers on the emptied databases of ``worker_env``."""
    return {
        "FAULT_BROKER_URL": worker_env["STORM_BROKER_URL"],
        "FAULT_BACKEND_URL": worker_env["STORM_BACKEND_URL"],
        "FAULT_LOCK_URL": worker_env["STORM_LOCK_URL"],
        "FAULT_RECORD_URL": worker_env["STORM_RECORD_URL"],
        "PYTHONPATH": worker_env["PYTHONPATH"],
    }


@pytest.fixture
def start_worker(
    spawn_worker: Callable[..., CeleryWorker], fault_env: dict[str, str]
) -> Callable[..., CeleryWorker]:
    """Start fault_app workers; each is SIGKILLed by process group at the end of the test
    (nothing to wait for: the next test empties the databases)."""
    return lambda **env: spawn_worker(
        "tests.apps.fault_app", {**fault_env, **env}, concurrency=2, kill_at_end=True
    )


@pytest.fixture
def producer(fault_env: dict[str, str]) -> Iterator[Celery]:
    app = Celery(
        "fault-producer",
        broker=fault_env["FAULT_BROKER_URL"],
        backend=fault_env["FAULT_BACKEND_URL"],
        set_as_current=False,
    )
    yield app
    close_producer(app)


@pytest.fixture
def broker(fault_env: dict[str, str]) -> Iterator[redis.Redis]:
    """A client on the broker's database, to see what it still holds."""
    client = redis.Redis.from_url(fault_env["FAULT_BROKER_URL"])
    yield client
    client.close()


@pytest.fixture
def record(fault_env: dict[str, str]) -> Iterator[Record]:
    client = redis.Redis.from_url(fault_env["FAULT_RECORD_URL"])
    yield Record(client)
    client.close()


class Record:
    """What fault_app's bodies and signal receivers wrote (see its module docstring)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def _entries(self, key: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.client.lrange(key, 0, -1)]

    def started(self) -> list[dict[str, Any]]:
        return self._entries("fault:started")

    def runs(self) -> list[dict[str, Any]]:
        return self._entries("fault:runs")

    def deferred(self) -> list[dict[str, Any]]:
        return self._entries("fault:deferred")

    def skipped(self) -> list[dict[str, Any]]:
        return self._entries("fault:skipped")


def wait_started(record: Record, count: int = 1) -> dict[str, Any]:
    """The ``count``-th started entry, once a body has written it."""

    def nth() -> dict[str, Any] | None:
        started = record.started()
        return started[count - 1] if len(started) >= count else None

    return dict(wait_for(f"body start #{count}", nth, TIMEOUT))


def wait_state(result: AsyncResult[Any], state: str, timeout: float = TIMEOUT) -> set[str]:
    """Wait until ``result`` is in ``state``; return every state seen on the way.

    Fails at once on another ready state (``AsyncResult`` would keep returning it anyway).
    """
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while (current := result.state) != state:
        seen.add(current)
        if current in READY_STATES:
            pytest.fail(f"task {result.id} ended {current} ({result.info!r}), not {state}")
        if time.monotonic() > deadline:
            pytest.fail(f"task {result.id} not {state} after {timeout}s (seen {sorted(seen)})")
        time.sleep(0.05)
    return seen | {state}


def broker_idle(client: redis.Redis) -> bool:
    """No message queued and none delivered but unacked (deferred ETA copies included)."""
    return not client.llen("celery") and not client.hlen("unacked")


def force_visibility_timeout(app: Celery, visibility_timeout: float) -> None:
    """Sweep the Redis broker for unacked messages older than ``visibility_timeout``, as any
    kombu client does (a worker at startup and periodically): each goes back on its queue."""
    with app.connection_for_write(
        transport_options={"visibility_timeout": visibility_timeout}
    ) as conn:
        conn.default_channel.qos.restore_visible(num=100, interval=1)


def sleep_past_visibility_timeout(started: dict[str, Any]) -> None:
    """Sleep until the message whose body wrote ``started`` has been unacked for longer than
    the visibility timeout (not at all if the test only saw the entry later than that)."""
    time.sleep(max(0.0, VISIBILITY_TIMEOUT + 0.2 - (time.monotonic() - started["at"])))


def wait_redelivered_copy_deferred(record: Record, task_id: str) -> None:
    """Wait until the forced redelivery of the one running body is handled; check it was
    deferred (not run alongside, not skipped)."""
    wait_for(
        "the redelivered copy to arrive",
        lambda: record.deferred() or record.skipped() or len(record.started()) > 1,
        TIMEOUT,
    )
    assert len(record.started()) == 1, "the redelivered copy ran alongside the original"
    assert record.skipped() == [], "the redelivered copy was skipped"
    deferral = record.deferred()[0]
    assert (deferral["task_id"], deferral["reason"]) == (task_id, "redelivered")


def ran(record: Record) -> list[tuple[str, int]]:
    """The task id and fence of every body that finished."""
    return [(run["task_id"], run["fence"]) for run in record.runs()]


def assert_no_overlap(runs: list[dict[str, Any]]) -> None:
    ordered = sorted(runs, key=lambda run: run["start"])
    for earlier, later in itertools.pairwise(ordered):
        assert later["start"] >= earlier["end"], f"runs overlap: {earlier} and {later}"
        assert later["fence"] > earlier["fence"], f"fence did not increase: {earlier}, {later}"


# -- 1. a pool process SIGKILLed mid-task ---------------------------------------------------------


def test_killed_pool_process_message_reruns_once_with_next_fence_after_lease_lapses(
    start_worker: Callable[..., CeleryWorker], producer: Celery, record: Record
) -> None:
    start_worker(**KILLED_POOL_ENV)
    result = producer.send_task(TASK, args=(1, 1.0))
    first = wait_started(record)
    os.kill(first["pid"], signal.SIGKILL)  # as the OOM killer would
    killed_at = time.monotonic()

    states = wait_state(result, "SUCCESS", timeout=2 * KILLED_POOL_TTL + TIMEOUT)
    assert states <= {"PENDING", "STARTED", "SUCCESS"}
    assert result.result == 1
    rerun = wait_started(record, 2)
    assert rerun["fence"] == first["fence"] + 1
    assert rerun["task_id"] == result.id
    assert rerun["pid"] != first["pid"]
    # The message came back while the dead lease lived, so it was deferred (never dropped, and
    # without counting against max_retries=0) until the lease lapsed: at most one heartbeat
    # interval before the kill it had been extended to a full TTL. A deferral waits no longer
    # than the lease's remaining TTL (+20% jitter), so the copy runs soon after the lapse: the
    # upper bound leaves seconds for a loaded machine, and is far below the broker's visibility
    # timeout (an hour here), which is not what brought it back.
    assert {entry["reason"] for entry in record.deferred()} == {"redelivered"}
    waited = rerun["at"] - killed_at
    assert KILLED_POOL_TTL - KILLED_POOL_HEARTBEAT - 0.1 <= waited <= 2 * KILLED_POOL_TTL + 5.0
    runs = record.runs()
    assert [(run["task_id"], run["fence"]) for run in runs] == [(result.id, first["fence"] + 1)]


def test_copy_sent_while_pool_process_is_dead_does_not_run_alongside_the_rerun(
    start_worker: Callable[..., CeleryWorker], producer: Celery, record: Record
) -> None:
    start_worker(**KILLED_POOL_ENV)
    result = producer.send_task(TASK, args=(1, 1.0))
    first = wait_started(record)
    os.kill(first["pid"], signal.SIGKILL)
    copy = producer.send_task(TASK, args=(1, 1.0))  # e.g. a producer's retry: another task id

    assert follow(copy, timeout=TIMEOUT) == 1
    wait_state(result, "SUCCESS")
    assert copy.state == SKIPPED
    assert copy.info["holder"] == result.id
    assert [entry["task_id"] for entry in record.started()] == [result.id, result.id]
    runs = record.runs()
    assert [(run["task_id"], run["fence"]) for run in runs] == [(result.id, first["fence"] + 1)]
    assert_no_overlap(runs)


def test_killed_pool_process_message_reruns_under_an_app_wide_retry_on_worker_lost(
    start_worker: Callable[..., CeleryWorker], producer: Celery, record: Record
) -> None:
    # Celery 5.7's task_retry_on_worker_lost would make the kill a Celery retry: acked, and
    # with fault.work's max_retries=0 a FAILURE, the request never run.
    start_worker(**KILLED_POOL_ENV, FAULT_CONF=json.dumps({"task_retry_on_worker_lost": True}))
    result = producer.send_task(TASK, args=(1, 1.0))
    first = wait_started(record)
    os.kill(first["pid"], signal.SIGKILL)

    wait_state(result, "SUCCESS", timeout=2 * KILLED_POOL_TTL + TIMEOUT)
    assert ran(record) == [(result.id, first["fence"] + 1)]


@pytest.mark.skipif(
    not hasattr(Task, "retry_on_worker_lost"), reason="Celery before 5.7 does not retry it"
)
def test_a_killed_first_step_is_retried_with_the_later_steps_its_message_carries(
    start_worker: Callable[..., CeleryWorker], producer: Celery
) -> None:
    # Under task_retry_on_worker_lost the worker's main process publishes the retry, with the
    # steps the message carries: here a link a producer that does not register its task sent
    # unchecked, and which cannot be keyed (None alone). The retry is the same call again, no
    # first publish: refused for that step, it would fail the step that can run ("Failed to
    # retry task"), whose link is left to fail alone, on the worker, as it would have anyway.
    start_worker(FAULT_CONF=json.dumps({"task_retry_on_worker_lost": True}))
    step = producer.signature(TASK, (None,), immutable=True)
    result = producer.send_task("fault.killed_once", link=step)

    wait_state(result, "SUCCESS", timeout=2 * TIMEOUT)


# -- 2. the whole worker SIGKILLed ----------------------------------------------------------------


def test_killed_worker_message_is_restored_by_a_new_worker_at_startup_and_runs_once(
    start_worker: Callable[..., CeleryWorker],
    producer: Celery,
    record: Record,
) -> None:
    # Periodic sweeps a minute apart: only the new worker's startup sweep can bring it back.
    env = {"FAULT_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT), "FAULT_RESTORE_INTERVAL": "60"}
    first_worker = start_worker(**env)
    result = producer.send_task(TASK, args=(1, 2.0))
    first = wait_started(record)
    first_worker.kill()
    killed_at = time.monotonic()
    # The message stays in the broker's unacked set until some client sweeps it back.
    time.sleep(VISIBILITY_TIMEOUT + 0.2)
    start_worker(**env)
    ready_at = time.monotonic()

    wait_state(result, "SUCCESS")
    rerun = wait_started(record, 2)
    assert rerun["fence"] == first["fence"] + 1
    assert rerun["at"] - killed_at >= VISIBILITY_TIMEOUT
    # Soon after the new worker is up (its startup sweep; the lease of the killed run, 2 s
    # from the kill, has lapsed or nearly), far from its first periodic sweep 60 s on.
    assert rerun["at"] - ready_at < 15.0
    assert ran(record) == [(result.id, first["fence"] + 1)]


@pytest.mark.skipif(
    not hasattr(RedisChannel, "unacked_restore_interval"),
    reason="kombu before 5.7 sweeps on a schedule of its own, which the test cannot shorten",
)
def test_killed_worker_message_is_restored_by_a_running_worker_sweep_and_runs_once(
    start_worker: Callable[..., CeleryWorker], producer: Celery, record: Record
) -> None:
    env = {"FAULT_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT), "FAULT_RESTORE_INTERVAL": "0.5"}
    first_worker = start_worker(**env)
    second_worker = start_worker(**env)
    assert second_worker.pid != first_worker.pid
    result = producer.send_task(TASK, args=(1, 1.0))
    first = wait_started(record)
    owner = first_worker if first["pid"] in first_worker.child_pids() else second_worker
    survivor = second_worker if owner is first_worker else first_worker
    owner.kill()
    killed_at = time.monotonic()

    wait_state(result, "SUCCESS")
    rerun = wait_started(record, 2)
    assert rerun["pid"] in survivor.child_pids()
    assert rerun["fence"] == first["fence"] + 1
    assert rerun["at"] - killed_at >= VISIBILITY_TIMEOUT - 0.5
    assert ran(record) == [(result.id, first["fence"] + 1)]


# -- 3. the broker redelivers a running message; ETA and countdown copies -------------------------


def test_redelivered_running_message_is_deferred_never_run_alongside(
    start_worker: Callable[..., CeleryWorker],
    producer: Celery,
    record: Record,
    broker: redis.Redis,
) -> None:
    # The worker's own sweep is a minute away: the test decides when the timeout strikes.
    start_worker(FAULT_VISIBILITY_TIMEOUT=str(VISIBILITY_TIMEOUT), FAULT_RESTORE_INTERVAL="60")
    result = producer.send_task(TASK, args=(1, 3.0))
    first = wait_started(record)
    sleep_past_visibility_timeout(first)
    force_visibility_timeout(producer, VISIBILITY_TIMEOUT)

    wait_redelivered_copy_deferred(record, result.id)
    # Neither RETRY nor SKIPPED ever shows: the running original's state is left alone.
    assert wait_state(result, "SUCCESS") <= {"PENDING", "STARTED", "SUCCESS"}
    wait_for("the deferred copies to be acked", lambda: broker_idle(broker), TIMEOUT)
    # The last deferred copy found the request done by its own task id: acked, SUCCESS kept.
    assert AsyncResult(result.id, app=producer).state == "SUCCESS"
    assert ran(record) == [(result.id, first["fence"])]
    assert len(record.started()) == 1
    assert record.skipped() == []


@pytest.mark.parametrize("expires", [5.0, 1.0], ids=["comes-back-before", "comes-back-after"])
def test_a_redelivered_copy_past_its_expiry_leaves_the_running_original_alone(
    start_worker: Callable[..., CeleryWorker],
    producer: Celery,
    record: Record,
    broker: redis.Redis,
    expires: float,
) -> None:
    # The copy comes back (~1.7 s) before the message's expiry (5 s) and waits on its running
    # original past it: kept, the expiry would revoke the waiting copy, storing REVOKED under
    # the task id the original still runs as. Or it comes back after the expiry (1 s): Celery's
    # main process revoked it at once (REVOKED stored while the original ran, and its ack took
    # the original's message off the broker's unacked set).
    start_worker(FAULT_VISIBILITY_TIMEOUT=str(VISIBILITY_TIMEOUT), FAULT_RESTORE_INTERVAL="60")
    result = producer.send_task(TASK, args=(1, 8.0), expires=expires)
    first = wait_started(record)
    sleep_past_visibility_timeout(first)
    force_visibility_timeout(producer, VISIBILITY_TIMEOUT)
    wait_redelivered_copy_deferred(record, result.id)

    assert wait_state(result, "SUCCESS") <= {"PENDING", "STARTED", "SUCCESS"}
    assert ran(record) == [(result.id, first["fence"])]
    wait_for("the deferred copy to be acked", lambda: broker_idle(broker), TIMEOUT)


def test_a_message_delivered_again_past_its_expiry_that_no_run_holds_is_revoked(
    start_worker: Callable[..., CeleryWorker],
    producer: Celery,
    record: Record,
    broker: redis.Redis,
) -> None:
    # The worker's main process lets a message delivered again past its expiry through (its
    # first delivery may be running): with no run of it holding the request, the pool revokes
    # it, as Celery would have. Here a countdown message, held by a worker that stopped
    # before it was due, is put back marked redelivered, and comes again after its expiry.
    first_worker = start_worker()
    sent_at = time.monotonic()
    result = producer.send_task(TASK, args=(1, 0.5), countdown=2.0, expires=3.0)
    wait_for("the worker to hold the message", lambda: broker.hlen("unacked") == 1, TIMEOUT)
    first_worker.stop()  # warm: the message goes back, marked redelivered
    time.sleep(max(0.0, sent_at + 3.5 - time.monotonic()))  # past its expiry
    start_worker()
    wait_state(result, "REVOKED")
    wait_for("the message to be acked", lambda: broker_idle(broker), TIMEOUT)
    assert record.started() == []


def test_deferred_copies_of_a_long_running_message_do_not_double_past_the_visibility_timeout(
    start_worker: Callable[..., CeleryWorker],
    producer: Celery,
    record: Record,
    broker: redis.Redis,
) -> None:
    # A deferred copy waits in the worker as an ETA message, unacked: one that waited past the
    # visibility timeout came back beside itself, each copy was deferred again, and the copies
    # doubled every round while the holder ran (1 -> 4 -> 14 -> 35 in a review's run).
    start_worker(
        FAULT_VISIBILITY_TIMEOUT=str(VISIBILITY_TIMEOUT),
        FAULT_RESTORE_INTERVAL="60",
        FAULT_LOCK_TTL="30",  # the holder's lease bounds no deferral below the backoff's 4 s
    )
    result = producer.send_task(TASK, args=(1, 8.0))
    first = wait_started(record)
    sleep_past_visibility_timeout(first)
    most_messages = 0
    deadline = time.monotonic() + TIMEOUT
    while result.state not in READY_STATES and time.monotonic() < deadline:
        force_visibility_timeout(producer, VISIBILITY_TIMEOUT)  # as a worker sweeps, sooner
        most_messages = max(most_messages, broker.llen("celery") + broker.hlen("unacked"))
        time.sleep(0.3)

    assert wait_state(result, "SUCCESS") <= {"PENDING", "STARTED", "SUCCESS"}
    wait_for("the deferred copies to be acked", lambda: broker_idle(broker), TIMEOUT)
    assert ran(record) == [(result.id, first["fence"])]
    deferred = record.deferred()
    assert len(deferred) >= 4, "too few rounds to have doubled"
    assert max(d["countdown"] for d in deferred) <= VISIBILITY_TIMEOUT / 2
    assert most_messages <= 2, f"{most_messages} messages of one task id at once"


def test_deferred_redelivery_survives_when_the_running_original_is_killed(
    start_worker: Callable[..., CeleryWorker], producer: Celery, record: Record
) -> None:
    start_worker(FAULT_VISIBILITY_TIMEOUT=str(VISIBILITY_TIMEOUT), FAULT_RESTORE_INTERVAL="60")
    # The body outlasts the sweep (at ~1.7 s) by seconds, so the copy is deferred and the
    # original killed while it still runs, even on a loaded machine; the rerun is as long.
    result = producer.send_task(TASK, args=(1, 6.0))
    first = wait_started(record)
    sleep_past_visibility_timeout(first)
    force_visibility_timeout(producer, VISIBILITY_TIMEOUT)
    wait_redelivered_copy_deferred(record, result.id)
    assert record.runs() == [], "the original ended before the test could kill it"
    # Acking the redelivered copy acked the original's delivery tag too: from here on the
    # deferred copy is the only one the broker has.
    os.kill(first["pid"], signal.SIGKILL)

    wait_state(result, "SUCCESS")
    assert ran(record) == [(result.id, first["fence"] + 1)]


def test_a_stale_holder_s_ack_leaves_a_copy_for_the_same_id_copy_that_took_its_lapsed_lease(
    start_worker: Callable[..., CeleryWorker], producer: Celery, record: Record
) -> None:
    # A review's chaos soak: a paused holder's lease lapses, the visibility timeout delivers
    # its message again, and that copy (the same task id) is granted the request. The stale
    # holder ends; Celery acks its delivery, and on Redis that ack takes the copy's too (a
    # restored message keeps its delivery tag). The copy is killed: nothing brought the
    # request back. The stale holder now sends a copy of its message as it ends.
    start_worker(
        FAULT_VISIBILITY_TIMEOUT=str(VISIBILITY_TIMEOUT),
        FAULT_RESTORE_INTERVAL="60",
        FAULT_HEARTBEAT_INTERVAL="0.5",
    )
    result = producer.send_task(TASK, args=(1, 6.0))
    first = wait_started(record)
    os.kill(first["pid"], signal.SIGSTOP)  # a paused holder: its 2 s lease lapses
    try:
        time.sleep(2.5)
        sleep_past_visibility_timeout(first)
        force_visibility_timeout(producer, VISIBILITY_TIMEOUT)
        second = wait_started(record, 2)
    finally:
        os.kill(first["pid"], signal.SIGCONT)
    assert (second["task_id"], second["fence"]) == (result.id, first["fence"] + 1)
    wait_for(
        "the stale holder to end",
        lambda: any(run["fence"] == first["fence"] for run in record.runs()),
        TIMEOUT,
    )
    assert not any(run["fence"] == second["fence"] for run in record.runs()), "ended too soon"
    os.kill(second["pid"], signal.SIGKILL)  # the OOM killer, say
    third = wait_for(
        "the request run again",
        lambda: next((run for run in record.runs() if run["fence"] > second["fence"]), None),
        TIMEOUT + KILLED_POOL_TTL,
    )
    assert third["task_id"] == result.id
    lost = [d for d in record.deferred() if d["reason"] == "lost"]
    assert [d["task_id"] for d in lost] == [result.id]


def test_countdown_message_and_its_same_id_duplicate_run_once(
    start_worker: Callable[..., CeleryWorker],
    producer: Celery,
    record: Record,
    broker: redis.Redis,
) -> None:
    start_worker()
    task_id = str(uuid.uuid4())
    for _ in range(2):  # a producer that retried a publish whose confirmation it lost
        producer.send_task(TASK, args=(2, 1.0), countdown=1.0, task_id=task_id)
    result = AsyncResult(task_id, app=producer)

    assert wait_state(result, "SUCCESS") <= {"PENDING", "STARTED", "SUCCESS"}
    wait_for("the duplicate to be acked", lambda: broker_idle(broker), TIMEOUT)
    assert AsyncResult(task_id, app=producer).state == "SUCCESS"
    [started] = record.started()  # one grant: the duplicate never ran
    assert ran(record) == [(task_id, started["fence"])]
    assert record.skipped() == []


def test_eta_duplicate_with_another_task_id_runs_once(
    start_worker: Callable[..., CeleryWorker], producer: Celery, record: Record
) -> None:
    start_worker()
    eta = datetime.now(timezone.utc) + timedelta(seconds=1)
    copies = [producer.send_task(TASK, args=(3, 1.0), eta=eta) for _ in range(2)]

    assert [follow(copy, timeout=TIMEOUT) for copy in copies] == [3, 3]
    states = sorted(copy.state for copy in copies)
    assert states == [SKIPPED, "SUCCESS"]
    runs = record.runs()
    assert len(runs) == 1
    skipped = next(copy for copy in copies if copy.state == SKIPPED)
    assert skipped.info["holder"] == runs[0]["task_id"]


# -- 4. a replaced task's message delivered again --------------------------------------------------

replacements_keep_their_depth = pytest.mark.skipif(
    not celery_lock.task._REPLACEMENTS_KEEP_THEIR_DEPTH,
    reason="this Celery sends a replacement without its depth (before 5.3.5): no hand-on marker",
)


@replacements_keep_their_depth
def test_a_replaced_message_delivered_again_after_its_pool_process_died_is_acked_unrun(
    start_worker: Callable[..., CeleryWorker], producer: Celery, record: Record
) -> None:
    # The pool process dies after sending the replacement, before its message is acked: the
    # message comes back, finds the hand-on marker its own run left, and is acked unrun; the
    # replacement, sent with the same task id, runs the request once.
    worker = start_worker(**KILLED_POOL_ENV, FAULT_KILL_AFTER_REPLACE="sent")
    # A second in the body first: a pool process killed before the pool has read that it took
    # the job leaves the job to no one (billiard marks lost only the jobs a process accepted),
    # and the message is neither acked nor returned while the worker runs. And a replacement
    # that runs past the pool's check (5 s): one that has stored its SUCCESS by the time the
    # pool notices the death has Celery ack the message ("succeeded before the worker was
    # lost": the two share a task id) instead of returning it.
    result = producer.send_task("fault.fetch", args=(5, 1.0, KILLED_POOL_TTL + 3.0))
    wait_state(result, "SUCCESS", timeout=2 * KILLED_POOL_TTL + TIMEOUT)
    assert result.result == 5
    assert record.client.get("fault:killed-after-replace") == b"1"
    acked = f"already handed on by this task {result.id}; acking the redelivery"
    try:  # returned once the pool noticed the death, while the replacement ran
        wait_for("the replaced message to come back", lambda: acked in worker.log(), TIMEOUT)
    except BaseException:
        print(worker.log()[-6000:])  # shown with the failure
        raise
    fetched = [json.loads(raw) for raw in record.client.lrange("fault:fetched", 0, -1)]
    assert [entry["task_id"] for entry in fetched] == [result.id]
    assert [task_id for task_id, _ in ran(record)] == [result.id]  # fault.work, once
    assert result.state == "SUCCESS"


@replacements_keep_their_depth
def test_a_replaced_message_whose_run_died_sending_its_replacement_runs_the_request_again(
    start_worker: Callable[..., CeleryWorker], producer: Celery, record: Record
) -> None:
    # The pool process dies as it sends the replacement, its hand-on marker written: nothing
    # went out. The message comes back, finds its own run's marker unconfirmed, withdraws it
    # and runs the request again: not acked unrun, which would leave no run to complete it.
    worker = start_worker(**KILLED_POOL_ENV, FAULT_KILL_AFTER_REPLACE="sending")
    result = producer.send_task("fault.fetch", args=(6, 1.0, 0.2))
    try:
        wait_state(result, "SUCCESS", timeout=2 * KILLED_POOL_TTL + TIMEOUT)
    except BaseException:
        print(worker.log()[-6000:])  # shown with the failure
        raise
    assert result.result == 6
    assert record.client.get("fault:killed-after-replace") == b"1"
    assert f"handed on by this task {result.id} when its run ended" in worker.log()
    fetched = [json.loads(raw) for raw in record.client.lrange("fault:fetched", 0, -1)]
    assert [entry["task_id"] for entry in fetched] == [result.id, result.id]
    assert [task_id for task_id, _ in ran(record)] == [result.id]  # fault.work, once
