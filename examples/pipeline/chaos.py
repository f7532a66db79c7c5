"""Chaos soak: the pipeline under crashes and redeliveries, checked from what the bodies wrote.

::

    python -m examples.pipeline.chaos --quick     # 30 requests, ~15 s of faults, under a minute
    python -m examples.pipeline.chaos             # 300 requests, 60 s of faults
    python -m examples.pipeline.chaos --broker amqp://guest:guest@127.0.0.1:5672//

1. Starts two private ``redis-server`` processes: one for the broker (unless ``--broker`` names
   a RabbitMQ), the results and the record, and the lock store, which keeps its data across a
   restart (``appendonly``, ``appendfsync always``, in a directory of this run), as a
   production lock store must for its done-markers and fence counters to outlive a restart.
2. Starts the three stage workers (``celery worker -P prefork``, ``--concurrency`` processes
   each) and the producer, which sends every request ``--copies`` times, shuffled, some of those
   again with the same task id, and duplicates straight into *process*.
3. For ``--chaos-seconds``, at random intervals: SIGKILLs a random pool process of a random
   stage (as the OOM killer would); stops the lock store's ``redis-server`` and starts it again
   on the same port; or makes the broker deliver again (examples/pipeline/brokers.py): on Redis,
   sweeps for messages unacknowledged for over a second, as a visibility timeout would, so that
   running and waiting messages are delivered again while their first delivery goes on; on
   RabbitMQ, crashes a stage's worker (SIGKILL of its process group) and starts a new one, and
   RabbitMQ requeues what the dead one had not acknowledged. On RabbitMQ the stages' queues
   have names of this run's own, deleted at the end.
4. Waits (bounded) until every request's *callback* has run and the broker holds nothing,
   queued or unacknowledged; then checks the record and prints a summary. Exit status: 0 no
   violation, 1 a violation, 2 the run could not start or did not drain.

A killed body runs again (at-least-once of the body: its message comes back, and its lease
lapses after ``--lock-ttl``); so may a body whose lease was lost, or whose release got no
answer while the lock store was down. Those re-runs are counted by cause, not violations. The
violations are what the lock promises not to do:

- a request with a stage that never completed;
- a stage that ran again after a run of it had released with its done-marker written;
- two bodies of one request, across its stages, running at the same time (a killed body counts
  as running until it was killed; bodies whose lease was lost are left out);
- a fence that does not strictly increase, per request, in start order (leases not lost);
- an accepted fenced write with a smaller fence than a write accepted before it, or a final
  stored state whose fence is not the largest accepted;
- a body that started, was not killed, and never ended.

Everything started is stopped by pid at the end, on Ctrl-C too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

if __name__ == "__main__" and not __package__:  # run as a file: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kombu.exceptions import OperationalError

from celery_lock.fencing import fenced_get
from celery_lock.testing import CeleryWorker, RedisServer
from examples.pipeline.brokers import RabbitBroker, RedisBroker
from examples.pipeline.run import (
    ROOT,
    STAGES,
    pipeline_env,
    stage_workers,
    start_workers,
    stop_workers,
    worker_lock_options,
)

# Databases of the main redis-server, one role each (the lock store has a server of its own).
BROKER_DB, BACKEND_DB, RECORD_DB = 0, 1, 3
# The record's keys, as examples/pipeline/app.py writes them; not imported from there, since
# importing app.py configures its Celery app from PIPELINE_* (and the checks run without one).
STARTED_KEY = "pipeline:started"
EXECUTIONS_KEY = "pipeline:executions"
RELEASES_KEY = "pipeline:releases"
WRITES_KEY = "pipeline:writes"
LOCK_EVENTS_KEY = "pipeline:lock-events"
STATE_KEY = "pipeline:state:{}"
LAST_RUN_KEY = "pipeline:last-run"
FAULTS = ("kill", "restart", "redeliver")
#: How often each fault is drawn: kills most, since they are what re-runs bodies.
FAULT_WEIGHTS = (5, 1, 2)
_STARTED = time.monotonic()


def note(message: str) -> None:
    """Progress on stderr: ``[chaos] <elapsed> <message>``; stdout holds the summary alone."""
    print(f"[chaos] {time.monotonic() - _STARTED:6.1f}s  {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chaos", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--quick", action="store_true", help="a small run, under a minute")
    parser.add_argument(
        "--broker",
        metavar="AMQP_URL",
        help="a RabbitMQ, amqp://... (default: a private redis-server)",
    )
    parser.add_argument("--requests", type=int, help="requests to inject (300; quick: 30)")
    parser.add_argument("--copies", type=int, default=3, help="copies of each request (3)")
    parser.add_argument("--concurrency", type=int, default=3, help="processes per stage (3)")
    parser.add_argument(
        "--chaos-seconds", type=float, help="how long faults are made (60; quick: 15)"
    )
    parser.add_argument(
        "--interval",
        type=float,
        nargs=2,
        default=(0.5, 3.0),
        metavar=("MIN", "MAX"),
        help="seconds between faults, drawn uniformly (0.5 3.0)",
    )
    parser.add_argument(
        "--outage", type=float, default=1.5, help="longest lock store outage, seconds (1.5)"
    )
    parser.add_argument("--lock-ttl", type=float, default=6.0, help="lease TTL, seconds (6)")
    parser.add_argument("--work-seconds", type=float, default=0.5, help="each body's work (0.5)")
    parser.add_argument(
        "--drain-timeout", type=float, help="seconds to wait for the end (600; quick: 240)"
    )
    parser.add_argument("--seed", type=int, help="random seed of the faults and the producer")
    parser.add_argument("--logs", type=Path, help="keep the worker logs in this directory")
    return parser


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwind through the finally block that stops what was started


# -- the faults -----------------------------------------------------------------------------------


@dataclass
class Faults:
    """What the chaos loop did, with the monotonic time of each fault."""

    #: pid -> (stage, when): pool processes SIGKILLed, alone or with their worker.
    kills: dict[int, tuple[str, float]] = field(default_factory=dict)
    #: pool processes SIGKILLed alone, and of those, the ones running a body
    pool_kills: int = 0
    busy_kills: int = 0
    #: (down, up): lock store outages.
    outages: list[tuple[float, float]] = field(default_factory=list)


def busy_pids(records: Any, stage: str) -> set[int]:
    """Pool processes running a body of ``stage`` now, by the record: started, not ended."""
    started = map(json.loads, records.lrange(STARTED_KEY, 0, -1))
    ended = map(json.loads, records.lrange(EXECUTIONS_KEY, 0, -1))
    running = Counter((e["pid"], e["task_id"]) for e in started if e["stage"] == stage)
    running.subtract((e["pid"], e["task_id"]) for e in ended if e["stage"] == stage)
    return {pid for (pid, _), n in running.items() if n > 0}


def kill_pool_process(
    rng: random.Random, workers: dict[str, CeleryWorker], records: Any, faults: Faults
) -> str:
    """SIGKILL one pool process of a stage drawn at random: one running a body if the stage
    has any (a kill of an idle process tests little), else any."""
    stage = rng.choice(STAGES)
    pids = workers[stage].child_pids()
    if not pids:
        return f"kill: {stage} has no pool process right now"
    busy = sorted(busy_pids(records, stage) & set(pids))
    pid = rng.choice(busy or pids)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return f"kill: {stage} pool process {pid} was gone already"
    faults.kills[pid] = (stage, time.monotonic())
    faults.pool_kills += 1
    faults.busy_kills += bool(busy)
    return f"kill: SIGKILL {stage} pool process {pid} ({'busy' if busy else 'idle'})"


def restart_lock_store(
    rng: random.Random, lock_server: RedisServer, outage: float, faults: Faults
) -> str:
    """Stop the lock store's redis-server (SIGTERM), wait, start it again on the same port."""
    down_for = rng.uniform(0.2, outage)
    lock_server.stop()
    down = time.monotonic()
    time.sleep(down_for)
    lock_server.start(timeout=30)
    faults.outages.append((down, time.monotonic()))
    return f"restart: lock store down {time.monotonic() - down:.1f}s, back as pid {lock_server.pid}"


