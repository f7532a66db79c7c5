"""The examples run as documented: ``examples/basic.py`` and the pipeline's ``run.py --smoke``.

Each runs as a subprocess with a bounded timeout and starts its own redis-server and workers;
no service of the machine is used (``REDIS_URL`` and ``PIPELINE_*`` are removed from the
environment). verify is also shown to fail on a record with a doubled stage.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from amqp.exceptions import NotFound
from kombu import Connection
from programs import run_program

from celery_lock.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("pending", "process", "callback")
RECORD_DB = 6  # a database of the session's redis-server no other test uses


def run(args: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``args`` in the repository, away from any Redis or broker of the machine."""
    base = {
        k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("PIPELINE_")
    }
    environment = {**base, "PYTHONUNBUFFERED": "1", **env}
    done = run_program(args, cwd=ROOT, env=environment, timeout=timeout)
    print(done.stdout)  # shown by pytest when the test fails
    print(done.stderr, file=sys.stderr)
    return done


@pytest.mark.worker
def test_basic_example_runs_the_request_once() -> None:
    done = run([sys.executable, "examples/basic.py"], timeout=180)
    assert done.returncode == 0
    out = done.stdout
    assert "private redis-server on port" in out
    assert "worker ready: celery -A basic worker -P prefork -c 2" in out
    [fence] = re.findall(r"^  copy \d: SUCCESS: ran the body with fence (\d+)$", out, re.M)
    assert len(re.findall(r"^  copy \d: SKIPPED, reason '(running|done)'", out, re.M)) == 2
    assert f"request 42: state 'processed', fence {fence}, body ran 1 time(s)" in out
    assert "OK: request 42 ran once; the other 2 copies were SKIPPED" in out


@pytest.mark.worker
def test_pipeline_smoke_run_proves_no_stage_ran_twice() -> None:
    done = run([sys.executable, "examples/pipeline/run.py", "--smoke"], timeout=280)
    assert done.returncode == 0
    out = done.stdout
    assert "run: workers ready: pending (pid" in out
    assert re.search(r"^producer: sent 24 copies to pending \(3 per request\)", out, re.M)
    assert re.search(r"^producer: sent [1-9]\d* duplicates straight to process", out, re.M)
    for stage in STAGES:
        assert re.search(rf"^{stage}\s+ran\s+8 \(doubled 0\)", out, re.M), stage
    for check in ("each stage ran exactly once per request",
                  "no two executions of one request overlapped in time (across stages)",
                  "fences strictly increasing per request, in start order",
                  "stages ran in order pending -> process -> callback"):  # fmt: skip
        assert f"[ok] {check}" in out
    assert "verify: OK: 8 requests x 3 stages = 24 executions" in out
    assert "lock ls: no leases held" in out
    assert "exit status 0" in out


def test_pipeline_run_module_form_answers_help() -> None:
    done = run([sys.executable, "-m", "examples.pipeline.run", "--help"], timeout=60)
    assert done.returncode == 0
    assert "--smoke" in done.stdout


def execution(stage: str, idx: int, fence: int, start: float, end: float) -> str:
    task_id = f"{stage}-{idx}-{start}"
    return json.dumps({"stage": stage, "request_idx": idx, "task_id": task_id, "fence": fence,
                       "host": "h", "pid": 1, "start": start, "end": end})  # fmt: skip


def test_verify_fails_on_a_doubled_stage_an_overlap_and_a_stale_fence(
    redis_server: RedisServer,
) -> None:
    """verify is not vacuous: a record with a double, an overlap and a stale fence fails."""
    records = redis_server.client(RECORD_DB)
    records.flushdb()
    records.set("pipeline:run:r1", json.dumps({"run_id": "r1", "first": 10, "count": 2}))
    records.set("pipeline:last-run", "r1")
    records.rpush(
        "pipeline:executions",
        # request 10: clean
        execution("pending", 10, 1, 0.0, 1.0),
        execution("process", 10, 2, 1.0, 2.0),
        execution("callback", 10, 3, 2.5, 3.0),
        # request 11: process twice, overlapping pending, with a fence that went back
        execution("pending", 11, 2, 0.0, 1.0),
        execution("process", 11, 1, 0.5, 1.5),
        execution("process", 11, 3, 2.0, 2.5),
        execution("callback", 11, 4, 3.0, 3.5),
    )
    records.close()
    done = run(
        [sys.executable, "examples/pipeline/verify.py"], timeout=60,
        PIPELINE_RECORD_URL=redis_server.url_for(RECORD_DB),
    )  # fmt: skip
    assert done.returncode == 1
    out = done.stdout
    assert re.search(r"^process\s+ran\s+3 \(doubled 1\)", out, re.M)
    assert "[FAIL] each stage ran exactly once per request" in out
    assert "request 11: process ran 2 times" in out
    assert "[FAIL] no two executions of one request overlapped in time" in out
    assert "[FAIL] fences strictly increasing per request, in start order" in out
    assert "request 11: fence 1 of process after fence 2 of pending" in out
    assert "request 10" not in out
    assert "verify: FAILED: 3 check(s) failed" in out


#: The chaos run's bound: worker starts, its faults, and a drain slowed by a loaded machine.
CHAOS_QUICK_LIMIT = 420


@pytest.mark.worker
@pytest.mark.timeout(CHAOS_QUICK_LIMIT + 120)
def test_pipeline_chaos_quick_run_finds_no_violation() -> None:
    _chaos_quick_run([], "forced visibility sweeps")


