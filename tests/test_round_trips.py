"""The lock store sees exactly two commands per uncontended task: acquire and release.

Counted on the server (``INFO commandstats``), so whatever the client does is seen. Commands the
scripts run inside EVALSHA are counted by Redis too, under the same names as top-level calls, so
every command's count is pinned (the INFO calls the test makes itself aside), and the client's
sends are counted as well.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from celery import Celery
from conftest import command_calls

from celery_lock import LockedTask
from celery_lock.keys import RequestKeys
from celery_lock.lease import Acquired, Holder, Lease, new_token
from celery_lock.runtime import get_runtime, reset_runtime
from celery_lock.store import LockStore

TASKS = 50
#: What the three scripts run inside EVALSHA.
SCRIPT_COMMANDS = {"get", "pttl", "incr", "pexpire", "del", "set"}
#: Every command the server runs for one uncontended task, top level and inside the scripts.
#: Pinned exactly: a top-level GET, PTTL or PEXPIRE the client added would change these counts.
PER_TASK = Counter({
    "evalsha": 2,  # acquire and release: the only round trips
    "get": 3,  # acquire reads the done-marker and the lock; release reads the lock
    # acquire starts the request's fence counter at the clock with its TTL (SET NX PX: no INCR
    # for a new request), then writes the lease; release writes the done-marker
    "set": 3,
    "del": 1,  # the lease, released
})  # fmt: skip


def top_level(delta: Counter[str]) -> Counter[str]:
    return Counter({name: n for name, n in delta.items()
                    if n and name not in SCRIPT_COMMANDS and name != "info"})  # fmt: skip


def without_info(delta: Counter[str]) -> Counter[str]:
    """``delta`` without the INFO calls the test makes itself (and without zero counts)."""
    return Counter({name: n for name, n in delta.items() if n and name != "info"})


@pytest.fixture
def process(celery_app: Celery) -> Iterator[Any]:
    @celery_app.task(base=LockedTask, lock_key="request_idx", name="rt.process", shared=False,
                     lock_skip_as_success=False)  # fmt: skip
    def process(request_idx: int) -> int:
        return request_idx

    yield process
    reset_runtime(celery_app)


def test_uncontended_task_costs_two_round_trips(
    celery_app: Celery, process: Any, celery_worker: Any, lock_redis: redis.Redis
) -> None:
    process.delay(-1).get(timeout=20)  # loads the scripts on this server
    store = get_runtime(celery_app).store_for(process.lock_settings())
    before = command_calls(lock_redis)
    with count_writes(store) as sent:
        results = [process.delay(idx) for idx in range(TASKS)]
        assert [r.get(timeout=20) for r in results] == list(range(TASKS))
    delta = command_calls(lock_redis) - before
    assert len(sent) == 2 * TASKS  # round trips the worker's lock store client made
    assert top_level(delta) == Counter({"evalsha": 2 * TASKS})
    assert without_info(delta) == Counter({name: n * TASKS for name, n in PER_TASK.items()})


def test_heartbeat_extends_many_leases_in_one_pipelined_round_trip(
    celery_app: Celery, lock_url: str, lock_redis: redis.Redis
) -> None:
    store = LockStore.from_url(lock_url)
    try:
        heartbeat = get_runtime(celery_app).heartbeat
        for idx in range(TASKS):
            keys = RequestKeys.build("celery-lock", "rt", str(idx), "rt.process")
            token, holder = new_token(), Holder(f"t{idx}", "rt.process", "h", 1)
            outcome = store.acquire(keys, token, 30_000, holder, 60_000)
            assert isinstance(outcome, Acquired)
            lease = Lease(store, keys, token, 30_000, outcome.fence, holder)
            heartbeat.add(lease, interval=3600)  # long interval: only the beats below run
        heartbeat.beat()  # loads the extend script
        before = command_calls(lock_redis)
        with count_writes(store) as sent:
            heartbeat.beat()
        assert len(sent) == 1
        delta = command_calls(lock_redis) - before
        assert top_level(delta) == Counter({"evalsha": TASKS})
    finally:
        reset_runtime(celery_app)  # stops the heartbeat
        store.client.close()


@contextmanager
def count_writes(store: LockStore) -> Iterator[list[int]]:
    """Count the times the client sends to the server (one per round trip), while in the
    ``with`` block; the connection class is restored on the way out, whatever happens."""
    sent: list[int] = []
    connection_class = store.client.connection_pool.connection_class
    original = connection_class.send_packed_command

    def send_packed_command(self: Any, command: Any, check_health: bool = True) -> None:
        sent.append(1)
        original(self, command, check_health)

    connection_class.send_packed_command = send_packed_command  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        connection_class.send_packed_command = original  # type: ignore[method-assign]
