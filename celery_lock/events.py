"""Celery events sent by celery-lock, for Flower and other event consumers.

``task-skipped``
    A copy was skipped. Fields: ``name``, ``lock_key``, ``reason`` (``running`` or ``done``),
    ``holder`` (task id), and ``result``, a readable summary that Flower displays.
``task-lock-lost``
    The heartbeat found a running task's lease lost. Fields: ``name``, ``lock_key``, ``result``.

``name`` is the name Celery's own events give the call (``task-received``): the task's name, or
the call's shadow name when it has one (``apply_async(shadow=...)``, ``Task.shadow_name``), so
that Flower lists and counts the call under one name.

Events follow the worker's switch: they are sent only when the worker sends task events
(``celery worker -E`` or ``worker_send_task_events = True``), because ``Task.send_event`` would
otherwise force them on. ``task-skipped`` is sent by the worker's main process
(:class:`celery_lock.request.LockedRequest`), so it also follows a switch flipped at run time
(Flower's ``enable_events``); ``task-lock-lost``, and ``task-skipped`` for a copy completed as
SUCCESS under ``skip_as_success`` (which the main process sees as a success), are sent by the
pool process, which knows only the switch it started with. A task with ``send_events = False``
sends none, as Celery sends none of its own events for it. Nothing is sent for eager or direct
calls.
"""

from __future__ import annotations

import logging
import os
import threading
from time import monotonic
from typing import Any

from celery import Task
from tenacity import Retrying, stop_after_delay, wait_random_exponential

from .heartbeat import start_apart

__all__ = [
    "MAX_SENDERS",
    "RETRY_SECONDS",
    "TASK_LOCK_LOST",
    "TASK_SKIPPED",
    "send_task_event",
    "send_task_event_apart",
    "task_events_enabled",
    "wait_for_events_apart",
]

logger = logging.getLogger(__name__)

#: The threads of :func:`send_task_event_apart` still publishing.
_senders: set[threading.Thread] = set()
if hasattr(os, "register_at_fork"):
    # A process forked meanwhile has none of them running.
    os.register_at_fork(after_in_child=_senders.clear)

#: Seconds :func:`send_task_event_apart` goes on trying an event the broker did not take.
RETRY_SECONDS = 60

#: The most threads :func:`send_task_event_apart` keeps publishing at once in a process; an
#: event beyond them is dropped, with a warning: a broker that hangs holds each one for ever.
MAX_SENDERS = 16

TASK_SKIPPED = "task-skipped"
TASK_LOCK_LOST = "task-lock-lost"


def task_events_enabled(task: Task[Any, Any]) -> bool:
    """Whether this worker sends task events, and this task sends its own (``send_events``,
    which Celery's request honours for the events it sends)."""
    return bool(task.app.conf.worker_send_task_events) and bool(task.send_events)


def send_task_event(
    task: Task[Any, Any], type_: str, task_id: str, hostname: str | None, **fields: Any
) -> None:
    """Send event ``type_`` about ``task_id`` if the worker sends task events; never raise.

    Takes the worker's ``hostname`` explicitly: the heartbeat thread has no task request.
    ``name`` defaults to the task's name; a call with a shadow name passes that instead.
    """
    if not hostname or not task_events_enabled(task):
        return
    try:
        _publish(task, type_, task_id, hostname, fields)
    except Exception:  # an event is worth a log line, never a failed task
        logger.warning("celery-lock: could not send %s for task %s", type_, task_id, exc_info=True)


def _publish(
    task: Task[Any, Any], type_: str, task_id: str, hostname: str, fields: dict[str, Any]
) -> None:
    fields.setdefault("name", task.name)
    with task.app.events.default_dispatcher(hostname=hostname) as dispatcher:
        dispatcher.send(type_, uuid=task_id, retry=False, **fields)


def send_task_event_apart(
    task: Task[Any, Any], type_: str, task_id: str, hostname: str | None, **fields: Any
) -> None:
    """:func:`send_task_event` on a thread of its own, for a caller that must not wait on the
    broker: the heartbeat's thread, whose next extends would wait as long as a publish to a
    broker that is down takes to give up (seconds), or a body's. Tried again, with backoff,
    for up to :data:`RETRY_SECONDS`: a lost lease most often comes with a network that cut the
    broker too (Celery's own events wait in the worker's buffer meanwhile). At most
    :data:`MAX_SENDERS` at once: beyond, the event is dropped with a warning. Where no thread
    can start, sent here, once."""
    if not hostname or not task_events_enabled(task):
        return
    if len(_senders) >= MAX_SENDERS:
        logger.warning(
            "celery-lock: dropped %s for task %s: %d events are still on their way to the broker",
            type_,
            task_id,
            MAX_SENDERS,
        )
        return

    def send() -> None:
        try:
            for attempt in Retrying(
                stop=stop_after_delay(RETRY_SECONDS),
                wait=wait_random_exponential(multiplier=0.5, max=10.0),
                reraise=True,
            ):
                with attempt:
                    _publish(task, type_, task_id, hostname, dict(fields))
        except Exception:
            logger.warning(
                "celery-lock: could not send %s for task %s in %d s of tries",
                type_,
                task_id,
                RETRY_SECONDS,
                exc_info=True,
            )
        finally:
            _senders.discard(threading.current_thread())

    sender = threading.Thread(target=send, name="celery-lock-event", daemon=True)
    _senders.add(sender)
    try:
        start_apart(sender)  # signals blocked: it may wait on the broker a minute, or for ever
    except RuntimeError:  # "can't start new thread": late rather than never
        _senders.discard(sender)
        send_task_event(task, type_, task_id, hostname, **fields)


def wait_for_events_apart(timeout: float) -> None:
    """Wait, ``timeout`` seconds at most in all, for the events :func:`send_task_event_apart`
    is still publishing: a pool process that exits (``os._exit``) would drop them."""
    deadline = monotonic() + timeout
    for sender in list(_senders):
        sender.join(max(0.0, deadline - monotonic()))
