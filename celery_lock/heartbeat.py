"""The per-process heartbeat: keeps every lease the process holds alive.

One daemon thread per process (started after fork, stopped at process shutdown) wakes every
interval and extends all held leases of a store in one pipelined round trip, on a thread of its
own per store, so that a store that hangs holds back no other. A lease whose extend
answers "not yours" is lost at once; a lease that cannot be confirmed (Redis unreachable) is lost
once a full TTL has passed since it was last confirmed, because by then it has surely expired.
A release that found the store unavailable is tried again on each beat while its lease may still
be held (:meth:`Heartbeat.release_later`), so a blip at the end of a run does not cost the
request its done-marker. The thread never dies silently: an unexpected error is logged and the
loop goes on.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from time import monotonic as _monotonic

import redis

from .exceptions import LockStoreError, LockStoreUnavailableError
from .lease import Lease
from .store import LockStore, address_of

__all__ = ["Heartbeat", "green_pool"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Release:
    """A release to try again: its lease, its outcome, and whom to tell once it is done."""

    lease: Lease
    success: bool
    done_ttl_ms: int
    #: Called with whether the lease was still owned (``None``: cannot tell, see
    #: :meth:`LockStore.release`), once a try got an answer.
    then: Callable[[bool | None], None] | None


#: Seconds an exiting process goes on trying the releases left for later of runs that
#: succeeded (while their leases last): given up, their done-markers are lost, and a later copy
#: runs the request again. Long enough for a blip or a restart of the lock store, short enough
#: not to hold up a shutdown much (the process is gone after it, and the store is unavailable
#: to every locked task meanwhile).
_EXIT_PATIENCE = 5.0
#: Seconds between those tries.
_EXIT_RETRY_PAUSE = 0.2


# The signals a fault in the thread itself raises: blocked, their outcome is undefined.
_SYNCHRONOUS = {"SIGBUS", "SIGFPE", "SIGILL", "SIGSEGV", "SIGSYS", "SIGTRAP"}
#: Every other signal: those a process may be sent, which the heartbeat's threads block.
_SENT = frozenset(s for s in signal.valid_signals() if getattr(s, "name", "") not in _SYNCHRONOUS)


def start_apart(thread: threading.Thread) -> None:
    """Start ``thread``, one of the heartbeat's (or another of celery-lock's own, which sends an
    event), blocking from its first instruction every signal a process may be sent (it inherits
    the mask it is started with).

    So that the kernel never hands such a signal to it. The kernel hands a process-directed
    signal to another thread where the main thread already has one pending: a cold shutdown
    (``SIGQUIT``) right after a warm one, under ``-P solo``, or a pool process's ``SIGTERM``
    (``revoke(terminate=True)``, a hard time limit) beside another signal. Handed to the
    heartbeat's thread, it did not interrupt what the main thread waited on (a body's sleep, a
    socket read): Python ran the handler only once that wait returned, seconds later. Not under
    a green pool, whose heartbeat runs on the main thread itself.
    """
    if green_pool() is not None or not hasattr(signal, "pthread_sigmask"):
        thread.start()
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _SENT)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextlib.contextmanager
def _signals_unblocked() -> Iterator[None]:
    """Unblock, while a receiver of the user's runs (on a heartbeat's thread, mostly), the
    signals that thread blocks: a process the receiver starts inherits the mask, and would
    ignore ``SIGTERM``. The thread's own mask is put back after, whichever thread it is."""
    if green_pool() is not None or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_UNBLOCK, _SENT)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def green_pool() -> str | None:
    """``"gevent"`` or ``"eventlet"`` where it has patched ``threading`` in this process
    (``celery worker -P gevent`` or ``-P eventlet`` patches it first thing): the heartbeat is a
    greenlet there, and a task's body runs in a greenlet of the worker's own process."""
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("threading"):
        return "gevent"
    eventlet_patcher = sys.modules.get("eventlet.patcher")
    if eventlet_patcher is not None and eventlet_patcher.is_monkey_patched("thread"):
        return "eventlet"
    return None


