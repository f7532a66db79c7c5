"""Skipped copies on result backends other than Redis, by a real prefork worker
(``tests/apps/store_app.py``): the database and filesystem backends with the session's Redis as
broker and lock store, and ``rpc://`` over RabbitMQ, on a queue of its own."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from celery import Celery
from conftest import wait_for

from celery_lock import SKIPPED, ConfigurationError, follow
from celery_lock.keys import RequestKeys
from celery_lock.testing import CeleryWorker, RedisServer

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 20.0
KEYS = RequestKeys.build("celery-lock", "store.work", "7", "store.work")


def store_env(broker: str, backend: str, lock_url: str, record_url: str) -> dict[str, str]:
    return {
        "STORE_BROKER_URL": broker,
        "STORE_BACKEND_URL": backend,
        "STORE_LOCK_URL": lock_url,
        "STORE_RECORD_URL": record_url,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]),
    }


@pytest.mark.worker
@pytest.mark.parametrize("kind", ["db+sqlite", "file"])
def test_follow_reaches_the_holder_of_a_prefork_worker_s_skip(
    kind: str,
    tmp_path: Path,
    redis_server: RedisServer,
    lock_url: str,
    lock_redis: redis.Redis,
    spawn_worker: Callable[..., CeleryWorker],
    make_producer: Callable[..., Celery],
) -> None:
    for db in (0, 3):
        redis_server.flush(db)
    if kind == "db+sqlite":
        backend = f"db+sqlite:///{tmp_path / 'results.db'}"
    else:
        (tmp_path / "results").mkdir()
        backend = f"file://{tmp_path / 'results'}"
    broker = redis_server.url_for(0)
    spawn_worker(
        "tests.apps.store_app",
        store_env(broker, backend, lock_url, redis_server.url_for(3)),
        concurrency=2,
    )
    app = make_producer(broker, backend)
    app.conf.celery_lock_redis_url = lock_url
    first = app.send_task("store.work", args=(7, 2.0))
    wait_for("the first copy to hold request 7", lambda: lock_redis.exists(KEYS.lock), TIMEOUT)
    running = app.send_task("store.work", args=(7,))
    wait_for("the copy to be SKIPPED", lambda: running.state == SKIPPED, TIMEOUT)
    assert (running.info["reason"], running.info["holder"]) == ("running", first.id)
    assert follow(running, timeout=TIMEOUT) == 7
    done = app.send_task("store.work", args=(7,))
    assert follow(done, timeout=TIMEOUT) == 7
    assert (done.state, done.info["reason"]) == (SKIPPED, "done")


@pytest.mark.worker
@pytest.mark.amqp
def test_follow_refuses_a_prefork_worker_s_skip_on_rpc_over_rabbitmq(
    rabbitmq: str,
    redis_server: RedisServer,
    lock_url: str,
    lock_redis: redis.Redis,
    spawn_worker: Callable[..., CeleryWorker],
) -> None:
    queue = f"celery-lock-rpc-{uuid.uuid4().hex[:8]}"
    redis_server.flush(3)
    env = store_env(rabbitmq, "rpc://", lock_url, redis_server.url_for(3))
    spawn_worker("tests.apps.store_app", env, "-Q", queue, concurrency=2)
    app = Celery("producer", broker=rabbitmq, backend="rpc://", set_as_current=False)
    app.conf.task_default_queue = queue
    app.conf.celery_lock_redis_url = lock_url
    try:
        first = app.send_task("store.work", args=(7, 2.0))
        wait_for("the first copy to hold request 7", lambda: lock_redis.exists(KEYS.lock), TIMEOUT)
        running = app.send_task("store.work", args=(7,))
        wait_for("the copy to be SKIPPED", lambda: running.state == SKIPPED, TIMEOUT)
        assert running.info["holder"] == first.id
        with pytest.raises(ConfigurationError):
            follow(running, timeout=TIMEOUT)
        assert follow(first, timeout=TIMEOUT) == 7
    finally:
        consumer = app.backend.result_consumer
        if consumer._consumer is not None:  # started by a get(): stop it, or its socket leaks
            consumer.stop()
        with app.connection_for_write() as connection:
            connection.default_channel.queue_delete(queue)
        app.close()
