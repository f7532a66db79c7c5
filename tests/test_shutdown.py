"""Shutdown, revoke, Celery's own limits and start-up checks, with real prefork workers.

A body cut short by ``revoke(terminate=True)``, by a shutdown that stops waiting, or by a time
limit hands its lease back (no done-marker unless the body returned), so its returning message
runs at once, with the next fence, rather than after the lease TTL (30 s here). So do pool
processes recycled between tasks, and a body whose broker connection is lost meanwhile.
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
from celery import Celery, Task
from conftest import close_producer, consecutive, wait_for

from celery_lock.testing import CeleryWorker, RedisServer

pytestmark = pytest.mark.worker

ROOT = Path(__file__).resolve().parent.parent
HOLD_KEY = "celery-lock:{storm.hold:1}:lock"
HOLD_DONE = "celery-lock:{storm.hold:1}:done:storm.hold"
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
    assert not locks.exists(HOLD_DONE)


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
    assert locks.exists(HOLD_DONE)


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
    fences = [run["fence"] for run in started_runs(records)]
    assert len(fences) == 2
    assert consecutive(fences)  # the rerun: the next grant


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
    [run] = started_runs(records)
    assert locks.get(fence_key) == str(run["fence"]).encode()  # the one grant's


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


# -- time limits, recycled pool processes, a lost broker connection -----------------------------


def started_fences(records: redis.Redis) -> list[int]:
    return [json.loads(raw)["fence"] for raw in records.lrange("storm:started", 0, -1)]


def finished_runs(records: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in records.lrange("storm:runs", 0, -1)]


def state(app: Celery, task_id: str) -> str:
    """The stored state, read afresh (an ``AsyncResult`` keeps the first ready state it saw:
    a FAILURE a rerun later overwrites with SUCCESS)."""
    return str(app.backend.get_task_meta(task_id)["status"])


@pytest.mark.parametrize(
    "limit",
    # A soft limit raises in the body. At a hard one billiard SIGTERMs the pool process
    # (SIGKILL 0.1 s later): the SIGTERM's exception runs the body's ``finally``.
    [{"soft_time_limit": 1}, {"time_limit": 2}],
    ids=["soft", "hard"],
)
def test_a_time_limit_fails_the_task_and_releases_without_a_done_marker(
    start_worker: Any, producer: Celery, records: redis.Redis, locks: redis.Redis,
    limit: dict[str, int],
) -> None:  # fmt: skip
    start_worker()
    result = producer.send_task("storm.hold", args=(1,), **limit)
    wait_for("FAILURE", lambda: state(producer, result.id) == "FAILURE", 20)
    wait_for("the lease to be released", lambda: not locks.exists(HOLD_KEY), PROMPTLY)
    assert not locks.exists(HOLD_DONE)
    assert len(started_fences(records)) == 1


def test_a_soft_time_limit_during_the_acquire_gives_the_message_back_unrun(
    start_worker: Any, producer: Celery, records: redis.Redis
) -> None:
    """A lock store that hangs takes two socket timeouts (about 10 s) to give the acquire up:
    a soft time limit below that fired in the acquire, and the task failed before its body
    began, its message acked. Given back, the message runs once the store answers again."""
    with RedisServer() as store:
        worker = start_worker(STORM_LOCK_URL=store.url)
        store.pause()
        try:
            result = producer.send_task("storm.process", args=(1,), soft_time_limit=3)
            # The limit fires in the first delivery's acquire; the store answers again a
            # second into the next one's, well before its limit.
            time.sleep(4)
            assert state(producer, result.id) != "FAILURE"
        finally:
            store.resume()
        try:
            wait_for("SUCCESS", lambda: state(producer, result.id) == "SUCCESS", 40)
        except BaseException:
            print(worker.log()[-6000:])  # shown with the failure
            raise
    assert len(finished_runs(records)) == 1
    # Given back, not republished: a Redis broker counts no returns, and is often the store
    # that hangs, where a republish would hang too.
    assert "store-unavailable" not in worker.log()


@pytest.mark.skipif(not hasattr(Task, "acks_on_timeout"), reason="task_acks_on_timeout: 5.7+")
def test_a_message_requeued_after_a_hard_time_limit_runs_again_at_once(
    start_worker: Any, producer: Celery, records: redis.Redis, locks: redis.Redis
) -> None:
    """With ``task_acks_on_timeout = False`` Celery requeues the message before it kills the
    process: the copy waits (deferred) for the lease or finds it released, never runs beside."""
    start_worker(STORM_CONF=json.dumps({"task_acks_on_timeout": False}))
    result = producer.send_task("storm.hold", args=(1,), time_limit=2)
    wait_for("the rerun", lambda: finished_runs(records), 2 + PROMPTLY)
    fences = started_fences(records)
    assert len(fences) == 2
    assert consecutive(fences)
    wait_for("SUCCESS", lambda: state(producer, result.id) == "SUCCESS", 10)
    assert locks.exists(HOLD_DONE)
    assert not locks.exists(HOLD_KEY)


@pytest.mark.parametrize("limit", ["--max-tasks-per-child", "--max-memory-per-child"])
def test_recycled_pool_processes_keep_and_release_their_leases(
    limit: str, start_worker: Any, producer: Celery, records: redis.Redis, locks: redis.Redis
) -> None:
    """Each process runs one body (``1``: one task, or 1 KiB of RSS) and is replaced: each body
    outlasts its 2 s TTL, so only the new process's heartbeat keeps its lease; a lease that
    lapsed would be released unowned, without a done-marker."""
    worker = start_worker(limit, "1")
    results = [producer.send_task("storm.long", args=(i,), kwargs={"seconds": 3})
               for i in range(3)]  # fmt: skip
    wait_for("every request", lambda: all(r.state == "SUCCESS" for r in results), 60)
    assert len({run["pid"] for run in finished_runs(records)}) == 3
    for i in range(3):
        assert locks.exists(f"celery-lock:{{storm.long:{i}}}:done:storm.long")
    assert not list(locks.scan_iter("celery-lock:*:lock"))
    assert "no longer held" not in worker.log()


@pytest.fixture
def broker() -> Iterator[RedisServer]:
    """A broker of its own, whose clients a test can cut off without the lock store's."""
    with RedisServer() as server:
        yield server


