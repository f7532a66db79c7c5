"""What the worker-test apps share: an app configured from ``<PREFIX>_*`` environment variables,
and a recorder that appends JSON entries to Redis lists for the test to read."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

import celery_lock


def env_url(prefix: str, role: str, db: int) -> str:
    """``<PREFIX>_<ROLE>_URL``; unset, a URL that names the missing variable and reaches no
    server, never the machine's own Redis on 6379."""
    missing = f"{prefix}-{role}-url-not-set".lower().replace("_", "-")
    return os.environ.get(f"{prefix}_{role}_URL", f"redis://{missing}.invalid:6379/{db}")


def worker_test_app(name: str, prefix: str, **conf: Any) -> Celery:
    """An app on ``<PREFIX>_BROKER_URL``, ``_BACKEND_URL`` and ``_LOCK_URL`` (the lock store),
    one message per pool process at a time, with celery-lock installed; ``conf`` on top."""

    app = Celery(name, broker=env_url(prefix, "BROKER", 0), backend=env_url(prefix, "BACKEND", 1))
    app.conf.update(
        {
            "celery_lock_redis_url": env_url(prefix, "LOCK", 2),
            "worker_prefetch_multiplier": 1,
            "broker_connection_retry_on_startup": True,
            "result_expires": 3600,
            **conf,  # any of the above too (celery_lock_redis_url None: the broker's)
        }
    )
    celery_lock.install(app)
    return app


class Recorder:
    """Appends entries to Redis lists on ``<PREFIX>_RECORD_URL``, each stamped with the pool
    process's pid and ``time.monotonic()`` (system-wide on Linux: the test compares it with its
    own clock)."""

    def __init__(self, prefix: str) -> None:
        self.client = redis.Redis.from_url(env_url(prefix, "RECORD", 3))

    def append(self, key: str, **entry: Any) -> int:
        """Append ``entry`` to the list at ``key``; return how many entries it holds now."""
        stamped = {**entry, "pid": os.getpid(), "at": time.monotonic()}
        return int(self.client.rpush(key, json.dumps(stamped)))
