"""Duplicate storm: many copies of few requests through a real prefork worker.

10k messages over 1k request ids (ten copies of each, shuffled) go to a four-process worker; the
task counts each execution of its body, per request id. Every request must run exactly once:
the other copies find the lease held (a copy running now) or the done-marker (a copy that
finished) and are skipped. The storm's time is set against 10k messages of a plain no-op task
on the same worker, pairwise, round by round.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery_lock.testing import RedisServer

from .stats import Summary, paired_ratios, rounds
from .workers import LOCK_DB, RECORD_DB, BenchError, bench_app, publish, running_worker

STORM = "storm (LockedTask)"
PLAIN = "plain no-op Task"


@dataclass(frozen=True)
class Options:
    """How big a storm."""

    messages: int = 10_000
    requests: int = 1_000
    processes: int = 4
    rounds: int = 3

    def timeout(self) -> float:
        """Bound on one drain."""
        return 60 + self.messages / 20


def miscounted_requests(counts: Mapping[bytes | str, bytes | str], requests: int) -> list[str]:
    """The requests of one storm round not run exactly once, from the executions counted per
    request id (``counts``), as ``"<id> ran <n> times"``: a total alone would let a request run
    twice hide behind one that never ran."""
    found = [
        f"{idx.decode() if isinstance(idx, bytes) else idx} ran {int(n)} times"
        for idx, n in sorted(counts.items(), key=lambda item: int(item[0]))
        if int(n) != 1
    ]
    if len(counts) < requests:
        found.append(f"{requests - len(counts)} never ran")
    return found


def run(server: RedisServer, options: Options) -> dict[str, Any]:
    """Run storms and plain batches alternately; check every storm's execution count."""
    module = bench_app(server)
    record = server.client(RECORD_DB)
    lock_store = server.client(LOCK_DB)
    lock_store.flushdb()
    samples: dict[str, dict[str, list[float]]] = {
        name: {"publish_s": [], "drain_s": [], "drain_cpu_s": []} for name in (STORM, PLAIN)
    }
    executions: list[int] = []
    miscounted: list[str] = []
    next_id = 0
    try:
        with running_worker(server, module.app, options.processes) as worker:
            for task in (module.storm, module.plain):  # connections, scripts, imports
                queue = f"bench.storm.warm.{task.name}"
                publish(task, range(next_id, next_id + 50), queue)
                next_id += 50
                worker.drain(queue, options.timeout())
            for number, order in rounds([STORM, PLAIN], options.rounds, "storm"):
                for name in order:
                    queue = f"bench.storm.{number}.{name.split()[0]}"
                    base, next_id = next_id, next_id + options.messages
                    if name == STORM:
                        ids = [base + i % options.requests for i in range(options.messages)]
                        random.Random(number).shuffle(ids)
                        record.delete(module.EXECUTIONS_KEY)
                        task = module.storm
                    else:
                        ids = list(range(base, base + options.messages))
                        task = module.plain
                    samples[name]["publish_s"].append(publish(task, ids, queue))
                    drained = worker.drain(queue, options.timeout())
                    samples[name]["drain_s"].append(drained.seconds)
                    samples[name]["drain_cpu_s"].append(drained.cpu_seconds)
                    if name == STORM:
                        counts = record.hgetall(module.EXECUTIONS_KEY)
                        executions.append(sum(int(n) for n in counts.values()))
                        miscounted += miscounted_requests(counts, options.requests)
        leases_left = sum(1 for _ in lock_store.scan_iter(match="*:lock", count=1000))
    finally:
        lock_store.flushdb()
        lock_store.close()
        record.close()
    if any(n != options.requests for n in executions) or miscounted or leases_left:
        raise BenchError(
            f"storm: executions per round {executions} (expected {options.requests} each), "
            f"requests not run exactly once: {miscounted[:10] or 'none'}, "
            f"{leases_left} leases left in the store"
        )
    storm, plain = samples[STORM]["drain_s"], samples[PLAIN]["drain_s"]
    return {
        "options": {
            "messages": options.messages,
            "requests": options.requests,
            "processes": options.processes,
            "rounds": options.rounds,
        },
        "executions": executions,
        "leases_left": leases_left,
        "storm_s": Summary.of(storm).as_dict(),
        "plain_s": Summary.of(plain).as_dict(),
        "time_ratio": Summary.of(paired_ratios(storm, plain)).as_dict(),
        "cpu_ratio": Summary.of(
            paired_ratios(samples[STORM]["drain_cpu_s"], samples[PLAIN]["drain_cpu_s"])
        ).as_dict(),
        "samples": samples,
    }