@pytest.mark.parametrize("cancel", [False, True])
def test_a_broker_connection_lost_mid_body_never_runs_the_request_twice_at_once(
    cancel: bool, broker: RedisServer, start_worker: Any, worker_env: dict[str, str],
    records: redis.Redis, locks: redis.Redis,
) -> None:  # fmt: skip
    """kombu restores the unacked message when the connection drops. Left running, the body
    holds the lease: the restored copy is deferred until the done-marker acks it. Cancelled
    (``worker_cancel_long_running_tasks_on_connection_loss``), the body is SIGTERMed and
    releases: the restored copy runs at once with the next fence."""
    conf = {"worker_cancel_long_running_tasks_on_connection_loss": cancel}
    worker = start_worker(STORM_BROKER_URL=broker.url, STORM_CONF=json.dumps(conf))
    app = Celery("producer", broker=broker.url, backend=worker_env["STORM_BACKEND_URL"],
                 set_as_current=False)  # fmt: skip
    try:
        result = app.send_task("storm.hold", args=(1,), kwargs={"seconds": 4})
        wait_for("the body to start", lambda: started_fences(records), 20)
        with broker.client() as admin:
            admin.client_kill_filter(_type="normal", skipme=True)
            wait_for("SUCCESS", lambda: state(app, result.id) == "SUCCESS", 4 + PROMPTLY)
            assert len(finished_runs(records)) == 1
            fences = started_fences(records)
            assert len(fences) == (2 if cancel else 1)
            assert consecutive(fences)
            assert locks.exists(HOLD_DONE)
            if not cancel:
                wait_for("the restored copy to be acked", lambda: "acking the redelivery"
                         in worker.log(), 20)  # fmt: skip
            wait_for("an empty broker", lambda: not admin.llen("celery")
                     and not admin.hlen("unacked"), 20)  # fmt: skip
        assert not locks.exists(HOLD_KEY)
    finally:
        close_producer(app)
        worker.stop()
