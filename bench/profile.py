"""``python -m bench.profile``: where a locked task's time goes.

Two ways in:

- in-process (default): ``N`` calls of a no-op LockedTask's ``__call__`` exactly as the worker makes
  them (a request pushed, the real lock store), timed beside a plain task's, then once more
  under cProfile; prints microseconds per call and the functions that cost the most;
- ``--stub-store``: the same, with every lock store command answered at once (as granted and
  released) instead of sent: what is left is the library's own Python per call;
- ``--worker KIND``: a real solo-pool worker run under cProfile while it drains ``N`` messages
  of ``plain``, ``floor`` (two round trips, nothing else), ``locked`` or ``storm`` (ten copies
  per request id); prints the worker's profile, so Celery's own handling of each outcome
  (``Ignore`` for a skipped copy) is seen too;
- ``--worker KIND --sampler py-spy``: a real prefork worker (``--processes``) sampled by py-spy
  while it drains, unchanged by the profiler: microseconds per task in the main process, in the
  pool processes, inside celery-lock (round trips included) and in its own Python
  (:mod:`bench.sampling`; py-spy needs ptrace: root, or ``kernel.yama.ptrace_scope=0``).

::

    python -m bench.profile --calls 5000
    python -m bench.profile --stub-store --calls 20000
    python -m bench.profile --worker storm --calls 5000
    python -m bench.profile --worker locked --sampler py-spy --processes 2 --calls 6000
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import signal
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

from celery import Celery, Task
from celery.app.trace import task_has_custom

from celery_lock import LockedTask
from celery_lock.runtime import reset_runtime
from celery_lock.store import LockStore
from celery_lock.testing import RedisServer

from .sampling import SamplerUnavailable, sampling, summarize
from .stats import rounds as stats_rounds
from .workers import LOCK_DB, BenchError, bench_app, publish, running_worker

#: What the printed profile keeps by default: the library, Celery's tracer, redis-py's command
#: path (``--focus .`` keeps everything).
FOCUS = r"celery_lock|trace\.py|einfo|redis/client\.py|redis/connection\.py|tenacity|keys\.py"


def timed_calls(task: Task[Any, Any], count: int, first: int) -> float:
    """Microseconds per call with a worker-like request on the stack, called as Celery's
    tracer calls it: ``__call__`` where the task overrides it (``LockedTask``), else ``run``
    (a plain task: the tracer skips ``Task.__call__``, and its request push, for it)."""
    call = task if task_has_custom(task, "__call__") else task.run
    began = time.perf_counter()
    for n in range(first, first + count):
        task.push_request(
            id=f"bench-{n}",
            hostname="bench@host",
            called_directly=False,
            is_eager=False,
            args=(n,),
            kwargs={},
            delivery_info={},
        )
        try:
            call(n)
        finally:
            task.pop_request()
    return (time.perf_counter() - began) / count * 1e6


def in_process(
    server: RedisServer,
    calls: int,
    rounds: int,
    top: int,
    focus: str = FOCUS,
    stub_store: bool = False,
) -> dict[str, Any]:
    """Time and profile ``LockedTask.__call__`` beside a plain task's, in this process."""
    stub = mock.patch.object(LockStore, "_send", answered_at_once)
    with stub if stub_store else nullcontext():
        return _profile_calls(server, calls, rounds, top, focus)


def answered_at_once(store: LockStore, command: tuple[Any, ...]) -> int:
    """Every command "succeeds" at once: 1 is a grant with fence 1, and a release of a lease
    still owned; so only the library's own work is timed (a plain function, not a mock, whose
    own calls would be timed too)."""
    return 1


def no_op_tasks(broker_url: str, lock_url: str) -> tuple[Celery, Task[Any, Any], Task[Any, Any]]:
    """An app with two no-op tasks, a LockedTask and a plain one, results ignored."""
    app = Celery("bench-profile", broker=broker_url, set_as_current=False)
    app.conf.celery_lock_redis_url = lock_url
    app.conf.task_ignore_result = True

    @app.task(base=LockedTask, lock_key="request_idx", name="profile.locked", shared=False)
    def locked(request_idx: int) -> None:
        """No-op."""

    @app.task(name="profile.plain", shared=False)
    def plain(request_idx: int) -> None:
        """No-op."""

    app.finalize()
    # The registry's task objects, as a worker calls them: the decorator returned proxies,
    # whose every attribute read and call would be measured with the task's.
    return app, app.tasks[locked.name], app.tasks[plain.name]


def _profile_calls(
    server: RedisServer, calls: int, rounds: int, top: int, focus: str
) -> dict[str, Any]:
    app, locked, plain = no_op_tasks(server.url_for(0), server.url_for(LOCK_DB))
    timed_calls(locked, 200, 10**9)  # connection, scripts
    timed_calls(plain, 200, 10**9)
    tasks = {"locked": locked, "plain": plain}
    samples: dict[str, list[float]] = {name: [] for name in tasks}
    first = 0
    # Each first in half the rounds (bench.stats.rounds), as every pair the bench sets side by
    # side: a drift across a round must not count against one of them only.
    for _, order in stats_rounds(list(tasks), rounds):
        for name in order:
            samples[name].append(timed_calls(tasks[name], calls, first))
        first += calls
    profiler = cProfile.Profile()
    profiler.enable()
    timed_calls(locked, calls, first + calls)
    profiler.disable()
    reset_runtime(app)
    server.flush(LOCK_DB)
    return {
        "us_per_call": {k: statistics.median(v) for k, v in samples.items()},
        "samples": samples,
        "profile": _top(profiler, top, focus),
    }


