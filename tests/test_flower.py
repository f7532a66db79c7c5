"""A real Flower beside a real worker: skipped copies and lost leases show up in what it serves.

Flower (``celery -A tests.apps.storm_app flower``) runs as a subprocess in its own session on a
free port. The tests read its Prometheus counter ``flower_events_total`` (``GET /metrics``) and
its task list (``GET /api/tasks?state=SKIPPED``; Flower 2.x answers its API without
authentication only when ``FLOWER_UNAUTHENTICATED_API`` is set).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult
from conftest import close_producer, wait_for
from prometheus_client.parser import text_string_to_metric_families

from celery_lock import SKIPPED
from celery_lock.testing import CeleryWorker, free_port

pytestmark = pytest.mark.worker

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.apps.storm_app"
TIMEOUT = 30.0


class Flower:
    """``celery -A <app> flower`` on 127.0.0.1 and a free port, in its own process group."""

    def __init__(self, env: dict[str, str], logfile: Path, extra_args: list[str]) -> None:
        self.port = free_port()
        self.logfile = logfile
        self.cmd = [sys.executable, "-m", "celery", "-A", APP, "flower",
                    f"--port={self.port}", "--address=127.0.0.1", *extra_args]  # fmt: skip
        self.env = {**os.environ, **env, "FLOWER_UNAUTHENTICATED_API": "true"}
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.logfile.open("wb") as out:
            self._proc = subprocess.Popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.env, cwd=ROOT, start_new_session=True,
            )  # fmt: skip
        wait_for(f"Flower to answer:\n{self.log()}", self._healthy)

    def stop(self) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # sweep anything left in its group
            os.killpg(self._proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5)
        self._proc = None

    def log(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def get(self, path: str) -> str:
        url = f"http://127.0.0.1:{self.port}{path}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    def _healthy(self) -> bool:
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise AssertionError(f"Flower exited during startup:\n{self.log()}")
        try:
            return self.get("/healthcheck") == "OK"
        except (OSError, urllib.error.URLError):
            return False

    def samples(self, metric: str) -> list[tuple[dict[str, str], float]]:
        """The samples of ``metric`` (e.g. ``flower_events_total``) as (labels, value)."""
        return [
            (sample.labels, sample.value)
            for family in text_string_to_metric_families(self.get("/metrics"))
            for sample in family.samples
            if sample.name == metric
        ]

    def events_total(self, type_: str, task: str) -> float:
        """``flower_events_total{type=type_, task=task}``, summed over workers (0 if absent)."""
        return sum(
            value
            for labels, value in self.samples("flower_events_total")
            if labels["type"] == type_ and labels["task"] == task
        )

    def counter_lines(self) -> list[str]:
        return [line for line in self.get("/metrics").splitlines()
                if line.startswith("flower_events_total{")]  # fmt: skip

    def tasks(self, **query: str) -> dict[str, dict[str, Any]]:
        """``GET /api/tasks`` with ``query``: task id -> Flower's fields of the task."""
        tasks: dict[str, dict[str, Any]] = json.loads(
            self.get("/api/tasks?" + "&".join(f"{k}={v}" for k, v in query.items()))
        )
        return tasks


