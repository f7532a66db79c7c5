"""``python -m bench.cachegrind``: a locked call's cost in instructions and cache misses.

On a shared VM, timing the library's own Python is too noisy to tell a 1 µs change from none,
and a worker pays for it several times what a tight loop shows (docs/benchmarks.md). Valgrind's
cachegrind counts instead of timing: it runs ``N`` calls of a no-op task's ``__call__`` exactly
as ``python -m bench.profile --stub-store`` makes them (a request pushed, every lock store
command answered at once) and reports, per call, the instructions executed and the misses of a
simulated cache: first-level instruction and data caches, and a last-level cache of
``--ll-kib``. That is the pool process's cost (``--stage pool``, the default); two more
stages count what the lock adds elsewhere, each for a LockedTask and a plain task alike:

- ``--stage main``: a message's handling in a prefork worker's main process, from the message
  the transport hands the consumer to the request's success: Celery's strategy for the task
  and the request class it generates (for a LockedTask, from ``LockedRequest``), the request
  handed to a pool that pickles the job as billiard's does and hands back its acceptance and
  success at once, and the message's ack, whose sending is stubbed (no broker, no pool
  process; no ETA, expiry or rate limit);
- ``--stage publish``: a call's ``apply_async`` through Celery and kombu's producer to the
  transport, whose ``basic_publish`` sends nothing (a plain task's from an app celery-lock is
  not installed in: ``install`` wraps the app's ``send_task``, which every task then pays).

Two settings:

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

The main stage makes the longer run's messages in both runs, before the counted ones, so that
making them costs both alike and cancels too.

::

    python -m bench.cachegrind
    python -m bench.cachegrind --calls 300 --kinds locked
    python -m bench.cachegrind --stage main --calls 300 --settings hot
    python -m bench.cachegrind --stage publish --calls 300 --settings hot
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from shutil import which
from time import monotonic
from types import SimpleNamespace
from typing import Any
from unittest import mock

from billiard.pool import TASK, ApplyResult
from celery import Celery, Task
from celery.concurrency.base import BasePool
from celery.worker import state as worker_state
from celery.worker.worker import WorkController
from kombu.asynchronous.semaphore import LaxBoundedSemaphore
from kombu.asynchronous.timer import Timer
from kombu.transport import memory

from celery_lock.heartbeat import Heartbeat
from celery_lock.request import CONTENT_TYPE_FIELD
from celery_lock.runtime import get_runtime
from celery_lock.store import LockStore

from .profile import answered_at_once, no_op_tasks, timed_calls

STAGES = ("pool", "main", "publish")
KINDS = ("plain", "locked")
SETTINGS = ("hot", "cold")
#: What a stage's figures are per, and what its runs stub or leave out, for the table's heading.
HEADINGS = {
    "pool": ("call", "lock store stubbed"),
    "main": ("message", "the worker's main process; broker and pool processes stubbed"),
    "publish": ("call", "apply_async; the transport's send stubbed"),
}
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


def _run_calls(stage: str, kind: str, count: int, most: int, thrash_bytes: int) -> None:
    """In the process cachegrind watches: ``count`` calls of the ``kind`` task at ``stage``
    (``most``: the most calls of the figure's runs, what the main process prepares messages
    for in each of them, so that both prepare alike)."""
    buffer = bytearray(thrash_bytes)
    line = b"\x01" * len(buffer[::64])
    stages = {"pool": _pool_calls, "main": _main_process_calls, "publish": _publish_calls}
    with stages[stage](kind, most) as (calls, subject, warm_up):
        if subject is not None:
            calls(subject, warm_up, 10**9)
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
            if subject is not None:
                calls(subject, 1, number)


#: What a stage yields: its calls, made as ``calls(subject, how_many, first_number)`` (as
#: :func:`bench.profile.timed_calls` is, with no frame of ours between), what they are made
#: on, ``None`` for a run that calls nothing (:data:`BUFFER_ALONE`), and how many to make
#: first, unmeasured.
StageCalls = Iterator[tuple[Callable[[Any, int, int], object], Any, int]]


@contextmanager
def _pool_calls(kind: str, most: int) -> StageCalls:
    """The task's call in a pool process, as Celery's tracer makes it, the lock store's every
    command answered at once."""
    app, locked, plain = no_op_tasks(UNUSED_URL, UNUSED_URL)
    # Nothing that depends on the clock may run: the two runs of a figure take different
    # times, and on a loaded machine very different ones. The heartbeat would beat (every
    # 20 s by default) a different number of times in each.
    app.conf.celery_lock_ttl = UNBEATEN_TTL
    # Nor while no lease is held, between calls: an idle heartbeat waits 20 s by default.
    get_runtime(app).heartbeat = Heartbeat(default_interval=UNBEATEN_TTL)
    task = {"locked": locked, "plain": plain}.get(kind)
    with mock.patch.object(LockStore, "_send", answered_at_once):
        yield timed_calls, task, WARMUP


#: What Celery's ``fast_trace_task`` hands the main process for a no-op's success: not failed,
#: the result's repr, the runtime.
SUCCEEDED = (0, "None", 0.0)
#: The task id of the message the main process's messages are copied from, each with its own id
#: in its place (ids of a UUID's length, as a client's are).
TEMPLATE_ID = str(uuid.UUID(int=0))


class _Pool(BasePool):
    """A prefork pool's main-process side without its processes: a job made into billiard's
    ``ApplyResult`` and pickled as ``AsynPool`` pickles it for a process's pipe (``send_job``);
    the pipe's write and the process left out. The last job is kept, for its acceptance and
    result to be handed back as billiard's result handler hands them."""

    def __init__(self) -> None:
        super().__init__(limit=1, putlocks=False)  # as a prefork worker with its event loop
        self.jobs: dict[int, Any] = {}
        self.last: Any = None

    def on_apply(
        self, target: Any, args: Any, kwargs: Any, waitforslot: Any = None, **options: Any
    ) -> Any:
        job: Any = ApplyResult(self.jobs, **options)
        body = pickle.dumps((TASK, (job._job, None, target, args, kwargs)), pickle.HIGHEST_PROTOCOL)
        job._payload = memoryview(struct.pack(">I", len(body))), memoryview(body), len(body)
        self.last = job
        return job


