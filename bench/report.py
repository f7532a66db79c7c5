"""Results as Markdown tables (printed, and pasted into ``docs/benchmarks.md``), JSON and a plot.

``python -m bench.report RESULTS.json [--plot PATH]`` prints a kept run's tables again and, with
``--plot``, draws its plot (as ``docs/benchmarks/throughput.png`` is drawn from a kept run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .endtoend import LOCKED, PLAIN
from .lockcycle import CELERY_LOCK, FLOOR, FLOOR_POOLED, SCRIPTED_FLOOR
from .machine import name as machine_name
from .stats import Summary, paired_ratios
from .workers import ROLES


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; numbers right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    numeric = [all(_is_number(r[i]) for r in cells) and bool(cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        padded = [
            v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = ["-" * (w - 1) + ":" if n else "-" * w for w, n in zip(widths, numeric, strict=True)]
    return "\n".join([line(headers), "| " + " | ".join(rule) + " |", *map(line, cells)])


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", "").split(" ")[0])
    except ValueError:
        return False
    return True


def _cpu_us(rate: dict[str, float] | None) -> str:
    """Microseconds of CPU per task, from a tasks-per-CPU-second summary."""
    return f"{1e6 / rate['median']:,.0f}" if rate else "-"


def _us(summary: dict[str, float]) -> str:
    """A median in microseconds, with its range."""
    return f"{summary['median']:,.0f} ({summary['low']:,.0f}..{summary['high']:,.0f})"


def _ratio(summary: dict[str, float] | None) -> str:
    if not summary:
        return "-"
    return f"{summary['median']:.3f} ({summary['low']:.2f}..{summary['high']:.2f})"


def machine_table(machine: dict[str, Any]) -> str:
    """The machine the numbers come from."""
    packages = ", ".join(f"{k} {v}" for k, v in machine["packages"].items() if v != "-")
    rows = [
        ("CPU", f"{machine_name(machine)} ({machine['cores']} cores)"),
        ("memory", f"{machine['memory_gib']} GiB"),
        ("OS", machine["os"]),
        ("Python", machine["python"]),
        ("redis-server", machine["redis_server"]),
        ("load average (1/5/15 min) at start", "/".join(map(str, machine["load_at_start"]))),
        ("load average at end", "/".join(map(str, machine.get("load_at_end", [])))),
        ("packages", packages),
    ]
    if machine.get("commit"):
        rows.append(("celery-lock commit", machine["commit"]))
    if machine.get("note"):
        rows.append(("note", machine["note"]))
    return table(["machine", ""], rows)


def lockcycle_table(result: dict[str, Any]) -> str:
    """Lock cycles per second, and each contender's share of the floor's rate."""
    rows = []
    for name, entry in result["contenders"].items():
        ops = entry["ops_per_s"]
        rows.append(
            (
                name,
                f"{ops['median']:,.0f}",
                f"{entry['us_per_cycle']:.0f}",
                _ratio(entry.get("ratio_to_floor")),
            )
        )
    for name, error in result["unavailable"].items():
        rows.append((name, "n/a", "n/a", f"did not run: {error}"))
    text = table(
        ["lock cycle (fresh key, one client)", "cycles/s", "µs/cycle", "vs floor, median (range)"],
        rows,
    )
    server = result.get("server_us_per_cycle")
    if server:
        text += "\n\nServer time per cycle (`INFO commandstats`): " + ", ".join(
            f"{name} {us:.1f} µs" for name, us in server.items()
        )
    return text


def endtoend_table(result: dict[str, Any]) -> str:
    """Wall-clock rates per worker size, then CPU per task; each with its ratio to plain."""
    rows, cpu_rows = [], []
    for size, entry in result["by_processes"].items():
        for name, c in entry["contenders"].items():
            rows.append(
                (
                    size,
                    name,
                    f"{c['worker']['median']:,.0f}",
                    _ratio(c.get("worker_ratio")),
                    f"{c['end_to_end']['median']:,.0f}",
                    _ratio(c.get("end_to_end_ratio")),
                    f"{c['publish']['median']:,.0f}",
                )
            )
            cpu_rows.append(
                (
                    size,
                    name,
                    _cpu_us(c.get("worker_cpu")),
                    _ratio(c.get("worker_cpu_ratio")),
                    _cpu_us(c.get("end_to_end_cpu")),
                    _ratio(c.get("end_to_end_cpu_ratio")),
                )
            )
    text = table(
        [
            "processes",
            "task",
            "worker tasks/s",
            "vs plain",
            "end-to-end tasks/s",
            "vs plain",
            "publish msg/s",
        ],
        rows,
    )
    text += "\n\nCPU per task (worker processes + redis-server; end to end adds the publisher):"
    text += "\n\n" + table(
        [
            "processes",
            "task",
            "worker CPU µs/task",
            "plain's / this",
            "end-to-end CPU µs/task",
            "plain's / this",
        ],
        cpu_rows,
    )
    text += "\n\nWorker CPU per task by process, µs (median):"
    text += "\n\n" + table(
        ["processes", "task", *ROLES],
        [
            (size, name, *(_us(c["worker_cpu_us_by_role"][role]) for role in ROLES))
            for size, entry in result["by_processes"].items()
            for name, c in entry["contenders"].items()
            if "worker_cpu_us_by_role" in c
        ],
    )
    for name, error in result["unavailable"].items():
        text += f"\n\n{name} did not run: `{error}`"
    text += "\n\nLoad average (1 min) as each round started: " + "; ".join(
        f"{size} processes: {min(e['load_by_round'])}..{max(e['load_by_round'])}"
        for size, e in result["by_processes"].items()
        if e.get("load_by_round")
    )
    left = {
        size: {k: v for k, v in entry["left_in_store"].items() if v}
        for size, entry in result["by_processes"].items()
    }
    text += "\n\nLeft in the lock store after each worker size: " + "; ".join(
        f"{size} processes: {counts or 'nothing'}" for size, counts in left.items()
    )
    return text


def storm_table(result: dict[str, Any]) -> str:
    """The storm against the same number of plain no-op tasks."""
    o = result["options"]
    rows = [
        (
            f"storm: {o['messages']:,} messages over {o['requests']:,} request ids",
            f"{result['storm_s']['median']:.2f}",
            f"{result['storm_s']['low']:.2f}..{result['storm_s']['high']:.2f}",
            ", ".join(map(str, result["executions"])),
        ),
        (
            f"{o['messages']:,} plain no-op tasks",
            f"{result['plain_s']['median']:.2f}",
            f"{result['plain_s']['low']:.2f}..{result['plain_s']['high']:.2f}",
            "-",
        ),
    ]
    text = table([f"{o['processes']} processes", "drain s (median)", "range", "executions"], rows)
    text += f"\n\nStorm time / plain time, paired by round: {_ratio(result['time_ratio'])}"
    if "cpu_ratio" in result:
        text += f"; CPU (worker + redis-server): {_ratio(result['cpu_ratio'])}"
    return text


def _bytes(size: dict[str, Any]) -> str:
    if size.get("median_bytes") is None:
        return "-"
    return f"{size['median_bytes']:.0f} ({size['low']}..{size['high']})"


def _ttl(store: dict[str, Any], kind: str) -> str:
    """The TTLs of one kind of key, in seconds; a run made before kinds were told apart
    recorded one range over every key."""
    by_kind = store.get("ttl_s_by_kind")
    ttl = by_kind[kind] if by_kind is not None else store["ttl_s"]
    ttl = ttl or {"min": 0, "max": 0}
    return f"{ttl['min']:.0f}..{ttl['max']:.0f}"


def _replaced(run: dict[str, Any]) -> str:
    """A warning where a pool process was replaced mid-run: its growth was not measured, so a
    small figure proves nothing."""
    if run.get("pool_processes_unchanged", True):
        return ""
    return " (a pool process was replaced during the run: not measured)"


def memory_tables(result: dict[str, Any]) -> str:
    """RSS growth per process over the run, and the lock store's contents afterwards."""
    rows = []
    for name, run in result["runs"].items():
        first, last = run["checkpoints"][0], run["checkpoints"][-1]
        rows.append(
            (
                name,
                f"{last['tasks']:,}",
                " / ".join(f"{(k or 0) / 1024:.1f}" for k in first["pool_kib"]),
                " / ".join(f"{(k or 0) / 1024:.1f}" for k in last["pool_kib"]),
                " / ".join(f"{g:+d}" for g in run["pool_growth_kib"]) + _replaced(run),
                " / ".join(f"{g:+d}" for g in run["pool_growth_second_half_kib"]),
                f"{run['main_growth_kib']:+d}",
                f"{first['lock_store_clients']} → {last['lock_store_clients']}",
            )
        )
    text = table(
        [
            "run",
            "tasks",
            "pool RSS MiB at start",
            "at end",
            "growth KiB",
            "2nd-half growth KiB",
            "main growth KiB",
            "lock store connections",
        ],
        rows,
    )
    store = result["store"]
    keys, sizes = store["keys"], store["memory_usage"]
    store_rows: list[tuple[Any, ...]] = [
        ("leases", keys["leases"], "-", "-"),
        (
            "done-markers",
            keys["done_markers"],
            _ttl(store, "done_markers"),
            _bytes(sizes["done_markers"]),
        ),
        (
            "fence counters",
            keys["fences"],
            _ttl(store, "fences"),
            _bytes(sizes["fences"]),
        ),
        ("other", keys["other"], "-", "-"),
    ]
    text += "\n\n" + table(
        ["lock store after the run", "keys", "TTL s", "MEMORY USAGE bytes, median (range)"],
        store_rows,
    )
    text += (
        f"\n\nKeys without a TTL: {store['keys_without_ttl']}. All-in per completed request "
        f"(`used_memory` freed by flushing the store / requests): "
        f"{store['used_memory_per_request_bytes']:.0f} bytes."
    )
    return text


