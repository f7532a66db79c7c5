"""A deferred copy is published again with the serializer and the compression its message came in
(an in-process worker that accepts pickle as well as JSON)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from conftest import hold, wait_for
from kombu import Producer, compression
from recording import recording

from celery_lock import LockedTask, signals
from celery_lock.store import LockStore

TIMEOUT = 20
pytestmark = pytest.mark.usefixtures("close_lock_runtime")


@pytest.fixture
def celery_config(celery_config: dict[str, Any]) -> dict[str, Any]:
    return {**celery_config, "accept_content": ["json", "pickle"]}


@pytest.fixture
def reserve(celery_app: Celery) -> Any:
    @celery_app.task(
        base=LockedTask, bind=True, lock_key=lambda skus: ",".join(sorted(skus)),
        lock_scope="cart", name="s.reserve", shared=False,
    )  # fmt: skip
    def reserve(self: Any, skus: set[str]) -> str:
        return type(skus).__name__

    return reserve


@pytest.fixture
def deferred() -> Iterator[list[dict[str, Any]]]:
    with recording(signals.lock_deferred) as sent:
        yield sent


def test_a_pickled_copy_is_deferred_as_pickle(
    reserve: Any, celery_worker: Any, store: LockStore, deferred: list[dict[str, Any]]
) -> None:
    """Published again with the task's serializer (JSON), a copy whose argument JSON cannot
    carry (a set) failed to publish each time, and came straight back: never deferred, tried
    again at once for as long as the holder held the request."""
    lease = hold(store, reserve, {"hat", "socks"}, "other-stage-id", "s.other")
    result = reserve.apply_async(({"hat", "socks"},), serializer="pickle")
    wait_for("the copy to be deferred", lambda: deferred, TIMEOUT)
    assert deferred[0]["reason"] == "contention"
    store.release(lease, success=False, done_ttl_ms=60_000)  # the other stage is done
    assert result.get(timeout=TIMEOUT) == "set"  # pickled all the way


@pytest.fixture
def restock(celery_app: Celery) -> Any:
    @celery_app.task(
        base=LockedTask, bind=True, lock_key=lambda skus: ",".join(sorted(skus)),
        name="s.restock", shared=False, max_retries=3,
    )  # fmt: skip
    def restock(self: Any, skus: set[str]) -> str:
        if self.request.retries == 0:
            raise self.retry(countdown=0.1)
        return type(skus).__name__

    return restock


def test_a_pickled_message_whose_body_retries_is_retried_as_pickle(
    restock: Any, celery_worker: Any
) -> None:
    """Celery's retry publishes the copy with the task's serializer (JSON): a message that came
    in as pickle with an argument JSON cannot carry (a set) failed to publish its retry, and
    Celery rejected it without requeue, so the request was never done nor handed on."""
    result = restock.apply_async(({"hat", "socks"},), serializer="pickle")
    assert result.get(timeout=TIMEOUT) == "set"


def test_a_compressed_message_is_deferred_and_retried_compressed(
    reserve: Any,
    restock: Any,
    celery_worker: Any,
    store: LockStore,
    deferred: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Celery copies no compression into a retry, nor into a deferred copy: a large message
    sent compressed went out uncompressed, over a broker's size limit, and RabbitMQ refuses
    such a publish after it returned, with the original message acked."""
    sent: list[tuple[str, str | None]] = []
    publish = Producer.publish

    def spied(self: Producer, body: Any, *args: Any, **kwargs: Any) -> Any:
        task = (kwargs.get("headers") or {}).get("task")
        if task in (reserve.name, restock.name):
            given = kwargs.get("compression")
            sent.append((task, given and compression.get_encoder(given)[1]))
        return publish(self, body, *args, **kwargs)

    monkeypatch.setattr(Producer, "publish", spied)
    lease = hold(store, reserve, {"hat", "socks"}, "other-stage-id", "s.other")
    result = reserve.apply_async(({"hat", "socks"},), serializer="pickle", compression="zlib")
    wait_for("the copy to be deferred", lambda: deferred, TIMEOUT)
    store.release(lease, success=False, done_ttl_ms=60_000)
    assert result.get(timeout=TIMEOUT) == "set"
    retried = restock.apply_async(({"hat", "socks"},), serializer="pickle", compression="zlib")
    assert retried.get(timeout=TIMEOUT) == "set"
    gzip = "application/x-gzip"
    assert sent == [(reserve.name, gzip)] * 2 + [(restock.name, gzip)] * 2
