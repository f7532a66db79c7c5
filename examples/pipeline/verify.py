"""Prove from the record that no request was handled twice by any stage of the pipeline.

::

    python -m examples.pipeline.verify --wait 120

Reads the last run's manifest (or ``--run``), optionally waits (bounded) until every request's
*callback* has run and every published message has been delivered and finished, then checks
the record of executions:

1. each stage ran exactly once per request (none missing, none doubled);
2. no two executions for one request overlap in time, across the stages;
3. fences are strictly increasing per request, in start order;
4. the stages of each request ran in order: pending, process, callback (the example's order,
   which a killed pending holder can break: see README.md).

Prints what each stage did (executions, skipped copies, deferrals) and a verdict. Exit status:
0 all checks hold, 1 a check failed, 2 there is no run to verify.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STAGES = ("pending", "process", "callback")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verify", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--run", help="run id to verify (default: the producer's last run)")
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        help="seconds to wait for the run to finish and settle before checking (default 0)",
    )
    parser.add_argument(
        "--quiet-period",
        type=float,
        default=1.0,
        help="seconds nothing may change before the run counts as settled (1.0)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="list every execution")
    return parser


@dataclass(frozen=True)
class Execution:
    """One run of a stage body, as the app recorded it."""

    stage: str
    request_idx: int
    task_id: str
    fence: int | None
    start: float
    end: float
    host: str
    pid: int

    @classmethod
    def from_json(cls, raw: bytes | str) -> Execution:
        data = json.loads(raw)
        return cls(
            stage=data["stage"],
            request_idx=int(data["request_idx"]),
            task_id=data["task_id"],
            fence=None if data.get("fence") is None else int(data["fence"]),
            start=float(data["start"]),
            end=float(data["end"]),
            host=str(data.get("host", "?")),
            pid=int(data.get("pid", 0)),
        )


def find_problems(executions: list[Execution], requests: range) -> dict[str, list[str]]:
    """Check the executions of ``requests``; return each check's problems (empty: it holds)."""
    problems: dict[str, list[str]] = {
        "each stage ran exactly once per request": [],
        "no two executions of one request overlapped in time (across stages)": [],
        "fences strictly increasing per request, in start order": [],
        "stages ran in order pending -> process -> callback": [],
    }
    once, overlap, fences, order = problems.values()
    by_request: dict[int, list[Execution]] = defaultdict(list)
    for run in executions:
        by_request[run.request_idx].append(run)
    for idx in requests:
        runs = sorted(by_request.get(idx, []), key=lambda run: run.start)
        counts = Counter(run.stage for run in runs)
        for stage in STAGES:
            if counts[stage] != 1:
                what = "never ran" if counts[stage] == 0 else f"ran {counts[stage]} times"
                once.append(f"request {idx}: {stage} {what}")
        for earlier, later in itertools.pairwise(runs):
            if later.start < earlier.end:
                overlap.append(
                    f"request {idx}: {later.stage} ({later.task_id}) started "
                    f"{earlier.end - later.start:.3f}s before {earlier.stage} "
                    f"({earlier.task_id}) ended"
                )
            if later.fence is None or earlier.fence is None or later.fence <= earlier.fence:
                fences.append(
                    f"request {idx}: fence {later.fence} of {later.stage} after fence "
                    f"{earlier.fence} of {earlier.stage}"
                )
        if sorted(counts.values()) == [1, 1, 1] and tuple(r.stage for r in runs) != STAGES:
            order.append(f"request {idx}: " + " -> ".join(run.stage for run in runs))
    return problems


def _entries(records: Any, key: str, requests: range) -> list[dict[str, Any]]:
    entries = (json.loads(raw) for raw in records.lrange(key, 0, -1))
    return [entry for entry in entries if entry.get("request_idx") in requests]


def wait_until_settled(pipeline: Any, requests: range, timeout: float, quiet: float) -> bool:
    """Wait until every callback ran and no message is in flight, for ``quiet`` seconds."""
    records = pipeline.records
    deadline = time.monotonic() + timeout
    next_report = time.monotonic() + 5
    done: set[int] = set()
    seen = 0
    stable_since: float | None = None
    while True:
        new = records.lrange(pipeline.EXECUTIONS_KEY, seen, -1)
        seen += len(new)
        done |= {e["request_idx"] for e in map(json.loads, new) if e["stage"] == "callback"}
        published, finished = (
            int(v or 0) for v in records.mget(pipeline.PUBLISHED_KEY, pipeline.FINISHED_KEY)
        )
        now = time.monotonic()
        finished_all = len(done & set(requests)) == len(requests)
        if finished_all and finished >= published:
            stable_since = stable_since or now
            if now - stable_since >= quiet:
                return True
        else:
            stable_since = None
        if now >= deadline:
            return False
        if now >= next_report:
            print(
                f"verify: waiting: {len(done & set(requests))}/{len(requests)} callbacks done, "
                f"{max(0, published - finished)} message(s) in flight",
                flush=True,
            )
            next_report = now + 5
        time.sleep(0.2)


