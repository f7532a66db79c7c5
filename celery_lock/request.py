"""The worker's side of a skipped copy: ``task-skipped`` is sent by the worker's main process.

A copy is skipped in the pool process, but whether the worker sends task events is known only
in its main process: ``celery worker -E`` sets it at start, and Flower (``enable_events``) or
``celery control enable_events`` turn it on at run time, which a pool process never learns. So
the pool process raises :class:`SkippedCopy` (Celery's ``Ignore``, with what the event needs)
and :class:`LockedRequest`, the request class of every ``LockedTask``, sends the event when the
outcome reaches the main process, through the worker's own event dispatcher, exactly as Celery
sends ``task-succeeded``.

A task with a request class of its own should derive it from :class:`LockedRequest`; one that
overrides ``request_dict`` must return ``super().request_dict`` (it carries the message's content
type into the pool process, for a deferral to be published with the serializer it came in).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal

from billiard.einfo import ExceptionWithTraceback  # type: ignore[attr-defined]  # not in celery-types
from celery.exceptions import Ignore
from celery.worker.request import Request

from .events import TASK_SKIPPED

__all__ = ["EXPIRED_FIELD", "ExpiredCopy", "LockedRequest", "SkippedCopy"]

#: The request field that carries the message's content type into the pool process, where a
#: deferral publishes the copy again with the serializer it came in.
CONTENT_TYPE_FIELD = "celery_lock_content_type"
#: The request field that tells the pool process a message delivered again is past its
#: ``expires``, read in the main process as Celery reads it (the app's timezone for a naive one).
EXPIRED_FIELD = "celery_lock_expired"


class SkippedCopy(Ignore):
    """Celery's ``Ignore`` for a copy skipped as a duplicate, carrying the ``task-skipped``
    fields across to the worker's main process (positional, so it pickles as it is)."""

    def __init__(
        self, lock_key: str, reason: str, holder: str, handed_on_at: int | None = None
    ) -> None:
        super().__init__(lock_key, reason, holder, handed_on_at)
        self.lock_key, self.reason, self.holder = lock_key, reason, holder
        #: The holder's replacement depth, for a copy skipped because the holder handed the
        #: request on with ``self.replace``.
        self.handed_on_at = handed_on_at
        #: For an eager call's skip only (which nothing pickles), under
        #: ``task_store_eager_result``: the task's result backend, where
        #: :func:`celery_lock.follow` reads the holder's result (an ``EagerResult`` knows none).
        self.backend: Any = None

    def __reduce__(self) -> tuple[Any, ...]:
        # From the arguments alone: the backend stays behind (a copy pickled for the main
        # process).
        return type(self), self.args

    def event_fields(self) -> dict[str, Any]:
        """The fields of ``task-skipped``; ``result`` is the line Flower shows. A copy skipped
        for a hand-on marker also has ``handed_on_at``."""
        fields: dict[str, Any] = {
            "lock_key": self.lock_key,
            "reason": self.reason,
            "holder": self.holder,
            "result": f"skipped: {self.reason} (holder {self.holder})",
        }
        if self.handed_on_at is not None:
            fields["handed_on_at"] = self.handed_on_at
            fields["result"] = (
                f"skipped: handed on (holder {self.holder}, at depth {self.handed_on_at})"
            )
        return fields


class ExpiredCopy(Ignore):
    """Celery's ``Ignore`` for a message delivered again past its ``expires`` that no run of
    it holds: :class:`LockedRequest` revokes it in the main process, as Celery revokes an
    expired message (``task-revoked``, the ``task_revoked`` signal, ``REVOKED`` stored)."""


class LockedRequest(Request):
    """The worker's request for a ``LockedTask``: sends ``task-skipped`` for a skipped copy
    whenever the worker sends task events, including once Flower has turned them on."""

    @property
    def request_dict(self) -> dict[str, Any]:
        """Celery's request dict, which the pool process sees alone (as ``task.request``), with
        the message's content type added for a deferral to be sent in."""
        # Added as the worker hands the request to the pool, which reads this property: the
        # main process makes a request per message, and an __init__ of ours, with its
        # arguments passed on, cost more than all the rest the lock adds there.
        request: dict[str, Any] = self._request_dict  # type: ignore[attr-defined]
        request[CONTENT_TYPE_FIELD] = self.content_type
        return request

    def execute_using_pool(self, pool: Any, **kwargs: Any) -> Any:
        """Celery's, which hands the pool ``_request_dict``, not this property. The worker's
        strategy never calls it (the class it generates has its own, which reads the
        property): a strategy of one's own, or a caller of its own, does."""
        self.request_dict  # noqa: B018  # adds the content type
        return super().execute_using_pool(pool, **kwargs)

    def execute(self, loglevel: Any = None, logfile: Any = None) -> Any:
        """Celery's in-process execution, which reads ``_request_dict``, not this property."""
        self.request_dict  # noqa: B018  # adds the content type
        return super().execute(loglevel, logfile)

    def maybe_expire(self) -> Literal[True] | None:
        """Celery's expiry check, except for a message the broker delivers again (a Redis
        visibility timeout, a worker that died or stopped): its first delivery was accepted
        before it expired, and may be running still. Expired here, in the main process, it
        stored ``REVOKED`` under the task id its first delivery runs as, and its ack took that
        delivery's message off the broker (on Redis, one delivery tag). It goes to the pool
        instead: deferred while its first delivery holds the request, acked once that one is
        done, and revoked there if no run holds it (``LockedTask``'s acquire is granted)."""
        if self.delivery_info.get("redelivered"):
            expires = self.expires  # aware, in the app's timezone, as Celery reads it
            if expires and datetime.now(timezone.utc if expires.tzinfo else None) > expires:
                self.request_dict[EXPIRED_FIELD] = True
            return None  # as Celery's for a message not expired
        return super().maybe_expire()

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, ExpiredCopy):
            # Celery's own revocation of an expired message, as maybe_expire would have made it.
            self._announce_revoked("expired", False, None, True)  # type: ignore[attr-defined]
            return None
        if isinstance(exc, SkippedCopy):
            # Request.send_event: only if the worker's dispatcher sends task events now. Named
            # as task-received names the call (self.name is its shadow name, if it has one).
            self.send_event(TASK_SKIPPED, name=self.name, **exc.event_fields())
        return super().on_failure(exc_info, send_failed_event, return_ok)
