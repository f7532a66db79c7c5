"""Duplicate storms through real prefork workers: each request runs once, never two at a time.

A real ``celery worker -P prefork -c 4`` subprocess runs ``tests/apps/storm_app.py`` against the
session's redis-server (or the RabbitMQ service for the AMQP storm); every body records its
monotonic interval, fence and task id, and the test checks the record.
"""

from __future__ import annotations

import itertools
import json
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, states
from celery.result import AsyncResult
from conftest import settle, wait_for

from celery_lock import SKIPPED
from celery_lock.lease import decode_lock
from celery_lock.testing import CeleryWorker

pytestmark = pytest.mark.worker

REQUESTS = 40
COPIES = 5
SETTLE_TIMEOUT = 120
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def producer(make_producer: Callable[..., Celery]) -> Callable[..., Celery]:
    def make(env: dict[str, str]) -> Celery:
        return make_producer(env["STORM_BROKER_URL"], env["STORM_BACKEND_URL"],
                             env.get("STORM_QUEUE", "celery"))  # fmt: skip

    return make


@pytest.fixture
def start_worker(
    spawn_worker: Callable[..., CeleryWorker], worker_env: dict[str, str]
) -> Callable[..., CeleryWorker]:
    """``start_worker(**env)``: a four-process storm_app worker."""
    return lambda **env: spawn_worker("tests.apps.storm_app", {**worker_env, **env})


def publish_shuffled(app: Celery, jobs: list[tuple[str, int]]) -> list[AsyncResult[Any]]:
    random.shuffle(jobs)
    return [app.send_task(name, args=(idx,), task_id=str(uuid.uuid4())) for name, idx in jobs]


def recorded_runs(env: dict[str, str]) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(env["STORM_RECORD_URL"])
    try:
        return [json.loads(raw) for raw in client.lrange("storm:runs", 0, -1)]
    finally:
        client.close()


def assert_no_overlap_and_increasing_fences(runs: list[dict[str, Any]]) -> None:
    by_request: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_request[run["request_idx"]].append(run)
    for idx, request_runs in by_request.items():
        request_runs.sort(key=lambda run: run["start"])
        for earlier, later in itertools.pairwise(request_runs):
            assert later["start"] >= earlier["end"], f"request {idx}: runs overlap"
            assert later["fence"] > earlier["fence"], f"request {idx}: fence did not increase"


def run_storm(app: Celery, env: dict[str, str]) -> None:
    jobs = [("storm.process", idx) for idx in range(REQUESTS) for _ in range(COPIES)]
    results = publish_shuffled(app, jobs)
    counts = settle(results, SETTLE_TIMEOUT)
    assert counts == {"SUCCESS": REQUESTS, SKIPPED: REQUESTS * (COPIES - 1)}

    runs = recorded_runs(env)
    assert sorted(run["request_idx"] for run in runs) == list(range(REQUESTS))
    assert_no_overlap_and_increasing_fences(runs)
    executed = {run["task_id"] for run in runs}
    for result in results:
        if result.state == SKIPPED:
            assert result.info["reason"] in ("running", "done")
            assert result.info["holder"] in executed

    # Copies sent after completion are skipped as done, pointing at the run that did it.
    late = publish_shuffled(app, [("storm.process", idx) for idx in range(REQUESTS)])
    assert settle(late, SETTLE_TIMEOUT) == {SKIPPED: REQUESTS}
    assert {result.info["reason"] for result in late} == {"done"}
    assert len(recorded_runs(env)) == REQUESTS


def test_duplicate_storm_runs_each_request_once(
    producer: Callable[..., Celery], start_worker: Any, worker_env: dict[str, str]
) -> None:
    start_worker()
    app = producer(worker_env)
    run_storm(app, worker_env)


