"""One request's lease, and the outcomes of asking for it.

A grant is a :class:`Lease` (token, fence, TTL, holder); the other outcomes are values too:
:class:`Held` (someone else holds it) and :class:`Done` (the request was completed, or handed on
by ``self.replace(sig)``). :class:`~celery_lock.store.LockStore` produces them from the script
replies.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from json.encoder import encode_basestring_ascii as _json_string
from time import monotonic as _monotonic
from typing import TYPE_CHECKING

from .keys import RequestKeys

if TYPE_CHECKING:
    from .store import LockStore

__all__ = [
    "HANDED_ON",
    "HANDING_ON",
    "Acquired",
    "Done",
    "HandOn",
    "Held",
    "Holder",
    "Lease",
    "LockEntry",
    "Outcome",
    "decode_done",
    "decode_id",
    "decode_lock",
    "encode_done",
    "encode_id",
    "encode_lock",
    "new_token",
]

logger = logging.getLogger(__name__)
#: Makes :meth:`Lease.mark_lost` once-only across threads; taken only when a lease is lost, not
#: per task (a lock per lease would cost every task).
_LOSS_GUARD = threading.Lock()


def new_token() -> str:
    """An unguessable owner token: 128 bits from the OS's CSPRNG, as :mod:`secrets` draws
    them (so two processes forked from one parent never draw the same tokens)."""
    # What secrets.token_hex(16) returns, without its three Python calls on every task
    # (bench.cachegrind: some 90 first-level cache misses per task).
    return os.urandom(16).hex()


@dataclass(frozen=True)
class Holder:
    """Who asks for a lease: written into the lock so others can see who holds it."""

    task_id: str
    task_name: str
    host: str
    pid: int

    def __init__(self, task_id: str, task_name: str, host: str, pid: int) -> None:
        # What the frozen dataclass's own __init__ does (one object.__setattr__ per field),
        # written into the instance's dict at once: one is made per task.
        self.__dict__.update(task_id=task_id, task_name=task_name, host=host, pid=pid)

    def describe(self, since_ms: int) -> str:
        """The holder as the lock records it: JSON, read by Python only (``celery lock``, a
        copy that finds the lease held)."""
        # What json.dumps would write for {"task_id", "task", "host", "pid", "since"}, with
        # the part that is the same for every task of a process encoded once.
        return (
            f'{{"task_id": {_json_string(self.task_id)}, '
            f"{_holder_fields(self.task_name, self.host, self.pid)}, "
            f'"since": {int(since_ms)}}}'
        )


@lru_cache(maxsize=1024)
def _holder_fields(task_name: str, host: str, pid: int) -> str:
    return json.dumps({"task": task_name, "host": host, "pid": pid})[1:-1]


@dataclass(frozen=True)
class LockEntry:
    """A lock as stored in Redis, without its token: who holds it, with which fence."""

    fence: int
    holder: Holder
    #: When the lease was granted, ms since the epoch by the acquiring worker's clock.
    since_ms: int


def encode_lock(token: str, fence: int, holder: Holder, since_ms: int) -> str:
    """The lock's value: ``"<token> <fence> <holder JSON>"``, as the acquire script writes it
    (token first: the scripts compare it by prefix; fence second: they read it as a number)."""
    return f"{token} {fence} {holder.describe(since_ms)}"


def decode_lock(value: str | bytes, *, with_token: bool = True) -> LockEntry:
    """Parse a lock's value (or, ``with_token=False``, the ``"<fence> <holder>"`` rest of it that
    the acquire script returns for a held lease).

    Raises:
        ValueError: the value is not a lock celery-lock wrote.
    """
    text = value.decode() if isinstance(value, bytes) else value
    if with_token:
        text = text.partition(" ")[2]
    fence, _, described = text.partition(" ")
    try:
        fields = json.loads(described)
        if not isinstance(fields, dict):
            raise ValueError(f"not a lock: {text[:60]!r}")
        holder = Holder(
            task_id=str(fields["task_id"]),
            task_name=str(fields["task"]),
            host=str(fields.get("host", "")),
            pid=int(fields.get("pid", 0)),
        )
        return LockEntry(fence=int(fence), holder=holder, since_ms=int(fields.get("since", 0)))
    except (OverflowError, RecursionError) as exc:
        # A number no int holds (1e999 reads as inf), JSON nested past the parser's depth:
        # not a lock celery-lock wrote either.
        raise ValueError(f"not a lock: {text[:60]!r}") from exc


@dataclass(frozen=True)
class Acquired:
    """The lease was granted; ``fence`` is strictly greater than every earlier grant's."""

    fence: int

    def __init__(self, fence: int) -> None:
        self.__dict__["fence"] = fence  # as the frozen dataclass's __init__, without its call


@dataclass(frozen=True)
class Held:
    """Another acquisition holds the lease."""

    task_id: str
    task_name: str
    pttl_ms: int


@dataclass(frozen=True)
class Done:
    """The request was completed by task ``task_id`` and is remembered as done; or, with
    ``handed_on_at``, task ``task_id`` handed it on with ``self.replace(sig)``."""

    task_id: str
    #: The replacement depth (Celery's ``replaced_task_nesting``) of the run that handed the
    #: request on; ``None``: a run completed it. Only a message of the same canvas (root id) at
    #: a greater depth, sent by the replacement, runs the task on the request again.
    handed_on_at: int | None = None
    #: For a hand-on marker: the root task id of its canvas.
    root_id: str = ""
    #: For a hand-on marker: whether its replacement is known to have been sent. ``False`` for
    #: the marker the release writes before sending it: a run killed in between sent nothing,
    #: and the redelivery of its message must run the request again.
    sent: bool = True


