"""Fenced writes: the Redis script against the session's redis-server, the SQL helper on sqlite3.

The rule under test: a write is accepted when its fence is >= the stored one (the same holder
may write twice), refused when it is smaller.
"""

from __future__ import annotations

import enum
import math
import os
import random
import re
import sqlite3
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import granted
from programs import run_program

from celery_lock import CeleryLockError
from celery_lock.config import LockSettings
from celery_lock.fencing import (
    MAX_FENCE,
    FencedRedis,
    FencedValue,
    StaleFenceError,
    fenced_get,
    fenced_set,
    fenced_update,
)
from celery_lock.keys import RequestKeys
from celery_lock.lease import Holder, Lease, new_token
from celery_lock.store import LockStore
from celery_lock.testing import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
SINK_DB = 5
KEY = "sink:order-42"


@pytest.fixture
def sink(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client on an emptied database of the session's redis-server."""
    client = redis_server.client(SINK_DB)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def db(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(tmp_path / "fenced.db")
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT, fence INTEGER)")
    conn.executemany("INSERT INTO orders VALUES (?, 'new', NULL)", [(1,), (2,)])
    conn.commit()
    yield conn
    conn.close()


def row(conn: sqlite3.Connection, key: int = 1) -> tuple[str, int | None]:
    status, fence = conn.execute("SELECT status, fence FROM orders WHERE id = ?", (key,)).fetchone()
    return status, fence


# -- Redis ------------------------------------------------------------------------------------


def test_first_write_is_stored_with_its_fence(sink: redis.Redis) -> None:
    assert fenced_set(sink, KEY, "paid", 3) is True
    assert fenced_get(sink, KEY) == FencedValue(b"paid", 3)
    assert sink.hgetall(KEY) == {b"value": b"paid", b"fence": b"3"}


def test_higher_fence_is_accepted(sink: redis.Redis) -> None:
    fenced_set(sink, KEY, "first", 1)
    assert fenced_set(sink, KEY, "second", 2) is True
    assert fenced_get(sink, KEY) == FencedValue(b"second", 2)


def test_lower_fence_is_rejected_and_changes_nothing(sink: redis.Redis) -> None:
    fenced_set(sink, KEY, "newer", 5)
    assert fenced_set(sink, KEY, "stale", 4) is False
    assert fenced_get(sink, KEY) == FencedValue(b"newer", 5)


def test_same_fence_may_write_again(sink: redis.Redis) -> None:
    fenced_set(sink, KEY, "draft", 2)
    assert fenced_set(sink, KEY, "final", 2) is True
    assert fenced_get(sink, KEY) == FencedValue(b"final", 2)


def test_rejected_write_raises_when_asked(sink: redis.Redis) -> None:
    sink_writer = FencedRedis(sink)
    sink_writer.set(KEY, "newer", 7)
    with pytest.raises(StaleFenceError) as caught:
        sink_writer.set(KEY, "stale", 6, raise_on_stale=True)
    error = caught.value
    assert isinstance(error, CeleryLockError)
    assert (error.record, error.fence, error.current) == (KEY, 6, 7)
    assert str(error) == f"stale fence 6 for {KEY}: the store holds 7"
    assert error.args == (KEY, 6, 7, False, None)  # rebuilt from a result backend as the same error
    assert error.missing is False


def test_ttl_sets_the_records_expiry(sink: redis.Redis) -> None:
    fenced_set(sink, KEY, "v", 1, ttl=30)
    assert 29_000 < sink.pttl(KEY) <= 30_000
    fenced_set(sink, "sink:no-ttl", "v", 1)
    assert sink.pttl("sink:no-ttl") == -1


def test_a_ttl_under_a_millisecond_still_expires_the_record(sink: redis.Redis) -> None:
    # Rounded down, it would be the 0 that tells the script to leave the expiry as it is: a
    # record asked to live a moment would live for ever.
    fenced_set(sink, KEY, "v", 1, ttl=0.0001)
    assert sink.pttl(KEY) != -1  # 1 ms to live, or gone already


@pytest.mark.parametrize(
    "ttl", [math.inf, -math.inf, math.nan, 0, -1, 1e300, pytest.param(10**400, id="10**400")]
)
def test_ttl_that_is_not_a_positive_finite_number_is_a_value_error(
    sink: redis.Redis, ttl: float
) -> None:
    with pytest.raises(ValueError, match="ttl"):
        fenced_set(sink, KEY, "v", 1, ttl=ttl)
    assert not sink.exists(KEY)


def test_missing_record_reads_as_none(sink: redis.Redis) -> None:
    assert fenced_get(sink, "sink:nothing") is None


@pytest.mark.parametrize("fence", [True, 1.0, "3", None])
def test_fence_of_the_wrong_type_is_refused(sink: redis.Redis, fence: Any) -> None:
    with pytest.raises(TypeError):
        fenced_set(sink, KEY, "v", fence)
    assert not sink.exists(KEY)


def test_no_fence_of_an_unlocked_run_is_refused_saying_why(
    sink: redis.Redis, db: sqlite3.Connection
) -> None:
    # self.request.lock_fence in a body run unlocked under fail_open.
    with pytest.raises(TypeError, match="fail_open"):
        fenced_set(sink, KEY, "v", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fail_open"):
        fenced_update(db, "orders", "id", 1, {"status": "paid"}, None)  # type: ignore[arg-type]
    assert not sink.exists(KEY)
    assert row(db) == ("new", None)


class Grant(enum.IntEnum):
    FIRST = 5


@pytest.mark.parametrize("packer", ["default", "python"])
def test_fence_of_an_int_subclass_is_stored_as_its_number(
    redis_server: RedisServer, packer: str
) -> None:
    # redis-py sends an int as its repr(): "<Grant.FIRST: 5>" stored as the fence would read as
    # no fence, and let any later write through. (hiredis's packer refuses an int subclass.)
    kwargs: dict[str, Any] = {"host": "127.0.0.1", "port": redis_server.port, "db": SINK_DB}
    if packer == "python":
        encode = redis.connection.Encoder("utf-8", "strict", False).encode
        kwargs["command_packer"] = redis.connection.PythonRespSerializer(6000, encode)
    client = redis.Redis(connection_pool=redis.ConnectionPool(**kwargs))
    try:
        client.delete(KEY)
        assert fenced_set(client, KEY, "by 5", Grant.FIRST) is True
        assert fenced_set(client, KEY, "stale", 4) is False
        assert fenced_get(client, KEY) == FencedValue(b"by 5", 5)
    finally:
        client.close()
        client.connection_pool.disconnect()


@pytest.mark.parametrize("fence", [-1, MAX_FENCE + 1])
def test_fence_out_of_range_is_refused(sink: redis.Redis, fence: int) -> None:
    with pytest.raises(ValueError, match="fence"):
        fenced_set(sink, KEY, "v", fence)


def test_largest_fence_compares_exactly(sink: redis.Redis) -> None:
    fenced_set(sink, KEY, "top", MAX_FENCE)
    assert fenced_set(sink, KEY, "below", MAX_FENCE - 1) is False
    assert fenced_get(sink, KEY) == FencedValue(b"top", MAX_FENCE)


def test_fenced_writes_run_on_a_redis_cluster_client() -> None:
    """The one-key script on a ``RedisCluster`` client, as the docs promise (its type is in
    ``FencedRedis``'s signature: tests/typing_checks.py), on a one-node cluster."""
    # The cluster bus listens 10000 above the port: redis-server 6.2 wants a port up to 55535.
    port = next(port for port in (free_port() for _ in range(100)) if port <= 55535)
    with RedisServer(port, extra_args=["--cluster-enabled", "yes"]) as server:
        with server.client() as setup:
            setup.execute_command("CLUSTER ADDSLOTS", *range(16384))
            deadline = time.monotonic() + 20
            while setup.execute_command("CLUSTER INFO")["cluster_state"] != "ok":
                assert time.monotonic() < deadline, "the one-node cluster never came up"
                time.sleep(0.05)
        cluster = redis.RedisCluster(host="127.0.0.1", port=server.port)
        try:
            sink = FencedRedis(cluster)
            assert sink.set(KEY, "by B", 2) is True
            assert fenced_set(cluster, KEY, "by A", 1) is False
            with pytest.raises(StaleFenceError) as refused:
                sink.set(KEY, "by A", 1, raise_on_stale=True)
            assert refused.value.current == 2
            assert fenced_get(cluster, KEY) == FencedValue(b"by B", 2)
        finally:
            cluster.close()


def test_concurrent_writers_with_random_fences_end_with_the_largest(
    redis_server: RedisServer, sink: redis.Redis
) -> None:
    fences = random.sample(range(1, 10_000), 400)
    start = threading.Barrier(8)
    accepted: list[int] = []

    def writer(mine: list[int]) -> None:
        client = redis_server.client(SINK_DB)
        store = FencedRedis(client)
        start.wait(10)
        for fence in mine:
            if store.set(KEY, f"by {fence}", fence):
                accepted.append(fence)
        client.close()

    threads = [threading.Thread(target=writer, args=(fences[i::8],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    top = max(fences)
    assert fenced_get(sink, KEY) == FencedValue(f"by {top}".encode(), top)
    assert top in accepted
    assert len(accepted) < len(fences)  # some writers were late, with smaller fences


def test_newer_lease_holder_fences_off_the_one_that_paused(
    redis_server: RedisServer, sink: redis.Redis
) -> None:
    """Fences from real grants: holder A pauses past its TTL, B takes over and writes."""
    store = LockStore.from_url(redis_server.url_for(SINK_DB))
    keys = RequestKeys.build("celery-lock", "shop.settle", "42", "shop.settle")

    def grant(task_id: str) -> int:
        holder = Holder(task_id=task_id, task_name="shop.settle", host="h", pid=os.getpid())
        return granted(store.acquire(keys, new_token(), 100, holder, 60_000))

    fence_a = grant("A")
    time.sleep(0.3)  # A's lease lapses: no heartbeat extends it
    fence_b = grant("B")
    assert fence_b > fence_a
    assert fenced_set(sink, KEY, "by B", fence_b) is True
    assert fenced_set(sink, KEY, "by A", fence_a) is False
    assert fenced_get(sink, KEY) == FencedValue(b"by B", fence_b)
    store.client.close()


# -- SQL --------------------------------------------------------------------------------------


def test_sql_higher_fence_is_accepted(db: sqlite3.Connection) -> None:
    assert fenced_update(db, "orders", "id", 1, {"status": "paid"}, 1) is True
    assert fenced_update(db, "orders", "id", 1, {"status": "shipped"}, 2) is True
    assert row(db) == ("shipped", 2)
    assert row(db, 2) == ("new", None)


def test_sql_lower_fence_is_rejected(db: sqlite3.Connection) -> None:
    fenced_update(db, "orders", "id", 1, {"status": "newer"}, 5)
    assert fenced_update(db, "orders", "id", 1, {"status": "stale"}, 4) is False
    assert row(db) == ("newer", 5)


def test_sql_same_fence_may_write_again(db: sqlite3.Connection) -> None:
    fenced_update(db, "orders", "id", 1, {"status": "draft"}, 3)
    assert fenced_update(db, "orders", "id", 1, {"status": "final"}, 3) is True
    assert row(db) == ("final", 3)


def test_sql_missing_row_is_not_updated(db: sqlite3.Connection) -> None:
    assert fenced_update(db, "orders", "id", 99, {"status": "paid"}, 1) is False


def test_sql_rejected_update_raises_when_asked(db: sqlite3.Connection) -> None:
    fenced_update(db, "orders", "id", 1, {"status": "newer"}, 5)
    with pytest.raises(StaleFenceError, match="stale fence 4 for orders:1") as caught:
        fenced_update(db, "orders", "id", 1, {"status": "stale"}, 4, raise_on_stale=True)
    assert (caught.value.current, caught.value.missing) == (5, False)
    assert str(caught.value) == "stale fence 4 for orders:1: the store holds 5"


@pytest.mark.parametrize("paramstyle", [None, "named"])
def test_sql_refused_update_of_a_missing_row_says_the_row_is_missing(
    db: sqlite3.Connection, paramstyle: str | None
) -> None:
    with pytest.raises(StaleFenceError) as caught:
        fenced_update(
            db, "orders", "id", 99, {"status": "paid"}, 4,
            paramstyle=paramstyle, raise_on_stale=True,
        )  # fmt: skip
    error = caught.value
    assert (error.record, error.fence, error.current, error.missing) == ("orders:99", 4, None, True)
    assert "orders:99 does not exist" in str(error)
    assert "newer" not in str(error)


def test_sql_refused_update_names_the_stored_fence_with_rows_as_dicts(
    db: sqlite3.Connection,
) -> None:
    # pymysql's DictCursor, psycopg's dict_row: the cursor's rows are mappings, not tuples.
    fenced_update(db, "orders", "id", 1, {"status": "newer"}, 5)
    db.row_factory = lambda cursor, values: dict(
        zip((d[0] for d in cursor.description), values, strict=True)
    )
    with pytest.raises(StaleFenceError) as caught:
        fenced_update(db, "orders", "id", 1, {"status": "stale"}, 4, raise_on_stale=True)
    assert (caught.value.current, caught.value.missing) == (5, False)


class SnapshotReads:
    """One transaction as MySQL runs it under REPEATABLE READ: the UPDATE matches the latest
    committed row (``latest``), a plain SELECT reads the snapshot taken at the transaction's
    first read (a second connection to the WAL database, its read transaction open since
    ``__init__``)."""

    def __init__(self, latest: sqlite3.Connection, path: Path) -> None:
        latest.execute("PRAGMA journal_mode=WAL")  # a reader keeps its snapshot across commits
        self.latest = latest
        self.snapshot = sqlite3.connect(path, isolation_level=None)
        self.snapshot.execute("BEGIN")
        self.snapshot.execute("SELECT count(*) FROM orders").fetchone()  # takes the snapshot
        self.used: sqlite3.Cursor | None = None

    def cursor(self) -> SnapshotReads:
        return self

    @property
    def rowcount(self) -> int:
        assert self.used is not None
        return self.used.rowcount

    def execute(self, sql: str, params: Any) -> None:
        reader = self.snapshot if sql.startswith("SELECT") else self.latest
        self.used = reader.execute(sql, params)

    def fetchone(self) -> Any:
        assert self.used is not None
        return self.used.fetchone()

    def close(self) -> None:
        pass

    def refused(self, key: int) -> StaleFenceError:
        """The error of a stale write (fence 5) to row ``key`` in this transaction, which
        then ends."""
        with pytest.raises(StaleFenceError) as caught:
            fenced_update(
                self, "orders", "id", key, {"status": "stale"}, 5,
                paramstyle="qmark", raise_on_stale=True,
            )  # fmt: skip
        self.snapshot.close()
        return caught.value


@pytest.mark.parametrize("before", [None, 3, 5])
def test_sql_refusal_the_snapshot_does_not_explain_names_no_stored_fence(
    db: sqlite3.Connection, tmp_path: Path, before: int | None
) -> None:
    if before is not None:
        fenced_update(db, "orders", "id", 1, {"status": "old"}, before)
        db.commit()
    conn = SnapshotReads(db, tmp_path / "fenced.db")
    fenced_update(db, "orders", "id", 1, {"status": "newer"}, 9)  # after the snapshot
    db.commit()
    error = conn.refused(1)
    # The snapshot's fence (or NULL) would have allowed the write: it is not why it was refused.
    assert (error.record, error.fence, error.current, error.missing) == ("orders:1", 5, None, False)
    seen = "no fence" if before is None else f"fence {before}"
    assert f"the row as this transaction reads it ({seen}) allows the write" in str(error)
    assert "after this transaction's snapshot (REPEATABLE READ)" in str(error)
    assert ("CLIENT.FOUND_ROWS" in str(error)) is (before == 5)
    assert row(db) == ("newer", 9)  # the refusal itself was right


def test_sql_refusal_of_a_row_the_snapshot_lacks_says_it_may_be_newer(
    db: sqlite3.Connection, tmp_path: Path
) -> None:
    conn = SnapshotReads(db, tmp_path / "fenced.db")
    db.execute("INSERT INTO orders VALUES (3, 'newer', 9)")  # committed after the snapshot
    db.commit()
    error = conn.refused(3)
    assert (error.record, error.fence, error.current, error.missing) == ("orders:3", 5, None, True)
    assert "orders:3 does not exist as this transaction reads it" in str(error)
    assert "committed with a larger fence after this transaction's snapshot" in str(error)
    assert row(db, 3) == ("newer", 9)


def test_sql_update_runs_in_the_callers_transaction(db: sqlite3.Connection) -> None:
    fenced_update(db, "orders", "id", 1, {"status": "paid"}, 1)
    db.rollback()
    assert row(db) == ("new", None)


def test_sql_named_paramstyle(db: sqlite3.Connection) -> None:
    updated = fenced_update(db, "orders", "id", 1, {"status": "paid"}, 1, paramstyle="named")
    assert updated is True
    assert row(db) == ("paid", 1)


class RecordingConnection:
    """Records the statement: for the paramstyles sqlite3 does not speak."""

    def __init__(self) -> None:
        self.executed: list[tuple[str, Any]] = []

    def cursor(self) -> RecordingConnection:
        return self

    rowcount = 1

    def execute(self, sql: str, params: Any) -> None:
        self.executed.append((sql, params))

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("style", "marks", "params"),
    [
        ("format", ["%s", "%s", "%s", "%s"], ["paid", 7, 1, 7]),
        ("numeric", [":1", ":2", ":3", ":4"], ["paid", 7, 1, 7]),
        ("pyformat", ["%(p0)s", "%(p1)s", "%(p2)s", "%(p3)s"],
         {"p0": "paid", "p1": 7, "p2": 1, "p3": 7}),
    ],
)  # fmt: skip
def test_sql_placeholders_follow_the_paramstyle(style: str, marks: list[str], params: Any) -> None:
    conn = RecordingConnection()
    assert fenced_update(conn, "orders", "id", 1, {"status": "paid"}, 7, paramstyle=style)
    a, b, c, d = marks
    assert conn.executed == [
        (
            f"UPDATE orders SET status = {a}, fence = {b}"
            f" WHERE id = {c} AND (fence IS NULL OR fence <= {d})",
            params,
        )
    ]


def fake_driver(
    monkeypatch: pytest.MonkeyPatch, styles: dict[str, str | None], where: str
) -> type[RecordingConnection]:
    """Modules ``styles`` (name: its paramstyle, or None for none) and a connection class in
    module ``where``, as a driver package lays them out."""
    for name, style in styles.items():
        module = types.ModuleType(name)
        if style is not None:
            module.paramstyle = style  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, name, module)
    return type("Connection", (RecordingConnection,), {"__module__": where})


@pytest.mark.parametrize(
    ("styles", "where"),
    [
        # mysql-connector: mysql.connector.connection.MySQLConnection; mysql has no paramstyle.
        ({"fakesql": None, "fakesql.connector": "format",
          "fakesql.connector.connection": None}, "fakesql.connector.connection"),
        # The top-level package wins, as DB-API has it: pg8000.paramstyle, which users set,
        # over pg8000.legacy's own (which its cursor ignores).
        ({"fakesql": "format", "fakesql.legacy": "qmark"}, "fakesql.legacy"),
        # sqlite3, psycopg: the top-level package, as before.
        ({"fakesql": "format"}, "fakesql.connections"),
    ],
)  # fmt: skip
def test_sql_paramstyle_is_the_package_s_else_the_nearest_module_s_that_has_one(
    monkeypatch: pytest.MonkeyPatch, styles: dict[str, str | None], where: str
) -> None:
    conn = fake_driver(monkeypatch, styles, where)()
    assert fenced_update(conn, "orders", "id", 1, {"status": "paid"}, 7)
    assert conn.executed[0][0].startswith("UPDATE orders SET status = %s, fence = %s")


@pytest.mark.parametrize("attribute", ["driver_connection", "dbapi_connection"])
def test_sql_paramstyle_is_read_through_a_pool_proxy(
    monkeypatch: pytest.MonkeyPatch, attribute: str
) -> None:
    # SQLAlchemy's raw_connection() is a proxy in sqlalchemy.pool, which has no paramstyle;
    # dbapi_connection is its only name for the driver's connection on older SQLAlchemy.
    driver = fake_driver(monkeypatch, {"fakesql": "format"}, "fakesql")()
    proxy_class = fake_driver(monkeypatch, {"fakepool": None}, "fakepool")
    proxy = proxy_class()
    setattr(proxy, attribute, driver)
    assert fenced_update(proxy, "orders", "id", 1, {"status": "paid"}, 7)
    assert proxy.executed[0][0].startswith("UPDATE orders SET status = %s, fence = %s")


def test_sql_sqlalchemy_raw_connection_is_a_connection(tmp_path: Path) -> None:
    import sqlalchemy  # noqa: PLC0415 - the test extra's; only this test needs it

    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'pooled.db'}")
    conn = engine.raw_connection()
    try:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT, fence INTEGER)")
        conn.execute("INSERT INTO orders VALUES (1, 'new', NULL)")
        assert fenced_update(conn, "orders", "id", 1, {"status": "paid"}, 3) is True
        assert fenced_update(conn, "orders", "id", 1, {"status": "stale"}, 2) is False
        conn.commit()
    finally:
        conn.close()
        engine.dispose()
    with sqlite3.connect(tmp_path / "pooled.db") as check:
        assert row(check) == ("paid", 3)
    check.close()


def test_sql_sqlalchemy_session_is_refused_and_its_dbapi_connection_used(tmp_path: Path) -> None:
    # A Session, Connection or Engine has no cursor(): the error must say what to pass instead
    # (not "pass paramstyle=", which only leads to an AttributeError), and what it names must run
    # the update in the session's transaction.
    import sqlalchemy  # noqa: PLC0415 - the test extra's; only these tests need it
    from sqlalchemy.orm import Session  # noqa: PLC0415

    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'session.db'}")
    with engine.begin() as setup:
        setup.exec_driver_sql(
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT, fence INTEGER)"
        )
        setup.exec_driver_sql("INSERT INTO orders VALUES (1, 'new', NULL)")
    try:
        with Session(engine) as session:
            for wrong in (session, session.connection(), engine):
                for style in ({}, {"paramstyle": "qmark"}):
                    with pytest.raises(TypeError, match=r"\.connection"):
                        fenced_update(wrong, "orders", "id", 1, {"status": "x"}, 3, **style)
            dbapi = session.connection().connection
            assert fenced_update(dbapi, "orders", "id", 1, {"status": "paid"}, 3) is True
            assert fenced_update(dbapi, "orders", "id", 1, {"status": "stale"}, 2) is False
            session.rollback()  # the update was in the session's transaction: it goes too
    finally:
        engine.dispose()
    with sqlite3.connect(tmp_path / "session.db") as check:
        assert row(check) == ("new", None)
    check.close()


