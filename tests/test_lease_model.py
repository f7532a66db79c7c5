"""The lease scripts against a model of the contract, in random sequences, on a real redis-server.

Hypothesis drives acquisitions, releases and extends by current and stale tokens of two tasks
that share a scope, beside the faults a real deployment sees: a lease that lapses, a fence
counter that expires, a done-marker forgotten (``celery lock forget``). After every step the
scripts' answers must be what the contract says, and the keys must hold what the model holds:

- a grant's fence is one more than the request's last, or once the counter is gone, the
  granting process's clock in microseconds, above every fence the request had; the same for a
  retried acquire with the same token;
- a done-marker of the copy's task comes first, then a lease held by another token;
- a release or an extend acts only for the token that holds the lease, and a release writes
  the done-marker only on success;
- the fence counter lives at least as long as the longest fence TTL a grant asked of it (never
  shortened by a grant that asks less).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from celery_lock.keys import RequestKeys
from celery_lock.lease import Acquired, Done, Held, Holder, Lease, new_token
from celery_lock.store import LockStore

REQUESTS = ("a", "b")
#: Two stages of one scope: they share the lease and the fence, each has its own done-marker.
TASKS = ("shop.pending", "shop.process")
TTL_MS = 60_000
FENCE_TTLS_MS = (20_000, 90_000)
DONE_TTL_MS = 120_000
#: What the fence counter's TTL may have lost to the time the steps take.
SLACK_MS = 5_000


def keys_of(request: str, task: str) -> RequestKeys:
    return RequestKeys.build("model", "scope", request, task)


@dataclass
class Grant:
    token: str
    holder: Holder
    fence: int


@dataclass
class Request:
    """What the contract says the store holds for one request."""

    lease: Grant | None = None
    #: The last fence granted while the counter lived; ``None``: no counter.
    fence: int | None = None
    #: The largest fence ever granted, counters gone or not.
    highest: int = 0
    #: Monotonic time until which the counter must live (the longest TTL a grant asked).
    fence_until: float = 0.0
    done: dict[str, str] = field(default_factory=dict)
    #: Grants that are no longer the lease (released or lapsed): their tokens are stale.
    stale: list[Grant] = field(default_factory=list)


class LeaseModel(RuleBasedStateMachine):
    def __init__(self, url: str) -> None:
        super().__init__()
        self.store = LockStore.from_url(url)
        self.admin = redis.Redis.from_url(url)
        self.requests = {name: Request() for name in REQUESTS}
        self.task_ids = 0

    @initialize()
    def empty(self) -> None:
        self.admin.flushdb()

    def teardown(self) -> None:
        self.store.client.close()
        self.admin.close()

    def _holder(self, task: str) -> Holder:
        self.task_ids += 1
        return Holder(f"task-{self.task_ids}", task, "host", 1)

    def _lease(self, request: str, grant: Grant) -> Lease:
        keys = keys_of(request, grant.holder.task_name)
        return Lease(self.store, keys, grant.token, TTL_MS, grant.fence, grant.holder)

    @rule(request=st.sampled_from(REQUESTS), task=st.sampled_from(TASKS),
          fence_ttl_ms=st.sampled_from(FENCE_TTLS_MS))  # fmt: skip
    def acquire(self, request: str, task: str, fence_ttl_ms: int) -> None:
        state = self.requests[request]
        holder = self._holder(task)
        token = new_token()
        before_us = time.time_ns() // 1000
        outcome = self.store.acquire(keys_of(request, task), token, TTL_MS, holder, fence_ttl_ms)
        after_us = time.time_ns() // 1000
        if task in state.done:
            assert outcome == Done(task_id=state.done[task])
        elif state.lease is not None:
            assert outcome == Held(
                task_id=state.lease.holder.task_id,
                task_name=state.lease.holder.task_name,
                pttl_ms=outcome.pttl_ms if isinstance(outcome, Held) else -1,
            )
            assert 0 < outcome.pttl_ms <= TTL_MS
        else:
            assert isinstance(outcome, Acquired)
            fence = outcome.fence
            if state.fence is not None:
                assert fence == state.fence + 1
            else:  # a new counter, started from the clock
                assert max(before_us, state.highest + 1) <= fence <= after_us
            state.lease, state.fence = Grant(token, holder, fence), fence
            state.highest = fence
            state.fence_until = max(state.fence_until, time.monotonic() + fence_ttl_ms / 1000)

    @rule(request=st.sampled_from(REQUESTS), fence_ttl_ms=st.sampled_from(FENCE_TTLS_MS))
    def acquire_again_after_a_lost_reply(self, request: str, fence_ttl_ms: int) -> None:
        state = self.requests[request]
        if state.lease is None:
            return
        lease = state.lease
        keys = keys_of(request, lease.holder.task_name)
        outcome = self.store.acquire(keys, lease.token, TTL_MS, lease.holder, fence_ttl_ms)
        # Re-entrant: the same grant, not HELD against itself, and no new fence.
        assert outcome == Acquired(fence=lease.fence)

    @rule(request=st.sampled_from(REQUESTS), success=st.booleans(), stale=st.booleans())
    def release(self, request: str, success: bool, stale: bool) -> None:
        state = self.requests[request]
        grant = state.stale[-1] if stale and state.stale else state.lease
        if grant is None:
            return
        owned = grant is state.lease
        # A success release of a grant no longer held that finds its own done-marker, the lock
        # free and no grant made since its own, was released by itself before (a try whose reply
        # was lost, or here a second release): it reports the lease owned.
        released_before = (
            success
            and state.lease is None
            and state.done.get(grant.holder.task_name) == grant.holder.task_id
            and state.fence == grant.fence
        )
        lease = self._lease(request, grant)
        answer = self.store.release(lease, success=success, done_ttl_ms=DONE_TTL_MS)
        assert answer is (owned or released_before)
        if owned:
            state.lease = None
            state.stale.append(grant)
            if success:
                state.done[grant.holder.task_name] = grant.holder.task_id

    @rule(request=st.sampled_from(REQUESTS))
    def extend(self, request: str) -> None:
        state = self.requests[request]
        grants = [g for g in (state.lease, *state.stale[-1:]) if g is not None]
        if not grants:
            return
        answers = self.store.extend_all([self._lease(request, g) for g in grants])
        assert answers == [g is state.lease for g in grants]

    @rule(request=st.sampled_from(REQUESTS))
    def lease_lapses(self, request: str) -> None:
        state = self.requests[request]
        if state.lease is None:
            return
        self.admin.delete(keys_of(request, TASKS[0]).lock)  # as its TTL would
        state.stale.append(state.lease)
        state.lease = None

    @rule(request=st.sampled_from(REQUESTS))
    def fence_counter_expires(self, request: str) -> None:
        state = self.requests[request]
        if state.lease is not None:
            return  # the counter outlives every lease (grants and extends see to it)
        self.admin.delete(keys_of(request, TASKS[0]).fence)
        state.fence, state.fence_until = None, 0.0

    @rule(request=st.sampled_from(REQUESTS), task=st.sampled_from(TASKS))
    def done_marker_forgotten(self, request: str, task: str) -> None:
        self.admin.delete(keys_of(request, task).done)
        self.requests[request].done.pop(task, None)

    @invariant()
    def the_store_holds_what_the_model_holds(self) -> None:
        for name, state in self.requests.items():
            keys = keys_of(name, TASKS[0])
            lock = self.admin.get(keys.lock)
            if state.lease is None:
                assert lock is None
            else:
                assert lock is not None
                assert lock.decode().startswith(f"{state.lease.token} {state.lease.fence} ")
            counter = self.admin.get(keys.fence)
            assert (counter and int(counter)) == (state.fence or None)
            if state.fence is not None:
                left_ms = (state.fence_until - time.monotonic()) * 1000
                assert self.admin.pttl(keys.fence) >= left_ms - SLACK_MS
            for task in TASKS:
                marker = self.admin.get(keys_of(name, task).done)
                assert (marker and marker.decode()) == state.done.get(task)


@pytest.mark.timeout(600)
def test_the_scripts_keep_the_contract_in_any_order_of_steps(lock_url: str) -> None:
    run_state_machine_as_test(
        lambda: LeaseModel(lock_url),
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
