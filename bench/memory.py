"""Memory: worker RSS over many locked tasks, and what the lock store holds afterwards.

A two-process worker runs a warm-up, then N locked tasks in equal chunks; after each chunk the
RSS of the main process and of each pool process is read from ``/proc`` and the connections to
the lock store are counted (``CLIENT LIST``). A lease or client leaked per task would show as a
slope. The same run with a plain task gives Celery's own baseline.

Afterwards the lock store must hold only done-markers and fence counters, each with a TTL, and
no lease. ``MEMORY USAGE`` gives the bytes of a done-marker (and of a fence counter);
``used_memory`` before and after flushing the store gives the all-in cost per request
(both keys, their expiry entries, the allocator's rounding).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import redis

from celery_lock.testing import RedisServer

from .progress import note
from .workers import LOCK_DB, BenchError, bench_app, publish, rss_kib, running_worker

#: Name the bench's own connection to the lock store, so it is not counted as the worker's.
INSPECTOR = "bench-inspector"


@dataclass(frozen=True)
class Options:
    """How long a run."""

    tasks: int = 100_000
    checkpoints: int = 10
    warmup: int = 2_000
    processes: int = 2
    baseline: bool = True
    sample_keys: int = 200

    def timeout(self, count: int) -> float:
        """Bound on draining one chunk."""
        return 60 + count / 20


def _lock_store_clients(client: redis.Redis) -> int:
    return sum(
        1
        for c in client.client_list()
        if int(c.get("db", -1)) == LOCK_DB and c.get("name") != INSPECTOR
    )


def _worker_run(
    server: RedisServer, module: Any, task: Any, options: Options, inspector: redis.Redis
) -> dict[str, Any]:
    chunk = options.tasks // options.checkpoints
    queue = f"bench.memory.{task.name}"
    rows: list[dict[str, Any]] = []
    # This process may hold connections to the store too (celery-once's and celery-singleton's
    # clients, after the end-to-end section): count only what the worker adds.
    others = _lock_store_clients(inspector)
    with running_worker(server, module.app, options.processes) as worker:
        worker.consume(queue)
        publish(task, range(10_000_000, 10_000_000 + options.warmup), queue)
        worker.wait_drained(queue, options.timeout(options.warmup))
        main, pool = worker.process.pid, worker.pool_pids()

        def sample(done: int) -> None:
            rows.append(
                {
                    "tasks": done,
                    "main_kib": rss_kib(main) if main else None,
                    "pool_kib": [rss_kib(pid) for pid in pool],
                    "lock_store_clients": _lock_store_clients(inspector) - others,
                }
            )

        sample(0)
        for number in range(options.checkpoints):
            ids = range(number * chunk, (number + 1) * chunk)
            publish(task, ids, queue)
            worker.wait_drained(queue, options.timeout(chunk))
            sample((number + 1) * chunk)
            note(f"memory, {task.name}: {(number + 1) * chunk:,} of {options.tasks:,} tasks")
        same_pool = worker.pool_pids() == pool
        worker.stop_consuming(queue)
    first, last = rows[0], rows[-1]
    growth = [b - a for a, b in zip(first["pool_kib"], last["pool_kib"], strict=True) if a and b]
    half = rows[len(rows) // 2]
    late_growth = [
        b - a for a, b in zip(half["pool_kib"], last["pool_kib"], strict=True) if a and b
    ]
    return {
        "task": task.name,
        "processes": options.processes,
        "checkpoints": rows,
        "pool_processes_unchanged": same_pool,
        "pool_growth_kib": growth,
        "pool_growth_second_half_kib": late_growth,
        "main_growth_kib": (last["main_kib"] or 0) - (first["main_kib"] or 0),
    }


def store_contents(client: redis.Redis, sample_keys: int) -> dict[str, Any]:
    """Classify the lock store's keys, check their TTLs, and size done-markers and fences."""
    counts = {"leases": 0, "done_markers": 0, "fences": 0, "other": 0}
    without_ttl = 0
    ttls_ms: dict[str, list[int]] = {kind: [] for kind in counts}
    samples: dict[str, list[str]] = {"done_markers": [], "fences": []}
    batch: list[tuple[str, str]] = []

    def check(keys: list[tuple[str, str]]) -> None:
        nonlocal without_ttl
        pipe = client.pipeline(transaction=False)
        for key, _ in keys:
            pipe.pttl(key)
        for (_, kind), ttl in zip(keys, pipe.execute(), strict=True):
            if ttl < 0:
                without_ttl += 1
            else:
                ttls_ms[kind].append(ttl)

    for raw in client.scan_iter(count=1000):
        key = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        if key.endswith(":lock"):
            kind = "leases"
        elif ":done:" in key:
            kind = "done_markers"
        elif key.endswith(":fence"):
            kind = "fences"
        else:
            kind = "other"
        counts[kind] += 1
        if kind in samples and len(samples[kind]) < sample_keys:
            samples[kind].append(key)
        batch.append((key, kind))
        if len(batch) >= 1000:
            check(batch)
            batch = []
    if batch:
        check(batch)
    sizes: dict[str, Any] = {}
    for kind, keys in samples.items():
        usage = [int(client.memory_usage(k, samples=0) or 0) for k in keys]
        sizes[kind] = {
            "median_bytes": statistics.median(usage) if usage else None,
            "low": min(usage, default=None),
            "high": max(usage, default=None),
            "sampled": len(usage),
        }
    before = int(client.info("memory")["used_memory"])
    client.flushdb()
    after = int(client.info("memory")["used_memory"])
    requests = counts["done_markers"] or 1
    every_ttl = [ttl for kind in ttls_ms.values() for ttl in kind]
    return {
        "keys": counts,
        "keys_without_ttl": without_ttl,
        # Over every key: what runs made before the kinds were told apart recorded.
        "ttl_s": _ttl_range(every_ttl),
        # Per kind: a fence counter outlives its done-marker by a lease TTL.
        "ttl_s_by_kind": {kind: _ttl_range(ttls) for kind, ttls in ttls_ms.items()},
        "memory_usage": sizes,
        "used_memory_per_request_bytes": (before - after) / requests,
    }


def _ttl_range(ttls_ms: list[int]) -> dict[str, float] | None:
    """The shortest and longest of some TTLs, in seconds; ``None`` for none."""
    return {"min": min(ttls_ms) / 1000, "max": max(ttls_ms) / 1000} if ttls_ms else None


def run(server: RedisServer, options: Options) -> dict[str, Any]:
    """The locked run (and the plain baseline), then the lock store's contents."""
    module = bench_app(server)
    inspector = server.client(LOCK_DB, client_name=INSPECTOR)
    inspector.flushdb()
    try:
        runs: dict[str, Any] = {}
        if options.baseline:
            runs["plain Task"] = _worker_run(server, module, module.plain, options, inspector)
        runs["celery-lock"] = _worker_run(server, module, module.locked, options, inspector)
        store = store_contents(inspector, options.sample_keys)
    finally:
        inspector.close()
    expected = options.tasks + options.warmup
    if store["keys"]["done_markers"] != expected or store["keys"]["leases"]:
        raise BenchError(f"lock store after the run: {store['keys']} (expected {expected} done)")
    return {
        "options": {
            "tasks": options.tasks,
            "checkpoints": options.checkpoints,
            "warmup": options.warmup,
            "processes": options.processes,
        },
        "runs": runs,
        "store": store,
    }
