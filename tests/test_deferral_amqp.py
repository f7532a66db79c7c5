"""Deferrals over RabbitMQ quorum queues, where Celery (5.5+) sends a countdown through native
delayed delivery: an in-process worker on the machine's RabbitMQ service."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import TestWorkController
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import before_task_publish
from conftest import hold, start_in_process_worker, wait_for
from kombu import Exchange, Queue

from celery_lock import LockedTask, signals
from celery_lock.lease import Acquired
from celery_lock.runtime import get_runtime
from celery_lock.store import LockStore
from celery_lock.task import DEFERRALS_HEADER

pytest.importorskip("celery.utils.quorum_queues", reason="native delayed delivery: Celery 5.5+")

TIMEOUT = 30
pytestmark = [pytest.mark.amqp, pytest.mark.usefixtures("close_lock_runtime")]
SUFFIX = uuid.uuid4().hex[:8]
DEFAULT_QUEUE = f"celery-lock-default-{SUFFIX}"
WORK_QUEUE = f"celery-lock-work-{SUFFIX}"


def quorum_queue(name: str, binding_key: str | None = None, **arguments: Any) -> Queue:
    """A quorum queue on a topic exchange of its own (native delayed delivery needs one),
    bound by ``binding_key`` (default: its name)."""
    return Queue(
        name, Exchange(name, type="topic"), routing_key=binding_key or name,
        queue_arguments={"x-queue-type": "quorum", **arguments},
    )  # fmt: skip


@pytest.fixture
def work_queue_arguments() -> dict[str, Any]:
    return {}


@pytest.fixture
def work_binding_key() -> str:
    return WORK_QUEUE


@pytest.fixture
def celery_config(
    celery_config: dict[str, Any],
    rabbitmq: str,
    work_queue_arguments: dict[str, Any],
    work_binding_key: str,
) -> dict[str, Any]:
    return {
        **celery_config,
        "broker_url": rabbitmq,
        "task_queues": [
            quorum_queue(DEFAULT_QUEUE),
            quorum_queue(WORK_QUEUE, work_binding_key, **work_queue_arguments),
        ],
        "task_default_queue": DEFAULT_QUEUE,
        "task_default_exchange": DEFAULT_QUEUE,
        "task_default_exchange_type": "topic",
        "task_default_routing_key": DEFAULT_QUEUE,
        "worker_prefetch_multiplier": 1,
    }


@pytest.fixture
def stage(celery_app: Celery) -> Any:
    @celery_app.task(
        base=LockedTask, bind=True, lock_key="idx", lock_scope="quorum", name="q.stage",
        shared=False,
    )  # fmt: skip
    def stage(self: Any, idx: int) -> int:
        return idx

    return stage


@pytest.fixture
def redo(celery_app: Celery) -> Any:
    @celery_app.task(
        base=LockedTask, bind=True, lock_key="idx", name="q.redo", shared=False, max_retries=3,
    )  # fmt: skip
    def redo(self: Any, idx: int, countdown: float) -> int:
        if self.request.retries == 0:
            raise self.retry(countdown=countdown)
        return idx

    return redo


@pytest.fixture
def work_worker(celery_app: Celery, stage: Any, redo: Any) -> Iterator[TestWorkController]:
    """A worker of the work queue alone, as a dedicated pool would be; both queues declared
    first (as their own workers would), and deleted after, with their exchanges."""
    with celery_app.connection_for_write() as connection:
        for queue in celery_app.conf.task_queues:
            queue(connection.default_channel).declare()
    try:
        with start_in_process_worker(
            celery_app, pool="solo", queues=[WORK_QUEUE], perform_ping_check=False
        ):
            yield
    finally:
        with celery_app.connection_for_write() as connection:
            for name in (DEFAULT_QUEUE, WORK_QUEUE):
                connection.default_channel.queue_delete(name)
                connection.default_channel.exchange_delete(name)


@pytest.fixture
def deferrals() -> Iterator[list[str]]:
    """The routing keys of the deferred copies published meanwhile."""
    routing_keys: list[str] = []

    def on_publish(headers: dict[str, Any], routing_key: str, **_: Any) -> None:
        if headers.get(DEFERRALS_HEADER):
            routing_keys.append(routing_key)

    before_task_publish.connect(on_publish, weak=False)
    yield routing_keys
    before_task_publish.disconnect(on_publish)


def test_a_deferred_copy_is_published_in_whole_seconds_to_the_queue_it_came_from(
    stage: Any, work_worker: Any, store: LockStore, deferrals: list[str]
) -> None:
    """Native delayed delivery routes a delay by whole seconds and refuses 0: a first deferral
    of 0.5 s failed to publish, and the message came back at once, again and again. And it
    routes by the queue's routing key, which Celery takes from the default queue unless the
    copy names its own: the copy left the work queue."""
    lease = hold(store, stage, 7, "other-stage-id", "q.other")  # another stage: deferred
    result = stage.apply_async((7,), queue=WORK_QUEUE)
    wait_for("a deferred copy", lambda: deferrals, TIMEOUT)
    store.release(lease, success=False, done_ttl_ms=60_000)
    assert deferrals[0].endswith("." + WORK_QUEUE), deferrals[0]
    assert result.get(timeout=TIMEOUT) == 7


@pytest.mark.parametrize("work_queue_arguments", [{"x-delivery-limit": 5}])
def test_a_held_request_on_a_quorum_queue_with_a_delivery_limit_runs_once_free(
    stage: Any, work_worker: Any, store: LockStore
) -> None:
    """Every failed deferral sent the message back, and a quorum queue counts each return as
    a delivery: past the limit RabbitMQ dropped the message, and the request never ran."""
    lease = hold(store, stage, 8, "other-stage-id", "q.other")
    result = stage.apply_async((8,), queue=WORK_QUEUE)
    threading.Event().wait(3)
    store.release(lease, success=False, done_ttl_ms=60_000)
    assert result.get(timeout=TIMEOUT) == 8


@pytest.mark.parametrize("work_queue_arguments", [{"x-delivery-limit": 1}])
def test_a_soft_time_limit_in_the_acquire_on_a_quorum_queue_with_a_delivery_limit_runs_once(
    stage: Any, work_worker: Any, deferrals: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lock store that hangs past a soft time limit cuts the acquire short, before the body
    began. The message was given back (Reject with requeue), and a quorum queue counts each
    return as a delivery: past the limit RabbitMQ dropped it, and the request never ran, its
    result PENDING for ever. Republished instead, as a deferral, the copy starts a count of
    its own."""
    store = get_runtime(stage.app).store_for(stage.lock_settings())
    acquire, cut = store.acquire, []

    def hangs_three_times(*args: Any, **kwargs: Any) -> Any:
        if len(cut) < 3:
            cut.append(args)
            raise SoftTimeLimitExceeded()
        return acquire(*args, **kwargs)

    retried: list[Any] = []
    monkeypatch.setattr(store, "acquire", hangs_three_times)
    monkeypatch.setattr(stage, "on_retry", lambda *args: retried.append(args))
    result = stage.apply_async((10,), queue=WORK_QUEUE)
    assert result.get(timeout=TIMEOUT) == 10
    assert len(cut) == 3
    assert len(deferrals) == 3
    # Acked with no state stored: a RETRY, in a result backend on the store that hangs, would
    # wait there until the hard limit, whose FAILURE callers would read meanwhile.
    assert retried == []


