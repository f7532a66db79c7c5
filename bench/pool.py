"""``python -m bench.pool``: the ratios of several runs pooled, with their confidence.

One run's rounds spread widely on a shared VM (single rounds from 0.7 to 1.1 of a plain task),
so a goal such as "LockedTask keeps at least 0.95 of a plain task's throughput" is read better
from the rounds of several runs on one machine: every round's ratio, paired within its round as
every ratio in the bench is, then the median of them all and a 95% confidence interval of that
median. The interval is distribution-free (two order statistics, chosen from the binomial
distribution; nothing assumed about the noise), so it needs six rounds at least. Rounds of one
run are not independent of each other, though (a run sees one state of the machine), so where
the rounds come from two runs or more the interval is widened to take in a two-stage bootstrap
over them: runs drawn with replacement, then rounds within each. Set against a goal, the
interval says **met** (it lies above), **missed** (below) or **open** (it straddles the goal:
more rounds, or more runs, could tell).

Runs are pooled per machine and server (the CPU, its clock and the redis-server version the run
recorded): the end-to-end section per worker size, and the lock cycle (celery-lock's against the
floor's, the other goal of 0.95)::

    python -m bench.pool bench/results/*.json
    python -m bench.pool bench/results/*.json --metric end_to_end --goal 0.95
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from .endtoend import LOCKED, PLAIN
from .lockcycle import CELERY_LOCK, FLOOR, FLOOR_POOLED, SCRIPTED_FLOOR
from .machine import name as machine_name
from .report import table
from .stats import paired_ratios

#: The peers' contender names in the end-to-end section.
PEERS = ("celery-once", "celery-singleton")
METRICS = ("worker", "end_to_end", "worker_cpu", "end_to_end_cpu")
#: A ratio: the contender over the one it is set against.
Pair = tuple[str, str]
#: The ratios shown.
RATIOS: tuple[Pair, ...] = (
    (LOCKED, PLAIN),
    (FLOOR, PLAIN),
    (LOCKED, FLOOR),
    *((peer, PLAIN) for peer in PEERS),
    *((LOCKED, peer) for peer in PEERS),
)
#: The lock cycle's ratios: celery-lock's against the floor (the goal), the scripted floor and
#: the floor sent through redis-py's pool.
CYCLE_RATIOS: tuple[Pair, ...] = (
    (CELERY_LOCK, FLOOR),
    (CELERY_LOCK, SCRIPTED_FLOOR),
    (SCRIPTED_FLOOR, FLOOR),
    (CELERY_LOCK, FLOOR_POOLED),
)
#: Column labels.
SHORT = {
    PLAIN: "plain",
    FLOOR: "floor",
    LOCKED: "celery-lock",
    "celery-once": "once",
    "celery-singleton": "singleton",
    CELERY_LOCK: "celery-lock",
    SCRIPTED_FLOOR: "scripted floor",
    FLOOR_POOLED: "floor through redis-py's pool",
}
#: The metrics that include publishing, where celery-once and celery-singleton take their lock:
#: "ahead of the peers" is judged on these.
END_TO_END = ("end_to_end", "end_to_end_cpu")
#: What :func:`_target` is told for the lock cycle's ratios.
LOCK_CYCLE = "lockcycle"
CONFIDENCE = 0.95
#: Resamples of the bootstrap over runs; seeded, so that a table comes out the same every time.
RESAMPLES = 2000


@dataclass(frozen=True)
class Pooled:
    """The pooled rounds of one ratio, run by run: their median and the median's confidence
    interval."""

    #: Each run's rounds: the ratio of each.
    runs: tuple[tuple[float, ...], ...]

    @property
    def ratios(self) -> tuple[float, ...]:
        """Every round's ratio, of every run."""
        return tuple(ratio for run in self.runs for ratio in run)

    @property
    def median(self) -> float:
        """The median of every round's ratio."""
        return statistics.median(self.ratios)

    @cached_property  # read by both cell() and verdict(): computed once
    def interval(self) -> tuple[float, float] | None:
        """The median's 95% confidence interval; ``None`` below six rounds.

        The order statistics' interval, which takes the rounds as independent, widened where
        the rounds come from several runs to take in the bootstrap over runs as well.
        """
        rounds = median_interval(self.ratios)
        runs = [run for run in self.runs if run]
        if rounds is None or len(runs) < 2:
            return rounds
        low, high = runs_bootstrap_interval(runs)
        return min(rounds[0], low), max(rounds[1], high)

    def verdict(self, goal: float) -> str:
        """``met``, ``missed`` or ``open`` (the interval straddles ``goal``, or there is none)."""
        interval = self.interval
        if interval is None:
            return "open"
        low, high = interval
        if low >= goal:
            return "met"
        if high < goal:
            return "missed"
        return "open"

    def cell(self, goal: float | None = None) -> str:
        """``0.917 [0.89, 0.95]``, with the verdict against ``goal`` when there is one."""
        interval = self.interval
        text = f"{self.median:.3f}"
        text += f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else " [-]"
        return f"{text} {self.verdict(goal)}" if goal is not None else text


