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
No Celery hook sees a group before its first member is sent, so it is not checked whole unless
the caller asks, with :func:`check_canvas`, before applying it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from celery import Task

from .exceptions import LockKeyError

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["STEP_OPTIONS", "check_canvas", "check_later_steps"]

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
    # celery-types declares neither attribute.
    if not app.finalized and not app.autofinalize:  # type: ignore[attr-defined]
        # A client that sends by name before it finalizes (autofinalize=False): its registry
        # is not ready, and reading it would raise ("Contract breach: app not finalized"),
        # refusing a call Celery sends. Its steps are left to the worker, as unregistered ones.
        return
    seen: set[int] = set()  # each signature once, as a chain's link_error is on each step
    for option in STEP_OPTIONS:
        # Not fixed: a mutable step's arguments start with its parent's result.
        for step in _fixed_steps(options.get(option), fixed=False, seen=seen):
            where = f"a later step, in the call's {option}: the call is not sent"
            _check_step(app, step, where)


def check_canvas(signature: Mapping[str, Any], app: Celery | None = None) -> None:
    """Derive, before the caller applies ``signature``, the request key of every
    :class:`~celery_lock.LockedTask` step whose arguments are fixed, as its worker would: each
    member of a group or of a chord's header, and the first step of a chain, as they stand in
    ``signature``; and every immutable step (``.si()``), wherever it is.

    Celery publishes a group's members one by one, each checked as it is sent, so a refused
    member leaves the members before it published and running. Checked first, the group is
    refused whole::

        job = group(process.s(idx) for idx in request_ids)
        check_canvas(job)  # LockKeyError, and nothing is sent
        job.apply_async()

    A mutable step after another (a chain's next step, a chord's body, a callback) gets its
    parent's result first: it is left to the worker. Arguments given when the canvas is applied
    (``job.apply_async(args)``) are not in ``signature``: not checked.

    Args:
        signature: the canvas (or a single signature, as a ``Signature`` or a dict).
        app: the app whose task registry names the steps' tasks; default: the signature's.

    Raises:
        LockKeyError: naming the first such step's task, whose arguments yield no request key.
        TypeError: ``signature`` is none of those (a task, ``process`` for ``process.s(7)``,
            or its name): there would be nothing to check, and no sign of it.

    .. versionadded:: 0.2.0
    """
    if not isinstance(signature, Mapping) and (
        # The Proxy a lazy @app.task returns is Iterable to the ABC, and fails to iterate.
        not isinstance(signature, Iterable) or isinstance(signature, str | bytes | Task)
    ):
        raise TypeError(
            f"check_canvas() takes a signature (such as process.s(7)), a dict, or an iterable "
            f"of them, not {type(signature).__name__}"
        )
    if app is None:
        from celery import current_app  # noqa: PLC0415 - for a dict, which names no app

        app = getattr(signature, "app", None) or current_app
    for step in _fixed_steps(signature, fixed=True, seen=set()):
        _check_step(app, step, "checked before the canvas is applied: nothing is sent")


def _check_step(app: Celery, step: Mapping[str, Any], where: str) -> None:
    """Derive the request key of ``step`` if it calls a :class:`~celery_lock.LockedTask` of
    ``app``; a refusal names ``where`` the step is."""
    from .task import LockedTask  # noqa: PLC0415 - task imports worker, which imports this

    name = step.get("task")
    task = app.tasks.get(name) if isinstance(name, str) else None
    if not isinstance(task, LockedTask):
        return
    try:
        task._request_key(tuple(step.get("args") or ()), step.get("kwargs") or {})
    except LockKeyError as exc:
        raise LockKeyError(f"{exc.args[0]} ({where})", exc.task_name) from exc


def _fixed_steps(value: Any, fixed: bool, seen: set[int]) -> Iterator[Mapping[str, Any]]:
    """The calls in ``value`` (a signature, a dict or an iterable of them) whose arguments are
    fixed: ``fixed`` ones (a member of a group the caller applies, a chain's first step) and
    immutable ones; a step after another, or a callback, is ``fixed`` no more."""
    if value is None:  # the usual publish option: answered before the ABC checks below
        return
    if isinstance(value, Iterable) and not isinstance(value, Mapping | str | bytes):
        for item in value:  # a list, a tuple, or the regen of a group made from a generator
            yield from _fixed_steps(item, fixed, seen)
        return
    if not isinstance(value, Mapping) or id(value) in seen:
        return
    seen.add(id(value))
    kind, kwargs = value.get("subtask_type"), value.get("kwargs") or {}
    if kind == "group":
        yield from _fixed_steps(kwargs.get("tasks"), fixed, seen)
    elif kind == "chain":
        first, *rest = list(kwargs.get("tasks") or ()) or [None]
        yield from _fixed_steps(first, fixed, seen)
        yield from _fixed_steps(rest, False, seen)
    elif kind == "chord":
        yield from _fixed_steps(kwargs.get("header"), fixed, seen)
        yield from _fixed_steps(kwargs.get("body"), False, seen)
    elif fixed or value.get("immutable"):
        yield value
    options = value.get("options") or {}
    for option in STEP_OPTIONS:
        yield from _fixed_steps(options.get(option), False, seen)
