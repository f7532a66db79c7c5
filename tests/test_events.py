"""Celery events from a real worker started with -E: task-skipped carries what Flower shows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from celery import Celery
from conftest import wait_for

from celery_lock import SKIPPED, is_skipped
from celery_lock.testing import CeleryWorker, EventTap

pytestmark = pytest.mark.worker

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def events_worker(
    spawn_worker: Callable[..., CeleryWorker], worker_env: dict[str, str]
) -> CeleryWorker:
    return spawn_worker("tests.apps.storm_app", worker_env, "-E", concurrency=2)


def test_skipped_copy_sends_task_skipped_event(
    make_producer: Callable[..., Celery], events_worker: CeleryWorker, worker_env: dict[str, str]
) -> None:
    app = make_producer(worker_env["STORM_BROKER_URL"], worker_env["STORM_BACKEND_URL"])
    with EventTap(app, "task-skipped") as tap:
        first = app.send_task("storm.process", args=(3,))
        first.get(timeout=30)
        copy = app.send_task("storm.process", args=(3,))
        wait_for("task-skipped", lambda: copy.state == SKIPPED and tap.events)
    [event] = tap.events
    assert event["uuid"] == copy.id
    assert event["name"] == "storm.process"
    assert event["reason"] == "done"
    assert event["holder"] == first.id
    assert event["lock_key"] == "celery-lock:{storm.process:3}:lock"
    assert "skipped" in event["result"]
    assert "args" not in event
    assert "kwargs" not in event


def test_a_copy_skipped_as_success_sends_task_skipped_too(
    make_producer: Callable[..., Celery], events_worker: CeleryWorker, worker_env: dict[str, str]
) -> None:
    # Such a copy ends as SUCCESS: the main process sees a success, so the pool process sends
    # the event. Flower must still count it as a skip.
    app = make_producer(worker_env["STORM_BROKER_URL"], worker_env["STORM_BACKEND_URL"])
    with EventTap(app, "task-skipped") as tap:
        first = app.send_task("storm.process_as_success", args=(4,))
        assert first.get(timeout=30) == 4
        copy = app.send_task("storm.process_as_success", args=(4,))
        assert is_skipped(copy.get(timeout=30))
        wait_for("task-skipped", lambda: tap.events)
    [event] = tap.events
    assert event["uuid"] == copy.id
    assert event["name"] == "storm.process_as_success"
    assert event["reason"] == "done"
    assert event["holder"] == first.id
    assert "skipped" in event["result"]
