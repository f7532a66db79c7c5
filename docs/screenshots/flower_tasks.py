"""Make the Flower screenshots of docs/monitoring.md: skipped copies in Flower's task list.

Starts its own ``redis-server`` (on a free port), a ``celery worker -E`` and a Flower for the
demo app (``celery_lock.demo.app``), sends duplicate copies of a few requests, waits until
Flower lists the skipped ones, then photographs Flower's tasks page with headless Chromium
(Debian: ``apt-get install chromium``) and stops everything it started. Rerunnable::

    python docs/screenshots/flower_tasks.py            # writes docs/screenshots/*.png
    python docs/screenshots/flower_tasks.py --out /tmp/shots --chromium /usr/bin/chromium

Writes ``flower-skipped.png`` (the list filtered on ``state:SKIPPED``) and ``flower-tasks.png``
(every task: the runs that did the work beside their skipped copies).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from celery import Celery

from celery_lock.testing import CeleryWorker, RedisServer, free_port

HERE = Path(__file__).resolve().parent
APP = "celery_lock.demo.app"
TASK = "demo.process"
QUEUE = "celery-lock-demo"
PREFIX = "celery-lock-demo"
TIMEOUT = 60.0
#: Columns of Flower's tasks page: Result is off by default, and it carries the skip's reason.
COLUMNS = "name,uuid,state,result,received"


def wait_for(what: str, probe: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
    """Poll ``probe`` until it returns a true value, and return that; bounded."""
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)
    return value


def http_get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return str(response.read().decode())


@contextlib.contextmanager
def flower(env: dict[str, str], port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``celery flower`` in its own process group; stop the group on exit."""
    cmd = [sys.executable, "-m", "celery", "-A", APP, "flower", f"--port={port}",
           "--address=127.0.0.1", f"--tasks_columns={COLUMNS}"]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **env, "FLOWER_UNAUTHENTICATED_API": "true"},
            start_new_session=True,
        )  # fmt: skip
    try:

        def healthy() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"Flower exited:\n{log.read_text(errors='replace')}")
            try:
                return http_get(port, "/healthcheck") == "OK"
            except OSError:  # URLError is an OSError
                return False

        wait_for("Flower to answer", healthy)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # sweep anything left in its group
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def send_duplicates(env: dict[str, str]) -> tuple[int, int]:
    """Send copies of three requests; return how many copies run and how many are skipped."""
    producer = Celery("screenshot-producer", set_as_current=False)
    producer.conf.update(
        broker_url=env["CELERY_LOCK_DEMO_BROKER_URL"],
        result_backend=env["CELERY_LOCK_DEMO_BACKEND_URL"],
        broker_transport_options={"global_keyprefix": f"{PREFIX}:broker:"},
        result_backend_transport_options={"global_keyprefix": f"{PREFIX}:results:"},
        task_default_queue=QUEUE,
    )
    try:
        # 1001 and 1002: two copies each at once; one runs, the other finds it running.
        for idx in (1001, 1002):
            for _ in range(2):
                producer.send_task(TASK, args=(idx,), task_id=str(uuid.uuid4()))
            time.sleep(0.3)
        # 1003: runs to the end, then two late copies find it done.
        producer.send_task(TASK, args=(1003,)).get(timeout=TIMEOUT)
        for _ in range(2):
            producer.send_task(TASK, args=(1003,))
    finally:
        producer.close()
    return 3, 4


def screenshot(chromium: str, url: str, png: Path) -> None:
    """Photograph ``url`` with headless Chromium into ``png``."""
    with tempfile.TemporaryDirectory(prefix="flower-shot-") as profile:
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--hide-scrollbars",
               f"--user-data-dir={profile}", "--window-size=1400,900",
               f"--screenshot={png}", "--virtual-time-budget=5000", url]  # fmt: skip
        png.unlink(missing_ok=True)
        done = subprocess.run(
            cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=120, check=False,
            start_new_session=True,
        )  # fmt: skip
        if not png.is_file():
            raise RuntimeError(f"chromium wrote no screenshot:\n{done.stderr.decode()[-2000:]}")
    print(f"wrote {png}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="directory of the PNGs")
    parser.add_argument("--chromium", default=None, help="Chromium binary (default: on PATH)")
    args = parser.parse_args(argv)
    chromium = args.chromium or next(
        filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None
    )
    if chromium is None:
        parser.error("no Chromium found: apt-get install chromium, or pass --chromium")
    args.out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="flower-shot-logs-") as logs, RedisServer() as redis:
        env = {
            "CELERY_LOCK_DEMO_BROKER_URL": redis.url_for(0),
            "CELERY_LOCK_DEMO_BACKEND_URL": redis.url_for(1),
            "CELERY_LOCK_DEMO_LOCK_URL": redis.url_for(2),
            "CELERY_LOCK_DEMO_RECORD_URL": redis.url_for(3),
            "CELERY_LOCK_DEMO_PREFIX": PREFIX,
            "CELERY_LOCK_DEMO_WORK_SECONDS": "1.0",
        }
        port = free_port()
        worker = CeleryWorker(
            APP, concurrency=2, hostname="worker1@shop", env=env,
            extra_args=["-E", "--without-mingle", "--without-gossip"],
            logfile=Path(logs, "worker.log"),
        )  # fmt: skip
        with flower(env, port, Path(logs, "flower.log")), worker:
            online = f'flower_worker_online{{worker="{worker.hostname}"}} 1.0'
            wait_for("Flower to see the worker", lambda: online in http_get(port, "/metrics"))
            runs, skips = send_duplicates(env)

            def settled() -> bool:
                tasks = json.loads(http_get(port, "/api/tasks"))
                states = [task["state"] for task in tasks.values()]
                return states.count("SUCCESS") == runs and states.count("SKIPPED") == skips

            wait_for("Flower to show every copy", settled)
            base = f"http://127.0.0.1:{port}"
            screenshot(chromium, f"{base}/tasks?state=SKIPPED", args.out / "flower-skipped.png")
            screenshot(chromium, f"{base}/tasks", args.out / "flower-tasks.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
