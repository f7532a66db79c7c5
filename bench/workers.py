"""Real workers for the bench: start one, hand it a queue, time how fast it empties the queue.

Every measured run gets a queue of its own. Messages are published while no worker consumes
that queue; then the worker is told to consume it (``add_consumer``) and the clock runs until the
queue is empty *and* no message is unacknowledged. Every task acks late, so a message leaves
kombu's ``unacked`` hash only once its task has finished: no per-task bookkeeping is needed to
know when the last one is done. Every wait is bounded; workers are stopped by pid (process
group), through :class:`celery_lock.testing.CeleryWorker`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from celery_lock.testing import CeleryWorker, RedisServer

ROOT = Path(__file__).resolve().parent.parent
APP = "bench.apps.bench_app"

# Databases on the bench's redis-server, one role each.
BROKER_DB, CYCLE_DB, LOCK_DB, RECORD_DB = 0, 1, 2, 3
#: kombu's Redis transport keeps delivered, unacknowledged messages in this hash.
UNACKED = "unacked"
#: How often the queue is looked at while it drains (seconds).
POLL = 0.005


class BenchError(RuntimeError):
    """A run did not finish as it should (a timeout, a wrong count)."""


def worker_env(server: RedisServer) -> dict[str, str]:
    """Environment pointing ``bench/apps/bench_app.py`` at ``server``."""
    return {
        "BENCH_BROKER_URL": server.url_for(BROKER_DB),
        "BENCH_LOCK_URL": server.url_for(LOCK_DB),
        "BENCH_RECORD_URL": server.url_for(RECORD_DB),
        # The caller's PYTHONPATH first (e.g. another celery_lock tree to compare), then this
        # checkout (for ``bench``), then whatever this process imports from.
        "PYTHONPATH": os.pathsep.join(
            [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            + [str(ROOT), *sys.path]
        ),
    }


def bench_app(server: RedisServer) -> Any:
    """The bench app module, imported in this process (the producer) against ``server``.

    The peers keep module-global clients made on first use, so one bench run uses one server.
    """
    os.environ.update({k: v for k, v in worker_env(server).items() if k != "PYTHONPATH"})
    from bench.apps import bench_app as module  # noqa: PLC0415 - configured by the env above

    if server.url_for(BROKER_DB) != module.BROKER_URL:
        raise BenchError("bench.apps.bench_app was imported for another server")
    return module


#: The processes whose CPU a drain adds up, in the order reports show them.
ROLES = ("main", "pool", "redis-server")


@dataclass(frozen=True)
class Drain:
    """One queue drained: wall seconds, and CPU seconds of the worker and the redis-server.

    CPU time is what stays comparable on a shared machine: other people's processes stretch the
    wall clock, not the CPU a task costs. On a saturated machine, throughput follows it.
    """

    seconds: float
    #: CPU seconds by process (:data:`ROLES`): the worker's main process, its pool processes
    #: together, and the redis-server (broker and lock store).
    cpu_by_role: dict[str, float]

    @property
    def cpu_seconds(self) -> float:
        """CPU seconds of the worker's processes and the redis-server together."""
        return sum(self.cpu_by_role.values())


