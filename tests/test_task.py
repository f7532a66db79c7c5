"""LockedTask's outcomes, run by an in-process worker (celery.contrib.pytest) on a real Redis.

Another holder is simulated by taking the lease with :class:`LockStore` directly, so each test
controls exactly who holds the request and for how long.
"""

from __future__ import annotations

import collections.abc
import contextlib
import functools
import json
import logging
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Protocol
from unittest import mock

import celery.local
import pytest
import redis
from celery import Celery, Signature, Task, chain, chord, current_task, group
from celery.app.task import Context
from celery.contrib.testing.worker import TestWorkController
from celery.exceptions import Ignore, Retry, SoftTimeLimitExceeded
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.signals import before_task_publish, task_postrun
from celery.states import STARTED
from conftest import consecutive, hold, wait_for
from kombu.exceptions import EncodeError, OperationalError
from recording import recording

import celery_lock.bases
import celery_lock.events
import celery_lock.task
from celery_lock import (
    SKIPPED,
    ConfigurationError,
    DuplicateTaskError,
    LockContendedError,
    LockedTask,
    LockKeyError,
    LockLostError,
    LockStoreUnavailableError,
    ResultUnavailableError,
    check_canvas,
    follow,
    install,
    is_skipped,
    signals,
)
from celery_lock.keys import RequestKeys
from celery_lock.lease import HandOn, Holder, Lease
from celery_lock.runtime import get_runtime
from celery_lock.store import LockStore
from celery_lock.task import DEFERRALS_HEADER

TIMEOUT = 20
pytestmark = pytest.mark.usefixtures("close_lock_runtime")


class Calls:
    """What the bodies saw, shared between the worker thread and the test."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.started = threading.Event()
        self.proceed = threading.Event()

    def count(self, name: str) -> int:
        return sum(1 for call in self.seen if call["task"] == name)


@pytest.fixture
def calls() -> Calls:
    return Calls()


@pytest.fixture
def tasks(celery_app: Celery, calls: Calls) -> dict[str, Any]:
    """The tasks under test, registered before the worker starts."""

    def seen(task: Any, **extra: Any) -> None:
        calls.seen.append(
            {
                "task": task.name,
                "id": task.request.id,
                "fence": task.request.lock_fence,
                "lock_key": task.request.lock_key,
                "retries": task.request.retries,
                "current_task": current_task.name if current_task else None,
                **extra,
            }
        )

    @celery_app.task(base=LockedTask, bind=True, lock_key="request_idx", name="t.process")
    def process(self: Any, request_idx: int) -> str:
        seen(self)
        return f"processed {request_idx}"

    @celery_app.task(
        base=LockedTask, bind=True, lock_key="request_idx", lock_scope="request", name="t.pending"
    )
    def pending(self: Any, request_idx: int) -> str:
        seen(self)
        return "pending"

    @celery_app.task(
        base=LockedTask, bind=True, lock_key="request_idx", lock_scope="request", name="t.stage"
    )
    def stage(self: Any, request_idx: int) -> str:
        seen(self)
        return "stage"

    @celery_app.task(
        base=LockedTask, bind=True, lock_key="request_idx", name="t.flaky", max_retries=3
    )
    def flaky(self: Any, request_idx: int) -> str:
        seen(self)
        if self.request.retries == 0:
            raise self.retry(countdown=0.1)
        return "second time lucky"

    @celery_app.task(
        base=LockedTask, bind=True, lock_key="request_idx", name="t.resend", max_retries=3
    )
    def resend(self: Any, request_idx: int, catch: bool) -> str:
        # Asks for a retry and returns anyway: the retry must still run.
        seen(self)
        if self.request.retries == 0:
            if catch:
                with contextlib.suppress(Retry):
                    self.retry(countdown=0.1)
            else:
                self.retry(countdown=0.1, throw=False)
            return "first, retry sent"
        return "the retry ran"

    @celery_app.task(
        base=LockedTask, bind=True, lock_key="request_idx", name="t.unsent", max_retries=3,
        lock_ttl=1.0,  # what a retry given back leaves to lapse before the request runs again
    )  # fmt: skip
    def unsent(self: Any, request_idx: int, refusal: str) -> str:
        # Its first run's retry cannot be published: the broker refuses it for now (a lost
        # connection, a full queue), or for good (no such serializer: every publish fails).
        seen(self)
        if refusal == "for-now" and calls.count("t.unsent") == 1:
            with mock.patch.object(
                Signature, "apply_async", side_effect=OperationalError("the broker refused it")
            ):
                raise self.retry(countdown=0.1)
        if refusal == "for-good":
            raise self.retry(countdown=0.1, serializer="no-such-serializer")
        return "run again"

    @celery_app.task(base=LockedTask, bind=True, lock_key="request_idx", name="t.boom")
    def boom(self: Any, request_idx: int) -> None:
        seen(self)
        raise RuntimeError("boom")

    @celery_app.task(
        base=LockedTask, bind=True, lock_key="request_idx", name="t.slow", lock_ttl=1.2
    )
    def slow(self: Any, request_idx: int) -> bool:
        seen(self)
        calls.started.set()
        calls.proceed.wait(TIMEOUT)
        lost = self.request.lock_lost
        try:
            self.check_lock()
        except LockLostError:
            return True
        return lost

    @celery_app.task(base=LockedTask, bind=True, lock_key="request_idx", name="t.walk")
    def walk(self: Any, request_idx: int) -> Any:
        # Calls itself directly from its own body: the inner call is plain Python.
        before = (self.request.lock_key, self.request.lock_fence)
        inner = self(request_idx + 1) if request_idx == 0 else f"walked {request_idx}"
        seen(self, before=before, inner=inner)
        return inner

    @celery_app.task(base=LockedTask, bind=True, lock_key="request_idx", name="t.hop")
    def hop(self: Any, request_idx: int, hops: int, retry_last: bool = False) -> str:
        # Hands its request on to a copy of itself, as a paginating task does.
        seen(self, hops=hops)
        if hops:
            return self.replace(self.si(request_idx, hops - 1, retry_last))
        if retry_last and not self.request.retries:
            raise self.retry(countdown=0.1)
        return f"landed {request_idx}"

    @celery_app.task(base=LockedTask, bind=True, lock_key="request_idx", name="t.page")
    def page(self: Any, request_idx: int, pages: int) -> str:
        # Hands its request on to a chain: its next page (a task id of its own), then a plain
        # task (which inherits this task id).
        seen(self, pages=pages)
        if pages:
            return self.replace(chain(self.si(request_idx, pages - 1), nothing.si()))
        return f"last page of {request_idx}"

    @celery_app.task(base=LockedTask, bind=True, lock_key="request_idx", name="t.fan")
    def fan(self: Any, request_idx: int, width: int) -> str:
        # Hands its request on to a group of copies of itself (Celery makes it a chord).
        seen(self, width=width)
        if width:
            return self.replace(group(self.si(request_idx, 0) for _ in range(width)))
        return f"member of {request_idx}"

    @celery_app.task(base=LockedTask, bind=True, lock_key="request_idx", name="t.handoff")
    def handoff(self: Any, request_idx: int, send: bool = True) -> Any:
        # Hands its request on to the next stage, a task of another name.
        seen(self)
        step = process.si(request_idx)
        if not send:
            step.delay = mock.Mock(side_effect=OperationalError("broker gone"))
        return self.replace(step)

    @celery_app.task(base=LockedTask, bind=True, lock_key="request_idx", name="t.relay")
    def relay(self: Any, request_idx: int) -> str:
        value = self.replace(process.si(request_idx))  # eager: returns the replacement's value
        try:
            self.check_lock()
        except LockLostError:
            return f"{value}; lease handed on"
        return f"{value}; lease still held"

    @celery_app.task(
        base=LockedTask, bind=True, lock_key="request_idx", name="t.quiet", ignore_result=True
    )
    def quiet(self: Any, request_idx: int) -> str:
        seen(self)
        return f"quiet {request_idx}"

    @celery_app.task(base=LockedTask, bind=True, lock_key="request_idx", name="t.tags")
    def tags(self: Any, request_idx: int) -> set[str]:
        seen(self)
        return {"a", "b"}  # a set: the JSON result serializer cannot store it

    @celery_app.task(name="t.nothing")
    def nothing() -> None:
        return None

    def before_start(self: Any, task_id: str, args: Any, kwargs: Any) -> None:
        calls.seen.append({"task": "before_start", "id": task_id})

    @celery_app.task(
        base=LockedTask, bind=True, lock_key="request_idx", name="t.hooked",
        before_start=before_start,
    )  # fmt: skip
    def hooked(self: Any, request_idx: int) -> str:
        seen(self)
        return "hooked"

    @celery_app.task(name="t.sender")
    def sender() -> str:
        # Publishes, from a running task, a call whose callback lacks its key.
        step = process.si(None)
        step.freeze()
        nothing.apply_async(link=step)
        return str(step.id)

    class Traced(celery_app.Task):  # type: ignore[name-defined]
        """A base of the user's own with a ``__call__`` (tracing, a tenant's context)."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            fence = getattr(self.request, "lock_fence", None)
            calls.seen.append({"task": "traced.__call__", "fence": fence})
            return super().__call__(*args, **kwargs)

    class TracedLocked(Traced, LockedTask):  # the order check_call_order asks for
        pass

    @celery_app.task(base=TracedLocked, bind=True, lock_key="request_idx", name="t.traced")
    def traced(self: Any, request_idx: int) -> str:
        seen(self)
        return "traced"

    every = [process, pending, stage, flaky, resend, unsent, boom, slow, walk, hop, page, handoff]
    every += [relay, quiet, tags, nothing, hooked, sender, fan, traced]
    return {t.name.split(".", 1)[1]: t for t in every}


@pytest.fixture
def worker(tasks: dict[str, Any], celery_worker: TestWorkController) -> TestWorkController:
    return celery_worker


@pytest.fixture
def finished() -> Iterator[Callable[[str], threading.Event]]:
    """``finished(task_id)``: an event set when the worker is done with that task id."""
    events: dict[str, threading.Event] = {}

    def on_postrun(task_id: str, **_: Any) -> None:
        events.setdefault(task_id, threading.Event()).set()

    task_postrun.connect(on_postrun, weak=False)
    yield lambda task_id: events.setdefault(task_id, threading.Event())
    task_postrun.disconnect(on_postrun)


def test_body_runs_with_fence_and_lock_key(
    worker: Any, tasks: dict[str, Any], calls: Calls
) -> None:
    before_us = time.time_ns() // 1000
    assert tasks["process"].delay(7).get(timeout=TIMEOUT) == "processed 7"
    [call] = calls.seen
    assert before_us <= call["fence"] <= time.time_ns() // 1000  # a new request: the clock
    assert call["lock_key"] == "celery-lock:{t.process:7}:lock"


def test_success_writes_done_marker_and_frees_lock(
    worker: Any, tasks: dict[str, Any], lock_redis: redis.Redis
) -> None:
    result = tasks["process"].delay(7)
    result.get(timeout=TIMEOUT)
    keys: RequestKeys = tasks["process"].request_keys((7,), {})
    assert not lock_redis.exists(keys.lock)
    assert lock_redis.get(keys.done) == result.id.encode()


def test_copy_of_running_request_is_skipped(
    worker: Any, tasks: dict[str, Any], store: LockStore, calls: Calls
) -> None:
    hold(store, tasks["process"], 7, "holder-id")
    copy = tasks["process"].delay(7)
    wait_for("the copy to be SKIPPED", lambda: copy.state == SKIPPED, TIMEOUT)
    assert copy.info == {
        "celery_lock": "skipped",
        "reason": "running",
        "lock_key": "celery-lock:{t.process:7}:lock",
        "holder": "holder-id",
        "task": "t.process",
    }
    assert calls.seen == []


def test_a_failure_after_the_body_returned_leaves_the_request_done(
    worker: Any, tasks: dict[str, Any], calls: Calls
) -> None:
    # The body's effects have happened when Celery fails to store its result (or to send the
    # next step): the task ends FAILURE, and later copies are skipped, never run again.
    first = tasks["tags"].delay(7)
    wait_for("the run to fail", lambda: first.state == "FAILURE", TIMEOUT)
    copy = tasks["tags"].delay(7)
    with pytest.raises(EncodeError):
        follow(copy, timeout=TIMEOUT)  # the holder's failure
    assert (copy.state, copy.info["reason"], copy.info["holder"]) == (SKIPPED, "done", first.id)
    assert calls.count("t.tags") == 1


@pytest.mark.celery(task_track_started=True)
def test_under_track_started_only_the_run_that_holds_the_request_stores_started(
    worker: Any, tasks: dict[str, Any], calls: Calls
) -> None:
    # Celery stored STARTED for every delivery, before the lease was asked for: a redelivery
    # of a message whose request is done, acked as such, left STARTED over its FAILURE (and,
    # on rpc://, over its SUCCESS), so follow() and .get() waited for ever.
    running = tasks["slow"].delay(7)
    assert calls.started.wait(TIMEOUT)
    assert running.state == STARTED  # the holder's run stores it
    calls.proceed.set()
    running.get(timeout=TIMEOUT)
    first = tasks["tags"].delay(7)
    wait_for("the run to fail", lambda: first.state == "FAILURE", TIMEOUT)
    ended: list[str] = []

    def on_postrun(task_id: str, **_: Any) -> None:
        ended.append(task_id)

    task_postrun.connect(on_postrun, weak=False)
    try:
        tasks["tags"].apply_async((7,), task_id=first.id)  # the same message, again
        wait_for("the redelivery to be acked", lambda: first.id in ended, TIMEOUT)
    finally:
        task_postrun.disconnect(on_postrun)
    assert tasks["tags"].AsyncResult(first.id).state == "FAILURE"  # was STARTED (first caches)
    assert calls.count("t.tags") == 1


def test_copy_of_done_request_is_skipped_and_follows_to_holder(
    worker: Any, tasks: dict[str, Any], calls: Calls
) -> None:
    first = tasks["process"].delay(7)
    first.get(timeout=TIMEOUT)
    copy = tasks["process"].delay(7)
    assert follow(copy, timeout=TIMEOUT) == "processed 7"
    assert copy.state == SKIPPED
    assert copy.info["reason"] == "done"
    assert copy.info["holder"] == first.id
    assert calls.count("t.process") == 1


def test_before_start_runs_for_a_skipped_copy_too(
    worker: Any, tasks: dict[str, Any], store: LockStore, calls: Calls
) -> None:
    """Celery calls before_start ahead of the task, before the lease is taken: it runs for a
    copy that is then skipped, as docs/api.md says, and the body does not."""
    hooked = tasks["hooked"]
    hold(store, hooked, 7, "holder-id")
    copy = hooked.delay(7)
    wait_for("the copy to be SKIPPED", lambda: copy.state == SKIPPED, TIMEOUT)
    assert [call["id"] for call in calls.seen if call["task"] == "before_start"] == [copy.id]
    assert calls.count("t.hooked") == 0