class _Worker:
    """What ``WorkController`` hands a request to the pool with, in a prefork worker: its own
    methods, behind the semaphore of pool processes free."""

    # (Not in celery-types.)
    _process_task = vars(WorkController)["_process_task"]
    _process_task_sem = vars(WorkController)["_process_task_sem"]

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.semaphore = LaxBoundedSemaphore(1)
        self._quick_acquire = self.semaphore.acquire
        self._quick_release = self.semaphore.release


def _not_sent(channel: Any, *args: Any, **kwargs: Any) -> None:
    """The transport's part, stubbed: nothing is sent to a broker."""


@dataclass
class _MainProcess:
    """A main-process run's strategy, pool, its release of a pool process, and messages."""

    handle: Callable[..., Any]
    pool: _Pool
    release: Callable[[], None]
    messages: Iterator[Any]
    #: The consumer's ``on_task_message``.
    callbacks: set[Any] = field(default_factory=set)


def _handled(main: _MainProcess, how_many: int, first: int) -> None:
    """The next ``how_many`` messages handled as a worker's main process handles them, the
    pool's acceptance and result handed back as billiard's result handler hands them
    (``first``: unused, the messages were numbered as they were made)."""
    handle, pool, release, callbacks, pid = (
        main.handle, main.pool, main.release, main.callbacks, os.getpid()
    )  # fmt: skip
    for message in itertools.islice(main.messages, how_many):
        handle(message, None, message.ack_log_error, message.reject_log_error, callbacks)
        job = pool.last
        job._ack(None, monotonic(), pid, None)
        job._set(None, (True, SUCCEEDED))
        release()  # the pool process is free again