def _beside_the_floor(locked: dict[str, Any], floor: dict[str, Any] | None) -> str:
    """The floor's worker ratio, the most a lock with two round trips in the worker keeps on
    this machine, and celery-lock's worker rate against it (paired by round)."""
    if not floor or "worker_ratio" not in floor:
        return ""
    text = f"; the floor, two round trips and nothing else: {floor['worker_ratio']['median']:.3f}"
    if "samples" in locked and "samples" in floor:
        paired = paired_ratios(locked["samples"]["worker"], floor["samples"]["worker"])
        text += f", LockedTask / the floor {Summary.of(paired).median:.3f}"
    return text


def _against_the_peers(locked: dict[str, Any], peers: dict[str, dict[str, Any]]) -> str:
    """celery-lock's end-to-end rate beside the peers', and whether it is ahead: judged, as
    every ratio here, round by round (medians of the rates, taken apart, would set one round's
    noise against another's)."""
    own = f"end to end {locked['end_to_end']['median']:,.0f}/s"
    if not peers:  # a run narrowed with --contenders
        return own
    rates = ", ".join(f"{n} {p['end_to_end']['median']:,.0f}/s" for n, p in peers.items())
    paired = {
        n: Summary.of(
            paired_ratios(locked["samples"]["end_to_end"], p["samples"]["end_to_end"])
        ).median
        for n, p in peers.items()
    }
    ratios = ", ".join(f"{n} {r:.3f}" for n, r in paired.items())
    verdict = "ahead" if all(r > 1 for r in paired.values()) else "not ahead"
    return f"{own} vs peers {rates}; celery-lock / peer, paired by round: {ratios} ({verdict})"


