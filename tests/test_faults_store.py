"""When the lock store fails: down, restarted, answering ambiguously, or holding garbage.

Every test runs against real ``redis-server`` processes. The lock store is always a server of
its own (``lock_server``), so a test can stop, restart or pause it without touching the broker.

- Down when a task arrives: transient errors are retried (bounded, jittered), then the task
  fails closed: deferred, never run unlocked, and run exactly once after the store returns
  (real ``celery worker -P prefork`` on ``tests/apps/store_app.py``); ``fail_open`` runs the
  body unlocked with a warning per run. A store whose save to disk failed (``MISCONF``) is
  down for now too, until a save succeeds.
- Down mid-run: the heartbeat cannot extend; after a whole TTL unconfirmed the lease is lost
  (signal, ``request.lock_lost``); the release fails and is logged; the task still succeeds.
  A release refused for now while the lease is still held is tried again by the heartbeat: with
  its done-marker once the store answers, given up once the lease lapses.
- Ambiguous replies: a reply lost after the write (a TCP proxy that runs the command but drops
  its reply) for acquire and release; ``NOSCRIPT`` after a real restart for acquire, release and
  the heartbeat's pipeline; a restart noticed by the server's ``run_id``.
- Garbage under our keys: a typed :class:`LockStateError` naming the key; the task fails.
- Tokens: distinct across forked processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import select
import signal
import socket
import sys
import threading
import time
import types
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import TestWorkController
from conftest import command_calls, consecutive, granted, settle, wait_for
from recording import recording
from redis.backoff import NoBackoff
from redis.credentials import CredentialProvider
from redis.retry import Retry

import celery_lock.heartbeat
from celery_lock import (
    SKIPPED,
    LockedTask,
    LockStateError,
    LockStoreError,
    LockStoreUnavailableError,
    signals,
)
from celery_lock.heartbeat import Heartbeat, _Release
from celery_lock.keys import RequestKeys
from celery_lock.lease import Acquired, Holder, Lease, encode_lock, new_token
from celery_lock.runtime import reset_runtime
from celery_lock.scripts import RELEASE
from celery_lock.store import LockStore, TransientReplyError, _check_out
from celery_lock.testing import CeleryWorker, RedisServer

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 20.0
pytestmark = pytest.mark.usefixtures("close_lock_runtime")

HOLDER = Holder(task_id="task-1", task_name="shop.process", host="host-a", pid=101)
KEYS = RequestKeys.build("celery-lock", "shop.process", "42", "shop.process")
TTL_MS = 5_000
FENCE_TTL_MS = 60_000


# -- helpers ---------------------------------------------------------------------------------


def acquire(store: LockStore, token: str, keys: RequestKeys = KEYS, holder: Holder = HOLDER):
    return store.acquire(keys, token, TTL_MS, holder, FENCE_TTL_MS)


class Records(logging.Handler):
    """Collects celery-lock's log records (also from worker threads)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int = logging.DEBUG, contains: str = "") -> list[str]:
        return [
            r.getMessage()
            for r in list(self.records)
            if r.levelno >= level and contains in r.getMessage()
        ]


@pytest.fixture
def logs() -> Iterator[Records]:
    """celery-lock's log records at INFO and above, straight from its logger.

    Not ``caplog``: an in-process worker sets up Celery's logging, which may drop the root
    logger's handlers.
    """
    handler = Records()
    logger = logging.getLogger("celery_lock")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def lock_server() -> Iterator[RedisServer]:
    """A lock store of this test alone: stopping it touches nothing else."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def admin(lock_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain client on the lock store, for setting up and inspecting keys."""
    client = lock_server.client()
    yield client
    client.close()


@pytest.fixture
def store(lock_server: RedisServer) -> Iterator[LockStore]:
    store = LockStore.from_url(lock_server.url)
    yield store
    store.client.close()


def beat_once(lease: Lease) -> None:
    """One heartbeat beat over ``lease``, and only that one (the thread waits a minute)."""
    heartbeat = Heartbeat()
    heartbeat.add(lease, 60.0)
    try:
        heartbeat.beat()
    finally:
        heartbeat.stop()


class ReplyDropper:
    """A TCP proxy in front of a redis-server that loses chosen replies.

    ``drop_reply_to(marker)`` arms it: the next command whose bytes contain ``marker`` reaches
    the server and runs there, but the proxy closes the client's connection instead of passing
    the reply on, as a network cut between the write and its reply would. With ``hang=True``
    it keeps the connection open and the reply to itself: the client's read times out.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.dropped = 0
        self._armed: list[tuple[bytes, bool]] = []
        self._guard = threading.Lock()
        self._stopping = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def drop_reply_to(self, marker: bytes, *, hang: bool = False) -> None:
        with self._guard:
            self._armed.append((marker, hang))

    def close(self) -> None:
        self._stopping.set()
        with self._guard:
            sockets = [self.listener, *self._sockets]
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(5)
            assert not thread.is_alive(), "proxy thread did not end"

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            upstream.settimeout(None)
            with self._guard:
                self._sockets += [client, upstream]
            state = {"drop": False}
            self._spawn(self._to_server, client, upstream, state)
            self._spawn(self._to_client, client, upstream, state)

    def _to_server(self, client: socket.socket, upstream: socket.socket, state: dict) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                with self._guard:
                    for marker, hang in self._armed:
                        if marker in data:
                            self._armed.remove((marker, hang))
                            # Set before the command can be answered.
                            state["drop"] = "hang" if hang else "cut"
                            break
                upstream.sendall(data)
        self._cut(client, upstream)

    def _to_client(self, client: socket.socket, upstream: socket.socket, state: dict) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                if state["drop"]:
                    with self._guard:
                        self.dropped += 1
                    if state["drop"] == "cut":
                        break  # the command ran; its reply is lost with the connection
                    state["drop"] = False
                    continue  # the command ran; its reply never comes
                client.sendall(data)
        self._cut(client, upstream)

    @staticmethod
    def _cut(client: socket.socket, upstream: socket.socket) -> None:
        for sock in (client, upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def proxy(lock_server: RedisServer) -> Iterator[ReplyDropper]:
    dropper = ReplyDropper(lock_server.port)
    yield dropper
    dropper.close()


# -- in-process worker (celery.contrib.pytest) on this test's lock store ---------------------


@pytest.fixture
def lock_url(request: pytest.FixtureRequest, lock_server: RedisServer) -> str:
    """The in-process app's lock store URL: through the proxy when the test uses one."""
    if "proxy" in request.fixturenames:
        return str(request.getfixturevalue("proxy").url)
    return lock_server.url


class Bodies:
    """What the task bodies saw, shared between the worker thread and the test."""

    def __init__(self) -> None:
        self.runs: list[dict[str, Any]] = []
        self.started = threading.Event()
        self.proceed = threading.Event()
        self.in_body: Callable[[], None] = lambda: None


@pytest.fixture
def bodies() -> Bodies:
    return Bodies()


@pytest.fixture
def tasks(celery_app: Celery, bodies: Bodies) -> dict[str, Any]:
    def seen(task: Any, **extra: Any) -> None:
        request = task.request
        bodies.runs.append(
            {"id": request.id, "fence": request.lock_fence, "lost": request.lock_lost, **extra}
        )

    @celery_app.task(base=LockedTask, bind=True, lock_key="request_idx", name="fs.work")
    def work(self: Any, request_idx: int) -> int:
        bodies.in_body()
        seen(self, request_idx=request_idx)
        return request_idx

    @celery_app.task(
        base=LockedTask, bind=True, lock_key="request_idx", name="fs.slow", lock_ttl=1.2
    )
    def slow(self: Any, request_idx: int) -> bool:
        bodies.started.set()
        assert bodies.proceed.wait(TIMEOUT)
        seen(self, request_idx=request_idx)
        return bool(self.request.lock_lost)

    return {"work": work, "slow": slow}


@pytest.fixture
def worker(tasks: dict[str, Any], celery_worker: TestWorkController) -> TestWorkController:
    return celery_worker


@pytest.fixture
def deferred() -> Iterator[list[dict[str, Any]]]:
    """Every ``lock_deferred`` signal sent during the test."""
    with recording(signals.lock_deferred) as sent:
        yield sent


# -- 1. the lock store is down when a task arrives --------------------------------------------