def stage_table(
    executions: list[Execution], deliveries: list[dict[str, Any]], events: list[dict[str, Any]]
) -> str:
    """One line per stage: executions, skipped copies, deferrals, quietly acked redeliveries,
    and failed deliveries (e.g. duplicates under ``--lock-on-duplicate raise``), if any."""
    ran = Counter(run.stage for run in executions)
    ignored = Counter(d["stage"] for d in deliveries if d["state"] == "IGNORED")
    failed = Counter(d["stage"] for d in deliveries if d["state"] == "FAILURE")
    why = Counter((e["event"], e["stage"], e["reason"]) for e in events)
    lines = []
    for stage in STAGES:
        per_request = Counter(run.request_idx for run in executions if run.stage == stage)
        doubled = sum(count - 1 for count in per_request.values())
        running, done = why["skipped", stage, "running"], why["skipped", stage, "done"]
        contention, redelivered, duplicate = (
            why["deferred", stage, reason] for reason in ("contention", "redelivered", "duplicate")
        )
        # IGNORED deliveries: skips, deferred redeliveries, and redeliveries of a finished message.
        acked = max(0, ignored[stage] - running - done - redelivered)
        lines.append(
            f"{stage:<8}  ran {ran[stage]:>3} (doubled {doubled})"
            f"  skipped {running + done:>3} (running {running}, done {done})"
            f"  deferred {contention + redelivered + duplicate:>3} (contention {contention},"
            f" redelivered {redelivered}, duplicate {duplicate})"
            f"  redeliveries acked {acked}" + (f"  FAILED {failed[stage]}" if failed[stage] else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from examples.pipeline import app as pipeline  # noqa: PLC0415 - reads PIPELINE_* on import

    records = pipeline.records
    run_id = args.run or (records.get(pipeline.LAST_RUN_KEY) or b"").decode()
    raw = records.get(pipeline.run_key(run_id)) if run_id else None
    if raw is None:
        print(f"verify: no run {run_id or '(none yet)'} in {pipeline.RECORD_URL}", file=sys.stderr)
        return 2
    manifest = json.loads(raw)
    requests = range(manifest["first"], manifest["first"] + manifest["count"])
    print(
        f"verify: run {run_id}: {len(requests)} requests ({requests[0]}..{requests[-1]}), "
        f"broker {manifest.get('broker', '?')}",
        flush=True,
    )

    settled = True
    if args.wait > 0:
        settled = wait_until_settled(pipeline, requests, args.wait, args.quiet_period)
    executions = [
        Execution.from_json(raw) for raw in records.lrange(pipeline.EXECUTIONS_KEY, 0, -1)
    ]
    executions = [run for run in executions if run.request_idx in requests]
    deliveries = _entries(records, pipeline.DELIVERIES_KEY, requests)
    events = _entries(records, pipeline.LOCK_EVENTS_KEY, requests)

    print(stage_table(executions, deliveries, events))
    if args.verbose:
        origin = min((run.start for run in executions), default=0.0)
        for run in sorted(executions, key=lambda run: (run.request_idx, run.start)):
            print(
                f"  request {run.request_idx:>5}  {run.stage:<8}  fence {run.fence}  "
                f"{run.start - origin:8.3f}s-{run.end - origin:8.3f}s  "
                f"{run.host}:{run.pid}  {run.task_id}"
            )

    problems = find_problems(executions, requests)
    if not settled:
        problems[f"the run settled within {args.wait:g}s"] = ["callbacks missing or in flight"]
    print("checks:")
    for check, found in problems.items():
        print(f"  [{'FAIL' if found else 'ok'}] {check}")
        for problem in found[:20]:
            print(f"         {problem}")
        if len(found) > 20:
            print(f"         ... and {len(found) - 20} more")
    failed = sum(bool(found) for found in problems.values())
    if failed:
        print(f"verify: FAILED: {failed} check(s) failed")
        return 1
    print(
        f"verify: OK: {len(requests)} requests x {len(STAGES)} stages = {len(executions)} "
        "executions, none doubled, none overlapping, fences increasing"
    )
    return 0


if __name__ == "__main__":
    if not __package__:  # run as a file: make `examples.pipeline` importable
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
