"""A task class's bases and their ``__call__``: which ones ``LockedTask``'s runs inside.

``LockedTask.__call__`` takes the lease, runs the body and releases it; it calls no
``__call__`` after its own. So a base's ``__call__`` works only before it in the method
resolution order, and only if it calls ``super().__call__``: placed after it, it never runs; placed
before it and calling the body itself, every call runs unlocked. Both would say nothing, so
both are refused when the class is created (:func:`check_call_order`).

Whether a ``__call__`` calls the body itself is read from its code (:mod:`dis`), so only what its
code says is known: a call of ``run`` (or of ``__wrapped__``, the function a task was made of) on
anything but a module or a class that is no task (``subprocess.run``), ``getattr(..., "run")``,
Celery's own ``Task.__call__`` however it is named (``X.__call__`` where ``X``, a global or a
closure variable, is a task class whose ``__call__`` is ``Task``'s), or ``super(X, self).__call__``
where ``X`` comes at or after ``LockedTask``. Read with it: the functions it defines inside, the
functions of its own module it calls, and what it uses on ``self`` (or names to ``getattr``) that a
class of the user's defines (not ``LockedTask`` or Celery's ``Task``). A decorated ``__call__`` is
read layer by layer (``__wrapped__``, or the functions a wrapper's closure holds), each judged on
its own. A call of the body is forgiven where the same layer also calls a ``__call__`` that reaches
``LockedTask``'s (a choice between the two). Names are resolved without running any code of theirs:
an instance (a proxy) is not looked into. What is no Python function (compiled code, a
``partialmethod``, a wrapt proxy's wrapper), a function of another module or class, and a name the
check cannot resolve are taken on trust.
"""

from __future__ import annotations

import builtins
import contextlib
import dis
import functools
import inspect
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from types import CodeType, FunctionType, ModuleType
from typing import Any, TypeGuard

from celery import Task

from .exceptions import ConfigurationError

__all__ = ["check_call_order"]

_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_CELL_LOADS = frozenset({"LOAD_DEREF", "LOAD_CLASSDEREF"})
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})
_FAST_LOADS = frozenset(
    {
        "LOAD_FAST", "LOAD_CLOSURE", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR",
        "LOAD_FAST_LOAD_FAST", "STORE_FAST_LOAD_FAST", "LOAD_FAST_BORROW",
        "LOAD_FAST_BORROW_LOAD_FAST_BORROW",
    }
)  # fmt: skip
_UNRESOLVED = object()
_COMPARISONS = frozenset({"IS_OP", "COMPARE_OP", "CONTAINS_OP"})
_CALLS = ("CALL", "PRECALL")  # CALL, CALL_FUNCTION, CALL_METHOD, CALL_FUNCTION_EX, CALL_KW, ...
#: The attributes that are a task's body: ``run``, and the function a task was made of.
_BODY = frozenset({"run", "__wrapped__"})

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
        call = klass.__dict__.get("__call__")
        if call is None:
            continue
        accepted = None
        with contextlib.suppress(TypeError):  # a class its metaclass made unhashable
            accepted = _ACCEPTED.get(klass)
        if accepted is not None and accepted.holds(call, mro, locked):
            continue  # read for an earlier class, and what it reads on self is the same here
        reader = _Reader(cls, locked)
        bypass = reader.bypass(call)
        if bypass:
            raise ConfigurationError(
                name,
                f"{_shown_class(klass)}.__call__ calls {bypass}, not super().__call__, so "
                f"LockedTask's never runs: no call of the task would be locked; have it return "
                f"super().__call__(*args, **kwargs) instead",
            )
        with contextlib.suppress(TypeError):
            _ACCEPTED[klass] = _Accepted(call, reader.followed, mro[at:])
    # After LockedTask: a task class before Task, or a plain mixin (after Task itself) that a
    # base listed after LockedTask brings; one that the user's own base lists after Task never
    # ran before LockedTask either.
    later = _listed_after(cls, locked)
    task_classes = mro[at + 1 : mro.index(Task)]
    hidden = [
        k
        for k in mro[at + 1 :]
        if "__call__" in k.__dict__
        and (
            k in task_classes
            or (k not in Task.__mro__ and k in later and _wraps_a_call(cls, locked, k))
        )
    ]
    if not hidden:
        return
    shown = _shown_class(hidden[0])
    # Read as if listed before LockedTask, as the message asks: one that would then run the
    # body itself is told so now, not after the user moved it.
    bypass = _Reader(cls, locked, before=(*mro[:at], *hidden)).bypass(hidden[0].__call__)
    if bypass:
        raise ConfigurationError(
            name,
            f"{shown}.__call__ would never run: LockedTask comes before it and runs the body "
            f"itself; and listed first, it calls {bypass}, not super().__call__, so that no "
            f"call would be locked: have it return super().__call__(*args, **kwargs), and "
            f"{_order_that_runs(cls, hidden, locked)}",
        )
    raise ConfigurationError(
        name,
        f"{shown}.__call__ would never run: LockedTask comes before it and runs the body "
        f"itself; {_order_that_runs(cls, hidden, locked)}, so that its __call__ runs and calls "
        f"super().__call__",
    )


