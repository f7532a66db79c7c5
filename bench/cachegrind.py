"""``python -m bench.cachegrind``: a locked call's cost in instructions and cache misses.

On a shared VM, timing the library's own Python is too noisy to tell a 1 µs change from none,
and a worker pays for it several times what a tight loop shows (docs/benchmarks.md). Valgrind's
cachegrind counts instead of timing: it runs ``N`` calls of a no-op task's ``__call__`` exactly
as ``python -m bench.profile --stub-store`` makes them (a request pushed, every lock store
command answered at once) and reports, per call, the instructions executed and the misses of a
simulated cache: first-level instruction and data caches, and a last-level cache of
``--ll-kib``. Two settings:

- **hot**: the calls back to back, as in a tight loop;
- **cold**: a buffer twice the last-level cache written between calls, as a pool process's
  caches are when its next task arrives after the main process and ``redis-server`` ran (the
  buffer's own counts, from a run that writes it and calls nothing, are taken off).

Each figure is the difference between two runs of different length (``N`` and ``3N`` calls),
so start-up and warm-up cancel; ``PYTHONHASHSEED`` is fixed so both runs do the same work, the
cyclic garbage collector is off during the calls (one collection more or less moved a figure
by up to 1.5 million instructions over the calls between: where collections fall depends on
when the heartbeat's thread first ran), nothing on that thread waits by the clock, and
the environment is padded to one size (:func:`padded_environment`), which would otherwise move
a call's count by up to 1,600 instructions. The counts then agree within a few hundred
instructions from run to run on one machine and interpreter, and between two trees
(``PYTHONPATH``), so a change of a thousand instructions or more shows. Needs ``valgrind`` on
PATH.

::

    python -m bench.cachegrind
    python -m bench.cachegrind --calls 300 --kinds locked
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from shutil import which
from unittest import mock

from celery_lock.heartbeat import Heartbeat
from celery_lock.runtime import get_runtime
from celery_lock.store import LockStore

from .profile import answered_at_once, no_op_tasks, timed_calls

KINDS = ("plain", "locked")
SETTINGS = ("hot", "cold")
#: What is reported per call, as cachegrind names its events.
EVENTS = {"Ir": "instructions", "I1mr": "I1 misses", "D1mr": "D1 read misses",
          "D1mw": "D1 write misses", "ILmr": "LL instruction misses", "DLmr": "LL data misses",
          "DLmw": "LL write misses"}  # fmt: skip
#: Nothing listens there: the lock store is stubbed and nothing is published.
UNUSED_URL = "redis://127.0.0.1:1/0"
#: A cold run that calls nothing: what writing the buffer alone costs.
BUFFER_ALONE = "buffer"
WARMUP = 200
#: The lease TTL the measured calls are made with: its heartbeat interval outlasts any run.
UNBEATEN_TTL = 12 * 3600.0
#: What a measured process's environment and arguments are padded to, in bytes, and the
#: variable that pads them (:func:`padded_environment`).
STARTUP_BYTES = 65_536
PAD_VARIABLE = "BENCH_PAD"


class ValgrindUnavailable(RuntimeError):
    """``valgrind`` is not on PATH."""


@dataclass(frozen=True)
class PerCall:
    """Cachegrind's counts per call of one kind of task in one setting."""

    kind: str
    setting: str
    counts: dict[str, float]


def _run_calls(kind: str, count: int, thrash_bytes: int) -> None:
    """In the process cachegrind watches: ``count`` calls of the ``kind`` task."""
    app, locked, plain = no_op_tasks(UNUSED_URL, UNUSED_URL)
    # Nothing that depends on the clock may run: the two runs of a figure take different
    # times, and on a loaded machine very different ones. The heartbeat would beat (every
    # 20 s by default) a different number of times in each.
    app.conf.celery_lock_ttl = UNBEATEN_TTL
    # Nor while no lease is held, between calls: an idle heartbeat waits 20 s by default.
    get_runtime(app).heartbeat = Heartbeat(default_interval=UNBEATEN_TTL)
    task = {"locked": locked, "plain": plain}.get(kind)
    buffer = bytearray(thrash_bytes)
    line = b"\x01" * len(buffer[::64])
    with mock.patch.object(LockStore, "_send", answered_at_once):
        if task is not None:
            timed_calls(task, WARMUP, 10**9)
        # No cyclic collection among the measured calls: where one falls depends on when the
        # heartbeat's thread allocated during the warm-up, which the clock decides, and one of
        # the heap Celery builds costs 0.5 to 1.5 million instructions, several calls' worth.
        # (Refcounting frees what a call allocates; the memory section of python -m bench
        # checks that nothing piles up.)
        gc.collect()
        gc.disable()
        for number in range(count):
            if thrash_bytes:
                buffer[::64] = line  # one write per cache line: evicts the task's lines
            if task is not None:
                timed_calls(task, 1, number)


