"""The heartbeat under the worker pools other than prefork: solo, threads and gevent.

Real ``celery worker -P <pool>`` subprocesses run ``tests/apps/storm_app.py`` on the session's
redis-server. A lease that lapsed while its body ran cannot be released as a success: the
release finds the lock gone and writes no done-marker. So a done-marker naming the run says its
lease was held, extended by the heartbeat, from the grant to the release.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_lock.keys import RequestKeys
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
    assert "under gevent" not in worker.log()


def test_under_gevent_a_body_that_yields_keeps_its_lease_and_the_worker_warns(
    spawn_worker: Callable[..., CeleryWorker],
    worker_env: dict[str, str],
    make_producer: Callable[..., Celery],
    lock_redis: redis.Redis,
) -> None:
    # The heartbeat is a greenlet there: it runs while the body sleeps (yields to the hub), and
    # the worker says at start what a body that never yields would do to it.
    worker, task_id = run_once(spawn_worker, worker_env, make_producer, "gevent", "storm.long")
    assert done_by(lock_redis, "storm.long") == task_id.encode()
    assert re.search(
        r"WARNING.*celery-lock: under gevent the heartbeat is a greenlet, not a thread: a body "
        r"that holds the hub .* for a whole lease TTL loses its lease unnoticed",
        worker.log(),
    ), worker.log()
