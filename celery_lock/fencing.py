"""Fenced writes: make a store reject a holder whose lease was lost.

A lease can be lost while its body still runs: the process paused (GC, swap, ``SIGSTOP``, a VM
migration) past the lease's TTL, another copy took the request, and then the paused body wakes
and writes. No lock can stop that write; the store receiving it can. Every grant of a request's
lease carries a **fence**, strictly greater than every earlier grant's for that request
(``self.request.lock_fence``). Hand it to each write; the store keeps the largest fence it has
accepted and refuses a write with a smaller one (Kleppmann's fencing tokens).

The rule, here and in :func:`fenced_update`: a write is accepted when its fence is **greater than
or equal to** the stored fence. Equal is allowed because a fence belongs to one grant: the same
holder may write twice, or retry a write whose reply was lost. A smaller fence is a stale holder.

Worker side, with the record in Redis::

    import redis
    from celery_lock import LockedTask
    from celery_lock.fencing import FencedRedis

    sink = FencedRedis(redis.Redis.from_url("redis://results:6379/0"))

    @app.task(base=LockedTask, bind=True, lock_key="order_id")
    def settle(self, order_id):
        total = compute_total(order_id)
        # Raises StaleFenceError if a later holder of this order has written already.
        sink.set(f"total:{order_id}", total, self.request.lock_fence, raise_on_stale=True)

or in a SQL table with a ``fence`` column (the row must exist; ``NULL`` counts as no fence)::

    from celery_lock.fencing import fenced_update

    @app.task(base=LockedTask, bind=True, lock_key="order_id")
    def settle(self, order_id):
        conn = connect()  # any DB-API connection; the update runs in its transaction
        try:
            written = fenced_update(conn, "orders", "id", order_id,
                                    {"status": "settled"}, self.request.lock_fence)
            conn.commit()  # not every driver's "with conn:" commits (PyMySQL's only closes)
        finally:
            conn.close()
        if not written:
            ...  # a later holder got there first (or the row is missing): leave it alone

The same pattern by hand, for any SQL store::

    UPDATE orders SET status = :status, fence = :fence
     WHERE id = :id AND (fence IS NULL OR fence <= :fence)

Fences are large: a grant that creates a request's counter starts it at the granting process's
clock in microseconds since the epoch (16 digits), so that a counter that expired, was evicted
or was lost with a restart starts again above the fences it gave. Keep them in a 64-bit column
(``BIGINT``); they stay below :data:`MAX_FENCE`.

What fencing does not give: a fence only orders grants **of one request** (the counter is per
request key), so keep one fenced record per request. The counter lives at least the lease TTL
plus the longer of the lease TTL and the done TTL (``celery_lock_done_ttl``) after the last
grant or heartbeat; a new one, started from a clock that is behind the old counter's by more
than that, would give smaller fences than the old: keep the workers' clocks in sync. Only
stores that check the fence are protected; a stale holder can still send an e-mail or write to
a store that does not. And
:meth:`celery_lock.LockedTask.check_lock` before a write narrows the window but cannot close it:
the process can pause between the check and the write.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import redis
from redis.commands.core import Script

from .exceptions import StaleFenceError

__all__ = [
    "FENCED_SET",
    "MAX_FENCE",
    "FencedRedis",
    "FencedValue",
    "StaleFenceError",
    "fenced_get",
    "fenced_set",
    "fenced_update",
]

#: The largest fence accepted: Lua compares numbers as doubles, exact up to 2**53.
MAX_FENCE = 2**53
# The longest record TTL, in milliseconds: above 2**53 the Lua script's tonumber() is no longer
# exact, and far above it PEXPIRE refuses the value; 2**53 ms is some 285,000 years.
_MAX_TTL_MS = 2**53

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A table may be schema-qualified: each part a plain identifier, used unquoted like the others.
_TABLE = re.compile(rf"(?:{_IDENTIFIER.pattern}\.)?{_IDENTIFIER.pattern}")
_PARAMSTYLES = ("qmark", "numeric", "named", "format", "pyformat")

# KEYS[1] - the fenced record (hash: value, fence)
# ARGV[1] - value
# ARGV[2] - fence of the writer (an integer, 0 <= fence <= 2**53)
# ARGV[3] - TTL of the record in milliseconds; 0 leaves its expiry as it is
# return {1, <fence>} if accepted (no fence stored, or the stored one is <= ARGV[2]): both
#        fields written
#      | {0, <stored fence>} if the writer's fence is smaller: nothing written
FENCED_SET = """
local fence = tonumber(ARGV[2])
local stored = tonumber(redis.call('HGET', KEYS[1], 'fence'))
if stored and fence < stored then
    return {0, stored}