def test_store_down_fails_closed_after_bounded_jittered_retries(
    lock_server: RedisServer, store: LockStore, logs: Records
) -> None:
    """Three tries (two jittered waits) within the deadline, then LockStoreUnavailableError."""
    acquire(store, new_token(), RequestKeys.build("celery-lock", "s", "warm", "s"))
    lock_server.stop()
    started = time.monotonic()
    with pytest.raises(LockStoreUnavailableError, match="acquire failed"):
        acquire(store, new_token())
    elapsed = time.monotonic() - started
    retries = logs.messages(logging.INFO, "trying again in")
    assert len(retries) == 2, retries  # tries 1 and 2 failed and were retried; try 3 gave up
    assert elapsed < 2.5  # bounded: no try starts after the 2 s deadline


def test_busy_reply_is_transient_not_state(lock_server: RedisServer, store: LockStore) -> None:
    """BUSY (a long script elsewhere) is retried and then reported unavailable, not garbage."""
    admin = lock_server.client()
    admin.config_set("lua-time-limit", 50)
    busy_loop = (
        "local t = redis.call('TIME') local stop = t[1] + 4 "
        "while tonumber(redis.call('TIME')[1]) < stop do end return 1"
    )
    acquire(store, new_token(), RequestKeys.build("celery-lock", "s", "warm", "s"))
    probe = lock_server.client()

    def answers_busy() -> bool:
        try:
            probe.ping()
        except redis.ResponseError as exc:
            return str(exc).startswith("BUSY")
        return False  # the script has not started yet, or not run past lua-time-limit

    runner = threading.Thread(target=lambda: admin.eval(busy_loop, 0), daemon=True)
    runner.start()
    try:
        wait_for("the server to answer BUSY", answers_busy, 2.0)  # well within the 3 s script
        with pytest.raises(LockStoreUnavailableError, match="BUSY"):
            acquire(store, new_token())
    finally:
        runner.join(TIMEOUT)
        probe.close()
        admin.close()
    assert not runner.is_alive()
    granted(acquire(store, new_token()))  # served again once it is over


def _bgsave(admin: redis.Redis, status: str) -> None:
    """BGSAVE, and wait (bounded) until it is over and ended with ``status``."""
    admin.bgsave()

    def over() -> bool:
        info = admin.info("persistence")
        return not info["rdb_bgsave_in_progress"] and info["rdb_last_bgsave_status"] == status

    wait_for(f"a BGSAVE that ends {status}", over, TIMEOUT)


def fail_saves(admin: redis.Redis) -> Path:
    """Make a save to disk fail, as a full disk would, and return what to remove to repair it.

    With a save rule (here one never due) and ``stop-writes-on-bgsave-error yes`` (Redis's
    default), a server whose last save failed answers ``MISCONF`` to writes and to ``PING``
    until a save succeeds. A directory in the place of the dump file fails the save's last
    step (its rename), whoever runs the test: a read-only directory would not stop root.
    """
    admin.config_set("save", "3600 1")  # without a rule, a failed save stops no writes
    dump = Path(admin.config_get("dir")["dir"], admin.config_get("dbfilename")["dbfilename"])
    dump.mkdir()
    _bgsave(admin, "err")
    with pytest.raises(redis.ResponseError, match=r"^MISCONF"):
        admin.ping()  # the server does refuse now
    return dump


def repair_saves(admin: redis.Redis, dump: Path) -> None:
    """Let the next save succeed, and run it: the server takes writes again."""
    dump.rmdir()
    _bgsave(admin, "ok")
    assert admin.ping()


def test_misconf_after_a_failed_save_is_transient_and_clears_with_a_good_save(
    lock_server: RedisServer, store: LockStore, admin: redis.Redis
) -> None:
    """MISCONF is "not now": Redis takes writes again by itself once a save succeeds. Acquire
    and release are unavailable (a task defers, not fails unrun), and the heartbeat leaves a
    lease unconfirmed, not lost. The script's own reply and the health check's PING (on a
    connection idle for its interval) are both refusals for now."""
    token = new_token()
    # A TTL no test run outlasts: the heartbeat below must not lose it for being unconfirmed.
    fence = granted(store.acquire(KEYS, token, 600_000, HOLDER, FENCE_TTL_MS))
    lease = Lease(store, KEYS, token, 600_000, fence, HOLDER)
    # A health check before every command: each comes more than a nanosecond after the last.
    checked = LockStore(
        redis.Redis.from_url(
            lock_server.url, health_check_interval=1e-9, retry=Retry(NoBackoff(), 0)
        )
    )
    other = RequestKeys.build("celery-lock", "shop.process", "43", "shop.process")
    try:
        assert checked.extend_all([lease]) == [True]  # connected before saves fail
        dump = fail_saves(admin)
        with pytest.raises(LockStoreUnavailableError, match="MISCONF"):
            acquire(store, new_token(), other)
        with pytest.raises(TransientReplyError, match="MISCONF"):  # the extend's own reply
            store.extend_all([lease])
        with pytest.raises(TransientReplyError, match="MISCONF"):  # the health check's PING
            checked.extend_all([lease])
        with pytest.raises(LockStoreUnavailableError, match="MISCONF"):
            acquire(checked, new_token(), other)
        beat_once(lease)
        assert not lease.lost
        with pytest.raises(LockStoreUnavailableError, match="MISCONF"):
            store.release(lease, success=True, done_ttl_ms=60_000)

        repair_saves(admin, dump)
        fence = granted(acquire(store, new_token(), other))
        assert checked.extend_all([lease]) == [True]
        assert store.extend_all([lease]) == [True]
        assert store.release(lease, success=True, done_ttl_ms=60_000) is True
    finally:
        checked.client.close()
    assert admin.get(KEYS.done) == b"task-1"


@pytest.fixture
def store_env(redis_server: RedisServer, lock_server: RedisServer) -> dict[str, str]:
    """store_app environment: broker, backend and record on the session server (emptied),
    the lock store on this test's own server."""
    for db in (0, 1, 3):
        redis_server.flush(db)
    return {
        "STORE_BROKER_URL": redis_server.url_for(0),
        "STORE_BACKEND_URL": redis_server.url_for(1),
        "STORE_RECORD_URL": redis_server.url_for(3),
        "STORE_LOCK_URL": lock_server.url,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]),
    }


@pytest.fixture
def store_worker(
    spawn_worker: Callable[..., CeleryWorker], store_env: dict[str, str]
) -> Callable[..., CeleryWorker]:
    """``store_worker(**env)``: a two-process store_app worker."""
    return lambda **env: spawn_worker("tests.apps.store_app", {**store_env, **env}, concurrency=2)


@pytest.fixture
def producer(make_producer: Callable[..., Celery], store_env: dict[str, str]) -> Celery:
    """A producer app on the store tests' broker, closed (pub/sub socket too) after the test."""
    return make_producer(store_env["STORE_BROKER_URL"], store_env["STORE_BACKEND_URL"])


def recorded(env: dict[str, str], key: str) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(env["STORE_RECORD_URL"])
    try:
        return [json.loads(raw) for raw in client.lrange(key, 0, -1)]
    finally:
        client.close()


@pytest.mark.worker
def test_store_down_defers_in_prefork_worker_then_each_request_runs_once(
    lock_server: RedisServer, store_worker: Any, store_env: dict[str, str], producer: Celery
) -> None:
    """Lock store stopped: nothing runs, every copy is deferred; started again on the same
    port: each request runs exactly once, its duplicate is skipped."""
    worker = store_worker()
    app = producer
    assert app.send_task("store.work", args=(-1,)).get(timeout=TIMEOUT) == -1

    lock_server.stop()
    down = time.monotonic()
    requests = range(4)
    copies = [app.send_task("store.work", args=(idx,)) for idx in requests for _ in range(2)]
    ids = {copy.id for copy in copies}

    def deferred_twice() -> bool:
        counts = Counter(d["task_id"] for d in recorded(store_env, "store:deferred"))
        return all(counts[task_id] >= 2 for task_id in ids)

    wait_for("every copy deferred twice", deferred_twice, TIMEOUT)
    assert [run["request_idx"] for run in recorded(store_env, "store:runs")] == [-1]
    assert {d["reason"] for d in recorded(store_env, "store:deferred")} == {"store-unavailable"}
    assert {copy.state for copy in copies} <= {"PENDING", "RETRY"}

    back_us = time.time_ns() // 1000
    lock_server.start()  # same port, empty: the lease state of the outage never existed
    back = time.monotonic()
    assert settle(copies) == Counter({"SUCCESS": 4, SKIPPED: 4})
    runs = [run for run in recorded(store_env, "store:runs") if run["request_idx"] >= 0]
    assert sorted(run["request_idx"] for run in runs) == list(requests)
    # Locked, each by a fence counter the empty store started from the clock once it was back.
    assert all(run["fence"] >= back_us and run["deferrals"] >= 2 for run in runs)
    log = worker.log()
    assert "deferring task" in log
    assert "(fail closed)" in log
    assert "unlocked (fail_open)" not in log

    delays = sorted(round(run["start"] - back, 2) for run in runs)
    deferrals = sorted(run["deferrals"] for run in runs)
    countdowns = sorted(round(d["countdown"], 1) for d in recorded(store_env, "store:deferred"))
    tries = log.count("trying again in")
    print(f"\nstore down {back - down:.1f}s; runs {delays}s after it was back; deferrals per "
          f"run {deferrals}; countdowns {countdowns}; tenacity retries {tries}")  # fmt: skip


