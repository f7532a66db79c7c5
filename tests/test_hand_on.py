"""The hand-on marker a ``self.replace(sig)`` leaves, as the lock store's scripts read it.

A run that hands its request on releases with a marker naming its replacement depth (Celery's
``replaced_task_nesting``), its canvas's root task id and its task id: copies of the request
skip it as done, except a message of the same root at a greater depth, which only the
replacement (or a step of it) is. The release writes it before the replacement is sent
(``handing-on``), and it is confirmed (``handed-on``) once it was, or withdrawn.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from conftest import granted
from hypothesis import given
from hypothesis import strategies as st

from celery_lock.keys import RequestKeys
from celery_lock.lease import (
    HANDED_ON,
    HANDING_ON,
    Acquired,
    Done,
    HandOn,
    Held,
    Holder,
    Lease,
    decode_done,
    encode_done,
    new_token,
)
from celery_lock.store import LockStore
from celery_lock.testing import RedisServer

ORIGINAL = Holder(task_id="task-1", task_name="shop.fetch", host="host-a", pid=101)
DUPLICATE = Holder(task_id="task-2", task_name="shop.fetch", host="host-b", pid=202)
KEYS = RequestKeys.build("celery-lock", "shop.fetch", "42", "shop.fetch")
TTL_MS = 5_000


@pytest.fixture
def store(lock_url: str) -> LockStore:
    return LockStore.from_url(lock_url)


def hand_on(
    store: LockStore, holder: Holder, depth: int, root: str = "task-1", *, sent: bool = True
) -> Lease:
    """Take the request's lease as ``holder`` at ``depth`` of the canvas of ``root`` and hand
    it on: release it, and, if ``sent``, confirm the marker as once the replacement was sent."""
    token = new_token()
    fence = granted(store.acquire(KEYS, token, TTL_MS, holder, 60_000, depth, root))
    lease = Lease(store, KEYS, token, TTL_MS, fence, holder, handed_on=HandOn(depth, root))
    assert store.release(lease, success=True, done_ttl_ms=30_000)
    if sent:
        assert store.confirm_hand_on(lease, 30_000)
    return lease


def withdraw(lease: Lease, **options: int) -> bool | None:
    """Withdraw the unsent marker ``lease``'s release wrote."""
    assert lease.handed_on is not None
    return lease.store.withdraw_hand_on(KEYS, lease.holder.task_id, lease.handed_on, **options)


def ask(store: LockStore, holder: Holder, depth: int, root: str = "task-1") -> object:
    return store.acquire(KEYS, new_token(), TTL_MS, holder, 60_000, depth, root)


def test_a_hand_on_marker_names_the_depth_the_root_and_the_task_id(
    store: LockStore, lock_redis: redis.Redis
) -> None:
    lease = hand_on(store, ORIGINAL, 0, sent=False)
    assert lock_redis.get(KEYS.done) == b"\xffhanding-on:0\xfftask-1\xfftask-1"
    assert not lock_redis.exists(KEYS.lock)
    assert 0 < lock_redis.pttl(KEYS.done) <= 30_000
    lock_redis.pexpire(KEYS.done, 1_000)
    assert store.confirm_hand_on(lease, 30_000)  # the replacement went out
    assert lock_redis.get(KEYS.done) == b"\xffhanded-on:0\xfftask-1\xfftask-1"
    assert 1_000 < lock_redis.pttl(KEYS.done) <= 30_000
    assert not store.confirm_hand_on(lease, 30_000)  # once only


@pytest.mark.parametrize("sent", [False, True])
def test_a_hand_on_marker_lets_the_replacement_through_before_and_after_it_is_confirmed(
    store: LockStore, sent: bool
) -> None:
    # The replacement may run before the replaced run has confirmed that it sent it.
    hand_on(store, ORIGINAL, 0, sent=sent)
    handed_on = Done("task-1", handed_on_at=0, root_id="task-1", sent=sent)
    assert ask(store, DUPLICATE, 0, root="task-2") == handed_on
    assert ask(store, ORIGINAL, 0) == handed_on
    assert isinstance(ask(store, ORIGINAL, 1), Acquired)


