"""Checked by mypy (``[tool.mypy] files`` in pyproject.toml), never run: what a typed task body
sees. mypy fails here if ``self.request`` loses the lease's attributes, or if the fenced Redis
writes refuse a client they work with (a Redis Cluster client runs the one-key script too)."""

from __future__ import annotations

import redis
from celery import Celery

from celery_lock import FencedRedis, LockedTask, fenced_set
from celery_lock.fencing import fenced_get

app = Celery("typing_checks")


@app.task(base=LockedTask, bind=True, lock_key="request_idx")
def process(self: LockedTask, request_idx: int) -> int:
    fence: int | None = self.request.lock_fence
    key: str = self.request.lock_key
    lost: bool = self.request.lock_lost
    return request_idx if fence is None or lost or not key else fence


def fenced_total(client: redis.Redis | redis.RedisCluster, fence: int) -> bool:
    fenced_get(client, "total:7")
    return FencedRedis(client).set("total:7", 42, fence) and fenced_set(client, "n:7", 1, fence)
