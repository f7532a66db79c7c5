"""Inject requests into the pipeline, with the duplicates real producers and brokers make.

::

    python -m examples.pipeline.producer --requests 50 --copies 3

1. Takes ``--requests`` fresh request numbers (a counter in the record Redis, so runs against a
   long-lived Redis never reuse a number whose done-markers still live).
2. Sends each request ``--copies`` times to *pending*, every copy with its own task id, shuffled.
3. ``--redeliveries``: sends some of those messages again with the SAME task id, as a broker
   does when it redelivers (visibility timeout, lost connection); they land while their twin
   waits, runs, or has finished.
4. ``--process-duplicates``: as soon as a request's *pending* stage has started, sends a
   duplicate straight into *process* (some of them then redelivered with the same id too), as
   a producer that retries a hand-off would. It arrives while *pending* holds the request: it
   must wait (contention), neither run alongside nor be dropped.
5. Writes the run's manifest (request range, what was sent) for ``verify``.

The app is configured from ``PIPELINE_*`` variables, see :mod:`examples.pipeline.app`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="producer", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--requests", type=int, default=20, help="how many requests (20)")
    parser.add_argument("--copies", type=int, default=3, help="copies of each to pending (3)")
    parser.add_argument(
        "--redeliveries",
        type=int,
        default=None,
        help="messages sent again with the same task id (default: requests / 2, at least 2)",
    )
    parser.add_argument(
        "--process-duplicates",
        type=int,
        default=None,
        help="duplicates sent straight to process (default: requests / 4, at least 2)",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=120.0,
        help="seconds to wait for pending stages before giving up on process duplicates (120)",
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed, for a rerun")
    return parser


def with_redeliveries(
    messages: list[tuple[int, str]], count: int, rng: random.Random
) -> list[tuple[int, str]]:
    """``messages`` plus ``count`` re-sends of earlier ones (same task id), each placed later."""
    result = list(messages)
    for _ in range(min(count, len(messages))):
        position = rng.randrange(len(result))
        result.insert(rng.randint(position + 1, len(result)), result[position])
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.requests < 1 or args.copies < 1:
        print("producer: --requests and --copies must be at least 1", file=sys.stderr)
        return 2
    redeliveries = max(2, args.requests // 2) if args.redeliveries is None else args.redeliveries
    duplicates = args.process_duplicates
    duplicates = max(2, args.requests // 4) if duplicates is None else duplicates
    duplicates = min(duplicates, args.requests)
    rng = random.Random(args.seed)

    from examples.pipeline import app as pipeline  # noqa: PLC0415 - reads PIPELINE_* on import

    records = pipeline.records
    first = int(records.incrby(pipeline.NEXT_REQUEST_KEY, args.requests)) - args.requests
    requests = list(range(first, first + args.requests))
    run_id = uuid.uuid4().hex[:12]
    manifest: dict[str, Any] = {
        "run_id": run_id,
        "first": first,
        "count": args.requests,
        "copies": args.copies,
        "broker": pipeline.app.conf.broker_url.split("://", 1)[0],
        "sent": {},
    }
    records.set(pipeline.run_key(run_id), json.dumps(manifest))
    records.set(pipeline.LAST_RUN_KEY, run_id)
    print(f"producer: run {run_id}: requests {first}..{first + args.requests - 1}")

    # Copies to pending, each its own task id; some re-sent later with the same id.
    pending = [(idx, str(uuid.uuid4())) for idx in requests for _ in range(args.copies)]
    rng.shuffle(pending)
    redeliver_pending = (redeliveries + 1) // 2 if duplicates else redeliveries
    for idx, task_id in with_redeliveries(pending, redeliver_pending, rng):
        pipeline.pending.apply_async((idx,), task_id=task_id)
    print(
        f"producer: sent {len(pending)} copies to pending ({args.copies} per request), "
        f"and {redeliver_pending} of them again with the same task id"
    )

    # Duplicates straight into process, each once its request's pending stage has started.
    chosen = set(rng.sample(requests, duplicates))
    deadline = time.monotonic() + args.wait
    sent_to_process: list[tuple[int, str]] = []
    started: set[int] = set()
    seen = 0  # entries of the record read so far
    while chosen and time.monotonic() < deadline:
        new = records.lrange(pipeline.STARTED_KEY, seen, -1)
        seen += len(new)
        started |= {e["request_idx"] for e in map(json.loads, new) if e["stage"] == "pending"}
        for idx in sorted(chosen & started):
            task_id = str(uuid.uuid4())
            pipeline.process.apply_async((idx,), task_id=task_id)
            sent_to_process.append((idx, task_id))
            chosen.discard(idx)
        time.sleep(0.02)
    redeliver_process = min(redeliveries - redeliver_pending, len(sent_to_process))
    for idx, task_id in rng.sample(sent_to_process, redeliver_process):
        pipeline.process.apply_async((idx,), task_id=task_id)
    print(
        f"producer: sent {len(sent_to_process)} duplicates straight to process, "
        f"and {redeliver_process} of them again with the same task id"
    )
    if chosen:
        print(f"producer: gave up waiting for pending of requests {sorted(chosen)}")

    manifest["sent"] = {
        "pending_copies": len(pending),
        "pending_redeliveries": redeliver_pending,
        "process_duplicates": len(sent_to_process),
        "process_redeliveries": redeliver_process,
    }
    records.set(pipeline.run_key(run_id), json.dumps(manifest))
    return 1 if chosen else 0


if __name__ == "__main__":
    if not __package__:  # run as a file: make `examples.pipeline` importable
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