def median_interval(
    samples: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float] | None:
    """A distribution-free confidence interval of the median: ``(x[k], x[n-k+1])`` of the sorted
    samples, ``k`` the largest with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2.

    ``None`` when even the whole range is not enough (fewer than six samples at 95%).
    """
    ordered = sorted(samples)
    n = len(ordered)
    tail = (1 - confidence) / 2
    below, k = 0.0, 0
    while k < n:
        below += math.comb(n, k) / 2**n  # now P(X <= k)
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    return ordered[k - 1], ordered[n - k]


def runs_bootstrap_interval(
    runs: Sequence[Sequence[float]],
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
) -> tuple[float, float]:
    """A percentile interval of the median of rounds grouped in runs, by a two-stage bootstrap:
    draw as many runs as there are, with replacement, then as many rounds from each drawn run
    as it has, with replacement; the median of each such draw; its quantiles.

    Runs on one machine differ (one run's median 1.13, another's 0.96, on one VM), which an
    interval over the pooled rounds alone would not see. With few runs the interval is coarse,
    and still too narrow if the runs themselves share a state of the machine.
    """
    draw = random.Random(0)  # the same table from the same runs, every time
    medians = []
    for _ in range(resamples):
        pooled: list[float] = []
        for run in draw.choices(runs, k=len(runs)):
            pooled.extend(draw.choices(run, k=len(run)))
        medians.append(statistics.median(pooled))
    medians.sort()
    tail = (1 - confidence) / 2
    return medians[int(tail * resamples)], medians[math.ceil((1 - tail) * resamples) - 1]


def _target(pair: Pair, goal: float, metric: str) -> float | None:
    """What a ratio is held against: the goal for LockedTask / plain Task and for the lock cycle
    against the floor, 1 (ahead) for LockedTask / a peer end to end, nothing for the rest (shown
    for reference)."""
    if pair in ((LOCKED, PLAIN), (CELERY_LOCK, FLOOR)):
        return goal
    if pair[0] == LOCKED and pair[1] in PEERS and metric in END_TO_END:
        return 1.0
    return None


def _paired(
    contenders: dict[str, Any], pairs: Iterable[Pair], samples: Callable[[Any], list[float]]
) -> dict[Pair, list[float]]:
    """The ratio of each pair whose two contenders ran, one per round."""
    return {
        (a, b): paired_ratios(samples(contenders[a]), samples(contenders[b]))
        for a, b in pairs
        if a in contenders and b in contenders
    }


def round_ratios(results: dict[str, Any], metric: str) -> dict[str, dict[Pair, list[float]]]:
    """Per worker size, the ratios of each pair in :data:`RATIOS`, one per round of one run."""
    return {
        size: _paired(entry["contenders"], RATIOS, lambda c: c["samples"][metric])
        for size, entry in results.get("endtoend", {}).get("by_processes", {}).items()
    }


def _setup(results: dict[str, Any]) -> str:
    """What a run's rounds are pooled under: its machine (CPU and clock) and its redis-server."""
    machine = results.get("machine", {})
    server = machine.get("redis_server")
    return f"{machine_name(machine)}, redis-server {server}" if server else machine_name(machine)


def _as_pooled(by_pair: dict[Pair, list[tuple[float, ...]]]) -> dict[Pair, Pooled]:
    return {pair: Pooled(tuple(runs)) for pair, runs in by_pair.items() if any(runs)}


def commits(runs: Iterable[dict[str, Any]]) -> dict[str, list[str | None]]:
    """Machine -> the celery-lock commits its runs measured (``+``: with uncommitted changes),
    in the order first seen; ``None`` for runs that recorded none (made before runs did)."""
    seen: dict[str, list[str | None]] = defaultdict(list)
    for results in runs:
        commit = results.get("machine", {}).get("commit") or None
        if commit not in seen[_setup(results)]:
            seen[_setup(results)].append(commit)
    return dict(seen)