def chaos(
    rng: random.Random,
    seconds: float,
    interval: tuple[float, float],
    make_fault: dict[str, Callable[[], str]],
    finished: Callable[[], bool],
) -> None:
    """Make faults at random intervals for ``seconds``, or until ``finished()``. Each kind of
    fault comes once first, in a random order, finished or not, so every run has every kind."""
    first = list(FAULTS)
    rng.shuffle(first)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and (first or not finished()):
        time.sleep(min(rng.uniform(*interval), max(0.0, deadline - time.monotonic())))
        kind = first.pop() if first else rng.choices(FAULTS, FAULT_WEIGHTS)[0]
        note(make_fault[kind]())


# -- waiting for the end --------------------------------------------------------------------------


def callbacks_done(records: Any, requests: range) -> set[int]:
    """The requests whose *callback* body has completed at least once."""
    entries = map(json.loads, records.lrange(EXECUTIONS_KEY, 0, -1))
    return {e["request_idx"] for e in entries if e["stage"] == "callback"} & set(requests)


def last_manifest(records: Any) -> dict[str, Any] | None:
    """The manifest of the producer's last run (its requests, what it sent), once written."""
    run_id = records.get(LAST_RUN_KEY)
    raw = records.get(f"pipeline:run:{run_id.decode()}") if run_id else None
    return json.loads(raw) if raw else None