def test_sql_unknown_driver_needs_a_paramstyle() -> None:
    with pytest.raises(ValueError, match="paramstyle"):
        fenced_update(RecordingConnection(), "orders", "id", 1, {"status": "paid"}, 1)


@pytest.mark.parametrize(
    "name",
    ["orders; DROP TABLE orders", "orders\n", "1orders", "", 'or"ders', "orders--", "ord ers",
     "ordérs", ".orders", "orders.", "main..orders", "a.main.orders", "main.1orders",
     "main. orders", "main.orders\n"],
)  # fmt: skip
@pytest.mark.parametrize("where", ["table", "key_column", "fence_column", "values"])
def test_sql_names_must_be_plain_identifiers(db: sqlite3.Connection, name: str, where: str) -> None:
    args: dict[str, Any] = {"table": "orders", "key_column": "id", "values": {"status": "x"}}
    if where == "values":
        args["values"] = {name: "x"}
    else:
        args[where] = name
    with pytest.raises(ValueError, match="must match"):
        fenced_update(db, key=1, fence=1, **args)
    assert db.execute("SELECT count(*) FROM orders").fetchone() == (2,)
    assert row(db) == ("new", None)


def test_sql_table_may_be_schema_qualified(db: sqlite3.Connection) -> None:
    # sqlite3 names its database's schema "main", as app.orders names a PostgreSQL schema.
    assert fenced_update(db, "main.orders", "id", 1, {"status": "paid"}, 2) is True
    assert row(db) == ("paid", 2)
    with pytest.raises(StaleFenceError, match=r"main\.orders:1: the store holds 2"):
        fenced_update(db, "main.orders", "id", 1, {"status": "stale"}, 1, raise_on_stale=True)