def test_copies_of_a_handed_on_request_are_done_but_its_replacement_gets_through(
    store: LockStore,
) -> None:
    hand_on(store, ORIGINAL, 0)
    handed_on = Done(task_id="task-1", handed_on_at=0, root_id="task-1")
    assert ask(store, DUPLICATE, 0, root="task-2") == handed_on  # another message
    assert ask(store, DUPLICATE, 1, root="task-2") == handed_on  # another canvas's replacement
    assert ask(store, ORIGINAL, 0) == handed_on  # the replaced message, redelivered
    assert isinstance(ask(store, ORIGINAL, 1), Acquired)  # its replacement


def test_a_step_of_the_replacement_gets_through_under_its_own_task_id(store: LockStore) -> None:
    # self.replace(chain(self.si(next_page), notify.si())): the chain's first step has a task
    # id of its own, the replaced run's root, and the replacement's depth.
    hand_on(store, ORIGINAL, 0)
    assert isinstance(ask(store, DUPLICATE, 1, root="task-1"), Acquired)


def test_a_replacement_that_hands_on_again_lets_only_a_deeper_one_through(
    store: LockStore, lock_redis: redis.Redis
) -> None:
    first = hand_on(store, ORIGINAL, 0)
    second = hand_on(store, ORIGINAL, 1)
    assert second.fence > first.fence
    assert lock_redis.get(KEYS.done) == b"\xffhanded-on:1\xfftask-1\xfftask-1"
    assert ask(store, ORIGINAL, 1) == Done(task_id="task-1", handed_on_at=1, root_id="task-1")
    token = new_token()
    last = granted(store.acquire(KEYS, token, TTL_MS, ORIGINAL, 60_000, 2, "task-1"))
    # The last replacement completes the request: a plain done-marker, final for every copy.
    lease = Lease(store, KEYS, token, TTL_MS, last, ORIGINAL)
    assert store.release(lease, success=True, done_ttl_ms=30_000)
    assert lock_redis.get(KEYS.done) == b"task-1"
    assert ask(store, ORIGINAL, 3) == Done(task_id="task-1")


def test_a_replacement_running_holds_the_request_against_a_deeper_copy(
    store: LockStore,
) -> None:
    hand_on(store, ORIGINAL, 0)
    granted(ask(store, ORIGINAL, 1))
    assert isinstance(ask(store, ORIGINAL, 2), Held)


def test_a_release_whose_reply_was_lost_tells_its_hand_on_marker_by_its_value(
    store: LockStore,
) -> None:
    lease = hand_on(store, ORIGINAL, 0, sent=False)  # tried again within the release call
    # Tried again, the release finds the lock gone and the marker it wrote: released.
    assert store.release(lease, success=True, done_ttl_ms=30_000) is True


def test_a_hand_on_marker_is_withdrawn_only_while_it_is_the_one_written(
    store: LockStore, lock_redis: redis.Redis
) -> None:
    lease = hand_on(store, ORIGINAL, 0, sent=False)
    assert withdraw(lease)
    assert not lock_redis.exists(KEYS.done)
    assert not withdraw(lease)
    # The replacement ran and completed the request first: its marker stays.
    lease = hand_on(store, ORIGINAL, 0, sent=False)
    lock_redis.set(KEYS.done, b"task-1")
    assert not withdraw(lease)
    assert not store.confirm_hand_on(lease, 30_000)
    assert lock_redis.get(KEYS.done) == b"task-1"
    # A marker confirmed as sent is never withdrawn.
    lock_redis.delete(KEYS.done)
    lease = hand_on(store, ORIGINAL, 0)
    assert not withdraw(lease)
    assert lock_redis.get(KEYS.done) == b"\xffhanded-on:0\xfftask-1\xfftask-1"


def test_an_unsent_hand_on_marker_is_withdrawn_only_once_old_enough_when_asked_so(
    store: LockStore, lock_redis: redis.Redis
) -> None:
    lease = hand_on(store, ORIGINAL, 0, sent=False)  # 30 s to live
    assert withdraw(lease, most_ttl_left_ms=20_000) is None
    assert lock_redis.exists(KEYS.done)  # written under 10 s ago: maybe a live run's
    lock_redis.pexpire(KEYS.done, 15_000)
    assert withdraw(lease, most_ttl_left_ms=20_000) is True
    assert not lock_redis.exists(KEYS.done)


