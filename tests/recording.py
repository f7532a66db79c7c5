"""Recording a Celery or celery-lock signal for the length of a test."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery.utils.dispatch import Signal


@contextmanager
def recording(signal: Signal) -> Iterator[list[dict[str, Any]]]:
    """Every sending of ``signal`` while the block runs, in order, as the receiver's keyword
    arguments (``sender`` among them) and ``at``, the ``time.monotonic()`` it was sent at."""
    sent: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        sent.append({"sender": sender, **kwargs, "at": time.monotonic()})

    signal.connect(receiver, weak=False)
    try:
        yield sent
    finally:
        signal.disconnect(receiver)