@pytest.mark.parametrize("work_queue_arguments", [{"x-delivery-limit": 1}])
def test_a_grant_cut_short_by_a_soft_time_limit_waits_as_a_redelivery_of_its_own(
    stage: Any, work_worker: Any, monkeypatch: pytest.MonkeyPatch, lock_redis: Any
) -> None:
    """The acquire's script granted the lease, then the soft limit cut the round trip short:
    the republished copy finds its own task id holding the request, and waits for the lease
    to lapse (no heartbeat knows it) instead of running beside a grant, or being skipped."""
    store = get_runtime(stage.app).store_for(stage.lock_settings())
    acquire, cut = store.acquire, []
    reasons: list[tuple[str, str]] = []

    def granted_then_cut(*args: Any, **kwargs: Any) -> Any:
        outcome = acquire(*args, **kwargs)
        if not cut:
            cut.append(outcome)
            raise SoftTimeLimitExceeded()
        return outcome

    def on_deferred(sender: Any, reason: str, holder: str, **_: Any) -> None:
        reasons.append((reason, holder))

    signals.lock_deferred.connect(on_deferred, weak=False)
    monkeypatch.setattr(store, "acquire", granted_then_cut)
    try:
        result = stage.apply_async((11,), queue=WORK_QUEUE)
        assert result.get(timeout=TIMEOUT) == 11
    finally:
        signals.lock_deferred.disconnect(on_deferred)
    assert isinstance(cut[0], Acquired)
    assert reasons[0] == ("store-unavailable", "")
    assert len(reasons) > 1
    assert set(reasons[1:]) == {("redelivered", result.id)}


@pytest.mark.parametrize("countdown", [1.0, 0.1], ids=["routed", "under-a-second"])
def test_a_retry_on_a_quorum_queue_runs_on_the_queue_it_came_from(
    redo: Any, work_worker: Any, countdown: float
) -> None:
    """Celery publishes a retry's countdown through native delayed delivery as it does any
    countdown: routed by the default queue's routing key, the retry left the work queue (and
    waited for ever where no worker consumes the default one), and a countdown under a second
    (int() of it is 0) failed to publish, so Celery rejected the message without requeue."""
    result = redo.apply_async((7, countdown), queue=WORK_QUEUE)
    assert result.get(timeout=TIMEOUT) == 7


@pytest.mark.parametrize("work_binding_key", [f"{WORK_QUEUE}.#"], ids=["topic-pattern"])
def test_a_copy_routed_by_a_topic_pattern_is_deferred_to_the_queue_it_came_from(
    stage: Any, redo: Any, work_worker: Any, store: LockStore, deferrals: list[str]
) -> None:
    """A message that reached its queue through a topic binding (``<queue>.#``) carries a
    routing key of its own (``<queue>.create``), which is no queue's: the copy named no queue,
    and native delayed delivery routed it by the default queue's routing key, to the default
    queue, where no worker of the work queue would ever see it (and so did a retry)."""
    routed = {"exchange": WORK_QUEUE, "routing_key": f"{WORK_QUEUE}.create"}
    lease = hold(store, stage, 9, "other-stage-id", "q.other")  # another stage: deferred
    deferred = stage.apply_async((9,), **routed)
    wait_for("a deferred copy", lambda: deferrals, TIMEOUT)
    store.release(lease, success=False, done_ttl_ms=60_000)
    assert deferrals[0].endswith("." + f"{WORK_QUEUE}.#"), deferrals[0]
    assert deferred.get(timeout=TIMEOUT) == 9
    assert redo.apply_async((9, 1.0), **routed).get(timeout=TIMEOUT) == 9
