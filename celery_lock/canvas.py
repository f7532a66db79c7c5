"""Publish-time check of a canvas's later steps.

A chain's next step, a ``link`` or ``link_error`` callback and a chord's body ride in the first
message's options (``chain``, ``link``, ``link_error``, ``chord``), and a worker publishes them
only once the step before has run. A :class:`~celery_lock.LockedTask` step whose arguments yield
no request key would fail there, after the first step's work is done::

    chain(charge.si(order_id), notify.si(wrong_name=order_id))()

:func:`check_later_steps` derives the key of every such step whose arguments are all known when
the first message is published, so the call raises :class:`~celery_lock.LockKeyError` and
nothing is sent. Those are the immutable signatures (``.si()``, ``immutable=True``), at any depth
(in a group, a chord's header or body, a nested chain, a step's own callbacks). A mutable step
(``.s()``) gets its parent's result before its own arguments, which only the worker knows: it is
left to the worker, as is a step of a task this process has not registered (or of an app that
is not finalized and does not finalize itself).

A group the caller applies (or a chord's header) is no later step: Celery publishes its members
one by one, each checked as it is sent, so a refused member leaves those before it published.
No Celery hook sees a group before its first member is sent, so it is not checked whole.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .exceptions import LockKeyError

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["STEP_OPTIONS", "check_later_steps"]

#: The options of a call that carry signatures a worker publishes later.
STEP_OPTIONS = ("chain", "link", "link_error", "chord")


def check_later_steps(app: Celery, options: Mapping[str, Any]) -> None:
    """Derive the request key of every :class:`~celery_lock.LockedTask` step in ``options``
    whose arguments are fixed (an immutable signature), as its worker would.

    Args:
        app: the app publishing the call, whose task registry names the steps' tasks.
        options: the call's publish options (``send_task``'s keyword arguments).

    Raises:
        LockKeyError: naming the first such step's task, whose arguments yield no request key.
    """
    from .task import LockedTask  # noqa: PLC0415 - task imports worker, which imports this

    # celery-types declares neither attribute.
    if not app.finalized and not app.autofinalize:  # type: ignore[attr-defined]
        # A client that sends by name before it finalizes (autofinalize=False): its registry
        # is not ready, and reading it would raise ("Contract breach: app not finalized"),
        # refusing a call Celery sends. Its steps are left to the worker, as unregistered ones.
        return
    seen: set[int] = set()
    for option in STEP_OPTIONS:
        for step in _signatures(options.get(option), seen):
            # A group, chain or chord is no call of its own (its members are steps), and a
            # mutable step's arguments start with its parent's result.
            if step.get("subtask_type") or not step.get("immutable"):
                continue
            name = step.get("task")
            task = app.tasks.get(name) if isinstance(name, str) else None
            if not isinstance(task, LockedTask):
                continue
            try:
                task._request_key(tuple(step.get("args") or ()), step.get("kwargs") or {})
            except LockKeyError as exc:
                raise LockKeyError(
                    f"{exc.args[0]} (a later step, in the call's {option}: the call is not sent)",
                    exc.task_name,
                ) from exc


def _signatures(value: Any, seen: set[int]) -> Iterator[Mapping[str, Any]]:
    """Every signature in ``value`` (a signature, as a ``Signature`` or a dict, or a list of
    them), with those nested in groups, chains, chords and in their options; each object once
    (``seen``), as a chain's ``link_error`` is set on each of its steps."""
    if isinstance(value, list | tuple):
        for item in value:
            yield from _signatures(item, seen)
        return
    if not isinstance(value, Mapping) or id(value) in seen:
        return
    seen.add(id(value))
    yield value
    kwargs = value.get("kwargs") or {}
    if value.get("subtask_type") in ("group", "chain"):
        yield from _signatures(kwargs.get("tasks"), seen)
    elif value.get("subtask_type") == "chord":
        yield from _signatures(kwargs.get("header"), seen)
        yield from _signatures(kwargs.get("body"), seen)
    options = value.get("options") or {}
    for option in STEP_OPTIONS:
        yield from _signatures(options.get(option), seen)