def wait_drained(
    records: Any,
    outstanding: Callable[[], tuple[int, int]],
    requests: range,
    timeout: float,
    quiet: float = 2.0,
) -> bool:
    """Wait until every callback has run and the broker holds no message, queued or
    unacknowledged (deferred copies wait unacknowledged), for ``quiet`` seconds on end;
    ``outstanding()`` tells how many are queued and unacknowledged."""
    deadline = time.monotonic() + timeout
    next_note = time.monotonic() + 5
    quiet_since: float | None = None
    while True:
        done = len(callbacks_done(records, requests))
        queued, unacked = outstanding()
        now = time.monotonic()
        if done == len(requests) and not queued and not unacked:
            quiet_since = quiet_since or now
            if now - quiet_since >= quiet:
                return True
        else:
            quiet_since = None
        if now >= deadline:
            note(f"drain: gave up after {timeout:g}s: {done}/{len(requests)} callbacks done")
            return False
        if now >= next_note:
            note(
                f"drain: {done}/{len(requests)} callbacks done, {queued} queued, "
                f"{unacked} unacknowledged"
            )
            next_note = now + 5
        time.sleep(0.25)


# -- the checks -----------------------------------------------------------------------------------


@dataclass
class Findings:
    """What the record shows: counts for the summary, and the violations."""

    counts: Counter[str] = field(default_factory=Counter)
    violations: dict[str, list[str]] = field(default_factory=dict)

    def violate(self, check: str, problem: str) -> None:
        self.violations.setdefault(check, []).append(problem)


def _list(records: Any, key: str, requests: range | None = None) -> list[dict[str, Any]]:
    entries = [json.loads(raw) for raw in records.lrange(key, 0, -1)]
    if requests is None:
        return entries
    return [entry for entry in entries if entry.get("request_idx") in requests]


