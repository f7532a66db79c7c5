"""Celery events from a real worker started with -E: task-skipped carries what Flower shows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from celery import Celery
from conftest import wait_for

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


@pytest.mark.parametrize(
    ("task", "copy_state"),
    [("storm.process", SKIPPED), ("storm.process_as_success", "SUCCESS")],
    ids=["skipped", "skip-as-success"],
)
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