def test_stages_sharing_a_scope_never_overlap_and_each_runs_once(
    producer: Callable[..., Celery], start_worker: Any, worker_env: dict[str, str]
) -> None:
    start_worker()
    app = producer(worker_env)
    stages = ("storm.pending", "storm.process_stage", "storm.callback")
    jobs = [(stage, idx) for idx in range(30) for stage in stages for _ in range(3)]
    results = publish_shuffled(app, jobs)
    counts = settle(results, SETTLE_TIMEOUT)
    assert counts["SUCCESS"] == 30 * len(stages)
    assert counts[SKIPPED] == 30 * len(stages) * 2

    runs = recorded_runs(worker_env)
    per_stage: dict[tuple[str, int], int] = defaultdict(int)
    for run in runs:
        per_stage[(run["task"], run["request_idx"])] += 1
    assert set(per_stage.values()) == {1}
    assert len(per_stage) == 30 * len(stages)
    assert_no_overlap_and_increasing_fences(runs)


@pytest.mark.amqp
def test_duplicate_storm_over_rabbitmq(
    producer: Callable[..., Celery], start_worker: Any, worker_env: dict[str, str], rabbitmq: str
) -> None:
    queue = f"celery-lock-storm-{uuid.uuid4().hex[:8]}"
    env = {**worker_env, "STORM_BROKER_URL": rabbitmq, "STORM_QUEUE": queue}
    start_worker(STORM_BROKER_URL=rabbitmq, STORM_QUEUE=queue)
    app = producer(env)
    try:
        run_storm(app, env)
    finally:
        with app.connection_for_write() as connection:
            connection.default_channel.queue_delete(queue)


def test_long_task_keeps_its_lease_by_heartbeat_in_pool_process(
    producer: Callable[..., Celery],
    start_worker: Any,
    worker_env: dict[str, str],
    lock_redis: redis.Redis,
) -> None:
    """A body running 4x its TTL keeps the lease; copies arriving all along are skipped."""
    start_worker()
    app = producer(worker_env)
    first = app.send_task("storm.long", args=(1,))
    # Copies are sent once the first holds the lease: sent earlier, one could reach another
    # pool process first and make the first copy the skipped one.
    held = wait_for(
        "the first copy's lease", lambda: lock_redis.get("celery-lock:{storm.long:1}:lock")
    )
    assert decode_lock(held).holder.task_id == first.id
    copies = []
    deadline = time.monotonic() + 60
    while first.state not in states.READY_STATES:
        assert time.monotonic() < deadline, f"first copy still {first.state} after 60 s"
        copies.append(app.send_task("storm.long", args=(1,)))
        time.sleep(0.4)
    assert first.state == "SUCCESS", first.info
    assert len(copies) >= 5
    assert set(settle(copies, SETTLE_TIMEOUT)) == {SKIPPED}
    assert {copy.info["holder"] for copy in copies} == {first.id}
    assert len(recorded_runs(worker_env)) == 1


class SentOnly:
    """A sent call's handle that never asks the result backend (an AsyncResult does, as it is
    collected, under a key made of the task id)."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id


def test_a_task_id_holding_a_lone_surrogate_completes_its_request_once(
    producer: Callable[..., Celery],
    start_worker: Any,
    worker_env: dict[str, str],
    lock_redis: redis.Redis,
) -> None:
    """A client's key, read from JSON, used as the task id: the broker carries its lone
    surrogate (JSON escapes it), and the run's release must record it, or the next copy of the
    request runs the body again. The run ignores its result: Celery's Redis backend cannot make
    a result key of that id."""
    start_worker()
    app = producer(worker_env)
    task_id = json.loads('"req-7\\udcff"')
    app.send_task(
        "storm.process", args=(7,), task_id=task_id, ignore_result=True, result_cls=SentOnly
    )
    done = "celery-lock:{storm.process:7}:done:storm.process"
    assert wait_for("the run's done-marker", lambda: lock_redis.get(done)) == b"req-7\xed\xb3\xbf"
    copy = app.send_task("storm.process", args=(7,))
    assert settle([copy], SETTLE_TIMEOUT) == {SKIPPED: 1}
    assert (copy.info["reason"], copy.info["holder"]) == ("done", task_id)
    assert [run["task_id"] for run in recorded_runs(worker_env)] == [task_id]