end
redis.call('HSET', KEYS[1], 'value', ARGV[1], 'fence', ARGV[2])
if tonumber(ARGV[3]) > 0 then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return {1, fence}
"""


@dataclass(frozen=True)
class FencedValue:
    """A fenced record as stored: the value and the fence of the write that stored it.

    ``value`` is ``bytes``, or ``str`` from a client made with ``decode_responses=True``.

    .. versionadded:: 0.1.0
    """

    value: bytes | str
    fence: int


def _check_fence(fence: int) -> int:
    if fence is None:
        # What a body run unlocked under fail_open has as self.request.lock_fence: no grant, so
        # nothing a store could order its write by.
        raise TypeError(
            "a fence is an int, got None: a body run unlocked (celery_lock_fail_open) has no "
            "fence (self.request.lock_fence is None), so it cannot make a fenced write"
        )
    if isinstance(fence, bool) or not isinstance(fence, int):
        raise TypeError(f"a fence is an int, got {type(fence).__name__}")
    if not 0 <= fence <= MAX_FENCE:
        raise ValueError(f"a fence is between 0 and 2**53, got {fence}")
    # A plain int: redis-py sends an int as its repr(), and an int subclass's (an IntEnum
    # member's "<Grant.FIRST: 5>") would be stored as the record's fence, a fence that no longer
    # reads as a number, so that any later write, however stale, is accepted.
    return int(fence)


class FencedRedis:
    """Fenced records in Redis: one hash per record holding ``value`` and ``fence``.

    Registers :data:`FENCED_SET` on ``client`` once; each write is one ``EVALSHA`` on one key,
    so it runs unchanged on Redis Cluster.

    Args:
        client: the Redis client of the store that receives the writes: a ``redis.Redis``, or
            a ``redis.cluster.RedisCluster``.

    .. versionadded:: 0.1.0
    """

    def __init__(self, client: redis.Redis | redis.RedisCluster) -> None:
        self.client = client
        self._script: Script = client.register_script(FENCED_SET)

    def set(
        self,
        key: str,
        value: bytes | str | int | float,
        fence: int,
        *,
        ttl: float | None = None,
        raise_on_stale: bool = False,
    ) -> bool:
        """Store ``value`` at ``key`` unless a larger fence than ``fence`` is stored there.

        Args:
            key: the record's key; one record per request (fences order one request only).
            value: what to store.
            fence: the writer's fence, ``self.request.lock_fence`` in a task.
            ttl: seconds the record lives from this write; ``None`` leaves its expiry as is.
            raise_on_stale: raise instead of returning ``False`` when the write is refused.

        Returns:
            Whether the write was accepted (``fence`` >= the stored fence).

        Raises:
            StaleFenceError: the write was refused and ``raise_on_stale`` is set.
            TypeError: ``fence`` is not an int.
            ValueError: ``fence`` is negative or above :data:`MAX_FENCE`, or ``ttl`` is not
                a positive, finite number of seconds (up to 2**53 milliseconds).
        """
        fence = _check_fence(fence)
        ttl_ms = 0
        if ttl is not None:
            # Checked before int(): int(inf) raises OverflowError, not the documented ValueError.
            # Comparisons only (NaN and inf fail them): math.isfinite would raise OverflowError
            # for an int too large for a float (ttl=10**400).
            if not (ttl > 0 and ttl * 1000 <= _MAX_TTL_MS):
                raise ValueError(
                    f"ttl must be a positive number of seconds up to 2**53 ms, got {ttl!r}"
                )
            ttl_ms = max(1, int(ttl * 1000))
        accepted, stored = self._script(keys=[key], args=[value, fence, ttl_ms])
        if accepted:
            return True
        if raise_on_stale:
            raise StaleFenceError(key, fence, int(stored))
        return False

    def get(self, key: str) -> FencedValue | None:
        """The record at ``key`` with its fence, or ``None`` if there is none."""
        value, fence = self.client.hmget(key, ["value", "fence"])
        if value is None or fence is None:
            return None
        return FencedValue(value=value, fence=int(fence))


def fenced_set(
    client: redis.Redis | redis.RedisCluster,
    key: str,
    value: bytes | str | int | float,
    fence: int,
    *,
    ttl: float | None = None,
    raise_on_stale: bool = False,
) -> bool:
    """Store ``value`` at ``key`` in Redis unless a larger fence is stored there.

    A one-off :meth:`FencedRedis.set`; keep a :class:`FencedRedis` for repeated writes.

    Returns:
        Whether the write was accepted.

    Raises:
        StaleFenceError: the write was refused and ``raise_on_stale`` is set.

    .. versionadded:: 0.1.0
    """
    return FencedRedis(client).set(key, value, fence, ttl=ttl, raise_on_stale=raise_on_stale)


def fenced_get(client: redis.Redis | redis.RedisCluster, key: str) -> FencedValue | None:
    """The fenced record at ``key`` written by :func:`fenced_set`, or ``None``.

    .. versionadded:: 0.1.0
    """
    return FencedRedis(client).get(key)


class _Cursor(Protocol):
    rowcount: int

    def execute(self, operation: str, parameters: Any = ..., /) -> Any: ...

    def fetchone(self) -> Any: ...

    def close(self) -> Any: ...


class _Connection(Protocol):
    def cursor(self) -> Any: ...


def _identifier(name: str, what: str) -> str:
    """``name`` as a plain ``str`` once checked: the text checked is the text formatted in.

    A ``str`` subclass formats as it likes: a ``(str, Enum)`` member as ``Column.ID``, not as
    the ``id`` it holds, and any subclass as text that was never checked.
    """
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise ValueError(f"{what} must match [A-Za-z_][A-Za-z0-9_]*, got {name!r}")
    return str.__str__(name)


def _table(name: str) -> str:
    """``name`` as a plain ``str`` once checked (see :func:`_identifier`)."""
    if not isinstance(name, str) or not _TABLE.fullmatch(name):
        raise ValueError(
            f"table must match [A-Za-z_][A-Za-z0-9_]*, or schema.table with each part so, "
            f"got {name!r}"
        )
    return str.__str__(name)


def _check_connection(conn: _Connection) -> None:
    # Checked first: without a cursor() the paramstyle lookup fails, and its "pass paramstyle="
    # would only lead to an AttributeError. SQLAlchemy's Session, Connection and Engine are the
    # usual cases; a Connection's .connection is its DB-API connection, in its transaction.
    if not callable(getattr(conn, "cursor", None)):
        raise TypeError(
            f"conn must be a DB-API connection (with cursor()), got {type(conn).__name__}: "
            "with SQLAlchemy, pass connection.connection (session.connection().connection) "
            "to update in that transaction, or engine.raw_connection()"
        )


def _paramstyle(conn: _Connection) -> str:
    # SQLAlchemy's engine.raw_connection() is a pool proxy (sqlalchemy.pool): the driver's
    # connection is inside it (driver_connection; dbapi_connection on older SQLAlchemy).
    for attribute in ("driver_connection", "dbapi_connection"):
        inner = getattr(conn, attribute, None)
        if inner is not None:
            conn = inner
            break
    module = type(conn).__module__
    # The driver's top-level package, where DB-API puts paramstyle and where users set it
    # (pg8000.paramstyle = "named"; pg8000.legacy has its own, which the cursor ignores); else
    # the nearest module below it that has one: mysql-connector's connection class lives in
    # mysql.connector.connection, its paramstyle in mysql.connector, and mysql has none.
    parts = module.split(".")
    style = None
    for end in (1, *range(len(parts), 1, -1)):
        style = getattr(sys.modules.get(".".join(parts[:end])), "paramstyle", None)
        if style is not None:
            break
    if style not in _PARAMSTYLES:
        raise ValueError(
            f"cannot tell the paramstyle of {module}.{type(conn).__name__}: "
            f"pass paramstyle= (one of {', '.join(_PARAMSTYLES)})"
        )
    return str(style)


def _placeholders(style: str, count: int) -> tuple[list[str], bool]:
    """SQL placeholders for ``count`` positional values, and whether to bind a dict."""
    if style == "qmark":
        return ["?"] * count, False
    if style == "numeric":
        return [f":{i}" for i in range(1, count + 1)], False
    if style == "named":
        return [f":p{i}" for i in range(count)], True
    if style == "format":
        return ["%s"] * count, False
    if style == "pyformat":
        return [f"%(p{i})s" for i in range(count)], True
    raise ValueError(f"paramstyle must be one of {', '.join(_PARAMSTYLES)}, got {style!r}")


def _bound(params: list[Any], named: bool) -> Any:
    """``params`` as the driver binds them: a list, or a dict ``p0, p1, ...`` for named styles."""
    return {f"p{i}": value for i, value in enumerate(params)} if named else params


def fenced_update(
    conn: _Connection,
    table: str,
    key_column: str,
    key: Any,
    values: Mapping[str, Any],
    fence: int,
    *,
    fence_column: str = "fence",
    paramstyle: str | None = None,
    raise_on_stale: bool = False,
) -> bool:
    """Update one row unless it carries a larger fence; store ``fence`` with the update.

    Runs, with every value bound as a parameter::

        UPDATE <table> SET <column> = ?, ..., <fence_column> = ?
         WHERE <key_column> = ? AND (<fence_column> IS NULL OR <fence_column> <= ?)

    in the connection's current transaction: commit it yourself. Names are checked against
    ``[A-Za-z_][A-Za-z0-9_]*`` and used unquoted, so no SQL can come in through them; a name
    that is a reserved word of the database (``key`` in MySQL, ``user`` in PostgreSQL) is a
    syntax error there, so rename such a column or write the update by hand.

    Args:
        conn: a DB-API 2.0 connection (``sqlite3``, ``psycopg``, ...; with SQLAlchemy, a
            ``Connection``'s ``.connection``).
        table: the table's name, optionally schema-qualified (``schema.table``).
        key_column: the column identifying the row, e.g. the request key.
        key: the row's key value.
        values: the columns to set and their new values (not the key or fence column).
        fence: the writer's fence, ``self.request.lock_fence`` in a task.
        fence_column: the integer column holding the row's fence.
        paramstyle: the driver's placeholder style; by default the ``paramstyle`` of the
            driver's top-level package, else of the nearest module below it that has one, read
            from the connection's class (inside SQLAlchemy's ``engine.raw_connection()``, the
            driver's connection's).
        raise_on_stale: raise instead of returning ``False`` when no row was updated.

    Returns:
        Whether the row was updated. ``False`` means a larger fence is stored, or there is no
        such row (insert rows before fenced updates). The driver's ``rowcount`` must count
        matched rows (MySQL: connect with ``CLIENT.FOUND_ROWS``).

    Raises:
        StaleFenceError: nothing was updated and ``raise_on_stale`` is set; before raising, one
            ``SELECT`` of the row's fence tells a larger fence (``current``) from a missing row
            (``missing``). Under REPEATABLE READ that ``SELECT`` reads the transaction's
            snapshot, the ``UPDATE`` the latest row: where the snapshot would allow the write,
            ``current`` is ``None`` and the message says why the two differ.
        ValueError: a name is not a plain identifier (the table may be ``schema.table``),
            ``values`` is empty or names the key or fence column (in any letter case), or the
            paramstyle is unknown.
        TypeError: ``fence`` is not an int, or ``conn`` has no ``cursor()`` (SQLAlchemy's
            ``Session``, ``Connection`` or ``Engine``: pass ``connection.connection``).

    .. versionadded:: 0.1.0
    """
    fence = _check_fence(fence)
    _check_connection(conn)
    # The names as plain str: the text checked is the text formatted into the SQL.
    table = _table(table)
    key_column = _identifier(key_column, "key_column")
    fence_column = _identifier(fence_column, "fence_column")
    if not values:
        raise ValueError("values must name at least one column to set")
    columns = [_identifier(column, "a column in values") for column in values]
    # Unquoted SQL names ignore case: "IDX" is the column "idx".
    reserved = {key_column.casefold(), fence_column.casefold()}
    if any(column.casefold() in reserved for column in columns):
        raise ValueError(f"values must not set {key_column!r} or {fence_column!r}")
    style = paramstyle or _paramstyle(conn)
    params = [*values.values(), fence, key, fence]
    marks, named = _placeholders(style, len(params))
    targets = [*columns, fence_column]
    assignments = [
        f"{col} = {mark}" for col, mark in zip(targets, marks[: len(targets)], strict=True)
    ]
    # Only validated identifiers and placeholders are formatted in; every value is bound.
    sql = (
        f"UPDATE {table} SET {', '.join(assignments)}"
        f" WHERE {key_column} = {marks[-2]}"
        f" AND ({fence_column} IS NULL OR {fence_column} <= {marks[-1]})"
    )
    cursor: _Cursor
    with contextlib.closing(conn.cursor()) as cursor:
        cursor.execute(sql, _bound(params, named))
        updated = cursor.rowcount > 0
    if not updated and raise_on_stale:
        raise _refusal(conn, style, table, key_column, key, fence_column, fence)
    return updated


def _refusal(
    conn: _Connection,
    style: str,
    table: str,
    key_column: str,
    key: Any,
    fence_column: str,
    fence: int,
) -> StaleFenceError:
    """Why an update matched no row: a larger fence stored (and which), or no such row.

    Under REPEATABLE READ (MySQL's and MariaDB's default) the ``UPDATE`` matched against the
    latest committed row while this ``SELECT`` reads the transaction's snapshot, so what it
    reads is only reported as the reason where it agrees with the refusal.
    """
    [mark], named = _placeholders(style, 1)
    cursor: _Cursor
    with contextlib.closing(conn.cursor()) as cursor:
        # As in the UPDATE, only validated identifiers and a placeholder are formatted in.
        cursor.execute(
            f"SELECT {fence_column} FROM {table} WHERE {key_column} = {mark}",
            _bound([key], named),
        )
        found = cursor.fetchone()
    record = f"{table}:{key}"
    if found is None:
        return StaleFenceError(
            record,
            fence,
            missing=True,
            detail=f"{record} does not exist as this transaction reads it (insert rows before "
            "fenced updates), or is a row committed with a larger fence after this "
            "transaction's snapshot (REPEATABLE READ)",
        )
    # A tuple, or a mapping where the connection's cursor makes rows dicts (pymysql's
    # DictCursor, psycopg's dict_row, a sqlite3 row_factory).
    value: Any = next(iter(found.values()), None) if isinstance(found, Mapping) else found[0]
    try:
        current = None if value is None else int(value)
    except (TypeError, ValueError):  # not a number: no fence to name
        return StaleFenceError(record, fence)
    if current is not None and current > fence:
        return StaleFenceError(record, fence, current)
    # NULL or a fence <= the caller's would have let the UPDATE through: this is not the row
    # the UPDATE saw, so it must not be reported as the store's fence.
    seen = "no fence" if current is None else f"fence {current}"
    detail = (
        f"the row as this transaction reads it ({seen}) allows the write, so another"
        " transaction changed it after this transaction's snapshot (REPEATABLE READ)"
    )
    if current == fence:
        # Also what a rowcount of changed rows reports for a write of the same values again.
        detail += (
            ", or the driver's rowcount counts changed rows only (MySQL without"
            " CLIENT.FOUND_ROWS) and the row already held these values"
        )
    return StaleFenceError(record, fence, detail=detail)