@pytest.mark.skipif(
    celery_lock.task._get_actual_ignore_result is None,
    reason="before Celery 5.6.3 a task's ignore_result wins over its call's",
)
def test_a_skipped_copy_stores_skipped_when_its_call_asks_for_a_result(
    worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    """Celery stores a call's result by the call's own ignore_result, which overrides the
    task's: a skipped copy of such a call stores SKIPPED too, or it stayed PENDING and follow()
    waited on it until its timeout."""
    quiet = tasks["quiet"]
    assert quiet.apply_async((6,), ignore_result=False).get(timeout=TIMEOUT) == "quiet 6"
    hold(store, quiet, 7, "holder-id")
    copy = quiet.apply_async((7,), ignore_result=False)
    wait_for("the copy to be SKIPPED", lambda: copy.state == SKIPPED, TIMEOUT)
    assert copy.info["holder"] == "holder-id"


def skipped_copy(task: Any, request_idx: int, reason: str) -> Any:
    copy = task.delay(request_idx)
    wait_for("the copy to be SKIPPED", lambda: copy.state == SKIPPED, TIMEOUT)
    assert copy.info["reason"] == reason
    return copy


def test_follow_raises_when_a_done_holder_left_no_result(
    worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    # The holder finished (its done-marker names it) but its result is gone: expired, or ignored.
    store.release(hold(store, tasks["process"], 7, "gone-id"), success=True, done_ttl_ms=60_000)
    copy = skipped_copy(tasks["process"], 7, "done")
    with pytest.raises(ResultUnavailableError) as caught:
        follow(copy, timeout=TIMEOUT, grace=0.3)
    assert (caught.value.task_id, caught.value.lock_name) == ("gone-id", copy.info["lock_key"])


def handed_on(
    store: LockStore, task: Any, task_id: str, *, depth: int, done_ttl_ms: int = 86_400_000
) -> Lease:
    """Request 7 held by ``task_id`` and released as its body's ``self.replace`` releases it:
    the done-marker names a hand-on to a replacement at ``depth``, not known to be sent."""
    lease = hold(store, task, 7, task_id)
    lease.handed_on = HandOn(depth, task_id)
    assert store.release(lease, success=True, done_ttl_ms=done_ttl_ms)
    return lease


def test_follow_waits_past_its_grace_for_the_replacement_of_a_holder_that_handed_on(
    worker: Any, tasks: dict[str, Any], store: LockStore, celery_app: Celery
) -> None:
    # Its body called self.replace: the replacement stores the result under its task id.
    handed_on(store, tasks["process"], "handing-id", depth=0, done_ttl_ms=60_000)
    copy = skipped_copy(tasks["process"], 7, "done")
    assert (copy.info["holder"], copy.info["handed_on_at"]) == ("handing-id", 0)
    with pytest.raises(CeleryTimeoutError):
        follow(copy, timeout=1.0, grace=0.1)  # not ResultUnavailableError: it is to come
    late = threading.Timer(0.5, celery_app.backend.store_result, ("handing-id", 3, "SUCCESS"))
    late.start()
    try:
        assert follow(copy, timeout=TIMEOUT, grace=0.1) == 3
    finally:
        late.cancel()
        late.join(TIMEOUT)


@pytest.mark.parametrize("completed", [True, False], ids=["completed", "failed-or-died"])
def test_follow_waits_for_a_running_holder_and_raises_only_once_it_completed_unstored(
    worker: Any, tasks: dict[str, Any], store: LockStore, completed: bool
) -> None:
    lease = hold(store, tasks["process"], 7, "quiet-id")  # a holder that ignores its result
    copy = skipped_copy(tasks["process"], 7, "running")
    with pytest.raises(CeleryTimeoutError) as caught:
        follow(copy, timeout=1.0, grace=0.1)
    assert not isinstance(caught.value, ResultUnavailableError)  # it still holds: still running
    store.release(lease, success=completed, done_ttl_ms=60_000)
    if completed:  # done, and no result: it never comes
        with pytest.raises(ResultUnavailableError):
            follow(copy, timeout=TIMEOUT, grace=0.3)
    else:  # no done-marker: its rerun (or its FAILURE) is still to come, so wait for it
        with pytest.raises(CeleryTimeoutError) as caught:
            follow(copy, timeout=1.5, grace=0.1)
        assert not isinstance(caught.value, ResultUnavailableError)


def test_follow_gives_a_released_holder_grace_to_store_its_result(
    celery_app: Celery, worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    lease = hold(store, tasks["process"], 7, "late-id")
    copy = skipped_copy(tasks["process"], 7, "running")
    store.release(lease, success=True, done_ttl_ms=60_000)
    # The worker stores a result after its release: give it a moment.
    late = threading.Timer(0.5, celery_app.backend.store_result, ("late-id", "late", "SUCCESS"))
    late.start()
    try:
        assert follow(copy, timeout=TIMEOUT, grace=3.0) == "late"
    finally:
        late.cancel()
        late.join(TIMEOUT)


@pytest.fixture
def lock_at_publish(lock_redis: redis.Redis) -> Iterator[list[bool]]:
    """Whether the lock of ``t.hop``'s request 7 was held each time a ``t.hop`` was sent."""
    held: list[bool] = []

    def on_publish(headers: dict[str, Any], **_: Any) -> None:
        if headers.get("task") == "t.hop":
            held.append(bool(lock_redis.exists("celery-lock:{t.hop:7}:lock")))

    before_task_publish.connect(on_publish, weak=False)
    yield held
    before_task_publish.disconnect(on_publish)


def test_replace_hands_the_request_on_and_the_last_run_marks_it_done(
    worker: Any,
    tasks: dict[str, Any],
    calls: Calls,
    lock_redis: redis.Redis,
    lock_at_publish: list[bool],
) -> None:
    result = tasks["hop"].delay(7, 2)
    assert result.get(timeout=TIMEOUT) == "landed 7"
    # The replacements inherit the task id; each finds the lease free, not held by its own id.
    assert lock_at_publish == [False, False, False]
    assert [(c["hops"], c["id"]) for c in calls.seen] == [
        (2, result.id), (1, result.id), (0, result.id)
    ]  # fmt: skip
    assert consecutive([c["fence"] for c in calls.seen])
    keys: RequestKeys = tasks["hop"].request_keys((7, 0), {})
    assert not lock_redis.exists(keys.lock)
    assert lock_redis.get(keys.done) == result.id.encode()


replacements_keep_their_depth = pytest.mark.skipif(
    not celery_lock.task._REPLACEMENTS_KEEP_THEIR_DEPTH,
    reason="this Celery sends a replacement without its depth (before 5.3.5)",
)


@replacements_keep_their_depth
def test_a_handed_on_request_skips_later_copies_and_acks_its_own_redelivery(
    worker: Any,
    tasks: dict[str, Any],
    calls: Calls,
    lock_redis: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="celery_lock.task")
    result = tasks["handoff"].delay(7)
    assert result.get(timeout=TIMEOUT) == "processed 7"
    keys: RequestKeys = tasks["handoff"].request_keys((7,), {})
    marker = b"\xffhanded-on:0\xff%s\xff%s" % (result.id.encode(), result.id.encode())
    assert lock_redis.get(keys.done) == marker
    assert not lock_redis.exists(keys.lock)
    # Another message of the request: skipped as done, and followed to the replacement's value.
    copy = skipped_copy(tasks["handoff"], 7, "done")
    assert copy.info["holder"] == result.id
    assert follow(copy, timeout=TIMEOUT) == "processed 7"
    # The replaced message itself, delivered again: acked, and its SUCCESS kept.
    tasks["handoff"].apply_async((7,), task_id=result.id)
    acked = f"already handed on by this task {result.id}; acking the redelivery"
    wait_for("the redelivery to be acked", lambda: acked in caplog.text, TIMEOUT)
    assert (result.state, result.result) == ("SUCCESS", "processed 7")
    assert (calls.count("t.handoff"), calls.count("t.process")) == (1, 1)


@replacements_keep_their_depth
def test_a_hand_on_marker_the_store_could_not_confirm_stays_unsent_and_warns(
    worker: Any,
    tasks: dict[str, Any],
    calls: Calls,
    lock_redis: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unavailable(*_: Any) -> bool:
        raise LockStoreUnavailableError("confirm failed: Connection refused", lock_name="x")

    caplog.set_level(logging.WARNING, logger="celery_lock.task")
    monkeypatch.setattr(LockStore, "confirm_hand_on", unavailable)
    result = tasks["handoff"].delay(7)
    assert result.get(timeout=TIMEOUT) == "processed 7"  # the replacement went out, and ran
    keys: RequestKeys = tasks["handoff"].request_keys((7,), {})
    marker = b"\xffhanding-on:0\xff%s\xff%s" % (result.id.encode(), result.id.encode())
    assert lock_redis.get(keys.done) == marker
    assert "stays marked as being handed on" in caplog.text
    # Unconfirmed, a redelivery of the replaced message runs the request again, not lost.
    monkeypatch.undo()
    tasks["handoff"].apply_async((7,), task_id=result.id)
    wait_for("the rerun", lambda: calls.count("t.handoff") == 2, TIMEOUT)
    assert "when its run ended, its replacement not known to be sent" in caplog.text


@replacements_keep_their_depth
def test_a_fresh_unsent_hand_on_marker_of_its_own_defers_the_redelivery_until_it_is_old(
    worker: Any,
    tasks: dict[str, Any],
    store: LockStore,
    calls: Calls,
    lock_redis: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A marker written less than a lease TTL ago may be a live run's, still sending: a
    # visibility-timeout redelivery of its message then must not rerun the body beside it.
    caplog.set_level(logging.WARNING, logger="celery_lock.task")
    lease = handed_on(store, tasks["handoff"], "sending-id", depth=0)
    with recording(signals.lock_deferred) as deferred:
        tasks["handoff"].apply_async((7,), task_id="sending-id")
        wait_for("the redelivery to be deferred", lambda: deferred, TIMEOUT)
        assert calls.count("t.handoff") == 0
        assert {d["reason"] for d in deferred} == {"redelivered"}
        # Once it is older than a lease TTL, its run is dead: the next try reruns the request.
        lock_redis.pexpire(lease.keys.done, 60_000)
        # Waited for by the replacement's own record (it keeps the task id): a t.process
        # message an earlier test's worker left on the broker can run here too (seen once, on
        # a loaded machine).
        replaced = {"task": "t.process", "id": "sending-id"}
        wait_for(
            "the rerun's replacement",
            lambda: any(replaced.items() <= call.items() for call in calls.seen),
            TIMEOUT,
        )
    assert calls.count("t.handoff") == 1
    assert "when its run ended, its replacement not known to be sent" in caplog.text


def test_an_unsent_hand_on_marker_its_replacement_left_acks_a_redelivery_of_the_original(
    worker: Any,
    tasks: dict[str, Any],
    store: LockStore,
    calls: Calls,
    lock_redis: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The replacement (same task id, depth 1) handed on again and died sending: its marker is
    # its own message's to withdraw. The original message (depth 0), delivered again, ran its
    # part already and is acked unrun, the marker left.
    caplog.set_level(logging.INFO, logger="celery_lock.task")
    lease = handed_on(store, tasks["handoff"], "sending-id", depth=1)
    lock_redis.pexpire(lease.keys.done, 60_000)  # older than a lease TTL: no live run's
    marker = lock_redis.get(lease.keys.done)
    tasks["handoff"].apply_async((7,), task_id="sending-id")
    acked = "already handed on by this task"
    # The body's run ends the wait too: it fails at once, not at the timeout.
    wait_for("the redelivery acked", lambda: acked in caplog.text or calls.seen, TIMEOUT)
    assert calls.count("t.handoff") == 0
    assert lock_redis.get(lease.keys.done) == marker


@replacements_keep_their_depth
def test_an_exception_during_the_hand_on_release_withdraws_the_marker_it_wrote(
    worker: Any,
    tasks: dict[str, Any],
    calls: Calls,
    lock_redis: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A soft time limit read with the release's reply: the marker is written, sig is not sent,
    # and the task fails, its message acked. Left, the marker would skip every later copy.
    release = LockStore.release

    def interrupted(self: LockStore, lease: Lease, **options: Any) -> Any:
        owned = release(self, lease, **options)
        if lease.handed_on is not None and not calls.count("interrupted"):
            calls.seen.append({"task": "interrupted"})
            raise SoftTimeLimitExceeded
        return owned

    monkeypatch.setattr(LockStore, "release", interrupted)
    result = tasks["handoff"].delay(7)
    with pytest.raises(SoftTimeLimitExceeded):
        result.get(timeout=TIMEOUT)
    keys: RequestKeys = tasks["handoff"].request_keys((7,), {})
    assert not lock_redis.exists(keys.done)
    monkeypatch.undo()
    assert tasks["handoff"].delay(7).get(timeout=TIMEOUT) == "processed 7"
    assert (calls.count("t.handoff"), calls.count("t.process")) == (2, 1)


@replacements_keep_their_depth
def test_a_hand_on_released_late_by_the_heartbeat_writes_no_marker(
    worker: Any,
    tasks: dict[str, Any],
    calls: Calls,
    lock_redis: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The hand-on release found the store unavailable, and was left to the heartbeat; the
    # replacement's send then failed. A marker the heartbeat wrote later would announce that
    # replacement, and skip every copy of the request until it expired: it writes none.
    release, failed = LockStore.release, []

    def unavailable_once(self: LockStore, lease: Lease, **options: Any) -> Any:
        if lease.handed_on is not None and not failed:
            failed.append(lease)
            raise LockStoreUnavailableError("release failed: Connection refused", lock_name="x")
        return release(self, lease, **options)

    monkeypatch.setattr(LockStore, "release", unavailable_once)
    with pytest.raises(OperationalError, match="broker gone"):
        tasks["handoff"].delay(7, send=False).get(timeout=TIMEOUT)
    keys: RequestKeys = tasks["handoff"].request_keys((7,), {})
    wait_for("the heartbeat's release", lambda: not lock_redis.exists(keys.lock), TIMEOUT)
    assert failed
    assert not lock_redis.exists(keys.done)
    monkeypatch.undo()
    assert tasks["handoff"].delay(7).get(timeout=TIMEOUT) == "processed 7"
    assert calls.count("t.handoff") == 2


@replacements_keep_their_depth
def test_a_replacement_that_was_not_sent_leaves_the_request_to_run_again(
    worker: Any, tasks: dict[str, Any], calls: Calls, lock_redis: redis.Redis
) -> None:
    failed = tasks["handoff"].delay(7, send=False)
    with pytest.raises(OperationalError, match="broker gone"):
        failed.get(timeout=TIMEOUT)
    keys: RequestKeys = tasks["handoff"].request_keys((7,), {})
    assert not lock_redis.exists(keys.done)
    assert not lock_redis.exists(keys.lock)
    assert tasks["handoff"].delay(7).get(timeout=TIMEOUT) == "processed 7"
    assert calls.count("t.handoff") == 2


@pytest.mark.skipif(
    celery_lock.task._REPLACEMENTS_KEEP_THEIR_DEPTH,
    reason="this Celery sends a replacement with its depth (5.3.5 and later)",
)
def test_where_replacements_lose_their_depth_a_replaced_request_leaves_no_marker(
    worker: Any, tasks: dict[str, Any], calls: Calls, lock_redis: redis.Redis
) -> None:
    # Read as depth 0, a replacement of the same request would take its own marker for a
    # redelivery's: released as before, without one, and a later copy runs the body again.
    assert tasks["handoff"].delay(7).get(timeout=TIMEOUT) == "processed 7"
    assert not lock_redis.exists(tasks["handoff"].request_keys((7,), {}).done)
    tasks["handoff"].delay(7)  # its replacement finds t.process done, and is skipped
    wait_for("the copy to run", lambda: calls.count("t.handoff") == 2, TIMEOUT)


def test_each_step_of_a_chain_that_replaced_a_run_gets_through_its_hand_on_marker(
    worker: Any, tasks: dict[str, Any], calls: Calls, lock_redis: redis.Redis
) -> None:
    result = tasks["page"].delay(7, 2)
    assert result.get(timeout=TIMEOUT) is None  # t.nothing's, last of the chains
    pages = [(c["pages"], c["id"]) for c in calls.seen if c["task"] == "t.page"]
    assert [p for p, _ in pages] == [2, 1, 0]
    assert pages[0][1] == result.id
    assert len({i for _, i in pages}) == 3  # each later page a chain's first step
    assert consecutive([c["fence"] for c in calls.seen if c["task"] == "t.page"])
    # The last page completed the request: its done-marker, final for every copy.
    assert lock_redis.get(tasks["page"].request_keys((7, 0), {}).done) == pages[2][1].encode()


@replacements_keep_their_depth
def test_a_request_handed_on_to_a_group_of_its_own_task_runs_in_one_member(
    worker: Any, tasks: dict[str, Any], calls: Calls, lock_redis: redis.Redis
) -> None:
    # Celery sends a group replacement's members one replacement deeper in the same canvas,
    # as it does a chain's steps: one member gets through the hand-on marker, and the others,
    # copies of the same request, are skipped as they would be in any group. (Read as depth 0,
    # every member would take the marker for done, and no member would run the request.)
    ended: list[str] = []

    def on_postrun(task: Any, **_: Any) -> None:
        ended.append(task.name)

    task_postrun.connect(on_postrun, weak=False)
    try:
        tasks["fan"].delay(7, 2)
        # The replaced run and both members, the one that ran and the one skipped.
        wait_for("both members to end", lambda: ended.count("t.fan") == 3, TIMEOUT)
    finally:
        task_postrun.disconnect(on_postrun)
    assert [c["width"] for c in calls.seen] == [2, 0]
    member = calls.seen[1]["id"]
    assert member != calls.seen[0]["id"]
    assert lock_redis.get(tasks["fan"].request_keys((7, 0), {}).done) == member.encode()


def test_a_replacement_s_retry_keeps_its_depth_and_gets_through_the_hand_on_marker(
    worker: Any, tasks: dict[str, Any], calls: Calls, lock_redis: redis.Redis
) -> None:
    result = tasks["hop"].delay(7, 1, True)
    assert result.get(timeout=TIMEOUT) == "landed 7"
    assert [(c["hops"], c["retries"], c["id"]) for c in calls.seen] == [
        (1, 0, result.id), (0, 0, result.id), (0, 1, result.id)
    ]  # fmt: skip
    assert lock_redis.get(tasks["hop"].request_keys((7, 0), {}).done) == result.id.encode()


def test_after_an_eager_replace_the_body_knows_it_holds_no_lease(
    tasks: dict[str, Any], lock_redis: redis.Redis
) -> None:
    assert tasks["relay"].apply((7,)).get() == "processed 7; lease handed on"
    assert not lock_redis.exists("celery-lock:{t.relay:7}:lock")


def test_a_direct_call_that_replaces_itself_leaves_its_replacement_to_run(
    worker: Any, tasks: dict[str, Any], calls: Calls, lock_redis: redis.Redis
) -> None:
    # A direct call has no task id, and its replacement is sent with one of its own: a hand-on
    # marker naming no id would have the replacement skipped as done, and the request never run.
    with pytest.raises(Ignore):
        tasks["hop"](7, 1)
    keys: RequestKeys = tasks["hop"].request_keys((7, 0), {})
    wait_for("the replacement to run", lambda: lock_redis.exists(keys.done), TIMEOUT)
    assert [c["hops"] for c in calls.seen] == [1, 0]
    replacement = calls.seen[1]["id"]
    assert replacement
    assert lock_redis.get(keys.done) == replacement.encode()


def test_replace_hands_the_request_on_in_an_eager_call(
    tasks: dict[str, Any], calls: Calls, lock_redis: redis.Redis
) -> None:
    # Eager, the replacement runs inside the replaced body: a lease still held would refuse it.
    assert tasks["hop"].apply((7, 2)).get() == "landed 7"
    assert [c["hops"] for c in calls.seen] == [2, 1, 0]
    assert consecutive([c["fence"] for c in calls.seen])
    assert not lock_redis.exists("celery-lock:{t.hop:7}:lock")


def test_redelivery_of_succeeded_message_keeps_success(
    worker: Any, tasks: dict[str, Any], calls: Calls, finished: Callable[[str], threading.Event]
) -> None:
    first = tasks["process"].delay(7)
    first.get(timeout=TIMEOUT)
    done = finished(first.id)
    done.clear()
    tasks["process"].apply_async((7,), task_id=first.id)  # the broker delivers it again
    assert done.wait(TIMEOUT)
    assert first.state == "SUCCESS"
    assert first.result == "processed 7"
    assert calls.count("t.process") == 1


def test_a_task_id_holding_a_lone_surrogate_completes_its_request_once(
    worker: Any,
    tasks: dict[str, Any],
    calls: Calls,
    lock_redis: redis.Redis,
    finished: Callable[[str], threading.Event],
) -> None:
    """A producer may use a client's key, read from JSON, as the task id: a lone surrogate the
    release once refused after the body ran, leaving the request to run again. (Its result is
    ignored: Celery's key-value backends cannot make a result key of it.)"""
    task_id = json.loads('"req-7\\udcff"')
    quiet = tasks["quiet"]
    quiet.apply_async((7,), task_id=task_id)
    assert finished(task_id).wait(TIMEOUT)
    keys: RequestKeys = quiet.request_keys((7,), {})
    assert lock_redis.get(keys.done) == b"req-7\xed\xb3\xbf"  # surrogatepass
    assert not lock_redis.exists(keys.lock)
    with recording(signals.lock_skipped) as skipped:
        # Another copy of the request: skipped as done by that task id.
        assert finished(quiet.apply_async((7,)).id).wait(TIMEOUT)
        # The message itself, delivered again: its done-marker names it, so it is acked.
        finished(task_id).clear()
        quiet.apply_async((7,), task_id=task_id)
        assert finished(task_id).wait(TIMEOUT)
    assert [(s["reason"], s["holder"]) for s in skipped] == [("done", task_id)]
    assert calls.count("t.quiet") == 1


def test_redelivered_copy_of_running_message_is_deferred_until_holder_ends(
    worker: Any, tasks: dict[str, Any], store: LockStore, calls: Calls, lock_redis: redis.Redis
) -> None:
    with recording(signals.lock_deferred) as deferred:
        lease = hold(store, tasks["process"], 7, "same-id")
        lock_redis.pexpire(lease.keys.lock, 3000)  # its holder died: the lease lapses by TTL
        result = tasks["process"].apply_async((7,), task_id="same-id")
        assert result.get(timeout=TIMEOUT) == "processed 7"
    assert deferred
    assert {d["reason"] for d in deferred} == {"redelivered"}
    [call] = calls.seen
    assert call["retries"] == 0  # deferring does not use up max_retries
    assert call["fence"] == lease.fence + 1


def test_a_redelivered_copy_waiting_on_its_running_original_stores_no_state(
    celery_app: Celery, worker: Any, tasks: dict[str, Any], store: LockStore, calls: Calls
) -> None:
    # The original runs as this very task id: a RETRY stored for the waiting copy would
    # overwrite the state its run stored, and show the running task as retrying.
    lease = hold(store, tasks["process"], 7, "original-id")
    celery_app.backend.store_result("original-id", {"pid": 1, "hostname": "elsewhere"}, STARTED)
    with recording(signals.lock_deferred) as deferred:
        result = tasks["process"].apply_async((7,), task_id="original-id")
        # Deferred twice: the first deferral's outcome is stored before the second is sent.
        wait_for("the copy to be deferred twice", lambda: len(deferred) >= 2, TIMEOUT)
        assert result.state == STARTED
        store.release(lease, success=False, done_ttl_ms=60_000)
        assert result.get(timeout=TIMEOUT) == "processed 7"
    assert {d["reason"] for d in deferred} == {"redelivered"}
    assert len(calls.seen) == 1


def test_contention_with_another_stage_is_deferred_not_skipped(
    worker: Any, tasks: dict[str, Any], store: LockStore, calls: Calls
) -> None:
    lease = hold(store, tasks["stage"], 7, "pending-id", task_name="t.pending")
    result = tasks["stage"].delay(7)
    wait_for("the copy to be deferred", lambda: result.state == "RETRY", TIMEOUT)
    assert calls.seen == []
    store.release(lease, success=False, done_ttl_ms=60_000)
    assert result.get(timeout=TIMEOUT) == "stage"
    assert calls.seen[0]["retries"] == 0


def test_stage_done_marker_does_not_skip_next_stage(
    worker: Any, tasks: dict[str, Any], calls: Calls
) -> None:
    assert tasks["pending"].delay(7).get(timeout=TIMEOUT) == "pending"
    assert tasks["stage"].delay(7).get(timeout=TIMEOUT) == "stage"
    assert consecutive([call["fence"] for call in calls.seen])  # one fence counter per scope


@pytest.mark.parametrize("policy", ["retry", "raise"])
def test_duplicate_policy(
    policy: str,
    celery_app: Celery,
    worker: Any,
    tasks: dict[str, Any],
    store: LockStore,
    calls: Calls,
) -> None:
    celery_app.conf.celery_lock_on_duplicate = policy
    lease = hold(store, tasks["process"], 7, "holder-id")
    result = tasks["process"].delay(7)
    if policy == "raise":
        with pytest.raises(DuplicateTaskError, match="holder-id"):
            result.get(timeout=TIMEOUT)
        return
    wait_for("the copy to be deferred", lambda: result.state == "RETRY", TIMEOUT)
    store.release(lease, success=False, done_ttl_ms=60_000)
    assert result.get(timeout=TIMEOUT) == "processed 7"
    assert calls.count("t.process") == 1


def test_skip_as_success_returns_marker_for_canvas(
    celery_app: Celery, worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    celery_app.conf.celery_lock_skip_as_success = True
    hold(store, tasks["process"], 7, "holder-id")
    value = tasks["process"].delay(7).get(timeout=TIMEOUT)
    assert is_skipped(value)
    assert value["holder"] == "holder-id"


def test_a_copy_skipped_as_success_does_not_wait_on_the_broker_for_its_event(
    celery_app: Celery,
    worker: Any,
    tasks: dict[str, Any],
    store: LockStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The pool process sends its task-skipped itself: on the body's thread, a broker that
    # hangs held the pool's slot as long (a review's run: 17.6 s).
    celery_app.conf.celery_lock_skip_as_success = True
    celery_app.conf.worker_send_task_events = True
    on_its_way, give_up = threading.Event(), threading.Event()

    def stuck_publish(*args: Any) -> None:
        on_its_way.set()
        give_up.wait(TIMEOUT)

    monkeypatch.setattr(celery_lock.events, "_publish", stuck_publish)
    hold(store, tasks["process"], 7, "holder-id")
    try:
        assert is_skipped(tasks["process"].delay(7).get(timeout=TIMEOUT / 2))
        assert on_its_way.wait(TIMEOUT)
    finally:
        give_up.set()
        celery_lock.events.wait_for_events_apart(TIMEOUT)


def test_self_retry_releases_without_done_marker(
    worker: Any, tasks: dict[str, Any], calls: Calls, lock_redis: redis.Redis
) -> None:
    assert tasks["flaky"].delay(7).get(timeout=TIMEOUT) == "second time lucky"
    assert [call["retries"] for call in calls.seen] == [0, 1]
    assert consecutive([call["fence"] for call in calls.seen])


def test_a_retry_the_broker_cannot_take_for_now_gives_the_message_back(
    worker: Any, tasks: dict[str, Any], calls: Calls
) -> None:
    # Celery rejects the message without requeue when a retry's publish fails: the request,
    # never done, was dropped (FAILURE, nothing left to run it). Given back, it runs again,
    # once the lease the first run left to lapse has: not at once, on every delivery while
    # the broker refuses (a review's run: 24 runs in 15 s).
    with recording(signals.lock_deferred) as deferred:
        assert tasks["unsent"].delay(7, "for-now").get(timeout=TIMEOUT) == "run again"
    assert [call["retries"] for call in calls.seen] == [0, 0]  # no retry was sent
    assert consecutive([call["fence"] for call in calls.seen])
    assert deferred
    assert {d["reason"] for d in deferred} == {"redelivered"}


def test_a_retry_that_no_publish_can_send_is_not_given_back(
    worker: Any, tasks: dict[str, Any], calls: Calls
) -> None:
    # Every publish fails: given back, the body would run again and again, at once (a review's
    # run: 480 runs in 10 s). Left to Celery, which rejects the message.
    tasks["unsent"].delay(7, "for-good")
    wait_for("the run", lambda: calls.count("t.unsent"), TIMEOUT)
    time.sleep(3.0)  # given back, it would have run again once its lease (1 s) lapsed
    assert calls.count("t.unsent") == 1


@pytest.mark.parametrize("catch", [False, True], ids=["throw-false", "retry-caught"])
def test_a_body_that_returns_after_sending_its_retry_leaves_the_request_to_it(
    worker: Any, tasks: dict[str, Any], calls: Calls, lock_redis: redis.Redis, catch: bool
) -> None:
    # The retry carries the same task id: had the first run written its done-marker, the retry
    # would be acked unrun as a redelivery of a message that succeeded.
    task_id = tasks["resend"].delay(7, catch).id
    wait_for("the retry to run", lambda: calls.count("t.resend") == 2, TIMEOUT)
    assert [call["retries"] for call in calls.seen] == [0, 1]
    assert consecutive([call["fence"] for call in calls.seen])
    keys = tasks["resend"].request_keys((7, catch), {})
    wait_for("the done-marker", lambda: lock_redis.get(keys.done) == task_id.encode(), TIMEOUT)
    # (The result stays the first run's: Celery's backend keeps a SUCCESS it has stored.)


def test_an_eager_retry_that_returns_is_the_request_s_last_run(
    celery_app: Celery, tasks: dict[str, Any], calls: Calls, lock_redis: redis.Redis
) -> None:
    # Eager, Celery publishes no retry: the run that returned is the last, and marks it done.
    assert tasks["resend"].apply((8, False)).get() == "first, retry sent"
    assert lock_redis.get(tasks["resend"].request_keys((8, False), {}).done) is not None


def test_failure_releases_without_done_marker(
    worker: Any, tasks: dict[str, Any], lock_redis: redis.Redis
) -> None:
    with pytest.raises(RuntimeError):
        tasks["boom"].delay(7).get(timeout=TIMEOUT)
    keys = tasks["boom"].request_keys((7,), {})
    assert not lock_redis.exists(keys.lock)
    assert not lock_redis.exists(keys.done)


def test_heartbeat_keeps_lease_of_long_task(
    worker: Any, tasks: dict[str, Any], calls: Calls, lock_redis: redis.Redis
) -> None:
    result = tasks["slow"].delay(7)
    assert calls.started.wait(TIMEOUT)
    keys = tasks["slow"].request_keys((7,), {})
    deadline = time.monotonic() + 3 * 1.2  # three TTLs
    while time.monotonic() < deadline:
        assert lock_redis.pttl(keys.lock) > 0
        time.sleep(0.05)
    calls.proceed.set()
    assert result.get(timeout=TIMEOUT) is False


def test_lost_lease_is_reported_to_body_and_signal(
    worker: Any, tasks: dict[str, Any], calls: Calls, lock_redis: redis.Redis
) -> None:
    with recording(signals.lock_lost) as lost, recording(signals.lock_deferred) as deferred:
        try:
            result = tasks["slow"].delay(7)
            assert calls.started.wait(TIMEOUT)
            keys = tasks["slow"].request_keys((7,), {})
            lock_redis.set(keys.lock, "someone-else 99 {}", keepttl=True)  # taken over
            wait_for("lock_lost", lambda: lost, TIMEOUT)
            calls.proceed.set()
            assert result.get(timeout=TIMEOUT) is True
        finally:
            calls.proceed.set()  # never leave the body waiting on a failed test
    assert [sent["lock_key"] for sent in lost] == [keys.lock]
    assert not lock_redis.exists(keys.done)
    # Taken by another task id (not a copy of this message, which its ack could take off the
    # broker): no copy of the message is sent, and the request does not run again.
    assert deferred == []
    assert calls.count("t.slow") == 1


def test_a_lost_run_whose_taker_died_unfinished_sends_a_copy_that_runs_the_request(
    worker: Any, tasks: dict[str, Any], calls: Calls, lock_redis: redis.Redis
) -> None:
    # Granted since (the fence moved on), to a holder that died, its lease lapsed, no done-marker:
    # if that was a copy of this task id, this run's ack took its message (a Redis redelivery
    # keeps the delivery tag), and only a copy of this one brings the request back.
    with recording(signals.lock_deferred) as deferred:
        try:
            result = tasks["slow"].delay(7)
            assert calls.started.wait(TIMEOUT)
            keys = tasks["slow"].request_keys((7,), {})
            lock_redis.delete(keys.lock)
            lock_redis.incr(keys.fence)  # the taker's grant
        finally:
            calls.proceed.set()
        wait_for("the copy of the lost run", lambda: deferred, TIMEOUT)
        assert [(d["task_id"], d["reason"]) for d in deferred] == [(result.id, "lost")]
        wait_for("the rerun", lambda: calls.count("t.slow") == 2, TIMEOUT)
    assert calls.seen[1]["fence"] > calls.seen[0]["fence"] + 1
    wait_for("the rerun's done-marker", lambda: lock_redis.get(keys.done), TIMEOUT)


def test_signals_acquired_and_released(worker: Any, tasks: dict[str, Any]) -> None:
    sent: list[tuple[str, dict[str, Any]]] = []

    def on_acquired(sender: Any, **kwargs: Any) -> None:
        sent.append(("acquired", kwargs))

    def on_released(sender: Any, **kwargs: Any) -> None:
        sent.append(("released", kwargs))

    signals.lock_acquired.connect(on_acquired, weak=False)
    signals.lock_released.connect(on_released, weak=False)
    before_us = time.time_ns() // 1000
    try:
        tasks["process"].delay(7).get(timeout=TIMEOUT)
    finally:
        signals.lock_acquired.disconnect(on_acquired)
        signals.lock_released.disconnect(on_released)
    assert [name for name, _ in sent] == ["acquired", "released"]
    assert before_us <= sent[0][1]["fence"] <= time.time_ns() // 1000  # a new request: the clock
    assert sent[1][1]["success"] is True


def test_eager_call_is_locked(celery_app: Celery, tasks: dict[str, Any], store: LockStore) -> None:
    assert tasks["process"].apply((7,)).get() == "processed 7"
    assert tasks["process"].apply((7,)).state == "IGNORED"  # done


def test_requests_whose_key_parts_could_be_split_alike_both_run(
    celery_app: Celery, store: LockStore
) -> None:
    # ("acme:eu", 1) and ("acme", "eu:1") join into one text, as do scope "a:b" with key "c"
    # and scope "a" with key "b:c": each is a request of its own, never skipped as done.
    @celery_app.task(base=LockedTask, lock_key="{tenant}:{request_idx}", name="t.tenant_order")
    def tenant_order(tenant: str, request_idx: Any) -> str:
        return f"{tenant}/{request_idx}"

    @celery_app.task(base=LockedTask, lock_key="request_idx", lock_scope="a:b", name="t.ab")
    def scoped_ab(request_idx: str) -> str:
        return f"a:b/{request_idx}"

    @celery_app.task(base=LockedTask, lock_key="request_idx", lock_scope="a", name="t.a")
    def scoped_a(request_idx: str) -> str:
        return f"a/{request_idx}"

    assert tenant_order.apply(("acme:eu", 1)).get() == "acme:eu/1"
    assert tenant_order.apply(("acme", "eu:1")).get() == "acme/eu:1"
    assert tenant_order.apply(("acme", "eu:1")).state == "IGNORED"  # that one is done
    assert scoped_ab.apply(("c",)).get() == "a:b/c"
    assert scoped_a.apply(("b:c",)).get() == "a/b:c"


def test_direct_call_runs_locked_as_the_current_task(tasks: dict[str, Any], calls: Calls) -> None:
    assert tasks["process"](7) == "processed 7"
    [call] = calls.seen
    assert call["current_task"] == "t.process"
    assert call["fence"] is not None  # locked
    assert not current_task  # popped again


def test_a_heartbeat_that_cannot_start_leaves_no_lease_held(
    celery_app: Celery,
    tasks: dict[str, Any],
    calls: Calls,
    lock_redis: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    heartbeat = get_runtime(celery_app).heartbeat
    add = heartbeat.add

    def add_then_fail(*args: Any, **kwargs: Any) -> None:
        add(*args, **kwargs)  # the lease is in, then its thread cannot start
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(heartbeat, "add", add_then_fail)
    with pytest.raises(RuntimeError, match="start new thread"):
        tasks["process"](7)
    assert calls.seen == []
    assert heartbeat.leases() == []
    assert not lock_redis.exists("celery-lock:{t.process:7}:lock")


class _GreenletKilled(BaseException):
    """What gevent's kill (GreenletExit) and hard time limit (Timeout) are: BaseExceptions."""


@pytest.mark.parametrize("interruption", [SystemExit, _GreenletKilled])
@pytest.mark.parametrize(
    ("script", "script_ran"),
    [("acquire", True), ("release", False), ("release", True)],
    ids=["acquire-reply-lost", "release-before-the-send", "release-reply-lost"],
)
def test_a_round_trip_a_signal_interrupts_leaves_the_request_unlocked(
    celery_app: Celery,
    tasks: dict[str, Any],
    calls: Calls,
    lock_redis: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    script: str,
    script_ran: bool,
    interruption: type[BaseException],
) -> None:
    # SIGTERM in a pool process raises SystemExit wherever the process is; gevent delivers a
    # kill at the next I/O. Inside the acquire, after its script ran, or inside the release,
    # before its script left, the lock would stay held a whole TTL: no heartbeat knows it, so
    # the shutdown's hand-back would miss it.
    store = get_runtime(celery_app).store_for(tasks["process"].lock_settings())
    tasks["process"](6)  # the scripts are loaded: the interrupted send is the script itself
    sha = getattr(store.scripts, script).sha
    send = store._send
    interrupted: list[tuple[Any, ...]] = []

    def send_interrupted(command: tuple[Any, ...]) -> Any:
        if command[:2] == ("EVALSHA", sha) and not interrupted:
            interrupted.append(command)
            if script_ran:
                send(command)
            raise interruption()
        return send(command)

    monkeypatch.setattr(store, "_send", send_interrupted)
    with pytest.raises(interruption):
        tasks["process"](7)
    assert interrupted
    keys = tasks["process"].request_keys((7,), {})
    assert not lock_redis.exists(keys.lock)
    # Done only where the body had finished.
    assert lock_redis.exists(keys.done) == (script == "release")
    assert calls.count("t.process") == (2 if script == "release" else 1)


def test_a_soft_time_limit_inside_the_heartbeat_s_discard_still_releases(
    celery_app: Celery,
    tasks: dict[str, Any],
    lock_redis: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Raised before the lease left the heartbeat, the release was skipped: the heartbeat kept
    # extending the lease for as long as the process lived, and every copy was skipped.
    heartbeat = get_runtime(celery_app).heartbeat
    discard = heartbeat.discard
    interrupted: list[Lease] = []

    def discard_interrupted(lease: Lease) -> None:
        if not interrupted:
            interrupted.append(lease)
            raise SoftTimeLimitExceeded()
        discard(lease)

    monkeypatch.setattr(heartbeat, "discard", discard_interrupted)
    with pytest.raises(SoftTimeLimitExceeded):
        tasks["process"](7)
    assert interrupted
    assert heartbeat.leases() == []
    assert not lock_redis.exists(tasks["process"].request_keys((7,), {}).lock)


def test_a_direct_call_failing_closed_is_logged_as_failing_not_as_deferred(
    celery_app: Celery,
    tasks: dict[str, Any],
    calls: Calls,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = get_runtime(celery_app).store_for(tasks["process"].lock_settings())

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise LockStoreUnavailableError("acquire failed: Connection refused", lock_name="x")

    monkeypatch.setattr(store, "acquire", unreachable)
    with (
        caplog.at_level(logging.WARNING, logger="celery_lock"),
        pytest.raises(LockStoreUnavailableError),
    ):
        tasks["process"](7)
    assert calls.seen == []
    assert "task (a direct call) fails unrun (fail closed)" in caplog.text
    assert "deferring" not in caplog.text  # nothing is handed back to a broker


def test_a_lost_lease_s_event_does_not_hold_up_the_heartbeat(
    celery_app: Celery, tasks: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The callback runs on the heartbeat's thread; a publish to a broker that is down takes
    # seconds to give up, and the next extends of every lease in the process would wait.
    celery_app.conf.worker_send_task_events = True
    on_its_way, give_up = threading.Event(), threading.Event()

    def stuck_publish(*args: Any, **kwargs: Any) -> None:
        on_its_way.set()
        give_up.wait(10)

    monkeypatch.setattr(celery_lock.events, "_publish", stuck_publish)
    task = tasks["process"]
    keys = task.request_keys((7,), {})
    holder = Holder("task-1", task.name, "w@h", 1)
    lease = Lease(get_runtime(celery_app).store_for(task.lock_settings()), keys, "t", 1, 1, holder)
    request = Context(id="task-1", hostname="w@h", is_eager=False)
    heartbeat = threading.Thread(target=task._lease_lost_callback(request), args=(lease,))
    heartbeat.start()
    try:
        heartbeat.join(5)
        assert on_its_way.wait(5)  # the event is sent...
        assert not heartbeat.is_alive()  # ...and the heartbeat went on without waiting
        # A pool process shutting down waits for it (bounded), before billiard ends it.
        [sender] = celery_lock.events._senders
        celery_lock.events.wait_for_events_apart(0.1)
        assert sender.is_alive()  # still stuck: the wait was bounded
        give_up.set()
        celery_lock.events.wait_for_events_apart(5)
        assert not sender.is_alive()
        assert not celery_lock.events._senders
    finally:
        give_up.set()
        heartbeat.join(5)


def test_an_event_sent_apart_is_tried_again_until_the_broker_takes_it(
    celery_app: Celery, tasks: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A lost lease most often comes with a network that cut the broker too: one try, and the
    # task-lock-lost of every lease lost in the outage was dropped.
    celery_app.conf.worker_send_task_events = True
    tries: list[dict[str, Any]] = []

    def publish_after_two_failures(*args: Any) -> None:
        tries.append(args[-1])
        if len(tries) < 3:
            raise OperationalError("the broker is down")

    monkeypatch.setattr(celery_lock.events, "_publish", publish_after_two_failures)
    task = tasks["process"]
    celery_lock.events.send_task_event_apart(task, "task-lock-lost", "task-1", "w@h", result="r")
    celery_lock.events.wait_for_events_apart(TIMEOUT)
    assert not celery_lock.events._senders
    assert tries == [{"result": "r"}] * 3


@pytest.fixture
def event_warnings(
    celery_app: Celery, caplog: pytest.LogCaptureFixture
) -> pytest.LogCaptureFixture:
    """Task events turned on, and the warnings of celery_lock.events captured."""
    celery_app.conf.worker_send_task_events = True
    caplog.set_level(logging.WARNING, logger="celery_lock.events")
    return caplog


def test_an_event_the_broker_never_takes_is_given_up_with_a_warning(
    tasks: dict[str, Any], monkeypatch: pytest.MonkeyPatch, event_warnings: pytest.LogCaptureFixture
) -> None:
    tries: list[float] = []

    def broker_down(*args: Any) -> None:
        tries.append(time.monotonic())
        raise OperationalError("the broker is down")

    monkeypatch.setattr(celery_lock.events, "_publish", broker_down)
    monkeypatch.setattr(celery_lock.events, "RETRY_SECONDS", 1)
    celery_lock.events.send_task_event_apart(tasks["process"], "task-lock-lost", "task-1", "w@h")
    celery_lock.events.wait_for_events_apart(TIMEOUT)
    assert not celery_lock.events._senders
    assert len(tries) >= 2
    assert "could not send task-lock-lost for task task-1 in 1 s of tries" in event_warnings.text


def test_events_beyond_the_senders_a_process_keeps_are_dropped_with_a_warning(
    tasks: dict[str, Any], monkeypatch: pytest.MonkeyPatch, event_warnings: pytest.LogCaptureFixture
) -> None:
    # A broker that hangs holds each sender for ever: with a skipped copy's event sent apart,
    # a storm of them piled up threads without end (a review: 2,000 in 10 s).
    give_up = threading.Event()
    monkeypatch.setattr(celery_lock.events, "_publish", lambda *args: give_up.wait(TIMEOUT))
    monkeypatch.setattr(celery_lock.events, "MAX_SENDERS", 2)
    try:
        for task_id in ("task-1", "task-2", "task-3"):
            celery_lock.events.send_task_event_apart(
                tasks["process"], "task-skipped", task_id, "w@h"
            )
        assert len(celery_lock.events._senders) == 2
        assert "dropped task-skipped for task task-3: 2 events are still on their way" in (
            event_warnings.text
        )
    finally:
        give_up.set()
        celery_lock.events.wait_for_events_apart(TIMEOUT)


def test_a_lease_counts_its_ttl_from_before_the_acquire(
    celery_app: Celery, tasks: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The script may run at any point of a slow acquire (retries after a timeout): the lease's
    # own clock must not start later than the server's, or it would look alive when it is not.
    store = get_runtime(celery_app).store_for(tasks["process"].lock_settings())
    acquire = store.acquire

    def slow_acquire(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.5)
        return acquire(*args, **kwargs)

    monkeypatch.setattr(store, "acquire", slow_acquire)
    seen: list[float] = []

    def on_acquired(sender: Any, **_: Any) -> None:
        seen.append(sender.request.lock_lease.confirmed_at)

    signals.lock_acquired.connect(on_acquired, weak=False)
    try:
        called_at = time.monotonic()
        tasks["process"](7)
    finally:
        signals.lock_acquired.disconnect(on_acquired)
    [confirmed_at] = seen
    assert confirmed_at < called_at + 0.4  # before the slow acquire, not after it


@pytest.fixture
def late_grant(celery_app: Celery, calls: Calls) -> Any:
    """A task of a short lease, whose body outlasts it: only the heartbeat keeps it held."""

    @celery_app.task(
        base=LockedTask, bind=True, lock_key="request_idx", name="t.late_grant", lock_ttl=0.3
    )
    def late_grant(self: Any, request_idx: int) -> tuple[bool, int]:
        calls.seen.append({"task": self.name})
        time.sleep(0.6)
        store = get_runtime(celery_app).store_for(self.lock_settings())
        return self.request.lock_lost, store.client.pttl(self.request.lock_key)

    return late_grant


def _slow_acquire(
    monkeypatch: pytest.MonkeyPatch, task: Any, before: float = 0.0, after: float = 0.0
) -> None:
    """The task's acquire takes ``before`` seconds to reach the script and ``after`` to
    bring its reply back (a store that stalled, a reply lost and the try made again)."""
    store = get_runtime(task.app).store_for(task.lock_settings())
    acquire = store.acquire

    def slow_acquire(*args: Any, **kwargs: Any) -> Any:
        time.sleep(before)
        outcome = acquire(*args, **kwargs)
        time.sleep(after)
        return outcome

    monkeypatch.setattr(store, "acquire", slow_acquire)


@pytest.mark.parametrize("late", [0.25, 0.4], ids=["within-its-ttl", "after-its-ttl"])
def test_a_grant_that_came_back_late_is_confirmed_and_kept(
    late_grant: Any, monkeypatch: pytest.MonkeyPatch, late: float
) -> None:
    # The script ran late, the lease counted from the ask: it looked lapsed, or lapsed before
    # the heartbeat's first beat (an interval, 0.1 s, after the body began), which gave it up
    # unextended while Redis held it for this run, for a TTL.
    _slow_acquire(monkeypatch, late_grant, before=late)
    lost, pttl = late_grant(7)
    assert not lost
    assert pttl > 0  # still held, 0.6 s into a body under a 0.3 s lease


def test_a_grant_whose_reply_came_after_its_ttl_is_not_run_under(
    late_grant: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The script ran at once, its reply a whole TTL later: the lease had lapsed, and another
    # copy could hold the request by now.
    _slow_acquire(monkeypatch, late_grant, after=0.4)
    with pytest.raises(LockStoreUnavailableError, match="so late that it had lapsed"):
        late_grant(7)


@pytest.mark.parametrize("late", [0.15, 0.4], ids=["within-its-ttl", "after-its-ttl"])
def test_a_late_grant_whose_confirm_came_back_late_too_is_given_back_unrun(
    late_grant: Any, calls: Calls, lock_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    late: float,
) -> None:  # fmt: skip
    # Confirmed as late as the grant was, the lease would lapse before the heartbeat's first
    # beat: it is given back (within its TTL, still held: released), and the copy deferred.
    _slow_acquire(monkeypatch, late_grant, before=0.15)
    store = get_runtime(late_grant.app).store_for(late_grant.lock_settings())
    extend_all = store.extend_all

    def slow_extend_all(leases: Any) -> list[bool]:
        owned = extend_all(leases)
        time.sleep(late)
        return owned

    monkeypatch.setattr(store, "extend_all", slow_extend_all)
    with pytest.raises(LockStoreUnavailableError, match="confirmed a late grant too late"):
        late_grant(7)
    assert not lock_redis.exists(late_grant.request_keys((7,), {}).lock)
    assert calls.seen == []


def test_a_grant_under_a_heartbeat_interval_near_its_ttl_is_confirmed_with_room_to_spare(
    celery_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # TTL 1 s, interval 0.9 s: a grant 0.06 s late leaves 0.94 s, and the first beat, 0.9 s
    # after the body began (plus the thread's own delay), could find it expired.
    @celery_app.task(
        base=LockedTask, bind=True, lock_key="request_idx", name="t.near_ttl",
        lock_ttl=1.0, lock_heartbeat_interval=0.9,
    )  # fmt: skip
    def near_ttl(self: Any, request_idx: int) -> None:
        pass

    assert near_ttl.lock_settings().late_after == pytest.approx(0.05)
    _slow_acquire(monkeypatch, near_ttl, before=0.06)
    store = get_runtime(celery_app).store_for(near_ttl.lock_settings())
    extend_all = store.extend_all
    extended_by: list[threading.Thread] = []

    def recording(leases: Any) -> list[bool]:
        extended_by.append(threading.current_thread())
        return extend_all(leases)

    monkeypatch.setattr(store, "extend_all", recording)
    near_ttl(7)
    assert threading.current_thread() in extended_by  # confirmed by the call, not a beat


def test_a_late_grant_the_store_does_not_confirm_counts_as_the_store_unavailable(
    late_grant: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slow_acquire(monkeypatch, late_grant, before=0.4)

    def unreachable(leases: Any) -> list[bool]:
        raise redis.ConnectionError("Connection refused")

    store = get_runtime(late_grant.app).store_for(late_grant.lock_settings())
    monkeypatch.setattr(store, "extend_all", unreachable)
    with pytest.raises(LockStoreUnavailableError, match="did not confirm it: Connection refused"):
        late_grant(7)


def test_a_soft_time_limit_in_a_late_confirm_s_release_gives_the_message_back(
    late_grant: Any, worker: Any, calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store is slow, so a soft limit is likely to land in this third round trip too.
    _slow_acquire(monkeypatch, late_grant, before=0.4)
    store = get_runtime(late_grant.app).store_for(late_grant.lock_settings())
    extend_all, release = store.extend_all, store.release
    slowed: list[Any] = []
    cut: list[Any] = []

    def slow_once(leases: Any) -> list[bool]:
        owned = extend_all(leases)
        if leases and not slowed:
            slowed.append(leases)
            time.sleep(0.4)  # the confirm's reply comes a TTL late
        return owned

    def cut_once(lease: Any, **kwargs: Any) -> Any:
        if not cut:
            cut.append(lease)
            raise SoftTimeLimitExceeded()
        return release(lease, **kwargs)

    monkeypatch.setattr(store, "extend_all", slow_once)
    monkeypatch.setattr(store, "release", cut_once)
    lost, _ = late_grant.apply_async((7,)).get(timeout=TIMEOUT)
    assert cut
    assert not lost
    assert calls.count("t.late_grant") == 1


@pytest.mark.parametrize("interruption", [SystemExit, SoftTimeLimitExceeded])
def test_a_late_grant_s_confirm_cut_short_leaves_the_request_unlocked(
    late_grant: Any,
    calls: Calls,
    lock_redis: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    interruption: type[BaseException],
) -> None:
    # A direct call: the exception goes on, and the grant, known to no heartbeat, is given back.
    _slow_acquire(monkeypatch, late_grant, before=0.4)
    store = get_runtime(late_grant.app).store_for(late_grant.lock_settings())
    monkeypatch.setattr(store, "extend_all", mock.Mock(side_effect=interruption))
    with pytest.raises(interruption):
        late_grant(7)
    assert calls.seen == []
    assert not lock_redis.exists(late_grant.request_keys((7,), {}).lock)


def test_a_soft_time_limit_in_a_late_grant_s_confirm_gives_the_message_back(
    late_grant: Any, worker: Any, calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As in the acquire: failed before the body began, the message would be acked unrun.
    _slow_acquire(monkeypatch, late_grant, before=0.4)
    store = get_runtime(late_grant.app).store_for(late_grant.lock_settings())
    extend_all = store.extend_all
    interrupted: list[Any] = []

    def interrupted_once(leases: Any) -> list[bool]:
        if leases and not interrupted:
            interrupted.append(leases)
            raise SoftTimeLimitExceeded()
        return extend_all(leases)

    monkeypatch.setattr(store, "extend_all", interrupted_once)
    result = late_grant.apply_async((7,))
    lost, _ = result.get(timeout=TIMEOUT)
    assert interrupted
    assert not lost
    assert calls.count("t.late_grant") == 1


def test_direct_call_of_held_request_raises(tasks: dict[str, Any], store: LockStore) -> None:
    hold(store, tasks["stage"], 7, "pending-id", task_name="t.pending")
    with pytest.raises(LockContendedError, match="pending-id"):
        tasks["stage"](7)


def test_a_chain_step_without_a_key_fails_alone_not_its_parent(
    worker: Any, tasks: dict[str, Any], calls: Calls
) -> None:
    # The worker sends the step after its parent succeeded: the publish-time check, raising
    # there, failed the parent (and its errbacks ran). The step fails on the worker, unrun.
    result = chain(tasks["nothing"].si(), tasks["process"].s()).apply_async()
    with pytest.raises(LockKeyError, match="None alone"):
        result.get(timeout=TIMEOUT)
    assert result.parent.get(timeout=TIMEOUT) is None
    assert result.parent.state == "SUCCESS"
    assert calls.seen == []


@pytest.fixture
def published() -> Iterator[list[str]]:
    """The names of the tasks sent while the test runs, as Celery is about to publish them."""
    names: list[str] = []

    def on_publish(headers: dict[str, Any], **_: Any) -> None:
        names.append(headers["task"])

    before_task_publish.connect(on_publish, weak=False)
    yield names
    before_task_publish.disconnect(on_publish)


LATER_STEPS_WITHOUT_A_KEY: dict[str, Callable[[dict[str, Any]], Any]] = {
    "chain-after-a-plain-task": lambda t: chain(t["nothing"].si(), t["process"].si()).apply_async(),
    "chain-after-a-locked-task": lambda t: chain(t["stage"].si(7), t["process"].si()).delay(),
    "third-step": lambda t: (t["nothing"].si() | t["stage"].si(7) | t["process"].si(other=2))(),
    "link": lambda t: t["nothing"].apply_async(link=t["process"].si()),
    "link-error": lambda t: t["nothing"].apply_async(link_error=t["process"].si()),
    "immutable-signature": lambda t: t["nothing"].apply_async(
        link=t["process"].signature((), {"other": 2}, immutable=True)
    ),
    "link-of-a-chain-step": lambda t: chain(
        t["nothing"].si(), t["stage"].si(7).set(link=t["process"].si())
    )(),
    "group-in-a-chain": lambda t: chain(
        t["nothing"].si(), group(t["process"].si(7), t["process"].si())
    )(),
    "chord-body": lambda t: chord([t["nothing"].si()], t["process"].si())(),
}


@pytest.mark.parametrize(
    "publish", LATER_STEPS_WITHOUT_A_KEY.values(), ids=list(LATER_STEPS_WITHOUT_A_KEY)
)
def test_a_later_step_with_fixed_arguments_but_no_key_is_refused_at_publish(
    tasks: dict[str, Any], published: list[str], publish: Callable[[dict[str, Any]], Any]
) -> None:
    # Its arguments are known at publish: refused there, not after the first step's work is done.
    with pytest.raises(LockKeyError, match=r"^t\.process: .*request_idx"):
        publish(tasks)
    assert published == []


#: Task ids a caller may pass that are not text.
NOT_TEXT_IDS = {
    "int": 12345,
    "uuid": uuid.UUID("6e4a2b6c-54c4-4c6e-9d0e-7a0f0f5f3b21"),
    "float": 1.5,
    "bytes": b"req-7",
    "list": ["req-7"],
}


@pytest.mark.parametrize("task_id", NOT_TEXT_IDS.values(), ids=list(NOT_TEXT_IDS))
def test_a_task_id_that_is_not_text_is_refused_at_publish(
    tasks: dict[str, Any], published: list[str], task_id: object
) -> None:
    # The lock and the done-marker name their holder by it as text: refused where the caller
    # passes it, not on the worker, which could only fail the request unrun. A UUID too: sent
    # as its text, the results frozen under the UUID itself (a canvas's) would never be found.
    with pytest.raises(TypeError, match=r"^celery-lock: task id .* is a \w+, not a str"):
        tasks["process"].apply_async((7,), task_id=task_id)
    assert published == []


def test_a_canvas_step_with_a_task_id_that_is_not_text_is_published_with_a_warning(
    tasks: dict[str, Any], published: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    # A worker publishes the next step once its parent has run: raised there, the error would
    # fail the parent. The step fails on the worker instead (the next test).
    caplog.set_level(logging.WARNING, logger="celery_lock.task")
    with mock.patch.object(Celery, "send_task") as send_task:
        tasks["process"].apply_async((7,), task_id=12345, parent_id="parent-1")
    assert send_task.call_count == 1
    assert "task id 12345 is a int, not a str" in caplog.text
    assert "(pass str(task_id)); the worker will fail this step unrun" in caplog.text


@pytest.mark.parametrize("task_id", [12345, NOT_TEXT_IDS["uuid"]], ids=["int", "uuid"])
def test_a_task_id_that_is_not_text_fails_unrun_with_a_clear_error(
    tasks: dict[str, Any], calls: Calls, lock_redis: redis.Redis, task_id: object
) -> None:
    # Sent by name (or through apply, here), the id reaches the worker unchecked: the request
    # fails before its acquire is sent, with an error that names the id, not a cleanup's
    # AttributeError.
    result = tasks["process"].apply((7,), task_id=task_id)
    with pytest.raises(TypeError, match=r"^celery-lock: task id .* is a \w+, not a str"):
        result.get()
    assert calls.seen == []
    assert lock_redis.keys("*") == []


#: A group member refused at publish, as the third member: the call's own key (a LockedTask's
#: apply_async) and a later step the member carries (the check in app.send_task).
REFUSED_GROUP_MEMBERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "member-without-its-key": lambda t: t["process"].si(),
    "member-with-a-link-without-its-key": lambda t: t["nothing"].si().set(link=t["process"].si()),
}


@pytest.mark.parametrize("refused", REFUSED_GROUP_MEMBERS.values(), ids=list(REFUSED_GROUP_MEMBERS))
def test_a_group_member_refused_at_publish_leaves_the_members_before_it_published(
    worker: Any,
    tasks: dict[str, Any],
    published: list[str],
    refused: Callable[[dict[str, Any]], Any],
) -> None:
    # Celery publishes a group's members one by one, each through its own apply_async, and
    # offers no hook that sees the group before its first member is sent: the refusal of the
    # third comes after the first two are on the broker. The caller gets the error, and no
    # GroupResult, while those two run; a group frozen first still names them.
    members = group(tasks["process"].si(1), tasks["process"].si(2), refused(tasks))
    result = members.freeze()
    with pytest.raises(LockKeyError, match=r"^t\.process: .*request_idx"):
        members.apply_async()
    assert published == ["t.process", "t.process"]
    sent = result.results[:2]
    assert [member.get(timeout=TIMEOUT) for member in sent] == ["processed 1", "processed 2"]


def test_a_chord_header_member_refused_at_publish_leaves_a_chord_that_never_ends(
    worker: Any,
    tasks: dict[str, Any],
    published: list[str],
    finished: Callable[[str], threading.Event],
) -> None:
    # A chord's header is a group, published the same way: the first two members run, but the
    # chord counts the three members of its header, so the body, which the last of them to
    # finish sends, never is.
    first = tasks["process"].si(1).set(task_id="first-member")
    second = tasks["process"].si(2).set(task_id="second-member")
    with pytest.raises(LockKeyError, match=r"^t\.process: .*request_idx"):
        chord([first, second, tasks["process"].si()], tasks["nothing"].si())()
    assert finished("first-member").wait(TIMEOUT)
    assert finished("second-member").wait(TIMEOUT)
    # A member's chord-part return, which would send the body, comes before its postrun.
    assert published == ["t.process", "t.process"]


@pytest.mark.parametrize("refused", REFUSED_GROUP_MEMBERS.values(), ids=list(REFUSED_GROUP_MEMBERS))
def test_check_canvas_refuses_a_group_whole_before_any_member_is_sent(
    tasks: dict[str, Any], published: list[str], refused: Callable[[dict[str, Any]], Any]
) -> None:
    members = group(tasks["process"].si(1), tasks["process"].si(2), refused(tasks))
    with pytest.raises(LockKeyError, match=r"^t\.process: .*request_idx.*nothing is sent"):
        check_canvas(members)
    assert published == []


#: Canvases check_canvas refuses: each has one LockedTask step whose fixed arguments give no key.
REFUSED_CANVASES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "group-of-mutable-members": lambda t: group(t["process"].s(1), t["process"].s()),
    "group-from-a-generator": lambda t: group(t["process"].s() for _ in range(2)),
    "chain-s-first-step": lambda t: chain(t["process"].s(), t["nothing"].si()),
    "chord-header": lambda t: chord([t["process"].s(1), t["process"].s()], t["nothing"].si()),
    "chord-s-immutable-body": lambda t: chord([t["process"].s(1)], t["process"].si()),
    "group-in-a-chain-s-first-step": lambda t: chain(
        group(t["process"].s(1), t["process"].s(other=1)), t["nothing"].si()
    ),
    "a-single-signature": lambda t: t["process"].s(),
    "the-signature-as-a-dict": lambda t: dict(t["process"].s()),
}

#: Canvases it lets through: every step's key derives, or a step gets its parent's result first.
ACCEPTED_CANVASES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "group": lambda t: group(t["process"].s(1), t["process"].si(2)),
    "chain-s-later-mutable-step": lambda t: chain(t["process"].s(1), t["process"].s()),
    "chord-s-mutable-body": lambda t: chord([t["process"].s(1)], t["process"].s()),
    "a-plain-task": lambda t: t["nothing"].s(),
}


@pytest.mark.parametrize("canvas", REFUSED_CANVASES.values(), ids=list(REFUSED_CANVASES))
def test_check_canvas_refuses_a_fixed_step_without_its_key(
    tasks: dict[str, Any], published: list[str], canvas: Callable[[dict[str, Any]], Any]
) -> None:
    with pytest.raises(LockKeyError, match=r"^t\.process: .*request_idx"):
        check_canvas(canvas(tasks), app=tasks["process"].app)
    assert published == []


@pytest.mark.parametrize("canvas", ACCEPTED_CANVASES.values(), ids=list(ACCEPTED_CANVASES))
def test_check_canvas_lets_a_canvas_whose_fixed_steps_have_keys_through(
    tasks: dict[str, Any], published: list[str], canvas: Callable[[dict[str, Any]], Any]
) -> None:
    check_canvas(canvas(tasks))
    assert published == []


@pytest.mark.parametrize(
    "not_a_canvas",
    [lambda t: t["process"], lambda t: "t.process", lambda t: 7, lambda t: None],
    ids=["the-task-itself", "its-name", "an-int", "none"],
)
def test_check_canvas_refuses_what_is_not_a_canvas(
    tasks: dict[str, Any], not_a_canvas: Callable[[dict[str, Any]], Any]
) -> None:
    # process for process.s(7): nothing was checked, and nothing said so.
    with pytest.raises(TypeError, match=r"^check_canvas\(\) takes a signature .*, not "):
        check_canvas(not_a_canvas(tasks), app=tasks["process"].app)


def test_a_group_check_canvas_let_through_runs(
    worker: Any, tasks: dict[str, Any], calls: Calls
) -> None:
    job = group(tasks["process"].s(idx) for idx in (1, 2))
    check_canvas(job)
    assert job.apply_async().get(timeout=TIMEOUT) == ["processed 1", "processed 2"]
    assert calls.count("t.process") == 2


def test_a_later_step_given_its_key_is_published_and_runs(
    worker: Any, tasks: dict[str, Any], calls: Calls
) -> None:
    result = chain(tasks["nothing"].si(), tasks["process"].si(request_idx=7)).apply_async()
    assert result.get(timeout=TIMEOUT) == "processed 7"
    assert calls.count("t.process") == 1


def test_a_later_step_of_a_call_with_a_parent_is_left_to_the_worker(
    worker: Any, tasks: dict[str, Any], calls: Calls
) -> None:
    # A parent_id marks a call a worker sends after its parent succeeded (here passed by the
    # caller), whose later steps its first publisher checked: refused there, the error would
    # fail the step that has run. The later step fails alone, unrun.
    step = tasks["process"].si(None)
    step_result = step.freeze()
    result = tasks["nothing"].apply_async(link=step, parent_id="parent")
    with pytest.raises(LockKeyError, match="None alone"):
        step_result.get(timeout=TIMEOUT)
    assert result.get(timeout=TIMEOUT) is None
    assert result.state == "SUCCESS"
    assert calls.seen == []


def test_a_later_step_of_a_call_from_a_running_task_is_left_to_the_worker(
    celery_app: Celery, worker: Any, tasks: dict[str, Any], calls: Calls
) -> None:
    # Celery gives a call published from a running task that task for its parent: that is how
    # a worker passes the rest of a canvas on (a chord's body, a replacement), whose steps the
    # canvas's publisher checked. The sender is not failed; the step fails alone, unrun.
    step_id = tasks["sender"].delay().get(timeout=TIMEOUT)
    with pytest.raises(LockKeyError, match="None alone"):
        celery_app.AsyncResult(step_id).get(timeout=TIMEOUT)
    assert calls.seen == []


def test_a_send_task_the_app_class_gets_after_install_sees_every_publish(
    celery_app: Celery,
    tasks: dict[str, Any],
    published: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # sentry-sdk wraps Celery.send_task at sentry_sdk.init(), often after the app's module has
    # installed celery-lock: the check on the app must publish through it, not through the
    # send_task the class had at install.
    sent: list[str] = []
    send_task = type(celery_app).send_task

    def traced_send_task(app: Celery, name: str, *args: Any, **options: Any) -> Any:
        sent.append(name)
        return send_task(app, name, *args, **options)

    monkeypatch.setattr(type(celery_app), "send_task", traced_send_task)
    tasks["nothing"].delay()
    assert (sent, published) == (["t.nothing"], ["t.nothing"])
    with pytest.raises(LockKeyError, match=r"^t\.process: "):  # and the check still runs first
        tasks["nothing"].apply_async(link=tasks["process"].si())
    assert (sent, published) == (["t.nothing"], ["t.nothing"])


def test_a_mock_of_the_app_class_send_task_still_takes_the_call(
    celery_app: Celery, tasks: dict[str, Any], published: list[str]
) -> None:
    # A user's test stubs the broker out with mock.patch.object(Celery, "send_task").
    with mock.patch.object(type(celery_app), "send_task") as send_task:
        tasks["process"].delay(7)
    send_task.assert_called_once()
    assert send_task.call_args.args[0] == "t.process"
    assert published == []


def test_a_client_app_not_finalized_sends_by_name_with_a_step_it_has_not_registered(
    published: list[str],
) -> None:
    # Sent by name before the app is finalized (autofinalize=False): app.tasks would raise
    # "Contract breach: app not finalized", refusing a call Celery sends. No task of this app
    # is bound yet, so no step is a LockedTask of its.
    client = Celery("client", broker="memory://", autofinalize=False, set_as_current=False)
    install(client)
    try:
        client.send_task("t.remote", link=client.signature("t.notify", (1,), immutable=True))
    finally:
        client.close()
    assert published == ["t.remote"]


def test_message_without_key_argument_fails_and_never_runs_unlocked(
    celery_app: Celery, worker: Any, calls: Calls
) -> None:
    # send_task skips the publish-time check: the worker refuses to run the body.
    result = celery_app.send_task("t.process", kwargs={"other": 1})
    with pytest.raises(LockKeyError, match="request_idx"):
        result.get(timeout=TIMEOUT)
    assert calls.seen == []


@pytest.mark.parametrize("inner_held", [False, True], ids=["inner-free", "inner-held"])
def test_a_task_calling_itself_from_its_body_keeps_its_own_lease(
    worker: Any,
    tasks: dict[str, Any],
    store: LockStore,
    calls: Calls,
    lock_redis: redis.Redis,
    inner_held: bool,
) -> None:
    # The inner call finds the outer call's request on top of the task's stack: it must get a
    # context of its own (a direct call), not take the running call's request over.
    walk = tasks["walk"]
    if inner_held:
        hold(store, walk, 1, "holder-of-1")
    result = walk.delay(0)
    value = result.get(timeout=TIMEOUT)
    outer = next(call for call in calls.seen if call["id"] == result.id)
    assert (outer["lock_key"], outer["fence"]) == outer["before"]
    assert outer["lock_key"].endswith(":0}:lock")
    if inner_held:
        assert is_skipped(value)  # a direct call's skip: the marker, not an Ignore
        assert value["reason"] == "running"
    else:
        assert value == "walked 1"
    assert result.state == "SUCCESS"
    assert lock_redis.get(walk.request_keys((0,), {}).done) == result.id.encode()


def flaky_headers(tasks: dict[str, Any], **options: Any) -> list[dict[str, Any]]:
    """The headers of each message of ``t.flaky`` for request 7, sent with ``options``: the
    first, then its body's retry, which succeeds."""
    published: list[dict[str, Any]] = []

    def on_publish(headers: dict[str, Any], **_: Any) -> None:
        if headers.get("task") == "t.flaky":
            published.append(headers)

    before_task_publish.connect(on_publish, weak=False)
    try:
        result = tasks["flaky"].apply_async((7,), **options)
        assert result.get(timeout=TIMEOUT) == "second time lucky"
    finally:
        before_task_publish.disconnect(on_publish)
    return published


def test_a_body_that_retries_starts_its_deferral_count_afresh(
    worker: Any, tasks: dict[str, Any], calls: Calls
) -> None:
    # As a copy deferred five times while another held the request, then granted.
    first, retried = flaky_headers(tasks, headers={DEFERRALS_HEADER: 5})
    assert [call["retries"] for call in calls.seen] == [0, 1]
    assert first[DEFERRALS_HEADER] == 5
    assert DEFERRALS_HEADER not in retried


def first_deferral_headers(tasks: dict[str, Any], store: LockStore, **options: Any) -> Any:
    """The headers of the first deferred copy of ``t.stage`` for request 7, sent with
    ``options`` while ``t.pending`` holds the request; the copy then runs."""
    republished: list[dict[str, Any]] = []

    def on_publish(headers: dict[str, Any], **_: Any) -> None:
        if headers.get(DEFERRALS_HEADER):
            republished.append(headers)

    lease = hold(store, tasks["stage"], 7, "pending-id", task_name="t.pending")
    before_task_publish.connect(on_publish, weak=False)
    try:
        result = tasks["stage"].apply_async((7,), **options)
        wait_for("the copy to be deferred", lambda: republished, TIMEOUT)
    finally:
        before_task_publish.disconnect(on_publish)
    store.release(lease, success=False, done_ttl_ms=60_000)
    assert result.get(timeout=TIMEOUT) == "stage"
    return republished[0]


def test_a_deferred_copy_drops_rabbitmqs_dead_letter_headers(
    worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    # Celery drops them from a message it publishes again: RabbitMQ < 4.0.1 takes a copy that
    # carries them through native delayed delivery for a dead-letter cycle, and drops it.
    caller = {"x-death": [{"count": 1}], "x-first-death-queue": "q", "tenant": "a"}
    headers = first_deferral_headers(tasks, store, headers=caller)
    assert "x-death" not in headers
    assert "x-first-death-queue" not in headers
    assert headers["tenant"] == "a"  # the caller's own headers go along


def test_a_deferred_copy_of_a_call_without_a_parent_is_not_its_own_parent(
    worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    # Celery takes the running task for the parent of what it publishes without one: the copy
    # of a top-level call came with parent_id set to its own task id (its body saw a parent,
    # and events showed the task as its own parent and child).
    headers = first_deferral_headers(tasks, store)
    assert headers["parent_id"] is None
    assert headers["root_id"] == headers["id"]


def test_a_deferred_copy_keeps_the_callers_parent(
    worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    headers = first_deferral_headers(tasks, store, parent_id="parent-id", root_id="root-id")
    assert (headers["parent_id"], headers["root_id"]) == ("parent-id", "root-id")


def test_a_deferred_copy_keeps_the_callers_argsrepr_and_kwargsrepr(
    worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    # docs/monitoring.md: pass argsrepr and kwargsrepr to keep the arguments out of events and
    # Flower. A deferred copy is published again: its task-received must not show them either.
    headers = first_deferral_headers(tasks, store, argsrepr="(<order>,)", kwargsrepr="{...}")
    assert (headers["argsrepr"], headers["kwargsrepr"]) == ("(<order>,)", "{...}")


def test_a_deferred_copy_keeps_the_callers_ignore_result(
    worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    # Before Celery 5.6.3, Celery's copy of a request drops the call's ignore_result: the copy
    # was published with the task's (False), and stored the result the caller had declined.
    republished: list[dict[str, Any]] = []

    def on_publish(headers: dict[str, Any], **_: Any) -> None:
        if headers.get(DEFERRALS_HEADER):
            republished.append(headers)

    lease = hold(store, tasks["stage"], 7, "pending-id", task_name="t.pending")
    before_task_publish.connect(on_publish, weak=False)
    try:
        tasks["stage"].apply_async((7,), ignore_result=True)
        wait_for("the copy to be deferred", lambda: republished, TIMEOUT)
    finally:
        before_task_publish.disconnect(on_publish)
        store.release(lease, success=False, done_ttl_ms=60_000)
    assert republished[0]["ignore_result"] is True


def test_a_retry_keeps_the_callers_argsrepr_and_kwargsrepr(
    worker: Any, tasks: dict[str, Any]
) -> None:
    # docs/monitoring.md: argsrepr and kwargsrepr keep the arguments out of events and Flower.
    # Celery's retry copies the request without them: the retry's task-received showed them.
    _, retried = flaky_headers(tasks, argsrepr="(<order>,)", kwargsrepr="{...}")
    assert (retried["argsrepr"], retried["kwargsrepr"]) == ("(<order>,)", "{...}")


def test_a_retry_keeps_the_callers_ignore_result(
    worker: Any, tasks: dict[str, Any], calls: Calls
) -> None:
    # Before Celery 5.6.3, Celery's retry copies the request without the call's ignore_result:
    # the retry took the task's (False), and stored the result the caller had declined.
    published: list[dict[str, Any]] = []

    def on_publish(headers: dict[str, Any], **_: Any) -> None:
        if headers.get("task") == "t.flaky":
            published.append(headers)

    before_task_publish.connect(on_publish, weak=False)
    try:
        tasks["flaky"].apply_async((7,), ignore_result=True)
        wait_for("the retry to run", lambda: calls.count("t.flaky") == 2, TIMEOUT)
    finally:
        before_task_publish.disconnect(on_publish)
    assert [headers["ignore_result"] for headers in published] == [True, True]


def test_check_lock_raises_once_a_whole_ttl_passed_unconfirmed(celery_app: Celery) -> None:
    """A body that resumes after a pause longer than its lease finds out at its next
    check_lock(), before the heartbeat has had a chance to beat and mark the lease lost; and
    the loss is told (lock_lost, the log), which the heartbeat, finding the lease let go of by
    then, would not."""

    @celery_app.task(base=LockedTask, bind=True, lock_key="request_idx", name="t.paused",
                     lock_ttl=0.6)  # fmt: skip
    def paused(self: Any, request_idx: int) -> str:
        lease = self.request.lock_lease
        get_runtime(self.app).heartbeat.discard(lease)  # no beat while "paused"
        time.sleep(0.7)  # past the TTL, with no confirmation since the grant
        assert self.request.lock_lost is False  # nobody has told the body yet
        try:
            self.check_lock()
        except LockLostError:
            return f"lost: {self.request.lock_lost}"
        return "still held"

    with recording(signals.lock_lost) as lost:
        assert paused(7) == "lost: True"
    assert [entry["lock_key"] for entry in lost] == ["celery-lock:{t.paused:7}:lock"]


def test_check_lock_on_a_lease_the_task_let_go_of_tells_no_loss(celery_app: Celery) -> None:
    """A lease the task released already (handed on by self.replace, the body going on) is no
    longer extended: a whole TTL later it looks expired, and is no loss to tell."""

    @celery_app.task(base=LockedTask, bind=True, lock_key="request_idx", name="t.let_go",
                     lock_ttl=0.6)  # fmt: skip
    def let_go(self: Any, request_idx: int) -> str:
        lease = self.request.lock_lease
        get_runtime(self.app).heartbeat.discard(lease)
        lease.released = True  # as a hand-on's release marks it
        time.sleep(0.7)
        with contextlib.suppress(LockLostError):
            self.check_lock()
        return "went on"

    with recording(signals.lock_lost) as lost:
        assert let_go(7) == "went on"
    assert lost == []


def test_a_lease_found_gone_at_release_is_told_lost(
    celery_app: Celery, lock_redis: redis.Redis
) -> None:
    """A lease taken from under its body (evicted, a failover that lost it) that the body lets
    go of before the heartbeat's next beat: the release finds it gone, and the loss is told as
    the heartbeat would have (the heartbeat skips a lease no longer held)."""

    @celery_app.task(base=LockedTask, bind=True, lock_key="request_idx", name="t.taken")
    def taken(self: Any, request_idx: int) -> str:
        lock_redis.delete(self.request.lock_key)
        return "done"

    with recording(signals.lock_lost) as lost, recording(signals.lock_released) as released:
        assert taken.apply((7,)).get() == "done"
    assert [entry["lock_key"] for entry in lost] == ["celery-lock:{t.taken:7}:lock"]
    assert [entry["owned"] for entry in released] == [False]


def test_a_long_deferred_copy_waits_no_longer_than_the_holders_lease(
    worker: Any, tasks: dict[str, Any], store: LockStore, lock_redis: redis.Redis
) -> None:
    """After ten deferrals the backoff alone is 512 s: the holder's remaining lease (2 s here)
    caps it, give or take the jitter, so the copy is not kept waiting after the holder ends."""
    lease = hold(store, tasks["stage"], 7, "pending-id", task_name="t.pending")
    lock_redis.pexpire(lease.keys.lock, 2000)
    with recording(signals.lock_deferred) as deferred:
        result = tasks["stage"].apply_async((7,), headers={DEFERRALS_HEADER: 10})
        wait_for("the copy to be deferred", lambda: deferred, TIMEOUT)
        store.release(lease, success=False, done_ttl_ms=60_000)
        assert result.get(timeout=TIMEOUT) == "stage"
    assert 0 < deferred[0]["countdown"] <= 2.0 * 1.2


@pytest.mark.parametrize("pttl_ms", [0, 600_000], ids=["store-down", "ten-minute-lease"])
def test_a_long_deferred_copy_waits_at_most_a_minute(pttl_ms: int) -> None:
    """After ten deferrals the backoff alone is 512 s: with no lease to bound it (the store was
    down) or a holder's lease longer than that, DEFER_MAX_DELAY does, give or take the jitter."""
    delays = [LockedTask._defer_delay(10, pttl_ms) for _ in range(50)]
    assert all(0.8 * 60 <= d <= 1.2 * 60 for d in delays), delays
    # Jittered (±20 %), so that copies deferred together do not all come back together: fifty
    # draws spread over more than half the range (a mutant without the jitter survived).
    assert max(delays) - min(delays) > 0.2 * 60, delays


def _traced(call: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator as tracing libraries write them: its wrapper calls what it wraps."""

    @functools.wraps(call)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    return wrapper


def test_a_base_listed_before_locked_task_has_its_call_run_around_the_locked_body(
    worker: Any, tasks: dict[str, Any], calls: Calls
) -> None:
    assert tasks["traced"].delay(7).get(timeout=TIMEOUT) == "traced"
    # The base's __call__ runs first (no lease yet), then the body, inside the lease.
    assert [call["task"] for call in calls.seen] == ["traced.__call__", "t.traced"]
    assert calls.seen[0]["fence"] is None
    assert calls.seen[1]["fence"] is not None
    copy = tasks["traced"].delay(7)
    assert follow(copy, timeout=TIMEOUT) == "traced"  # skipped as done, followed to the first
    assert copy.state == SKIPPED
    assert calls.count("t.traced") == 1


def test_a_base_whose_call_locked_task_would_hide_is_refused_at_class_creation() -> None:
    class Traced(Task):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    class Tenant(Traced):  # inherits the __call__ LockedTask would hide
        pass

    for base in (Traced, Tenant):
        with pytest.raises(
            ConfigurationError,
            match=rf"Traced\.__call__ would never run: .* \(class Hiding\({base.__name__}, "
            rf"LockedTask\)\)",
        ):
            type("Hiding", (LockedTask, base), {})

    class Plain(LockedTask, Celery("plain_base", set_as_current=False).Task):  # no __call__
        pass

    # Brought in by a LockedTask subclass of the user's: moved before that one, not dropped.
    class Keyed(LockedTask):
        lock_key = "n"

    with pytest.raises(ConfigurationError, match=r"\(class Hiding\(Tenant, Keyed\)\)"):
        type("Hiding", (Keyed, Tenant), {})


def test_a_base_whose_call_skips_locked_task_s_is_refused_at_class_creation() -> None:
    # Flask's recipe for a task_cls calls self.run: listed before LockedTask, as the error above
    # asks, every call would run unlocked.
    class FlaskTask(Task):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.run(*args, **kwargs)

    flask_app = Celery("flask_base", task_cls=FlaskTask, set_as_current=False)
    calls_no_super = (
        r"FlaskTask\.__call__ calls self\.run, not super\(\)\.__call__, "
        r"so LockedTask's never runs: no call of the task would be locked; have it return "
        r"super\(\)\.__call__\(\*args, \*\*kwargs\) instead"
    )
    with pytest.raises(ConfigurationError, match=calls_no_super):
        type("Unlocked", (FlaskTask, LockedTask), {})
    # The app's Task after LockedTask: moved first, as asked, it is refused in turn.
    with pytest.raises(ConfigurationError, match=r"list app\.Task first \(class B\(app\.Task, "):
        type("B", (LockedTask, flask_app.Task), {})
    with pytest.raises(ConfigurationError, match=calls_no_super):
        type("B", (flask_app.Task, LockedTask), {})

    class Explicit(Task):  # names LockedTask's own: it runs
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return LockedTask.__call__(self, *args, **kwargs)  # type: ignore[arg-type]

    type("Locked", (Explicit, LockedTask), {})

    class Decorated(Task):  # the wrapper names no super: what it wraps does
        @_traced
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    type("Locked", (Decorated, LockedTask), {})

    # The app's task_cls brought twice, before LockedTask (app.Task) and after it: moving the
    # one after it works, and is what is asked, not the order as written.
    class Tenant(Task):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    tenant_app = Celery("tenant_base", task_cls=Tenant, set_as_current=False)
    with pytest.raises(
        ConfigurationError, match=r"list Tenant first \(class L\(app\.Task, Tenant, LockedTask\)\)"
    ):
        type("L", (tenant_app.Task, LockedTask, Tenant), {})
    type("L", (tenant_app.Task, Tenant, LockedTask), {})


def _flask_before_1_0(task_cls: type[Task]) -> type[Task]:
    """Flask's recipe before 1.0: the app's Task held in a closure variable and called by it."""
    celery = Celery("flask_0", task_cls=task_cls, set_as_current=False)
    TaskBase = celery.Task

    class ContextTask(TaskBase):  # type: ignore[valid-type,misc]
        abstract = True

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with contextlib.nullcontext():  # app.app_context()
                return TaskBase.__call__(self, *args, **kwargs)

    return ContextTask


class _Nested(Task):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        def inner() -> Any:
            return self.run(*args, **kwargs)

        return inner()


class _Decorated(Task):
    @_traced
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


class _ByName(Task):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, "run")(*args, **kwargs)  # noqa: B009


class _SuperOfLocked(Task):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super(LockedTask, self).__call__(*args, **kwargs)  # type: ignore[misc]


class _HandsOn(Task):  # to a method of its own, which runs the body
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._invoke(args, kwargs)

    def _invoke(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.run(*args, **kwargs)


def _traced_without_wraps(call: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:  # no __wrapped__: its closure holds call
        return call(*args, **kwargs)

    return wrapper


class _DecoratedWithoutWraps(Task):
    @_traced_without_wraps
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


class _Wrapped(Task):  # a task made of a function holds it as __wrapped__
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__wrapped__(*args, **kwargs)


class _Hooked(Task):  # a __call__ of something unknown does not reach LockedTask's
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hook = getattr(self, "on_call", None)
        if hook is not None:
            hook.__call__(self)
        return self.run(*args, **kwargs)


class _Telemetry(Task):  # a structlog-style context around self.run
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = {"task.id": self.request.id, "request.id": kwargs.pop("_request_id", None)}
        logging.getLogger(self.name).debug("context %s", context)
        try:
            result = self.run(*args, **kwargs)
            return result
        finally:
            context.clear()


class _Aliased(Task):  # Task.__call__ called through a local name, on another name of self
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call, task = Task.__call__, self
        return call(task, *args, **kwargs)


class _Starred(Task):  # no self parameter: self is in args
    def __call__(*args: Any, **kwargs: Any) -> Any:
        return Task.__call__(*args, **kwargs)


class _Kept(Task):  # Task.__call__ kept as an attribute, called on self
    base_call = Task.__call__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.base_call(*args, **kwargs)


class _TaskCall(Task):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return Task.__call__(self, *args, **kwargs)


@pytest.mark.parametrize(
    ("base", "call"),
    [
        (_flask_before_1_0(Task), "TaskBase.__call__"),
        (_Nested, "self.run"),
        (_Decorated, "self.run"),
        (_DecoratedWithoutWraps, "self.run"),
        (_HandsOn, "self.run (in self._invoke)"),
        (_Wrapped, "self.__wrapped__"),
        (_Hooked, "self.run"),
        (_ByName, "getattr(..., 'run')"),
        (_SuperOfLocked, "super(LockedTask, self).__call__"),
        (_TaskCall, "Task.__call__"),
        (_Telemetry, "self.run"),
        (_Aliased, "Task.__call__"),
        (_Starred, "Task.__call__"),
        (_Kept, "Task.__call__ (in self.base_call)"),
    ],
    ids=[
        "flask-before-1.0",
        "nested-function",
        "decorated",
        "decorated-without-wraps",
        "hands-on-to-a-method",
        "wrapped-function",
        "unknown-call",
        "getattr",
        "super-of-locked-task",
        "task-call",
        "telemetry",
        "task-call-aliased",
        "task-call-starred",
        "task-call-kept",
    ],
)
def test_a_base_running_the_body_without_locked_task_s_call_is_refused(
    base: type[Task], call: str
) -> None:
    # Each ran every call unlocked, listed before LockedTask; the call is read from the code,
    # resolving the names it calls through (a closure's TaskBase, a global's Task).
    with pytest.raises(ConfigurationError, match=rf"calls {re.escape(call)}, not super"):
        type("Unlocked", (base, LockedTask), {})


def test_a_base_whose_call_reaches_locked_task_s_is_accepted() -> None:
    class OwnSuper(Task):  # Python 2's spelling of super()
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super(OwnSuper, self).__call__(*args, **kwargs)  # noqa: UP008

    type("Locked", (OwnSuper, LockedTask), {})
    # Flask's recipe before 1.0 on an app whose task_cls is LockedTask: TaskBase.__call__ is
    # LockedTask's.
    type("Locked", (_flask_before_1_0(LockedTask),), {})

    class Tenant(OwnSuper):  # its parent's by name: OwnSuper's, which goes on to LockedTask's
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return OwnSuper.__call__(self, *args, **kwargs)

    type("Locked", (Tenant, LockedTask), {})
    # So on an app whose task_cls is such a base (Flask's recipe before 1.0 over Sentry's, say).
    type("Locked", (_flask_before_1_0(OwnSuper), LockedTask), {})

    class Looped(Task):  # a __wrapped__ loop: nothing to read, and no crash
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    Looped.__call__.__wrapped__ = Looped.__call__  # type: ignore[attr-defined]
    type("Locked", (Looped, LockedTask), {})


def test_a_task_class_s_own_call_is_read_though_its_bases_were_read_before() -> None:
    # The bases of a LockedTask class are read once, when it is made; each class made of it
    # is still read for a __call__ of its own.
    class Traced(Task):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    locked = type("Locked", (Traced, LockedTask), {})

    with pytest.raises(ConfigurationError, match=r"Unlocked\.__call__ calls self\.run"):

        class Unlocked(locked):  # type: ignore[valid-type,misc]
            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                return self.run(*args, **kwargs)


def test_a_base_read_before_is_read_again_where_a_later_class_changes_what_it_calls() -> None:
    # Its verdict is kept for each task class made of it: but a later class may override what
    # its __call__ calls on self, or set a __call__ of its own on a LockedTask class after it
    # was made (a class decorator), and each ran every call unlocked.
    class Instrumented(Task):  # a template method: __call__ hands on to a hook
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.execute(*args, **kwargs)

        def execute(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    base = type("Base", (Instrumented, LockedTask), {})
    type("Task", (base,), {})  # read again, and still accepted

    def execute(self: Task, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)

    with pytest.raises(ConfigurationError, match=r"calls self\.run \(in self\.execute\)"):
        type("Fast", (base,), {"execute": execute})
    direct = type("Direct", (), {"execute": execute})  # a plain mixin, listed first
    with pytest.raises(ConfigurationError, match=r"calls self\.run \(in self\.execute\)"):
        type("Fast", (direct, base), {})

    def tenant_aware(cls: type) -> type:  # a class decorator written for a plain Task
        def __call__(self: Task, *args: Any, **kwargs: Any) -> Any:
            return self.run(*args, **kwargs)

        cls.__call__ = __call__  # type: ignore[operator]
        return cls

    tenant = tenant_aware(type("Tenant", (LockedTask,), {}))
    with pytest.raises(ConfigurationError, match=r"Tenant\.__call__ calls self\.run"):
        type("Task", (tenant,), {})


def test_what_a_call_names_is_read_without_running_a_proxy_s_code() -> None:
    # A base's attribute used on self in its __call__, a shared_task (a proxy): reading it ran
    # the proxy, which finalized the app as the module was imported, or raised.
    proxy_app = Celery("proxy_attr", broker="memory://", autofinalize=False, set_as_current=False)
    notify = proxy_app.task(lambda task_id: None, name="proxy_attr.notify", shared=False)
    proxy = celery.local.Proxy(lambda: proxy_app.tasks[notify.name])

    class Notifying(Task):
        on_start = proxy

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            self.on_start.delay(self.request.id)
            return super().__call__(*args, **kwargs)

    type("Locked", (Notifying, LockedTask), {})
    assert not proxy_app.finalized


def test_calls_the_reading_takes_through() -> None:
    class Ctx:  # no task: its __call__ goes on to the next one, LockedTask's
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]

    class ByName(Ctx, Task):  # named, and a .run that is no body's beside it: accepted
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            subprocess.run(["true"], check=False)
            return Ctx.__call__(self, *args, **kwargs)

    type("Locked", (ByName, LockedTask), {})

    class ByString(Task):  # getattr(self, "invoke") is self.invoke
        def invoke(self, *args: Any, **kwargs: Any) -> Any:
            return self.run(*args, **kwargs)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(self, "invoke")(*args, **kwargs)  # noqa: B009

    with pytest.raises(
        ConfigurationError, match=r"calls self\.run \(in getattr\(\.\.\., 'invoke'\)"
    ):
        type("Unlocked", (ByString, LockedTask), {})

    def in_place(call: Callable[..., Any]) -> Callable[..., Any]:  # runs the body instead
        @functools.wraps(call)
        def wrapper(self: Task, *args: Any, **kwargs: Any) -> Any:
            return self.run(*args, **kwargs)

        return wrapper

    class Replaced(Task):  # what it wraps calls super().__call__, and never runs
        @in_place
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    with pytest.raises(ConfigurationError, match=r"Replaced\.__call__ calls self\.run"):
        type("Unlocked", (Replaced, LockedTask), {})

    def timed(call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.invoke  # noqa: B018 (names what will run, say): read in this layer first
            return call(self, *args, **kwargs)

        return wrapper

    class Timed(Task):  # what it wraps calls the body through the same method: still seen
        def invoke(self, *args: Any, **kwargs: Any) -> Any:
            return self.run(*args, **kwargs)

        @timed
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.invoke(*args, **kwargs)

    with pytest.raises(ConfigurationError, match=r"Timed\.__call__ calls self\.run"):
        type("Unlocked", (Timed, LockedTask), {})

    class Paired(Task):  # 3.13 loads x and self in one instruction: self.invoke still seen
        def invoke(self, *args: Any, **kwargs: Any) -> Any:
            return self.run(*args, **kwargs)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return print(args, self.invoke(*args, **kwargs))  # type: ignore[func-returns-value]

    with pytest.raises(ConfigurationError, match=r"calls self\.run \(in self\.invoke\)"):
        type("Unlocked", (Paired, LockedTask), {})


def _run_in_context(task: Task, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return task.run(*args, **kwargs)


_task_call = Task.__call__


def test_what_a_call_hands_on_to_outside_its_class_is_read() -> None:
    # A function of its module that runs the body, or Celery's Task.__call__ under a name of
    # the module's: each ran every call unlocked.
    class Helped(Task):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return _run_in_context(self, args, kwargs)

    class Aliased(Task):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return _task_call(self, *args, **kwargs)

    with pytest.raises(ConfigurationError, match=r"calls task\.run \(in _run_in_context\)"):
        type("Unlocked", (Helped, LockedTask), {})
    with pytest.raises(ConfigurationError, match=r"calls _task_call, not super"):
        type("Unlocked", (Aliased, LockedTask), {})


def test_a_plain_mixin_listed_after_locked_task_is_refused_as_hidden() -> None:
    class ContextAware:  # no task: it lands after Task itself, and never ran
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]

    with pytest.raises(
        ConfigurationError,
        match=r"ContextAware\.__call__ would never run: .* \(class T\(ContextAware, LockedTask\)\)",
    ):
        type("T", (LockedTask, ContextAware), {})
    type("T", (ContextAware, LockedTask), {})
    # Listed after Task by a base of the user's own, it never ran before LockedTask came either.
    mixed = type("Mixed", (Task, ContextAware), {})
    type("T", (mixed, LockedTask), {})


def test_a_kept_verdict_is_read_again_where_the_classes_after_locked_task_differ() -> None:
    class Named(Task):  # no __call__ of its own: super(Named, self) goes on to what follows it
        pass

    class Reaching(Named):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super(Named, self).__call__(*args, **kwargs)

    type("First", (Reaching, LockedTask), {})  # Named before LockedTask: it reaches it
    named_after = type("NamedAfter", (LockedTask, Named), {})
    with pytest.raises(ConfigurationError, match=r"calls super\(Named, self\)\.__call__"):
        type("Second", (Reaching, named_after), {})  # Named after LockedTask: it skips it


def test_reading_a_base_runs_none_of_its_attributes_code_and_takes_any_class() -> None:
    ran: list[str] = []

    class Lazy:  # as werkzeug's LocalProxy, lazy_object_proxy: __wrapped__ runs a factory
        @property
        def __wrapped__(self) -> Any:
            ran.append("factory")
            return lambda: None

        def __call__(self) -> None:
            pass

    class Unhashable(type):  # a metaclass with __eq__ and no __hash__
        def __eq__(cls, other: object) -> bool:
            return cls is other

        __hash__ = None  # type: ignore[assignment]

    class Client(Task, metaclass=Unhashable):
        client = Lazy()

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            self.client()
            return super().__call__(*args, **kwargs)

    type("Locked", (Client, LockedTask), {})
    assert ran == []


class _Runner(Protocol):  # a callback's type, whose __call__ is a stub
    def __call__(self, *args: Any) -> Any: ...


class _Configurable:  # a callable config object: its __call__ makes a configured copy
    def __call__(self, **options: Any) -> Any:
        return type(self)


def _notify() -> None:
    subprocess.run(["true"], check=False)


def test_correct_classes_the_reading_must_not_refuse() -> None:
    # Each is accepted: refused, it would break the import of a task module on upgrading.
    for mixin in (_Runner, collections.abc.Callable, _Configurable):  # never meant to run first
        type("T", (LockedTask, mixin), {})
    library = type("Library", (Task, _Configurable), {})  # its mixin after Task: never ran
    type("T", (LockedTask, library), {})

    class Stored(Task):  # a helper's subprocess.run is no body; super() stored, then called
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            _notify()
            parent = super()
            return parent.__call__(*args, **kwargs)

    class Copied(Task):  # functools.wraps(Task.__call__) copies its name, and calls super()
        @functools.wraps(Task.__call__)
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    class Compared(Task):  # Task.__call__ compared, not called, whichever side it is on
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if type(self).__call__ is not Task.__call__:
                _notify()
            if Task.__call__ is self.__class__.__call__ or type(self).__call__ in (Task.__call__,):
                _notify()
            return super().__call__(*args, **kwargs)

    for base in (Stored, Copied, Compared):
        type("Locked", (base, LockedTask), {})


def test_a_kept_verdict_read_against_a_foreign_object_does_not_break_an_import() -> None:
    class Raising(type):  # a foreign metaclass whose __module__ raises
        @property
        def __module__(cls) -> str:  # type: ignore[override]
            raise RuntimeError("no module")

    class Handle(metaclass=Raising):
        pass

    class Helped(Task):
        def helper(self) -> int:
            return 1

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            self.helper()
            return super().__call__(*args, **kwargs)

    type("First", (Helped, LockedTask), {})
    # The kept verdict is checked against what self.helper is here: a foreign object.
    type("Second", (Helped, LockedTask), {"helper": Handle()})


def test_a_base_is_read_once_for_every_task_class_made_of_it() -> None:
    # Each task class holds its own name (and options): a verdict compared on self.name was
    # never reused, and the base read again for every task (60 to 145 us each).
    class Named(Task):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            logging.getLogger(self.name).debug("called")
            return super().__call__(*args, **kwargs)

    locked = type("Locked", (Named, LockedTask), {})
    with mock.patch.object(
        celery_lock.bases._Reader, "bypass", autospec=True, return_value=None
    ) as bypass:
        for n in range(3):
            type(f"T{n}", (locked,), {"name": f"t{n}"})
    assert bypass.call_count == 0


def test_a_long_call_s_code_is_read_whole() -> None:
    # Past 255 names, an instruction's argument takes an EXTENDED_ARG before it, which cleared
    # what the check held: Task.__call__ was no longer seen.
    options = "".join(f"    self.option_{n}\n" for n in range(300))  # each a name of its own
    source = f"def __call__(self, *a, **k):\n{options}    return Task.__call__(self, *a, **k)\n"
    namespace: dict[str, Any] = {"Task": Task}
    exec(source, namespace)
    base = type("Long", (Task,), {"__call__": namespace["__call__"]})
    with pytest.raises(ConfigurationError, match=r"calls Task\.__call__, not super"):
        type("Unlocked", (base, LockedTask), {})


def test_every_base_whose_call_locked_task_would_hide_is_moved_in_the_order_asked() -> None:
    class Traced(Task):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    class Tenant(Task):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    with pytest.raises(
        ConfigurationError,
        match=r"list Traced, Tenant first \(class H\(Traced, Tenant, LockedTask\)\)",
    ):
        type("H", (LockedTask, Traced, Tenant), {})
    type("H", (Traced, Tenant, LockedTask), {})

    class Flask(Task):  # hidden, and would run the body itself once moved: both are said
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.run(*args, **kwargs)

    with pytest.raises(
        ConfigurationError,
        match=r"Flask\.__call__ would never run: .*; and listed first, it calls self\.run, not "
        r"super\(\)\.__call__, so that no call would be locked: have it return "
        r"super\(\)\.__call__\(\*args, \*\*kwargs\), and list Flask first",
    ):
        type("H", (LockedTask, Flask), {})


def test_track_started_is_taken_from_where_celery_would_take_it() -> None:
    # on_bound moves track_started to the task's own flag: a subclass of a bound task that says
    # track_started=False kept its base's True, and stored STARTED.
    first = Celery("track_first", broker="memory://", set_as_current=False)
    first.conf.task_track_started = True

    class Fetch(LockedTask):
        name = "track.fetch"
        lock_key = "n"

        def run(self, n: int) -> int:
            return n

    fetch = first.register_task(Fetch())
    second = Celery("track_second", broker="memory://", set_as_current=False)

    @second.task(base=Fetch, name="track.quiet", track_started=False, shared=False, lazy=False)
    def quiet(n: int) -> int:
        return n

    @second.task(base=Fetch, name="track.inherits", shared=False, lazy=False)
    def inherits(n: int) -> int:
        return n

    assert (fetch.track_started, fetch._lock_track_started) == (False, True)
    assert quiet._lock_track_started is False  # its own False
    assert inherits._lock_track_started is True  # its base's, as Celery would read it
    Fetch.bind(second)  # bound again: what it had stays
    assert Fetch._lock_track_started is True