@pytest.fixture
def stack(worker_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Start Flower and a storm worker (``-E`` or not); both are stopped at teardown."""
    started: list[Any] = []

    def start(*, task_events: bool, flower_args: list[str] | None = None,
              **env: str) -> tuple[Flower, CeleryWorker]:  # fmt: skip
        flower = Flower(worker_env, tmp_path / "flower.log", flower_args or [])
        started.append(flower)
        flower.start()
        worker = CeleryWorker(
            APP, concurrency=2, cwd=ROOT, env={**worker_env, **env},
            hostname=f"flower-{uuid.uuid4().hex[:8]}@celery-lock-test",
            extra_args=(["-E"] if task_events else []) + ["--without-mingle", "--without-gossip"],
            logfile=tmp_path / "worker.log",
        )  # fmt: skip
        started.append(worker)
        worker.start()
        # Flower's event queue is bound once it has seen the worker come online.
        online = f'flower_worker_online{{worker="{worker.hostname}"}} 1.0'
        wait_for(f"Flower to see {worker.hostname}", lambda: online in flower.get("/metrics"))
        return flower, worker

    yield start
    for process in reversed(started):
        process.stop()


@pytest.fixture
def producer(worker_env: dict[str, str]) -> Iterator[Celery]:
    app = Celery("flower-producer", broker=worker_env["STORM_BROKER_URL"],
                 backend=worker_env["STORM_BACKEND_URL"], set_as_current=False)  # fmt: skip
    yield app
    close_producer(app)


@pytest.fixture
def locks(worker_env: dict[str, str]) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(worker_env["STORM_LOCK_URL"])
    yield client
    client.close()


def lock_key(task: str, request_idx: int) -> str:
    return f"celery-lock:{{{task}:{request_idx}}}:lock"


def wait_skipped(result: AsyncResult[Any]) -> None:
    wait_for(f"{result.id} to be SKIPPED", lambda: result.state == SKIPPED)


def test_flower_counts_and_lists_skipped_copies(
    stack: Callable[..., Any], producer: Celery, locks: redis.Redis
) -> None:
    # The first copy runs long enough for the second to reach the other pool process while it
    # runs (skipped: running), even on a loaded machine.
    flower, _ = stack(task_events=True, STORM_WORK_SECONDS="5.0")
    key = lock_key("storm.process", 7)

    first = producer.send_task("storm.process", args=(7,))
    wait_for("the first copy to hold the lease", lambda: locks.exists(key))
    running_copy = producer.send_task("storm.process", args=(7,))  # skipped: running
    wait_skipped(running_copy)
    assert first.get(timeout=TIMEOUT) == 7
    done_copy = producer.send_task("storm.process", args=(7,))  # skipped: done
    wait_skipped(done_copy)

    wait_for("the counter to count both skips",
             lambda: flower.events_total("task-skipped", "storm.process") == 2)  # fmt: skip
    print("\n".join(flower.counter_lines()))

    skipped = wait_for(
        "Flower to list both copies as SKIPPED",
        lambda: (
            (tasks := flower.tasks(state=SKIPPED)).keys() == {running_copy.id, done_copy.id}
            and tasks
        ),
    )
    print(json.dumps(skipped, indent=1))
    for copy, reason in ((running_copy, "running"), (done_copy, "done")):
        task = skipped[copy.id]
        assert task["state"] == SKIPPED
        assert task["name"] == "storm.process"
        assert task["result"] == f"skipped: {reason} (holder {first.id})"
    assert first.id not in skipped
    assert flower.tasks()[first.id]["state"] == "SUCCESS"
    assert flower.events_total("task-succeeded", "storm.process") == 1


def test_flower_counts_a_lost_lease(
    stack: Callable[..., Any], producer: Celery, locks: redis.Redis
) -> None:
    flower, worker = stack(task_events=True)
    key = lock_key("storm.long", 5)

    result = producer.send_task("storm.long", args=(5, 5.0))  # TTL 1 s, kept by the heartbeat
    wait_for("the lease", lambda: locks.exists(key))
    locks.delete(key)  # the heartbeat's next extend finds it gone

    wait_for("the counter to count the lost lease",
             lambda: flower.events_total("task-lock-lost", "storm.long") == 1)  # fmt: skip
    print("\n".join(flower.counter_lines()))
    # While the body runs on, Flower shows the event as the task's state, with its summary.
    task = flower.tasks()[result.id]
    print(json.dumps({k: task[k] for k in ("state", "result")}))
    assert task["state"] == "LOCK-LOST"
    assert task["result"] == f"lock lost: {key}"
    assert result.get(timeout=TIMEOUT) == 5
    wait_for("Flower to see the task succeed",
             lambda: flower.events_total("task-succeeded", "storm.long") == 1)  # fmt: skip
    assert flower.events_total("task-lock-lost", "storm.long") == 1
    assert flower.tasks()[result.id]["state"] == "SUCCESS"
    assert f"lease on {key} lost while task {result.id} ran" in worker.log()


def test_without_task_events_no_task_skipped_event_is_sent(
    stack: Callable[..., Any], producer: Celery, worker_env: dict[str, str]
) -> None:
    # --enable_events=False: Flower must not turn the worker's task events on over remote control.
    flower, worker = stack(task_events=False, flower_args=["--enable_events=False"])

    first = producer.send_task("storm.process", args=(9,))
    assert first.get(timeout=TIMEOUT) == 9
    copy = producer.send_task("storm.process", args=(9,))
    wait_skipped(copy)  # the skip sends its event (if any) before it stores the state

    # A barrier: an event published now reaches Flower after anything the skip published.
    with producer.events.default_dispatcher(hostname=worker.hostname) as dispatcher:
        dispatcher.send("task-barrier", uuid=str(uuid.uuid4()), name="barrier")
    wait_for("Flower to count the barrier", lambda: flower.events_total("task-barrier", "barrier"))

    assert flower.events_total("task-skipped", "storm.process") == 0
    assert flower.tasks(state=SKIPPED) == {}
    assert "task-received" not in "\n".join(flower.counter_lines())  # task events stayed off


def test_task_events_turned_on_by_flower_carry_task_skipped(
    stack: Callable[..., Any], producer: Celery
) -> None:
    # No -E: Flower (enable_events by default) turns the worker's task events on remotely.
    flower, worker = stack(task_events=False)
    wait_for("Flower to turn task events on", lambda: "enabled by remote" in worker.log())

    first = producer.send_task("storm.process", args=(4,))
    assert first.get(timeout=TIMEOUT) == 4
    copy = producer.send_task("storm.process", args=(4,))
    wait_skipped(copy)
    wait_for("Flower to see the copy", lambda: copy.id in flower.tasks())
    wait_for("the counter to count the skip",
             lambda: flower.events_total("task-skipped", "storm.process") == 1,
             timeout=10)  # fmt: skip
    [(task_id, task)] = flower.tasks(state=SKIPPED).items()
    assert task_id == copy.id
    assert task["result"] == f"skipped: done (holder {first.id})"