@dataclass(frozen=True)
class _Accepted:
    """A base's ``__call__`` read and accepted, and what each name it called on ``self``
    resolved to then (``None``: defined by no class before ``LockedTask``)."""

    call: Any
    followed: dict[str, Any]
    after: tuple[type, ...]  # the classes at and after LockedTask then, which super(X) may name

    def holds(self, call: Any, mro: tuple[type, ...], locked: type) -> bool:
        """Whether the verdict holds for a class of order ``mro``: the same ``__call__`` (not
        one set on the class since), the same classes at and after ``locked``, and each name it
        called on ``self`` resolving as it did (not overridden by a class made since)."""
        try:
            return self._holds(call, mro, locked)
        except Exception:  # an object no reader foresaw: read again, where it is trusted
            return False

    def _holds(self, call: Any, mro: tuple[type, ...], locked: type) -> bool:
        own = _own_classes(mro, locked)
        return (
            call is self.call
            and _same(mro[mro.index(locked) :], self.after)
            and all(_readable(_resolve(own, name)) is held for name, held in self.followed.items())
        )


#: The bases read and accepted, so that each task class made of a base does not read it again.
_ACCEPTED: weakref.WeakKeyDictionary[type, _Accepted] = weakref.WeakKeyDictionary()


class _Reader:
    """Reads a ``__call__`` placed before ``locked``'s in ``cls``'s order, and what it calls
    in turn, for a call that runs the body without ``locked.__call__``."""

    def __init__(self, cls: type, locked: type, before: tuple[type, ...] | None = None) -> None:
        mro = cls.__mro__
        at = mro.index(locked)
        self.locked = locked
        #: The classes before ``locked``: a ``__call__`` or method of theirs is read in turn.
        self.before = mro[:at] if before is None else before
        #: The user's classes, wherever they come: a method of theirs called on self is read.
        self.own = _own_classes(mro, locked)
        #: The classes at and after it: ``super(X, self)`` of one of them passes it by.
        self.skipped = tuple(k for k in mro[at:] if k not in self.before)
        self.read: set[CodeType] = set()
        #: The functions the ``__call__`` being read wraps (by id), each read in its own turn.
        self.wrapped: set[int] = set()
        #: Each name followed on ``self``, and what it resolved to.
        self.followed: dict[str, Any] = {}

    def bypass(self, call: Any) -> str | None:
        """How ``call`` runs the body without ``locked.__call__`` (``"self.run"``,
        ``"TaskBase.__call__"``), or ``None``. Each layer of a decorated ``__call__`` is judged
        on its own: a wrapper that calls the body in place of what it wraps is not forgiven by
        the ``super().__call__`` of the function it wraps."""
        layers = list(_layers(call))
        self.wrapped = {id(layer) for layer in layers[1:]}
        try:
            for layer in layers:
                self.read = set()  # each layer reads what it calls itself
                bypass = _verdict(list(self._layer(layer, via="")))
                if bypass:
                    return bypass
        except Exception:  # hundreds of methods deep, or an object no reader foresaw: trusted,
            return None  # as the check must never break an import it cannot judge
        return None

    def _function(self, call: Any, via: str) -> Iterator[tuple[str, str]]:
        """The calls of ``call`` and of each function it wraps (``__wrapped__``, as
        ``functools.wraps`` and wrapt set it), and of what they hand on to; ``via``: how it was
        reached, for the message."""
        for layer in _layers(call):
            yield from self._layer(layer, via)

    def _layer(self, function: Any, via: str) -> Iterator[tuple[str, str]]:
        """The calls of one Python function (a static or class method's), if it is one."""
        if type(function) is staticmethod or type(function) is classmethod:
            function = function.__func__
        if type(function) is not FunctionType or function is self.locked.__call__:
            return
        code = function.__code__
        if code in self.read:
            return
        self.read.add(code)
        cells: dict[str, Any] = {}
        for name, cell in zip(code.co_freevars, function.__closure__ or (), strict=True):
            with contextlib.suppress(ValueError):  # empty: assigned after the class was made
                cells[name] = cell.cell_contents
        self_name = code.co_varnames[0] if code.co_argcount else ""
        yield from self._code(code, function.__globals__, cells, self_name, via)
        # A wrapper made without functools.wraps holds what it wraps in its closure.
        for held in cells.values():
            if type(held) is FunctionType and id(held) not in self.wrapped:
                yield from self._function(held, via)

    def _code(
        self,
        code: CodeType,
        global_names: dict[str, Any],
        cells: dict[str, Any],
        self_name: str,
        via: str,
    ) -> Iterator[tuple[str, str]]:
        """Each call in ``code`` (and the code nested in it) of the body or of a ``__call__``, as
        ``(the call as written, _RUNS | _SKIPS | _REACHES)``. A ``__call__`` of what cannot be
        resolved to a task class is left out."""
        held: Any = _UNRESOLVED  # what the loads since the last other instruction resolve to
        shown = ""  # and how the code names it
        in_super = False  # a super(...) is being built: its attribute is the next one loaded
        super_of: Any = None  # the class it names, if any (3.12 names __class__ for super())
        instructions = _instructions(code)
        for at, (op, arg) in enumerate(instructions):
            if op in _GLOBAL_LOADS or op in _CELL_LOADS:
                if op in _CELL_LOADS:
                    value = cells.get(arg, _UNRESOLVED)
                else:
                    value = global_names.get(arg, getattr(builtins, arg, _UNRESOLVED))
                if id(value) in self.wrapped:  # a wrapper calling what it wraps, read apart
                    yield arg, _REACHES
                elif value is Task.__call__ and not _compared(instructions, at):
                    yield f"{arg}{via}", _SKIPS  # Celery's, under another name
                elif op in _GLOBAL_LOADS and _same_module(value, global_names):
                    # A function of the same module it hands on to (_run_in_context(self)).
                    yield from self._function(value, f" (in {arg}{via})")
                if held is super:
                    super_of = value
                in_super = in_super or value is super
                held, shown = value, arg
            elif op in _ATTRIBUTE_LOADS and in_super:
                if arg == "__call__" and any(super_of is k for k in self.skipped):
                    yield f"super({super_of.__name__}, self).__call__{via}", _SKIPS
                elif arg == "__call__":
                    yield "super().__call__", _REACHES
                in_super, super_of = False, None
                held, shown = _UNRESOLVED, ""
            elif op in _ATTRIBUTE_LOADS:
                compared = arg == "__call__" and _compared(instructions, at)
                yield from self._on_attribute(held, shown, arg, self_name, via, compared)
                held = _attribute(held, arg)
                shown = f"{shown}.{arg}" if shown else ""
            elif op == "LOAD_CONST" and isinstance(arg, CodeType):
                # A nested function's own captured locals are not the outer's closure.
                inner = {k: v for k, v in cells.items() if k not in code.co_cellvars}
                yield from self._code(arg, global_names, inner, self_name, via)
            elif op == "LOAD_CONST" and type(arg) is str and "getattr" in code.co_names:
                yield from self._named(arg, via)  # getattr(self, "invoke"), say
            elif op == "EXTENDED_ARG":  # the next instruction's argument: what is held holds
                continue
            elif op in _FAST_LOADS:
                # 3.13 loads two at once (and stores one, loads another): the last is on top.
                held, shown = _UNRESOLVED, arg[-1] if isinstance(arg, tuple) else arg
            else:
                # s = super(): no attribute of it is loaded next.
                in_super = in_super and not op.startswith("STORE")
                held, shown = _UNRESOLVED, ""

    def _on_attribute(
        self, held: Any, shown: str, name: str, self_name: str, via: str, compared: bool
    ) -> Iterator[tuple[str, str]]:
        """What loading ``held.<name>`` (``shown`` in the code) calls: the body, a class's
        ``__call__`` (not where it is only compared, as in ``is Task.__call__``), or a method
        of the user's on ``self``, read in turn."""
        if name in _BODY and not _no_task(held):  # subprocess.run is no task's body
            yield f"{shown or '(...)'}.{name}{via}", _RUNS
        elif name == "__call__" and _is_class(held) and not compared:
            kind = self._named_call(held)
            if kind is not None:
                yield f"{shown}.__call__{via}", kind
        elif shown == self_name and self_name:
            yield from self._method(name, f" (in {shown}.{name}{via})")

    def _named(self, name: str, via: str) -> Iterator[tuple[str, str]]:
        """The calls of what a string names to ``getattr`` (``"run"``, ``"invoke"``)."""
        if name in _BODY:
            yield f"getattr(..., {name!r}){via}", _RUNS
        elif name.isidentifier():
            yield from self._method(name, f" (in getattr(..., {name!r}){via})")

    def _method(self, name: str, via: str) -> Iterator[tuple[str, str]]:
        """The calls of ``self.<name>``, where a class of the user's defines it (not
        ``locked`` or Celery's ``Task``)."""
        found = _resolve(self.own, name)
        if found is Task.__call__:  # base_call = Task.__call__, called as self.base_call(...)
            yield f"Task.__call__{via}", _SKIPS
        held = self.followed[name] = _readable(found)
        if held is not None:
            yield from self._function(held, via)

    def _named_call(self, klass: type) -> str | None:
        """What ``klass.__call__(self, ...)`` reaches: the class that defines that function
        decides. One placed before ``locked`` is read on its own (its ``super()`` goes on
        towards ``locked``'s); ``locked``'s or a subclass's reaches it; another task class's
        (Celery's ``Task``'s) passes it by; any other class's is left out (``None``)."""
        if issubclass(klass, self.locked):
            return _REACHES
        function = _resolve(klass.__mro__, "__call__")
        owner = next((k for k in klass.__mro__ if k.__dict__.get("__call__") is function), klass)
        if owner in self.before:
            return _REACHES
        return _SKIPS if issubclass(klass, Task) else None


