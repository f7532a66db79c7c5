"""``follow`` with Celery's ``rpc://`` result backend (results travel as messages to the caller),
by a real prefork worker (``tests/apps/store_app.py``) on the session's Redis.

The quickstart's steps, on ``rpc://``: a first copy runs, a second is skipped. Each state
reaches one reader of the caller's reply queue, once, so the skip is read with its meta in one
read, and a holder's result, which may have gone elsewhere, is not waited for.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from celery import Celery
from conftest import wait_for

from celery_lock import ConfigurationError, follow
from celery_lock.keys import RequestKeys
from celery_lock.testing import CeleryWorker, RedisServer

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 20.0
KEYS = RequestKeys.build("celery-lock", "store.work", "7", "store.work")


@pytest.mark.worker
def test_follow_on_an_rpc_backend_refuses_to_follow_a_skip_to_its_holder(
    redis_server: RedisServer,
    lock_url: str,
    lock_redis: redis.Redis,
    spawn_worker: Callable[..., CeleryWorker],
) -> None:
    for db in (0, 3):
        redis_server.flush(db)
    env = {
        "STORE_BROKER_URL": redis_server.url_for(0),
        "STORE_BACKEND_URL": "rpc://",
        "STORE_LOCK_URL": lock_url,
        "STORE_RECORD_URL": redis_server.url_for(3),
        "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]),
    }
    spawn_worker("tests.apps.store_app", env, concurrency=2)
    app = Celery("producer", broker=env["STORE_BROKER_URL"], backend="rpc://", set_as_current=False)
    app.conf.celery_lock_redis_url = lock_url
    try:
        first = app.send_task("store.work", args=(7, 2.0))
        wait_for("the first copy to hold request 7", lambda: lock_redis.exists(KEYS.lock), TIMEOUT)
        second = app.send_task("store.work", args=(7,))  # skipped: the first copy runs request 7
        with pytest.raises(ConfigurationError, match=r"^result_backend: follow\(\) cannot follow"):
            follow(second, timeout=TIMEOUT)  # not None, as if the skip named no holder
        assert follow(first, timeout=TIMEOUT) == 7  # a copy that ran is followed as ever
    finally:
        consumer = app.backend.result_consumer
        if consumer._consumer is not None:  # started by a get(): stop it, or its socket leaks
            consumer.stop()
        app.close()