@pytest.mark.parametrize("where", ["key_column", "fence_column", "values"])
def test_sql_column_names_cannot_be_qualified(db: sqlite3.Connection, where: str) -> None:
    # Only a table lives in a schema; "orders.status" in SET is not SQL everywhere.
    args: dict[str, Any] = {"key_column": "id", "values": {"status": "x"}}
    if where == "values":
        args["values"] = {"orders.status": "x"}
    else:
        args[where] = f"orders.{args.get(where, 'fence')}"
    with pytest.raises(ValueError, match="must match"):
        fenced_update(db, "orders", key=1, fence=1, **args)
    assert row(db) == ("new", None)


def test_sql_values_are_bound_not_spliced(db: sqlite3.Connection) -> None:
    assert fenced_update(db, "orders", "id", "1 OR 1=1", {"status": "x"}, 1) is False
    assert fenced_update(db, "orders", "id", 1, {"status": "'; DROP TABLE orders; --"}, 1)
    assert row(db) == ("'; DROP TABLE orders; --", 1)
    assert row(db, 2) == ("new", None)


@pytest.mark.parametrize(
    "values", [{}, {"fence": 9}, {"id": 3, "status": "x"}, {"ID": 3}, {"Fence": 9}]
)
def test_sql_values_must_set_other_columns(db: sqlite3.Connection, values: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="values"):
        fenced_update(db, "orders", "id", 1, values, 1)
    assert row(db) == ("new", None)