def _verdict(found: list[tuple[str, str]]) -> str | None:
    """The call that passes ``LockedTask.__call__`` by, of the calls read in one layer: one
    that skips it, or one of the body where nothing read calls a ``__call__`` that reaches it."""
    skips = [what for what, kind in found if kind == _SKIPS]
    runs = [what for what, kind in found if kind == _RUNS]
    if skips:
        return skips[0]
    if runs and all(kind != _REACHES for _, kind in found):
        return runs[0]
    return None


def _same_module(value: Any, global_names: dict[str, Any]) -> bool:
    """Whether ``value`` is a function of the module whose globals are ``global_names``."""
    return type(value) is FunctionType and value.__globals__ is global_names


def _same(these: tuple[type, ...], those: tuple[type, ...]) -> bool:
    """Whether two orders hold the same classes (by identity: a metaclass may define ``==``)."""
    return len(these) == len(those) and all(a is b for a, b in zip(these, those, strict=True))


def _own_classes(mro: tuple[type, ...], locked: type) -> tuple[type, ...]:
    """The classes of ``mro`` that are neither ``locked`` nor one of its bases (Celery's)."""
    return tuple(k for k in mro if k not in locked.__mro__)


def _bases_after(cls: type, locked: type) -> tuple[list[type], int, list[type]]:
    """``cls``'s bases, the index of the first that brings ``locked``, and the bases listed
    after it that do not bring it themselves (``class T(LockedTask, Mixin)``'s ``Mixin``)."""
    bases = list(cls.__bases__)
    first = next(i for i, base in enumerate(bases) if locked in base.__mro__)
    return bases, first, [b for b in bases[first + 1 :] if locked not in b.__mro__]