@contextmanager
def _main_process_calls(kind: str, most: int) -> StageCalls:
    """A message's handling in a prefork worker's main process: Celery's strategy for the task
    (:func:`celery.worker.strategy.default`, with the request class it generates: a
    LockedTask's derives from ``LockedRequest``) given a message as the transport hands it to
    the consumer, the request handed to the pool (:class:`_Pool`), then its acceptance and
    success handed back, the message acked as the task acks it. Left out: the transport
    (fetching the message, sending the ack: ``basic_ack`` is stubbed), the consumer's ack
    promises and event loop, the pool's pipes and processes; no ETA, expiry or rate limit."""
    app, locked, plain = no_op_tasks("memory://", UNUSED_URL)
    task = {"locked": locked, "plain": plain}.get(kind)
    if task is None:
        yield _handled, None, 0
        return
    # As setup_worker_optimizations sets it in a worker (not in celery-types).
    app.use_fast_trace_task = True  # type: ignore[attr-defined]
    connection = app.connection_for_read()
    pool = _Pool()
    pool.start()
    worker = _Worker(pool)
    consumer = SimpleNamespace(  # what the strategy reads of the worker's consumer
        hostname="celery@bench",
        connection_errors=connection.connection_errors,
        event_dispatcher=app.events.Dispatcher(connection, "celery@bench", enabled=False),
        timer=Timer(),
        apply_eta_task=None,  # no ETA
        disable_rate_limits=app.conf.worker_disable_rate_limits,
        task_buckets=defaultdict(lambda: None),  # no rate limit, as the consumer's
        on_task_request=worker._process_task_sem,
        _limit_task=None,
        _limit_post_eta=None,
        pool=pool,
        controller=SimpleNamespace(state=worker_state),
    )
    handle = task.start_strategy(app, consumer)
    # Celery keeps the last 1,000 successful ids (a LimitedSet, trimmed once full): full before
    # the measured messages, so that each of them costs what it costs in a worker that ran for
    # a while, not a mix of both.
    warm_up = worker_state.successful_requests.maxlen + WARMUP
    messages = iter(_messages(task, connection, warm_up + most))
    main = _MainProcess(handle, pool, worker.semaphore.release, messages)
    with mock.patch.object(memory.Channel, "basic_ack", _not_sent):
        yield _handled, main, warm_up
    # The last message went the way a worker's does (so a Celery that handles messages
    # otherwise fails here, rather than be counted doing something else).
    request = pool.last._callback.__self__
    fields = pickle.loads(pool.last._payload[1])[1][3][2]  # the request dict the pool gets
    if not request.message.acknowledged or (kind == "locked") != (CONTENT_TYPE_FIELD in fields):
        raise RuntimeError(f"the {kind} message was not handled as a worker handles it")


def _messages(task: Task[Any, Any], connection: Any, count: int) -> list[Any]:
    """``count`` messages of ``task`` as the transport hands them to the consumer, each with a
    task id of its own: one published, the others copied from it (each made as the Redis
    transport makes them, from JSON: cheaper than publishing each, and made before the
    measured messages, in every run alike)."""
    task.apply_async((0,), task_id=TEMPLATE_ID)
    channel = connection.default_channel
    raw = channel.basic_get(task.app.conf.task_default_queue, no_ack=True)._raw
    raw["headers"]["origin"] = "bench@host"  # the publisher's name has its pid in it
    template = json.dumps(raw)
    return [
        channel.message_to_python(json.loads(template.replace(TEMPLATE_ID, str(uuid.UUID(int=n)))))
        for n in range(1, count + 1)
    ]


@contextmanager
def _publish_calls(kind: str, most: int) -> StageCalls:
    """A call's publishing, ``task.apply_async((n,))``, through Celery and kombu's producer to
    the transport, which sends nothing (``memory://``'s ``basic_publish`` stubbed). A plain
    task is one of an app celery-lock is not installed in: ``install`` wraps ``send_task``,
    which every task of its app then publishes through."""
    task: Task[Any, Any] | None = None
    if kind == "locked":
        task = no_op_tasks("memory://", UNUSED_URL)[1]
    elif kind == "plain":
        task = _plain_task()
    with mock.patch.object(memory.Channel, "basic_publish", _not_sent):
        yield _published, task, WARMUP
    if task is None:
        return
    sent: list[Any] = []  # one more, seen through: it reaches the transport
    with mock.patch.object(memory.Channel, "basic_publish", lambda _, m, *a, **k: sent.append(m)):
        task.apply_async((0,))
    if [message["headers"]["task"] for message in sent] != [task.name]:
        raise RuntimeError(f"the {kind} call did not reach the transport: {sent}")


