"""The heartbeat thread's life: started by the first lease, ended by stop(), started again by the
next lease if it ever ends otherwise; and its beats against a real Redis where leases come and go
while it works. (More of its beats are in test_round_trips, test_task and the fault tests.)"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from conftest import granted, wait_for

import celery_lock.events
from celery_lock.heartbeat import Heartbeat, _signals_unblocked, start_apart
from celery_lock.keys import RequestKeys
from celery_lock.lease import Acquired, Holder, Lease, new_token
from celery_lock.store import LockStore
from celery_lock.testing import RedisServer

HOLDER = Holder(task_id="task-1", task_name="shop.process", host="host-a", pid=101)

#: Leases are held for this long: no beat runs during a test.
LONG = 3600.0


class Died(BaseException):
    """Not an Exception: the heartbeat's loop does not catch it, so its thread ends."""


def test_the_first_lease_starts_the_thread_and_stop_ends_it() -> None:
    heartbeat = Heartbeat()
    assert not heartbeat.running
    heartbeat.add(object(), LONG)  # type: ignore[arg-type]
    assert heartbeat.running
    thread = heartbeat._thread
    assert thread is not None
    assert thread.is_alive()
    heartbeat.stop()
    assert not heartbeat.running
    assert not thread.is_alive()


def test_a_thread_that_ended_unexpectedly_is_started_again_by_the_next_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    heartbeat = Heartbeat()
    heartbeat.add(object(), LONG)  # type: ignore[arg-type]
    first = heartbeat._thread
    assert first is not None

    def die(*_: Any) -> bool:
        raise Died

    # The thread is waiting on _wake: make the wait raise, then wake it.
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # no traceback on stderr
    monkeypatch.setattr(heartbeat._wake, "wait", die)
    heartbeat._wake.set()
    first.join(10)
    assert not first.is_alive()
    assert not heartbeat.running

    monkeypatch.undo()
    heartbeat.add(object(), LONG)  # type: ignore[arg-type]
    try:
        assert heartbeat.running
        second = heartbeat._thread
        assert second is not None
        assert second is not first
        assert second.is_alive()
    finally:
        heartbeat.stop()
    assert not second.is_alive()


def test_a_thread_that_outlives_stop_ends_instead_of_beating_beside_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    heartbeat = Heartbeat()
    in_beat, unblock = threading.Event(), threading.Event()

    def slow_beat() -> None:  # an extend stuck on an unanswering store
        in_beat.set()
        unblock.wait(10)

    monkeypatch.setattr(heartbeat, "beat", slow_beat)
    heartbeat.add(object(), 0.01)  # type: ignore[arg-type]
    stuck = heartbeat._thread
    assert stuck is not None
    assert in_beat.wait(10)
    heartbeat.stop(timeout=0.05)  # its join gives up on the stuck thread
    assert stuck.is_alive()
    heartbeat.add(object(), LONG)  # type: ignore[arg-type]  # starts a new thread
    try:
        unblock.set()
        stuck.join(10)
        assert not stuck.is_alive()  # it saw its own stop, not the new thread's go-ahead
        assert heartbeat.running
    finally:
        heartbeat.stop()


def test_a_thread_started_while_stop_waits_for_an_extend_is_not_forgotten_by_it() -> None:
    """stop() waits for extends still on their way; a task may start meanwhile (a threads pool,
    a runtime closed under it), and its lease starts a new thread, which stop() must leave
    known: forgotten, it would beat on beside the next one started, and no stop() would end it."""
    heartbeat = Heartbeat()
    heartbeat.add(object(), LONG)  # type: ignore[arg-type]
    first = heartbeat._thread
    assert first is not None
    unblock = threading.Event()
    extend = threading.Thread(target=unblock.wait, args=(10,))  # an extend on a slow store
    extend.start()
    heartbeat._in_flight[object()] = extend  # type: ignore[index]
    stopper = threading.Thread(target=heartbeat.stop)
    stopper.start()
    try:
        first.join(10)
        assert not first.is_alive()  # stop() now waits for the extend
        heartbeat.add(object(), LONG)  # type: ignore[arg-type]
        second = heartbeat._thread
        assert second is not None
        assert second is not first
    finally:
        unblock.set()
        stopper.join(10)
    try:
        assert heartbeat.running
        assert heartbeat._thread is second
        assert second.is_alive()
    finally:
        heartbeat.stop()
    assert not second.is_alive()


