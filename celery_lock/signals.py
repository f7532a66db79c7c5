"""Signals sent by :class:`~celery_lock.LockedTask` (``celery.utils.dispatch.Signal``).

Connect receivers as with Celery's own signals::

    from celery_lock.signals import lock_skipped

    @lock_skipped.connect
    def count_skip(sender, lock_key, reason, holder, **kwargs):
        metrics.increment("celery_lock.skipped", tags={"task": sender.name, "reason": reason})

Every signal's sender is the task; every one carries ``task_id`` and ``lock_key`` (the lock's Redis
key), never the task's arguments.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["lock_acquired", "lock_deferred", "lock_lost", "lock_released", "lock_skipped"]

#: A lease was granted and the body is about to run. Extra argument: ``fence``.
lock_acquired = Signal(name="lock_acquired", providing_args=["task_id", "lock_key", "fence"])

#: A copy was skipped. Extra arguments: ``reason`` (``"running"`` or ``"done"``), ``holder``
#: (the task id holding or having completed the request).
lock_skipped = Signal(
    name="lock_skipped", providing_args=["task_id", "lock_key", "reason", "holder"]
)

#: A copy was handed back to the broker to run later. Extra arguments: ``reason``
#: (``"redelivered"``, ``"contention"``, ``"duplicate"``, ``"store-unavailable"``, or
#: ``"lost"``: the copy a run that lost its lease to another grant sends as it ends), ``holder``,
#: ``countdown``.
lock_deferred = Signal(
    name="lock_deferred",
    providing_args=["task_id", "lock_key", "reason", "holder", "countdown"],
)

#: The body finished and the lease was released. Extra arguments: ``success`` (a done-marker
#: was written; for a body that called ``self.replace``, a hand-on marker), ``owned`` (``False``
#: when the lease had been lost before the release; ``None`` when a try whose reply was lost may
#: have released it and nothing tells whether it did). Sent from the heartbeat thread for a
#: release the lock store was unavailable for at first, which the heartbeat tried again; not sent
#: for a release that never got an answer.
lock_released = Signal(
    name="lock_released", providing_args=["task_id", "lock_key", "success", "owned"]
)

#: The heartbeat found a running task's lease lost. Sent from the heartbeat thread.
lock_lost = Signal(name="lock_lost", providing_args=["task_id", "lock_key"])
