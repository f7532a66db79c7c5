"""A sampling profile of a real prefork worker, with py-spy.

cProfile slows every Python call down and sees one process; py-spy samples the stacks of the
worker's main process and of every pool process from outside, at a fixed rate, without changing
them. Only py-spy's "active" samples are kept: a thread on a CPU or ready for one, not one asleep
on a socket or a pipe. So a function's share is its CPU time, system calls included, plus, on a
machine with more busy processes than cores, the time it waited for a CPU (a ``sendall`` that
wakes ``redis-server`` on the same core shows that way).

:func:`summarize` reads py-spy's ``raw`` output (one collapsed stack and its sample count per
line) and turns it into microseconds per task: per process kind, inside celery-lock's frames,
and for the functions found at the top of the pool processes' stacks.
"""

from __future__ import annotations

import collections
import contextlib
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: Samples per second.
RATE = 1000


class SamplerUnavailable(RuntimeError):
    """py-spy is not installed, or may not attach to the worker (it needs ptrace)."""


@dataclass(frozen=True)
class WorkerProfile:
    """Where the worker's CPU went, in microseconds per task."""

    main_us: float
    pool_us: float
    #: Pool time with a celery-lock frame on the stack (the lock's calls, round trips included).
    lock_us: float
    #: Pool time with a celery-lock frame at the top of the stack (the library's own Python).
    lock_own_us: float
    #: The functions at the top of the pool processes' stacks, costliest first.
    pool_top: list[tuple[str, float]]

    def render(self, top: int) -> str:
        """The profile as text."""
        lines = [
            f"main process      {self.main_us:8.1f} µs/task",
            f"pool processes    {self.pool_us:8.1f} µs/task",
            f"  in celery-lock  {self.lock_us:8.1f} µs/task (round trips included)",
            f"  its own Python  {self.lock_own_us:8.1f} µs/task",
            "pool processes, top of the stack:",
        ]
        lines += [f"  {us:8.1f} µs/task  {frame}" for frame, us in self.pool_top[:top]]
        return "\n".join(lines)


def summarize(raw: str, tasks: int, rate: int = RATE) -> WorkerProfile:
    """Summarize py-spy ``--format raw --subprocesses`` output of a worker that ran ``tasks``."""
    per_task = 1e6 / rate / max(tasks, 1)
    by_kind: collections.Counter[str] = collections.Counter()
    tops: collections.Counter[str] = collections.Counter()
    lock = lock_own = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        # A pool process's stack starts with its parent's "process <pid>:..." frame and its own.
        kind = "pool" if sum(f.startswith("process ") for f in frames[:2]) == 2 else "main"
        by_kind[kind] += count
        if kind == "pool":
            tops[frames[-1]] += count
            if "celery_lock/" in stack:
                lock += count
            if "celery_lock/" in frames[-1]:
                lock_own += count
    return WorkerProfile(
        main_us=by_kind["main"] * per_task,
        pool_us=by_kind["pool"] * per_task,
        lock_us=lock * per_task,
        lock_own_us=lock_own * per_task,
        pool_top=[(frame, count * per_task) for frame, count in tops.most_common()],
    )


@contextlib.contextmanager
def sampling(pid: int, out: Path) -> Iterator[None]:
    """Sample process ``pid`` and its children with py-spy while the block runs.

    Raises:
        SamplerUnavailable: py-spy is missing, or could not attach.
    """
    executable = shutil.which("py-spy")
    if executable is None:
        raise SamplerUnavailable("py-spy is not installed (pip install -e '.[bench]')")
    command = [
        executable, "record", "--pid", str(pid), "--subprocesses", "--nonblocking",
        "--rate", str(RATE), "--format", "raw", "--output", str(out),
    ]  # fmt: skip
    spy = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output and exits
        try:
            said, _ = spy.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
            said, _ = spy.communicate()
    if not out.exists() or not out.stat().st_size:
        raise SamplerUnavailable(
            f"py-spy recorded nothing (it needs ptrace: run as root, or with "
            f"kernel.yama.ptrace_scope=0): {said.strip()[-500:]}"
        )
