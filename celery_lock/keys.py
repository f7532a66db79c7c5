"""Request keys: how a task call names the work it does, and where its lease lives.

``lock_key`` on a task says how to derive the request key from the bound arguments:

* an argument name: ``lock_key="request_idx"``;
* a format template over the bound arguments: ``lock_key="{tenant}:{request_idx}"``, with
  literal text between any two fields (``"{tenant}{request_idx}"`` reads ``("a1", 23)`` and
  ``("a12", 3)`` alike, and is refused) and no field in a format spec (``"{tenant:>{width}}"``
  reads ``("x", 3)`` and ``("  x", 1)`` alike, and is refused too);
* a callable taking the task's ``*args, **kwargs`` and returning the key (``str``, ``bytes``,
  ``int``, or anything read as an argument is);
* ``None`` (default): a stable digest of the task name and all bound arguments.

An argument in a name or template key (or a value a template reaches through one:
``{order.id}``, ``{invoice[number]}``) reads as itself (a ``str``), its decimal digits (an
``int``), ``true``/``false``/``null`` (a ``bool`` or ``None``), its digest (``bytes``), its
canonical JSON (a ``dict``, ``list``, ``tuple`` or ``set``: equal values give one key, whatever
their order), what kombu's ``__json__`` hook returns (as the worker receives it), or its
``str()``. A key made of ``None`` alone is refused (every call missing the value would become
one request), and so is a value whose only text is its memory address.
A template joins its values with its own text; a value holding the first character of the
separator after it could read as another split (``{a}:{b}`` with ``("x:y", "z")`` and
``("x", "y:z")``), so such a call's key is a digest of the template's parts instead.

The Redis keys of one request share a hash tag, so every script runs on one Redis Cluster slot::

    <prefix>:{<scope>:<request key>}:lock
    <prefix>:{<scope>:<request key>}:fence
    <prefix>:{<scope>:<request key>}:done:<task name>

A request key that is long, binary or contains braces is replaced by a readable prefix and a
digest, so a key is always bounded and never breaks the hash tag; so is a scope holding ``:``,
which would read as another split of scope and request key.
"""

from __future__ import annotations

import datetime
import decimal
import difflib
import hashlib
import inspect
import json
import re
import string
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, NamedTuple

from .exceptions import LockKeyError

__all__ = [
    "MAX_KEY_LENGTH",
    "KeyDeriver",
    "RequestKeys",
    "digest_arguments",
    "safe_key_part",
    "scope_key_part",
    "stored_key_part",
]

#: Longest request key (or scope) kept as written; longer ones are digested.
MAX_KEY_LENGTH = 128
_READABLE_PREFIX = 40
_SAFE = re.compile(r"[A-Za-z0-9_.:@/+=-]*")
#: Hex digits of the digest :func:`safe_key_part` appends.
_DIGEST_HEX = 32
#: What :func:`safe_key_part` digests before a ``bytes`` part: a byte UTF-8 text never holds,
#: so no text has the digest of any bytes.
_BYTES_TAG = b"\xfe"
#: What a template key digests before its parts when a value holds the separator after it:
#: another byte UTF-8 text never holds, so no joined text and no bytes share its digests.
_SPLIT_TAG = b"\xfd"
#: What a template key holding a ``bytes`` value digests before it: which values are bytes,
#: then the key as it would be; a byte of its own, so no str-only call shares its digests.
_TYPED_TAG = b"\xfc"
#: What :func:`safe_key_part` returns for a part it digests.
_DIGESTED = re.compile(rf"{_SAFE.pattern}~[0-9a-f]{{{_DIGEST_HEX}}}")

LockKeySpec = str | Callable[..., Any] | None


#: The parts of a template field after its argument, as str.format reads them (``.attribute``
#: or ``[item]``), and a dunder name (``__class__``), which a template may not reach.
_FIELD_PARTS = re.compile(r"\.([^.\[]+)|\[([^\]]*)\]")
#: The parts after a field's argument as str.format accepts them: none empty, and nothing but
#: ``.`` or ``[`` after an item.
_WELL_FORMED_PARTS = re.compile(r"(?:\.[^.\[]+|\[[^\]]+\])*")
_DUNDER = re.compile(r"__\w+__")


def safe_key_part(raw: str | bytes) -> str:
    """Return ``raw`` if it is short and plain, else a readable prefix plus a digest.

    Plain means printable ASCII from a conservative set (no braces, no spaces, no control
    characters). The digest keeps distinct inputs distinct, and bytes apart from text: ``bytes``
    are always digested, with a tag of their own, so ``b"a b"`` and ``"a b"`` never share a key
    (as ``b"ab"`` and ``"ab"`` do not); the prefix keeps logs readable.
    """
    if isinstance(raw, str):
        if len(raw) <= MAX_KEY_LENGTH and _SAFE.fullmatch(raw):
            return raw
        return _digested(raw.encode("utf-8", "surrogatepass"), raw)
    return _digested(_BYTES_TAG + raw, raw.decode("ascii", "replace"))


def scope_key_part(scope: str) -> str:
    """A ``lock_scope`` (or a task name standing in for one) as the keys hold it: as
    :func:`safe_key_part` makes it, except that a scope holding ``:`` is always digested, with
    no ``:`` in its readable prefix. The scope is followed by ``:`` and the request key in the
    hash tag, so a ``:`` in it would let scope ``a:b`` with key ``c`` and scope ``a`` with key
    ``b:c`` read as one request; a scope as stored never holds one.
    """
    if ":" not in scope:
        return safe_key_part(scope)
    return _digested(scope.encode("utf-8", "surrogatepass"), scope.replace(":", ""))