def test_fail_open_runs_unlocked_with_a_warning_per_run(
    celery_app: Celery,
    lock_server: RedisServer,
    worker: Any,
    tasks: dict[str, Any],
    bodies: Bodies,
    logs: Records,
    deferred: list[dict[str, Any]],
) -> None:
    celery_app.conf.celery_lock_fail_open = True
    lock_server.stop()
    assert [tasks["work"].delay(idx).get(timeout=TIMEOUT) for idx in (1, 1, 2)] == [1, 1, 2]
    assert [run["fence"] for run in bodies.runs] == [None, None, None]  # no lease: no fence
    warned = logs.messages(logging.WARNING, "unlocked (fail_open)")
    assert len(warned) == 3
    assert deferred == []


def test_fail_closed_in_process_defers_with_reason_and_runs_once_when_back(
    lock_server: RedisServer,
    worker: Any,
    tasks: dict[str, Any],
    bodies: Bodies,
    deferred: list[dict[str, Any]],
) -> None:
    lock_server.stop()
    result = tasks["work"].delay(7)
    wait_for("two deferrals", lambda: len(deferred) >= 2, TIMEOUT)
    assert bodies.runs == []
    assert result.state == "RETRY"
    assert {d["reason"] for d in deferred} == {"store-unavailable"}
    back_us = time.time_ns() // 1000
    lock_server.start()
    assert result.get(timeout=TIMEOUT) == 7
    (run,) = bodies.runs
    assert run["fence"] >= back_us  # locked, by a counter started once the store was back
    countdowns = [round(d["countdown"], 2) for d in deferred]
    assert countdowns[1] > countdowns[0]  # backs off: no lease TTL caps the wait


def test_a_task_defers_while_saves_fail_and_runs_once_a_save_succeeds(
    admin: redis.Redis,
    worker: Any,
    tasks: dict[str, Any],
    bodies: Bodies,
    deferred: list[dict[str, Any]],
) -> None:
    """Fail closed under MISCONF: the copy is deferred, not failed unrun (and acked, lost)."""
    dump = fail_saves(admin)
    result = tasks["work"].delay(7)
    # lock_deferred is sent before Celery stores the copy's RETRY: wait for the state itself.
    wait_for("a deferral", lambda: result.state == "RETRY" or result.ready(), TIMEOUT)
    assert result.state == "RETRY"  # not FAILURE
    assert deferred
    assert bodies.runs == []
    repaired_us = time.time_ns() // 1000
    repair_saves(admin, dump)
    assert result.get(timeout=TIMEOUT) == 7
    (run,) = bodies.runs
    assert run["fence"] >= repaired_us  # locked, by a grant made once saves succeeded
    assert {d["reason"] for d in deferred} == {"store-unavailable"}


# -- 2. the lock store goes down mid-run -----------------------------------------------------


def test_store_down_mid_run_loses_lease_after_ttl_and_task_still_succeeds(
    lock_server: RedisServer,
    worker: Any,
    tasks: dict[str, Any],
    bodies: Bodies,
    logs: Records,
) -> None:
    with recording(signals.lock_lost) as lost:
        result = tasks["slow"].delay(7)
        assert bodies.started.wait(TIMEOUT)
        stopped = time.monotonic()
        lock_server.stop()
        wait_for("lock_lost", lambda: lost, TIMEOUT)
        bodies.proceed.set()
        assert result.get(timeout=TIMEOUT) is True  # the body saw request.lock_lost
    assert result.state == "SUCCESS"
    lost_after = lost[0]["at"] - stopped
    # Lost once a whole TTL (1.2 s) passed since the last confirmation, which came at most
    # one interval (0.4 s) before the stop: not before TTL - interval, nor long after TTL.
    assert 0.8 - 0.1 <= lost_after <= 1.2 + 0.4 + 1.0
    assert logs.messages(logging.ERROR, "release of")
    assert logs.messages(logging.WARNING, "heartbeat could not extend")
    # The process recovers: once the store is back, the next task runs locked.
    back_us = time.time_ns() // 1000
    lock_server.start()
    assert tasks["work"].delay(8).get(timeout=TIMEOUT) == 8
    assert bodies.runs[-1]["fence"] >= back_us  # locked, by a counter started once it was back
    print(f"\nlease lost {lost_after:.2f}s after the store stopped (TTL 1.2 s)")


@pytest.fixture
def released() -> Iterator[list[dict[str, Any]]]:
    """Every ``lock_released`` signal sent during the test."""
    with recording(signals.lock_released) as sent:
        yield sent


def test_a_release_refused_for_now_is_tried_again_while_the_lease_lasts(
    admin: redis.Redis,
    worker: Any,
    tasks: dict[str, Any],
    bodies: Bodies,
    logs: Records,
    released: list[dict[str, Any]],
) -> None:
    """The store refuses writes for a moment as the body ends (a failed save: MISCONF; a
    failover or BUSY alike) and keeps its data: the heartbeat releases once it answers, with
    the done-marker, so a later copy is skipped as done rather than run again."""
    dumps: list[Path] = []
    bodies.in_body = lambda: dumps.append(fail_saves(admin)) if not dumps else None
    result = tasks["work"].delay(7)
    assert result.get(timeout=TIMEOUT) == 7
    keys = tasks["work"].request_keys((7,), {})
    assert admin.exists(keys.lock)  # not released yet
    assert logs.messages(logging.ERROR, "the heartbeat tries again while the lease lasts")
    repair_saves(admin, dumps[0])
    wait_for("the done-marker", lambda: admin.get(keys.done), TIMEOUT)
    assert admin.get(keys.done) == result.id.encode()
    assert not admin.exists(keys.lock)
    # The heartbeat sends lock_released after its release returns: a moment after the marker.
    wait_for("lock_released", lambda: released, TIMEOUT)
    assert [(r["owned"], r["success"]) for r in released] == [(True, True)]
    assert logs.messages(logging.INFO, "once the lock store answered")
    copy = tasks["work"].delay(7)
    wait_for("the copy skipped", lambda: copy.state == SKIPPED, TIMEOUT)
    assert copy.info["reason"] == "done"
    assert len(bodies.runs) == 1


def test_a_release_the_store_stays_unavailable_for_is_given_up_once_the_lease_lapses(
    admin: redis.Redis,
    worker: Any,
    tasks: dict[str, Any],
    bodies: Bodies,
    logs: Records,
    released: list[dict[str, Any]],
) -> None:
    result = tasks["slow"].delay(7)  # a lease TTL of 1.2 s
    assert bodies.started.wait(TIMEOUT)
    dump = fail_saves(admin)
    bodies.proceed.set()  # the lease still held: its release is refused (MISCONF), not lost
    result.get(timeout=TIMEOUT)
    assert result.state == "SUCCESS"

    # The heartbeat gives up once a whole TTL has passed since the lease was last confirmed.
    # A try it sent a moment earlier that reached the store only after Redis expired the lease
    # (a loaded machine) finds it gone: answered without a write, which MISCONF lets through,
    # as a release of a lease no longer held. Either way the lease lapsed without a marker.
    def lapsed() -> bool:
        return bool(logs.messages(logging.ERROR, "gave up")) or bool(released)

    wait_for("the release given up, or found lapsed", lapsed, TIMEOUT)
    for gave_up in logs.messages(logging.ERROR, "gave up"):
        assert "no done-marker was written" in gave_up
    assert [(r["owned"], r["success"]) for r in released] in ([], [(False, False)])
    repair_saves(admin, dump)
    keys = tasks["slow"].request_keys((7,), {})
    assert not admin.exists(keys.lock, keys.done)  # lapsed; no marker