def find_violations(records: Any, requests: range, faults: Faults) -> Findings:
    """Check the record of the run's ``requests`` against the lock's promises (module doc)."""
    found = Findings()
    started = _list(records, STARTED_KEY, requests)
    ended = {(e["task_id"], e["pid"]): e for e in _list(records, EXECUTIONS_KEY, requests)}
    confirmed = {(r["task_id"], r["pid"]) for r in _list(records, RELEASES_KEY) if r["success"]}
    writes = _list(records, WRITES_KEY, requests)
    events = Counter((e["event"], e["reason"]) for e in _list(records, LOCK_EVENTS_KEY, requests))
    found.counts.update(
        {
            "skips": sum(n for (event, _), n in events.items() if event == "skipped"),
            "deferrals": sum(n for (event, _), n in events.items() if event == "deferred"),
            "deferred store-unavailable": events["deferred", "store-unavailable"],
            "deferred redelivered": events["deferred", "redelivered"],
            "body runs": len(started),
            "fenced writes refused": sum(not w["accepted"] for w in writes),
        }
    )

    # The last body each killed process started before the kill: it died in that body, or
    # after it, before its release. Any earlier body of that process had ended and released.
    last_before_kill: dict[int, dict[str, Any]] = {}
    for start in started:
        kill = faults.kills.get(start["pid"])
        if kill is not None and start["start"] <= kill[1]:
            last = last_before_kill.get(start["pid"])
            if last is None or start["start"] > last["start"]:
                last_before_kill[start["pid"]] = start
    killed_bodies = {(body["task_id"], body["pid"]) for body in last_before_kill.values()}

    # Each body run: its interval, and how it ended.
    runs: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for start in started:
        run = dict(start)
        end = ended.get((start["task_id"], start["pid"]))
        killed = faults.kills.get(start["pid"])
        if end is not None:
            run.update(end=end["end"], lost=end.get("lost", False), how="ended")
        elif killed is not None and killed[1] >= start["start"]:
            run.update(end=killed[1], lost=False, how="killed")
        else:
            run.update(end=None, lost=False, how="vanished")
            found.violate(
                "every body that started ended or was killed",
                f"request {start['request_idx']}: {start['stage']} ({start['task_id']}, "
                f"pid {start['pid']}) started and never ended",
            )
        runs[start["request_idx"]].append(run)
    found.counts["lost leases"] = sum(run["lost"] for request in runs.values() for run in request)

    for idx in requests:
        request = sorted(runs.get(idx, []), key=lambda run: run["start"])
        for stage in STAGES:
            of_stage = [run for run in request if run["stage"] == stage]
            if not any(run["how"] == "ended" for run in of_stage):
                found.violate(
                    "every request completed every stage", f"request {idx}: {stage} never ended"
                )
            for earlier in of_stage[:-1]:  # each run but the last one was run again
                if (earlier["task_id"], earlier["pid"]) in confirmed:
                    found.violate(
                        "no stage ran again once its done-marker was written",
                        f"request {idx}: {stage} ({earlier['task_id']}) released done, "
                        "and ran again",
                    )
                    continue
                cause = (
                    "killed"
                    if (earlier["task_id"], earlier["pid"]) in killed_bodies
                    else "lease lost"
                    if earlier["lost"]
                    else "release unanswered"
                )
                found.counts[f"re-runs: {cause}"] += 1
                found.counts["re-runs"] += 1
        held = [run for run in request if not run["lost"] and run["end"] is not None]
        for earlier, later in itertools.pairwise(held):
            if later["start"] < earlier["end"]:
                found.violate(
                    "no two bodies of one request ran at the same time",
                    f"request {idx}: {later['stage']} (fence {later['fence']}) started "
                    f"{earlier['end'] - later['start']:.3f}s before {earlier['stage']} "
                    f"(fence {earlier['fence']}, {earlier['how']}) ended",
                )
            if later["fence"] <= earlier["fence"]:
                found.violate(
                    "fences strictly increase per request, in start order",
                    f"request {idx}: fence {later['fence']} of {later['stage']} after fence "
                    f"{earlier['fence']} of {earlier['stage']}",
                )
    killed_fences = {
        (run["request_idx"], run["fence"])
        for request in runs.values()
        for run in request
        if run["how"] == "killed"
    }
    _check_fenced_writes(records, requests, writes, killed_fences, found)
    return found


def _check_fenced_writes(
    records: Any,
    requests: range,
    writes: list[dict[str, Any]],
    killed_fences: set[tuple[int, int]],
    found: Findings,
) -> None:
    """Every accepted write carries a fence >= that of every write accepted before it (before:
    it returned before the other was sent), and the stored state is the largest accepted; or
    larger, written by a body killed before it could record its write (``killed_fences``:
    request and fence of each killed body)."""
    check = "every accepted fenced write had a fence >= every earlier accepted one"
    accepted: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for write in writes:
        if write["accepted"]:
            accepted[write["request_idx"]].append(write)
    for idx in requests:
        mine = accepted.get(idx, [])
        for earlier in mine:
            for later in mine:
                if earlier["after"] < later["before"] and later["fence"] < earlier["fence"]:
                    found.violate(
                        check,
                        f"request {idx}: {later['stage']} wrote fence {later['fence']} after "
                        f"{earlier['stage']} wrote fence {earlier['fence']}",
                    )
        stored = fenced_get(records, STATE_KEY.format(idx))
        largest = max((write["fence"] for write in mine), default=None)
        if (
            stored is not None
            and largest is not None
            and stored.fence != largest
            and not (stored.fence > largest and (idx, stored.fence) in killed_fences)
        ):
            found.violate(
                check, f"request {idx}: stored fence {stored.fence}, largest accepted {largest}"
            )


