"""End to end: a real prefork worker, Redis broker, results ignored, unique request ids.

Per worker size (1, 2, 4 processes) one worker runs every contender: plain ``Task``, the floor
(``SET NX PX`` before the body and a compare-and-delete after it, two round trips and nothing
else), celery-lock's ``LockedTask``, celery-once's ``QueueOnce`` and celery-singleton's
``Singleton`` (the same no-op body, all acking late). Each round publishes N messages per
contender into a queue of its own and then lets the worker drain it; the order of the
contenders rotates from round to round.

Three rates per contender:

- **publish**: messages per second through the task's own ``apply_async`` (celery-once and
  celery-singleton take their lock there, one round trip per message);
- **worker**: tasks per second while the worker drains the queue (celery-lock and the floor take
  and release their lease here, two round trips per task; the peers release theirs here, one
  round trip);
- **end to end**: N / (publish time + drain time): every round trip each contender adds,
  wherever it adds it. This is the fair line for comparing with the peers.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from celery_lock.testing import RedisServer

from .lockcycle import FLOOR
from .stats import Summary, paired_ratios, rounds
from .workers import LOCK_DB, ROLES, bench_app, cpu_seconds, publish, running_worker

PLAIN = "plain Task"
LOCKED = "celery-lock"


@dataclass(frozen=True)
class Options:
    """How much to measure."""

    processes: tuple[int, ...] = (1, 2, 4)
    rounds: int = 5
    tasks: int = 2000
    warmup: int = 100
    contenders: tuple[str, ...] = field(default=())  # empty: all that load

    def timeout(self, count: int) -> float:
        """Bound on one drain: very generous, since the machine may be shared."""
        return 60 + count / 20


def contenders(module: Any) -> dict[str, Any]:
    """Contender name -> its task, in the bench's order."""
    return {PLAIN: module.plain, FLOOR: module.floor, LOCKED: module.locked, **module.PEER_TASKS}


def leftovers(client: redis.Redis) -> dict[str, int]:
    """What the contenders left in the lock store, by kind of key (then flush it)."""
    kinds: dict[str, Callable[[str], bool]] = {
        "celery-lock leases": lambda k: k.startswith("celery-lock:") and k.endswith(":lock"),
        "celery-lock done-markers": lambda k: k.startswith("celery-lock:") and ":done:" in k,
        "celery-lock fences": lambda k: k.startswith("celery-lock:") and k.endswith(":fence"),
        "floor locks": lambda k: k.startswith("bench:floor:"),
        "celery-once locks": lambda k: k.startswith("qo_"),
        "celery-singleton locks": lambda k: k.startswith("SINGLETONLOCK_"),
    }
    counts = dict.fromkeys(kinds, 0)
    counts["other"] = 0
    for raw in client.scan_iter(count=1000):
        key = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        kind = next((name for name, test in kinds.items() if test(key)), "other")
        counts[kind] += 1
    client.flushdb()
    return counts


def run(server: RedisServer, options: Options) -> dict[str, Any]:
    """Measure every contender at every worker size; pairwise, by rounds."""
    module = bench_app(server)
    tasks = contenders(module)
    if options.contenders:
        tasks = {k: v for k, v in tasks.items() if k in options.contenders}
    lock_store = server.client(LOCK_DB)
    lock_store.flushdb()
    next_id = 0
    server_pid = server.pid or 0
    by_size: dict[str, Any] = {}
    try:
        for size in options.processes:
            load: list[float] = []  # 1-minute load average as each round starts
            samples: dict[str, dict[str, list[float]]] = {
                name: {
                    "publish_s": [],
                    "drain_s": [],
                    "publish_cpu_s": [],
                    "drain_cpu_s": [],
                    **{f"drain_cpu_{role}_s": [] for role in ROLES},
                }
                for name in tasks
            }
            with running_worker(server, module.app, size) as worker:
                for name, task in tasks.items():  # connections, scripts, imports
                    queue = f"bench.warm.{size}.{name}"
                    publish(task, range(next_id, next_id + options.warmup), queue)
                    next_id += options.warmup
                    worker.drain(queue, options.timeout(options.warmup))
                label = f"endtoend, {size} processes"
                for number, order in rounds(list(tasks), options.rounds, label):
                    load.append(round(os.getloadavg()[0], 2))
                    for name in order:
                        queue = f"bench.e2e.{size}.{number}.{name}"
                        ids = range(next_id, next_id + options.tasks)
                        next_id += options.tasks
                        cpu = time.process_time() + cpu_seconds(server_pid)
                        samples[name]["publish_s"].append(publish(tasks[name], ids, queue))
                        cpu = time.process_time() + cpu_seconds(server_pid) - cpu
                        samples[name]["publish_cpu_s"].append(cpu)
                        drained = worker.drain(queue, options.timeout(options.tasks))
                        samples[name]["drain_s"].append(drained.seconds)
                        samples[name]["drain_cpu_s"].append(drained.cpu_seconds)
                        for role, seconds in drained.cpu_by_role.items():
                            samples[name][f"drain_cpu_{role}_s"].append(seconds)
            by_size[str(size)] = {
                "contenders": _summarize(samples, options.tasks),
                "load_by_round": load,
                "left_in_store": leftovers(lock_store),
            }
    finally:
        lock_store.close()
    return {
        "options": {
            "processes": list(options.processes),
            "rounds": options.rounds,
            "tasks": options.tasks,
        },
        "by_processes": by_size,
        "unavailable": dict(module.UNAVAILABLE),
    }


def _summarize(samples: dict[str, dict[str, list[float]]], count: int) -> dict[str, Any]:
    rates: dict[str, dict[str, list[float]]] = {}
    for name, s in samples.items():
        rates[name] = {
            "publish": [count / t for t in s["publish_s"]],
            "worker": [count / t for t in s["drain_s"]],
            "end_to_end": [
                count / (p + d) for p, d in zip(s["publish_s"], s["drain_s"], strict=True)
            ],
            # Tasks per CPU-second (worker processes and redis-server; plus this process and
            # redis-server while publishing): the rate a saturated machine would reach.
            # NaN, not left out, where no CPU was read: the rounds stay paired across contenders.
            "worker_cpu": [count / t if t else math.nan for t in s["drain_cpu_s"]],
            "end_to_end_cpu": [
                count / (p + d) if p + d else math.nan
                for p, d in zip(s["publish_cpu_s"], s["drain_cpu_s"], strict=True)
            ],
        }
    plain = rates.get(PLAIN)
    out: dict[str, Any] = {}
    for name, by_metric in rates.items():
        entry: dict[str, Any] = {"samples": by_metric}
        for metric, values in by_metric.items():
            entry[metric] = Summary.of(values).as_dict()
            if plain is not None:
                ratios = paired_ratios(values, plain[metric])
                entry[f"{metric}_ratio"] = Summary.of(ratios).as_dict()
        # Where the worker's CPU goes, µs per task: the lock's round trips are paid in the pool
        # processes and the redis-server, while the main process (the broker's side) is the
        # one a small worker is bound by.
        entry["worker_cpu_us_by_role"] = {
            role: Summary.of(
                [t / count * 1e6 for t in samples[name][f"drain_cpu_{role}_s"]]
            ).as_dict()
            for role in ROLES
        }
        out[name] = entry
    return out
