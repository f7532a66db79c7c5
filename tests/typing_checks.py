"""Checked by mypy (``[tool.mypy] files`` in pyproject.toml), never run: what a typed task body
sees. mypy fails here if ``self.request`` loses the lease's attributes."""

from __future__ import annotations

from celery import Celery

from celery_lock import LockedTask

app = Celery("typing_checks")


@app.task(base=LockedTask, bind=True, lock_key="request_idx")
def process(self: LockedTask, request_idx: int) -> int:
    fence: int | None = self.request.lock_fence
    key: str = self.request.lock_key
    lost: bool = self.request.lock_lost
    return request_idx if fence is None or lost or not key else fence
