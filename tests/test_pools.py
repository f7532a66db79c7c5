"""The heartbeat under the worker pools other than prefork: solo, threads, gevent and eventlet.

Real ``celery worker -P <pool>`` subprocesses run ``tests/apps/storm_app.py`` on the session's
redis-server. A lease that lapsed while its body ran cannot be released as a success: the
release finds the lock gone and writes no done-marker. So a done-marker naming the run says its
lease was held, extended by the heartbeat, from the grant to the release.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery, states
from celery.result import AsyncResult
from conftest import settle, wait_for

from celery_lock import SKIPPED
from celery_lock.keys import RequestKeys
from celery_lock.lease import decode_lock
from celery_lock.testing import CeleryWorker

pytestmark = pytest.mark.worker

APP = "tests.apps.storm_app"
TIMEOUT = 60


def run_once(
    spawn_worker: Callable[..., CeleryWorker],
    worker_env: dict[str, str],
    make_producer: Callable[..., Celery],
    pool: str,
    task: str,
) -> tuple[CeleryWorker, str]:
    """Run ``task`` for request 1 on a ``-P pool`` worker: the worker and the run's task id."""
    worker = spawn_worker(APP, worker_env, pool=pool, concurrency=2)
    app = make_producer(worker_env["STORM_BROKER_URL"], worker_env["STORM_BACKEND_URL"])
    result = app.send_task(task, args=(1,), kwargs={"seconds": 6.0})  # three lease TTLs
    assert result.get(timeout=TIMEOUT) == 1
    return worker, result.id


def recorded_runs(env: dict[str, str]) -> int:
    """How many bodies ran to their end (storm_app records each run)."""
    client = redis.Redis.from_url(env["STORM_RECORD_URL"])
    try:
        return client.llen("storm:runs")
    finally:
        client.close()


def done_by(lock_redis: redis.Redis, task: str) -> Any:
    return lock_redis.get(RequestKeys.build("celery-lock", task, "1", task).done)


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_a_body_that_never_sleeps_keeps_its_lease(
    pool: str,
    spawn_worker: Callable[..., CeleryWorker],
    worker_env: dict[str, str],
    make_producer: Callable[..., Celery],
    lock_redis: redis.Redis,
) -> None:
    # These pools send no worker_process_init (solo does, at pool start): the first lease
    # starts the heartbeat thread, which the GIL lets run beside a body that computes.
    worker, task_id = run_once(spawn_worker, worker_env, make_producer, pool, "storm.busy")
    assert done_by(lock_redis, "storm.busy") == task_id.encode()
    assert "the heartbeat is a greenlet" not in worker.log()


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_under_a_green_pool_a_body_that_yields_keeps_its_lease_and_the_worker_warns(
    pool: str,
    spawn_worker: Callable[..., CeleryWorker],
    worker_env: dict[str, str],
    make_producer: Callable[..., Celery],
    lock_redis: redis.Redis,
) -> None:
    # The heartbeat is a greenlet there (`celery worker -P gevent|eventlet` patches threading
    # before it imports the app): it runs while the body sleeps (yields to the hub), and the
    # worker says at start what a body that never yields would do to it.
    worker = spawn_worker(APP, worker_env, pool=pool, concurrency=2)
    app = make_producer(worker_env["STORM_BROKER_URL"], worker_env["STORM_BACKEND_URL"])
    first = app.send_task("storm.long", args=(1,), kwargs={"seconds": 6.0})  # three lease TTLs
    lock = RequestKeys.build("celery-lock", "storm.long", "1", "storm.long").lock
    held = wait_for("the first copy's lease", lambda: lock_redis.get(lock), TIMEOUT)
    assert decode_lock(held).holder.task_id == first.id
    # Copies sent all along the body's run reach the process's other greenlet while the first
    # sleeps: each is skipped, as running while the lease is held, as done once it is released.
    copies = []
    deadline = time.monotonic() + TIMEOUT
    while first.state not in states.READY_STATES:
        assert time.monotonic() < deadline, f"first copy still {first.state} after {TIMEOUT} s"
        copies.append(app.send_task("storm.long", args=(1,)))
        time.sleep(1.0)
    assert first.get(timeout=TIMEOUT) == 1
    assert set(settle(copies, TIMEOUT)) == {SKIPPED}
    assert {copy.info["holder"] for copy in copies} == {first.id}
    assert "running" in {copy.info["reason"] for copy in copies}  # the one sent at the grant
    assert recorded_runs(worker_env) == 1
    # Released as a success: the lock is gone and the done-marker names the run.
    assert lock_redis.get(lock) is None
    assert done_by(lock_redis, "storm.long") == first.id.encode()
    assert re.search(
        rf"WARNING.*celery-lock: under {pool} the heartbeat is a greenlet, not a thread: a body "
        r"that holds the hub .* for a whole lease TTL loses its lease unnoticed",
        worker.log(),
    ), worker.log()