def test_a_hand_on_marker_is_confirmed_by_a_server_out_of_memory() -> None:
    """Under ``maxmemory-policy noeviction`` a server full up refuses a script's first write if
    it may add memory: the replacement was sent, and a marker left ``handing-on`` would have a
    redelivery of the replaced message run the request again."""
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as server:
        store = LockStore.from_url(server.url)
        client = redis.Redis.from_url(server.url)
        try:
            lease = hand_on(store, ORIGINAL, 0, sent=False)
            client.mset({f"ballast:{i}": "x" * 1_000 for i in range(2_000)})
            client.config_set("maxmemory", client.info("memory")["used_memory"] - 500_000)
            with pytest.raises(redis.ResponseError, match="maxmemory"):
                client.set("another", "key")
            assert store.confirm_hand_on(lease, 30_000)
            assert client.get(KEYS.done) == b"\xffhanded-on:0\xfftask-1\xfftask-1"
        finally:
            store.close()
            client.close()


def test_a_copy_at_depth_0_sends_the_script_what_every_copy_sent_before(
    store: LockStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[tuple[object, ...]] = []
    evalsha = store._evalsha

    def recorded(script: Any, keys: Any, args: Any) -> Any:
        sent.append(tuple(args))
        return evalsha(script, keys, args)

    monkeypatch.setattr(store, "_evalsha", recorded)
    granted(store.acquire(KEYS, new_token(), TTL_MS, DUPLICATE, 60_000))
    store.acquire(KEYS, new_token(), TTL_MS, ORIGINAL, 60_000, 3, "task-1")
    assert [len(args) for args in sent] == [5, 7]
    assert sent[1][5:] == (3, b"task-1")  # depth, root (as a hand-on marker holds it)


#: Any str a message may carry, lone surrogates too (JSON's "\\udcff").
TASK_IDS = st.text(st.characters())


@given(TASK_IDS, TASK_IDS, st.integers(min_value=0, max_value=10**6))
def test_a_marker_reads_back_as_it_was_written(task_id: str, root: str, depth: int) -> None:
    assert decode_done(encode_done(task_id)) == Done(task_id)
    for sent in (False, True):
        handed_on = encode_done(task_id, HandOn(depth, root, sent))
        assert decode_done(handed_on) == Done(task_id, depth, root, sent)
    # No task id reads as a hand-on marker: UTF-8, surrogates and all (surrogatepass, never
    # surrogateescape), never holds the byte it starts with.
    assert not encode_done(task_id).startswith((HANDED_ON, HANDING_ON))


def test_a_marker_of_ids_holding_a_lone_surrogate_is_written_and_passed(
    store: LockStore, lock_redis: redis.Redis
) -> None:
    """A task id is any str its message carries: a client's key used as the task id, read from
    JSON, may hold a lone surrogate. The release that would refuse it runs after the body."""
    task_id = json.loads('"req-7\\udcff"')
    holder = Holder(task_id, "shop.fetch", "host-a", 101)
    stored = b"req-7\xed\xb3\xbf"  # UTF-8's three bytes for U+DCFF (surrogatepass)
    lease = hand_on(store, holder, 0, root=task_id)
    assert lock_redis.get(KEYS.done) == b"\xffhanded-on:0\xff%s\xff%s" % (stored, stored)
    handed_on = Done(task_id, handed_on_at=0, root_id=task_id)
    assert ask(store, DUPLICATE, 0, root="task-2") == handed_on
    # Its replacement, of the same root, gets through, and completes the request.
    token = new_token()
    fence = granted(store.acquire(KEYS, token, TTL_MS, holder, 60_000, 1, task_id))
    assert fence > lease.fence
    last = Lease(store, KEYS, token, TTL_MS, fence, holder)
    assert store.release(last, success=True, done_ttl_ms=30_000)
    assert lock_redis.get(KEYS.done) == stored
    assert ask(store, DUPLICATE, 2, root=task_id) == Done(task_id)
