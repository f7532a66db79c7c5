"""The lock store: one Redis client with the lease scripts, their retries and their errors.

:class:`LockStore` is one Redis client with the scripts registered on it; it turns script replies
into values (:class:`Acquired`, :class:`Held`, :class:`Done`) and retries transient errors with
tenacity (bounded, jittered) before raising an error:

- :class:`~celery_lock.exceptions.LockStoreUnavailableError` when the store stayed unreachable or
  kept refusing for now (connection errors, timeouts, ``LOADING``, ``READONLY``, ``OOM``,
  ``BUSY``, ``MASTERDOWN``, ``TRYAGAIN``, ``CLUSTERDOWN``, ``NOREPLICAS``, ``MISCONF``): worth
  trying later;
- :class:`~celery_lock.exceptions.LockStateError` when a key of the request holds something
  celery-lock did not write (``WRONGTYPE``, a fence that is not an integer, a lock that is not
  ``"<token> <fence> <holder>"`` or has no TTL): trying again cannot help; the message names
  the key and what it holds;
- :class:`~celery_lock.exceptions.LockStoreError` for any other error reply (``NOPERM``, an
  unknown command, ``MOVED`` from a node of a Redis Cluster of several masters), for a wrong
  user or password (``WRONGPASS``, ``NOAUTH``, which redis-py raises as connection errors) and
  for any other error of redis-py (a connection it refuses to build): not transient either.

Scripts run by ``EVALSHA``; a ``NOSCRIPT`` reply (the server restarted or flushed its scripts) is
answered by loading the script and running it once more, for acquire and release as for the
heartbeat's pipeline; ``NOSCRIPT`` again on that run (a second flush or restart in between) is
"not now" as well. Every new connection reads the server's ``run_id`` (``INFO server``): a
change means the server restarted, so leases, done-markers and fence counters may be gone, and a
warning says so. That costs one round trip per connection, never one per task.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from time import monotonic as _monotonic
from time import time_ns as _time_ns
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    MasterDownError,
    MovedError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    TryAgainError,
)
from redis.retry import Retry
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

try:
    from hiredis import pack_command as _pack_command
except ImportError:  # pragma: no cover - hiredis is a dependency; redis-py works without it
    _pack_command = None  # type: ignore[assignment]

from .exceptions import LockStateError, LockStoreError, LockStoreUnavailableError
from .keys import RequestKeys
from .lease import (
    Acquired,
    HandOn,
    Held,
    Holder,
    Lease,
    Outcome,
    decode_done,
    decode_lock,
    encode_done,
    encode_id,
)  # fmt: skip
from .scripts import Scripts
from .sentinel import is_sentinel_url, sentinel_master_client

__all__ = [
    "REFUSED_ERRORS",
    "TRANSIENT_ERRORS",
    "LockStore",
    "TransientReplyError",
    "client_for_url",
    "cluster_masters",
    "is_transient_reply",
    "reply_code",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class TransientReplyError(redis.ConnectionError):
    """An error reply that means "not now" (``BUSY``, ``READONLY``, ``OOM``...), raised as a
    connection error so that every caller treats it as the store being unavailable."""


#: Errors worth another try: the connection failed, or the server refused the command for now.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,  # includes BusyLoadingError (LOADING) and TransientReplyError
    redis.TimeoutError,
)

#: Connection errors that mean "never" rather than "not now": a wrong password or user
#: (``WRONGPASS``, ``NOAUTH``). Tried once more (a rotated credential may have just expired),
#: then the task fails: deferring cannot help.
REFUSED_ERRORS: tuple[type[Exception], ...] = (AuthenticationError, AuthorizationError)

#: Error codes of replies that mean "not now" rather than "never". ``MISCONF``: the server's
#: last save to disk failed and ``stop-writes-on-bgsave-error`` is on; it refuses writes (and
#: ``PING``) until a save succeeds, which it tries again by itself.
TRANSIENT_CODES = frozenset(
    {
        "LOADING",
        "READONLY",
        "OOM",
        "BUSY",
        "MASTERDOWN",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "NOREPLICAS",
        "MISCONF",
    }
)
_TRANSIENT_REPLY_CLASSES = (
    ReadOnlyError,
    OutOfMemoryError,
    TryAgainError,
    ClusterDownError,
    MasterDownError,
)
# Redis < 7 wraps an error raised inside a script: "Error running script (call to f_...):
# @user_script:6: WRONGTYPE Operation against ..." (sometimes with a second "@user_script: 6: -").
_SCRIPT_ERROR = re.compile(r"@user_script:\s*\d+:\s*(?:@user_script:\s*\d+:\s*)?-?([A-Z]{2,})\b")
# Integers a fence counter can hold: what a Lua number (a double) holds exactly, which the
# acquire script checks (INCR itself would go on to 2**63 - 1).
_FENCE_MAX = 2**53
# Replies of the release script besides 1 (released) and 0 (lost): see scripts.RELEASE.
_RELEASED_BEFORE = 2
_MAYBE_RELEASED_BEFORE = 3
# The pool size redis-py 5 to 7 gave a pool with no max_connections: no cap in practice.
_UNBOUNDED_POOL = 2**31


def reply_code(exc: redis.ResponseError) -> str:
    """The error code of an error reply (``WRONGTYPE``, ``READONLY``...), also for an error
    raised inside a script; ``""`` when there is none."""
    text = str(exc)
    match = _SCRIPT_ERROR.search(text)
    if match:
        return match.group(1)
    status = getattr(exc, "status_code", None)  # redis-py >= 8 keeps the code it stripped
    if isinstance(status, str) and status:
        return status
    first = text.split(" ", 1)[0]
    return first if first.isupper() and first.isalpha() else ""


#: Error codes of a server that is no longer the primary: the address may now lead to another.
_DEMOTED_CODES = frozenset({"READONLY", "MASTERDOWN"})


def is_transient_reply(exc: redis.ResponseError) -> bool:
    """Whether an error reply means "not now" (the server is loading, read-only after a
    failover, out of memory, busy running a script, its cluster is reconfiguring, or it refuses
    writes until a save to disk succeeds)."""
    return isinstance(exc, _TRANSIENT_REPLY_CLASSES) or reply_code(exc) in TRANSIENT_CODES


def _log_retry(what: str, attempts: int) -> Callable[[RetryCallState], None]:
    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        delay = state.next_action.sleep if state.next_action is not None else 0.0
        logger.info(
            "celery-lock: %s failed (try %d of at most %d): %s; trying again in %.2fs",
            what,
            state.attempt_number,
            attempts,
            exc,
            delay,
        )

    return before_sleep


class LockStore:
    """One Redis client with the lease scripts registered on it.

    Args:
        client: the client; celery-lock adds a hook to its connection pool (when the pool has
            none) that reads the server's ``run_id`` on every new connection.
        retry_attempts: tries per call for transient errors (the first included).
        retry_deadline: seconds after which no further try starts, except that one retry
            follows a failed first try however long it took (when ``retry_attempts`` allows
            one): a try that timed out may have run on the server.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        retry_attempts: int = 3,
        retry_deadline: float = 2.0,
    ) -> None:
        self.client = client
        self.scripts = Scripts.register(client)
        self.retry_attempts = retry_attempts
        self.retry_deadline = retry_deadline
        #: ``run_id`` of the server last seen (``None`` until a connection has read it).
        self.run_id: str | None = None
        #: How often the server was seen to restart (its ``run_id`` changed, at its address).
        self.restarts = 0
        #: How often another server was found serving the store (a new ``run_id`` at a new
        #: address: a Sentinel failover).
        self.failovers = 0
        self._address: tuple[Any, Any] | None = None
        self._server_guard = threading.Lock()
        self._loaded: set[str] = set()
        # The connection acquire and release run on, held rather than checked out of the pool
        # per call; see _send.
        self._own: Any = None
        self._own_guard = threading.Lock()
        self._packs = False
        connection_kwargs = client.connection_pool.connection_kwargs
        # The address the URL names, to come back to from one a failover led to (see
        # _followed_failover); None for a unix socket's store.
        self._url_address: tuple[Any, Any] | None = (
            (connection_kwargs["host"], connection_kwargs.get("port"))
            if "host" in connection_kwargs
            else None
        )
        if connection_kwargs.get("redis_connect_func") is None:
            connection_kwargs["redis_connect_func"] = self._on_connect

    @classmethod
    def from_url(cls, url: str, **options: Any) -> LockStore:
        """A store on a new client for ``url`` (``redis://``, ``rediss://``, ``unix://`` or
        ``sentinel://``)."""
        # tenacity is the one retry layer: redis-py 8 would otherwise retry (with its own
        # backoff) inside every try, stretching a fail-closed decision to many seconds.
        # redis-py 8 caps a pool at 100 connections unless told otherwise: a gevent or threads
        # pool with more tasks in flight would fail the rest closed as if the server were down.
        # The URL's own ?max_connections= still wins.
        client = client_for_url(
            url,
            socket_timeout=5,
            socket_connect_timeout=5,
            health_check_interval=30,
            retry=Retry(NoBackoff(), 0),
            max_connections=_UNBOUNDED_POOL,
        )
        return cls(client, **options)

    def close(self) -> None:
        """Close the client's connections, the store's own one included. (``Redis.close()``
        alone leaves the pool's connections open on redis-py 5.0.)"""
        self.client.close()
        self.client.connection_pool.disconnect()

    # -- the server behind the client ---------------------------------------------------------

    def _on_connect(self, connection: Any) -> None:
        """redis-py's connect hook: the usual handshake, then, in one round trip, a ``PING``
        and the server's ``run_id``.

        redis-py's health check sends ``PING`` before a command on a connection idle for
        ``health_check_interval``; refused by an ACL (a user allowed only
        ``@read @write @scripting``), it would fail that command: an extend after a quiet
        interval, a release after a long body, the first acquire after a quiet spell. Such a
        connection goes without the check: a connection the server dropped meanwhile fails the
        command instead, which the store tries again on a new one.
        """
        connection.on_connect()
        connection.send_command("PING", check_health=False)
        connection.send_command("INFO", "server", check_health=False)
        try:
            connection.read_response()
        except redis.ResponseError as exc:
            logger.debug("celery-lock: no health check on the lock store's connection: %s", exc)
            connection.health_check_interval = 0
        try:
            info = connection.read_response()
        except redis.ResponseError as exc:  # INFO denied by an ACL: run without the check
            logger.debug("celery-lock: cannot read the lock store's run_id: %s", exc)
            return
        self._note_run_id(_parse_run_id(info), _address_of_connection(connection))

    def check_server(self) -> None:
        """Read the server's ``run_id`` now (one round trip) and warn if it changed."""
        try:
            info = self.client.info("server")
        except redis.ResponseError:
            return
        self._note_run_id(str(info.get("run_id") or "") or None)

    def _note_run_id(self, run_id: str | None, address: tuple[Any, Any] | None = None) -> None:
        """Note the server's ``run_id`` (and the address it was read at, where known); warn
        when it changed: a restart at the same address, a failover at another."""
        if run_id is None:
            return
        with self._server_guard:
            previous, self.run_id = self.run_id, run_id
            moved = None not in (address, self._address) and address != self._address
            if address is not None:
                self._address = address
            if previous is None or previous == run_id:
                return
            if moved:
                self.failovers += 1
            else:
                self.restarts += 1
        if moved:
            logger.warning(
                "celery-lock: the lock store %s is another server now (run_id %s -> %s), a "
                "failover: what the old one had not replicated to it (leases, done-markers, fence "
                "steps) is lost",
                address_of(self.client),
                previous,
                run_id,
            )
            return
        logger.warning(
            "celery-lock: the lock store %s restarted (run_id %s -> %s): unless it persists its "
            "data, leases, done-markers and fence counters were lost (new counters start "
            "from the clock, above the old fences while the workers' clocks agree)",
            address_of(self.client),
            previous,
            run_id,
        )

    def _scripts_missing(self, script: Script) -> None:
        """``NOSCRIPT`` for a script this store had loaded: the server restarted or flushed."""
        if script.sha in self._loaded:
            logger.info(
                "celery-lock: scripts are gone from the lock store %s (restart or SCRIPT FLUSH); "
                "loading them again",
                address_of(self.client),
            )
            self.check_server()

    def _load(self, script: Script) -> None:
        self.client.script_load(script.script)
        self._loaded.add(script.sha)

    # -- calls ----------------------------------------------------------------------------------

    def _send(self, command: tuple[Any, ...]) -> Any:
        """Run one command, its name and arguments in one tuple, on this store's own connection.

        The connection is taken from the client's pool once and held: checking one out and back
        in per command costs redis-py about 40 µs of CPU, a third of a round trip's client-side
        cost (``bench/``). A command that fails short of a whole reply, whatever the exception,
        gives it back disconnected (:meth:`_drop_own`), and the next one checks one out again.
        Used by another thread meanwhile (the heartbeat handing leases back at shutdown), the
        command goes through the pool instead.
        """
        if not self._own_guard.acquire(False):  # not blocking (positional: no keyword parsing)
            return self.client.execute_command(*command)  # type: ignore[no-untyped-call]
        try:
            connection = self._own
            if connection is None:
                connection = self._own = _check_out(self.client.connection_pool)
                self._packs = _packs_with_hiredis(connection)
            try:
                if self._packs:
                    # The bytes send_command would send, packed in one C call: about 10 µs of
                    # CPU per command less than going through redis-py's packer (bench/).
                    connection.send_packed_command((_pack_command(command),))
                else:
                    connection.send_command(*command)
                return connection.read_response()
            except redis.ResponseError:
                raise  # an error reply, read in full: the connection is in step
            except BaseException:
                # redis-py disconnects on an error inside the send or the read, but not on one
                # raised between them (a signal handler: a soft time limit, SIGTERM's
                # SystemExit). The reply would stay unread, and the next command on this held
                # connection, which the pool never checks, would read it as its own.
                self._drop_own()
                raise
        finally:
            self._own_guard.release()

    def _drop_own_unless_in_use(self) -> None:
        """:meth:`_drop_own`, unless another thread is using the held connection (it will meet
        the same reply, and drop it then)."""
        if self._own_guard.acquire(blocking=False):
            try:
                self._drop_own()
            finally:
                self._own_guard.release()

    def _drop_own(self) -> None:
        """Disconnect the held connection and give it back to the pool; the caller holds
        ``_own_guard``.

        The next command checks out another, which the pool connects as it connects any: a
        Sentinel pool asks the sentinels where the master is now. A connection left to
        reconnect by itself, as redis-py's does when it next sends, would go back to the
        address it had, a master that failed over.
        """
        connection, self._own = self._own, None
        if connection is not None:
            connection.disconnect()
            self.client.connection_pool.release(connection)

    def _evalsha(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run ``script`` by ``EVALSHA``; after ``NOSCRIPT`` load it and run it once more (a
        second ``NOSCRIPT`` is :class:`TransientReplyError`)."""
        # One tuple, handed on as it is: unpacked into _send's arguments, it was built again
        # there (twice per task).
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        try:
            try:
                reply = self._send(command)
            except NoScriptError:
                self._scripts_missing(script)
                self._load(script)
                reply = self._send(command)
        except redis.ResponseError as exc:
            self._raise_if_transient(exc)
            raise
        self._loaded.add(script.sha)
        return reply

    def _raise_if_transient(self, exc: redis.ResponseError) -> None:
        """Raise :class:`TransientReplyError` for an error reply that means "not now" (leaving
        a demoted primary first); return for any other.

        ``NOSCRIPT`` reaches here only from a run after the script was loaded again: it went
        missing once more in between (a second ``SCRIPT FLUSH`` or restart), which the next
        try, loading it again, can outlast. Not a refusal for good: as one, a copy would fail
        unrun and a held lease would count as lost.
        """
        if isinstance(exc, NoScriptError) or is_transient_reply(exc):
            self._leave_if_demoted(exc)
            raise TransientReplyError(str(exc)) from exc
        if self._followed_failover(exc):
            raise TransientReplyError(str(exc)) from exc

    def _followed_failover(self, exc: redis.ResponseError) -> bool:
        """After ``MOVED`` from a node of a Redis Cluster of one master, point the client at the
        master it names; whether it did.

        A failover in a cluster of one master (a replica promoted, by ``CLUSTER FAILOVER`` or
        because the master failed) leaves the node the URL names a replica, which answers
        ``MOVED`` for every key, never ``READONLY``: taken for a refusal for good, every task
        failed unrun and every held lease counted as lost. Followed, the command is tried again
        on the new master. Only where the node says its cluster has one master (``CLUSTER
        INFO``): in a cluster of several, or one that cannot be asked, the client would go back
        and forth between masters, and a pipeline of leases on several would never get through;
        such a store is refused for good, as the worker refuses it at start. The URL's own
        address is kept, to come back to should the address followed stop answering
        (:meth:`_unfollow_if_unreachable`).
        """
        target = _redirect_address(_redirect(exc))
        if target is None or self._url_address is None:  # no redirect, or a unix socket's store
            return False
        if cluster_masters(self.client) != 1:
            return False
        self._point_at(target, f"no longer its cluster's master ({exc}); following it to")
        return True

    def _unfollow_if_unreachable(self, exc: BaseException) -> None:
        """After a failover was followed, a connection that failed (refused, cut, timed out)
        makes the store ask the URL's node which master it knows, and point there: the URL's
        node itself when it is master again (a failback), or the master it names now. Where it
        names the address followed, or cannot say, the store stays: one connection dropped by
        a master that answers is no reason to leave it."""
        if self._url_address is None or isinstance(exc, TransientReplyError):
            return  # not a store that follows, or a reply: the address answers
        if not isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            return
        kwargs = self.client.connection_pool.connection_kwargs
        followed = (kwargs.get("host"), kwargs.get("port"))
        if followed == self._url_address:
            return
        master = self._master_known_at_url()
        if master is not None and master != followed:
            self._point_at(master, f"not reachable ({exc}); its URL's node names as master")

    def _master_known_at_url(self) -> tuple[Any, Any] | None:
        """The master the URL's node knows (``ROLE``): the node itself, or the one it
        replicates; ``None`` where it cannot be asked. One short-lived connection, with the
        store's own options (password, TLS), without the store's connect hook."""
        pool = self.client.connection_pool
        kwargs = dict(pool.connection_kwargs)
        kwargs.pop("redis_connect_func", None)
        host, port = self._url_address or (None, None)
        kwargs.update(host=host, port=port, socket_timeout=2, socket_connect_timeout=2)
        probe = redis.Redis(connection_pool=redis.ConnectionPool(pool.connection_class, **kwargs))
        try:
            role = probe.execute_command("ROLE")  # type: ignore[no-untyped-call]
        except redis.RedisError as exc:
            logger.debug("celery-lock: cannot ask %s:%s for its master: %s", host, port, exc)
            return None
        finally:
            probe.connection_pool.disconnect()
        kind = role[0].decode() if isinstance(role[0], bytes) else str(role[0])
        if kind == "master":
            return self._url_address
        if kind == "slave" and len(role) >= 3:
            named = role[1].decode() if isinstance(role[1], bytes) else str(role[1])
            return named, int(role[2])
        return None

    def _point_at(self, address: tuple[Any, Any], why: str) -> None:
        """Point every connection of the client at ``address``, the held one dropped."""
        pool = self.client.connection_pool
        with self._server_guard:
            if (pool.connection_kwargs.get("host"), pool.connection_kwargs.get("port")) != address:
                logger.warning(
                    "celery-lock: the lock store %s is %s %s:%s",
                    address_of(self.client),
                    why,
                    *address,
                )
                # One assignment, not two: a connection made meanwhile on another thread reads
                # the old address or the new one, never the new host with the old port.
                host, port = address
                pool.connection_kwargs = {**pool.connection_kwargs, "host": host, "port": port}
            _repoint_connections(pool, *address)
        self._drop_own_unless_in_use()

    def _leave_if_demoted(self, exc: redis.ResponseError) -> None:
        """After ``READONLY`` or ``MASTERDOWN``, drop the connections to the server not in use.

        A failover demotes the old primary to a replica without closing its clients' connections
        (Redis closes only blocked ones), and a replica answers the health check's ``PING``: the
        held connection would go on asking the old node, every try and every task, until the
        worker restarted. Reconnecting resolves the address again (a DNS name that moved with
        the failover: ElastiCache, a Kubernetes Service), as redis-py's Sentinel connections do.
        """
        if isinstance(exc, (ReadOnlyError, MasterDownError)) or reply_code(exc) in _DEMOTED_CODES:
            logger.warning(
                "celery-lock: the lock store %s is no longer a primary (%s); reconnecting",
                address_of(self.client),
                exc,
            )
            # The held connection, unless another thread is using it (it will meet the same
            # reply), and the idle ones: not those in use elsewhere, which may already lead to
            # the new primary and would lose a command on their way.
            self._drop_own_unless_in_use()
            self.client.connection_pool.disconnect(inuse_connections=False)

    def _call(
        self,
        what: str,
        keys: RequestKeys,
        roles: tuple[str, ...],
        tries: list[int] | None,
        script: Script,
        script_keys: Sequence[str],
        args: Sequence[Any],
    ) -> Any:
        """``script`` run with ``script_keys`` and ``args`` (:meth:`_evalsha`), tried again on
        transient errors; its errors raised as the store's.

        ``roles`` names the fields of ``keys`` the call touches (in the order
        :meth:`diagnose` looks at them), ``tries`` counts the runs in its first item (from 1):
        a list made per call, where the caller needs to know. Nothing but the run itself is
        made before a first try that succeeds (almost every one): no closure, no dict of the
        roles, no function and arguments passed on to be called (this runs twice per task)."""
        lock_name = keys.lock
        started = _monotonic()
        try:
            try:
                # The first try runs bare: building tenacity's machinery costs more than the
                # round trip's own client-side work, and almost every call succeeds at once.
                return self._evalsha(script, script_keys, args)
            except REFUSED_ERRORS:
                # Once more, on a new connection: a credential provider whose token had just
                # expired (ElastiCache IAM, Entra ID) fetches a fresh one.
                if tries is not None:
                    tries[0] += 1
                return self._evalsha(script, script_keys, args)
            except TRANSIENT_ERRORS as exc:
                self._unfollow_if_unreachable(exc)
                first_failure = exc
            again = _again(self._evalsha, (script, script_keys, args), tries)
            return self._retry(what, lock_name, again, first_failure, started)
        except REFUSED_ERRORS as exc:
            raise LockStoreError(
                f"{what} refused: {exc} (check the user and password of the lock store URL)",
                lock_name=lock_name,
            ) from exc
        except TRANSIENT_ERRORS as exc:
            raise LockStoreUnavailableError(f"{what} failed: {exc}", lock_name=lock_name) from exc
        except redis.ResponseError as exc:
            redirect = _redirect(exc)
            if redirect:
                # A node of a Redis Cluster of several masters, where another one serves the
                # key's slot. The worker refuses such a store at start.
                raise LockStoreError(
                    f"{what} refused: {redirect}: the lock store {address_of(self.client)} is a "
                    "node of a Redis Cluster of several masters, which celery-lock cannot use; "
                    "point the lock store URL (celery_lock_redis_url, or the task's "
                    "lock_redis_url) at a single endpoint (a plain Redis server, or a cluster of "
                    "one master)",
                    lock_name=lock_name,
                ) from exc
            found = self.diagnose({role: getattr(keys, role) for role in roles})
            if found is not None:
                key, problem = found
                raise LockStateError(
                    f"{what} refused: {problem} (server said: {exc})", lock_name=lock_name, key=key
                ) from exc
            raise LockStoreError(f"{what} got an error reply: {exc}", lock_name=lock_name) from exc
        except redis.RedisError as exc:
            # Neither a reply nor a connection failure (validated URLs leave few such errors).
            # Still a LockStoreError, which callers handle: a release that raised anything
            # else would fail the task it ends.
            raise LockStoreError(f"{what} failed: {exc}", lock_name=lock_name) from exc

    def _retry(
        self,
        what: str,
        lock_name: str,
        fn: Callable[[], T],
        first_failure: Exception,
        started: float,
    ) -> T:
        """Go on after a first try failed with a transient error: tenacity, bounded, jittered.

        The failed first try is replayed as tenacity's attempt 1, so the count of tries, the
        waits and the log lines are those of a retry loop that ran every try, and the deadline
        is measured from the start of the first try. One retry follows whatever the deadline:
        a first try that timed out (5 s, past the deadline) may have run on the server, and only
        a retry with the same token finds out.
        """
        replay: list[Exception] = [first_failure]

        def attempt() -> T:
            if replay:
                raise replay.pop()
            try:
                return fn()
            except TRANSIENT_ERRORS as exc:
                self._unfollow_if_unreachable(exc)
                raise

        # What is left of the deadline: tenacity's clock starts after the first try.
        remaining = self.retry_deadline - (_monotonic() - started)
        retrying = Retrying(
            retry=retry_if_exception(_transient),
            stop=stop_after_attempt(self.retry_attempts)
            | (stop_after_delay(remaining) & stop_after_attempt(2)),
            wait=wait_random_exponential(multiplier=0.05, max=0.5),
            before_sleep=_log_retry(f"{what} of {lock_name}", self.retry_attempts),
            reraise=True,
        )
        return retrying(attempt)

    def diagnose(self, roles: dict[str, str]) -> tuple[str, str] | None:
        """The first key (of ``roles``: role -> key) holding a value celery-lock did not write,
        and what it holds; ``None`` if all look right (or the store cannot be asked)."""
        expected = {"lock": "string", "fence": "string", "done": "string"}
        try:
            for role, key in roles.items():
                kind = _text(self.client.type(key))
                if kind == "none":
                    continue
                if kind != expected[role]:
                    return key, f"{key} holds a {kind}, expected a {expected[role]} ({role})"
                if role == "fence":
                    value = _text(self.client.get(key))
                    number = redis_integer(value)
                    if number is None or not 0 <= number < _FENCE_MAX:
                        return key, f"{key} holds {value[:40]!r}, expected a fence counter"
        except redis.RedisError as exc:
            logger.debug("celery-lock: could not inspect %s: %s", list(roles.values()), exc)
        return None

    def acquire(
        self,
        keys: RequestKeys,
        token: str,
        ttl_ms: int,
        holder: Holder,
        fence_ttl_ms: int,
        replaced_depth: int = 0,
        root_id: str = "",
    ) -> Outcome:
        """Run the acquire script (retried on transient errors: it is re-entrant for ``token``).

        A grant that creates the request's fence counter starts it at this machine's clock in
        microseconds since the epoch, so fences keep increasing across a counter that lapsed,
        was evicted or was lost with a restart (while the callers' clocks agree to within the
        old counter's lifetime); each later grant adds one.

        ``replaced_depth`` is the message's replacement depth (Celery's
        ``replaced_task_nesting``) and ``root_id`` its canvas's root task id: a replacement (or
        a step of one) passes a hand-on marker that a run of the same root wrote at a lesser
        depth, where any other copy finds the request :class:`~celery_lock.lease.Done`.

        Raises:
            LockStoreUnavailableError: the store stayed unreachable (or refusing) for every try.
            LockStateError: a key of the request holds something celery-lock did not write.
            LockStoreError: any other error reply.
        """
        now_us = _time_ns() // 1000
        # A new counter's first fence is the clock (see scripts.ACQUIRE), while a Lua number
        # holds it exactly; a clock past the year 2255 starts it at 1 instead.
        seed = now_us if now_us < _FENCE_MAX else 0
        args: tuple[Any, ...] = (token, ttl_ms, holder.describe(now_us // 1000), fence_ttl_ms, seed)
        if replaced_depth:
            # As a hand-on marker holds it (encode_id: any str a message carries).
            args += (replaced_depth, encode_id(root_id))
        reply = self._call(
            "acquire", keys, _ACQUIRE_ROLES, None,
            self.scripts.acquire, [keys.lock, keys.fence, keys.done], args,
        )  # fmt: skip
        if isinstance(reply, int):  # a grant, as _parse_acquire reads it, without its call
            return Acquired(reply)
        return _parse_acquire(reply, keys.lock)

    def release(
        self, lease: Lease, *, success: bool, done_ttl_ms: int, tried_before: bool = False
    ) -> bool | None:
        """Delete the lock if ``lease`` still owns it, writing the done-marker on success (a
        hand-on marker if ``lease.handed_on`` is set).

        A try whose reply was lost (tried again here on transient errors) may have released it,
        and a later try finds the lease no longer held. A success's later try tells by the
        done-marker naming this task id with no grant made since this lease's (see
        :data:`~celery_lock.scripts.RELEASE`); a failure leaves nothing to tell by.

        Args:
            lease: the lease to release.
            success: write the done-marker (the body completed the request).
            done_ttl_ms: how long the done-marker lives.
            tried_before: an earlier call released ``lease`` and got no answer (the heartbeat
                trying a release again): its tries may have run.

        Returns:
            ``True`` if the lease was still owned (released now, or by an earlier try whose
            reply was lost), ``False`` if it had been lost, ``None`` if it is no longer held
            and, after a try that may have run, nothing tells whether that try released it or
            the lease had been lost.

        Raises:
            LockStoreUnavailableError: the store stayed unreachable (or refusing) for every try.
            LockStateError: a key of the request holds something celery-lock did not write.
            LockStoreError: any other error reply.
        """
        keys = lease.keys
        args = [
            lease.token,
            done_ttl_ms,
            "success" if success else "failure",
            # As encode_done writes it (encode_id's surrogatepass), without its call per task
            # for a marker that is the id: a lone surrogate, which a message may carry, is not
            # refused by redis-py once the body ran.
            lease.holder.task_id.encode("utf-8", "surrogatepass")
            if lease.handed_on is None
            else encode_done(lease.holder.task_id, lease.handed_on),
            lease.fence,
        ]
        tries = [1]
        reply = self._call(
            "release", keys, _RELEASE_ROLES, tries,
            self.scripts.release, [keys.lock, keys.done, keys.fence], args,
        )  # fmt: skip
        retried = tries[0] > 1 or tried_before
        if reply == _RELEASED_BEFORE:
            logger.info(
                "celery-lock: release of %s found it done by an earlier try whose reply was lost",
                keys.lock,
            )
            return True
        if reply == _MAYBE_RELEASED_BEFORE and retried:
            logger.info(
                "celery-lock: release of %s found the lease no longer held: an earlier try "
                "whose reply was lost may have released it, or the lease was lost",
                keys.lock,
            )
            return None
        return bool(reply == 1)

    def granted_again(self, lease: Lease) -> bool:
        """Whether the request of ``lease``, a lease lost, was granted since to a copy whose
        message the lost run's ack may take, and is not done: held by the same task id now, or
        held by nobody, not done, with a fence above the lease's (granted to a holder that died
        since, its lease lapsed). One ``MGET``, not tried again: ``False`` if the store does not
        answer, or a key holds something celery-lock did not write (for a caller that does
        without an answer, as before it asked)."""
        keys = lease.keys
        try:
            held, fence, done = self.client.mget(keys.lock, keys.fence, keys.done)
            if held is not None:
                return decode_lock(held).holder.task_id == lease.holder.task_id
            return done is None and fence is not None and int(fence) > lease.fence
        except (redis.RedisError, ValueError, KeyError, TypeError):
            return False

    def withdraw_hand_on(
        self, keys: RequestKeys, task_id: str, hand_on: HandOn, *, most_ttl_left_ms: int = 0
    ) -> bool | None:
        """Delete the hand-on marker task ``task_id`` wrote as it handed the request on
        (``hand_on``), not yet sent, if the done-marker of ``keys`` still is that marker: a later
        copy must run the request.
        Return whether it was; ``None`` where it was, but has more than ``most_ttl_left_ms``
        (when above 0) of its TTL left: written too recently to be a dead run's.

        Raises:
            LockStoreUnavailableError: the store stayed unreachable (or refusing) for every try.
            LockStateError: the done-marker key holds something celery-lock did not write.
            LockStoreError: any other error reply.
        """
        written = encode_done(task_id, replace(hand_on, sent=False))
        reply = self._swap_hand_on("withdraw", keys, [written, "", most_ttl_left_ms])
        return None if reply < 0 else bool(reply)

    def confirm_hand_on(self, lease: Lease, done_ttl_ms: int) -> bool:
        """Mark the hand-on marker ``lease``'s release wrote as sent (``HANDED_ON``), if the
        done-marker still is that marker: its replacement went out, and a redelivery of the
        replaced message is acked unrun. Return whether it was.

        Raises: as :meth:`withdraw_hand_on`.
        """
        assert lease.handed_on is not None
        task_id = lease.holder.task_id
        written = encode_done(task_id, lease.handed_on)
        sent = encode_done(task_id, replace(lease.handed_on, sent=True))
        return bool(self._swap_hand_on("confirm", lease.keys, [written, sent, done_ttl_ms]))

    def _swap_hand_on(self, what: str, keys: RequestKeys, args: list[Any]) -> int:
        reply: int = self._call(
            what, keys, ("done",), None, self.scripts.swap_hand_on, [keys.done], args
        )
        return reply

    def extend_all(self, leases: Sequence[Lease]) -> list[bool]:
        """Reset the TTL of every lease in one pipelined round trip; ``True`` where still owned.

        Each owned lease's fence counter is kept alive at least ``lease.fence_ttl_ms`` from now
        (never shortened), so a run longer than that TTL does not outlive its counter.

        Uses ``EVALSHA`` directly: a pipeline given a ``Script`` checks ``SCRIPT EXISTS`` first,
        which would double the heartbeat's round trips. After ``NOSCRIPT`` the script is loaded
        and the pipeline sent once more (extending is idempotent). A lease whose lock key holds
        something else than a lock (an error reply for that lease alone) is not owned.

        Raises:
            redis.ConnectionError, redis.TimeoutError: the store is unreachable, or refused for
                now (:class:`TransientReplyError`), after one more try.
        """
        if not leases:
            return []
        extend = self.scripts.extend

        def send() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for lease in leases:
                pipe.evalsha(extend.sha, 2, lease.keys.lock, lease.keys.fence, lease.token,
                             lease.ttl_ms, lease.fence_ttl_ms)  # fmt: skip
            return list(pipe.execute(raise_on_error=False))

        def run() -> list[Any]:
            try:
                replies = send()
                if any(isinstance(reply, NoScriptError) for reply in replies):
                    self._scripts_missing(extend)
                    self._load(extend)
                    replies = send()
            except redis.ResponseError as exc:
                # An error reply to the whole pipeline, not to one lease: the health check's
                # PING (on a connection idle for its interval) refused with MISCONF, say.
                self._raise_if_transient(exc)
                raise
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self._unfollow_if_unreachable(exc)
                raise
            for reply in replies:
                if isinstance(reply, redis.ResponseError):
                    self._raise_if_transient(reply)
            self._loaded.add(extend.sha)
            return replies

        replies = Retrying(
            retry=retry_if_exception(_transient),
            stop=stop_after_attempt(2),
            reraise=True,
        )(run)
        owned: list[bool] = []
        for lease, reply in zip(leases, replies, strict=True):
            if isinstance(reply, Exception):
                logger.error(
                    "celery-lock: cannot extend the lease on %s: %s", lease.keys.lock, reply
                )
                owned.append(False)
            else:
                owned.append(bool(reply))
        return owned


def _redirect(exc: redis.ResponseError) -> str:
    """``"MOVED <slot> <host:port>"`` (or ``ASK``) for a cluster node's redirect, else ``""``.
    redis-py 8 raises it as :class:`MovedError` and strips the code from the message, which
    then says only ``"<slot> <host:port>"``; redis-py 5.0 raises a plain error reply that keeps
    the code."""
    if isinstance(exc, AskError):
        return f"{'MOVED' if isinstance(exc, MovedError) else 'ASK'} {exc}"
    return str(exc) if reply_code(exc) in ("MOVED", "ASK") else ""


def _redirect_address(redirect: str) -> tuple[str, int] | None:
    """The ``(host, port)`` a ``MOVED`` redirect names (see :func:`_redirect`); ``None`` for
    no redirect, an ``ASK`` (a slot on its way to another master: the cluster has several), or
    one this cannot read."""
    words = redirect.split()
    if len(words) != 3 or words[0] != "MOVED":
        return None
    host, _, port = words[2].rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _repoint_connections(pool: Any, host: Any, port: Any) -> None:
    """Point every connection of ``pool`` at ``host:port``, and disconnect the idle ones, which
    may still be connected to the old address whatever address they name. redis-py keeps each
    connection's address on the connection, so new ``connection_kwargs`` alone reach only
    connections made later. One in use reconnects there once it is disconnected: by the
    store, or by the next redirect followed after it is back in the pool."""
    idle = list(getattr(pool, "_available_connections", ()))
    for connection in [*idle, *getattr(pool, "_in_use_connections", ())]:
        if hasattr(connection, "host"):
            connection.host, connection.port = host, port
    for connection in idle:
        connection.disconnect()


def cluster_masters(client: redis.Redis) -> int | None:
    """How many masters serve slots in the cluster of the store's node (``cluster_size``);
    ``None`` where ``CLUSTER INFO`` is refused or fails (a server not in cluster mode, an ACL
    that denies ``CLUSTER``, or one gone)."""
    try:
        info = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
    except redis.RedisError as exc:
        logger.debug("celery-lock: no cluster check of the lock store: %s", exc)
        return None
    text = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "cluster_size" and value.strip().isdigit():
            return int(value)
    return None


#: The keys each script touches, in the order :meth:`LockStore.diagnose` looks at them.
_ACQUIRE_ROLES = ("lock", "fence", "done")
_RELEASE_ROLES = ("lock", "done", "fence")


def _again(
    fn: Callable[..., T], fn_args: tuple[Any, ...], tries: list[int] | None
) -> Callable[[], T]:
    """``fn(*fn_args)`` as a call of no arguments, for the tries after a first one failed,
    each counted in ``tries`` (if given)."""

    def call() -> T:
        if tries is not None:
            tries[0] += 1
        return fn(*fn_args)

    return call


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, TRANSIENT_ERRORS) and not isinstance(exc, REFUSED_ERRORS)


def _packs_with_hiredis(connection: Any) -> bool:
    """Whether ``connection`` packs commands with hiredis (redis-py does when hiredis is
    installed): then :func:`hiredis.pack_command` writes exactly what it would send."""
    packer = getattr(connection, "_command_packer", None)
    return _pack_command is not None and type(packer).__name__ == "HiredisRespSerializer"


def _check_out(pool: Any) -> Any:
    """A connected connection of ``pool``, kept in use (``client.close()`` still closes it)."""
    try:
        return pool.get_connection()
    except TypeError:  # redis-py < 5.3 wants a command name
        return pool.get_connection("EVALSHA")


def connect(client: redis.Redis) -> None:
    """Open one connection of ``client``'s pool, as its first command would (the URL's user and
    password, its database, and a lock store's handshake, which sends ``PING``), and put it back
    for the next command: errors of the connection apart from those of a command.

    Raises:
        redis.RedisError: what connecting raised (the server unreachable, a wrong password, a
            database out of range, a server that does not speak Redis).
    """
    pool = client.connection_pool
    pool.release(_check_out(pool))


def reach(client: redis.Redis) -> None:
    """Make one round trip that any user the scripts can run as may make: ``SCRIPT EXISTS``
    (``@scripting``, no key), where ``PING`` (``@connection``) may be refused.

    Raises:
        redis.RedisError: what connecting raised (the server unreachable, a wrong password, a
            database out of range or a ``SELECT`` the user may not send), as any command would.
    """
    client.script_exists(_ABSENT_SHA)


#: A script digest no script has: ``reach`` asks whether it is loaded.
_ABSENT_SHA = "0" * 40


def client_for_url(url: str, **options: Any) -> redis.Redis:
    """A client for a lock store URL, ``options`` passed on to its connections: redis-py's
    ``Redis.from_url`` for ``redis://``, ``rediss://`` and ``unix://``, and for
    ``sentinel://`` a client of the master the sentinels name
    (:func:`celery_lock.sentinel.sentinel_master_client`)."""
    if is_sentinel_url(url):
        return sentinel_master_client(url, **options)
    client: redis.Redis = redis.Redis.from_url(url, **options)
    return client


def address_of(client: redis.Redis) -> str:
    """Where ``client`` connects, for messages: ``host:port``, ``unix://path``, or for a
    sentinel master ``master <name> at host:port`` (where it was last found)."""
    pool = client.connection_pool
    service = getattr(pool, "service_name", None)
    if service is not None:  # redis-py's SentinelConnectionPool
        found = getattr(pool, "master_address", None)
        where = f" at {found[0]}:{found[1]}" if found else ""
        return f"master {service}{where}"
    kwargs = pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


def _address_of_connection(connection: Any) -> tuple[Any, Any] | None:
    """Where a connection is connected: ``(host, port)``, ``(path, None)`` for a unix socket."""
    if getattr(connection, "path", None):
        return (connection.path, None)
    host = getattr(connection, "host", None)
    return None if host is None else (host, getattr(connection, "port", None))


def _parse_run_id(info: Any) -> str | None:
    text = _text(info)
    for line in text.splitlines():
        if line.startswith("run_id:"):
            return line.split(":", 1)[1].strip() or None
    return None


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


_REDIS_INTEGER = re.compile(r"0|-?[1-9][0-9]{0,18}")


def redis_integer(text: str) -> int | None:
    """``text`` as an integer if ``INCR`` reads it as one (a signed 64-bit integer, written
    plainly), else ``None``: ``int()`` would also take ``"1_000"``, ``" 12"`` or ``"007"``."""
    if not _REDIS_INTEGER.fullmatch(text):
        return None
    number = int(text)
    return number if -(2**63) <= number < 2**63 else None


def _parse_acquire(reply: Any, lock_name: str) -> Outcome:
    if isinstance(reply, int):
        return Acquired(fence=reply)
    try:
        kind = _text(reply[0])
        if kind == "held":
            entry = decode_lock(reply[1], with_token=False)
            held = Held(
                task_id=entry.holder.task_id,
                task_name=entry.holder.task_name,
                pttl_ms=int(reply[2]),
            )
            if not held.task_name or held.pttl_ms < 0:
                # Every lock celery-lock writes names its task and has a TTL: this one would
                # block the request for ever.
                raise LockStateError(
                    f"{lock_name} holds a lock celery-lock did not write "
                    f"(task {held.task_name!r}, TTL {held.pttl_ms} ms): delete it",
                    lock_name=lock_name,
                    key=lock_name,
                )
            return held
        if kind == "done":
            return decode_done(reply[1])
    except (IndexError, KeyError, TypeError, ValueError):
        pass
    raise LockStateError(
        f"{lock_name} holds something celery-lock did not write "
        f"(the acquire script answered {reply!r}): delete it",
        lock_name=lock_name,
        key=lock_name,
    )