def _chaos_quick_run(options: list[str], redelivery: str) -> subprocess.CompletedProcess[str]:
    """Run ``chaos --quick`` and check its summary: no violation, every request, and every kind
    of fault (``redelivery``: the broker's) made at least once, whatever the seed."""
    command = [sys.executable, "-m", "examples.pipeline.chaos", "--quick", *options]
    done = run(command, CHAOS_QUICK_LIMIT)
    out = done.stdout
    assert done.returncode == 0
    assert re.search(r"^  violations\s+0$", out, re.M)
    assert re.search(r"^  requests\s+30$", out, re.M)
    for row in ("pool processes killed", "lock store restarts", redelivery):
        assert re.search(rf"^  {row}\s+[1-9]", out, re.M), row
    assert "VIOLATION" not in out
    return done


@pytest.mark.worker
@pytest.mark.amqp
@pytest.mark.timeout(CHAOS_QUICK_LIMIT + 120)
def test_pipeline_chaos_quick_run_over_rabbitmq_finds_no_violation(rabbitmq: str) -> None:
    """The same over RabbitMQ, where the broker's redelivery comes from a worker crash; the
    run's own queues and their exchanges are gone at the end."""
    done = _chaos_quick_run(["--broker", rabbitmq], "worker crashes")
    queues = re.search(r"^\[chaos\].* queues (\S+), (\S+), (\S+)$", done.stderr, re.M)
    assert queues is not None
    with Connection(rabbitmq) as connection:
        for name in queues.groups():
            assert "-chaos-" in name
            with pytest.raises(NotFound):
                connection.channel().queue_declare(name, passive=True)
            with pytest.raises(NotFound):
                connection.channel().exchange_declare(name, "direct", passive=True)


def chaos_entry(key: str, **fields: object) -> tuple[str, str]:
    return key, json.dumps(fields)


def test_chaos_checks_find_each_kind_of_violation(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chaos run's checks are not vacuous: a record with a re-run after a done-marker, an
    overlap, a fence gone back, a body that vanished and a stale accepted write fails each
    check; a clean request with a killed body's re-run fails none."""
    monkeypatch.syspath_prepend(str(ROOT))
    from examples.pipeline.chaos import (  # noqa: PLC0415 - needs the checkout on sys.path
        Faults,
        find_violations,
    )

    def body(stage: str, idx: int, fence: int, pid: int, start: float, end: float | None,
             done: bool = True) -> list[tuple[str, str]]:  # fmt: skip
        ids = {"stage": stage, "request_idx": idx, "task_id": f"{stage}-{idx}-{pid}", "pid": pid}
        entries = [chaos_entry("pipeline:started", **ids, fence=fence, start=start)]
        if end is not None:
            entries.append(chaos_entry("pipeline:executions", **ids, fence=fence, start=start,
                                       end=end, lost=False))  # fmt: skip
            entries.append(chaos_entry("pipeline:writes", **ids, fence=fence, accepted=True,
                                       before=end - 0.1, after=end - 0.05))  # fmt: skip
            entries.append(chaos_entry("pipeline:releases", stage=stage,
                                       task_id=ids["task_id"], pid=pid, success=done,
                                       owned=True))  # fmt: skip
        return entries

    entries = [
        # request 10: clean; its first pending body (pid 50) was killed and ran again
        *body("pending", 10, 1, 50, 0.0, None),
        *body("pending", 10, 2, 51, 0.5, 1.0),
        *body("process", 10, 3, 52, 1.0, 2.0),
        *body("callback", 10, 4, 53, 2.0, 3.0),
        # request 11: process ran again after a done release, overlapping callback, fence back
        *body("pending", 11, 1, 60, 0.0, 1.0),
        *body("process", 11, 2, 61, 1.0, 2.0),
        *body("callback", 11, 4, 62, 2.5, 3.5),
        *body("process", 11, 3, 63, 3.0, 4.0),
        # request 12: callback started and vanished (not killed); it never ended
        *body("pending", 12, 1, 70, 0.0, 1.0),
        *body("process", 12, 2, 71, 1.0, 2.0),
        *body("callback", 12, 3, 72, 2.0, None),
    ]
    records = redis_server.client(RECORD_DB)
    records.flushdb()
    try:
        for key, value in entries:
            records.rpush(key, value)
        for idx, fence in ((10, 4), (11, 4), (12, 1)):
            records.hset(f"pipeline:state:{idx}", mapping={"value": "x", "fence": fence})
        found = find_violations(records, range(10, 13), Faults(kills={50: ("pending", 0.4)}))
    finally:
        records.flushdb()
        records.close()

    problems = {check: "\n".join(found) for check, found in found.violations.items()}
    assert "request 10" not in "\n".join(problems.values())
    assert found.counts["re-runs: killed"] == 1
    assert (
        "request 11: process (process-11-61) released done, and ran again"
        in problems["no stage ran again once its done-marker was written"]
    )
    assert (
        "request 11: process (fence 3) started"
        in problems["no two bodies of one request ran at the same time"]
    )
    assert (
        "request 11: fence 3 of process after fence 4 of callback"
        in problems["fences strictly increase per request, in start order"]
    )
    assert (
        "request 11: process wrote fence 3 after callback wrote fence 4"
        in problems["every accepted fenced write had a fence >= every earlier accepted one"]
    )
    assert (
        "request 12: callback (callback-12-72, pid 72) started and never ended"
        in problems["every body that started ended or was killed"]
    )
    assert "request 12: callback never ended" in problems["every request completed every stage"]
    assert (
        "request 12: stored fence 1, largest accepted 2"
        in problems["every accepted fenced write had a fence >= every earlier accepted one"]
    )
