"""The lease scripts against a real redis-server: outcomes, fences, re-entrancy, done-markers."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest
import redis
from conftest import command_calls, consecutive, granted, wait_for
from hypothesis import given
from hypothesis import strategies as st

from celery_lock import store as store_module
from celery_lock.exceptions import LockStateError, LockStoreError
from celery_lock.keys import RequestKeys
from celery_lock.lease import (
    Acquired,
    Done,
    Held,
    Holder,
    Lease,
    LockEntry,
    decode_lock,
    new_token,
)
from celery_lock.store import LockStore
from celery_lock.testing import RedisServer

HOLDER = Holder(task_id="task-1", task_name="shop.process", host="host-a", pid=101)
OTHER = Holder(task_id="task-2", task_name="shop.process", host="host-b", pid=202)
KEYS = RequestKeys.build("celery-lock", "shop.process", "42", "shop.process")
TTL_MS = 5_000
FENCE_TTL_MS = 60_000


def acquire(store: LockStore, token: str, holder: Holder = HOLDER, keys: RequestKeys = KEYS):
    return store.acquire(keys, token, TTL_MS, holder, FENCE_TTL_MS)


def lease_for(store: LockStore, token: str, fence: int, holder: Holder = HOLDER) -> Lease:
    return Lease(store, KEYS, token, TTL_MS, fence, holder)


def test_a_new_request_s_first_fence_is_the_clock_in_microseconds(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    store = LockStore.from_url(lock_url)
    before = time.time_ns() // 1000
    fence = granted(acquire(store, new_token()))
    assert before <= fence <= time.time_ns() // 1000
    assert lock_redis.get(KEYS.fence) == str(fence).encode()
    lock = decode_lock(lock_redis.get(KEYS.lock))
    assert lock.fence == fence
    assert lock.holder == HOLDER
    assert 0 < lock_redis.pttl(KEYS.lock) <= TTL_MS
    assert 0 < lock_redis.pttl(KEYS.fence) <= FENCE_TTL_MS


def test_second_token_sees_held_with_holder_and_ttl(lock_url: str) -> None:
    store = LockStore.from_url(lock_url)
    acquire(store, new_token())
    outcome = acquire(store, new_token(), OTHER)
    assert isinstance(outcome, Held)
    assert outcome.task_id == "task-1"
    assert outcome.task_name == "shop.process"
    assert 0 < outcome.pttl_ms <= TTL_MS


def test_acquire_is_reentrant_for_the_same_token(lock_url: str) -> None:
    store = LockStore.from_url(lock_url)
    token = new_token()
    fence = granted(acquire(store, token))
    # A retried call after a lost reply must not report HELD against itself.
    assert acquire(store, token) == Acquired(fence=fence)


def test_a_reentrant_grant_resets_the_lease_s_ttl(lock_url: str, lock_redis: redis.Redis) -> None:
    # A retried acquire (its first reply lost) is a grant like any other: the lease it reports
    # runs a whole TTL from the retry, not from what the first try left of it.
    store = LockStore.from_url(lock_url)
    token = new_token()
    fence = granted(acquire(store, token))
    lock_redis.pexpire(KEYS.lock, 1_000)
    assert acquire(store, token) == Acquired(fence=fence)
    assert 1_000 < lock_redis.pttl(KEYS.lock) <= TTL_MS
    store.client.close()


def test_fence_increases_on_every_grant(lock_url: str) -> None:
    store = LockStore.from_url(lock_url)
    fences = []
    for _ in range(5):
        token = new_token()
        fences.append(granted(acquire(store, token)))
        store.release(lease_for(store, token, fences[-1]), success=False, done_ttl_ms=1000)
    assert consecutive(fences)


def test_successful_release_writes_done_marker(lock_url: str, lock_redis: redis.Redis) -> None:
    store = LockStore.from_url(lock_url)
    token = new_token()
    acquire(store, token)
    assert store.release(lease_for(store, token, 1), success=True, done_ttl_ms=30_000)
    assert not lock_redis.exists(KEYS.lock)
    assert lock_redis.get(KEYS.done) == b"task-1"
    assert 0 < lock_redis.pttl(KEYS.done) <= 30_000
    assert acquire(store, new_token(), OTHER) == Done(task_id="task-1")


def test_failed_release_frees_the_request_without_done_marker(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    store = LockStore.from_url(lock_url)
    token = new_token()
    fence = granted(acquire(store, token))
    assert store.release(lease_for(store, token, fence), success=False, done_ttl_ms=30_000)
    assert not lock_redis.exists(KEYS.done)
    assert acquire(store, new_token(), OTHER) == Acquired(fence=fence + 1)


def test_release_by_a_stale_token_changes_nothing(lock_url: str, lock_redis: redis.Redis) -> None:
    store = LockStore.from_url(lock_url)
    acquire(store, new_token())
    stale = lease_for(store, new_token(), 1)
    assert store.release(stale, success=True, done_ttl_ms=30_000) is False
    assert decode_lock(lock_redis.get(KEYS.lock)).holder.task_id == "task-1"
    assert not lock_redis.exists(KEYS.done)


def test_done_marker_is_per_task_name_within_a_scope(lock_url: str) -> None:
    store = LockStore.from_url(lock_url)
    pending = RequestKeys.build("celery-lock", "request", "7", "shop.pending")
    process = RequestKeys.build("celery-lock", "request", "7", "shop.process")
    assert pending.lock == process.lock
    token = new_token()
    fence = granted(acquire(store, token, keys=pending))
    lease = Lease(store, pending, token, TTL_MS, fence, HOLDER)
    store.release(lease, success=True, done_ttl_ms=30_000)
    # The pending stage finishing a request does not make it done for the process stage.
    assert acquire(store, new_token(), OTHER, keys=process) == Acquired(fence=fence + 1)


def test_extend_all_resets_ttls_in_one_round_trip(lock_url: str, lock_redis: redis.Redis) -> None:
    store = LockStore.from_url(lock_url)
    token = new_token()
    acquire(store, token)
    # Short of the TTL, but not so short that a stall of the machine lets the lease lapse
    # before the extend (100 ms did, once, in CI).
    lock_redis.pexpire(KEYS.lock, 2_000)
    stale = lease_for(store, new_token(), 1)
    store.extend_all([stale])  # loads the script: later beats are pure EVALSHA
    before = command_calls(lock_redis)
    assert store.extend_all([lease_for(store, token, 1), stale]) == [True, False]
    calls = command_calls(lock_redis) - before
    # Set to the TTL (5 s): not left at 2 s, nor added to what was left (7 s).
    assert 3_000 < lock_redis.pttl(KEYS.lock) <= 5_000
    # One EVALSHA per lease and nothing else: no SCRIPT EXISTS before the pipeline.
    assert calls["evalsha"] == 2
    assert calls["script|exists"] == 0


def test_extend_all_reloads_scripts_after_script_flush(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    store = LockStore.from_url(lock_url)
    token = new_token()
    acquire(store, token)
    lock_redis.script_flush()
    assert store.extend_all([lease_for(store, token, 1)]) == [True]


def test_tokens_are_128_bit_and_distinct() -> None:
    tokens = {new_token() for _ in range(1000)}
    assert len(tokens) == 1000
    assert all(len(token) == 32 for token in tokens)


@pytest.mark.parametrize("packed_by_hiredis", [True, False], ids=["hiredis", "redis-py"])
def test_a_lock_cycle_works_however_commands_are_packed(
    lock_url: str, lock_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch, packed_by_hiredis: bool
) -> None:
    """LockStore packs its commands with hiredis itself where redis-py would use hiredis, and
    leaves them to redis-py otherwise; both send the same bytes."""
    if not packed_by_hiredis:
        monkeypatch.setattr(store_module, "_pack_command", None)
    store = LockStore.from_url(lock_url)
    token = new_token()
    fence = granted(acquire(store, token))
    assert store._packs is packed_by_hiredis
    assert decode_lock(lock_redis.get(KEYS.lock)).holder == HOLDER
    assert store.release(lease_for(store, token, fence), success=True, done_ttl_ms=60_000)
    assert lock_redis.get(KEYS.done) == b"task-1"
    assert not lock_redis.exists(KEYS.lock)
    store.client.close()


@given(
    task_id=st.text(max_size=40),
    task_name=st.text(min_size=1, max_size=20),
    host=st.text(max_size=20),
    pid=st.integers(min_value=0, max_value=2**22),
    since=st.integers(min_value=0, max_value=2**45),
)
def test_holder_is_described_as_json_dumps_would(
    task_id: str, task_name: str, host: str, pid: int, since: int
) -> None:
    holder = Holder(task_id=task_id, task_name=task_name, host=host, pid=pid)
    described = holder.describe(since)
    assert described == json.dumps(
        {"task_id": task_id, "task": task_name, "host": host, "pid": pid, "since": since}
    )
    assert decode_lock(f"token 3 {described}") == LockEntry(fence=3, holder=holder, since_ms=since)


class SignalHandlerRaised(Exception):
    """What a soft time limit or SIGTERM's handler raises, wherever the code happens to be."""