class Heartbeat:
    """Extends the leases of one process until they are released."""

    def __init__(self, default_interval: float = 20.0) -> None:
        self.pid = os.getpid()
        self.default_interval = default_interval
        self._leases: dict[int, tuple[Lease, float]] = {}
        #: Releases that found the store unavailable, tried again on each beat (release_later).
        self._releasing: dict[int, _Release] = {}
        #: Releases taken out of ``_releasing`` while a thread tries them.
        self._trying: dict[int, _Release] = {}
        #: Releases being tried that settle_releases gave up on (by their lease's id).
        self._given_up: set[int] = set()
        #: What the thread waits while no lease is held: the shortest interval it has seen.
        self._idle_interval = default_interval
        #: What the thread waits now: only a lease that needs a shorter wait wakes it.
        self._waiting = math.inf
        self._guard = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # Set when the thread starts and cleared as it ends, however it ends: add() asks on
        # every task whether the thread runs, and Thread.is_alive() costs three Python calls
        # and a lock (bench.cachegrind: some 80 first-level cache misses per task).
        self._alive = False
        #: Stores being extended on a thread of their own (see beat), and that thread.
        self._in_flight: dict[LockStore, threading.Thread] = {}

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def running(self) -> bool:
        """Whether the thread is alive."""
        return self._alive

    def start(self) -> None:
        """Start the thread (idempotent)."""
        with self._guard:
            if self.running:
                return
            # A stop signal per thread: clearing a shared one would revive a thread that
            # outlived stop()'s join (stuck in a slow extend) beside the new one.
            self._stopping = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._stopping,), name="celery-lock-heartbeat", daemon=True
            )
            self._alive = True
            try:
                start_apart(self._thread)
            except BaseException:
                # At the thread limit ("can't start new thread"): not running, so that the next
                # lease tries again rather than trust a thread that never began.
                self._alive = False
                self._thread = None
                raise

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait (bounded) for it, and for the extends it started, to end."""
        deadline = _monotonic() + timeout
        self._stopping.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        # An extend still on its way would go on with a client the runtime closes next.
        with self._guard:
            extending = list(self._in_flight.values())
        for extend in extending:
            if extend is not threading.current_thread():
                extend.join(max(0.0, deadline - _monotonic()))
        with self._guard:
            # Only the thread this call stopped: one that add() started during the joins runs
            # on, and forgetting it here would leave it beating beside the next one started.
            if self._thread is thread:
                self._thread = None
                self._alive = False

    def add(self, lease: Lease, interval: float) -> None:
        """Keep ``lease`` alive, extending it at least every ``interval`` seconds."""
        with self._guard:
            self._leases[id(lease)] = (lease, interval)
            # Waking the thread costs every task a thread switch: wake it only when its wait
            # is too long for this lease. Since it waits the shortest interval seen even while
            # no lease is held, a process running one task after another never wakes it.
            if interval < self._idle_interval:  # noqa: PLR1730 - min(), without its call per task
                self._idle_interval = interval
            shorter = interval < self._waiting
        if not self._alive:  # self.running, without the property's call on every task
            self.start()
        elif shorter:
            self._wake.set()

    def discard(self, lease: Lease) -> None:
        """Stop extending ``lease`` (it is being released)."""
        with self._guard:
            self._leases.pop(id(lease), None)

    def leases(self) -> list[Lease]:
        """The leases held now."""
        with self._guard:
            return [lease for lease, _ in self._leases.values()]

    def release_later(
        self,
        lease: Lease,
        *,
        success: bool,
        done_ttl_ms: int,
        then: Callable[[bool | None], None] | None = None,
    ) -> None:
        """Try ``lease``'s release again on each beat, until a try gets an answer or the lease
        has surely lapsed (a whole TTL unconfirmed); then call ``then(owned)``, on the thread
        that beats. For a release that found the store unavailable: the lease, and with it the
        done-marker of a run that succeeded, may outlast the outage."""
        self._keep(_Release(lease, success, done_ttl_ms, then))
        if not self.running:
            try:
                self.start()
            except RuntimeError as exc:  # "can't start new thread": the next lease starts it
                logger.warning(
                    "celery-lock: no heartbeat to release %s later: %s", lease.keys.lock, exc
                )

    def _interval(self) -> float:
        return min((i for _, i in self._leases.values()), default=self._idle_interval)

    def _run(self, stopping: threading.Event) -> None:
        last_beat = _monotonic()
        try:
            while not stopping.is_set():
                with self._guard:
                    interval = self._waiting = self._interval()
                # Counted from the last beat, not from now: a wake-up (a lease with a shorter
                # interval, perhaps released again at once) must not start the wait over, or
                # leases added often enough would keep the others from ever being extended.
                remaining = last_beat + interval - _monotonic()
                if remaining > 0 and self._wake.wait(remaining):
                    self._wake.clear()
                    continue
                last_beat = _monotonic()
                try:
                    self.beat()
                except Exception:
                    logger.exception("celery-lock: heartbeat failed; trying again next interval")
        finally:
            # Only the current thread: one that outlived stop()'s join must not clear the flag
            # of the thread started after it.
            if self._thread is threading.current_thread():
                self._alive = False

    def beat(self) -> None:
        """Extend every held lease now: one pipelined round trip per lock store.

        With leases on several stores, each store is extended on a thread of its own, and a
        store whose extend from an earlier beat is still on its way is left out of this one: a
        store that hangs (up to two socket timeouts per extend) must not hold back the other
        stores' extends until their leases lapse. So is a lone store on the heartbeat's own
        thread: a task on another store may start while that store's extend hangs, and its lease
        would lapse before the thread came back to it. Called on any other thread (a test, a
        shutdown), leases on one store are extended on that thread, the call returning when done.
        """
        by_store: dict[LockStore, list[Lease]] = defaultdict(list)
        for lease in self.leases():
            if lease.expired:
                # Lost, or a whole TTL unconfirmed, which counts as lost however its store
                # answers in the end: an extend still on its way (a store that hangs) would
                # tell only after two socket timeouts, while another worker may hold it.
                self._lost_if_held(lease)
            else:
                by_store[lease.store].append(lease)
        for store in self._stores_releasing():
            by_store.setdefault(store, [])  # visited for its releases, even with no lease held
        if len(by_store) == 1 and threading.current_thread() is not self._thread:
            [(store, leases)] = by_store.items()
            with self._guard:
                in_flight = store in self._in_flight
            if not in_flight:
                self._extend(store, leases)
                return
        for store, leases in by_store.items():
            with self._guard:
                if store in self._in_flight:
                    continue
                thread = threading.Thread(
                    target=self._extend_apart,
                    args=(store, leases),
                    name="celery-lock-heartbeat-extend",
                    daemon=True,
                )
                self._in_flight[store] = thread
            try:
                start_apart(thread)
            except RuntimeError:  # "can't start new thread": a process at its limit (pids.max)
                with self._guard:
                    self._in_flight.pop(store, None)
                self._extend(store, leases)  # here, then: late for the others, never left out

    def _extend_apart(self, store: LockStore, leases: list[Lease]) -> None:
        """:meth:`_extend` on a thread of its own; the store may be extended again once done."""
        try:
            self._extend(store, leases)
        except Exception:
            logger.exception("celery-lock: heartbeat failed; trying again next interval")
        finally:
            with self._guard:
                self._in_flight.pop(store, None)

    def _extend(self, store: LockStore, leases: list[Lease]) -> None:
        """Extend the leases of one store; mark lost those it no longer holds, and those left
        unconfirmed for a whole TTL. Then try the store's releases again, if it answered."""
        started = _monotonic()
        try:
            owned = store.extend_all(leases)
        except redis.RedisError as exc:
            # Unreachable, or an error reply (READONLY after a failover): either way the
            # lease is unconfirmed, and lost once a whole TTL has passed unconfirmed.
            logger.warning("celery-lock: heartbeat could not extend leases: %s", exc)
            for lease in leases:
                if _monotonic() - lease.confirmed_at >= lease.ttl_ms / 1000:
                    self._lost_if_held(lease)
            self._release_pending(store, give_up_only=True)
            return
        for lease, still_owned in zip(leases, owned, strict=True):
            if still_owned:
                lease.confirmed_at = started
            else:
                self._lost_if_held(lease)
        self._release_pending(store)

    def _stores_releasing(self) -> set[LockStore]:
        with self._guard:
            return {release.lease.store for release in self._releasing.values()}

    def _release_pending(self, store: LockStore, *, give_up_only: bool = False) -> None:
        """Try the releases of ``store`` left for later again, until one finds it unavailable;
        give up those whose lease has surely lapsed (only that, with ``give_up_only``)."""
        with self._guard:
            pending = [r for r in self._releasing.values() if r.lease.store is store]
        for release in pending:
            key = id(release.lease)
            # Taken out while it is tried: the shutdown's hand_back may try it meanwhile, and
            # only one of them may report it. Kept in view as tried, for settle_releases.
            with self._guard:
                if self._releasing.pop(key, None) is None:
                    continue
                self._trying[key] = release
            keep = True  # an exception, whatever it is, must not lose the release
            try:
                give_up_only, keep = self._try_release(store, release, give_up_only=give_up_only)
            finally:
                # Out of one and back into the other at once: a settle_releases reading both
                # between the two would find it in neither.
                with self._guard:
                    self._trying.pop(key, None)
                    if keep and key not in self._given_up:
                        self._releasing[key] = release

    def _try_release(
        self, store: LockStore, release: _Release, *, give_up_only: bool
    ) -> tuple[bool, bool]:
        """One try of :meth:`_release_pending`; return whether the store is still to be only
        given up on (found unavailable), and whether to keep the release for a later try."""
        lease = release.lease
        if lease.expired:
            # A whole TTL unconfirmed (or found lost): the lock is gone or another's, and no
            # try can write the done-marker any more.
            logger.error(
                "celery-lock: gave up releasing %s for task %s: the lock store stayed "
                "unavailable until its lease lapsed%s",
                lease.keys.lock,
                lease.holder.task_id,
                "; no done-marker was written" if release.success else "",
            )
            return give_up_only, False
        if give_up_only:
            return give_up_only, True
        try:
            # tried_before: a try of the call that failed may have run, its reply lost.
            owned = store.release(
                lease,
                success=release.success,
                done_ttl_ms=release.done_ttl_ms,
                tried_before=True,
            )
        except LockStoreUnavailableError:
            return True, True  # still unavailable: the others wait for the next beat
        except LockStoreError as exc:
            logger.error(
                "celery-lock: release of %s for task %s failed: %s",
                lease.keys.lock,
                lease.holder.task_id,
                exc,
            )
            return give_up_only, False
        logger.info(
            "celery-lock: released %s for task %s once the lock store answered",
            lease.keys.lock,
            lease.holder.task_id,
        )
        if release.then is not None:
            try:
                with _signals_unblocked():  # lock_released's receivers
                    release.then(owned)
            except Exception:
                logger.exception("celery-lock: after releasing %s", lease.keys.lock)
        return give_up_only, False

    def settle_releases(self, patience: float = _EXIT_PATIENCE) -> set[LockStore]:
        """Try the releases left for later (:meth:`release_later`), with their outcome: again
        and again for up to ``patience`` seconds while one of a run that succeeded is left (its
        done-marker, given up, is lost), else once. Log and forget those still left, a try still
        on its way included, and return their stores (found unavailable).

        For a process about to end. The heartbeat may go on beating meanwhile (a threads pool's
        bodies may still run): a release its thread is trying counts as left.
        """
        give_up_at = _monotonic() + patience
        while True:
            for store in self._stores_releasing():
                self._release_pending(store)
            with self._guard:
                left = list(self._releasing.values())
                tried = list(self._trying.values())
            now = _monotonic()
            waiting = (r.success and not r.lease.expired for r in left + tried)
            if now >= give_up_at or not any(waiting):
                break
            time.sleep(min(_EXIT_RETRY_PAUSE, give_up_at - now))
        with self._guard:
            # A try still on its way (a store that hangs) is given up too: its release is not
            # put back for a later try, nor waited on again by a second settle.
            self._given_up.update(id(release.lease) for release in tried)
            given_up = [r for r in left if self._releasing.pop(id(r.lease), None) is not None]
        # (Those no longer waiting were taken by the heartbeat's thread meanwhile.)
        for release in given_up + tried:
            lease = release.lease
            logger.log(
                logging.ERROR if release.success else logging.WARNING,
                "celery-lock: gave up releasing %s for task %s: the process exits, its lock "
                "store unavailable%s",
                lease.keys.lock,
                lease.holder.task_id,
                "; no done-marker was written: a later copy runs the request again"
                if release.success
                else "; the lease lapses by its TTL",
            )
        return {release.lease.store for release in left + tried}

    def _keep(self, release: _Release) -> None:
        with self._guard:
            self._releasing[id(release.lease)] = release

    def _lost_if_held(self, lease: Lease) -> None:
        """Mark ``lease`` lost, unless its task let go of it while the extend was on its way.

        A task drops its lease from the heartbeat before its release script deletes the lock,
        so an extend that finds the lock gone for a lease no longer held met that release, not
        a loss: reporting it would send ``lock_lost`` for a task that ended well.
        """
        with self._guard:
            held = self._leases.get(id(lease), (None, 0.0))[0] is lease
        if held:
            with _signals_unblocked():  # lock_lost's receivers
                lease.mark_lost()

    def hand_back(self, patience: float = _EXIT_PATIENCE) -> int:
        """Release every held lease without a done-marker; return how many were released.

        For a process about to die with bodies unfinished: where their messages come back (a
        shutdown with late acks), they run at once instead of waiting a whole TTL. The releases
        left for later are settled first (:meth:`settle_releases`, up to ``patience`` seconds).
        A store found unavailable is not asked again: the rest of its leases are left to lapse,
        so that a store that is down or hangs costs the shutdown one try's time (up to two
        socket timeouts) more, not one per lease (a threads or gevent pool holds many).
        """
        unavailable = self.settle_releases(patience)
        released = 0
        left: defaultdict[LockStore, int] = defaultdict(int)
        for lease in self.leases():
            self.discard(lease)
            if lease.store in unavailable:
                left[lease.store] += 1
                continue
            try:
                if lease.store.release(lease, success=False, done_ttl_ms=1):
                    released += 1
            except LockStoreError as exc:
                logger.warning("celery-lock: could not hand back %s: %s", lease.keys.lock, exc)
                if isinstance(exc, LockStoreUnavailableError):
                    unavailable.add(lease.store)
        for store, count in left.items():
            logger.warning(
                "celery-lock: left %d more lease(s) of unfinished tasks to lapse, unasked: their "
                "lock store %s was unavailable",
                count,
                address_of(store.client),
            )
        if released:
            logger.warning("celery-lock: handed back %d lease(s) of unfinished tasks", released)
        return released
