"""``python -m bench.servercost``: what a lock cycle costs ``redis-server``, counted.

The lock cycle's server time (``INFO commandstats``, in :mod:`bench.lockcycle`) moves by more
between two runs on a shared VM than a script change of one Redis call is worth (about a
microsecond). Valgrind's cachegrind counts instead: ``redis-server`` runs under it while this
process sends it the lock cycles of :mod:`bench.lockcycle` (the floor, the scripted floor,
celery-lock's scripts, the leanest scripts for the same steps), one command per round trip as
the bench sends them, and the instructions the server executed are read from its totals. Each
figure is the difference between two servers that took ``N`` and ``3N`` cycles, so start-up,
script loading and the first connection cancel. The server runs with ``hz 1``, so that its
timer (expiry sampling, statistics) adds little to a run that valgrind slows down; what is
counted is the server's own code in user space, not the kernel's socket work (the same two
reads and two writes per cycle for every contender). Needs ``valgrind`` on PATH.

::

    python -m bench.servercost
    python -m bench.servercost --cycles 300 --redis-server /usr/bin/redis-server
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from shutil import which

from celery_lock.store import LockStore
from celery_lock.testing import RedisServer, find_redis_server

from .cachegrind import ValgrindUnavailable, output_totals
from .lockcycle import FLOOR, SERVER_SIDE
from .machine import redis_server_version
from .progress import note

MEASURED = tuple(SERVER_SIDE)
#: Seconds a server under valgrind may take to answer, and to exit once asked.
START_TIMEOUT = 120.0
EXIT_TIMEOUT = 120.0


@dataclass(frozen=True)
class ServerCost:
    """Instructions ``redis-server`` executed per lock cycle of one contender."""

    contender: str
    instructions: float


def counted_run(contender: str, cycles: int, executable: str, tmp: Path) -> int:
    """Instructions one ``redis-server`` executed in all, having taken ``cycles`` cycles."""
    # Named by position: the scripted contenders' setups share one function name.
    out_file = tmp / f"{MEASURED.index(contender)}-{cycles}.out"
    valgrind = ["valgrind", "--tool=cachegrind", "--cache-sim=no",
                f"--cachegrind-out-file={out_file}"]  # fmt: skip
    server = RedisServer(extra_args=["--hz", "1"], executable=executable, launcher=valgrind)
    server.start(timeout=START_TIMEOUT)
    try:
        store = LockStore.from_url(server.url)
        with ExitStack() as stack:
            stack.callback(store.client.close)
            cycle = SERVER_SIDE[contender](store, stack)
            cycle(-1)  # in both runs alike: the scripts loaded, the connection made
            for n in range(cycles):
                cycle(n)
    finally:
        server.stop(timeout=EXIT_TIMEOUT)  # SIGTERM: valgrind writes its counts as it exits
    return output_totals(out_file)["Ir"]


def measure(cycles: int, executable: str, contenders: Sequence[str] = MEASURED) -> list[ServerCost]:
    """Per-cycle server instructions of each contender: runs of ``cycles`` and ``3 * cycles``."""
    if which("valgrind") is None:
        raise ValgrindUnavailable("valgrind is not on PATH (Debian: apt install valgrind)")
    found = []
    with tempfile.TemporaryDirectory(prefix="celery-lock-servercost-") as tmp:
        for contender in contenders:
            note(f"servercost: {contender}")
            short = counted_run(contender, cycles, executable, Path(tmp))
            long = counted_run(contender, 3 * cycles, executable, Path(tmp))
            found.append(ServerCost(contender, (long - short) / (2 * cycles)))
    return found


def render(costs: Sequence[ServerCost]) -> str:
    """A Markdown table: instructions per cycle, and beyond the floor's."""
    floor = next((c.instructions for c in costs if c.contender == FLOOR), None)
    lines = [
        "| lock cycle | server instructions per cycle | beyond the floor | / the floor |",
        "| --- | ---: | ---: | ---: |",
    ]
    for cost in costs:
        beyond = f"{cost.instructions - floor:+,.0f}" if floor else "-"
        ratio = f"{cost.instructions / floor:.2f}" if floor else "-"
        lines.append(f"| {cost.contender} | {cost.instructions:,.0f} | {beyond} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, count, print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.servercost", description=__doc__)
    parser.add_argument("--cycles", type=int, default=1000, help="N: servers of N and 3N cycles")
    parser.add_argument("--contenders", nargs="+", choices=MEASURED, default=list(MEASURED))
    parser.add_argument("--redis-server", help="the binary to count (default: as the bench's)")
    args = parser.parse_args(argv)
    executable = args.redis_server or find_redis_server()
    try:
        costs = measure(args.cycles, executable, args.contenders)
    except ValgrindUnavailable as exc:
        print(f"python -m bench.servercost: {exc}", file=sys.stderr)
        return 2
    print(
        f"redis-server's own instructions per lock cycle, from servers of {args.cycles} and "
        f"{3 * args.cycles} cycles under cachegrind (Redis {redis_server_version(executable)}):"
    )
    print(render(costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