def test_an_exception_between_send_and_read_does_not_shift_later_replies(lock_url: str) -> None:
    store, other = LockStore.from_url(lock_url), LockStore.from_url(lock_url)
    held_elsewhere = RequestKeys.build("celery-lock", "shop.process", "43", "shop.process")
    assert isinstance(acquire(other, new_token(), OTHER, held_elsewhere), Acquired)
    store._load(store.scripts.release)  # so the lost reply is the release's own, not NOSCRIPT
    token = new_token()
    fence = granted(acquire(store, token))
    connection = store._own
    send = connection.send_packed_command if store._packs else connection.send_command

    def send_then_raise(*args: object, **kwargs: object) -> None:
        send(*args, **kwargs)
        raise SignalHandlerRaised  # after the command went out, before its reply is read

    attribute = "send_packed_command" if store._packs else "send_command"
    setattr(connection, attribute, send_then_raise)
    with pytest.raises(SignalHandlerRaised):
        store.release(lease_for(store, token, fence), success=True, done_ttl_ms=60_000)
    setattr(connection, attribute, send)
    # The release's reply must not be read as this acquire's: the request is held elsewhere.
    assert isinstance(acquire(store, new_token(), keys=held_elsewhere), Held)
    store.client.close()
    other.client.close()


def test_a_grant_never_shortens_the_fence_counter(lock_url: str, lock_redis: redis.Redis) -> None:
    # Tasks of one scope share the counter; one with a short done TTL must not cut it short
    # for another whose fenced records live a day.
    store = LockStore.from_url(lock_url)
    day, seconds = 86_400_000, 2_000
    first = granted(store.acquire(KEYS, token := new_token(), TTL_MS, HOLDER, day))
    store.release(lease_for(store, token, first), success=False, done_ttl_ms=1)
    assert store.acquire(KEYS, new_token(), TTL_MS, OTHER, seconds) == Acquired(fence=first + 1)
    assert lock_redis.pttl(KEYS.fence) > seconds
    store.client.close()


