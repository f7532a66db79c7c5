"""An app that never calls ``celery_lock.install``: binding its LockedTask installs it.

Configured from ``BARE_CONF`` (JSON settings); its broker is in memory, as nothing is sent.
"""

from __future__ import annotations

import json
import os

from celery import Celery

from celery_lock import LockedTask

app = Celery("bare", broker="memory://")
app.conf.update(json.loads(os.environ.get("BARE_CONF", "{}")))


@app.task(base=LockedTask, lock_key="request_idx", name="bare.process")
def process(request_idx: int) -> int:
    return request_idx
