"""Tests for ``python -m celery_lock.demo``: real runs on a private redis-server, and its verdict.

The runs pass ``--embedded`` or point ``$REDIS_URL`` at a port nobody listens on, so they never
touch a Redis service of the machine.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from programs import run_program

from celery_lock.demo import __main__ as demo_main
from celery_lock.demo.__main__ import Demo, Run, display_url, main, parse_args, summarize
from celery_lock.testing import CeleryWorker, free_port

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT = 120


def demo_env(**extra: str) -> dict[str, str]:
    """The environment of a demo subprocess: this source tree first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_LOCK_DEMO_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_demo(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_program(
        [sys.executable, "-m", "celery_lock.demo", *args], env=env, cwd=ROOT, timeout=RUN_TIMEOUT
    )


def table_value(output: str, label: str) -> str:
    """The value column of the summary row ``label``."""
    match = re.search(rf"^\s*{re.escape(label)}\s+(\S+)", output, re.MULTILINE)
    assert match, f"no {label!r} row in:\n{output}"
    return match.group(1)


def reported_pid(output: str, pattern: str) -> int:
    """The pid the demo printed where ``pattern`` (with one group) matches."""
    match = re.search(pattern, output)
    assert match, f"no {pattern!r} in:\n{output}"
    return int(match.group(1))


def reported_path(output: str, pattern: str) -> str:
    """The path the demo printed where ``pattern`` (with one group) matches."""
    match = re.search(pattern, output)
    assert match, f"no {pattern!r} in:\n{output}"
    return match.group(1)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (PID 1 may not reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


# -- real runs ---------------------------------------------------------------------------------


@pytest.mark.worker
def test_embedded_run_executes_each_request_once(tmp_path: Path) -> None:
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    env = demo_env(REDIS_URL=unreachable, TMPDIR=str(tmp_path))
    proc = run_demo("--requests", "10", "--copies", "3", "--embedded", env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "log kept" not in output
    assert list(tmp_path.iterdir()) == []  # the worker's log went with the success
    assert "started a private redis-server (--embedded)" in output
    assert table_value(output, "requests") == "10"
    assert table_value(output, "copies") == "3"
    assert table_value(output, "executed") == "10"
    assert table_value(output, "skipped") == "20"
    assert table_value(output, "doubles") == "0"
    assert table_value(output, "fences increasing") == "yes"
    assert "Traceback" not in output


@pytest.mark.worker
def test_unreachable_redis_url_falls_back_to_a_private_server() -> None:
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    proc = run_demo("--requests", "6", "--copies", "2", env=demo_env(REDIS_URL=unreachable))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert f"nothing usable at {unreachable} ($REDIS_URL)" in output
    assert "started a private redis-server (falling back)" in output
    assert table_value(output, "executed") == "6"
    assert table_value(output, "skipped") == "6"
    assert table_value(output, "doubles") == "0"


@pytest.mark.worker
def test_log_of_a_failed_run_is_kept_after_the_demo_exits(tmp_path: Path) -> None:
    # Bodies far longer than the timeout: failed however fast the machine publishes (with a
    # timeout of 0.001 s and quick bodies, a slow publish let the worker settle every copy).
    args = ["--requests", "5", "--copies", "2", "--work-seconds", "30", "--timeout", "1"]
    args.append("--embedded")
    proc = run_demo(*args, env=demo_env(TMPDIR=str(tmp_path)))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    log = Path(reported_path(output, r"worker: log kept at (\S+)"))
    assert log.parent == tmp_path
    assert "ready." in log.read_text()  # there, and it is the worker's log


@pytest.mark.worker
def test_ctrl_c_stops_the_worker_and_the_server(tmp_path: Path) -> None:
    # A child of a background shell may inherit SIGINT ignored: make it raise KeyboardInterrupt.
    code = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = ['celery_lock.demo', *sys.argv[1:]]; "
        "runpy.run_module('celery_lock.demo', run_name='__main__', alter_sys=True)"
    )
    args = ["--requests", "200", "--copies", "3", "--work-seconds", "0.2", "--embedded"]
    out_path = tmp_path / "demo.out"
    with out_path.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            env=demo_env(),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while "sent:" not in out_path.read_text():
            assert proc.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        returncode = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    output = out_path.read_text()
    assert returncode == 130, output
    assert "interrupted: cleaning up" in output
    server_pid = reported_pid(output, r"redis-server \(--embedded\): pid (\d+)")
    worker_pid = reported_pid(output, r"worker: pid (\d+)")
    assert not pid_alive(server_pid)
    assert not pid_alive(worker_pid)
    assert group_members(worker_pid) == []  # the pool processes went too
    assert "log kept" not in output


# -- in process --------------------------------------------------------------------------------


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for option in ("--requests", "--copies", "--concurrency", "--work-seconds", "--timeout"):
        assert option in help_text
    assert "--redis-url" in help_text
    assert "--embedded" in help_text


def test_rejects_a_zero_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--copies", "0"])
    assert exit_info.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err


@pytest.mark.worker
def test_log_of_a_worker_that_did_not_start_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class WorkerOfNoApp(CeleryWorker):
        def __init__(self, app: str, **options: Any) -> None:
            super().__init__("celery_lock_demo_no_such_app", **options)

    monkeypatch.setattr(demo_main, "CeleryWorker", WorkerOfNoApp)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = io.StringIO()
    assert main(["--requests", "1", "--copies", "1", "--embedded"], out=out) == 2
    output = out.getvalue()
    assert "error: the worker did not start" in output
    log = Path(reported_path(output, r"worker: log kept at (\S+)"))
    assert "celery_lock_demo_no_such_app" in log.read_text()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:secret@localhost:6380/0", "redis://:***@localhost:6380/0"),
        ("redis://me:secret@[::1]:6380/0", "redis://me:***@[::1]:6380/0"),
        ("redis://me@localhost/0", "redis://me@localhost/0"),
        ("redis://:secret@localhost:abc/0", "redis://:***@localhost:abc/0"),
        ("redis://:secret@[::1", "redis://:***@[::1"),
        ("redis://localhost/0?password=secret&db=1", "redis://localhost/0?password=***&db=1"),
    ],
)
def test_display_url_masks_the_password_also_of_a_malformed_url(url: str, shown: str) -> None:
    assert display_url(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "redis://:secret@localhost:abc/0",
        "redis://:secret@[::1",
        # a FULLWIDTH COMMERCIAL AT: urllib rejects the netloc and quotes it in its error
        "redis://:s\uff20cret@localhost/0",
    ],
)
@pytest.mark.parametrize("source", ["--redis-url", "$REDIS_URL"])
def test_malformed_redis_url_falls_back_to_a_private_server(
    url: str, source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if source == "$REDIS_URL":
        monkeypatch.setenv("REDIS_URL", url)
        argv: list[str] = []
    else:
        monkeypatch.delenv("REDIS_URL", raising=False)
        argv = ["--redis-url", url]
    out = io.StringIO()
    demo = Demo(parse_args(argv), out)
    try:
        _, private = demo.choose_redis()
    finally:
        demo.cleanup()
    output = out.getvalue()
    assert private
    assert f"({source}): invalid URL" in output
    assert "started a private redis-server (falling back)" in output
    assert "cret" not in output


def run(idx: int, start: float, end: float, fence: int | None = 1, task: str = "t") -> Run:
    return Run(request_idx=idx, task_id=task, fence=fence, pid=1, start=start, end=end)


def test_summary_of_a_clean_run() -> None:
    outcomes = {
        "a": ("SUCCESS", None),
        "b": ("SKIPPED", "running"),
        "c": ("SKIPPED", "done"),
        "d": ("SUCCESS", None),
    }
    summary = summarize([run(0, 0, 1), run(1, 0, 1)], outcomes, 2, 2, wall_seconds=2.0)
    assert (summary.executed, summary.skipped, summary.doubles) == (2, 2, 0)
    assert (summary.skipped_running, summary.skipped_done) == (1, 1)
    assert summary.fences_increasing
    assert summary.ok
    assert re.search(r"^\s*throughput\s+2\.0\s+messages settled/s$", summary.table(), re.MULTILINE)


def test_summary_counts_a_second_run_and_an_overlap_as_doubles() -> None:
    runs = [run(0, 0.0, 1.0, fence=1), run(0, 0.5, 1.5, fence=2), run(1, 0, 1)]
    summary = summarize(runs, {}, 2, 2, wall_seconds=1.0)
    assert summary.extra_runs == 1
    assert summary.overlaps == 1
    assert summary.doubles == 2
    assert summary.unsettled == 4
    assert not summary.ok
    assert table_value(summary.table(), "doubles") == "2"


def test_summary_notices_fences_that_do_not_increase_and_requests_that_never_ran() -> None:
    runs = [run(0, 0.0, 1.0, fence=2), run(0, 2.0, 3.0, fence=2)]
    summary = summarize(runs, {}, 2, 1, wall_seconds=1.0)
    assert summary.overlaps == 0
    assert summary.extra_runs == 1
    assert not summary.fences_increasing
    assert summary.never_ran == 1
    assert table_value(summary.table(), "fences increasing") == "no"


def test_summary_of_a_timed_out_run_is_not_ok() -> None:
    # Every request ran once, but one copy never settled before the timeout.
    outcomes = {"a": ("SUCCESS", None), "b": ("SKIPPED", "running"), "c": ("SUCCESS", None)}
    summary = summarize([run(0, 0, 1), run(1, 0, 1)], outcomes, 2, 2, wall_seconds=2.0)
    assert (summary.executed, summary.doubles, summary.unsettled) == (2, 0, 1)
    assert not summary.ok
    assert table_value(summary.table(), "unsettled") == "1"


def test_summary_of_a_run_with_a_failed_copy_is_not_ok() -> None:
    outcomes = {
        "a": ("SUCCESS", None),
        "b": ("FAILURE", None),
        "c": ("SUCCESS", None),
        "d": ("SKIPPED", "done"),
    }
    summary = summarize([run(0, 0, 1), run(1, 0, 1)], outcomes, 2, 2, wall_seconds=2.0)
    assert (summary.executed, summary.doubles, summary.unsettled, summary.failed) == (2, 0, 0, 1)
    assert not summary.ok
    assert table_value(summary.table(), "failed") == "1"


def test_summary_with_a_run_without_a_fence_is_not_ok() -> None:
    outcomes = {"a": ("SUCCESS", None), "b": ("SUCCESS", None)}
    summary = summarize([run(0, 0, 1, fence=None), run(1, 0, 1)], outcomes, 2, 1, 2.0)
    assert summary.doubles == 0
    assert not summary.fences_increasing
    assert not summary.ok
