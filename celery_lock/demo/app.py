"""The demo's Celery app: one locked task, ``demo.process``, that records every run it makes.

Configured from the environment, so ``python -m celery_lock.demo`` can point its worker at the
Redis it chose (it passes the same variables to the worker it starts):

=================================  ==============================================================
``CELERY_LOCK_DEMO_BROKER_URL``    broker (default ``$REDIS_URL``, else ``redis://127.0.0.1:6379/0``)
``CELERY_LOCK_DEMO_BACKEND_URL``   result backend (default: the broker URL)
``CELERY_LOCK_DEMO_LOCK_URL``      lock store (default: the broker URL)
``CELERY_LOCK_DEMO_RECORD_URL``    where runs are recorded (default: the broker URL)
``CELERY_LOCK_DEMO_PREFIX``        prefix of every Redis key the demo writes (default
                                   ``celery-lock-demo``); one per run keeps runs apart and
                                   leaves other data on a shared server alone
``CELERY_LOCK_DEMO_WORK_SECONDS``  how long each run sleeps (default 0.05)
=================================  ==============================================================

Each run appends one JSON object to the Redis list :func:`runs_key`: the request, the task id,
the lease's fence, the pool process's pid and the run's ``time.monotonic()`` interval
(``CLOCK_MONOTONIC`` is system-wide on Linux, so intervals from different processes compare).

Run a worker of your own with::

    celery -A celery_lock.demo.app worker -P prefork -c 4
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

import celery_lock
from celery_lock import LockedTask

__all__ = ["ENV_PREFIX", "QUEUE", "DemoConfig", "app", "configure", "process", "runs_key"]

#: Prefix of the environment variables the app is configured from.
ENV_PREFIX = "CELERY_LOCK_DEMO_"
#: The queue the demo's messages go to (under the run's key prefix).
QUEUE = "celery-lock-demo"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "celery-lock-demo"
DEFAULT_WORK_SECONDS = 0.05


@dataclass(frozen=True)
class DemoConfig:
    """Where the demo keeps its state, and how long each run works."""

    broker_url: str
    backend_url: str
    lock_url: str
    record_url: str
    prefix: str = DEFAULT_PREFIX
    work_seconds: float = DEFAULT_WORK_SECONDS

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> DemoConfig:
        """Read the ``CELERY_LOCK_DEMO_*`` variables of ``environ`` (see the module docstring)."""
        broker = environ.get(f"{ENV_PREFIX}BROKER_URL") or environ.get(
            "REDIS_URL", DEFAULT_REDIS_URL
        )
        return cls(
            broker_url=broker,
            backend_url=environ.get(f"{ENV_PREFIX}BACKEND_URL") or broker,
            lock_url=environ.get(f"{ENV_PREFIX}LOCK_URL") or broker,
            record_url=environ.get(f"{ENV_PREFIX}RECORD_URL") or broker,
            prefix=environ.get(f"{ENV_PREFIX}PREFIX") or DEFAULT_PREFIX,
            work_seconds=float(environ.get(f"{ENV_PREFIX}WORK_SECONDS") or DEFAULT_WORK_SECONDS),
        )

    def environ(self) -> dict[str, str]:
        """The environment variables that configure a worker like this."""
        return {
            f"{ENV_PREFIX}BROKER_URL": self.broker_url,
            f"{ENV_PREFIX}BACKEND_URL": self.backend_url,
            f"{ENV_PREFIX}LOCK_URL": self.lock_url,
            f"{ENV_PREFIX}RECORD_URL": self.record_url,
            f"{ENV_PREFIX}PREFIX": self.prefix,
            f"{ENV_PREFIX}WORK_SECONDS": repr(self.work_seconds),
        }


app = Celery("celery_lock_demo", set_as_current=False)
celery_lock.install(app)

_config = DemoConfig.from_environ(os.environ)
_record_client: redis.Redis | None = None


def configure(config: DemoConfig) -> DemoConfig:
    """Point :data:`app` at ``config``'s servers; call it before the app first connects.

    Every key the app writes starts with ``config.prefix``: the broker's and the result
    backend's (their ``global_keyprefix``), the leases' (``celery_lock_key_prefix``) and the
    record of runs.
    """
    global _config, _record_client  # noqa: PLW0603 - the module is the app's configuration
    _config = config
    _record_client = None
    app.conf.update(
        broker_url=config.broker_url,
        result_backend=config.backend_url,
        broker_transport_options={"global_keyprefix": f"{config.prefix}:broker:"},
        result_backend_transport_options={"global_keyprefix": f"{config.prefix}:results:"},
        celery_lock_redis_url=config.lock_url,
        celery_lock_key_prefix=f"{config.prefix}:lock",
        task_default_queue=QUEUE,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        result_expires=3600,
    )
    return config


def runs_key(config: DemoConfig | None = None) -> str:
    """The Redis list the runs are recorded in."""
    return f"{(config or _config).prefix}:runs"


def _records() -> redis.Redis:
    global _record_client  # noqa: PLW0603 - one client per process, made on first use
    if _record_client is None:
        _record_client = redis.Redis.from_url(_config.record_url)
    return _record_client


@app.task(base=LockedTask, bind=True, lock_key="request_idx", name="demo.process")
def process(self: LockedTask, request_idx: int) -> int:
    """Work on request ``request_idx`` for a moment and record the run; return the request."""
    started = time.monotonic()
    time.sleep(_config.work_seconds)
    run: dict[str, Any] = {
        "request_idx": request_idx,
        "task_id": self.request.id,
        "fence": getattr(self.request, "lock_fence", None),
        "pid": os.getpid(),
        "start": started,
        "end": time.monotonic(),
    }
    _records().rpush(runs_key(), json.dumps(run))
    return request_idx


configure(_config)