def headline(results: dict[str, Any]) -> list[str]:
    """The issue's goals, each with the figure that meets or misses it."""
    lines = []
    cycle = results.get("lockcycle")
    if cycle and CELERY_LOCK in cycle["contenders"]:
        contenders = cycle["contenders"]
        ratio = contenders[CELERY_LOCK].get("ratio_to_floor")
        if ratio:
            line = f"lock cycle / floor: {ratio['median']:.3f} (goal ≥ 0.95)"
            for other, label in (
                (SCRIPTED_FLOOR, "the scripted floor"),
                (FLOOR_POOLED, "the floor through redis-py's pool"),
            ):
                if other in contenders:
                    # Paired by round, as every other ratio here.
                    paired = paired_ratios(
                        contenders[CELERY_LOCK]["samples"], contenders[other]["samples"]
                    )
                    line += f"; / {label}: {Summary.of(paired).median:.3f}"
            scripted = contenders.get(SCRIPTED_FLOOR, {}).get("ratio_to_floor")
            if scripted:
                line += f" (the scripted floor / floor: {scripted['median']:.3f})"
            lines.append(line)
    e2e = results.get("endtoend")
    if e2e:
        for size, entry in e2e["by_processes"].items():
            c = entry["contenders"].get(LOCKED, {})
            if "worker_ratio" in c:
                peers = {
                    n: p for n, p in entry["contenders"].items() if n not in (PLAIN, FLOOR, LOCKED)
                }
                cpu = c.get("worker_cpu_ratio")
                # The peers lock at publish time and make one round trip in the worker (the DEL
                # that frees the lock): their ratio is what that one round trip costs here.
                peer_ratios = ", ".join(
                    f"{n} {entry['contenders'][n]['worker_ratio']['median']:.3f}"
                    for n in peers
                    if "worker_ratio" in entry["contenders"][n]
                )
                lines.append(
                    f"{size} processes: LockedTask / plain (worker) "
                    f"{c['worker_ratio']['median']:.3f} (goal ≥ 0.95"
                    + (f"; by CPU per task {cpu['median']:.3f}" if cpu else "")
                    + _beside_the_floor(c, entry["contenders"].get(FLOOR))
                    + (f"; peers, one worker round trip: {peer_ratios}" if peer_ratios else "")
                    + "); "
                    + _against_the_peers(c, peers)
                )
    storm = results.get("storm")
    if storm:
        lines.append(
            f"storm: executions {storm['executions']} (goal {storm['options']['requests']} "
            f"each); time / plain {storm['time_ratio']['median']:.2f}"
        )
    memory = results.get("memory")
    if memory:
        run = memory["runs"]["celery-lock"]
        lines.append(
            f"memory: pool RSS growth over {run['checkpoints'][-1]['tasks']:,} locked tasks "
            f"{run['pool_growth_kib']} KiB{_replaced(run)}; store: {memory['store']['keys']}, "
            f"{memory['store']['keys_without_ttl']} without TTL"
        )
    return lines