def padded_environment(env: dict[str, str], command: Sequence[str]) -> dict[str, str]:
    """``env`` with :data:`PAD_VARIABLE` added, so that the environment and the arguments the
    process starts with take :data:`STARTUP_BYTES` in all.

    Linux copies both onto the new process's stack, so their size moves where the stack begins,
    and with it the alignment of everything the interpreter keeps there: one variable of three
    bytes more moved a locked call's count by 700 instructions, a ``PYTHONPATH`` by 1,600 (of
    253,000). Padded to one size, two trees (``PYTHONPATH``) and two shells compare alike.
    """
    used = sum(len(arg.encode()) + 1 for arg in command)
    used += sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items() if k != PAD_VARIABLE)
    room = STARTUP_BYTES - used - len(PAD_VARIABLE) - 2
    if room < 0:
        raise RuntimeError(f"the environment takes over {STARTUP_BYTES} bytes: unset something")
    return {**env, PAD_VARIABLE: "x" * room}


def output_totals(out_file: Path) -> dict[str, int]:
    """The totals of a cachegrind output file, by event."""
    events: list[str] = []
    for text in out_file.read_text().splitlines():
        if text.startswith("events:"):
            events = text.split()[1:]
        elif text.startswith("summary:"):
            return dict(zip(events, map(int, text.split()[1:]), strict=True))
    raise RuntimeError(f"no summary in {out_file}")


def _cachegrind(
    kind: str, count: int, thrash_bytes: int, ll_bytes: int, tmp: Path
) -> dict[str, int]:
    out_file = tmp / f"{kind}-{count}-{thrash_bytes}.out"
    command = [
        "valgrind", "--tool=cachegrind", "--cache-sim=yes", f"--LL={ll_bytes},16,64",
        f"--cachegrind-out-file={out_file}", sys.executable, "-m", "bench.cachegrind",
        "--child", kind, str(count), str(thrash_bytes),
    ]  # fmt: skip
    env = padded_environment({**os.environ, "PYTHONHASHSEED": "0"}, command)
    subprocess.run(command, check=True, capture_output=True, env=env, timeout=1800)
    return output_totals(out_file)


def measure(
    calls: int, ll_kib: int, kinds: Sequence[str] = KINDS, settings: Sequence[str] = SETTINGS
) -> list[PerCall]:
    """Per-call counts of every kind in every setting (two cachegrind runs each, two at a
    time)."""
    if which("valgrind") is None:
        raise ValgrindUnavailable("valgrind is not on PATH (Debian: apt install valgrind)")
    ll_bytes = ll_kib * 1024
    # Each kind's calls once, natively, first: a module a child imports that no process had
    # imported yet is compiled and its bytecode written then. Otherwise the two runs of a
    # figure, which start together, could find it compiled or not (or another process, a test
    # beside this one, could write it between them), and one of them count its compiling.
    for kind in kinds:
        subprocess.run(
            [sys.executable, "-m", "bench.cachegrind", "--child", kind, "1", "0"],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
    jobs = [(kind, setting) for setting in settings for kind in kinds]
    if "cold" in settings:
        jobs.append((BUFFER_ALONE, "cold"))
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        runs = {
            (job, count): pool.submit(
                _cachegrind,
                job[0],
                count,
                2 * ll_bytes if job[1] == "cold" else 0,
                ll_bytes,
                Path(tmp),
            )
            for job in jobs
            for count in (calls, 3 * calls)
        }
        counts = {
            job: _difference(runs[job, calls].result(), runs[job, 3 * calls].result(), 2 * calls)
            for job in jobs
        }
    buffer = counts.pop((BUFFER_ALONE, "cold"), None)
    return [
        PerCall(kind, setting, _less(found, buffer if setting == "cold" else None))
        for (kind, setting), found in counts.items()
    ]


def _difference(short: dict[str, int], long: dict[str, int], calls: int) -> dict[str, float]:
    """Per call: what the longer run counted beyond the shorter one, over the calls between."""
    return {e: (long[e] - short[e]) / calls for e in EVENTS if e in short}


def _less(counts: dict[str, float], baseline: dict[str, float] | None) -> dict[str, float]:
    return counts if baseline is None else {e: n - baseline[e] for e, n in counts.items()}


def render(results: Sequence[PerCall]) -> str:
    """A Markdown table, with LockedTask's difference from a plain task per setting."""
    events = [e for e in EVENTS if all(e in r.counts for r in results)]
    lines = [
        "| setting | task | " + " | ".join(EVENTS[e] for e in events) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in events) + " |",
    ]
    for setting in SETTINGS:
        rows = {r.kind: r for r in results if r.setting == setting}
        for kind, row in rows.items():
            cells = " | ".join(f"{round(row.counts[e]):,}" for e in events)
            lines.append(f"| {setting} | {kind} | {cells} |")
        if set(KINDS) <= set(rows):
            cells = " | ".join(
                f"{round(rows['locked'].counts[e] - rows['plain'].counts[e]):+,}" for e in events
            )
            lines.append(f"| {setting} | LockedTask - plain | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, measure, print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.cachegrind", description=__doc__)
    parser.add_argument("--calls", type=int, default=1000, help="N: runs of N and 3N calls")
    parser.add_argument("--ll-kib", type=int, default=2048, help="simulated last-level cache")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, count, thrash_bytes = args.child
        _run_calls(kind, int(count), int(thrash_bytes))
        return 0
    try:
        results = measure(args.calls, args.ll_kib, args.kinds, args.settings)
    except ValgrindUnavailable as exc:
        print(f"python -m bench.cachegrind: {exc}", file=sys.stderr)
        return 2
    print(
        f"per call, from runs of {args.calls} and {3 * args.calls} calls under cachegrind "
        f"(last-level cache {args.ll_kib} KiB; lock store stubbed):"
    )
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