def _listed_after(cls: type, locked: type) -> set[type]:
    """The classes brought by the bases :func:`_bases_after` finds listed after ``locked``'s."""
    _, _, after = _bases_after(cls, locked)
    # A later task base's classes after Task were behind Task.__call__ there too: never ran.
    return {
        k
        for b in after
        for k in (b.__mro__[: b.__mro__.index(Task)] if Task in b.__mro__ else b.__mro__)
    }


def _wraps_a_call(cls: type, locked: type, klass: type) -> bool:
    """Whether a plain class's ``__call__`` is written to wrap a task's call: it calls
    ``super().__call__`` or the body. A ``Protocol``'s stub, ``collections.abc.Callable``'s, or
    a callable config object's own ``__call__`` is not, and was never meant to run first."""
    mro = cls.__mro__
    reader = _Reader(cls, locked, before=(*mro[: mro.index(locked)], klass))
    found: list[tuple[str, str]] = []
    with contextlib.suppress(Exception):  # as in _Reader.bypass: what cannot be read is trusted
        for layer in _layers(klass.__dict__["__call__"]):
            reader.read = set()
            found += reader._layer(layer, via="")
    # Its own body call only (self.run): a .run of something it holds (a context's, a step's)
    # is no task's.
    return any(kind == _REACHES or what.startswith("self.") for what, kind in found)


