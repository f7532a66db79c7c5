"""Celery events from a real worker started with -E: task-skipped carries what Flower shows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.events.state import State
from conftest import wait_for

import celery_lock.task
from celery_lock import SKIPPED, LockedTask, is_skipped
from celery_lock.events import task_events_enabled
from celery_lock.testing import CeleryWorker, EventTap

pytestmark = pytest.mark.worker

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def events_worker(
    spawn_worker: Callable[..., CeleryWorker], worker_env: dict[str, str]
) -> CeleryWorker:
    return spawn_worker("tests.apps.storm_app", worker_env, "-E", concurrency=2)


#: A copy skipped as SKIPPED, or completed as SUCCESS with a marker (skip_as_success).
SKIP_MODES = pytest.mark.parametrize(
    ("task", "copy_state"),
    [("storm.process", SKIPPED), ("storm.process_as_success", "SUCCESS")],
    ids=["skipped", "skip-as-success"],
)


@SKIP_MODES
def test_skipped_copy_sends_task_skipped_event(
    make_producer: Callable[..., Celery],
    events_worker: CeleryWorker,
    worker_env: dict[str, str],
    task: str,
    copy_state: str,
) -> None:
    # A copy completed as SUCCESS (skip_as_success) reaches the main process as a success: its
    # pool process sends the event, and Flower must count it as a skip all the same.
    app = make_producer(worker_env["STORM_BROKER_URL"], worker_env["STORM_BACKEND_URL"])
    with EventTap(app, "task-skipped") as tap:
        first = app.send_task(task, args=(3,))
        first.get(timeout=30)
        copy = app.send_task(task, args=(3,))
        wait_for("task-skipped", lambda: copy.state == copy_state and tap.events)
    if copy_state == "SUCCESS":
        assert is_skipped(copy.result)
    [event] = tap.events
    assert event["uuid"] == copy.id
    assert event["name"] == task
    assert event["reason"] == "done"
    assert event["holder"] == first.id
    assert event["lock_key"] == f"celery-lock:{{{task}:3}}:lock"
    assert "skipped" in event["result"]
    assert "args" not in event
    assert "kwargs" not in event


@pytest.mark.skipif(
    not celery_lock.task._REPLACEMENTS_KEEP_THEIR_DEPTH,
    reason="this Celery sends a replacement without its depth (before 5.3.5): no hand-on marker",
)
def test_a_copy_skipped_for_a_hand_on_says_so_in_task_skipped(
    make_producer: Callable[..., Celery], events_worker: CeleryWorker, worker_env: dict[str, str]
) -> None:
    app = make_producer(worker_env["STORM_BROKER_URL"], worker_env["STORM_BACKEND_URL"])
    with EventTap(app, "task-skipped") as tap:
        first = app.send_task("storm.handoff", args=(3,))
        assert first.get(timeout=30) == 3  # storm.process's, under the same task id
        copy = app.send_task("storm.handoff", args=(3,))
        wait_for("task-skipped", lambda: copy.state == SKIPPED and tap.events)
    [event] = tap.events
    assert (event["uuid"], event["reason"], event["holder"]) == (copy.id, "done", first.id)
    assert event["handed_on_at"] == 0
    assert event["result"] == f"skipped: handed on (holder {first.id}, at depth 0)"
    assert copy.info["handed_on_at"] == 0


@SKIP_MODES
def test_task_skipped_names_a_shadowed_call_as_task_received_does(
    make_producer: Callable[..., Celery],
    events_worker: CeleryWorker,
    worker_env: dict[str, str],
    task: str,
    copy_state: str,
) -> None:
    # Celery's own events name a call by its shadow name ("used in logs/monitoring"): under
    # the task's own name, Flower renamed the copy at the skip and counted it apart.
    app = make_producer(worker_env["STORM_BROKER_URL"], worker_env["STORM_BACKEND_URL"])
    shadow = f"{task}[tenant-a]"
    with EventTap(app, "task-received", "task-skipped") as tap:
        app.send_task(task, args=(5,), shadow=shadow).get(timeout=30)
        copy = app.send_task(task, args=(5,), shadow=shadow)
        wait_for(
            "task-skipped",
            lambda: (
                copy.state == copy_state and any(e["type"] == "task-skipped" for e in tap.events)
            ),
        )
    names = {event["type"]: event["name"] for event in tap.events if event["uuid"] == copy.id}
    assert names == {"task-received": shadow, "task-skipped": shadow}


def test_task_lock_lost_names_a_shadowed_call_as_task_received_does(
    make_producer: Callable[..., Celery], events_worker: CeleryWorker, worker_env: dict[str, str]
) -> None:
    app = make_producer(worker_env["STORM_BROKER_URL"], worker_env["STORM_BACKEND_URL"])
    locks = redis.Redis.from_url(worker_env["STORM_LOCK_URL"])
    key = "celery-lock:{storm.long:6}:lock"
    try:
        with EventTap(app, "task-received", "task-lock-lost") as tap:
            result = app.send_task("storm.long", args=(6, 3.0), shadow="storm.long[tenant-a]")
            wait_for("the lease", lambda: locks.exists(key))
            locks.delete(key)  # the heartbeat's next extend finds it gone
            wait_for("task-lock-lost", lambda: len(tap.events) == 2)
            result.get(timeout=30)
    finally:
        locks.close()
    assert [(e["type"], e["name"]) for e in tap.events][:2] == [
        ("task-received", "storm.long[tenant-a]"),
        ("task-lock-lost", "storm.long[tenant-a]"),
    ]
    # The copy the lost run sent of its message (semantics.md) is received under the name too.
    assert {(e["type"], e["name"]) for e in tap.events[2:]} <= {
        ("task-received", "storm.long[tenant-a]")
    }


@pytest.mark.parametrize(
    ("worker_sends", "task_sends"), [(True, True), (True, False), (False, True)]
)
def test_events_follow_the_worker_switch_and_the_tasks_own(
    worker_sends: bool, task_sends: bool
) -> None:
    app = Celery("switches", broker="memory://", set_as_current=False)
    app.conf.worker_send_task_events = worker_sends

    @app.task(base=LockedTask, lock_key="request_idx", send_events=task_sends, shared=False)
    def quiet(request_idx: int) -> None: ...

    assert task_events_enabled(quiet) is (worker_sends and task_sends)


@pytest.mark.parametrize(
    ("end", "fields", "final", "result"),
    [
        ("task-succeeded", {"result": "7", "runtime": 1.0}, "SUCCESS", "7"),
        ("task-failed", {"exception": "LockLostError()"}, "FAILURE", "lock lost: k"),
    ],
    ids=["succeeded", "failed"],
)
def test_a_lost_lease_s_result_stays_on_a_row_that_ends_failed(
    end: str, fields: dict[str, object], final: str, result: str
) -> None:
    # Celery's State, which Flower's is: task-failed carries no result (monitoring.md).
    state = State()
    events = [
        ("task-received", {"name": "shop.charge"}),
        ("task-started", {}),
        ("task-lock-lost", {"name": "shop.charge", "lock_key": "k", "result": "lock lost: k"}),
        (end, fields),
    ]
    for clock, (type_, more) in enumerate(events):
        common = {"uuid": "u", "hostname": "w", "clock": clock, "timestamp": clock}
        state.event({"type": type_, "local_received": clock, **common, **more})
    assert (state.tasks["u"].state, state.tasks["u"].result) == (final, result)