def _published(task: Task[Any, Any], how_many: int, first: int) -> None:
    """``how_many`` calls published, numbered from ``first`` (the key of a LockedTask's)."""
    for number in range(first, first + how_many):
        task.apply_async((number,))


def _plain_task() -> Task[Any, Any]:
    """A plain no-op task of an app without celery-lock, results ignored (as
    :func:`bench.profile.no_op_tasks`'s)."""
    app = Celery("bench-profile", broker="memory://", set_as_current=False)
    app.conf.task_ignore_result = True

    @app.task(name="profile.plain", shared=False)
    def plain(request_idx: int) -> None:
        """No-op."""

    app.finalize()
    return app.tasks[plain.name]


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
    stage: str, kind: str, count: int, most: int, thrash_bytes: int, ll_bytes: int, tmp: Path
) -> dict[str, int]:
    out_file = tmp / f"{stage}-{kind}-{count}-{thrash_bytes}.out"
    command = [
        "valgrind", "--tool=cachegrind", "--cache-sim=yes", f"--LL={ll_bytes},16,64",
        f"--cachegrind-out-file={out_file}",
        *_child_command(stage, kind, count, most, thrash_bytes),
    ]  # fmt: skip
    env = padded_environment({**os.environ, "PYTHONHASHSEED": "0"}, command)
    _run_child(command, env, 1800)
    return output_totals(out_file)


def _child_command(stage: str, kind: str, count: int, most: int, thrash_bytes: int) -> list[str]:
    return [sys.executable, "-m", "bench.cachegrind", "--child", stage, kind, str(count), str(most),
            str(thrash_bytes)]  # fmt: skip


def _run_child(command: list[str], env: dict[str, str] | None, timeout: float) -> None:
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, env=env, timeout=timeout
    )
    if done.returncode != 0:  # the child's own error, not only its status
        raise RuntimeError(f"{' '.join(command[-6:])} failed:\n{done.stderr[-4000:]}")


def measure(
    calls: int,
    ll_kib: int,
    kinds: Sequence[str] = KINDS,
    settings: Sequence[str] = SETTINGS,
    stage: str = "pool",
) -> list[PerCall]:
    """Per-call counts at ``stage`` of every kind in every setting (two cachegrind runs each,
    two at a time)."""
    if which("valgrind") is None:
        raise ValgrindUnavailable("valgrind is not on PATH (Debian: apt install valgrind)")
    ll_bytes = ll_kib * 1024
    # Each kind's calls once, natively, first: a module a child imports that no process had
    # imported yet is compiled and its bytecode written then. Otherwise the two runs of a
    # figure, which start together, could find it compiled or not (or another process, a test
    # beside this one, could write it between them), and one of them count its compiling.
    # (And a stage that no longer runs as a worker runs it fails here, in seconds.)
    for kind in kinds:
        _run_child(_child_command(stage, kind, 1, 1, 0), None, 300)
    jobs = [(kind, setting) for setting in settings for kind in kinds]
    if "cold" in settings:
        jobs.append((BUFFER_ALONE, "cold"))
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        runs = {
            (job, count): pool.submit(
                _cachegrind,
                stage,
                job[0],
                count,
                3 * calls,
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
    parser.add_argument(
        "--stage",
        choices=STAGES,
        default="pool",
        help="pool: the task's call in a pool process; main: a message's handling in the worker's "
        "main process; publish: the call's apply_async",
    )
    parser.add_argument("--calls", type=int, default=1000, help="N: runs of N and 3N calls")
    parser.add_argument("--ll-kib", type=int, default=2048, help="simulated last-level cache")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        stage, kind, count, most, thrash_bytes = args.child
        _run_calls(stage, kind, int(count), int(most), int(thrash_bytes))
        return 0
    try:
        results = measure(args.calls, args.ll_kib, args.kinds, args.settings, args.stage)
    except ValgrindUnavailable as exc:
        print(f"python -m bench.cachegrind: {exc}", file=sys.stderr)
        return 2
    unit, what = HEADINGS[args.stage]
    print(
        f"per {unit}, from runs of {args.calls} and {3 * args.calls} {unit}s under cachegrind "
        f"(last-level cache {args.ll_kib} KiB; {what}):"
    )
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
