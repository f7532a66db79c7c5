"""Tiny Celery app for the CeleryWorker helper test; broker/backend from ``ECHO_BROKER_URL``."""

from __future__ import annotations

import os

from celery import Celery

URL = os.environ["ECHO_BROKER_URL"]
app = Celery("echo_app", broker=URL, backend=URL)
app.conf.broker_connection_retry_on_startup = True


@app.task(name="echo.add")
def add(x: int, y: int) -> int:
    return x + y