def asked_releases(store: LockStore, monkeypatch: pytest.MonkeyPatch) -> list[Lease]:
    """The leases ``store.release`` is asked to release from now on, in order."""
    asked: list[Lease] = []
    release = store.release

    def counted(lease: Lease, **options: Any) -> bool | None:
        asked.append(lease)
        return release(lease, **options)

    monkeypatch.setattr(store, "release", counted)
    return asked


@pytest.mark.parametrize("repaired_after", [0.0, 0.6], ids=["repaired-before", "repaired-during"])
def test_a_release_left_for_later_is_tried_with_its_outcome_when_the_process_hands_back(
    store: LockStore, admin: redis.Redis, repaired_after: float
) -> None:
    """A pool process that exits (``max_tasks_per_child``, shutdown) right after its store
    refused a release tries it again as it hands its leases back: with the done-marker. A
    store back within the patience, after the first of those tries, gets it too: one try,
    made at once, lost it, and a later copy ran the request again (``max_tasks_per_child=1``
    exits after every task)."""
    token = new_token()
    fence = granted(store.acquire(KEYS, token, 600_000, HOLDER, FENCE_TTL_MS))
    lease = Lease(store, KEYS, token, 600_000, fence, HOLDER)
    dump = fail_saves(admin)
    with pytest.raises(LockStoreUnavailableError):
        store.release(lease, success=True, done_ttl_ms=60_000)
    heartbeat = Heartbeat(default_interval=600)
    answers: list[bool] = []
    repair = threading.Timer(repaired_after, repair_saves, (admin, dump))
    try:
        heartbeat.release_later(lease, success=True, done_ttl_ms=60_000, then=answers.append)
        repair.start()
        if not repaired_after:
            repair.join(TIMEOUT)
        assert heartbeat.hand_back(patience=30) == 0  # no lease held: nothing handed back
    finally:
        repair.join(TIMEOUT)
        heartbeat.stop()
    assert answers == [True]
    assert admin.get(KEYS.done) == b"task-1"
    assert not admin.exists(KEYS.lock)


@pytest.mark.parametrize("success", [True, False], ids=["success", "failure"])
def test_an_exiting_process_gives_up_a_release_the_store_keeps_refusing(
    store: LockStore,
    admin: redis.Redis,
    logs: Records,
    monkeypatch: pytest.MonkeyPatch,
    success: bool,
) -> None:
    """Past its patience, the exiting process gives the release up, with an error that says
    the request will run again; a failure's release, whose lease only lapses, is tried once."""
    token = new_token()
    fence = granted(store.acquire(KEYS, token, 600_000, HOLDER, FENCE_TTL_MS))
    lease = Lease(store, KEYS, token, 600_000, fence, HOLDER)
    dump = fail_saves(admin)
    heartbeat = Heartbeat(default_interval=600)
    asked = asked_releases(store, monkeypatch)
    try:
        heartbeat.release_later(lease, success=success, done_ttl_ms=60_000)
        assert heartbeat.hand_back(patience=0.5) == 0
    finally:
        heartbeat.stop()
        repair_saves(admin, dump)
    assert len(asked) > 1 if success else len(asked) == 1
    [gave_up] = logs.messages(logging.ERROR if success else logging.WARNING, "gave up")
    assert "the process exits" in gave_up
    if success:
        assert "no done-marker was written: a later copy runs the request again" in gave_up
    assert not admin.exists(KEYS.done)
    assert admin.exists(KEYS.lock)  # left to lapse