#: The lock of storm.long's request 1, which the tests below run.
LONG_LOCK = RequestKeys.build("celery-lock", "storm.long", "1", "storm.long").lock


@pytest.fixture
def long_body_holding(
    spawn_worker: Callable[..., CeleryWorker],
    worker_env: dict[str, str],
    make_producer: Callable[..., Celery],
    lock_redis: redis.Redis,
) -> Callable[..., tuple[CeleryWorker, AsyncResult[Any]]]:
    """``long_body_holding(pool, **options)``: a ``-P pool`` worker, and its run of storm.long
    for request 1 (``options``, its keyword arguments), once the run holds its lease."""

    def start(pool: str, **options: Any) -> tuple[CeleryWorker, AsyncResult[Any]]:
        worker = spawn_worker(APP, worker_env, pool=pool, concurrency=2)
        app = make_producer(worker_env["STORM_BROKER_URL"], worker_env["STORM_BACKEND_URL"])
        result = app.send_task("storm.long", args=(1,), kwargs=options)
        wait_for("the body's lease", lambda: lock_redis.get(LONG_LOCK), TIMEOUT)
        return worker, result

    return start


def broker_messages(env: dict[str, str]) -> tuple[int, int]:
    """How many messages the broker has queued, and delivered but not acked."""
    broker = redis.Redis.from_url(env["STORM_BROKER_URL"])
    try:
        return broker.llen("celery"), broker.hlen("unacked")
    finally:
        broker.close()


@pytest.mark.parametrize("pool", ["solo", "gevent", "eventlet"])
def test_a_body_cut_short_by_a_cold_shutdown_gives_its_message_back(
    pool: str,
    long_body_holding: Callable[..., tuple[CeleryWorker, AsyncResult[Any]]],
    spawn_worker: Callable[..., CeleryWorker],
    worker_env: dict[str, str],
    lock_redis: redis.Redis,
) -> None:
    # These pools run the body in the worker's own process: a cold shutdown (SIGQUIT) raises
    # in it under solo (Celery acked the FAILURE), or kills its greenlet (Celery acked a
    # success with no result, PENDING for ever). Either way the request was lost; a prefork
    # worker's message comes back, as its pool process dies.
    worker, result = long_body_holding(pool, seconds=4.0)
    worker.send_signal(signal.SIGQUIT)
    worker.wait(TIMEOUT)
    assert lock_redis.get(LONG_LOCK) is None  # released without a done-marker
    assert done_by(lock_redis, "storm.long") is None
    assert result.state not in states.READY_STATES

    spawn_worker(APP, worker_env, concurrency=1)  # the message is back: it runs to its end
    assert result.get(timeout=TIMEOUT) == 1
    assert recorded_runs(worker_env) == 1
    assert done_by(lock_redis, "storm.long") == result.id.encode()


def test_a_body_s_own_error_in_a_cold_shutdown_under_threads_stays_a_failure(
    long_body_holding: Callable[..., tuple[CeleryWorker, AsyncResult[Any]]],
    worker_env: dict[str, str],
) -> None:
    # Under threads a cold shutdown lets the bodies run to their end: an error a body raises
    # then is its own, not the shutdown's, and is not given back to run again.
    worker, result = long_body_holding("threads", seconds=3.0, fail=True)
    worker.send_signal(signal.SIGQUIT)
    worker.wait(TIMEOUT)
    assert result.state == states.FAILURE
    assert broker_messages(worker_env) == (0, 0)
    assert recorded_runs(worker_env) == 1


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_body_revoked_with_terminate_under_a_green_pool_is_not_given_back(
    pool: str,
    long_body_holding: Callable[..., tuple[CeleryWorker, AsyncResult[Any]]],
    worker_env: dict[str, str],
    lock_redis: redis.Redis,
) -> None:
    # A revoke(terminate=True) kills the greenlet as a cold shutdown does; the message of a
    # body revoked stays acked (REVOKED), not given back to run again.
    _, result = long_body_holding(pool, seconds=4.0)
    result.revoke(terminate=True)
    wait_for("REVOKED", lambda: result.state == states.REVOKED, TIMEOUT)
    time.sleep(5.0)  # past the body's own end: a copy given back would have run by now
    assert broker_messages(worker_env) == (0, 0)
    assert recorded_runs(worker_env) == 0
    assert lock_redis.get(LONG_LOCK) is None