def render(results: dict[str, Any]) -> str:
    """Every section that ran, as Markdown."""
    parts = ["## Machine", machine_table(results["machine"])]
    if "lockcycle" in results:
        parts += ["## Lock cycle", lockcycle_table(results["lockcycle"])]
    if "endtoend" in results:
        parts += ["## End to end", endtoend_table(results["endtoend"])]
    if "storm" in results:
        parts += ["## Duplicate storm", storm_table(results["storm"])]
    if "memory" in results:
        parts += ["## Memory", memory_tables(results["memory"])]
    parts += ["## Goals", "\n".join(f"- {line}" for line in headline(results))]
    return "\n\n".join(parts) + "\n"


def write_json(results: dict[str, Any], directory: Path, mode: str) -> Path:
    """Write ``results`` to ``<directory>/<time>-<mode>.json``; return the path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{time.strftime('%Y%m%d-%H%M%S')}-{mode}.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return path


def plot(results: dict[str, Any], path: Path) -> Path | None:
    """Throughput against worker processes, per contender (worker and end to end)."""
    e2e = results.get("endtoend")
    if not e2e:
        return None
    import matplotlib  # noqa: PLC0415 - only the full run plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    sizes = list(e2e["by_processes"])
    names = list(e2e["by_processes"][sizes[0]]["contenders"])
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for axis, metric, title in (
        (axes[0], "worker", "worker throughput (queue drain)"),
        (axes[1], "end_to_end", "end to end (publish + drain)"),
    ):
        for name in names:
            medians, lows, highs = [], [], []
            for size in sizes:
                s = e2e["by_processes"][size]["contenders"][name][metric]
                medians.append(s["median"])
                lows.append(s["median"] - s["low"])
                highs.append(s["high"] - s["median"])
            axis.errorbar(
                [int(x) for x in sizes],
                medians,
                yerr=[lows, highs],
                marker="o",
                capsize=3,
                label=name,
            )
        axis.set_title(title)
        axis.set_xlabel("worker processes (prefork)")
        axis.set_xticks([int(x) for x in sizes])
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("tasks/s (median, range)")
    axes[0].legend()
    machine = results["machine"]
    figure.suptitle(
        f"no-op tasks, Redis broker, results ignored: {machine['cpu']}, {machine['cores']} "
        f"cores (shared), redis {machine['redis_server']}",
        fontsize=9,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    """Print a kept run's tables; draw its plot with ``--plot``."""
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=main.__doc__)
    parser.add_argument("results", type=Path, help="a run's JSON (bench/results/*.json)")
    parser.add_argument("--plot", type=Path, help="where to write the run's plot")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        results = json.loads(args.results.read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"cannot read {args.results}: {exc}")
    print(render(results), end="")
    if args.plot is not None and plot(results, args.plot) is None:
        parser.error(f"{args.results} has no end-to-end section to plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