def _digested(data: bytes, text: str) -> str:
    """``data``'s digest after a readable prefix of ``text``: the safe characters of its start."""
    readable = "".join(c for c in text[:_READABLE_PREFIX] if _SAFE.fullmatch(c))
    return f"{readable}~{hashlib.sha256(data).hexdigest()[:_DIGEST_HEX]}"


def stored_key_part(part: str) -> str:
    """``part`` as the keys hold it, for a name a person typed: :func:`safe_key_part`, unless
    ``part`` already is what it returns for a part it digests (``order42~<digest>``)."""
    return part if _DIGESTED.fullmatch(part) else safe_key_part(part)


#: The types Celery's JSON carries as ISO text, each read back as that type (never a subclass);
#: datetime before date, which it derives from.
_CLOCKS: tuple[Any, ...] = (datetime.datetime, datetime.date, datetime.time)


def _canonical(value: Any) -> Any:
    """A JSON-able form of ``value`` that is equal across processes for equal values.

    Besides bytes, sets and tuples, the types Celery's JSON serializer carries beyond JSON's
    own (a ``UUID``, a ``datetime``, ``date`` or ``time``, a ``Decimal``), each tagged.
    """
    if isinstance(value, bytes):
        return {"__bytes__": value.hex()}
    if isinstance(value, (set, frozenset)):
        # Each member as json.dumps writes it by default (keys already digested this way).
        return {"__set__": sorted(json.dumps(v, sort_keys=True, default=_canonical) for v in value)}
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, uuid.UUID):
        return {"__uuid__": str(value)}
    for kind in _CLOCKS:
        if isinstance(value, kind):
            # Tagged by the type Celery's JSON carries (a subclass, such as pendulum's or
            # freezegun's, arrives as a plain datetime), in that type's own ISO format.
            return {f"__{kind.__name__}__": kind.isoformat(value)}
    if isinstance(value, decimal.Decimal):
        return {"__decimal__": str(value)}
    raise TypeError(f"cannot derive a stable key from a {type(value).__name__}")


def _canonical_json(value: Any) -> str:
    """``value`` as JSON text that is equal across processes for equal values: keys sorted, sets
    ordered, tuples as the lists a worker receives.

    Keys are sorted as the text JSON writes them, never as numbers: the worker receives
    ``{2: .., 10: ..}`` as ``{"2": .., "10": ..}``, and "10" sorts before "2".

    Raises:
        TypeError, ValueError: ``value`` holds something JSON cannot stand for, holds itself,
            or is nested too deeply.
    """
    try:
        received = _as_received(value, escape_tags=True)
    except RecursionError as exc:
        raise ValueError("the value holds itself or is nested too deeply") from exc
    return json.dumps(received, sort_keys=True, default=_canonical, separators=(",", ":"))


#: Types a worker receives as they are sent: nothing in them to convert.
_AS_SENT = frozenset({str, int, float, bool, type(None), bytes})


#: The keys of the one-key objects :func:`_canonical` writes for a type JSON lacks
#: (``{"__bytes__": "6162"}``), and of the one that holds a dict of the caller's written alike.
_TAGS = frozenset(
    {"__bytes__", "__set__", "__uuid__", "__decimal__", "__dict__"}
    | {f"__{kind.__name__}__" for kind in _CLOCKS}
)