def test_sql_key_and_fence_columns_are_compared_in_any_case(db: sqlite3.Connection) -> None:
    # SQL folds unquoted names: "IDX" would move the row to another key, "FENCE" fake a fence.
    with pytest.raises(ValueError, match="values"):
        fenced_update(db, "orders", "ID", 1, {"id": 9}, 1)
    with pytest.raises(ValueError, match="values"):
        fenced_update(db, "orders", "id", 1, {"status": "x", "FENCE": 99}, 1, fence_column="fence")
    assert row(db) == ("new", None)


def test_sql_concurrent_writers_with_random_fences_end_with_the_largest(tmp_path: Path) -> None:
    path = tmp_path / "race.db"
    with sqlite3.connect(path) as setup:
        setup.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT, fence INTEGER)")
        setup.execute("INSERT INTO orders VALUES (1, 'new', NULL)")
    setup.close()
    fences = random.sample(range(1, 10_000), 200)
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def writer(mine: list[int]) -> None:
        conn = sqlite3.connect(path, timeout=30)
        try:
            start.wait(10)
            for fence in mine:
                fenced_update(conn, "orders", "id", 1, {"status": f"by {fence}"}, fence)
                conn.commit()
        except BaseException as exc:
            errors.append(exc)
        finally:
            conn.close()

    threads = [threading.Thread(target=writer, args=(fences[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    assert not any(thread.is_alive() for thread in threads)
    conn = sqlite3.connect(path)
    top = max(fences)
    assert row(conn) == (f"by {top}", top)
    conn.close()


# -- the example ------------------------------------------------------------------------------


def test_example_runs_and_fences_off_the_stale_holder() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    done = run_program(
        [sys.executable, str(ROOT / "examples" / "fencing.py")], env=env, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [fence_a] = re.findall(r"A holds the lease on order 42 with fence (\d+);", done.stdout)
    assert f"A writes with fence {fence_a}: fenced update REJECTED" in done.stdout
    assert f"B writes with fence {int(fence_a) + 1}: fenced update accepted" in done.stdout
    assert "OK: the stale holder was fenced off" in done.stdout


# -- the fence counter outlives a lapsed lease ------------------------------------------------


@pytest.mark.parametrize(("ttl", "done_ttl"), [(1.0, 1.0), (1.0, 0.5)], ids=["equal", "shorter"])
def test_a_holder_paused_past_its_lease_is_fenced_off_whatever_the_done_ttl(
    lock_url: str, sink: redis.Redis, ttl: float, done_ttl: float
) -> None:
    """The settings' own counter TTL, with a done TTL no longer than the lease's (a periodic
    task's ``lock_done_ttl`` below its period, as concepts.md advises): A is granted and beats
    once, then pauses just past its lease; B is granted and writes; A wakes and writes."""
    settings = LockSettings.resolve({"celery_lock_ttl": ttl, "celery_lock_done_ttl": done_ttl})
    store = LockStore.from_url(lock_url)
    keys = RequestKeys.build("celery-lock", "shop.tick", "7", "shop.tick")

    def grant(task_id: str) -> Lease:
        holder = Holder(task_id=task_id, task_name="shop.tick", host="h", pid=os.getpid())
        token = new_token()
        fence = granted(store.acquire(keys, token, settings.ttl_ms, holder, settings.fence_ttl_ms))
        return Lease(store, keys, token, settings.ttl_ms, fence, holder, settings.fence_ttl_ms)

    try:
        for earlier in ("r1", "r2"):  # earlier runs that failed: no done-marker
            store.release(grant(earlier), success=False, done_ttl_ms=settings.done_ttl_ms)
        a = grant("A")
        assert store.extend_all([a]) == [True]  # A's last heartbeat
        time.sleep(ttl + 0.1)  # A pauses past its lease (not past it by the done TTL)
        b = grant("B")
        b_wrote = fenced_set(sink, KEY, "by B", b.fence)
        a_wrote = fenced_set(sink, KEY, "by A", a.fence)
        assert b.fence > a.fence
        assert (b_wrote, a_wrote) == (True, False)
        assert fenced_get(sink, KEY) == FencedValue(b"by B", b.fence)
    finally:
        store.client.close()


# -- names: the text validated is the text in the SQL -----------------------------------------


class Column(str, enum.Enum):  # a common way to name columns once
    ID = "id"
    STATUS = "status"
    FENCE = "fence"


class Table(str, enum.Enum):
    ORDERS = "orders"


def test_sql_names_given_as_str_enum_members_are_used_as_their_values(
    db: sqlite3.Connection,
) -> None:
    # format() of a (str, Enum) member is "Column.ID", not "id": that is not the name checked.
    assert fenced_update(
        db, Table.ORDERS, Column.ID, 1, {Column.STATUS: "paid"}, 3, fence_column=Column.FENCE
    )
    assert row(db) == ("paid", 3)
    with pytest.raises(StaleFenceError, match="stale fence 2 for orders:1: the store holds 3"):
        fenced_update(
            db, Table.ORDERS, Column.ID, 1, {Column.STATUS: "stale"}, 2,
            fence_column=Column.FENCE, raise_on_stale=True,
        )  # fmt: skip
    assert row(db) == ("paid", 3)


class Disguised(str):
    """A str whose formatting is not its text: the check must see what the SQL gets."""

    def __format__(self, spec: str) -> str:
        return "orders SET fence = 0; --"


@pytest.mark.parametrize("where", ["table", "key_column", "fence_column", "values"])
def test_sql_a_str_subclass_cannot_format_other_text_into_the_statement(
    where: str,
) -> None:
    conn = RecordingConnection()
    args: dict[str, Any] = {"table": "orders", "key_column": "id", "values": {"status": "x"}}
    if where == "values":
        args["values"] = {Disguised("status"): "x"}
    else:
        args[where] = Disguised(args.get(where, "fence"))
    fenced_update(conn, key=1, fence=1, paramstyle="qmark", **args)
    [(sql, _)] = conn.executed
    assert "--" not in sql
    assert sql == (
        "UPDATE orders SET status = ?, fence = ? WHERE id = ? AND (fence IS NULL OR fence <= ?)"
    )