@dataclass(frozen=True)
class HandOn:
    """How a run hands its request on with ``self.replace(sig)``: at replacement ``depth``
    (Celery's ``replaced_task_nesting``), in the canvas of ``root_id`` (the root task id, which
    the replacement and every step of it carry)."""

    depth: int
    root_id: str
    #: Whether the replacement went out: the release writes the marker before it is sent
    #: (``HANDING_ON``), and the marker becomes ``HANDED_ON`` once it was.
    sent: bool = False


#: How a hand-on marker starts. Its fields are separated by the same byte, 0xFF, which no UTF-8
#: text holds: no task id reads as a hand-on marker, and no id splits one.
HANDED_ON = b"\xffhanded-on:"
#: How a hand-on marker starts until its replacement was sent.
HANDING_ON = b"\xffhanding-on:"


def encode_id(task_id: str) -> bytes:
    """A task id (or root id) as the lock store is sent it: UTF-8, where a lone surrogate, which
    a message may carry (JSON's ``"\\udcff"``, a client's key used as the task id), is written
    as its three bytes (``surrogatepass``) rather than refused after the body ran.

    Not ``surrogateescape``: its ``"\\udcff"`` would be the byte 0xFF, which starts and splits
    a hand-on marker. No encoding of a str as UTF-8, surrogates and all, holds that byte."""
    return task_id.encode("utf-8", "surrogatepass")


def decode_id(data: bytes) -> str:
    """A task id (or root id) as :func:`encode_id` wrote it; bytes that no str encodes to
    (not written by celery-lock) are read with U+FFFD in their place."""
    try:
        return data.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return data.decode(errors="replace")


def encode_done(task_id: str, hand_on: HandOn | None = None) -> bytes:
    """A done-marker's value: the task id of the run that completed the request, or, for a run
    that handed it on, ``HANDED_ON + b"<depth>\\xff<root id>\\xff<task id>"`` (``HANDING_ON``
    first until the replacement was sent); the ids as :func:`encode_id` writes them."""
    if hand_on is None:
        return encode_id(task_id)
    root, task = encode_id(hand_on.root_id), encode_id(task_id)
    prefix = HANDED_ON if hand_on.sent else HANDING_ON
    return prefix + b"%d\xff%s\xff%s" % (hand_on.depth, root, task)


def decode_done(value: str | bytes) -> Done:
    """Parse a done-marker's value (see :func:`encode_done`); text that is not a hand-on
    marker is the id of the task that completed the request."""
    data = encode_id(value) if isinstance(value, str) else value
    for prefix in (HANDED_ON, HANDING_ON):
        if data.startswith(prefix):
            fields = data[len(prefix) :].split(b"\xff")
            if len(fields) == 3 and fields[0].isdigit():
                depth, root, task = fields
                return Done(
                    decode_id(task), handed_on_at=int(depth),
                    root_id=decode_id(root), sent=prefix == HANDED_ON,
                )  # fmt: skip
    return Done(decode_id(data))


Outcome = Acquired | Held | Done


@dataclass(eq=False)
class Lease:
    """A granted lease, as the process that holds it sees it."""

    store: LockStore
    keys: RequestKeys
    token: str
    ttl_ms: int
    fence: int
    holder: Holder
    #: How long the heartbeat keeps the fence counter alive, at least, each time it extends the
    #: lease (milliseconds; 0: it leaves the counter alone).
    fence_ttl_ms: int = 0
    #: Called once, from a heartbeat thread, when the lease is found lost.
    on_lost: Callable[[Lease], None] | None = None
    #: When the lease was last known to be ours (monotonic seconds).
    confirmed_at: float = field(default_factory=_monotonic)
    # A plain flag (set once, by the heartbeat thread): a threading.Event per lease cost
    # each task a lock and a condition that nobody waits on.
    _lost: bool = field(default=False, repr=False)
    #: Set by the task that releases it, once (a replaced body releases before it ends).
    released: bool = field(default=False, repr=False)
    #: Set when the body published its retry (:meth:`celery_lock.LockedTask.retry`): the run
    #: is not the request's last, so its release writes no done-marker.
    retry_sent: bool = field(default=False, repr=False)
    #: Set when the body hands the request on (``self.replace(sig)``): a successful release
    #: then writes a hand-on marker (see :class:`Done`).
    handed_on: HandOn | None = field(default=None, repr=False)

    @property
    def lost(self) -> bool:
        """Whether the lease expired or was taken over while held."""
        return self._lost

    @property
    def expired(self) -> bool:
        """Lost, or a whole TTL has passed since it was last confirmed (no round trip).

        Closes most of the gap after a pause: a resumed body may look before its heartbeat
        has had a chance to beat.
        """
        return self.lost or _monotonic() - self.confirmed_at >= self.ttl_ms / 1000

    def mark_lost(self) -> None:
        """Record the loss (once), tell ``on_lost``, then log it: once the loss is logged, the
        body sees it (``request.lock_lost``, which ``on_lost`` sets)."""
        with _LOSS_GUARD:  # the beat and an extend on its own thread may both find it
            if self._lost:
                return
            self._lost = True
        try:
            if self.on_lost is not None:
                self.on_lost(self)
        finally:
            logger.error(
                "celery-lock: lease on %s lost while task %s ran",
                self.keys.lock,
                self.holder.task_id,
            )
