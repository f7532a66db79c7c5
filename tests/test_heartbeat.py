"""The heartbeat thread's life: started by the first lease, ended by stop(), started again by the
next lease if it ever ends otherwise. (Its beats against a real Redis are in test_round_trips,
test_task and the fault tests.)"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from celery_lock.heartbeat import Heartbeat

#: Leases are held for this long: no beat runs during a test.
LONG = 3600.0


class Died(BaseException):
    """Not an Exception: the heartbeat's loop does not catch it, so its thread ends."""


def test_the_first_lease_starts_the_thread_and_stop_ends_it() -> None:
    heartbeat = Heartbeat()
    assert not heartbeat.running
    heartbeat.add(object(), LONG)  # type: ignore[arg-type]
    assert heartbeat.running
    thread = heartbeat._thread
    assert thread is not None
    assert thread.is_alive()
    heartbeat.stop()
    assert not heartbeat.running
    assert not thread.is_alive()


def test_a_thread_that_ended_unexpectedly_is_started_again_by_the_next_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    heartbeat = Heartbeat()
    heartbeat.add(object(), LONG)  # type: ignore[arg-type]
    first = heartbeat._thread
    assert first is not None

    def die(*_: Any) -> bool:
        raise Died

    # The thread is waiting on _wake: make the wait raise, then wake it.
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # no traceback on stderr
    monkeypatch.setattr(heartbeat._wake, "wait", die)
    heartbeat._wake.set()
    first.join(10)
    assert not first.is_alive()
    assert not heartbeat.running

    monkeypatch.undo()
    heartbeat.add(object(), LONG)  # type: ignore[arg-type]
    try:
        assert heartbeat.running
        second = heartbeat._thread
        assert second is not None
        assert second is not first
        assert second.is_alive()
    finally:
        heartbeat.stop()
    assert not second.is_alive()