def _as_received(value: Any, escape_tags: bool = False) -> Any:
    """``value`` as a worker receives it after the message's JSON round trip, so that the
    caller and the worker derive a key from the same thing.

    A tuple becomes a list, a dict's keys the text JSON writes for them (``2`` -> ``"2"``), and
    a ``str``, ``int`` or ``float`` subclass (an enum member) its plain value, at any depth.
    Anything else (a set, a ``datetime``) is kept: the serializer carries it as it is, or the
    call cannot be sent at all.

    With ``escape_tags`` (for canonical JSON), a dict whose one key is one of :data:`_TAGS`
    is held in ``{"__dict__": ...}``: written as it is, the dict ``{"__bytes__": "6162"}``
    would read as ``b"ab"`` does, and two requests would have one key.
    """
    kind = type(value)
    if kind in _AS_SENT:  # the usual argument: checked first, as this runs for every task
        return value
    # Members already as sent are kept without a call: the default digest walks every argument.
    if isinstance(value, dict):
        received = {
            k if type(k) is str else _json_key(k): (
                v if type(v) in _AS_SENT else _as_received(v, escape_tags)
            )
            for k, v in value.items()
        }
        if escape_tags and len(received) == 1 and next(iter(received)) in _TAGS:
            return {"__dict__": received}
        if received.keys() == _KOMBU_ENVELOPE:
            decoded = _kombu_decoded(received)
            if decoded is not received:
                return _as_received(decoded, escape_tags)
        return received
    if isinstance(value, (list, tuple)):
        return [v if type(v) in _AS_SENT else _as_received(v, escape_tags) for v in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    reduced = _json_hook(value)
    if reduced is not _NO_HOOK:
        return _as_received(reduced, escape_tags)
    for clock in _CLOCKS:
        if isinstance(value, clock):
            if (
                type(value) is clock
                and getattr(value, "tzinfo", None) is None
                and not getattr(value, "fold", 0)
            ):
                return value
            # As Celery's JSON carries it, its ISO text read back: a plain datetime (not a
            # subclass), its zone a fixed UTC offset (``{when!r}``, ``{when:%Z}`` read alike),
            # without the fold of a wall time the clock repeats (``fromtimestamp`` gives it).
            return clock.fromisoformat(clock.isoformat(value))
    if isinstance(value, uuid.UUID) and type(value) is not uuid.UUID:
        return uuid.UUID(int=value.int)  # kombu's JSON sends its hex, read back as a UUID
    return value


#: The keys of the object kombu's JSON writes for a type JSON lacks (a Decimal, a UUID), and
#: reads back as that type wherever it finds them, in a dict of the caller's too.
_KOMBU_ENVELOPE = frozenset({"__type__", "__value__"})


def _kombu_decoded(envelope: dict[str, Any]) -> Any:
    """A dict of kombu's envelope's keys as a worker receives it through kombu's JSON: the
    type it names, where kombu knows that type (else kombu refuses the message, and the dict is
    kept, as another serializer carries it)."""
    try:
        from kombu.utils.json import object_hook  # noqa: PLC0415 - only for such a dict

        return object_hook(envelope)
    except (ImportError, ValueError, TypeError, decimal.InvalidOperation):
        return envelope


#: What :func:`_json_hook` returns for a value without the hook.
_NO_HOOK: Any = object()


def _json_hook(value: Any) -> Any:
    """What kombu's JSON sends for ``value`` by its ``__json__`` hook, or :data:`_NO_HOOK`.

    kombu asks the hook of any value JSON cannot write itself, before its own types (a
    ``datetime``): a pydantic model with the hook (which Celery leaves to it under
    ``pydantic=True``) or any object of the user's arrives as what the hook returns.

    Raises:
        TypeError: the hook raised (kombu's JSON would fail to send the value too).
    """
    hook = getattr(value, "__json__", None)
    if hook is None:
        return _NO_HOOK
    try:
        return hook()
    except Exception as exc:
        raise TypeError(f"{type(value).__name__}.__json__ raised {exc!r}") from exc


def _received_as_none(value: Any) -> bool:
    """Whether the worker receives ``value`` as ``None``: ``None`` itself, or an object kombu's
    JSON sends by a ``__json__`` hook that returns ``None`` (a "no value" sentinel), which the
    caller would otherwise key as ``null`` and the worker refuse as a key of ``None`` alone."""
    if value is None:
        return True
    if type(value) in _AS_SENT or isinstance(value, (dict, list, tuple)):
        return False  # the usual argument, and what no hook is asked for
    try:
        return _as_received(value) is None
    except (TypeError, RecursionError):
        return False  # the hook raised, or returns its object: rendering the key says so


def _json_key(key: Any) -> Any:
    """A dict key as the text JSON writes for it: ``2`` -> ``"2"``, ``2.0`` -> ``"2.0"``,
    ``True`` -> ``"true"``, ``None`` -> ``"null"``, a ``str`` enum member -> its value."""
    if type(key) is str:
        return key
    if isinstance(key, str):
        return str.__str__(key)
    if isinstance(key, (bool, int, float)) or key is None:
        return json.dumps(key)  # json.dumps writes a key as it writes the value
    return key  # not a key JSON can write: json.dumps raises TypeError for it


def _ordered_text(value: Any) -> str:
    """``repr(value)``, with the members of every set in it in one order in every process.

    A set's own repr lists its members in hash order, which follows the process's hash seed:
    two processes would key one request differently. Sets are reached through lists, tuples
    and dicts (and sets); an object's own repr is taken as it is.
    """
    if isinstance(value, (set, frozenset)):
        return _ordered_set_text(value)
    kind = type(value)
    if kind is list:
        return f"[{', '.join(map(_ordered_text, value))}]"
    if kind is tuple:
        members = ", ".join(map(_ordered_text, value))
        return f"({members},)" if len(value) == 1 else f"({members})"
    if kind is dict:
        items = ", ".join(f"{_ordered_text(k)}: {_ordered_text(v)}" for k, v in value.items())
        return f"{{{items}}}"
    return repr(value)


def _ordered_set_text(members: set[Any] | frozenset[Any]) -> str:
    """A set's repr (``{1, 2}``, ``frozenset({1, 2})``), its members ordered by their text."""
    if not members:
        return repr(members)  # set(), frozenset(): no order to fix
    listed = ", ".join(sorted(map(_ordered_text, members)))
    if type(members) is set:
        return f"{{{listed}}}"
    return f"{type(members).__name__}({{{listed}}})"


def digest_arguments(task_name: str, arguments: Mapping[str, Any]) -> str:
    """A stable digest of a task name and its bound arguments (the default request key)."""
    try:
        payload = _canonical_json([task_name, arguments])
    except (TypeError, ValueError) as exc:
        raise LockKeyError(
            f"the default lock_key needs JSON-like arguments ({exc}); set lock_key",
            task_name=task_name,
        ) from exc
    return "args~" + hashlib.sha256(payload.encode()).hexdigest()[:32]


#: Argument types that read as their canonical JSON in a name or template key: ``str()`` of
#: them would depend on dict insertion order and set iteration order (which changes with
#: the hash seed), and would tell a tuple at publish from the list the worker receives.
_CONTAINERS = (dict, list, tuple, set, frozenset)
#: Text that shows a memory address: the default ``repr`` of an object (``<Order object at
#: 0x7f..>``), a function's, a method's (``<built-in method lower of str object at 0x7f..>``,
#: what ``{tenant.lower}`` reaches). It differs in every process and for every copy received.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")


def _render(value: Any) -> str | bytes:
    """How an argument reads in a name or template key.

    Raises:
        TypeError: the value's only text is its memory address (every call would be a
            request of its own, silently).
    """
    kind: Any = type(value)
    if kind is str or kind is bytes:
        text: str | bytes = value
        return text
    if kind is int:  # the usual request id, before the checks below (not a bool)
        return str(value)
    if kind is bool or value is None:
        return json.dumps(value)
    # A subclass reads as the worker receives it, in JSON: a str enum as its value, an IntEnum
    # as its number. Its own __str__ (Kind.REFUND) would lock another key on a direct or eager
    # call than on the worker, and the two copies would not exclude each other.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bytes):
        return bytes(value)
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        return float.__repr__(value)
    if isinstance(value, dict) and value.keys() == _KOMBU_ENVELOPE:
        decoded = _kombu_decoded(value)
        if decoded is not value:  # a Decimal, a UUID, ... on a worker reading kombu's JSON
            return _render(_as_received(decoded))
    reduced = _NO_HOOK if isinstance(value, _CONTAINERS) else _json_hook(value)
    if reduced is not _NO_HOOK:
        # As the worker receives it: what the hook returns, read by this same table.
        try:
            return _render(_as_received(reduced))
        except RecursionError:
            raise TypeError("the value holds itself or is nested too deeply") from None
    if isinstance(value, _CONTAINERS):
        try:
            return _canonical_json(value)
        except (TypeError, ValueError):
            # What it read as before keys were canonical (its str()), with its sets ordered.
            try:
                text = _ordered_text(value)
            except RecursionError:
                raise TypeError("the value holds itself or is nested too deeply") from None
            if _ADDRESS.search(text):
                raise TypeError(f"{text[:60]} holds an object whose text is its address") from None
            return text
    if isinstance(value, _RECEIVED_AS_THEIR_BASE) and kind not in _RECEIVED_AS_THEIR_BASE:
        # A subclass's own __str__ is lost on the way: the worker keys the base type's text.
        return _render(_as_received(value))
    if kind.__str__ is object.__str__ and kind.__repr__ is object.__repr__:
        # Not "give it __str__", nor "reach a field of it": Celery's JSON serializer would then
        # refuse the object at publish.
        raise TypeError(
            f"an object of type {kind.__name__} has no text of its own: pass a JSON value, "
            f"such as its id"
        )
    return _named(str(value))


#: Types whose subclasses a worker receives as the type itself (see :func:`_as_received`).
_RECEIVED_AS_THEIR_BASE = (*_CLOCKS, uuid.UUID)


def _spec_fields(format_spec: str) -> list[str]:
    """The replacement fields in a template field's format spec (``{width}`` in
    ``{a:>{width}}``), which str.format fills before it formats the field; an escaped brace
    (``{{``) is literal text, and no field."""
    return [name for _, name, _, _ in string.Formatter().parse(format_spec) if name is not None]


def _named(text: str) -> str:
    """``text``, unless it shows a memory address (a method a template reached, an object
    without text of its own inside another's): a key of its own for every copy.

    Raises:
        TypeError: ``text`` shows a memory address.
    """
    if _ADDRESS.search(text):
        raise TypeError(f"{text[:60]} reads as a memory address, another in every process")
    return text


#: The kinds of parameter a call can fill by position and that have a name.
NAMED_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _check_takes_no_self(
    task_name: str, signature: inspect.Signature, function: Callable[..., Any]
) -> None:
    """Refuse a ``lock_key`` callable whose first parameter is ``self``: it gets the call's
    arguments only, so ``self`` would take the first of them, and every call would fail at
    publish with a ``TypeError`` that names an argument the call did pass.

    Raises:
        LockKeyError: the callable takes ``self`` first and the task's first parameter is not
            named ``self`` too.
    """
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return
    first = parameters[0] if parameters else None
    if first is None or first.name != "self" or first.kind not in NAMED_POSITIONAL:
        return
    if next(iter(signature.parameters), None) == "self":  # mirrors the task's own arguments
        return
    raise LockKeyError(
        f"lock_key callable {_describe(function)} takes self first, but it is called with the "
        f"call's arguments only, not the task: take self out (a @staticmethod, a function or "
        f"a lambda of the arguments)",
        task_name=task_name,
    )


def _describe(function: Callable[..., Any]) -> str:
    """A callable's name for an error message (``key_of``, ``<lambda>``)."""
    return getattr(function, "__qualname__", None) or repr(function)


class _Cut(NamedTuple):
    """A template of two fields or more, cut at its fields: what tells a call whose values
    could be read as another split of the joined text (:meth:`key`)."""

    #: The text before the first field.
    lead: str
    #: Each field alone, as the template writes it (``"{order.id!r:>8}"``).
    fields: tuple[str, ...]
    #: The text after each field: a separator, then after the last field the template's end.
    afters: tuple[str, ...]
    #: The first character of each separator, which a value before it must not hold.
    marks: tuple[str, ...]
    #: How often the marks occur in the template's own text.
    marks_in_text: int

    @classmethod
    def of(cls, template: str) -> _Cut:
        """``template`` (already checked by :meth:`KeyDeriver._parse_fields`) cut at its fields."""
        lead, fields, afters = "", list[str](), list[str]()
        for literal, template_field, format_spec, conversion in string.Formatter().parse(template):
            # A literal text comes back unescaped ("{{" as "{"), maybe in several runs: it is
            # joined, not formatted.
            if afters:
                afters[-1] += literal
            else:
                lead += literal
            if template_field is not None:
                alone = template_field + (f"!{conversion}" if conversion else "")
                fields.append("{" + alone + (f":{format_spec}" if format_spec else "") + "}")
                afters.append("")
        # Every literal between two fields is non-empty: "{a}{b}" is refused.
        marks = tuple(sorted({after[0] for after in afters[:-1]}))
        literal_text = lead + "".join(afters)
        marks_in_text = sum(map(literal_text.count, marks))
        return cls(lead, tuple(fields), tuple(afters), marks, marks_in_text)

    def marks_in(self, text: str) -> int:
        """How often the marks occur in ``text``."""
        if len(self.marks) == 1:  # one count, not a sum over a map: this runs for every task
            return text.count(self.marks[0])
        return sum(map(text.count, self.marks))

    def key(self, joined: str, rendered: Mapping[str, Any]) -> str:
        """The request key of a call whose text ``joined`` holds a mark more often than the
        template's own text does (else it is ``safe_key_part(joined)``, without this call).

        The fields are joined by the template's own text, which a value may hold too:
        ``"{tenant}:{order_id}"`` would join ``("acme:eu", 1)`` and ``("acme", "eu:1")`` alike,
        and the second request would be skipped as a duplicate of the first. Each field's text
        is read up to the first character of the separator after it, so only a value holding
        that character is ambiguous; then the key is a digest of the template's parts, a
        domain of its own (:data:`_SPLIT_TAG`), with the joined text as its readable prefix.
        Values without it (a datetime's ``:`` in the last field, say) join as before.
        """
        texts = [alone.format_map(rendered) for alone in self.fields]
        if not any(after[0] in text for text, after in zip(texts, self.afters[:-1], strict=False)):
            return safe_key_part(joined)
        parts = [self.lead]
        for text, after in zip(texts, self.afters, strict=True):
            parts += (text, after)
        data = json.dumps(parts, ensure_ascii=False).encode("utf-8", "surrogatepass")
        return _digested(_SPLIT_TAG + data, joined)


#: What a ``lock_key`` meant as one request whatever the arguments adds to its error.
_ONE_REQUEST_HINT = (
    "; for one request whatever the arguments, write a template of literal text alone, such "
    "as '{{global}}' (its key is the text '{global}')"
)


def _plain_name_hint(spec: str, parameters: list[str]) -> str:
    """What a ``lock_key`` naming no argument of the task adds to its error: the argument it
    may have meant (a typo), a template reaching into one (``"order.id"``), or, for a name
    unlike any argument, how to write one request whatever the arguments (celery-once's
    ``keys=[]``). Never the last for a likely typo: it would turn a lock per request into one."""
    root = re.split(r"[.\[]", spec, maxsplit=1)[0]
    if root != spec and root in parameters:
        return f"; to reach into an argument, write a template: {'{' + spec + '}'!r}"
    close = difflib.get_close_matches(spec.strip(), parameters, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    return _ONE_REQUEST_HINT if spec.isidentifier() or not spec else ""


def _escaped_field(name: str) -> re.Pattern[str]:
    """``{{name}}`` as a template escapes it, with any attribute, item, conversion or spec
    (``{{order.id}}``, ``{{ idx!r }}``): the literal text of what was meant as a field."""
    return re.compile(r"\{\{\s*" + re.escape(name) + r"(?=[\s.\[!:}])[^{}]*\}\}")


@dataclass(frozen=True)
class KeyDeriver:
    """Derives the request key of one task from the arguments of a call."""

    task_name: str
    signature: inspect.Signature
    spec: LockKeySpec
    # Worked out once: the template's field names, and the parameter names when every
    # parameter is an ordinary one (positional or keyword), for binding without Signature.bind.
    _fields: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _plain_names: tuple[str, ...] | None = field(init=False, repr=False, compare=False)
    #: Whether the template reaches into an argument (``{order.id}``, ``{inv[number]}``).
    _sub_fields: bool = field(init=False, repr=False, compare=False)
    #: A template of two fields or more, cut at its fields (see :meth:`_Cut.key`); ``None`` for
    #: other specs.
    _cut_template: _Cut | None = field(init=False, repr=False, compare=False)
    #: For a key that is one argument's name (``lock_key="request_idx"``) among parameters that
    #: are all ordinary ones: that argument's position, for a call that passes every argument
    #: by position (see :meth:`request_key`); else ``None``.
    _name_position: int | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parameters = self.signature.parameters.values()
        plain = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters)
        names = tuple(self.signature.parameters) if plain else None
        object.__setattr__(self, "_plain_names", names)
        fields = self._parse_fields()
        object.__setattr__(self, "_fields", tuple(name for name, _ in fields))
        object.__setattr__(self, "_sub_fields", any(whole != name for name, whole in fields))
        cut = _Cut.of(self.spec) if isinstance(self.spec, str) and len(fields) > 1 else None
        object.__setattr__(self, "_cut_template", cut)
        spec = self.spec
        position = (
            names.index(spec)
            if isinstance(spec, str) and "{" not in spec and names is not None and spec in names
            else None
        )
        object.__setattr__(self, "_name_position", position)

    @classmethod
    def create(cls, task_name: str, signature: inspect.Signature, spec: LockKeySpec) -> KeyDeriver:
        """Check ``spec`` against the task's parameters and return the deriver.

        Raises:
            LockKeyError: ``spec`` names an argument (or template field) the task does not have,
                or the ``**kwargs`` parameter itself; the template is malformed, joins two
                fields with nothing between them, or takes a format spec from a field.
        """
        deriver = cls(task_name, signature, spec)
        if isinstance(spec, str):
            missing = [name for name in deriver.fields() if name not in signature.parameters]
            var_keyword = next(
                (p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None
            )
            if var_keyword is not None and var_keyword in deriver.fields():
                # Binding spreads **kwargs into the arguments it holds: its own name is never
                # among them, so every call would fail at publish.
                raise LockKeyError(
                    f"lock_key {spec!r} names the **{var_keyword} parameter itself; name one "
                    f"of the keyword arguments it collects instead",
                    task_name=task_name,
                )
            if missing and var_keyword is None:
                hint = "" if "{" in spec else _plain_name_hint(spec, list(signature.parameters))
                raise LockKeyError(
                    f"lock_key {spec!r} names {', '.join(map(repr, missing))}, which is not an "
                    f"argument of {task_name}{signature}{hint}",
                    task_name=task_name,
                )
        elif callable(spec):
            _check_takes_no_self(task_name, signature, spec)
        elif spec is not None:
            # A list of names, as celery-once's keys=[...] and celery-singleton's unique_on=[...]
            # take them: what a template of those names would key.
            names = list(spec) if isinstance(spec, (list, tuple)) else []
            hint = ""
            if isinstance(spec, (list, tuple)) and not names:  # celery-once's keys=[]
                hint = _ONE_REQUEST_HINT
            elif names and all(isinstance(name, str) and name.isidentifier() for name in names):
                template = ":".join("{" + name + "}" for name in names)
                hint = f": write {names[0] if len(names) == 1 else template!r} instead"
            raise LockKeyError(
                f"lock_key must be an argument name, a template or a callable, "
                f"not {type(spec).__name__}{hint}",
                task_name=task_name,
            )
        return deriver

    def fields(self) -> list[str]:
        """The argument names a string ``lock_key`` refers to."""
        return list(self._fields)

    def _parse_fields(self) -> list[tuple[str, str]]:
        """Each field of a string ``lock_key``: the argument it names, and the field whole."""
        if not isinstance(self.spec, str):
            return []
        if "{" not in self.spec:
            return [(self.spec, self.spec)]
        try:
            parsed = list(string.Formatter().parse(self.spec))
        except ValueError as exc:
            raise LockKeyError(
                f"lock_key template {self.spec!r} is malformed: {exc}", task_name=self.task_name
            ) from exc
        names = []
        previous: str | None = None  # the field before, while no literal text has followed it
        for literal, template_field, format_spec, conversion in parsed:
            if literal:
                previous = None
            if template_field is None:
                continue
            if conversion not in (None, "r", "s", "a"):
                raise LockKeyError(
                    f"lock_key template {self.spec!r} is malformed: unknown conversion "
                    f"!{conversion} (use !s, !r or !a)",
                    task_name=self.task_name,
                )
            root = re.split(r"[.\[]", template_field, maxsplit=1)[0]
            if not root or root.isdigit():
                raise LockKeyError(
                    f"lock_key template {self.spec!r} must name its fields ({{name}})",
                    task_name=self.task_name,
                )
            if not _WELL_FORMED_PARTS.fullmatch(template_field[len(root) :]):
                # "{a.}", "{a[]}", "{a[0]b}": str.format refuses them only as it formats.
                raise LockKeyError(
                    f"lock_key template {self.spec!r} is malformed: an empty or misplaced "
                    f"attribute or item in {{{template_field}}}",
                    task_name=self.task_name,
                )
            if format_spec and _spec_fields(format_spec):
                # "{a:>{width}}": str.format fills the spec from another field, so ("x", 3) and
                # ("  x", 1) read alike, and a field only the spec names fails at publish.
                raise LockKeyError(
                    f"lock_key template {self.spec!r} takes the format spec of "
                    f"{{{template_field}}} from a field ({format_spec!r}): a key must not depend "
                    f"on a width or spec read from an argument; write the spec out, such as "
                    f"'{{{template_field}:>8}}'",
                    task_name=self.task_name,
                )
            # The attributes the field reaches through (".name"), not its items ("[a.__b]").
            reached = _FIELD_PARTS.findall(template_field[len(root) :])
            if any(_DUNDER.fullmatch(attribute) for attribute, _ in reached):
                # {order.__class__}, {order.__init__}: Python's own attributes, which read as
                # a class or an address (a request of its own per call), never as a value.
                raise LockKeyError(
                    f"lock_key template {self.spec!r} reaches a dunder attribute in "
                    f"{{{template_field}}}: name the value's own attribute or item",
                    task_name=self.task_name,
                )
            if previous is not None:
                # "{a}{b}" reads a="1", b="23" and a="12", b="3" alike, as "123": two requests
                # with one key, and the second skipped as a duplicate of the first. Checked
                # after the field's own checks, which the separator asked for would not mend.
                raise LockKeyError(
                    f"lock_key template {self.spec!r} joins {{{previous}}} and "
                    f"{{{template_field}}} with nothing between them, so different values can "
                    f"read alike ('1' + '23', '12' + '3'): add a separator, such as "
                    f"'{{{previous}}}:{{{template_field}}}'",
                    task_name=self.task_name,
                )
            previous = template_field
            names.append((root, template_field))
        escaped = (n for n in self.signature.parameters if _escaped_field(n).search(self.spec))
        if not names and (argument := next(escaped, None)) is not None:
            # "{{request_idx}}" (as Jinja writes a field) is the literal text "{request_idx}":
            # every call would be one request, and all but the first skipped as its duplicates.
            # A template of other text alone ("{{global}}") is one request on purpose.
            raise LockKeyError(
                f"lock_key template {self.spec!r} names no argument ('{{{{' and '}}}}' are "
                f"literal braces): write the field as '{{{argument}}}'",
                task_name=self.task_name,
            )
        return names

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Bind a call's arguments to the task's parameters, defaults applied."""
        names = self._plain_names
        if names is not None and len(args) + len(kwargs) == len(names):
            # Every parameter given, all by position or all by name: what Signature.bind would
            # return, at a sixth of its cost (this runs for every task).
            if not kwargs:
                return dict(zip(names, args, strict=True))
            if not args and kwargs.keys() == set(names):
                return dict(kwargs)
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            hint = ""
            if next(iter(self.signature.parameters), None) == "self":
                hint = " (the task's first parameter is named self: was bind=True forgotten?)"
            raise LockKeyError(
                f"cannot derive the request key: {exc}{hint}", task_name=self.task_name
            ) from exc
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for param in self.signature.parameters.values():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                collected = arguments.pop(param.name, {})
                clash = sorted(collected.keys() & arguments.keys())
                if clash:
                    # f(1, args=2) binds *args to (1,) and collects args=2: merged, one would
                    # replace the other, and f(1, args=2), f(3, args=2) would be one request.
                    raise LockKeyError(
                        f"cannot derive the request key: keyword argument(s) "
                        f"{', '.join(map(repr, clash))} collected by **{param.name} have the "
                        f"name of a *args or positional-only parameter",
                        task_name=self.task_name,
                    )
                arguments.update(collected)
        return arguments

    def request_key(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The request key of one call, always bounded and free of hash-tag braces.

        Raises:
            LockKeyError: the call lacks an argument the key is made of, passes ``None`` for
                every one of them, or one whose only text is its memory address; a callable
                ``lock_key`` raised, or returned ``None`` or such an object.
        """
        spec = self.spec
        position = self._name_position
        if position is not None and not kwargs and len(args) == len(self._plain_names or ()):
            # The usual call (lock_key="request_idx", every argument passed by position) and the
            # usual values, keyed as the steps below key them, without binding the arguments:
            # an int is its digits and never None, a str is itself (safe_key_part makes both
            # safe: digits and "-" are safe as they are up to MAX_KEY_LENGTH).
            value = args[position]
            kind = type(value)
            if kind is str:
                return safe_key_part(value)
            if kind is int:
                try:
                    text = str(value)
                except ValueError:
                    # More digits than Python writes (sys.set_int_max_str_digits): the steps
                    # below raise it as the LockKeyError it is.
                    pass
                else:
                    return text if len(text) <= MAX_KEY_LENGTH else safe_key_part(text)
        if callable(spec):
            return safe_key_part(self._call_key_function(spec, args, kwargs))
        arguments = self.bind(args, kwargs)
        if spec is None:
            return digest_arguments(self.task_name, arguments)
        fields = self._fields
        for name in fields:  # a loop, not a comprehension's frame of its own, on every task
            if name not in arguments:
                missing = [name for name in fields if name not in arguments]
                raise LockKeyError(
                    f"the call has no argument {', '.join(map(repr, missing))} for lock_key "
                    f"{spec!r}",
                    task_name=self.task_name,
                )
        # The first field first, without a generator: this runs for every task.
        if (
            fields
            and _received_as_none(arguments[fields[0]])
            and all(_received_as_none(arguments[name]) for name in fields[1:])
        ):
            # The key would be one fixed text: every call lacking the value would be one
            # request, skipped as done for a day once the first succeeds. (In a template with
            # another field, None reads as null: an optional part of a key that varies.)
            raise LockKeyError(
                f"lock_key {spec!r} cannot be made of None alone, which the call passes for "
                f"{', '.join(map(repr, fields))}",
                task_name=self.task_name,
            )
        if "{" not in spec:
            try:
                return safe_key_part(_render(arguments[spec]))
            except (TypeError, ValueError) as exc:
                raise LockKeyError(
                    f"cannot render lock_key {spec!r} from the call's arguments: {exc}",
                    task_name=self.task_name,
                ) from exc
        # Values reached through sub-fields are checked for None-alone as they are formatted.
        leaves: list[Any] | None = [] if self._sub_fields else None
        try:
            rendered = {name: _KeyField(arguments[name], leaves) for name in self._fields}
            text = spec.format_map(rendered)
            cut = self._cut_template
            if cut is not None and cut.marks_in(text) != cut.marks_in_text:
                # A value holds a separator's first character: its split may be another's.
                key = cut.key(text, rendered)
            else:
                key = safe_key_part(text)
        except (
            AttributeError,
            IndexError,
            KeyError,
            TypeError,
            ValueError,
            RecursionError,  # !r of a value that holds itself, or is nested too deeply
        ) as exc:
            raise LockKeyError(
                f"cannot render lock_key {spec!r} from the call's arguments: {exc!r}",
                task_name=self.task_name,
            ) from exc
        if leaves and all(leaf is None for leaf in leaves):
            raise LockKeyError(
                f"lock_key {spec!r} cannot be made of None alone: every value it reaches in "
                f"the call is None",
                task_name=self.task_name,
            )
        if "~" in text:  # a bytes value's digest is in it, or a str's "~" (then digested too)
            return self._bytes_kept_apart(spec, arguments, key)
        return key

    def _bytes_kept_apart(self, spec: str, arguments: Mapping[str, Any], key: str) -> str:
        """``key``, the key of a template call, unless a value it holds is ``bytes``: then a
        digest of ``key`` and of which values are bytes (:data:`_TYPED_TAG`).

        A ``bytes`` value is put in as its digest, ``safe_key_part(value)``, which a ``str``
        value can spell too: ``"acme:{blob}"`` would key ``b"x"`` and the text of its digest
        alike, and one request would be skipped as a duplicate of the other.
        """
        leaves: list[Any] = []
        spec.format_map({name: _KeyField(arguments[name], leaves) for name in self._fields})
        kinds = "".join("b" if isinstance(leaf, bytes) else "s" for leaf in leaves)
        if "b" not in kinds:
            return key
        return _digested(_TYPED_TAG + f"{kinds}\0{key}".encode(), key)

    def _call_key_function(
        self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> str | bytes:
        """What a callable ``lock_key`` returns for a call, checked to be a request key."""
        # As the worker receives them, at the caller too (a tuple as a list, a str enum member
        # as its value): a callable that reads what only the caller's objects have
        # (``kind.value``) fails here, at publish, not on the worker for every copy; and a
        # direct or eager call keys the request as the worker does.
        try:
            received = _as_received(list(args))
            received_kwargs = _as_received(dict(kwargs))
        except RecursionError as exc:
            raise LockKeyError(
                "cannot derive the request key: an argument holds itself or is nested too deeply",
                task_name=self.task_name,
            ) from exc
        except TypeError as exc:  # a __json__ hook raised
            raise LockKeyError(
                f"cannot derive the request key: {exc}", task_name=self.task_name
            ) from exc
        try:
            key = function(*received, **received_kwargs)
        except Exception as exc:
            raise LockKeyError(
                f"lock_key callable {_describe(function)} raised {exc!r}", task_name=self.task_name
            ) from exc
        # None would turn every call into one request ("null"), an object without text of its
        # own each call into a request of its own (a memory address): both silently.
        try:
            if key is None:
                raise TypeError("None is no request key")
            return _render(key)
        except (TypeError, ValueError) as exc:  # ValueError: an int past str()'s digit limit
            raise LockKeyError(
                f"lock_key callable {_describe(function)} returned no usable key: {exc}",
                task_name=self.task_name,
            ) from exc


class _KeyField:
    """Formats a bound argument, or a value reached through it (``{order.id}``,
    ``{inv[number]}``), the way a bare ``lock_key`` renders it.

    It holds every value as the worker receives it (:func:`_as_received`), at the caller too:
    ``!r``, ``!a`` and format specs read a tuple as a list and a ``str`` enum member as its
    value, and a sub-field only the caller's object has (``{kind.value}`` of an enum member)
    fails at publish rather than on the worker, unrun.

    ``leaves``, when given, collects every value formatted, for the None-alone check of a
    template with sub-fields. The slots are name-mangled so that no sub-field a template may
    name (``{order.value}``) finds them instead of the argument's own attribute.
    """

    __slots__ = ("__leaves", "__value")

    def __init__(self, value: Any, leaves: list[Any] | None = None) -> None:
        self.__value = _as_received(value)
        self.__leaves = leaves

    def __format__(self, format_spec: str) -> str:
        if self.__leaves is not None:
            self.__leaves.append(self.__value)
        if format_spec:
            return format(self.__value, format_spec)
        rendered = _render(self.__value)
        # Bytes are digested, as a bytes key is: their hex would read as the hex string.
        return safe_key_part(rendered) if isinstance(rendered, bytes) else rendered

    def __str__(self) -> str:  # ``{name!s}``: as ``{name}``, never the object's address
        return self.__format__("")

    def __repr__(self) -> str:  # ``{name!r}``, ``{name!a}`` (ascii() escapes this repr)
        if self.__leaves is not None:
            self.__leaves.append(self.__value)
        text = _ordered_text(self.__value)  # sets ordered alike in every process
        # A str, bytes or number is its own text; anything else must not show an address.
        return text if type(self.__value) in _AS_SENT else _named(text)

    def __getattr__(self, name: str) -> Any:
        return _KeyField(getattr(self.__value, name), self.__leaves)

    def __getitem__(self, item: Any) -> Any:
        if isinstance(self.__value, Mapping) and not isinstance(item, str):
            # str.format looks "{totals[2]}" up as the int 2; the dict, as received, has the
            # text JSON writes for it, "2".
            item = _json_key(item)
        return _KeyField(self.__value[item], self.__leaves)


class RefusedKeyDeriver(KeyDeriver):
    """The deriver of a task whose lock options were refused as it bound to its app (a
    ``task_annotations`` entry giving a ``lock_key`` its arguments lack): every call raises
    that error again. Celery marks the app finalized before it binds the tasks, so a process
    that caught the error once would otherwise publish every later call keyed by the
    ``lock_key`` the annotation replaced, which no worker of the app (refusing to start) shares.
    """

    _error: Exception

    def __init__(self, task_name: str, signature: inspect.Signature, error: Exception) -> None:
        super().__init__(task_name, signature, None)
        object.__setattr__(self, "_error", error)

    def request_key(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """Raise the error the task's lock options were refused with."""
        raise self._error


@dataclass(frozen=True)
class RequestKeys:
    """The Redis keys of one request in one scope, sharing one hash tag."""

    lock: str
    fence: str
    done: str

    def __init__(self, lock: str, fence: str, done: str) -> None:
        # What the frozen dataclass's own __init__ does (one object.__setattr__ per field),
        # written into the instance's dict at once: one is made per task.
        self.__dict__.update(lock=lock, fence=fence, done=done)

    @classmethod
    def build(cls, prefix: str, scope: str, request_key: str, task_name: str) -> RequestKeys:
        """Lay out the keys: ``<prefix>:{<scope>:<request key>}:lock`` and its siblings."""
        head, done = _layout(prefix, scope, task_name)
        tag = f"{head}{request_key}}}"
        # Lock, fence, done, by position: made per task, and a class called with keywords
        # builds a dict of them (1,600 instructions).
        return cls(f"{tag}:lock", f"{tag}:fence", f"{tag}{done}")

    @classmethod
    def of_lock(cls, lock_key: str, task_name: str) -> RequestKeys:
        """The keys of the request whose lock key is ``lock_key`` (as a skip marker or a log
        names it), with ``task_name``'s done-marker."""
        tag = lock_key.removesuffix(":lock")
        return cls(lock=lock_key, fence=f"{tag}:fence", done=f"{tag}{_done_suffix(task_name)}")


@lru_cache(maxsize=1024)
def _layout(prefix: str, scope: str, task_name: str) -> tuple[str, str]:
    """What the keys of every request of one task share: ``"<prefix>:{<scope>:"`` and
    ``":done:<task name>"`` (made safe once, not per task)."""
    return f"{prefix}:{{{scope_key_part(scope)}:", _done_suffix(task_name)


def _done_suffix(task_name: str) -> str:
    return f":done:{safe_key_part(task_name)}"
