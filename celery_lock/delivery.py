"""How a deferred copy is published again: as its message came, where its broker needs it.

``LockedTask`` defers a copy by publishing it again with a countdown (Celery's
``signature_from_request``, as ``retry`` does). Three things that message must keep are not in
the request Celery copies from: the serializer and the compression the message came in, and, on
RabbitMQ's native delayed delivery, the queue it came from.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from celery import Celery
from kombu import Exchange, Queue, serialization
from kombu.common import Broadcast

from .request import CONTENT_TYPE_FIELD
from .runtime import first_broker_url

try:
    from celery.utils.quorum_queues import detect_quorum_queues as _detect_quorum_queues
except ImportError:  # Celery before 5.5: no native delayed delivery
    _detect_quorum_queues = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_VISIBILITY_TIMEOUT",
    "copy_delivery",
    "returns_uncounted",
    "visibility_timeout",
    "within_visibility",
]

#: Where _native_delayed_delivery keeps its answer on the app.
_NATIVE_DELAY = "_celery_lock_native_delay"
#: kombu's prefix of a delayed message's routing key: the delay's 28 bits, one per level.
_DELAY_PREFIX = re.compile(r"^(?:[01]\.){28}")

#: Kombu's default visibility timeout for the Redis transports (one hour).
DEFAULT_VISIBILITY_TIMEOUT = 3600.0
# The kombu transports that redeliver an unacked message after ``visibility_timeout``, by the
# broker URL's scheme (kombu's aliases, lower-cased), with kombu's default for each: Redis and
# Sentinel (kombu.transport.redis: one hour), SQS, SoftLayer MQ and pgmq (30 minutes).
_VISIBILITY_TRANSPORTS = {
    "redis": DEFAULT_VISIBILITY_TIMEOUT,
    "rediss": DEFAULT_VISIBILITY_TIMEOUT,
    "redis+socket": DEFAULT_VISIBILITY_TIMEOUT,
    "sentinel": DEFAULT_VISIBILITY_TIMEOUT,
    "sqs": 1800.0,
    "slmq": 1800.0,
    "pgmq": 1800.0,
}
#: The share of the broker's visibility timeout a deferred copy may wait, at most.
_SHARE_OF_VISIBILITY = 0.5


def within_visibility(app: Celery, countdown: float) -> float:
    """``countdown``, or half the broker's visibility timeout where that is shorter, for a
    deferred copy. The copy waits in a worker as an ETA message, unacked: one that waits past
    the timeout is delivered again beside itself, both copies are deferred again, and the copies
    double every round while the holder runs. (A retry's countdown is the caller's, as Celery
    takes it: Celery's docs say to keep it under the visibility timeout.)"""
    visibility = visibility_timeout(app)
    if visibility is None:
        return countdown
    return min(countdown, visibility * _SHARE_OF_VISIBILITY)


def visibility_timeout(app: Celery) -> float | None:
    """After how many seconds ``app``'s broker delivers an unacked message again, ``None``
    where it does not (RabbitMQ)."""
    broker = first_broker_url(app)  # the first of failover brokers: kombu starts there
    default = _VISIBILITY_TRANSPORTS.get(broker.split("://", 1)[0].lower())
    if default is None:
        return None
    options = app.conf.broker_transport_options or {}
    configured = options.get("visibility_timeout")
    return default if configured is None else float(configured)


def returns_uncounted(app: Celery) -> bool:
    """Whether the broker ``app``'s worker consumes from (``broker_read_url``, else
    ``broker_url``) takes a message given back (``Reject(requeue=True)``) without counting it
    as a delivery: kombu's Redis transports (Sentinel's too) do. A RabbitMQ quorum queue counts
    every return, and drops (or dead-letters) a message past its ``x-delivery-limit`` (RabbitMQ
    4 gives every quorum queue a limit of 20); SQS counts receives against a redrive policy's
    ``maxReceiveCount``. Other transports are taken to count too."""
    with app.connection_for_read() as connection:  # not connected: the transport's class
        return bool(connection.get_transport_cls().driver_type == "redis")


def copy_delivery(app: Celery, request: Any, countdown: float) -> tuple[float, dict[str, Any]]:
    """The countdown and the publish options of a deferred copy of ``request``.

    The serializer is the message's (``apply_async(serializer="pickle")``), not the task's: an
    argument the task's serializer cannot carry would fail every publish of the copy. So is the
    compression (``apply_async(compression="zlib")``): uncompressed, a copy may be over the
    broker's size limit, and RabbitMQ refuses it after the publish returned, the original
    acked: the request lost. Where
    Celery sends countdowns through RabbitMQ's native delayed delivery (Celery 5.5+, quorum
    queues), which routes a delay by whole seconds and refuses 0, the countdown is rounded up
    to whole seconds, at least 1; and the copy names the queue it came from, since that
    delivery routes by the queue's routing key and Celery would take the default queue's
    (also for a message that came by a routing key of its own, through a topic binding).
    """
    options: dict[str, Any] = {}
    serializer = _serializer_of(request)
    if serializer is not None:
        options["serializer"] = serializer
    # The message's compression header, a content type, which kombu takes as a name too.
    compression = getattr(request, "compression", None)
    if compression:
        options["compression"] = compression
    if _native_delayed_delivery(app):
        countdown = float(max(1, math.ceil(countdown)))
        queue = _queue_delivered_from(app, request.delivery_info or {})
        if queue is not None:
            options["queue"] = queue
    return countdown, options


def _serializer_of(request: Any) -> str | None:
    """The name of the serializer of the message a worker's request came in (``None`` for an
    eager or direct call, or a content type no serializer is registered for)."""
    content_type = getattr(request, CONTENT_TYPE_FIELD, None)
    if not content_type:
        return None
    registry: Any = serialization.registry  # type: ignore[attr-defined]  # not in kombu's stubs
    name: str | None = registry.type_to_name.get(content_type)
    return name


def _native_delayed_delivery(app: Any) -> bool:
    """Whether Celery sends ``app``'s countdowns through RabbitMQ's native delayed delivery: an
    AMQP broker with a quorum queue among the app's queues (Celery 5.5+). Read once per app."""
    native: bool | None = app.__dict__.get(_NATIVE_DELAY)
    if native is None:
        native = False
        if _detect_quorum_queues is not None:
            with app.connection_for_write() as connection:  # not connected: the driver's name
                native = bool(_detect_quorum_queues(app, connection.transport.driver_type)[0])
        setattr(app, _NATIVE_DELAY, native)
    return native


def _queue_delivered_from(app: Any, delivery_info: Mapping[str, Any]) -> str | None:
    """The name of the app's queue the delivery came from, or ``None``: the queue whose
    routing key the delivery came by, the delay's prefix taken off (a copy that came through
    native delayed delivery, which routes by the queue's routing key); else the queue bound
    by a topic pattern (``orders.#``) that the delivery's own routing key (``orders.create``)
    matches on the exchange it was published to."""
    routing_key = _DELAY_PREFIX.sub("", str(delivery_info.get("routing_key") or ""), count=1)
    queues = app.amqp.queues
    for name, queue in queues.items():
        if queue.routing_key == routing_key:
            return str(name)
    exchange = delivery_info.get("exchange")
    for name, queue in queues.items():
        if isinstance(queue, Broadcast):  # never a delayed delivery's (nor Celery's) target
            continue
        for bound_to, binding_key in _bindings(queue):
            if (
                bound_to is not None
                and bound_to.name == exchange
                and bound_to.type == "topic"
                and _topic_matches(binding_key or "", routing_key)
            ):
                return str(name)
    return None


def _bindings(queue: Queue) -> list[tuple[Exchange | None, str | None]]:
    """The (exchange, binding key) pairs ``queue`` is bound by, as native delayed delivery
    reads them: its exchange and routing key, or else its ``bindings``."""
    if queue.exchange:
        return [(queue.exchange, queue.routing_key)]
    return [(entry.exchange, entry.routing_key) for entry in queue.bindings or ()]


def _topic_matches(binding_key: str, routing_key: str) -> bool:
    """Whether a topic exchange routes ``routing_key`` by ``binding_key``: words split on
    dots, ``*`` standing for one word and ``#`` for any number of them."""
    return _words_match(tuple(binding_key.split(".")), tuple(routing_key.split(".")))


def _words_match(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_words_match(rest, words[skip:]) for skip in range(len(words) + 1))
    return bool(words) and head in ("*", words[0]) and _words_match(rest, words[1:])