def test_a_grant_with_no_fence_ttl_leaves_the_counter_alone(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    store = LockStore.from_url(lock_url)
    lock_redis.set(KEYS.fence, 6)
    assert store.acquire(KEYS, new_token(), TTL_MS, HOLDER, 0) == Acquired(fence=7)
    assert lock_redis.get(KEYS.fence) == b"7"
    assert lock_redis.pttl(KEYS.fence) == -1  # kept for ever, as it was
    store.client.close()


def test_a_grant_with_no_fence_ttl_starts_a_new_counter_from_the_clock_for_ever(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    store = LockStore.from_url(lock_url)
    fence = granted(store.acquire(KEYS, new_token(), TTL_MS, HOLDER, 0))
    assert fence > 10**15
    assert lock_redis.get(KEYS.fence) == str(fence).encode()
    assert lock_redis.pttl(KEYS.fence) == -1
    store.client.close()


@pytest.mark.parametrize("fence_ttl_ms", [FENCE_TTL_MS, 0], ids=["with-ttl", "no-ttl"])
def test_a_clock_past_what_a_fence_holds_starts_the_counter_at_one_with_its_ttl(
    lock_url: str, lock_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch, fence_ttl_ms: int
) -> None:
    # Past the year 2255 the clock in microseconds is no fence (2**53 and above): the counter
    # INCR creates starts at 1, and lives as a seeded one would, for its TTL or for ever.
    monkeypatch.setattr(store_module, "_time_ns", lambda: 2**53 * 1000)
    store = LockStore.from_url(lock_url)
    token = new_token()
    assert store.acquire(KEYS, token, TTL_MS, HOLDER, fence_ttl_ms) == Acquired(fence=1)
    if fence_ttl_ms:
        assert 0 < lock_redis.pttl(KEYS.fence) <= fence_ttl_ms
    else:
        assert lock_redis.pttl(KEYS.fence) == -1
    assert store.release(lease_for(store, token, 1), success=False, done_ttl_ms=1)
    assert store.acquire(KEYS, new_token(), TTL_MS, OTHER, fence_ttl_ms) == Acquired(fence=2)
    store.client.close()


def test_fences_past_lua_s_fourteen_digits_are_written_and_read_whole(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    # Lua writes a number of 10^14 or more as "1e+14" when it is concatenated: the lock would
    # hold that, a retried acquire would read fence 1 back, and a rival copy could not decode it.
    store = LockStore.from_url(lock_url)
    lock_redis.set(KEYS.fence, str(10**15 + 6))  # a counter seeded with microseconds
    token = new_token()
    assert acquire(store, token) == Acquired(fence=10**15 + 7)
    assert decode_lock(lock_redis.get(KEYS.lock)).fence == 10**15 + 7
    assert acquire(store, token) == Acquired(fence=10**15 + 7)  # re-entrant, after a lost reply
    held = acquire(store, new_token(), OTHER)
    assert isinstance(held, Held)
    assert held.task_id == "task-1"


def test_a_fence_ttl_past_lua_s_fourteen_digits_reaches_the_counter(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    store = LockStore.from_url(lock_url)
    huge = 10**17  # ms: passed on as a Lua number it would arrive as "1e+17", and fail
    granted(store.acquire(KEYS, new_token(), TTL_MS, HOLDER, huge))
    assert lock_redis.pttl(KEYS.fence) > 10**16


def test_a_counter_past_two_to_the_53_is_refused_as_not_a_fence(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    # A Lua number holds integers exactly up to 2^53: past it, fences could repeat.
    store = LockStore.from_url(lock_url)
    lock_redis.set(KEYS.fence, str(2**53 - 1))
    with pytest.raises(LockStateError, match="expected a fence counter") as caught:
        acquire(store, new_token())
    assert caught.value.key == KEYS.fence
    assert lock_redis.get(KEYS.lock) is None


def test_more_calls_in_flight_than_redis_py_8s_default_pool_of_100_are_all_served(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    # A threads or gevent pool of 150: redis-py 8 caps a pool without ?max_connections= at 100,
    # and the 101st call in flight would fail closed ("Too many connections") as if the
    # server were down, its task deferred, its release without a done-marker.
    store = LockStore.from_url(lock_url)
    calls = 150
    outcomes: Counter[str] = Counter()
    counted = threading.Lock()
    together = threading.Barrier(calls)

    def acquire_one(n: int) -> None:
        keys = RequestKeys.build("celery-lock", "shop.process", str(n), "shop.process")
        together.wait(30)
        try:
            outcome = type(acquire(store, new_token(), keys=keys)).__name__
        except LockStoreError as exc:
            outcome = f"{exc.__cause__!r}"
        with counted:
            outcomes[outcome] += 1

    # The server answers no one for a moment, so that every call is in flight at once.
    lock_redis.execute_command("CLIENT", "PAUSE", 1000, "ALL")
    threads = [threading.Thread(target=acquire_one, args=(n,)) for n in range(calls)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        store.client.close()
    assert outcomes == Counter({"Acquired": calls})


def test_fences_of_one_request_keep_increasing_after_a_quiet_spell(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    """The fence counter lapses after a lease TTL plus the longer of the lease and done TTLs
    without a grant or beat; the next grant starts a new one from the clock, above the old."""
    store = LockStore.from_url(lock_url)
    fences = []
    for _ in range(2):
        token = new_token()
        fences.append(granted(store.acquire(KEYS, token, 100, HOLDER, 200)))
        store.release(lease_for(store, token, fences[-1]), success=False, done_ttl_ms=100)
    assert consecutive(fences)
    wait_for("the fence counter to lapse", lambda: not lock_redis.exists(KEYS.fence), 10)
    outcome = store.acquire(KEYS, new_token(), 100, HOLDER, 200)
    store.client.close()
    assert isinstance(outcome, Acquired)
    assert outcome.fence > fences[-1], f"fence went back from {fences[-1]} to {outcome.fence}"


def test_fences_keep_increasing_after_the_counter_is_evicted_or_the_store_restarts(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    store = LockStore.from_url(lock_url)
    token = new_token()
    fence = granted(acquire(store, token))
    assert store.release(lease_for(store, token, fence), success=False, done_ttl_ms=1)
    lock_redis.delete(KEYS.fence)  # as maxmemory's eviction, or a restart without persistence
    assert granted(acquire(store, new_token())) > fence
    store.client.close()


def _replicated(primary: redis.Redis, replica: redis.Redis) -> None:
    """Wait (bounded) until ``replica`` has applied everything ``primary`` has written.

    The link must be up first: until the first sync, a replica reports an offset of 1, and a
    primary that had no replica yet reports 0, so the offsets alone read as caught up."""
    deadline = time.monotonic() + 10
    while replica.info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica did not sync"
        time.sleep(0.02)
    offset = primary.info("replication")["master_repl_offset"]
    while replica.info("replication").get("slave_repl_offset", -1) < offset:
        assert time.monotonic() < deadline, "the replica did not catch up"
        time.sleep(0.02)


def test_scripts_replicate_their_effects_where_the_server_would_replicate_them_verbatim() -> None:
    """Redis before 5.0 replicates a script by running it again on each replica, and so does
    6.2 with ``lua-replicate-commands no``; it then refuses a write after a command whose answer
    may differ there (``PTTL``). The acquire script reads the counter's ``PTTL`` before it
    writes the lock, and the extend script after it extended the lease: a second grant of a
    request failed with an error reply (the task failed unrun, after its fence was taken), and
    every extend lost its lease. Redis 7 replicates effects only, and ignores the setting."""
    replicated = ["--lua-replicate-commands", "no"]
    with (
        RedisServer(extra_args=replicated) as primary,
        RedisServer() as replica,
        primary.client() as writes,
        replica.client() as copy,
    ):
        copy.replicaof("127.0.0.1", primary.port)
        store = LockStore.from_url(primary.url)
        try:
            first = new_token()
            fence = granted(acquire(store, first))
            assert store.release(lease_for(store, first, fence), success=False, done_ttl_ms=1)
            # A lease no stall of a loaded machine outlives before it is read on the replica
            # (with TTL_MS, 5 s, it had lapsed there once, in CI's oldest-releases leg).
            ttl_ms, token = 600_000, new_token()
            granted_again = store.acquire(KEYS, token, ttl_ms, HOLDER, FENCE_TTL_MS)
            assert granted_again == Acquired(fence=fence + 1)
            lease = Lease(store, KEYS, token, ttl_ms, fence + 1, HOLDER)
            assert store.extend_all([lease]) == [True]
        finally:
            store.close()
        _replicated(writes, copy)
        assert copy.get(KEYS.lock) is not None
        assert copy.get(KEYS.lock) == writes.get(KEYS.lock)
        assert copy.get(KEYS.fence) == str(fence + 1).encode()
        assert 0 < copy.pttl(KEYS.lock) <= ttl_ms
        assert 0 < copy.pttl(KEYS.fence) <= FENCE_TTL_MS
        copy.replicaof("no", "one")


def test_granted_again_tells_a_lost_lease_s_request_taken_by_a_copy_whose_message_it_may_take(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    store = LockStore.from_url(lock_url)
    lost = lease_for(store, new_token(), granted(acquire(store, new_token())))
    lock_redis.delete(KEYS.lock)  # lapsed
    assert not store.granted_again(lost)  # nobody granted it since
    same_id = granted(acquire(store, new_token(), Holder("task-1", "shop.process", "host-b", 9)))
    assert store.granted_again(lost)  # a redelivery of its own task id holds it
    lock_redis.delete(KEYS.lock)
    assert same_id > lost.fence
    assert store.granted_again(lost)  # granted since, to a holder that died: nobody's now
    lock_redis.set(KEYS.done, "task-1")
    assert not store.granted_again(lost)  # done
    lock_redis.delete(KEYS.done)
    acquire(store, new_token(), OTHER)
    assert not store.granted_again(lost)  # another task id's message is not its to take
    lock_redis.set(KEYS.lock, "not a lease")
    assert not store.granted_again(lost)  # unreadable: as if it had not asked
