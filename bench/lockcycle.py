"""Lock cycle: acquire and release one fresh key, one client, one thread, in a tight loop.

The floor is what any safe Redis lock needs: ``SET key token NX PX`` and one ``EVALSHA`` of a
compare-and-delete script, sent exactly as ``LockStore`` sends its scripts (on the connection it
holds, each command packed by hiredis in one call), so that it measures the protocol rather than
the client; the same two commands through redis-py's pool are shown too. Beside them, on the
same server and in the same rounds:

- celery-lock's :class:`~celery_lock.store.LockStore` (acquire script, release script with its
  done-marker), alone and with the lease handed to the per-process heartbeat as LockedTask does;
- celery-lock's two scripts by bare ``EVALSHA``, sent as the floor is (no library code: what the
  server's work and the bigger payload cost on their own);
- the *scripted floor*: the floor with its ``SET NX PX`` run inside a script, so two ``EVALSHA``
  that do nothing else. The contract makes the grant a script (done-marker check, fence and lease
  in one atomic step); this row is the least such a lock can cost, and splits the gap between the
  floor and celery-lock into what a scripted grant costs and what the grant's own work costs;
- redis-py's ``Lock``, python-redis-lock's ``Lock`` (with and without ``auto_renewal``, which
  starts a thread per acquisition) and pottery's ``Redlock`` (one master).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from celery_lock.heartbeat import Heartbeat
from celery_lock.keys import RequestKeys
from celery_lock.lease import Acquired, Holder, Lease, new_token
from celery_lock.scripts import ACQUIRE, RELEASE
from celery_lock.store import LockStore

from .stats import Summary, paired_ratios, rounds

FLOOR = "floor: SET NX PX + EVALSHA"
FLOOR_POOLED = "floor, through redis-py's pool"
CELERY_LOCK = "celery-lock LockStore"
BARE = "celery-lock scripts, bare EVALSHA"
SCRIPTED_FLOOR = "scripted floor: EVALSHA (SET NX PX) + EVALSHA"
LEAN = "celery-lock's steps, leanest scripts"

#: A redis-py Lock's release: compare the token, delete.
COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""

#: The scripted floor's grant: the floor's SET NX PX, inside a script.
SET_NX_PX = """
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
"""

#: The grant's steps in as few and as cheap Redis calls as they go: EXISTS for the done-marker,
#: the fence (SET NX PX of a new counter at the clock, ARGV[5], else INCR), then SET NX for the
#: lease; no re-entrance and no holder reply, so *not* what the contract asks of a grant. Only
#: its server time is read: is there a cheaper way to do the work?
LEAN_ACQUIRE = """
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local fence = ARGV[5]
if not redis.call('SET', KEYS[2], fence, 'NX', 'PX', ARGV[4]) then
    fence = redis.call('INCR', KEYS[2])
    redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
if not redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. fence .. ' ' .. ARGV[3], 'NX', 'PX', ARGV[2])
then
    return -1
end
return tonumber(fence)
"""
#: The release's steps likewise: compare the token by a fixed-length prefix, delete, mark done.
LEAN_RELEASE = """
local lock = redis.call('GET', KEYS[1])
if lock and string.sub(lock, 1, #ARGV[1]) == ARGV[1] then
    redis.call('DEL', KEYS[1])
    redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[2])
    return 1
end
return 0
"""

TTL_MS = 60_000
DONE_TTL_MS = 3_600_000
HOLDER = Holder(
    task_id="00000000-0000-4000-8000-000000000000",
    task_name="bench.cycle",
    host="bench@host",
    pid=0,
)

#: One lock cycle on the key numbered ``n`` (fresh for every call).
Cycle = Callable[[int], None]


@dataclass(frozen=True)
class Options:
    """How much to measure."""

    rounds: int = 9
    cycles: int = 2000
    warmup: int = 200


def _floor(store: LockStore, stack: ExitStack) -> Cycle:
    sha = store.client.script_load(COMPARE_AND_DELETE)
    # The store's own command path: its held connection, the command packed in one call as
    # LockStore packs its scripts; so the floor is what the protocol costs, not the client.
    send = store._send

    def cycle(n: int) -> None:
        key, token = f"bench:floor:{n}", secrets.token_hex(16)
        if send(("SET", key, token, "NX", "PX", TTL_MS)) is None:
            raise RuntimeError(f"{key} was taken")
        send(("EVALSHA", sha, 1, key, token))

    return cycle


def _scripted_floor(store: LockStore, stack: ExitStack) -> Cycle:
    grant = store.client.script_load(SET_NX_PX)
    release = store.client.script_load(COMPARE_AND_DELETE)
    send = store._send  # as the floor sends

    def cycle(n: int) -> None:
        key, token = f"bench:scripted-floor:{n}", secrets.token_hex(16)
        if send(("EVALSHA", grant, 1, key, token, TTL_MS)) is None:
            raise RuntimeError(f"{key} was taken")
        send(("EVALSHA", release, 1, key, token))

    return cycle


def _floor_pooled(store: LockStore, stack: ExitStack) -> Cycle:
    client = store.client
    sha = client.script_load(COMPARE_AND_DELETE)

    def cycle(n: int) -> None:
        key, token = f"bench:floor-pooled:{n}", secrets.token_hex(16)
        if not client.set(key, token, nx=True, px=TTL_MS):
            raise RuntimeError(f"{key} was taken")
        client.evalsha(sha, 1, key, token)

    return cycle


def _granted(store: LockStore, tag: str, n: int) -> Lease:
    """A lease on a fresh key, granted by :meth:`LockStore.acquire` as a task's is."""
    keys = RequestKeys.build("bench", tag, str(n), "bench.cycle")
    token = new_token()
    outcome = store.acquire(keys, token, TTL_MS, HOLDER, DONE_TTL_MS)
    if not isinstance(outcome, Acquired):
        raise RuntimeError(f"{keys.lock}: {outcome}")
    return Lease(store, keys, token, TTL_MS, outcome.fence, HOLDER)


