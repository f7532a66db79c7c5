"""Periodic LockedTasks sent by real ``celery beat`` processes to a real prefork worker.

``tests/apps/beat_app.py`` schedules its tasks from ``BEAT_SCHEDULE`` (every 1 or 2 s); every
body records its monotonic interval and task id, and the test reads the record and the states
the result backend holds.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import BACKEND_DB, BROKER_DB, LOCK_DB, RECORD_DB, ROOT, wait_for

from celery_lock import SKIPPED
from celery_lock.testing import CeleryWorker, RedisServer, _terminate

pytestmark = pytest.mark.worker

RUNS_KEY = "beat:runs"


@pytest.fixture
def beat_env(redis_server: RedisServer) -> dict[str, str]:
    """Environment of ``tests/apps/beat_app.py`` processes, on emptied databases."""
    roles = {"BROKER": BROKER_DB, "BACKEND": BACKEND_DB, "LOCK": LOCK_DB, "RECORD": RECORD_DB}
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    for role, db in roles.items():
        redis_server.flush(db)
        env[f"BEAT_{role}_URL"] = redis_server.url_for(db)
    return env


@pytest.fixture
def spawn_beat(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """``spawn_beat(env)``: a ``celery beat`` subprocess of ``beat_app`` with a schedule file of
    its own; each one is stopped by pid (SIGTERM, then SIGKILL of its group) after the test."""
    started: list[subprocess.Popen[bytes]] = []

    def spawn(env: dict[str, str]) -> subprocess.Popen[bytes]:
        index = len(started)
        with (tmp_path / f"beat-{index}.log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.apps.beat_app", "beat", "-l",
                 "INFO", "-s", str(tmp_path / f"schedule-{index}"), "--pidfile="],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **env}, cwd=ROOT, start_new_session=True,
            )  # fmt: skip
        started.append(proc)
        return proc

    yield spawn
    for proc in started:
        _terminate(proc, 10, group=True)


def runs(env: dict[str, str]) -> list[dict[str, Any]]:
    with redis.Redis.from_url(env["BEAT_RECORD_URL"]) as client:
        return [json.loads(entry) for entry in client.lrange(RUNS_KEY, 0, -1)]


def stored_states(env: dict[str, str]) -> Counter[tuple[str, str | None]]:
    """The state of every task id in the result backend, with a skip's reason."""
    found: Counter[tuple[str, str | None]] = Counter()
    with redis.Redis.from_url(env["BEAT_BACKEND_URL"]) as client:
        for key in client.scan_iter("celery-task-meta-*"):
            meta = json.loads(client.get(key) or "{}")
            result = meta.get("result")
            found[meta["status"], result.get("reason") if isinstance(result, dict) else None] += 1
    return found


def assert_never_overlapped(recorded: list[dict[str, Any]]) -> None:
    ordered = sorted(recorded, key=lambda run: run["start"])
    for before, after in itertools.pairwise(ordered):
        assert before["end"] <= after["start"], f"two runs overlapped: {before} and {after}"


def test_periodic_job_without_arguments_is_done_after_its_first_run(
    spawn_worker: Callable[..., CeleryWorker],
    spawn_beat: Callable[..., subprocess.Popen[bytes]],
    beat_env: dict[str, str],
) -> None:
    # The default done TTL (a day) outlives the period: every later tick is the same request.
    env = {**beat_env, "BEAT_SCHEDULE": '{"sweep": {"task": "beat.sweep", "every": 1}}'}
    spawn_worker("tests.apps.beat_app", env, concurrency=2)
    spawn_beat(env)

    wait_for("three ticks skipped as done", lambda: stored_states(env)[SKIPPED, "done"] >= 3)
    assert len(runs(env)) == 1


def test_periodic_job_longer_than_its_period_never_overlaps_and_keeps_running(
    spawn_worker: Callable[..., CeleryWorker],
    spawn_beat: Callable[..., subprocess.Popen[bytes]],
    beat_env: dict[str, str],
) -> None:
    # concepts.md's advice for runs that must never overlap: a done TTL below the period.
    env = {
        **beat_env,
        "BEAT_SCHEDULE": '{"sweep": {"task": "beat.sweep", "every": 1}}',
        "BEAT_TASK_OPTIONS": '{"lock_done_ttl": 0.5}',
        "BEAT_WORK_SECONDS": "2.5",
    }
    spawn_worker("tests.apps.beat_app", env, concurrency=2)
    spawn_beat(env)

    wait_for("three runs", lambda: len(runs(env)) >= 3, timeout=40)
    assert_never_overlapped(runs(env))
    assert stored_states(env)[SKIPPED, "running"] >= 2
    assert stored_states(env)["RETRY", None] == 0  # nothing deferred to run later


def test_deferred_periodic_copy_past_its_expiry_is_revoked(
    spawn_worker: Callable[..., CeleryWorker],
    spawn_beat: Callable[..., subprocess.Popen[bytes]],
    beat_env: dict[str, str],
) -> None:
    # on_duplicate="retry" defers every tick sent while a run lasts; the entry's expires keeps
    # those copies from piling up: the deferred copy keeps it, and expires as REVOKED.
    schedule = {"sweep": {"task": "beat.sweep", "every": 1, "options": {"expires": 1.5}}}
    env = {
        **beat_env,
        "BEAT_SCHEDULE": json.dumps(schedule),
        "BEAT_TASK_OPTIONS": '{"lock_done_ttl": 0.5, "lock_on_duplicate": "retry"}',
        "BEAT_WORK_SECONDS": "2.5",
    }
    spawn_worker("tests.apps.beat_app", env, concurrency=2)
    beat = spawn_beat(env)

    wait_for("two deferred ticks revoked", lambda: stored_states(env)["REVOKED", None] >= 2)
    _terminate(beat, 10, group=True)
    # Every deferred copy ends (expired, skipped or run); none is left to run later.
    wait_for("no deferred copy left", lambda: stored_states(env)["RETRY", None] == 0)
    assert_never_overlapped(runs(env))


def test_two_beats_run_each_period_once_when_keyed_by_the_period(
    spawn_worker: Callable[..., CeleryWorker],
    spawn_beat: Callable[..., subprocess.Popen[bytes]],
    beat_env: dict[str, str],
) -> None:
    # Two beats by mistake, out of step with each other: each sends every tick. The entry's
    # task keys the job by the period the tick falls in, so each period's job runs once.
    schedule = {"dispatch": {"task": "beat.dispatch", "every": 2, "args": [2]}}
    env = {**beat_env, "BEAT_SCHEDULE": json.dumps(schedule)}
    spawn_worker("tests.apps.beat_app", env, concurrency=2)
    spawn_beat(env)
    wait_for("the first beat's first tick", lambda: runs(env))
    spawn_beat(env)

    wait_for("two ticks skipped as done", lambda: stored_states(env)[SKIPPED, "done"] >= 2)
    periods = Counter(run["period"] for run in runs(env))
    assert periods
    assert set(periods.values()) == {1}, periods
