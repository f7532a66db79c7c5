"""Skipped and deferred copies as a caller reads them on Celery's ``rpc://`` result backend
over RabbitMQ: an in-process worker on the machine's RabbitMQ service, on a queue of its own.

``rpc://`` sends each state to the caller's reply queue as a message. A state that is not ready
(``SKIPPED``, ``RETRY``) is put back after each poll, so ``.state`` and ``follow`` read it
again; a ``.get()`` consumes it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import TestWorkController
from celery.exceptions import TimeoutError as CeleryTimeoutError
from conftest import hold, start_in_process_worker, wait_for

from celery_lock import SKIPPED, ConfigurationError, LockedTask, follow, is_skipped
from celery_lock.store import LockStore

TIMEOUT = 20
SHORT = 0.5
pytestmark = [pytest.mark.amqp, pytest.mark.usefixtures("close_lock_runtime")]
QUEUE = f"celery-lock-rpc-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def celery_config(celery_config: dict[str, Any], rabbitmq: str) -> dict[str, Any]:
    return {
        **celery_config,
        "broker_url": rabbitmq,
        "result_backend": "rpc://",
        "task_default_queue": QUEUE,
        "worker_prefetch_multiplier": 1,
    }


@pytest.fixture
def tasks(celery_app: Celery) -> dict[str, Any]:
    @celery_app.task(base=LockedTask, bind=True, lock_key="idx", name="rpc.process", shared=False)
    def process(self: Any, idx: int) -> str:
        return f"processed {idx}"

    @celery_app.task(
        base=LockedTask, bind=True, lock_key="idx", lock_scope="rpc", name="rpc.stage",
        shared=False,
    )  # fmt: skip
    def stage(self: Any, idx: int) -> str:
        return f"staged {idx}"

    return {"process": process, "stage": stage}


@pytest.fixture
def worker(celery_app: Celery, tasks: dict[str, Any]) -> Iterator[TestWorkController]:
    try:
        with start_in_process_worker(celery_app, pool="solo", perform_ping_check=False) as worker:
            yield worker
    finally:
        consumer = celery_app.backend.result_consumer
        if consumer._consumer is not None:  # started by a get(): stop it, or its socket leaks
            consumer.stop()
        with celery_app.connection_for_write() as connection:
            connection.default_channel.queue_delete(QUEUE)


def skipped_copy(tasks: dict[str, Any], store: LockStore) -> Any:
    hold(store, tasks["process"], 7, "holder-id")
    copy = tasks["process"].delay(7)
    wait_for("the copy to be SKIPPED", lambda: copy.state == SKIPPED, TIMEOUT)
    return copy


def test_a_skipped_copy_reads_skipped_and_follow_refuses_it(
    worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    copy = skipped_copy(tasks, store)
    assert (copy.info["reason"], copy.info["holder"]) == ("running", "holder-id")
    assert (copy.ready(), copy.successful(), copy.failed()) == (False, False, False)
    with pytest.raises(ConfigurationError, match=r"^result_backend: follow\(\) cannot follow"):
        follow(copy, timeout=TIMEOUT)
    assert copy.state == SKIPPED  # still there for a later read


def test_a_get_consumes_a_skip_that_follow_then_cannot_see(
    worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    # docs/api.md: on rpc://, a .get() takes the SKIPPED state it cannot return off the reply
    # queue; from then on the copy reads PENDING, and follow waits until its timeout.
    copy = skipped_copy(tasks, store)
    with pytest.raises(CeleryTimeoutError):
        copy.get(timeout=SHORT, interval=0.05)
    assert copy.state == "PENDING"
    with pytest.raises(CeleryTimeoutError):
        follow(copy, timeout=SHORT)


def test_a_copy_skipped_as_success_is_returned_as_its_marker(
    celery_app: Celery, worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    celery_app.conf.celery_lock_skip_as_success = True
    hold(store, tasks["process"], 7, "holder-id")
    copy = tasks["process"].delay(7)
    value = follow(copy, timeout=TIMEOUT)
    assert is_skipped(value)
    assert copy.get(timeout=TIMEOUT) == value
    assert copy.successful()


def test_a_deferred_copy_reads_retry_until_it_runs(
    worker: Any, tasks: dict[str, Any], store: LockStore
) -> None:
    lease = hold(store, tasks["stage"], 7, "other-stage-id", task_name="rpc.other")
    result = tasks["stage"].delay(7)
    wait_for("the copy to be deferred", lambda: result.state == "RETRY", TIMEOUT)
    store.release(lease, success=False, done_ttl_ms=60_000)
    assert follow(result, timeout=TIMEOUT) == "staged 7"
