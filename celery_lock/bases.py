"""A task class's bases and their ``__call__``: which ones ``LockedTask``'s runs inside.

``LockedTask.__call__`` takes the lease, runs the body and releases it; it calls no
``__call__`` after its own. So a base's ``__call__`` works only before it in the method
resolution order, and only if it calls ``super().__call__``: placed after it, it never runs; placed
before it and calling the body itself, every call runs unlocked. Both would say nothing, so
both are refused when the class is created (:func:`check_call_order`).

Whether a ``__call__`` calls the body itself is read from its code (:mod:`dis`), so only what its
code says is known: a call of ``run`` on anything, ``getattr(..., "run")``, ``X.__call__`` where
``X`` is a task class (a global or a closure variable) that is no ``LockedTask``, or
``super(X, self).__call__`` where ``X`` comes at or after ``LockedTask``; nested functions
included. A wrapper a decorator made is looked through (``__wrapped__``). What is no Python
function (compiled code, a ``partialmethod``) is taken on trust, as is a name the check cannot
resolve.
"""

from __future__ import annotations

import builtins
import contextlib
import dis
import inspect
from collections.abc import Iterator, Mapping
from types import CodeType
from typing import Any

from celery import Task

from .exceptions import ConfigurationError

__all__ = ["check_call_order"]

_NAME_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF"})
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})
_UNRESOLVED = object()

# What a call in a base's __call__ does, read from its code:
_RUNS = "runs the body"  # self.run(...): the body, without LockedTask's
_SKIPS = "skips LockedTask's"  # Task.__call__(self, ...), super(LockedTask, self).__call__(...)
_REACHES = "reaches LockedTask's"  # super().__call__(...), LockedTask.__call__(self, ...)


def check_call_order(cls: type, locked: type) -> None:
    """Refuse ``cls`` if a ``__call__`` of its bases would skip ``locked.__call__`` (that of
    ``LockedTask``), or be skipped by it.

    Raises:
        ConfigurationError: naming the class and the order, or the call, that works.
    """
    name = f"{cls.__module__}.{cls.__qualname__}"
    mro = cls.__mro__
    at = mro.index(locked)
    for klass in mro[:at]:
        bypass = _bypass(klass.__dict__.get("__call__"), mro[at:], locked)
        if bypass:
            raise ConfigurationError(
                name,
                f"{_shown_class(klass)}.__call__ calls {bypass}, not super().__call__, so "
                f"LockedTask's never runs: no call of the task would be locked; have it return "
                f"super().__call__(*args, **kwargs) instead",
            )
    hidden = [k for k in mro[at + 1 : mro.index(Task)] if "__call__" in k.__dict__]
    if hidden:
        raise ConfigurationError(
            name,
            f"{_shown_class(hidden[0])}.__call__ would never run: LockedTask comes before it "
            f"and runs the body itself; {_order_that_runs(cls, hidden, locked)}, so that its "
            f"__call__ runs and calls super().__call__",
        )


def _bypass(call: Any, skipped: tuple[type, ...], locked: type) -> str | None:
    """How ``call``, a ``__call__`` placed before ``locked``'s, runs the body without
    ``locked.__call__`` (``"self.run"``, ``"TaskBase.__call__"``), or ``None``.

    ``skipped``: the classes at and after ``locked`` in the order, which a ``super(X, self)`` of
    one of them passes by. A call of ``run`` counts only where the code calls no ``__call__``
    that reaches ``locked``'s (a ``__call__`` that chooses between the two)."""
    if call is None:
        return None
    function = inspect.unwrap(call) if callable(call) else call
    if not inspect.isfunction(function) or function is locked.__call__:
        return None
    names: dict[str, Any] = {**vars(builtins), **function.__globals__}
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=True):
        with contextlib.suppress(ValueError):  # empty: assigned after the class was made
            names[name] = cell.cell_contents
    found = list(_calls(function.__code__, names, skipped, locked))
    skips = [what for what, kind in found if kind == _SKIPS]
    runs = [what for what, kind in found if kind == _RUNS]
    if skips:
        return skips[0]
    if runs and all(kind != _REACHES for _, kind in found):
        return runs[0]
    return None


