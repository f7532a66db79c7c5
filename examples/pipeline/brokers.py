"""The broker-specific part of the chaos soak: how a broker is made to deliver again, and how to
tell that it holds nothing more.

- :class:`RedisBroker`: a forced visibility-timeout sweep sends every message unacknowledged for
  over a second back to its queue, while its first delivery goes on.
- :class:`RabbitBroker`: a stage's worker crashes (its whole process group is SIGKILLed, main
  process and pool processes, as when its host or container dies) and a new one is started;
  RabbitMQ sees the connection close and requeues every message the worker had not
  acknowledged, running, prefetched or deferred. A gentler fault, closing the worker's
  connection broker-side, needs the management plugin or ``rabbitmqctl`` with the Erlang
  cookie, which an ordinary user does not have; a crash needs neither.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from celery.utils.nodenames import host_format

from celery_lock.testing import CeleryWorker

#: kombu's Redis transport keeps delivered, unacknowledged messages in this hash.
UNACKED = "unacked"
#: ... and when each was delivered (wall-clock seconds), for the visibility timeout's sweep.
UNACKED_INDEX = "unacked_index"
#: A forced sweep sends back every message unacknowledged for longer than this (seconds).
SWEEP_VISIBILITY_TIMEOUT = 1.0


def force_visibility_timeout(app: Any, visibility_timeout: float) -> int:
    """Sweep the Redis broker as kombu does when a visibility timeout passes (a worker at
    startup and periodically): every message unacknowledged for longer than
    ``visibility_timeout`` goes back on its queue, while its first delivery goes on. The same
    sweep as tests/test_faults_redelivery.py's. Returns how many were that old."""
    with app.connection_for_write(
        transport_options={"visibility_timeout": visibility_timeout}
    ) as conn:
        channel = conn.default_channel
        older = channel.client.zcount(UNACKED_INDEX, 0, time.time() - visibility_timeout)
        channel.qos.restore_visible(num=1000, interval=1)
    return int(older)


class RedisBroker:
    """A private Redis broker; its redelivery fault is a forced visibility-timeout sweep.

    Args:
        app: The pipeline's Celery app, on this broker.
        client: A client of the broker's database.
        queues: The stages' queue names.
    """

    fault = "forced visibility sweeps"

    def __init__(self, app: Any, client: Any, queues: list[str]) -> None:
        self.app, self.client, self.queues = app, client, queues
        self.sweeps = 0
        self.swept = 0

    def redeliver(self) -> str:
        older = force_visibility_timeout(self.app, SWEEP_VISIBILITY_TIMEOUT)
        self.sweeps += 1
        self.swept += older
        return f"sweep: {older} message(s) unacknowledged for over 1s sent back"

    def summary(self) -> str:
        return f"{self.sweeps} ({self.swept} messages sent back)"

    def outstanding(self) -> tuple[int, int]:
        """Messages queued, and delivered but not acknowledged (deferred copies among them)."""
        queued = sum(int(self.client.llen(queue)) for queue in self.queues)
        return queued, int(self.client.hlen(UNACKED))

    def close(self) -> None:
        self.client.close()


class RabbitBroker:
    """RabbitMQ; its redelivery fault is a worker crash, and a new worker for that stage.

    Args:
        app: The pipeline's Celery app, on this broker.
        queues: The stages' queue names, of this run alone: deleted by :meth:`close`.
        workers: The worker of each stage (restarted in place after a crash).
        kills: Where each process killed is noted, ``pid -> (stage, monotonic time)``, for the
            checks: a body of one counts as running until then.
        busy_pids: The pool processes of a stage running a body now, by the record.
        rng: Draws the stage.
    """

    fault = "worker crashes"

    def __init__(
        self,
        app: Any,
        queues: list[str],
        workers: dict[str, CeleryWorker],
        kills: dict[int, tuple[str, float]],
        busy_pids: Callable[[str], set[int]],
        rng: random.Random,
    ) -> None:
        self.app, self.queues, self.workers = app, queues, workers
        self.kills, self.busy_pids, self.rng = kills, busy_pids, rng
        self.crashes = 0
        self.processes = 0
        self.busy = 0

    def redeliver(self) -> str:
        stage = self.rng.choice(sorted(self.workers))
        worker = self.workers[stage]
        pids = worker.child_pids()
        busy = self.busy_pids(stage) & set(pids)
        main_pid = worker.pid
        worker.kill()  # SIGKILL of the process group: RabbitMQ requeues what it had not acked
        when = time.monotonic()
        self.kills.update(dict.fromkeys(pids, (stage, when)))
        self.crashes += 1
        self.processes += len(pids)
        self.busy += len(busy)
        worker.start(timeout=60)
        return (
            f"crash: SIGKILL {stage} worker {main_pid} and its {len(pids)} pool processes "
            f"({len(busy)} busy); new worker pid {worker.pid}"
        )

    def summary(self) -> str:
        return f"{self.crashes} ({self.processes} pool processes with them, {self.busy} busy)"

    def outstanding(self) -> tuple[int, int]:
        """Messages ready in the queues, and messages the workers hold: running, prefetched,
        or waiting for their countdown (deferred copies). AMQP tells a queue's ready count
        alone, so the workers are asked for the rest (a worker that does not answer counts
        as holding one)."""
        with self.app.connection_for_write() as conn:
            channel = conn.default_channel
            queued = sum(channel.queue_declare(queue, passive=True)[1] for queue in self.queues)
        names = [host_format(worker.hostname) for worker in self.workers.values()]
        inspect = self.app.control.inspect(destination=names, timeout=2, limit=len(names))
        held = 0
        for ask in (inspect.active, inspect.reserved, inspect.scheduled):
            replies = ask() or {}
            held += sum(len(tasks) for tasks in replies.values())
            held += len(set(names) - set(replies))
        return int(queued), held

    def close(self) -> None:
        """Delete this run's queues, and their exchanges (Celery declares a queue it routes to
        with an exchange of the same name).

        Raises:
            kombu.exceptions.OperationalError: RabbitMQ is not reachable (after two tries).
        """
        with self.app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=2)
            for queue in self.queues:
                conn.default_channel.queue_delete(queue)
                conn.default_channel.exchange_delete(queue)
