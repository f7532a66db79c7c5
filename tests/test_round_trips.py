"""The lock store sees exactly two commands per uncontended task: acquire and release.

Counted on the server (``INFO commandstats``), so whatever the client does is seen. Commands the
scripts run inside EVALSHA are counted by Redis too; they are told apart by name: the test allows
only EVALSHA at top level, plus the INFO calls it makes itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
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


def top_level(delta: Counter[str]) -> Counter[str]:
    return Counter({name: n for name, n in delta.items()
                    if n and name not in SCRIPT_COMMANDS and name != "info"})  # fmt: skip


@pytest.fixture
def process(celery_app: Celery) -> Iterator[Any]:
    @celery_app.task(base=LockedTask, lock_key="request_idx", name="rt.process", shared=False,
                     lock_skip_as_success=False)  # fmt: skip
    def process(request_idx: int) -> int:
        return request_idx

    yield process
    reset_runtime(celery_app)


def test_uncontended_task_costs_two_round_trips(
    process: Any, celery_worker: Any, lock_redis: redis.Redis
) -> None:
    process.delay(-1).get(timeout=20)  # loads the scripts on this server
    before = command_calls(lock_redis)
    results = [process.delay(idx) for idx in range(TASKS)]
    assert [r.get(timeout=20) for r in results] == list(range(TASKS))
    delta = command_calls(lock_redis) - before
    assert top_level(delta) == Counter({"evalsha": 2 * TASKS})
    assert delta["incr"] == TASKS  # one fence per grant
    assert delta["set"] == 2 * TASKS  # the lease, then its done-marker
    assert delta["del"] == TASKS  # the lease, released


def test_heartbeat_extends_many_leases_in_one_pipelined_round_trip(
    celery_app: Celery, lock_url: str, lock_redis: redis.Redis
) -> None:
    store = LockStore.from_url(lock_url)
    leases = []
    for idx in range(TASKS):
        keys = RequestKeys.build("celery-lock", "rt", str(idx), "rt.process")
        token = new_token()
        outcome = store.acquire(
            keys, token, 30_000, Holder(f"t{idx}", "rt.process", "h", 1), 60_000
        )
        assert isinstance(outcome, Acquired)
        leases.append(
            Lease(
                store,
                keys,
                token,
                30_000,
                outcome.fence,
                outcome and Holder(f"t{idx}", "rt.process", "h", 1),
            )
        )
    heartbeat = get_runtime(celery_app).heartbeat
    for lease in leases:
        heartbeat.add(lease, interval=3600)  # long interval: only the beat below runs
    heartbeat.beat()  # loads the extend script
    before = command_calls(lock_redis)
    packets = count_writes(store)
    heartbeat.beat()
    assert packets() == 1
    delta = command_calls(lock_redis) - before
    assert top_level(delta) == Counter({"evalsha": TASKS})
    reset_runtime(celery_app)
    store.client.close()


def count_writes(store: LockStore) -> Any:
    """Count the times the client sends to the server (one per round trip)."""
    sent = []
    connection_class = store.client.connection_pool.connection_class
    original = connection_class.send_packed_command

    def send_packed_command(self: Any, command: Any, check_health: bool = True) -> None:
        sent.append(1)
        original(self, command, check_health)

    connection_class.send_packed_command = send_packed_command  # type: ignore[method-assign]

    def packets() -> int:
        connection_class.send_packed_command = original  # type: ignore[method-assign]
        return len(sent)

    return packets