def test_settling_waits_for_a_release_the_heartbeat_thread_is_trying(
    store: LockStore, logs: Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heartbeat beats on as a threads worker stops: a release its thread has taken out
    to try is still left, and settling waits for it rather than end at once, unsaid."""
    token = new_token()
    fence = granted(store.acquire(KEYS, token, 600_000, HOLDER, FENCE_TTL_MS))
    lease = Lease(store, KEYS, token, 600_000, fence, HOLDER)
    heartbeat = Heartbeat(default_interval=600)
    naps: list[float] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 3:
            heartbeat._trying.clear()  # the thread's try got its answer

    monkeypatch.setattr(celery_lock.heartbeat, "time", types.SimpleNamespace(sleep=nap))
    heartbeat._trying[id(lease)] = _Release(lease, True, 60_000, None)  # as the thread has it
    assert heartbeat.settle_releases(patience=600) == set()
    assert len(naps) == 3
    assert logs.messages(logging.WARNING, "gave up") == []


def test_settling_gives_up_a_try_still_on_its_way_and_says_so(
    store: LockStore, logs: Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A try of the heartbeat's thread on a store that hangs, still on its way when the
    patience is up, is given up with the others, said and not put back: a second settle (at
    worker_shutdown, then at exit) waited for it all over again, and a restart lost it unsaid."""
    token = new_token()
    fence = granted(store.acquire(KEYS, token, 600_000, HOLDER, FENCE_TTL_MS))
    lease = Lease(store, KEYS, token, 600_000, fence, HOLDER)
    heartbeat = Heartbeat(default_interval=600)
    answer = threading.Event()

    def hangs(lease: Lease, **options: Any) -> bool | None:
        answer.wait(TIMEOUT)
        raise LockStoreUnavailableError("the store hung")

    monkeypatch.setattr(store, "release", hangs)
    heartbeat.release_later(lease, success=True, done_ttl_ms=60_000)
    beat = threading.Thread(target=heartbeat._release_pending, args=(store,))
    beat.start()  # as the heartbeat's thread tries it
    try:
        wait_for("the try on its way", lambda: heartbeat._trying, TIMEOUT)
        assert heartbeat.settle_releases(patience=0.3) == {store}
        [gave_up] = logs.messages(logging.ERROR, "gave up")
        assert "no done-marker was written" in gave_up
    finally:
        answer.set()
        beat.join(TIMEOUT)
        heartbeat.stop()
    assert heartbeat.settle_releases(patience=30) == set()  # not put back: nothing to wait on
    assert len(logs.messages(logging.ERROR, "gave up")) == 1


@pytest.mark.parametrize(
    "left_for_later", [0, 1, 2], ids=["held", "and-left-for-later", "and-two-left-for-later"]
)
def test_hand_back_asks_an_unavailable_store_once_and_leaves_its_other_leases_to_lapse(
    logs: Records, monkeypatch: pytest.MonkeyPatch, left_for_later: int
) -> None:
    """A threads pool's process holds many leases: a store that is down at shutdown is tried
    for the first of them only, not once (and a whole retry deadline) per lease; where a
    release left for later is tried first, for none of them, nor for the other releases left
    for later (a mutant trying each of those survived)."""
    server = RedisServer()
    server.start()
    store = LockStore.from_url(server.url_for(2), retry_deadline=0.2)
    heartbeat = Heartbeat(default_interval=600)
    asked = asked_releases(store, monkeypatch)
    try:
        for request in range(3):
            keys = RequestKeys.build("celery-lock", "s", f"held-{request}", "s")
            token = new_token()
            fence = granted(store.acquire(keys, token, 600_000, HOLDER, FENCE_TTL_MS))
            lease = Lease(store, keys, token, 600_000, fence, HOLDER)
            if request < left_for_later:
                heartbeat.release_later(lease, success=True, done_ttl_ms=60_000)
            else:
                heartbeat.add(lease, 600)
        server.stop()
        # Without patience: the releases of successes left for later are otherwise tried
        # again for that long (the tests below).
        assert heartbeat.hand_back(patience=0) == 0
        assert len(asked) == 1
        warned = logs.messages(logging.WARNING, "could not hand back")
        assert len(warned) == (1 if left_for_later == 0 else 0)
        [left] = logs.messages(logging.WARNING, "to lapse")
        assert f"left {3 - max(left_for_later, 1)} more lease(s)" in left
        assert heartbeat.leases() == []
    finally:
        heartbeat.stop()
        store.close()
        server.stop()


@pytest.mark.worker
def test_a_recycled_pool_process_writes_the_done_marker_once_the_store_is_back(
    spawn_worker: Callable[..., CeleryWorker],
    store_env: dict[str, str],
    producer: Celery,
    admin: redis.Redis,
) -> None:
    """``--max-tasks-per-child 1``: the pool process exits right after each task. Its store
    refused the release for now (``MISCONF``) and is repaired a second later: the exiting
    process, still trying, writes the done-marker, and a later copy is skipped (it ran the
    request again when the process tried once as it went)."""
    env = {**store_env, "STORE_LOCK_TTL": "30"}
    worker = spawn_worker("tests.apps.store_app", env, "--max-tasks-per-child", "1", concurrency=1)
    [first_process] = worker.child_pids()
    lock = "celery-lock:{store.work:5}:lock"
    result = producer.send_task("store.work", args=(5,), kwargs={"seconds": 3.0})
    wait_for("the lease", lambda: admin.exists(lock), TIMEOUT)
    dump = fail_saves(admin)  # before the body's end
    assert result.get(timeout=TIMEOUT) == 5  # after its release was refused
    # The process exits now, trying the release: one try, at once, before this change.
    time.sleep(1.5)
    repair_saves(admin, dump)
    wait_for("the lease released", lambda: not admin.exists(lock), TIMEOUT)
    wait_for("the process replaced", lambda: first_process not in worker.child_pids(), TIMEOUT)
    assert admin.get("celery-lock:{store.work:5}:done:store.work") == result.id.encode()
    copy = producer.send_task("store.work", args=(5,))
    assert settle([copy]) == Counter({SKIPPED: 1})
    assert [run["request_idx"] for run in recorded(store_env, "store:runs")] == [5]
    assert "once the lock store answered" in worker.log()


@pytest.mark.worker
@pytest.mark.parametrize("pool", ["solo", "threads"])
@pytest.mark.parametrize(
    "shutdown", [signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP], ids=["warm", "cold", "restart"]
)
def test_a_worker_running_bodies_itself_writes_the_done_marker_as_it_stops(
    spawn_worker: Callable[..., CeleryWorker],
    store_env: dict[str, str],
    producer: Celery,
    admin: redis.Redis,
    pool: str,
    shutdown: signal.Signals,
) -> None:
    """Solo and threads workers run the bodies in their own process, which gets no
    ``worker_process_shutdown``: a release the store refused just before a warm or a cold
    shutdown, or a restart (which execs the new worker), is tried as the worker stops, and the
    store, repaired meanwhile, gets the done-marker (the release was dropped unsaid, and a
    later copy ran the request again)."""
    env = {**store_env, "STORE_LOCK_TTL": "30"}
    worker = spawn_worker("tests.apps.store_app", env, pool=pool, concurrency=1)
    lock = "celery-lock:{store.work:6}:lock"
    result = producer.send_task("store.work", args=(6,), kwargs={"seconds": 3.0})
    wait_for("the lease", lambda: admin.exists(lock), TIMEOUT)
    dump = fail_saves(admin)  # before the body's end
    assert result.get(timeout=TIMEOUT) == 6  # after its release was refused
    worker.send_signal(shutdown)
    time.sleep(1.5)  # the worker stops meanwhile, trying the release
    repair_saves(admin, dump)
    done = "celery-lock:{store.work:6}:done:store.work"
    if shutdown == signal.SIGHUP:
        wait_for("the done-marker", lambda: admin.exists(done), TIMEOUT)  # it runs on, anew
    else:
        worker.wait(TIMEOUT)
    assert admin.get(done) == result.id.encode()
    assert not admin.exists(lock)
    assert "once the lock store answered" in worker.log()


@pytest.mark.worker
def test_store_down_mid_run_in_prefork_worker_nothing_crashes(
    lock_server: RedisServer, store_worker: Any, store_env: dict[str, str], producer: Celery
) -> None:
    worker = store_worker(STORE_LOCK_TTL="1")
    app = producer
    children = worker.child_pids()
    admin = lock_server.client()
    result = app.send_task("store.work", args=(1,), kwargs={"seconds": 3.0})
    wait_for("the lease", lambda: admin.exists("celery-lock:{store.work:1}:lock"), TIMEOUT)
    admin.close()
    time.sleep(0.5)  # a heartbeat or two confirm the lease
    lock_server.stop()
    assert result.get(timeout=TIMEOUT) == 1
    [run] = recorded(store_env, "store:runs")
    assert run["lost"] is True
    assert [entry["task_id"] for entry in recorded(store_env, "store:lost")] == [result.id]
    log = worker.log()
    assert "lost while task" in log
    assert re.search(r"release of celery-lock:\{store\.work:1\}:lock for task \S+ failed", log)
    assert worker.child_pids() == children  # no pool process died
    lock_server.start()
    assert app.send_task("store.work", args=(2,)).get(timeout=TIMEOUT) == 2


@pytest.mark.worker
def test_a_grant_the_paused_store_answered_after_its_ttl_is_kept_in_prefork_worker(
    lock_server: RedisServer, store_worker: Any, store_env: dict[str, str], producer: Celery
) -> None:
    """The lock store stalls longer than the TTL while a copy's acquire waits on it, and then
    grants the lease: confirmed, the heartbeat keeps it, and a copy sent a TTL later is skipped
    as running. (Counted from the ask, the lease looked lapsed at birth: the heartbeat gave it
    up unextended, it lapsed a TTL after the grant, and the second copy ran beside the first.)"""
    store_worker(STORE_LOCK_TTL="2")
    app = producer
    assert app.send_task("store.work", args=(-1,)).get(timeout=TIMEOUT) == -1  # connections up
    lock_server.pause()
    try:
        first = app.send_task("store.work", args=(1,), kwargs={"seconds": 5.0})
        time.sleep(3.0)  # its acquire waits, a TTL and more (within the socket timeout)
    finally:
        lock_server.resume()
    time.sleep(2.5)  # a TTL after the grant: only the heartbeat holds the lease now
    second = app.send_task("store.work", args=(1,))
    assert settle([first, second]) == Counter({"SUCCESS": 1, SKIPPED: 1})
    [run] = [run for run in recorded(store_env, "store:runs") if run["request_idx"] == 1]
    assert run["task_id"] == first.id
    assert run["lost"] is False
    assert not recorded(store_env, "store:lost")


# -- 3. ambiguous replies ---------------------------------------------------------------------


def test_acquire_whose_reply_is_lost_is_granted_on_retry(
    proxy: ReplyDropper, admin: redis.Redis
) -> None:
    """The acquire ran, its reply was lost: the retry with the same token is ACQUIRED."""
    store = LockStore.from_url(proxy.url)
    try:
        acquire(store, new_token(), RequestKeys.build("celery-lock", "s", "warm", "s"))
        before = command_calls(admin)
        proxy.drop_reply_to(store.scripts.acquire.sha.encode())
        token = new_token()
        fence = granted(acquire(store, token))
    finally:
        store.client.close()
    assert proxy.dropped == 1
    assert (command_calls(admin) - before)["evalsha"] == 2  # it ran twice: once unanswered
    assert admin.get(KEYS.lock).startswith(f"{token} {fence} ".encode())
    assert admin.get(KEYS.fence) == str(fence).encode()  # one grant, one fence


def test_acquire_whose_reply_timed_out_past_the_deadline_is_granted_on_retry(
    proxy: ReplyDropper, admin: redis.Redis
) -> None:
    """A read timeout longer than the retry deadline (5 s against 2 s by default) still gets
    the one retry that finds out whether the script ran."""
    client = redis.Redis.from_url(proxy.url, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
    store = LockStore(client, retry_deadline=0.2)
    try:
        acquire(store, new_token(), RequestKeys.build("celery-lock", "s", "warm", "s"))
        proxy.drop_reply_to(store.scripts.acquire.sha.encode(), hang=True)
        token = new_token()
        fence = granted(acquire(store, token))
    finally:
        client.close()
    assert proxy.dropped == 1
    assert admin.get(KEYS.lock).startswith(f"{token} {fence} ".encode())
    assert admin.get(KEYS.fence) == str(fence).encode()


def _release_losing_the_first_reply(proxy: ReplyDropper, *, success: bool) -> bool | None:
    """Grant a lease and release it through ``proxy``, which drops the release's first reply
    after the server ran it; return what the release reports after its retry."""
    store = LockStore.from_url(proxy.url)
    try:
        token, fence = _granted_with_the_release_script_loaded(store)
        proxy.drop_reply_to(store.scripts.release.sha.encode())
        lease = Lease(store, KEYS, token, TTL_MS, fence, HOLDER)
        return store.release(lease, success=success, done_ttl_ms=60_000)
    finally:
        store.client.close()


def _granted_with_the_release_script_loaded(store: LockStore) -> tuple[str, int]:
    """Load the release script (a release of a lease never granted) and grant ``KEYS``; return
    the grant's token and fence. The proxy can then drop the release's reply by its SHA."""
    stale = Lease(store, KEYS, new_token(), TTL_MS, 1, HOLDER)
    assert store.release(stale, success=False, done_ttl_ms=1) is False
    token = new_token()
    return token, granted(acquire(store, token))


def test_release_whose_reply_is_lost_reports_owned_on_retry(
    proxy: ReplyDropper, admin: redis.Redis, logs: Records
) -> None:
    """The release ran (lock deleted, done-marker written), its reply was lost: the retry finds
    the lock gone, its own done-marker and no grant since its own, and reports it owned."""
    assert _release_losing_the_first_reply(proxy, success=True) is True
    assert proxy.dropped == 1
    assert not admin.exists(KEYS.lock)
    assert admin.get(KEYS.done) == b"task-1"  # the lost try did release, with the marker
    assert not logs.messages(logging.WARNING)


def test_failure_release_whose_reply_is_lost_reports_owned_unknown(
    proxy: ReplyDropper, admin: redis.Redis, logs: Records
) -> None:
    """A release without a done-marker leaves nothing behind: after a lost reply the retry
    cannot tell its own earlier try from the lease's TTL running out, and says so (``None``)."""
    assert _release_losing_the_first_reply(proxy, success=False) is None
    assert proxy.dropped == 1
    assert not admin.exists(KEYS.lock)
    assert not admin.exists(KEYS.done)
    assert not logs.messages(logging.WARNING)
    assert logs.messages(logging.INFO, "may have released it")


@pytest.mark.parametrize(("lost_reply", "owned"), [(False, False), (True, None)])
def test_release_after_a_redelivered_copy_completed_is_not_reported_owned(
    proxy: ReplyDropper, admin: redis.Redis, lost_reply: bool, owned: bool | None
) -> None:
    """The lease lapsed, a redelivered copy of the same message (same task id) took the request
    and wrote the done-marker: a marker naming this task id is not this lease's release. After
    a lost reply the retry cannot tell that from this release's first try having run before
    another task of a shared scope took the lock: ``None``, never ``True``."""
    store = LockStore.from_url(proxy.url)
    try:
        token = new_token()
        fence = granted(acquire(store, token))
        admin.delete(KEYS.lock)  # the lease's TTL ran out
        again = new_token()
        assert acquire(store, again) == Acquired(fence=fence + 1)
        redelivered = Lease(store, KEYS, again, TTL_MS, fence + 1, HOLDER)
        assert store.release(redelivered, success=True, done_ttl_ms=60_000) is True
        if lost_reply:
            proxy.drop_reply_to(store.scripts.release.sha.encode())
        lease = Lease(store, KEYS, token, TTL_MS, fence, HOLDER)
        assert store.release(lease, success=True, done_ttl_ms=60_000) is owned
    finally:
        store.client.close()
    assert proxy.dropped == int(lost_reply)
    assert admin.get(KEYS.done) == b"task-1"


def test_release_whose_reply_is_lost_after_a_shared_scope_took_the_lock_is_not_lost(
    proxy: ReplyDropper, lock_server: RedisServer, admin: redis.Redis
) -> None:
    """The release ran, with its marker, and another task of the shared scope took the lock
    before the retry: the retry cannot tell this from a loss, and does not report one."""
    store, direct = LockStore.from_url(proxy.url), LockStore.from_url(lock_server.url)
    other_keys = RequestKeys.build("celery-lock", "shop.process", "42", "shop.ship")
    assert other_keys.lock == KEYS.lock
    assert other_keys.done != KEYS.done
    try:
        token, fence = _granted_with_the_release_script_loaded(store)
        # The lost reply's connection is cut only after the other task's grant: the retry
        # finds the lock held by it.
        proxy.drop_reply_to(store.scripts.release.sha.encode())
        original = store._evalsha
        grants: list[Any] = []

        def evalsha_then_other_grants(*args: Any) -> Any:
            try:
                return original(*args)
            finally:
                if not grants:
                    other = Holder("task-2", "shop.ship", "host-b", 202)
                    grants.append(acquire(direct, new_token(), other_keys, other))

        store._evalsha = evalsha_then_other_grants  # type: ignore[method-assign]
        lease = Lease(store, KEYS, token, TTL_MS, fence, HOLDER)
        assert store.release(lease, success=True, done_ttl_ms=60_000) is None
    finally:
        store.client.close()
        direct.client.close()
    assert grants == [Acquired(fence=fence + 1)]
    assert proxy.dropped == 1
    assert admin.get(KEYS.done) == b"task-1"


def test_release_tried_again_after_a_call_without_answer_cannot_tell_a_lapse(
    store: LockStore, admin: redis.Redis
) -> None:
    """The heartbeat tries again a release whose every try failed, some perhaps run: a failure's
    release finding the lock gone is owned or lost, nobody can tell (``tried_before``)."""
    token = new_token()
    fence = granted(acquire(store, token))
    admin.delete(KEYS.lock)  # an earlier call's try ran, or the TTL ran out
    lease = Lease(store, KEYS, token, TTL_MS, fence, HOLDER)
    assert store.release(lease, success=False, done_ttl_ms=60_000) is False
    assert store.release(lease, success=False, done_ttl_ms=60_000, tried_before=True) is None
    # A success's release has its marker to tell by: none, so this lease never released.
    assert store.release(lease, success=True, done_ttl_ms=60_000, tried_before=True) is False
    assert not admin.exists(KEYS.done)


def test_task_whose_release_reply_is_lost_still_succeeds(
    proxy: ReplyDropper,
    worker: Any,
    tasks: dict[str, Any],
    bodies: Bodies,
    logs: Records,
    admin: redis.Redis,
    released: list[dict[str, Any]],
) -> None:
    release_sha = hashlib.sha1(RELEASE.encode()).hexdigest().encode()
    assert tasks["work"].delay(6).get(timeout=TIMEOUT) == 6  # loads the scripts
    bodies.in_body = lambda: proxy.drop_reply_to(release_sha)
    result = tasks["work"].delay(7)
    assert result.get(timeout=TIMEOUT) == 7
    assert result.state == "SUCCESS"
    assert proxy.dropped == 1
    assert [(r["owned"], r["success"]) for r in released] == [(True, True), (True, True)]
    assert not logs.messages(logging.WARNING)
    keys = tasks["work"].request_keys((7,), {})
    assert admin.get(keys.done) == result.id.encode()
    assert not admin.exists(keys.lock)


def test_acquire_and_release_reload_scripts_after_a_real_restart(
    lock_server: RedisServer, store: LockStore, admin: redis.Redis
) -> None:
    acquire(store, new_token(), RequestKeys.build("celery-lock", "s", "warm", "s"))
    lock_server.restart()
    token = new_token()
    fence = granted(acquire(store, token))  # NOSCRIPT answered, not an error
    lock_server.restart()
    # The request's lock is there again (written by another client) but no script is loaded.
    other = LockStore.from_url(lock_server.url)
    fence = granted(acquire(other, token))
    other.client.close()
    assert admin.script_exists(store.scripts.release.sha) == [False]
    lease = Lease(store, KEYS, token, TTL_MS, fence, HOLDER)
    assert store.release(lease, success=True, done_ttl_ms=60_000) is True
    assert admin.get(KEYS.done) == b"task-1"


def test_after_a_failover_the_store_follows_its_address_to_the_new_primary(
    lock_server: RedisServer, proxy: ReplyDropper, admin: redis.Redis, logs: Records
) -> None:
    """The store's address (a DNS name moved by the failover; here the proxy) leads to a new
    primary, and the old one is demoted to its replica, which keeps its clients connected and
    answers PING: the store must leave it, not defer every task until the worker restarts."""
    store = LockStore.from_url(proxy.url)
    with RedisServer() as promoted:
        try:
            old_token = new_token()
            fence = granted(acquire(store, old_token))
            old_lease = Lease(store, KEYS, old_token, TTL_MS, fence, HOLDER)
            assert store.extend_all([old_lease]) == [True]  # the heartbeat's connection, too
            # Another thread's connection, in use meanwhile: its command must not be cut.
            busy = _check_out(store.client.connection_pool)
            proxy.upstream_port = promoted.port  # new connections reach the new primary
            admin.replicaof("127.0.0.1", promoted.port)
            other = RequestKeys.build("celery-lock", "shop.process", "43", "shop.process")
            fence = granted(acquire(store, new_token(), other))
            assert busy._sock is not None  # left alone: its own next reply says READONLY
            store.client.connection_pool.release(busy)
            with contextlib.closing(promoted.client()) as new_primary:
                assert new_primary.exists(other.lock) == 1
            # The old lease is gone with the old primary's data: lost, not "unavailable".
            assert store.extend_all([old_lease]) == [False]
            assert logs.messages(logging.WARNING, "no longer a primary")
        finally:
            admin.replicaof("no", "one")
            store.client.close()


def test_heartbeat_pipeline_reloads_its_script_after_a_real_restart(
    lock_server: RedisServer, store: LockStore, admin: redis.Redis
) -> None:
    token = new_token()
    fence = granted(acquire(store, token))
    lease = Lease(store, KEYS, token, TTL_MS, fence, HOLDER)
    assert store.extend_all([lease]) == [True]
    lock_server.restart()
    other = LockStore.from_url(lock_server.url)
    fence = granted(acquire(other, token))  # loads the acquire script only
    other.client.close()
    assert admin.script_exists(store.scripts.extend.sha) == [False]
    admin.pexpire(KEYS.lock, 2_000)  # not so short that a stall of the machine lets it lapse
    beat_once(lease)
    assert not lease.lost
    assert admin.pttl(KEYS.lock) > 3_000  # extended to the TTL (5 s) by the reloaded script


def flush_after_loads(store: LockStore, admin: redis.Redis, times: int) -> list[str]:
    """Make the next ``times`` loads of each script by ``store`` find it gone again at once, as
    a second ``SCRIPT FLUSH`` or restart between the load and the run would (a race no test
    can time): such a load is followed by a real ``SCRIPT FLUSH`` on the server. Returns the
    digests loaded, in order."""
    loaded: list[str] = []
    load = store._load

    def load_then_flush(script: Any) -> None:
        load(script)
        loaded.append(script.sha)
        if loaded.count(script.sha) <= times:
            admin.script_flush()

    store._load = load_then_flush  # type: ignore[method-assign]
    return loaded


def test_a_script_gone_again_once_loaded_is_not_now_for_acquire_and_release(
    store: LockStore, admin: redis.Redis
) -> None:
    """NOSCRIPT on the run after the load: tried again (loaded once more), not an error reply
    that fails the copy unrun."""
    acquire(store, new_token(), RequestKeys.build("celery-lock", "s", "warm", "s"))
    admin.script_flush()
    loaded = flush_after_loads(store, admin, times=1)
    token = new_token()
    fence = granted(acquire(store, token))
    assert loaded == [store.scripts.acquire.sha] * 2
    admin.script_flush()
    lease = Lease(store, KEYS, token, TTL_MS, fence, HOLDER)
    assert store.release(lease, success=True, done_ttl_ms=60_000) is True
    assert loaded[2:] == [store.scripts.release.sha] * 2
    assert admin.get(KEYS.done) == b"task-1"


def test_a_script_that_stays_gone_once_loaded_is_unavailable_not_an_error(
    store: LockStore, admin: redis.Redis
) -> None:
    """Gone after every load: the store is unavailable (a copy is deferred), not refusing."""
    admin.script_flush()
    flush_after_loads(store, admin, times=100)
    with pytest.raises(LockStoreUnavailableError, match="No matching script"):
        acquire(store, new_token())


def test_the_heartbeat_s_script_gone_again_once_loaded_does_not_lose_the_lease(
    store: LockStore, admin: redis.Redis
) -> None:
    token = new_token()
    fence = granted(acquire(store, token))
    lease = Lease(store, KEYS, token, TTL_MS, fence, HOLDER)
    assert store.extend_all([lease]) == [True]
    admin.script_flush()
    loaded = flush_after_loads(store, admin, times=1)
    admin.pexpire(KEYS.lock, 2_000)
    beat_once(lease)
    assert not lease.lost
    assert loaded == [store.scripts.extend.sha] * 2
    assert admin.pttl(KEYS.lock) > 3_000  # extended by the script loaded the second time


def test_restart_is_detected_by_run_id_with_a_warning(
    lock_server: RedisServer, store: LockStore, admin: redis.Redis, logs: Records
) -> None:
    acquire(store, new_token(), RequestKeys.build("celery-lock", "s", "warm", "s"))
    first = store.run_id
    assert first == admin.info("server")["run_id"]
    # A reconnect to the same server is not a restart.
    admin.client_kill_filter(_type="normal", skipme=True)
    acquire(store, new_token(), RequestKeys.build("celery-lock", "s", "again", "s"))
    assert store.restarts == 0
    assert logs.messages(logging.WARNING, "restarted") == []

    lock_server.restart()
    acquire(store, new_token())
    assert store.restarts == 1
    assert store.run_id not in (None, first)
    [warning] = logs.messages(logging.WARNING, "restarted")
    assert first in warning
    assert "fence counters were lost" in warning


def test_run_id_check_costs_no_round_trip_per_task(store: LockStore, admin: redis.Redis) -> None:
    acquire(store, new_token(), RequestKeys.build("celery-lock", "s", "warm", "s"))
    before = command_calls(admin)
    for idx in range(20):
        keys = RequestKeys.build("celery-lock", "s", str(idx), "s")
        acquire(store, new_token(), keys)
    delta = command_calls(admin) - before
    assert delta["evalsha"] == 20
    assert delta["info"] == 1  # ours, above; none from the store


# -- 4. values celery-lock did not write ------------------------------------------------------

GARBAGE: dict[str, Callable[[redis.Redis, RequestKeys], Any]] = {
    "lock-string": lambda r, k: r.set(k.lock, "garbage"),
    "lock-list": lambda r, k: r.rpush(k.lock, "a", "b"),
    "lock-hash": lambda r, k: r.hset(k.lock, "owner", "someone"),
    "lock-no-ttl": lambda r, k: r.set(k.lock, encode_lock("someone", 1, HOLDER, 0)),
    # A holder Python cannot read: a number no float holds, JSON nested past the parser's depth.
    "lock-pid-inf": lambda r, k: r.set(
        k.lock, 'someone 1 {"task_id": "x", "task": "shop.process", "pid": 1e999}', px=60_000
    ),
    "lock-nested": lambda r, k: r.set(k.lock, "someone 1 " + "[" * 100_000, px=60_000),
    # A holder of no task: every lock celery-lock writes names its task.
    "lock-no-task": lambda r, k: r.set(k.lock, 'someone 1 {"task_id": "x", "task": ""}', px=60_000),
    "fence-abc": lambda r, k: r.set(k.fence, "abc"),
    "fence-at-max": lambda r, k: r.set(k.fence, str(2**63 - 1)),
    # Integers to Python's int(), not to INCR.
    "fence-underscore": lambda r, k: r.set(k.fence, "1_000"),
    "fence-leading-zero": lambda r, k: r.set(k.fence, "007"),
    "done-hash": lambda r, k: r.hset(k.done, "task", "x"),
}
EXPECTED = {
    "lock-string": ("lock", "holds something celery-lock did not write"),
    "lock-list": ("lock", "holds a list, expected a string"),
    "lock-hash": ("lock", "holds a hash, expected a string"),
    "lock-no-ttl": ("lock", r"did not write \(task 'shop.process', TTL -1"),
    "lock-pid-inf": ("lock", "holds something celery-lock did not write"),
    "lock-nested": ("lock", "holds something celery-lock did not write"),
    "lock-no-task": ("lock", r"did not write \(task '', TTL"),
    "fence-abc": ("fence", "holds 'abc', expected a fence counter"),
    "fence-at-max": ("fence", "expected a fence counter"),
    "fence-underscore": ("fence", "holds '1_000', expected a fence counter"),
    "fence-leading-zero": ("fence", "holds '007', expected a fence counter"),
    "done-hash": ("done", "holds a hash, expected a string"),
}


@pytest.mark.parametrize("garbage", list(GARBAGE))
def test_garbage_under_a_key_is_a_typed_error_naming_the_key(
    garbage: str, store: LockStore, admin: redis.Redis
) -> None:
    GARBAGE[garbage](admin, KEYS)
    role, words = EXPECTED[garbage]
    with pytest.raises(LockStateError, match=words) as caught:
        acquire(store, new_token())
    assert caught.value.key == getattr(KEYS, role)
    assert getattr(KEYS, role) in str(caught.value)


def test_garbage_fails_the_task_without_running_or_deferring_it(
    celery_app: Celery,
    worker: Any,
    tasks: dict[str, Any],
    bodies: Bodies,
    admin: redis.Redis,
    deferred: list[dict[str, Any]],
) -> None:
    for fail_open in (False, True):
        celery_app.conf.celery_lock_fail_open = fail_open
        reset_runtime(celery_app)
        for idx, garbage in enumerate(GARBAGE):
            keys = tasks["work"].request_keys((idx,), {})
            admin.delete(keys.lock, keys.fence, keys.done)
            GARBAGE[garbage](admin, keys)
            result = tasks["work"].delay(idx)
            with pytest.raises(LockStateError, match=EXPECTED[garbage][1]):
                result.get(timeout=TIMEOUT, interval=0.05)
            assert result.state == "FAILURE", garbage
    assert bodies.runs == []  # never unlocked, even with fail_open
    assert deferred == []  # never deferred: that would loop for ever


def test_garbage_mid_run_loses_the_lease_and_the_task_succeeds(
    worker: Any, tasks: dict[str, Any], bodies: Bodies, admin: redis.Redis, logs: Records
) -> None:
    result = tasks["slow"].delay(7)
    assert bodies.started.wait(TIMEOUT)
    keys = tasks["slow"].request_keys((7,), {})
    with admin.pipeline() as overwrite:  # one step: a beat between the two would re-create it
        overwrite.delete(keys.lock)
        overwrite.rpush(keys.lock, "garbage")  # overwritten by someone else
        overwrite.execute()
    wait_for(
        "the lost lease logged", lambda: logs.messages(logging.ERROR, "lost while task"), TIMEOUT
    )
    bodies.proceed.set()
    assert result.get(timeout=TIMEOUT) is True
    assert logs.messages(logging.ERROR, "cannot extend the lease")
    [failed] = logs.messages(logging.ERROR, "release of")
    assert "holds a list, expected a string" in failed
    assert admin.lrange(keys.lock, 0, -1) == [b"garbage"]  # left alone


def test_a_lease_marked_lost_tells_its_task_before_the_loss_is_logged(
    store: LockStore, caplog: pytest.LogCaptureFixture
) -> None:
    """``on_lost`` (which sets the body's ``request.lock_lost``) runs before the ERROR is
    logged: whoever reads the log and then asks the body finds the loss. (The test above raced
    on that order, once in a full run.)"""
    lease = Lease(store, KEYS, new_token(), 600_000, 1, HOLDER)
    logged_before: list[bool] = []
    lease.on_lost = lambda _: logged_before.append("lost while task" in caplog.text)
    with caplog.at_level(logging.ERROR, logger="celery_lock.lease"):
        lease.mark_lost()
        lease.mark_lost()  # once only
    assert logged_before == [False]
    assert caplog.text.count("lost while task") == 1


def test_a_wrong_password_fails_without_retry(
    lock_server: RedisServer, admin: redis.Redis, logs: Records
) -> None:
    """A wrong password is refused for good: not "unavailable", which would defer for ever."""
    admin.acl_setuser("shop", enabled=True, passwords=["+right"], keys=["*"], commands=["+@all"])
    wrong = LockStore.from_url(f"redis://shop:wrong@127.0.0.1:{lock_server.port}/0")
    try:
        with pytest.raises(LockStoreError, match="password") as caught:
            acquire(wrong, new_token())
    finally:
        wrong.client.close()
    assert not isinstance(caught.value, LockStoreUnavailableError)
    assert logs.messages(logging.INFO, "trying again") == []


def test_a_credential_refused_once_is_tried_once_more(
    lock_server: RedisServer, admin: redis.Redis
) -> None:
    """A credential provider's token that had just expired: the next connection gets a fresh
    one, as with ElastiCache IAM or Entra ID tokens."""
    admin.acl_setuser("shop", enabled=True, passwords=["+fresh"], keys=["*"], commands=["+@all"])

    class Rotating(CredentialProvider):
        def __init__(self) -> None:
            self.tokens = iter(["expired", "fresh", "fresh"])

        def get_credentials(self) -> tuple[str, str]:
            return "shop", next(self.tokens)

    client = redis.Redis(
        port=lock_server.port, credential_provider=Rotating(), retry=Retry(NoBackoff(), 0)
    )
    try:
        granted(acquire(LockStore(client), new_token()))
    finally:
        client.close()


def test_other_error_replies_fail_without_retry(
    lock_server: RedisServer, admin: redis.Redis, logs: Records
) -> None:
    """A command the store refuses for good (here: an ACL denies EVALSHA) is not retried."""
    admin.acl_setuser("noscript", enabled=True, nopass=True, keys=["*"],
                      commands=["+@all", "-evalsha", "-eval"])  # fmt: skip
    denied = LockStore.from_url(f"redis://noscript:x@127.0.0.1:{lock_server.port}/0")
    try:
        with pytest.raises(LockStoreError) as caught:
            acquire(denied, new_token())
    finally:
        denied.client.close()
    assert not isinstance(caught.value, (LockStoreUnavailableError, LockStateError))
    assert logs.messages(logging.INFO, "trying again") == []


def test_an_error_of_redis_py_that_is_no_reply_is_a_lock_store_error(logs: Records) -> None:
    """A URL redis-py parses but will not build a connection from (``ssl_cert_reqs`` spelled
    as Celery spells it; LockStore.from_url does not validate): a plain RedisError. It must be
    a LockStoreError still, or fail_open and "a release never fails the task" would not apply."""
    store = LockStore.from_url("rediss://127.0.0.1:1/0?ssl_cert_reqs=CERT_REQUIRED")
    token = new_token()
    try:
        with pytest.raises(LockStoreError, match="acquire failed: Invalid SSL") as caught:
            acquire(store, token)
        assert not isinstance(caught.value, LockStoreUnavailableError)
        with pytest.raises(LockStoreError, match="release failed: Invalid SSL"):
            store.release(Lease(store, KEYS, token, TTL_MS, 1, HOLDER), success=True, done_ttl_ms=1)
    finally:
        store.client.close()
    assert logs.messages(logging.INFO, "trying again") == []


# -- 5. tokens --------------------------------------------------------------------------------


def test_tokens_are_distinct_across_forked_processes() -> None:
    children, per_child = 16, 2_000
    pipes: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads, Python 3.12+
        for _ in range(children):
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                try:
                    os.close(read)
                    data = "\n".join(new_token() for _ in range(per_child)).encode()
                    with os.fdopen(write, "wb") as out:
                        out.write(data)
                finally:
                    os._exit(0)
            os.close(write)
            pipes[read] = pid
    chunks: dict[int, list[bytes]] = {fd: [] for fd in pipes}
    deadline = time.monotonic() + TIMEOUT
    try:
        open_fds = set(pipes)
        while open_fds:
            assert time.monotonic() < deadline, "children did not report in time"
            ready, _, _ = select.select(list(open_fds), [], [], 0.5)
            for fd in ready:
                chunk = os.read(fd, 65536)
                if chunk:
                    chunks[fd].append(chunk)
                else:
                    open_fds.discard(fd)
    finally:
        for fd, pid in pipes.items():
            os.close(fd)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # by its pid; it has normally exited already
            os.waitpid(pid, 0)
    tokens = [t for fd in pipes for t in b"".join(chunks[fd]).decode().split("\n")]
    assert len(tokens) == children * per_child
    assert len(set(tokens)) == len(tokens)
    assert all(len(token) == 32 and int(token, 16) >= 0 for token in tokens)  # 128 bits, hex
    assert new_token() not in set(tokens)


def test_tasks_in_one_process_draw_a_new_token_per_acquisition(
    tasks: dict[str, Any], bodies: Bodies, admin: redis.Redis
) -> None:
    """One request, run five times in this process: each grant writes a token of its own.

    The body fails after reading its lock, so no done-marker stops the next run."""
    work = tasks["work"]
    keys = work.request_keys((7,), {})
    locks: list[bytes] = []

    def read_lock_then_fail() -> None:
        lock = admin.get(keys.lock)  # "<token> <fence> <holder>", as the task wrote it
        assert isinstance(lock, bytes), lock
        locks.append(lock)
        raise RuntimeError("fail, so the request is not done")

    bodies.in_body = read_lock_then_fail
    for _ in range(5):
        with pytest.raises(RuntimeError, match="not done"):
            work(7)
    tokens = [lock.split(b" ")[0] for lock in locks]
    fences = [int(lock.split(b" ")[1]) for lock in locks]
    assert len(fences) == 5
    assert consecutive(fences)  # five grants
    assert all(len(token) == 32 and int(token, 16) >= 0 for token in tokens)
    assert len(set(tokens)) == 5, tokens
    assert not admin.exists(keys.lock)  # each run released its lease
