"""The ``SKIPPED`` state and the value a skipped copy leaves behind.

A skipped copy stores state ``SKIPPED`` with meta::

    {"celery_lock": "skipped", "reason": "running" | "done",
     "lock_key": "<the lock's Redis key>", "holder": "<task id>", "task": "<the copy's task>"}

``SKIPPED`` is not one of Celery's ready states, so ``AsyncResult.get()`` on a skipped copy would
wait for ever: use :func:`celery_lock.follow`. With ``celery_lock_skip_as_success = True`` the copy
completes as ``SUCCESS`` with that same dict as its return value, so chains and chords go on;
:func:`is_skipped` tells such a value apart.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from celery import Task

from .request import SkippedCopy

__all__ = ["SKIPPED", "is_skipped", "skipped_marker"]

logger = logging.getLogger(__name__)

#: The state of a copy that was skipped because its request was running or done.
SKIPPED = "SKIPPED"

_MARKER = "celery_lock"


def skipped_marker(
    lock_key: str, reason: str, holder: str, task: str, handed_on_at: int | None = None
) -> dict[str, Any]:
    """The meta of a skipped copy (and its return value under ``skip_as_success``); with
    ``handed_on_at``, a copy skipped as ``done`` because ``holder`` handed the request on with
    ``self.replace`` at that replacement depth (its replacement may still be running)."""
    meta: dict[str, Any] = {
        _MARKER: "skipped",
        "reason": reason,
        "lock_key": lock_key,
        "holder": holder,
        "task": task,
    }
    if handed_on_at is not None:
        meta["handed_on_at"] = handed_on_at
    return meta


def is_skipped(value: Any) -> bool:
    """Whether ``value`` is the result or meta of a skipped copy: the marker dict, or the
    :class:`~celery_lock.request.SkippedCopy` an eager call's result holds (state ``IGNORED``).
    """
    if isinstance(value, SkippedCopy):
        return True
    return isinstance(value, dict) and value.get(_MARKER) == "skipped"


def store_skipped(task: Task[Any, Any], task_id: str, meta: dict[str, Any]) -> None:
    """Store ``SKIPPED`` with ``meta`` as the state of ``task``'s copy ``task_id``.

    Celery gives a stored state a ``date_done`` only when it is a ready state, and SKIPPED,
    which never changes, is not one. The database backend deletes expired results by their
    ``date_done`` (``celery.backend_cleanup``): a SKIPPED row without one stayed for ever, one
    row per skipped copy, so it gets one here.
    """
    task.update_state(task_id=task_id, state=SKIPPED, meta=meta)
    # Imported only if the app uses it (it needs SQLAlchemy): not imported, not in use.
    database = sys.modules.get("celery.backends.database")
    if database is not None and isinstance(task.backend, database.DatabaseBackend):
        try:
            _stamp_date_done(task.backend, task_id)
        except Exception:  # the skip is stored: a row left to stay is worth a log line
            logger.warning(
                "celery-lock: could not set date_done of skipped task %s; "
                "backend_cleanup will not delete its result",
                task_id,
                exc_info=True,
            )


def _stamp_date_done(backend: Any, task_id: str) -> None:
    """Set ``date_done`` of ``task_id``'s row to now, as Celery sets it for a ready state."""
    table = backend.task_cls
    session = backend.ResultSession()
    try:
        session.query(table).filter(table.task_id == task_id).update(
            {table.date_done: backend.app.now()}, synchronize_session=False
        )
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
