"""Shutdown, revoke and start-up checks, with real prefork workers.

A body cut short by ``revoke(terminate=True)`` or by a shutdown that stops waiting hands its
lease back, so its returning message runs at once rather than after the lease TTL (30 s here).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from conftest import close_producer, wait_for

from celery_lock.testing import CeleryWorker, RedisServer

pytestmark = pytest.mark.worker

ROOT = Path(__file__).resolve().parent.parent
HOLD_KEY = "celery-lock:{storm.hold:1}:lock"
PROMPTLY = 10.0  # well under the 30 s lease TTL of storm.hold


@pytest.fixture
def start_worker(
    spawn_worker: Callable[..., CeleryWorker], worker_env: dict[str, str]
) -> Callable[..., CeleryWorker]:
    """``start_worker(*extra_args, **env)``: a two-process storm_app worker."""
    return lambda *extra, **env: spawn_worker(
        "tests.apps.storm_app", {**worker_env, **env}, *extra, concurrency=2
    )


@pytest.fixture
def producer(worker_env: dict[str, str]) -> Iterator[Celery]:
    app = Celery("producer", broker=worker_env["STORM_BROKER_URL"],
                 backend=worker_env["STORM_BACKEND_URL"], set_as_current=False)  # fmt: skip
    yield app
    close_producer(app)


@pytest.fixture
def records(worker_env: dict[str, str]) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(worker_env["STORM_RECORD_URL"])
    yield client
    client.close()


@pytest.fixture
def locks(worker_env: dict[str, str]) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(worker_env["STORM_LOCK_URL"])
    yield client
    client.close()


def seconds_until(what: str, probe: Callable[[], Any], timeout: float) -> float:
    """How long :func:`wait_for` waited for ``probe``."""
    started = time.monotonic()
    wait_for(what, probe, timeout)
    return time.monotonic() - started


def started_runs(records: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in records.lrange("storm:started", 0, -1)]


def test_revoke_terminate_releases_the_lease(
    start_worker: Any, producer: Celery, records: redis.Redis, locks: redis.Redis
) -> None:
    start_worker()
    result = producer.send_task("storm.hold", args=(1,))
    wait_for("the body to start", lambda: started_runs(records), 20)
    assert locks.exists(HOLD_KEY)
    producer.control.revoke(result.id, terminate=True)
    took = seconds_until("the lease to be released", lambda: not locks.exists(HOLD_KEY), PROMPTLY)
    print(f"lease released {took:.2f}s after revoke")
    wait_for("REVOKED", lambda: result.state == "REVOKED", 10)
    assert not locks.exists("celery-lock:{storm.hold:1}:done:storm.hold")


def test_running_body_finishes_on_warm_shutdown_and_releases_with_done_marker(
    start_worker: Any, producer: Celery, records: redis.Redis, locks: redis.Redis
) -> None:
    worker = start_worker()
    result = producer.send_task("storm.hold", args=(1,), kwargs={"seconds": 1.5})
    wait_for("the body to start", lambda: started_runs(records), 20)
    worker.send_signal(signal.SIGTERM)  # warm shutdown: Celery waits for running bodies
    worker.wait(30)
    assert result.state == "SUCCESS"
    assert not locks.exists(HOLD_KEY)
    assert locks.exists("celery-lock:{storm.hold:1}:done:storm.hold")


def test_shutdown_that_cuts_a_body_short_hands_its_lease_back(
    start_worker: Any, producer: Celery, records: redis.Redis, locks: redis.Redis
) -> None:
    """Warm shutdown, then cold: after the soft-shutdown timeout the pool is terminated."""
    soft = json.dumps({"worker_soft_shutdown_timeout": 1.0})
    first = start_worker(STORM_CONF=soft)
    result = producer.send_task("storm.hold", args=(1,))
    wait_for("the body to start", lambda: started_runs(records), 20)
    first.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    first.send_signal(signal.SIGQUIT)
    first.wait(30)
    assert not locks.exists(HOLD_KEY), "the lease outlived the process that held it"

    start_worker()
    took = seconds_until("the requeued message to run", lambda: result.state == "SUCCESS", PROMPTLY)
    print(f"requeued message ran {took:.2f}s after the second worker started")
    assert [run["fence"] for run in started_runs(records)] == [1, 2]


def test_cold_shutdown_hands_the_lease_back_and_leaves_only_the_fence(
    start_worker: Any, producer: Celery, records: redis.Redis, locks: redis.Redis
) -> None:
    """SIGQUIT on a prefork worker: billiard terminates the pool, the body's ``finally``
    releases without a done-marker and the process hands back what it still holds. The only
    key left is the fence counter, which lapses by its own TTL (the 24 h done TTL plus the
    task's 30 s lease TTL here)."""
    worker = start_worker()
    producer.send_task("storm.hold", args=(1,))
    wait_for("the body to start", lambda: started_runs(records), 20)
    assert locks.exists(HOLD_KEY)
    worker.send_signal(signal.SIGQUIT)  # cold shutdown
    worker.wait(30)
    fence_key = "celery-lock:{storm.hold:1}:fence"
    assert sorted(locks.scan_iter("celery-lock:*")) == [fence_key.encode()]  # no lock, no done
    assert 0 < locks.pttl(fence_key) <= (24 * 3600 + 30) * 1000, "the counter would never lapse"
    assert locks.get(fence_key) == b"1"


def test_worker_warns_about_settings_that_contradict_the_guarantees(
    start_worker: Any, worker_env: dict[str, str], tmp_path: Path
) -> None:
    with RedisServer(
        extra_args=["--maxmemory", "50mb", "--maxmemory-policy", "allkeys-lru"]
    ) as store:
        # lock_ttl: how Django's namespace="CELERY" loads a CELERY_LOCK_TTL setting.
        conf = json.dumps({"celery_lock_done_ttl": 60, "lock_ttl": 30})
        worker = start_worker(STORM_CONF=conf, STORM_LOCK_URL=store.url)
        log = worker.log()
        worker.stop()
    assert "done TTL (60s) is shorter than the broker's visibility timeout (3600s)" in log
    assert (
        "storm.slow_heartbeat: heartbeat interval (6s) is above a third of the lease TTL (10s)"
        in log
    )
    assert "maxmemory-policy allkeys-lru" in log
    assert "app.conf has lock_ttl but no celery_lock_ttl" in log
    assert "write CELERY_CELERY_LOCK_TTL" in log