@dataclass
class Worker:
    """A running worker and the node name to address remote-control commands to."""

    process: CeleryWorker
    node: str
    app: Celery
    broker: redis.Redis
    server_pid: int | None = None

    def pool_pids(self) -> list[int]:
        """The pool processes (the main process for a solo pool)."""
        return self.process.child_pids() or [p for p in [self.process.pid] if p is not None]

    def consume(self, queue: str) -> None:
        """Start consuming ``queue`` (returns once the worker has replied)."""
        replies = self.app.control.add_consumer(
            queue, destination=[self.node], reply=True, timeout=10
        )
        if not replies:
            raise BenchError(f"{self.node} did not answer add_consumer({queue})")

    def stop_consuming(self, queue: str) -> None:
        """Stop consuming ``queue``."""
        self.app.control.cancel_consumer(queue, destination=[self.node], reply=True, timeout=10)

    def wait_drained(self, queue: str, timeout: float) -> None:
        """Wait until ``queue`` is empty and nothing is unacknowledged.

        Raises:
            BenchError: still busy after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        pipe = self.broker.pipeline(transaction=False)
        while True:
            pipe.llen(queue)
            pipe.hlen(UNACKED)
            waiting, unacked = pipe.execute()
            if not waiting and not unacked:
                return
            if time.monotonic() > deadline:
                raise BenchError(
                    f"{queue}: {waiting} waiting, {unacked} unacked after {timeout:.0f}s\n"
                    f"{self.process.log()[-2000:]}"
                )
            time.sleep(POLL)

    def cpu_by_role(self) -> dict[str, float]:
        """CPU used so far by the worker's main process, its pool and the redis-server."""
        pids: dict[str, Sequence[int | None]] = {
            "main": [self.process.pid],
            "pool": self.process.child_pids(),
            "redis-server": [self.server_pid],
        }
        return {role: sum(cpu_seconds(p) for p in pids[role] if p is not None) for role in ROLES}

    def drain(self, queue: str, timeout: float) -> Drain:
        """Consume ``queue`` until it is done, from its first delivery to its end.

        The clock starts when the first message leaves the queue, not at ``add_consumer``:
        kombu's Redis transport picks a new queue up only when its pending ``BRPOP`` (up to a
        second) returns, a delay that has nothing to do with the tasks.
        """
        waiting = self.broker.llen(queue)
        self.consume(queue)
        deadline = time.monotonic() + timeout
        while self.broker.llen(queue) >= waiting and waiting:
            if time.monotonic() > deadline:
                raise BenchError(f"{queue}: no message taken in {timeout:.0f}s")
            time.sleep(POLL / 5)
        began, before = time.perf_counter(), self.cpu_by_role()
        self.wait_drained(queue, timeout)
        seconds, after = time.perf_counter() - began, self.cpu_by_role()
        drained = Drain(seconds, {role: after[role] - before[role] for role in ROLES})
        self.stop_consuming(queue)
        return drained


@contextlib.contextmanager
def running_worker(
    server: RedisServer,
    app: Celery,
    concurrency: int,
    pool: str = "prefork",
    profile_to: Path | None = None,
) -> Iterator[Worker]:
    """A worker of the bench app with ``concurrency`` processes, consuming nothing yet.

    With ``profile_to`` the worker runs under cProfile (``python -m cProfile -o ... -m celery``)
    and writes its profile there when it stops; meant for a solo pool.
    """
    process = CeleryWorker(
        APP,
        pool=pool,
        concurrency=concurrency,
        queues=["bench.idle"],
        extra_args=["--without-mingle", "--without-gossip", "--without-heartbeat"],
        env=worker_env(server),  # PYTHONPATH has this checkout: any cwd will do
    )
    if profile_to is not None:
        process.cmd = [sys.executable, "-m", "cProfile", "-o", str(profile_to), *process.cmd[1:]]
    process.start(timeout=60)
    broker = server.client(BROKER_DB)
    try:
        node = process.hostname.replace("%h", socket.gethostname())
        yield Worker(process, node, app, broker, server.pid)
    finally:
        broker.close()
        process.stop(timeout=30)
        with contextlib.suppress(OSError):
            process.logfile.unlink()


def publish(task: Any, ids: Iterable[int], queue: str) -> float:
    """Send one message per id through the task's own ``apply_async``; the seconds it took.

    The task's own ``apply_async`` matters: celery-once and celery-singleton take their lock
    there, and LockedTask checks that the call yields a request key.
    """
    began = time.perf_counter()
    for request_idx in ids:
        task.apply_async((request_idx,), queue=queue)
    return time.perf_counter() - began


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid``, every thread's, exited ones included (0 once it
    is gone).

    Read from the process's own CPU clock, in nanoseconds: ``/proc/<pid>/stat`` counts in
    ticks of 10 ms, coarse against the tens of microseconds per task that tell contenders
    apart (a drain of a few thousand tasks took 4 to 6 ticks of difference). Linux names the
    clock of another process ``~pid << 3 | 2`` (``CPUCLOCK_SCHED``, what
    ``clock_getcpuclockid`` returns), readable for any process one can see.
    """
    try:
        return time.clock_gettime(_process_clock(pid))
    except OSError:  # gone (EINVAL), or a kernel without such clocks: ticks, then
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, ValueError, IndexError):
        return 0.0


def _process_clock(pid: int) -> int:
    """The clock id of ``pid``'s CPU time (the kernel's ``MAKE_PROCESS_CPUCLOCK``)."""
    return (~pid << 3) | 2


def rss_kib(pid: int) -> int | None:
    """Resident set size of ``pid`` in KiB (``VmRSS``), ``None`` once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