# -- the run --------------------------------------------------------------------------------------


def summary(
    manifest: dict[str, Any],
    faults: Faults,
    broker: RedisBroker | RabbitBroker,
    found: Findings,
    seconds: float,
) -> str:
    """The summary table (stdout)."""
    sent = manifest.get("sent", {})
    counts = found.counts
    rows = [
        ("requests", f"{manifest['count']}"),
        (
            "messages sent by the producer",
            f"{sum(sent.values())} ({sent.get('pending_copies', 0)} copies to pending, "
            f"{sent.get('pending_redeliveries', 0) + sent.get('process_redeliveries', 0)} "
            f"same-id redeliveries, {sent.get('process_duplicates', 0)} duplicates to process)",
        ),
        ("duplicates (beyond one per request)", f"{sum(sent.values()) - manifest['count']}"),
        ("pool processes killed", f"{faults.pool_kills} ({faults.busy_kills} running a body)"),
        ("lock store restarts", f"{len(faults.outages)}"),
        (broker.fault, broker.summary()),
        ("body runs", f"{counts['body runs']}"),
        (
            "re-runs",
            f"{counts['re-runs']} (killed {counts['re-runs: killed']}, lease lost "
            f"{counts['re-runs: lease lost']}, release unanswered "
            f"{counts['re-runs: release unanswered']})",
        ),
        ("skips", f"{counts['skips']}"),
        (
            "deferrals",
            f"{counts['deferrals']} (store unavailable {counts['deferred store-unavailable']}, "
            f"redelivered {counts['deferred redelivered']})",
        ),
        ("lost leases", f"{counts['lost leases']}"),
        ("fenced writes refused", f"{counts['fenced writes refused']}"),
        ("seconds", f"{seconds:.0f}"),
        ("violations", f"{sum(len(v) for v in found.violations.values())}"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.broker and not args.broker.startswith(("amqp://", "pyamqp://")):
        parser.error("--broker: a RabbitMQ URL, amqp://... (without it: a private Redis)")
    requests = args.requests or (30 if args.quick else 300)
    chaos_seconds = args.chaos_seconds or (15.0 if args.quick else 60.0)
    drain_timeout = args.drain_timeout or (240.0 if args.quick else 600.0)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    signal.signal(signal.SIGTERM, _terminate)

    work_dir = Path(tempfile.mkdtemp(prefix="pipeline-chaos-"))
    log_dir = args.logs or work_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    main_server = RedisServer()
    # Later arguments win: the lock store keeps an append-only file in a directory of this run,
    # written before every reply, so that a restart finds its leases, fences and done-markers.
    lock_server = RedisServer(
        extra_args=["--dir", str(work_dir), "--appendonly", "yes", "--appendfsync", "always"]
    )
    workers: list[CeleryWorker] = []
    broker: RedisBroker | RabbitBroker | None = None
    producer: subprocess.Popen[bytes] | None = None
    status = 2
    began = time.monotonic()
    try:
        main_server.start()
        lock_server.start()
        note(
            f"seed {seed}; redis-server pid {main_server.pid} "
            f"({'results, record' if args.broker else 'broker, results, record'}), "
            f"lock store pid {lock_server.pid} (appendonly)"
        )
        urls = [
            args.broker or main_server.url_for(BROKER_DB),
            main_server.url_for(BACKEND_DB),
            lock_server.url_for(0),
            main_server.url_for(RECORD_DB),
        ]
        # On a shared RabbitMQ, queues of this run's own, so that runs do not take each
        # other's messages; the private Redis needs none.
        suffix = f"-chaos-{seed:x}-{os.getpid()}" if args.broker else ""
        env = pipeline_env(urls, args.work_seconds, suffix)
        os.environ.update({k: v for k, v in env.items() if k != "PYTHONPATH"})
        from examples.pipeline import app as pipeline  # noqa: PLC0415 - reads PIPELINE_* on import

        queues = [pipeline.QUEUES[stage] for stage in STAGES]
        if args.broker:
            with pipeline.app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=2)  # unreachable: fail now, not at startup
            note(f"broker {conn.as_uri()}: queues {', '.join(queues)}")
        records = pipeline.records
        faults = Faults()
        lock_options = worker_lock_options(lock_server.url_for(0), args.lock_ttl, "skip")
        workers = stage_workers(env, lock_options, args.concurrency, log_dir)
        by_stage = dict(zip(STAGES, workers, strict=True))
        broker = (
            RabbitBroker(
                pipeline.app, queues, by_stage, faults.kills,
                lambda stage: busy_pids(records, stage), rng,
            )
            if args.broker
            else RedisBroker(pipeline.app, main_server.client(BROKER_DB), queues)
        )  # fmt: skip
        start_workers(workers)
        note("workers ready: " + ", ".join(f"{s} (pid {w.pid})" for s, w in by_stage.items()))

        producer = subprocess.Popen(
            [sys.executable, "-m", "examples.pipeline.producer", "--requests", str(requests),
             "--copies", str(args.copies), "--seed", str(seed), "--wait", f"{drain_timeout:g}"],
            cwd=ROOT, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, stdout=sys.stderr,
        )  # fmt: skip

        def all_done() -> bool:
            manifest = last_manifest(records)  # the producer writes it first thing
            if manifest is None:
                return False
            first = manifest["first"]
            return len(callbacks_done(records, range(first, first + requests))) == requests

        note(f"chaos for up to {chaos_seconds:g}s")
        chaos(
            rng,
            chaos_seconds,
            tuple(args.interval),
            {
                "kill": lambda: kill_pool_process(rng, by_stage, records, faults),
                "restart": lambda: restart_lock_store(rng, lock_server, args.outage, faults),
                "redeliver": broker.redeliver,
            },
            all_done,
        )
        note(
            f"chaos over: {faults.pool_kills} kills, {len(faults.outages)} restarts, "
            f"{broker.fault}: {broker.summary()}; waiting for the producer"
        )
        if producer.wait(timeout=drain_timeout) != 0:
            note(f"producer exited {producer.returncode}")
        manifest = last_manifest(records)
        if manifest is None:
            raise RuntimeError("the producer wrote no manifest")
        run_requests = range(manifest["first"], manifest["first"] + manifest["count"])
        drained = wait_drained(records, broker.outstanding, run_requests, drain_timeout)
        found = find_violations(records, run_requests, faults)
        if not drained:
            found.violate("the run drained", f"not drained within {drain_timeout:g}s")
        print(f"chaos summary (seed {seed}):")
        print(summary(manifest, faults, broker, found, time.monotonic() - began))
        for check, problems in found.violations.items():
            print(f"VIOLATION: {check}:")
            for problem in problems[:20]:
                print(f"    {problem}")
            if len(problems) > 20:
                print(f"    ... and {len(problems) - 20} more")
        status = 1 if found.violations else 2 if producer.returncode != 0 else 0
    except KeyboardInterrupt:
        note("interrupted")
        status = 130
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired, OperationalError) as exc:
        note(f"failed: {exc}")
        status = 2
    finally:
        if producer is not None and producer.poll() is None:
            producer.kill()
            producer.wait(10)
        stop_workers(workers)
        if broker is not None:
            broker.close()  # on RabbitMQ: deletes this run's queues
        lock_server.stop()
        main_server.stop()
        if status != 0:
            for worker in workers:
                tail = worker.log().splitlines()[-15:]
                note(f"last lines of {worker.logfile}:\n    " + "\n    ".join(tail))
        if status == 0 and args.logs is None:
            shutil.rmtree(work_dir, ignore_errors=True)
        note(f"stopped everything; exit status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