def pool(
    runs: Iterable[dict[str, Any]], metric: str = "worker"
) -> dict[str, dict[str, dict[Pair, Pooled]]]:
    """Machine -> worker size -> ratio -> the rounds of every run on that machine."""
    rounds: dict[str, dict[str, dict[Pair, list[tuple[float, ...]]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for results in runs:
        by_size = rounds[_setup(results)]
        for size, ratios in round_ratios(results, metric).items():
            for pair, values in ratios.items():
                by_size[size][pair].append(tuple(values))
    return {
        machine: {
            size: _as_pooled(by_pair)
            for size, by_pair in sorted(by_size.items(), key=lambda item: int(item[0]))
        }
        for machine, by_size in rounds.items()
    }


def pool_lock_cycles(runs: Iterable[dict[str, Any]]) -> dict[str, dict[Pair, Pooled]]:
    """Machine -> ratio of :data:`CYCLE_RATIOS` -> the lock cycle rounds of every run on it."""
    rounds: dict[str, dict[Pair, list[tuple[float, ...]]]] = defaultdict(lambda: defaultdict(list))
    for results in runs:
        by_pair = rounds[_setup(results)]
        contenders = results.get("lockcycle", {}).get("contenders", {})
        for pair, values in _paired(contenders, CYCLE_RATIOS, lambda c: c["samples"]).items():
            by_pair[pair].append(tuple(values))
    return {machine: _as_pooled(by_pair) for machine, by_pair in rounds.items()}


def _table(
    first: str,
    rows: dict[str, dict[Pair, Pooled]],
    ratios: Sequence[Pair],
    goal: float,
    metric: str,
) -> str:
    """A Markdown table: a row per key of ``rows``, with its count of rounds and of the runs
    they came from, and a column per ratio that any row has."""
    pairs = [pair for pair in ratios if any(pair in by_pair for by_pair in rows.values())]
    cells = [
        [
            label,
            max(len(p.ratios) for p in by_pair.values()),
            max(sum(1 for run in p.runs if run) for p in by_pair.values()),
            *(
                by_pair[pair].cell(_target(pair, goal, metric)) if pair in by_pair else "-"
                for pair in pairs
            ),
        ]
        for label, by_pair in rows.items()
    ]
    labels = [f"{SHORT[a]} / {SHORT[b]}" for a, b in pairs]
    return table([first, "rounds", "runs", *labels], cells)


def _measured(machine: str, versions: dict[str, list[str | None]]) -> str:
    """Which versions of celery-lock a machine's runs measured, when they recorded it."""
    found = versions.get(machine, [])
    recorded = [commit for commit in found if commit]
    if not recorded:
        return ""
    text = f"celery-lock at {', '.join(recorded)}"
    if None in found:
        text += " and at commits some runs did not record"
    if len(found) > 1:
        text += " (different versions of the code may be pooled as one)"
    return text


def render_lock_cycles(
    pooled: dict[str, dict[Pair, Pooled]],
    goal: float,
    runs: int,
    versions: dict[str, list[str | None]] | None = None,
) -> str:
    """A Markdown table: a row per machine, a column per ratio of the lock cycle."""
    heading = f"lock cycles per second, {runs} runs pooled:"
    measured = [
        f"{machine}: {text}" for machine in pooled if (text := _measured(machine, versions or {}))
    ]
    cycles = _table("machine", pooled, CYCLE_RATIOS, goal, LOCK_CYCLE)
    return "\n\n".join([heading, cycles, *measured])


def render(
    pooled: dict[str, dict[str, dict[Pair, Pooled]]],
    goal: float,
    metric: str,
    runs: int,
    versions: dict[str, list[str | None]] | None = None,
) -> str:
    """One Markdown table per machine: a row per worker size, a column per ratio."""
    sections = [
        "\n\n".join(
            part
            for part in (
                f"{machine}:",
                _table("processes", by_size, RATIOS, goal, metric),
                _measured(machine, versions or {}),
            )
            if part
        )
        for machine, by_size in pooled.items()
    ]
    heading = (
        f"{metric} rate, {runs} runs pooled: the median of every round's paired ratio "
        f"[its {CONFIDENCE:.0%} confidence interval], against the goal where there is one"
    )
    return "\n\n".join([heading, *sections])


def _read(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """One result file, or the command's usage error naming it (a shell glob that matched
    nothing arrives as its own pattern)."""
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"{path}: not a result file python -m bench wrote ({exc})")
    if not isinstance(results, dict):
        parser.error(f"{path}: not a result file python -m bench wrote (not a JSON object)")
    return results


def main(argv: list[str] | None = None) -> int:
    """Read the result files, pool, print."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.pool", description=__doc__.split("\n")[0]
    )
    parser.add_argument("results", nargs="+", type=Path, help="JSON files python -m bench wrote")
    parser.add_argument("--metric", choices=METRICS, default="worker")
    parser.add_argument("--goal", type=float, default=0.95, help="for LockedTask / plain Task")
    args = parser.parse_args(argv)
    runs = [_read(parser, path) for path in args.results]
    with_endtoend = [r for r in runs if "endtoend" in r]
    with_cycles = [r for r in runs if "lockcycle" in r]
    if not with_endtoend and not with_cycles:
        print(
            "python -m bench.pool: none of these runs has an endtoend or lockcycle section",
            file=sys.stderr,
        )
        return 2
    shown = []
    if with_endtoend:
        pooled = pool(with_endtoend, args.metric)
        versions = commits(with_endtoend)
        shown.append(render(pooled, args.goal, args.metric, len(with_endtoend), versions))
    if with_cycles:
        cycles = pool_lock_cycles(with_cycles)
        shown.append(render_lock_cycles(cycles, args.goal, len(with_cycles), commits(with_cycles)))
    print("\n\n".join(shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
