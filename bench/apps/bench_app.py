"""The app every benchmark worker runs: one no-op task per contender, the same body for each.

Configured from the environment, so the bench can point it at its own redis-server:
``BENCH_BROKER_URL``, ``BENCH_LOCK_URL`` (celery-lock, celery-once and celery-singleton all keep
their keys there) and ``BENCH_RECORD_URL`` (where the storm task counts its executions).

Every task runs with ``acks_late=True`` (LockedTask's default) and results ignored, so the only
difference between two contenders is how each one locks:

=================  ===========================================================================
task               locking
=================  ===========================================================================
``bench.plain``    none
``bench.floor``    the floor: ``SET NX PX`` before the body, a compare-and-delete after (worker)
``bench.locked``   celery-lock: acquire before the body, release + done-marker after (worker)
``bench.once``     celery-once ``QueueOnce``: lock when published, unlock after the body
``bench.singleton``  celery-singleton ``Singleton``: lock when published, unlock after the body
``bench.storm``    celery-lock, counting each execution of its body (one ``INCR``)
=================  ===========================================================================

``bench.floor`` is not a lock to use (no fence, no done-marker, no heartbeat, nothing done
about a copy it finds locked): it is what any lock that takes and frees its lease in the worker
adds to a task, two round trips and nothing else, sent as celery-lock sends its scripts. Its
ratio to a plain task bounds what a two-round-trip lock can keep on the machine at hand.

A peer that cannot be imported is left out (``PEERS`` lists the ones that loaded) and the
bench reports why.
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any

import redis
from celery import Celery, Task

import celery_lock
from bench.lockcycle import COMPARE_AND_DELETE, TTL_MS
from celery_lock import LockedTask
from celery_lock.store import LockStore

BROKER_URL = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0")
LOCK_URL = os.environ.get("BENCH_LOCK_URL", "redis://127.0.0.1:6379/2")
RECORD_URL = os.environ.get("BENCH_RECORD_URL", "redis://127.0.0.1:6379/3")
EXECUTIONS_KEY = "bench:storm:executions"

app = Celery("bench", broker=BROKER_URL, set_as_current=False)
app.conf.update(
    task_ignore_result=True,
    task_acks_late=True,
    broker_connection_retry_on_startup=True,
    # Idle until the bench adds a queue: each measured run gets a queue of its own.
    task_default_queue="bench.idle",
    celery_lock_redis_url=LOCK_URL,
    # celery-once: a Redis backend on the lock store; an hour, as its default.
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": LOCK_URL}},
    # celery-singleton: its Redis backend on the lock store.
    singleton_backend_url=LOCK_URL,
)
celery_lock.install(app)

# The worker logs every task twice at INFO ("received", "succeeded"), which would dilute the
# cost being measured; "<name> ready." (which CeleryWorker waits for) is logged elsewhere.
for name in ("celery.app.trace", "celery.worker.strategy"):
    logging.getLogger(name).setLevel(logging.WARNING)

#: Peer name -> why it could not be loaded, for the report.
UNAVAILABLE: dict[str, str] = {}
#: Peers whose task is defined.
PEERS: list[str] = []


@app.task(name="bench.plain", acks_late=True)
def plain(request_idx: int) -> None:
    """No lock at all: the baseline."""


@app.task(base=LockedTask, name="bench.locked", lock_key="request_idx")
def locked(request_idx: int) -> None:
    """celery-lock's LockedTask."""


class FloorTask(Task):  # type: ignore[type-arg]
    """Two round trips around the body, nothing else: see the module's docstring."""

    #: Per pool process, made on first use (after the fork): the store and the script's SHA.
    _floor: tuple[LockStore, str] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if FloorTask._floor is None:
            store = LockStore.from_url(LOCK_URL)
            FloorTask._floor = store, store.client.script_load(COMPARE_AND_DELETE)
        store, release = FloorTask._floor
        key, token = f"bench:floor:{self.request.id}", secrets.token_hex(16)
        # LockStore's own command path (held connection, hiredis packing), as the lock cycle's
        # floor sends: the protocol's cost, not redis-py's.
        if store._send(("SET", key, token, "NX", "PX", TTL_MS)) is None:
            raise RuntimeError(f"{key} was taken")
        try:
            return self.run(*args, **kwargs)
        finally:
            store._send(("EVALSHA", release, 1, key, token))


@app.task(base=FloorTask, name="bench.floor", acks_late=True)
def floor(request_idx: int) -> None:
    """The floor: two round trips around the body."""


_record: redis.Redis | None = None


@app.task(base=LockedTask, name="bench.storm", lock_key="request_idx")
def storm(request_idx: int) -> None:
    """Counts its executions per request (one HINCRBY), so a storm can check each request ran
    once."""
    global _record  # noqa: PLW0603 - one client per process, created after fork
    if _record is None:
        _record = redis.Redis.from_url(RECORD_URL)
    _record.hincrby(EXECUTIONS_KEY, str(request_idx), 1)


def _define_peers() -> dict[str, Task[Any, Any]]:
    tasks: dict[str, Task[Any, Any]] = {}
    try:
        from celery_once import QueueOnce  # type: ignore[import-untyped]  # noqa: PLC0415
    except Exception as exc:  # an old package may fail in any way on import
        UNAVAILABLE["celery-once"] = f"{type(exc).__name__}: {exc}"
    else:

        @app.task(base=QueueOnce, name="bench.once", acks_late=True, once={"graceful": True})
        def once(request_idx: int) -> None:
            """celery-once's QueueOnce."""

        tasks["celery-once"] = once
    try:
        from celery_singleton import Singleton  # type: ignore[import-untyped]  # noqa: PLC0415
    except Exception as exc:
        UNAVAILABLE["celery-singleton"] = f"{type(exc).__name__}: {exc}"
    else:

        @app.task(base=Singleton, name="bench.singleton", acks_late=True)
        def singleton(request_idx: int) -> None:
            """celery-singleton's Singleton."""

        tasks["celery-singleton"] = singleton
    PEERS.extend(tasks)
    return tasks


PEER_TASKS = _define_peers()