def _compared(instructions: tuple[tuple[str, Any], ...], at: int) -> bool:
    """Whether what the instruction at ``at`` loads (``Task.__call__``) is only compared: a
    comparison (``is``, ``==``, ``in``) comes before anything that could call it, store it or
    hand it on (``Task.__call__ is self.__class__.__call__``, ``x in (Task.__call__, ...)``),
    and its result is not an argument of a call after it (``Task.__call__(self, a == b)``).
    Told so only where sure: anything else counts as a call."""
    following = [op for op, _ in instructions[at + 1 :] if op != "EXTENDED_ARG"]
    for index, op in enumerate(following):
        if op in _COMPARISONS:
            after = (op for op in following[index + 1 :] if not op.startswith("LOAD"))
            return not next(after, "").startswith(_CALLS)
        if op.startswith((*_CALLS, "STORE", "POP", "RETURN", "YIELD", "JUMP", "RAISE")):
            return False
    return False


def _no_task(value: Any) -> bool:
    """Whether ``value`` resolved to a module or to a class that is no task class, whose
    ``run`` is no task's body (``subprocess.run``, ``asyncio.run``)."""
    if issubclass(type(value), ModuleType):
        return True
    return _is_class(value) and not issubclass(value, Task)


def _readable(value: Any) -> Any:
    """``value`` where the reader reads it (a function, a static or class method's, a wrapt
    proxy), else ``None``: a task option's value (``self.name``, ``self.queue``), which each
    task class holds its own of, does not make a kept verdict read again."""
    if any(type(value) is kind for kind in (FunctionType, staticmethod, classmethod)):
        return value  # compared by identity: a foreign metaclass's == may raise
    if _is_wrapt(value):
        return value
    return None