def _messages(module: Any, kind: str, calls: int) -> tuple[Any, list[int]]:
    """The task of ``kind`` and the request ids of ``calls`` messages (ten per id for storm)."""
    task = {
        "plain": module.plain,
        "floor": module.floor,
        "locked": module.locked,
        "storm": module.storm,
    }[kind]
    return task, [n % max(1, calls // 10) if kind == "storm" else n for n in range(calls)]


def in_worker(
    server: RedisServer, kind: str, calls: int, top: int, focus: str = FOCUS
) -> dict[str, Any]:
    """Run a solo worker under cProfile while it drains ``calls`` messages of ``kind``."""
    module = bench_app(server)
    task, ids = _messages(module, kind, calls)
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        out = Path(tmp, "worker.pstats")
        with running_worker(server, module.app, 1, pool="solo", profile_to=out) as worker:
            queue = f"bench.profile.{kind}"
            publish(task, ids, queue)
            drained = worker.drain(queue, 60 + calls / 20)
        stats = pstats.Stats(str(out))
    server.flush(LOCK_DB)
    return {"kind": kind, "drain_s": drained.seconds, "profile": _top(stats, top, focus)}


def sampled_worker(server: RedisServer, kind: str, calls: int, processes: int) -> dict[str, Any]:
    """Sample a prefork worker with py-spy while it drains ``calls`` messages of ``kind``."""
    module = bench_app(server)
    task, ids = _messages(module, kind, calls)
    with tempfile.TemporaryDirectory(prefix="bench-py-spy-") as tmp:
        out = Path(tmp, "stacks.txt")
        with running_worker(server, module.app, processes) as worker:
            warm = f"bench.profile.warm.{kind}"
            publish(task, range(10**7, 10**7 + 200), warm)  # connections, scripts, imports
            worker.drain(warm, 60)
            queue = f"bench.profile.{kind}"
            publish(task, ids, queue)
            if worker.process.pid is None:
                raise BenchError("the worker has no pid to sample")
            with sampling(worker.process.pid, out):
                time.sleep(1.0)  # py-spy attaches; the idle worker adds no samples meanwhile
                drained = worker.drain(queue, 60 + calls / 20)
        summary = summarize(out.read_text(), calls)
    server.flush(LOCK_DB)
    return {"kind": kind, "processes": processes, "drain_s": drained.seconds, "summary": summary}


def _top(source: cProfile.Profile | pstats.Stats, top: int, focus: str) -> str:
    text = io.StringIO()
    stats = source if isinstance(source, pstats.Stats) else pstats.Stats(source)
    stats.stream = text  # type: ignore[attr-defined]
    stats.sort_stats("cumulative").print_stats(focus, top)
    return text.getvalue()


def _run(args: argparse.Namespace) -> dict[str, Any]:
    """The profile ``args`` ask for, on a redis-server of its own."""
    with RedisServer() as server:
        if args.worker and args.sampler == "py-spy":
            result = sampled_worker(server, args.worker, args.calls, args.processes)
        elif args.worker:
            result = in_worker(server, args.worker, args.calls, args.top, args.focus)
        else:
            result = in_process(
                server, args.calls, args.rounds, args.top, args.focus, args.stub_store
            )
    return result


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run one profile, print it (or its JSON)."""
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (in-process)")
    parser.add_argument("--top", type=int, default=30, help="functions to print")
    parser.add_argument("--worker", choices=("plain", "floor", "locked", "storm"))
    parser.add_argument(
        "--sampler",
        choices=("cprofile", "py-spy"),
        default="cprofile",
        help="with --worker: cProfile in a solo worker, or py-spy outside a prefork worker",
    )
    parser.add_argument(
        "--processes", type=int, default=1, help="pool processes (--sampler py-spy)"
    )
    parser.add_argument(
        "--stub-store",
        action="store_true",
        help="in-process: answer lock store commands at once (times the library's own Python)",
    )
    parser.add_argument(
        "--focus", default=FOCUS, help="regex of the files and functions to print ('.': all)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (for A/B scripts)")
    args = parser.parse_args(argv)
    # SIGTERM (a test's timeout) unwinds like Ctrl-C: the worker and the server are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        result = _run(args)
    except SamplerUnavailable as exc:
        print(f"python -m bench.profile: {exc}", file=sys.stderr)
        return 2
    _show(args, result)
    return 0


def _show(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Print ``result``: its JSON (without the profile text), or the profile for a reader."""
    if args.json:
        shown = {k: v for k, v in result.items() if k not in ("profile", "summary")}
        if "summary" in result:
            shown["summary"] = dataclasses.asdict(result["summary"])
        print(json.dumps(shown))
        return
    if "summary" in result:
        print(
            f"prefork worker ({result['processes']} processes) drained {args.calls} "
            f"{args.worker} messages in {result['drain_s']:.2f}s, sampled by py-spy"
        )
        print(result["summary"].render(args.top))
        return
    if "us_per_call" in result:
        per = result["us_per_call"]
        stubbed = ", lock store stubbed" if args.stub_store else ""
        print(
            f"LockedTask.__call__ {per['locked']:.1f} µs, plain Task {per['plain']:.1f} µs "
            f"(median of {args.rounds} rounds of {args.calls}{stubbed})"
        )
    else:
        print(
            f"solo worker drained {args.calls} {args.worker} messages in "
            f"{result['drain_s']:.2f}s (under cProfile)"
        )
    print(result["profile"])


if __name__ == "__main__":
    sys.exit(main())
