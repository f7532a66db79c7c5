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

from typing import Any

__all__ = ["SKIPPED", "is_skipped", "skipped_marker"]

#: The state of a copy that was skipped because its request was running or done.
SKIPPED = "SKIPPED"

_MARKER = "celery_lock"


def skipped_marker(lock_key: str, reason: str, holder: str, task: str) -> dict[str, str]:
    """The meta of a skipped copy (and its return value under ``skip_as_success``)."""
    return {
        _MARKER: "skipped",
        "reason": reason,
        "lock_key": lock_key,
        "holder": holder,
        "task": task,
    }


def is_skipped(value: Any) -> bool:
    """Whether ``value`` is the result or meta of a skipped copy."""
    return isinstance(value, dict) and value.get(_MARKER) == "skipped"