def _calls(
    code: CodeType, names: Mapping[str, Any], skipped: tuple[type, ...], locked: type
) -> Iterator[tuple[str, str]]:
    """Each call in ``code`` (and the code nested in it) of the body or of a ``__call__``, as
    ``(the call as written, _RUNS | _SKIPS | _REACHES)``. A ``__call__`` of what the check
    cannot resolve to a class is taken as reaching ``locked``'s; of a class that is no task,
    left out."""
    held: Any = _UNRESOLVED  # what the loads since the last other instruction resolve to
    shown = ""  # and how the code names it
    in_super = False  # a super(...) is being built: its attribute is the next one loaded
    super_of: Any = None  # the class it names, if any (3.12 names __class__ for super())
    for instruction in dis.get_instructions(code):
        op, arg = instruction.opname, instruction.argval
        if op in _NAME_LOADS:
            value = names.get(arg, _UNRESOLVED)
            if held is super:
                super_of = value
            in_super = in_super or value is super
            held, shown = value, arg
        elif op in _ATTRIBUTE_LOADS and in_super:
            if arg == "__call__" and super_of in skipped:
                yield f"super({super_of.__name__}, self).__call__", _SKIPS
            elif arg == "__call__":
                yield "super().__call__", _REACHES
            in_super, super_of = False, None
            held, shown = _UNRESOLVED, ""
        elif op in _ATTRIBUTE_LOADS:
            if arg == "run":
                yield f"{shown or '(...)'}.run", _RUNS
            elif arg == "__call__" and not isinstance(held, type):
                yield f"{shown or '(...)'}.__call__", _REACHES  # on trust
            elif arg == "__call__" and issubclass(held, Task):
                yield f"{shown}.__call__", _REACHES if issubclass(held, locked) else _SKIPS
            held = inspect.getattr_static(held, arg, _UNRESOLVED)
            shown = f"{shown}.{arg}" if shown else ""
        elif op == "LOAD_CONST" and isinstance(arg, CodeType):
            # A nested function's own captured locals are not the globals of the same name.
            inner = {k: v for k, v in names.items() if k not in code.co_cellvars}
            yield from _calls(arg, inner, skipped, locked)
        elif op == "LOAD_CONST" and arg == "run" and "getattr" in code.co_names:
            yield "getattr(self, 'run')", _RUNS
        elif op in {"LOAD_FAST", "LOAD_CLOSURE"}:
            held, shown = _UNRESOLVED, arg
        else:
            held, shown = _UNRESOLVED, ""


def _order_that_runs(cls: type, hidden: list[type], locked: type) -> str:
    """How to list ``cls``'s bases so that each of ``hidden``'s ``__call__`` comes before
    ``locked``'s: each base listed after the first that brings ``locked`` and that brings one
    of ``hidden`` is moved before that one."""
    bases = list(cls.__bases__)
    first = next(i for i, base in enumerate(bases) if locked in base.__mro__)
    moved = [
        b
        for b in bases[first + 1 :]
        if locked not in b.__mro__ and any(h in b.__mro__ for h in hidden)
    ]
    if not moved:
        return f"list {_shown_class(hidden[0])} before LockedTask"
    order = bases[:first] + moved + [b for b in bases[first:] if b not in moved]
    first_ones, listed = (", ".join(_shown_class(b) for b in some) for some in (moved, order))
    return f"list {first_ones} first (class {cls.__name__}({listed}))"


def _shown_class(klass: type) -> str:
    """A class's name for a message: ``app.Task`` for the class an app makes of its
    ``task_cls`` (named ``Task``, as ``celery.Task`` is)."""
    if klass.__name__ == "Task" and klass is not Task and "_app" in klass.__dict__:
        return "app.Task"
    return klass.__name__
