"""What a caller reads of skipped and deferred copies on result backends other than Redis: the
database backend (SQLAlchemy, on a SQLite file), the filesystem backend and the in-process cache,
each under an in-process worker whose lock store is the session's Redis.

Every backend must show a skipped copy as ``SKIPPED`` with its marker (not ready, not failed),
complete it as ``SUCCESS`` under ``skip_as_success``, show a deferred copy as ``RETRY``, let
``follow`` reach the holder's result, and call a chord's body once.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from celery import Celery, chord
from celery.backends.database.models import ResultModelBase
from celery.contrib.testing.worker import TestWorkController
from celery.exceptions import TimeoutError as CeleryTimeoutError
from conftest import hold, wait_for

from celery_lock import (
    SKIPPED,
    LockedTask,
    LockStoreUnavailableError,
    follow,
    is_skipped,
    signals,
)
from celery_lock.states import skipped_marker
from celery_lock.store import LockStore

TIMEOUT = 20
SHORT = 0.5
pytestmark = pytest.mark.usefixtures("close_lock_runtime")


def create_result_tables(url: str) -> None:
    """Create the database backend's tables: Celery 5.3 creates them once per process
    (``SessionManager.prepared``), in the first database only, and each test has its own."""
    engine = sqlalchemy.create_engine(url)
    try:
        ResultModelBase.metadata.create_all(engine)
    finally:
        engine.dispose()


@pytest.fixture(params=["db+sqlite", "file", "cache+memory"])
def backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "db+sqlite":
        url = f"sqlite:///{tmp_path / 'results.db'}"
        create_result_tables(url)
        return f"db+{url}"
    if request.param == "file":
        (tmp_path / "results").mkdir()
        return f"file://{tmp_path / 'results'}"
    return "cache+memory://"


@pytest.fixture
def celery_config(celery_config: dict[str, Any], backend_url: str) -> dict[str, Any]:
    # result_extended: the database backend then stores a column per request field too.
    return {**celery_config, "result_backend": backend_url, "result_extended": True}


@pytest.fixture
def celery_worker_pool() -> str:
    return "threads"  # a chord's body, or chord_unlock, runs while a member is deferred


@pytest.fixture
def gathered() -> list[Any]:
    """The lists each chord body was called with."""
    return []


@pytest.fixture
def tasks(celery_app: Celery, gathered: list[Any]) -> dict[str, Any]:
    @celery_app.task(base=LockedTask, bind=True, lock_key="request_idx", name="b.process")
    def process(self: Any, request_idx: int) -> str:
        return f"processed {request_idx}"

    @celery_app.task(
        base=LockedTask, bind=True, lock_key="request_idx", lock_scope="req", name="b.stage"
    )
    def stage(self: Any, request_idx: int) -> str:
        return f"staged {request_idx}"

    @celery_app.task(name="b.gather")
    def gather(values: list[Any]) -> list[Any]:
        gathered.append(values)
        return values

    return {"process": process, "stage": stage, "gather": gather}


@pytest.fixture
def worker(tasks: dict[str, Any], celery_worker: TestWorkController) -> TestWorkController:
    return celery_worker


@pytest.fixture
def unused_port() -> Iterator[int]:
    """A local port nothing listens on, held bound (not listening: a connection is refused) for
    the test: let go at once, another test's redis-server could start on it, and the copy would
    run instead of being deferred (a CI run under load)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def test_a_skipped_copy_reads_skipped_with_its_marker_and_is_not_ready(
    worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    hold(store, tasks["process"], 7, "holder-id")
    copy = tasks["process"].delay(7)
    wait_for("the copy to be SKIPPED", lambda: copy.state == SKIPPED, TIMEOUT)
    marker = skipped_marker("celery-lock:{b.process:7}:lock", "running", "holder-id", "b.process")
    assert copy.result == copy.info == marker
    assert (copy.ready(), copy.successful(), copy.failed()) == (False, False, False)
    for propagate in (True, False):
        with pytest.raises(CeleryTimeoutError):
            copy.get(timeout=SHORT, interval=0.05, propagate=propagate)


def test_follow_reaches_the_holder_s_result(worker: Any, tasks: dict[str, Any]) -> None:
    first = tasks["process"].delay(7)
    assert first.get(timeout=TIMEOUT) == "processed 7"
    copy = tasks["process"].delay(7)
    assert follow(copy, timeout=TIMEOUT) == "processed 7"
    assert (copy.state, copy.info["reason"], copy.info["holder"]) == (SKIPPED, "done", first.id)


def test_a_copy_skipped_as_success_is_ready_with_its_marker(
    celery_app: Celery, worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    celery_app.conf.celery_lock_skip_as_success = True
    hold(store, tasks["process"], 7, "holder-id")
    copy = tasks["process"].delay(7)
    value = copy.get(timeout=TIMEOUT)
    assert is_skipped(value)
    assert value["holder"] == "holder-id"
    assert (copy.state, copy.successful(), copy.failed()) == ("SUCCESS", True, False)
    assert follow(copy, timeout=TIMEOUT) == value  # not followed to the holder


def test_a_call_that_ignores_its_result_is_followed_to_none_at_once(
    worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    skipped: list[str] = []

    def on_skipped(task_id: str, **_: Any) -> None:
        skipped.append(task_id)

    hold(store, tasks["process"], 7, "holder-id")
    signals.lock_skipped.connect(on_skipped, weak=False)
    try:
        copy = tasks["process"].apply_async((7,), ignore_result=True)
        assert follow(copy, timeout=SHORT) is None
        # Handled before the worker stops: the memory transport is the process's, and a
        # message left in it would reach the next test's worker.
        wait_for("the copy to be skipped", lambda: copy.id in skipped, TIMEOUT)
    finally:
        signals.lock_skipped.disconnect(on_skipped)
    assert copy.state == "PENDING"  # nothing stored


def test_a_deferred_copy_reads_retry_until_it_runs(
    worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    lease = hold(store, tasks["stage"], 7, "other-stage-id", task_name="b.other")
    result = tasks["stage"].delay(7)
    wait_for("the copy to be deferred", lambda: result.state == "RETRY", TIMEOUT)
    store.release(lease, success=False, done_ttl_ms=60_000)
    assert follow(result, timeout=TIMEOUT) == "staged 7"


def test_a_copy_deferred_while_the_lock_store_is_down_reads_retry_with_its_error(
    celery_app: Celery, worker: Any, tasks: dict[str, Any], unused_port: int
) -> None:
    celery_app.conf.celery_lock_redis_url = f"redis://127.0.0.1:{unused_port}/0"
    result = tasks["process"].delay(9)
    wait_for("the copy to be deferred", lambda: result.state == "RETRY", TIMEOUT)
    assert isinstance(result.result, LockStoreUnavailableError)
    assert result.result.lock_name == "celery-lock:{b.process:9}:lock"


def test_a_chord_body_runs_once_with_a_member_skipped_as_success(
    celery_app: Celery, worker: Any, tasks: dict[str, Any], store: LockStore, gathered: list[Any]
) -> None:
    celery_app.conf.celery_lock_skip_as_success = True
    hold(store, tasks["process"], 7, "holder-id")
    process = tasks["process"]
    values = chord([process.s(6), process.s(7)])(tasks["gather"].s()).get(timeout=TIMEOUT)
    assert values[0] == "processed 6"
    assert is_skipped(values[1])
    assert gathered == [values]


def test_a_chord_body_runs_once_with_a_member_deferred(
    worker: Any, tasks: dict[str, Any], store: LockStore, gathered: list[Any]
) -> None:
    stage = tasks["stage"]
    lease = hold(store, stage, 7, "other-stage-id", task_name="b.other")
    result = chord([stage.s(6), stage.s(7)])(tasks["gather"].s())
    member = result.parent.results[1]
    wait_for("the member to be deferred", lambda: member.state == "RETRY", TIMEOUT)
    assert gathered == []
    store.release(lease, success=False, done_ttl_ms=60_000)
    assert result.get(timeout=TIMEOUT) == ["staged 6", "staged 7"]
    assert gathered == [["staged 6", "staged 7"]]


@pytest.mark.parametrize("backend_url", ["db+sqlite"], indirect=True)
def test_the_database_backend_s_cleanup_deletes_a_skipped_copy_s_row(
    celery_app: Celery, worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    """Celery's backend_cleanup deletes rows by their ``date_done``, which Celery sets for ready
    states alone: a SKIPPED row had none, and stayed in the table for ever."""
    hold(store, tasks["process"], 7, "holder-id")
    copy = tasks["process"].delay(7)
    wait_for("the copy to be SKIPPED", lambda: copy.state == SKIPPED, TIMEOUT)
    ran = tasks["process"].delay(8)
    ran.get(timeout=TIMEOUT)
    backend = celery_app.backend
    backend.expires = timedelta(0)  # everything stored so far has expired
    backend.cleanup()
    assert celery_app.AsyncResult(ran.id).state == "PENDING"  # its row deleted
    assert celery_app.AsyncResult(copy.id).state == "PENDING"