def refusing(name: str) -> Callable[[threading.Thread], None]:
    """A ``Thread.start`` that refuses the threads called ``name``, as a process at its thread
    limit (a container's pids.max) refuses every new one."""
    start = threading.Thread.start

    def start_unless_named(thread: threading.Thread) -> None:
        if thread.name == name:
            raise RuntimeError("can't start new thread")
        start(thread)

    return start_unless_named


def _granted(store: LockStore, request_key: str, ttl_ms: int) -> Lease:
    keys = RequestKeys.build("celery-lock", "shop.process", request_key, "shop.process")
    token = new_token()
    fence = granted(store.acquire(keys, token, ttl_ms, HOLDER, 60_000))
    return Lease(store, keys, token, ttl_ms, fence, HOLDER)


def test_short_leases_coming_and_going_do_not_starve_a_long_one(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    # A lease with a shorter interval wakes the thread. If each wake-up started the wait over,
    # short tasks arriving more often than the long lease's interval (threads or gevent pool,
    # per-task TTLs) would keep it from ever being extended: it would expire under its task.
    store = LockStore.from_url(lock_url)
    heartbeat = Heartbeat()
    long_lease = _granted(store, "long", ttl_ms=1_500)
    first_confirmed = long_lease.confirmed_at
    heartbeat.add(long_lease, 0.5)
    try:
        deadline = time.monotonic() + 3.0  # two TTLs of the long lease
        while time.monotonic() < deadline:
            short = _granted(store, "short", ttl_ms=600)
            heartbeat.add(short, 0.2)
            heartbeat.discard(short)
            store.release(short, success=False, done_ttl_ms=1)
            time.sleep(0.1)
        assert lock_redis.exists(long_lease.keys.lock), "the long lease expired unextended"
        assert long_lease.confirmed_at > first_confirmed
        assert not long_lease.lost
    finally:
        heartbeat.stop()
        store.client.close()


#: A signal's bit in a mask /proc shows.
SIGNAL_BIT = {name: 1 << (getattr(signal, name) - 1) for name in ("SIGQUIT", "SIGTERM", "SIGSEGV")}


def _blocked_signals(native_id: int) -> int:
    """The mask of signals a thread of this process blocks (Linux's /proc)."""
    with open(f"/proc/self/task/{native_id}/status") as status:
        [mask] = [line.split()[1] for line in status if line.startswith("SigBlk:")]
    return int(mask, 16)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the mask in /proc")
def test_the_heartbeat_thread_leaves_signals_to_the_main_thread(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    # The kernel hands a process-directed signal to another thread where the main thread has
    # one pending already: handed to the heartbeat's thread, a cold shutdown's SIGQUIT right
    # after a warm shutdown's SIGTERM (-P solo) did not interrupt the body's sleep on the main
    # thread, whose handler ran once the body had run to its end, seconds later.
    store = LockStore.from_url(lock_url)
    heartbeat = Heartbeat()
    heartbeat.add(_granted(store, "any", ttl_ms=60_000), 30)
    try:
        thread = heartbeat._thread  # other tests' heartbeats may run in this process too
        assert thread is not None
        assert thread.native_id is not None
        # Read at once: the thread is started with the mask, not left to set it as it begins.
        blocked = _blocked_signals(thread.native_id)
        assert blocked & SIGNAL_BIT["SIGQUIT"]
        assert blocked & SIGNAL_BIT["SIGTERM"]
        assert not blocked & SIGNAL_BIT["SIGSEGV"]  # raised by a fault in the thread itself
        assert not _blocked_signals(threading.get_native_id()) & SIGNAL_BIT["SIGTERM"]
    finally:
        heartbeat.stop()
        store.client.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the mask in /proc")
@pytest.mark.parametrize("beaten_by", ["the heartbeat's thread", "the caller"])
def test_a_lock_lost_receiver_runs_with_the_signals_unblocked(
    lock_url: str, lock_redis: redis.Redis, beaten_by: str
) -> None:
    # A receiver the user connects to lock_lost runs on the heartbeat's thread: a process it
    # starts inherits the thread's mask, and would ignore SIGTERM. Run by a beat on another
    # thread, that thread's own mask is left as it was.
    store = LockStore.from_url(lock_url)
    heartbeat = Heartbeat()
    lease = _granted(store, "lost", ttl_ms=60_000)
    masks: list[tuple[int, int]] = []
    lease.on_lost = lambda _: masks.append(
        (threading.get_native_id(), _blocked_signals(threading.get_native_id()))
    )
    lock_redis.delete(lease.keys.lock)  # taken from under it
    main_thread = threading.get_native_id()
    main_mask = _blocked_signals(main_thread)
    try:
        heartbeat.add(lease, 0.05 if beaten_by == "the heartbeat's thread" else LONG)
        if beaten_by == "the caller":
            heartbeat.beat()
        wait_for("the loss reported", lambda: masks, 10.0)
        [(thread_id, in_receiver)] = masks
        assert not in_receiver & SIGNAL_BIT["SIGTERM"]
        # The heartbeat's thread extends a lone store on a thread it starts, masked as it is.
        assert (thread_id == main_thread) == (beaten_by == "the caller")
        assert _blocked_signals(main_thread) == main_mask
    finally:
        heartbeat.stop()
        store.client.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the mask in /proc")
def test_a_heartbeat_thread_blocks_the_signals_again_once_a_receiver_has_run() -> None:
    masks: list[int] = []

    def receiver_on_a_heartbeat_thread() -> None:
        masks.append(_blocked_signals(threading.get_native_id()))
        with _signals_unblocked():
            masks.append(_blocked_signals(threading.get_native_id()))
        masks.append(_blocked_signals(threading.get_native_id()))

    thread = threading.Thread(target=receiver_on_a_heartbeat_thread)
    start_apart(thread)
    thread.join(10.0)
    assert [bool(mask & SIGNAL_BIT["SIGTERM"]) for mask in masks] == [True, False, True]
    assert masks[0] == masks[2]
    assert not _blocked_signals(threading.get_native_id()) & SIGNAL_BIT["SIGTERM"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the mask in /proc")
def test_a_lock_released_receiver_of_a_late_release_runs_with_the_signals_unblocked(
    lock_url: str,
) -> None:
    # A release left for later reports lock_released, on the heartbeat's thread, once it
    # goes through.
    store = LockStore.from_url(lock_url)
    heartbeat = Heartbeat()
    masks: list[int] = []
    lease = _granted(store, "late", ttl_ms=60_000)
    try:
        heartbeat.release_later(
            lease,
            success=True,
            done_ttl_ms=60_000,
            then=lambda _: masks.append(_blocked_signals(threading.get_native_id())),
        )
        beat = threading.Thread(target=heartbeat._release_pending, args=(store,))
        start_apart(beat)  # as the heartbeat's own threads are started
        beat.join(10.0)
        [in_receiver] = masks
        assert not in_receiver & SIGNAL_BIT["SIGTERM"]
    finally:
        heartbeat.stop()
        store.client.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the mask in /proc")
def test_an_event_sender_thread_blocks_the_signals(monkeypatch: pytest.MonkeyPatch) -> None:
    # It may wait on the broker a minute, or for ever: handed a process-directed signal, it
    # would keep it from the main thread as the heartbeat's thread did.
    masks: list[int] = []
    monkeypatch.setattr(
        celery_lock.events,
        "_publish",
        lambda *args: masks.append(_blocked_signals(threading.get_native_id())),
    )
    conf = types.SimpleNamespace(worker_send_task_events=True)
    task = types.SimpleNamespace(app=types.SimpleNamespace(conf=conf), send_events=True)
    celery_lock.events.send_task_event_apart(task, "task-lock-lost", "task-1", "w@h")  # type: ignore[arg-type]
    celery_lock.events.wait_for_events_apart(10.0)
    [in_sender] = masks
    assert in_sender & SIGNAL_BIT["SIGTERM"]
    assert not _blocked_signals(threading.get_native_id()) & SIGNAL_BIT["SIGTERM"]


def test_a_lease_among_longer_ones_is_extended_at_its_own_interval(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    # Per-task TTLs: a short lease added while a long one is held is beaten at the shortest
    # interval held, or it would lapse under its task before the long one's next beat.
    store = LockStore.from_url(lock_url)
    heartbeat = Heartbeat()
    long_lease = _granted(store, "long", ttl_ms=600_000)
    short = _granted(store, "short", ttl_ms=1_500)
    first_confirmed = short.confirmed_at
    heartbeat.add(long_lease, LONG)
    heartbeat.add(short, 0.3)
    try:
        time.sleep(3.0)  # two TTLs of the short lease
        assert lock_redis.exists(short.keys.lock), "the short lease expired unextended"
        assert short.confirmed_at > first_confirmed
        assert not short.lost
    finally:
        heartbeat.stop()
        store.client.close()


def test_an_extend_that_meets_the_release_is_not_a_loss(
    lock_url: str, lock_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LockStore.from_url(lock_url)
    heartbeat = Heartbeat()
    released, held = _granted(store, "released", 60_000), _granted(store, "taken", 60_000)
    lost: list[Lease] = []
    released.on_lost = held.on_lost = lost.append
    heartbeat.add(released, LONG)
    heartbeat.add(held, LONG)
    extend_all = store.extend_all

    def task_ends_meanwhile(leases: list[Lease]) -> list[bool]:
        # The beat took its list of leases; before its extend arrives, one task ends as
        # LockedTask ends (dropped from the heartbeat, then released) and the other lease is
        # taken from its task (its lock deleted while it still holds it).
        heartbeat.discard(released)
        assert store.release(released, success=True, done_ttl_ms=60_000)
        lock_redis.delete(held.keys.lock)
        return extend_all(leases)

    monkeypatch.setattr(store, "extend_all", task_ends_meanwhile)
    try:
        heartbeat.beat()
    finally:
        heartbeat.stop()
        store.client.close()
    assert lost == [held]
    assert not released.lost
    assert held.lost


def test_a_run_that_outlasts_its_fence_counters_ttl_keeps_the_counter(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    # The grant gives the counter max(done TTL, lease TTL). A run longer than that must not see
    # its counter expire: the next grant (after this holder paused past its lease) would start
    # a new counter from its own clock, above the paused holder's fence only while the two
    # machines' clocks agree.
    store = LockStore.from_url(lock_url)
    heartbeat = Heartbeat()
    keys = RequestKeys.build("celery-lock", "shop.process", "long-run", "shop.process")
    token = new_token()
    # A 2 s lease beaten every 0.5 s: only a thread stalled for 1.5 s would lose it.
    fence = granted(store.acquire(keys, token, 2_000, HOLDER, 3_000))
    lease = Lease(store, keys, token, 2_000, fence, HOLDER, fence_ttl_ms=3_000)
    heartbeat.add(lease, 0.5)
    try:
        time.sleep(4.0)  # the counter's TTL from the grant (3 s) has run out
        assert not lease.lost
        assert lock_redis.exists(keys.fence)
        heartbeat.stop()
        lock_redis.delete(keys.lock)  # the holder paused past its lease
        next_grant = store.acquire(keys, new_token(), 2_000, HOLDER, 3_000)
        assert next_grant == Acquired(fence=fence + 1)
    finally:
        heartbeat.stop()
        store.client.close()


@pytest.mark.parametrize(
    ("counter_ttl_ms", "lease_fence_ttl_ms", "expected_ms"),
    [(3_000, 60_000, (59_000, 60_000)), (50_000, 1_000, (49_000, 50_000)), (3_000, 0, (1, 3_000))],
    ids=["lengthened", "never-shortened", "left-alone"],
)
def test_an_extend_only_ever_lengthens_the_fence_counters_ttl(
    lock_url: str,
    lock_redis: redis.Redis,
    counter_ttl_ms: int,
    lease_fence_ttl_ms: int,
    expected_ms: tuple[int, int],
) -> None:
    store = LockStore.from_url(lock_url)
    try:
        lease = _granted(store, "counter", 5_000)
        lease.fence_ttl_ms = lease_fence_ttl_ms
        lock_redis.pexpire(lease.keys.fence, counter_ttl_ms)
        assert store.extend_all([lease]) == [True]
        low, high = expected_ms
        assert low <= lock_redis.pttl(lease.keys.fence) <= high
    finally:
        store.client.close()


@contextlib.contextmanager
def _hung_and_healthy_stores(
    lock_url: str,
) -> Iterator[tuple[RedisServer, LockStore, LockStore, Heartbeat]]:
    """A store whose redis-server the test may pause (SIGSTOP: connections stay open, replies
    never come), a healthy store, and a heartbeat; all ended however the test ends."""
    with RedisServer() as hanging_server:
        hanging = LockStore.from_url(hanging_server.url)
        healthy = LockStore.from_url(lock_url)
        heartbeat = Heartbeat()
        try:
            yield hanging_server, hanging, healthy, heartbeat
        finally:
            hanging_server.resume()
            heartbeat.stop(timeout=20)
            # The stuck extend gets its reply now: let it end before its client is closed,
            # or its retry would open a connection nothing closes.
            for thread in list(heartbeat._in_flight.values()):
                thread.join(20)
            healthy.client.close()
            hanging.client.close()


def _assert_extended_throughout(lock_redis: redis.Redis, lease: Lease, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert lock_redis.exists(lease.keys.lock), "the healthy store's lease lapsed"
        time.sleep(0.2)
    assert not lease.lost


def test_a_store_that_hangs_does_not_hold_back_another_stores_extends(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    # Tasks on two lock stores in one process. One store stops answering, and each extend
    # there waits out two socket timeouts (10 s). The other store's lease, of a 2 s TTL, must
    # be extended all along (for three of its TTLs), not lapse while the beat waits.
    with _hung_and_healthy_stores(lock_url) as (hanging_server, hanging, healthy, heartbeat):
        stuck = _granted(hanging, "stuck", 60_000)
        kept = _granted(healthy, "kept", 2_000)
        heartbeat.add(stuck, 0.5)  # first: its store comes first in every beat
        heartbeat.add(kept, 0.5)
        hanging_server.pause()
        _assert_extended_throughout(lock_redis, kept, 6.0)


def test_a_store_that_hangs_alone_does_not_hold_back_a_lease_on_another_store_added_meanwhile(
    lock_url: str, lock_redis: redis.Redis
) -> None:
    # Tasks on two lock stores in one process, but at the beat only one store's lease is held:
    # that store hangs, and the beat waits out its extend (two socket timeouts, 10 s). A task
    # on the other store that starts meanwhile, with a 2 s TTL, must have its lease extended
    # all along, not wait for the hung store's extend to end.
    with _hung_and_healthy_stores(lock_url) as (hanging_server, hanging, healthy, heartbeat):
        heartbeat.add(_granted(hanging, "stuck", 60_000), 0.5)
        hanging_server.pause()
        time.sleep(1.0)  # two intervals: a beat is now waiting on the hung store
        kept = _granted(healthy, "kept", 2_000)
        heartbeat.add(kept, 0.5)
        _assert_extended_throughout(lock_redis, kept, 6.0)


def test_a_lease_on_a_store_that_hangs_is_lost_once_a_ttl_passed_unconfirmed(
    lock_url: str,
) -> None:
    # semantics.md: a lease its store cannot confirm counts as lost once a whole TTL has passed
    # since it was last confirmed. The loss waited for the extend on its way to give up (two
    # socket timeouts, 10 s): for 8 s after the lease lapsed, lock_lost said False while
    # another worker could hold the request.
    with _hung_and_healthy_stores(lock_url) as (hanging_server, hanging, _, heartbeat):
        lease = _granted(hanging, "stuck", 2_000)
        reported: list[float] = []
        lease.on_lost = lambda _: reported.append(time.monotonic())
        heartbeat.add(lease, 0.5)
        hanging_server.pause()
        paused = time.monotonic()
        deadline = paused + 9.0  # before the first extend's two socket timeouts are up
        while not lease.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lease.lost, "still not lost when the extend gave up"
        assert len(reported) == 1
        assert reported[0] - lease.confirmed_at >= 2.0  # not before a whole TTL
        time.sleep(0.6)  # another beat: reported once
        assert len(reported) == 1


def test_two_stores_are_extended_even_when_no_thread_can_start(
    lock_url: str, lock_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A process at its thread limit (a container's pids.max): the stores are extended on the
    # beat's own thread, and neither is left marked as being extended elsewhere.
    with RedisServer() as other_server:
        first, second = LockStore.from_url(lock_url), LockStore.from_url(other_server.url)
        heartbeat = Heartbeat()
        leases = [_granted(first, "first", 60_000), _granted(second, "second", 60_000)]
        refuse_extend_threads = refusing("celery-lock-heartbeat-extend")
        try:
            for lease in leases:
                heartbeat.add(lease, LONG)
            lock_redis.pexpire(leases[0].keys.lock, 1_000)
            with contextlib.closing(other_server.client()) as other:
                other.pexpire(leases[1].keys.lock, 1_000)
                monkeypatch.setattr(threading.Thread, "start", refuse_extend_threads)
                heartbeat.beat()
                monkeypatch.undo()
                assert other.pttl(leases[1].keys.lock) > 50_000
            assert lock_redis.pttl(leases[0].keys.lock) > 50_000
            assert heartbeat._in_flight == {}
        finally:
            heartbeat.stop()
            first.client.close()
            second.client.close()


def test_a_thread_that_could_not_start_is_started_by_the_next_lease(
    lock_url: str, lock_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A process briefly at its thread limit (a container's pids.max) when its first lease
    # comes: that task fails, but the process's later leases must still be extended (or found
    # lost), never left to lapse unnoticed by a heartbeat that thinks it runs.
    store = LockStore.from_url(lock_url)
    heartbeat = Heartbeat()
    try:
        first = _granted(store, "first", 60_000)
        monkeypatch.setattr(threading.Thread, "start", refusing("celery-lock-heartbeat"))
        with pytest.raises(RuntimeError, match="can't start new thread"):
            heartbeat.add(first, 0.2)
        monkeypatch.undo()
        assert not heartbeat.running
        heartbeat.discard(first)
        heartbeat.stop()  # at worker_process_shutdown: nothing to join, and no error

        lease = _granted(store, "second", 1_000)
        heartbeat.add(lease, 0.2)
        assert heartbeat.running
        time.sleep(1.5)
        assert lock_redis.pttl(lease.keys.lock) > 0
        assert not lease.lost
    finally:
        heartbeat.stop()
        store.client.close()


def test_an_unexpected_error_in_a_beat_is_logged_and_the_next_beat_extends(
    lock_url: str,
    lock_redis: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The heartbeat never dies silently: a beat that raises is logged, and the loop goes on."""
    store = LockStore.from_url(lock_url)
    heartbeat = Heartbeat()
    lease = _granted(store, "beaten", 2_000)
    extend_all = store.extend_all
    calls: list[int] = []

    def fails_once(leases: list[Lease]) -> list[bool]:
        calls.append(len(leases))
        if len(calls) == 1:
            raise RuntimeError("a bug in a beat")
        return extend_all(leases)

    monkeypatch.setattr(store, "extend_all", fails_once)
    lock_redis.pexpire(lease.keys.lock, 1_000)  # extended back to 2 s only by a later beat
    try:
        with caplog.at_level("ERROR", logger="celery_lock.heartbeat"):
            heartbeat.add(lease, 0.1)
            deadline = time.monotonic() + 10
            # Until a later beat has extended the lease (its call is counted before it runs).
            while time.monotonic() < deadline and not (
                len(calls) >= 2 and lock_redis.pttl(lease.keys.lock) > 1_000
            ):
                time.sleep(0.02)
    finally:
        heartbeat.stop()
        store.client.close()
    assert len(calls) >= 2, "the heartbeat stopped beating after an unexpected error"
    assert lock_redis.pttl(lease.keys.lock) > 1_000
    assert not lease.lost
    assert "heartbeat failed; trying again next interval" in caplog.text
    assert "a bug in a beat" in caplog.text


#: Run under ``eventlet.monkey_patch()``, as ``celery worker -P eventlet`` runs before it imports
#: the app: a 1 s lease, beaten every 0.2 s while the main greenlet sleeps three TTLs. Prints
#: what the heartbeat saw of itself, as JSON.
_UNDER_EVENTLET = """
import eventlet

eventlet.monkey_patch()

import json, sys, threading, time

from celery_lock.heartbeat import Heartbeat
from celery_lock.keys import RequestKeys
from celery_lock.lease import Holder, Lease, new_token
from celery_lock.store import LockStore

store = LockStore.from_url(sys.argv[1])
keys = RequestKeys.build("celery-lock", "shop.process", "green", "shop.process")
token = new_token()
holder = Holder("task-1", "shop.process", "host-a", 101)
fence = store.acquire(keys, token, 1_000, holder, 1_000).fence
lease = Lease(store, keys, token, 1_000, fence, holder)
heartbeat = Heartbeat()
beats, extends = [], []
beat, extend_all = heartbeat.beat, store.extend_all


def beat_and_look():
    beats.append(threading.current_thread() is heartbeat._thread)
    beat()


def extend_and_look(leases):
    extends.append(threading.current_thread().name)
    return extend_all(leases)


heartbeat.beat, store.extend_all = beat_and_look, extend_and_look
heartbeat.add(lease, 0.2)
time.sleep(3.0)
thread = heartbeat._thread
seen = {
    "beats_on_its_own_thread": beats,
    "extends_on": sorted(set(extends)),
    "lost": lease.lost,
    "owned": store.client.get(keys.lock).decode().startswith(token),
}
heartbeat.stop()
seen["stopped"] = not heartbeat.running and not thread.is_alive()
print(json.dumps(seen))
"""


def test_under_eventlet_the_heartbeat_is_a_green_thread_that_knows_itself(lock_url: str) -> None:
    # Under -P eventlet threading is eventlet's. The heartbeat tells its own thread from its
    # callers' by threading.current_thread(): a beat on it extends on a thread apart (see
    # Heartbeat.beat), and the thread clears the running flag as it ends. Both must hold for a
    # green thread too, and the lease must outlive its TTL while the main greenlet sleeps.
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _UNDER_EVENTLET, lock_url],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["beats_on_its_own_thread"]
    assert all(seen["beats_on_its_own_thread"]), seen
    assert seen["extends_on"] == ["celery-lock-heartbeat-extend"], seen
    assert not seen["lost"]
    assert seen["owned"]
    assert seen["stopped"]