def _celery_lock(store: LockStore, stack: ExitStack) -> Cycle:
    def cycle(n: int) -> None:
        lease = _granted(store, "cycle", n)
        store.release(lease, success=True, done_ttl_ms=DONE_TTL_MS)

    return cycle


def _celery_lock_heartbeat(store: LockStore, stack: ExitStack) -> Cycle:
    heartbeat = Heartbeat()
    heartbeat.start()
    stack.callback(heartbeat.stop)
    interval = TTL_MS / 3000

    def cycle(n: int) -> None:
        lease = _granted(store, "cycle-hb", n)
        heartbeat.add(lease, interval)
        heartbeat.discard(lease)
        store.release(lease, success=True, done_ttl_ms=DONE_TTL_MS)

    return cycle


def _scripts_by_evalsha(
    acquire_script: str, release_script: str, tag: str
) -> Callable[[LockStore, ExitStack], Cycle]:
    """A cycle of an acquire and a release script with celery-lock's keys and arguments, sent
    by bare ``EVALSHA`` the way the floor sends its commands (no library code around them)."""

    def setup(store: LockStore, stack: ExitStack) -> Cycle:
        acquire = store.client.script_load(acquire_script)
        release = store.client.script_load(release_script)
        send = store._send

        def cycle(n: int) -> None:
            keys = RequestKeys.build("bench", tag, str(n), "bench.cycle")
            token = new_token()
            now_us = time.time_ns() // 1000
            described = HOLDER.describe(now_us // 1000)
            send(("EVALSHA", acquire, 3, keys.lock, keys.fence, keys.done, token, TTL_MS,
                  described, DONE_TTL_MS, now_us))  # fmt: skip
            send(("EVALSHA", release, 2, keys.lock, keys.done, token, DONE_TTL_MS, "success",
                  HOLDER.task_id))  # fmt: skip

        return cycle

    return setup


_bare_scripts = _scripts_by_evalsha(ACQUIRE, RELEASE, "bare")
_lean_scripts = _scripts_by_evalsha(LEAN_ACQUIRE, LEAN_RELEASE, "lean")


def _redis_py(store: LockStore, stack: ExitStack) -> Cycle:
    client = store.client

    def cycle(n: int) -> None:
        lock = client.lock(f"bench:redis-py:{n}", timeout=TTL_MS / 1000)
        if not lock.acquire(blocking=False):
            raise RuntimeError("not acquired")
        lock.release()

    return cycle


def _python_redis_lock(auto_renewal: bool) -> Callable[[LockStore, ExitStack], Cycle]:
    def setup(store: LockStore, stack: ExitStack) -> Cycle:
        import redis_lock  # type: ignore[import-untyped]  # noqa: PLC0415 - optional peer

        client = store.client
        tag = "renewing" if auto_renewal else "plain"

        def cycle(n: int) -> None:
            lock = redis_lock.Lock(
                client, f"bench:{tag}:{n}", expire=TTL_MS // 1000, auto_renewal=auto_renewal
            )
            if not lock.acquire(blocking=False):
                raise RuntimeError("not acquired")
            lock.release()

        return cycle

    return setup


def _pottery(store: LockStore, stack: ExitStack) -> Cycle:
    from pottery import Redlock  # noqa: PLC0415 - optional peer

    masters = {store.client}

    def cycle(n: int) -> None:
        lock = Redlock(key=f"bench:pottery:{n}", masters=masters, auto_release_time=TTL_MS / 1000)
        if not lock.acquire(blocking=False):
            raise RuntimeError("not acquired")
        lock.release()

    return cycle


CONTENDERS: dict[str, Callable[[LockStore, ExitStack], Cycle]] = {
    FLOOR: _floor,
    SCRIPTED_FLOOR: _scripted_floor,
    FLOOR_POOLED: _floor_pooled,
    CELERY_LOCK: _celery_lock,
    "celery-lock LockStore + heartbeat": _celery_lock_heartbeat,
    BARE: _bare_scripts,
    "redis-py Lock": _redis_py,
    "python-redis-lock": _python_redis_lock(auto_renewal=False),
    "python-redis-lock auto_renewal": _python_redis_lock(auto_renewal=True),
    "pottery Redlock": _pottery,
}

#: The cycles whose server work tells the scripts' cost apart: the floors, celery-lock's scripts
#: and the leanest scripts for its steps (timed only on the server, not a contender).
SERVER_SIDE: dict[str, Callable[[LockStore, ExitStack], Cycle]] = {
    FLOOR: _floor,
    SCRIPTED_FLOOR: _scripted_floor,
    BARE: _bare_scripts,
    LEAN: _lean_scripts,
}


def _timed(cycle: Cycle, start: int, count: int) -> float:
    """Cycles per second over ``count`` fresh keys."""
    began = time.perf_counter()
    for n in range(start, start + count):
        cycle(n)
    return count / (time.perf_counter() - began)


def run(url: str, options: Options) -> dict[str, Any]:
    """Measure every contender on one client of the store at ``url``; pairwise, by rounds."""
    store = LockStore.from_url(url)
    unavailable: dict[str, str] = {}
    cycles: dict[str, Cycle] = {}
    samples: dict[str, list[float]] = {}
    with ExitStack() as stack:
        stack.callback(store.client.close)
        for name, setup in CONTENDERS.items():
            try:
                cycles[name] = setup(store, stack)
                cycles[name](-1)  # one cycle outside the clock: imports, scripts, connections
            except Exception as exc:  # a peer that does not work here is reported, not fatal
                unavailable[name] = f"{type(exc).__name__}: {exc}"
                cycles.pop(name, None)
        for name, cycle in cycles.items():
            _timed(cycle, 10_000_000, options.warmup)
            samples[name] = []
        next_key = 0
        for _, order in rounds(list(cycles), options.rounds, "lockcycle"):
            for name in order:
                samples[name].append(_timed(cycles[name], next_key, options.cycles))
                next_key += options.cycles
        store.client.flushdb()
    results: dict[str, Any] = {}
    floor = samples.get(FLOOR)
    for name, ops in samples.items():
        entry: dict[str, Any] = {"ops_per_s": Summary.of(ops).as_dict(), "samples": ops}
        entry["us_per_cycle"] = 1e6 / Summary.of(ops).median
        if floor is not None:
            entry["ratio_to_floor"] = Summary.of(paired_ratios(ops, floor)).as_dict()
        results[name] = entry
    return {
        "options": {"rounds": options.rounds, "cycles": options.cycles},
        "contenders": results,
        "unavailable": unavailable,
        "floor": FLOOR,
    }


def server_time_per_cycle(url: str, cycles: int = 2000, repeats: int = 7) -> dict[str, float]:
    """Microseconds the *server* spends per cycle (``INFO commandstats``), median of
    ``repeats`` runs of ``cycles`` each, the contenders alternating.

    Tells the scripts' own work apart from the client's: the floor runs a SET and a two-command
    script, the scripted floor a one-command and a two-command script, celery-lock's acquire
    script five commands and its release script three. The leanest scripts for the same steps
    (:data:`LEAN_ACQUIRE`, :data:`LEAN_RELEASE`) are timed too. One run is a few milliseconds
    of server time, which a hiccup of the machine would skew; hence the median.
    """
    store = LockStore.from_url(url)
    client = store.client
    # What the client sends; a script's time includes the commands it runs.
    sent = {
        FLOOR: ("cmdstat_set", "cmdstat_evalsha"),
        SCRIPTED_FLOOR: ("cmdstat_evalsha",),
        BARE: ("cmdstat_evalsha",),
        LEAN: ("cmdstat_evalsha",),
    }
    found: dict[str, list[float]] = {name: [] for name in sent}
    with ExitStack() as stack:
        stack.callback(client.close)
        cycles_of = {name: SERVER_SIDE[name](store, stack) for name in sent}
        for cycle in cycles_of.values():
            cycle(-2)  # outside the count: scripts loaded, connection made
        next_key = 20_000_000
        for _ in range(repeats):
            for name, commands in sent.items():
                cycle = cycles_of[name]
                client.config_resetstat()
                for n in range(next_key, next_key + cycles):
                    cycle(n)
                next_key += cycles
                stats: dict[str, Any] = client.info("commandstats")
                used = sum(int(stats.get(c, {}).get("usec", 0)) for c in commands)
                found[name].append(used / cycles)
        client.flushdb()
    return {name: Summary.of(values).median for name, values in found.items()}