def _is_wrapt(value: Any) -> bool:
    """Whether ``value`` is a wrapt proxy: its type derives from wrapt's, if wrapt was imported
    (wrapt 2 names its base ``BaseObjectProxy``, wrapt 1 ``ObjectProxy``)."""
    wrapt = sys.modules.get("wrapt")
    names = ("BaseObjectProxy", "ObjectProxy") if wrapt else ()
    bases: list[type] = [b for b in (getattr(wrapt, n, None) for n in names) if _is_class(b)]
    return any(issubclass(type(value), base) for base in bases)


def _resolve(classes: tuple[type, ...], name: str) -> Any:
    """What the first of ``classes`` that defines ``name`` holds there (``None``: none does)."""
    return next((k.__dict__[name] for k in classes if name in k.__dict__), None)


def _layers(call: Any) -> Iterator[Any]:
    """``call``, then each function it wraps in turn: the ``__wrapped__`` it holds itself
    (``functools.wraps``) or its type gives it (wrapt's proxies), never one a ``__getattr__``
    would make (a proxy's, which may load or finalize an app). Stops at a loop, and at what
    cannot be read."""
    seen: set[int] = {id(Task.__call__)}  # wraps(Task.__call__) copied its name only
    while id(call) not in seen:
        seen.add(id(call))
        yield call
        try:
            if type(call) is FunctionType:
                inner = call.__dict__.get("__wrapped__", _UNRESOLVED)
            elif _is_wrapt(call):
                # A wrapt proxy's, read on its type: another proxy's (werkzeug's LocalProxy,
                # lazy_object_proxy's) runs code of its own, a factory that may connect.
                inner = object.__getattribute__(call, "__wrapped__")  # no __getattr__ run
            else:
                return
        except Exception:  # whatever a foreign object raises: taken on trust
            return
        if inner is _UNRESOLVED:
            return
        call = inner


def _is_class(value: Any) -> TypeGuard[type]:
    """Whether ``value`` is a class, asked of its type: ``isinstance`` would ask a proxy's
    ``__class__``, which runs its code (a ``shared_task``'s finalizes its app)."""
    return issubclass(type(value), type)


def _attribute(value: Any, name: str) -> Any:
    """``value.<name>`` where ``value`` is a class or a module, without running any of its code
    (``inspect.getattr_static``); ``_UNRESOLVED`` for anything else (an instance may be a
    proxy), or what has no such attribute."""
    if value is _UNRESOLVED or not (_is_class(value) or issubclass(type(value), ModuleType)):
        return _UNRESOLVED
    return inspect.getattr_static(value, name, _UNRESOLVED)


@functools.lru_cache(maxsize=256)
def _instructions(code: CodeType) -> tuple[tuple[str, Any], ...]:
    """``code``'s instructions, as (name, argument): read once per function, however many task
    classes share the base that defines it."""
    return tuple((i.opname, i.argval) for i in dis.get_instructions(code))


def _order_that_runs(cls: type, hidden: list[type], locked: type) -> str:
    """How to list ``cls``'s bases so that each of ``hidden``'s ``__call__`` comes before
    ``locked``'s: each base listed after the first that brings ``locked`` and that brings one
    of ``hidden`` is moved before that one."""
    bases, first, after = _bases_after(cls, locked)
    moved = [b for b in after if any(h in b.__mro__ for h in hidden)]
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
