"""``celery -A proj lock ...``: look at and repair leases and done-markers.

Installed as a Celery subcommand through the ``celery.commands`` entry point; it reads the lock
store URL and key prefix from the app's settings (``--url`` and ``--prefix`` override them)::

    $ celery -A shop lock ls                      # leases held now
    $ celery -A shop lock show shop.process:42    # one request: lease, fence, done-markers
    $ celery -A shop lock release shop.process:42 --force
    $ celery -A shop lock forget shop.process:42  # let a done request run again
    $ celery -A shop lock key shop.process -a '[42]'   # the lock key of a call
    $ celery -A shop lock --json ls

A request is named either by one of its Redis keys (``celery-lock:{shop.process:42}:lock``, as
logs and events show it, or its ``:fence`` or ``:done:<task>`` key) or as
``<scope>:<request key>``; a key under another prefix than the one configured is a usage error
that names the ``--prefix`` to pass, and so is a name under the configured prefix that is none
of a request's keys (the hash tag alone, say). ``forget`` given a done-marker key forgets that
marker only. Every listing uses ``SCAN``, never ``KEYS``; a long scan reports its progress on
stderr when stderr is a terminal (``--progress-every``). A failing lock store is reported as an
error (exit status 1), never a traceback; so is a node of a Redis Cluster of several masters,
which holds a share of the keys alone.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import click
import redis
from celery import Celery
from celery.bin.base import JSON_ARRAY, JSON_OBJECT

from .checks import check_single_endpoint
from .config import LockSettings, check_value, conf_value
from .exceptions import ConfigurationError, LockKeyError
from .keys import RequestKeys, safe_key_part, scope_key_part, stored_key_part
from .lease import decode_done, decode_lock
from .runtime import lock_store_url
from .store import client_for_url, reach, redis_integer

__all__ = ["LeaseInfo", "lock"]

SCAN_BATCH = 500
#: How many keys a scan walks between two progress lines: 1 to 2 seconds' worth (docs/cli.md).
PROGRESS_EVERY = 1_000_000
#: A key of a request as the library lays it out: ``<prefix>:{<scope>:<request key>}:lock``,
#: ``...:fence`` or ``...:done:<task>``. Neither the prefix, the scope nor the request key holds
#: a brace (the prefix is checked, the others digested), so the first ``{`` opens the tag and
#: the next ``}`` closes it.
_KEY = re.compile(r"(?P<prefix>[^{}]+):(?P<tag>\{[^{}]*\})(?P<suffix>:lock|:fence|:done:.+)")


@dataclass(frozen=True)
class LeaseInfo:
    """What ``ls`` and ``show`` report about one held lease."""

    key: str
    task_id: str
    task: str
    worker: str
    age_s: float | None
    ttl_left_s: float
    fence: int | None


def _ttl_left(pttl: Any) -> float:
    return round(pttl / 1000, 3) if isinstance(pttl, int) and pttl >= 0 else -1.0


def _left(ttl_left_s: float, digits: int = 1) -> str:
    """A TTL left as text: a key without one (-1) is what a LockStateError names, not a
    lease about to lapse."""
    return "no TTL" if ttl_left_s < 0 else f"{ttl_left_s:.{digits}f}s left"


def _text(value: Any) -> str:
    """``value`` read from the lock store as text: bytes that are not UTF-8 (a key a foreign
    writer made) kept as surrogates, which :func:`_raw` turns back into the same bytes."""
    return value.decode(errors="surrogateescape") if isinstance(value, bytes) else str(value)


def _raw(key: str) -> bytes:
    """The key ``key`` names, as bytes: a name read by :func:`_text`, or typed (Python reads a
    command line's bytes that are not UTF-8 as the same surrogates), names the same key."""
    return key.encode(errors="surrogateescape")


def _printable(text: str) -> str:
    """``text`` read from the lock store (a task id, which the producer chose, a task name, a
    host, a key) as a line of the text output shows it: escaped as Python writes a str
    (``\\x1b``, ``\\n``, ``\\udcff``) where it holds what a terminal would act on or could
    not print."""
    # A backslash too: else the text "\\x1b" would read as the escaped ESC.
    return text if text.isprintable() and "\\" not in text else repr(text)[1:-1]


def _wrong_type(reply: Any) -> bool:
    """Whether a pipeline reply is the error of reading a key that holds another type."""
    if not isinstance(reply, redis.ResponseError):
        return False
    if str(reply).startswith("WRONGTYPE"):
        return True
    raise reply  # any other error (NOPERM, ...) is the store's failure, not the key's


def _not_a_string(key_type: Any) -> str:
    return f"<not a string: {_text(key_type)}>"


class LockAdmin:
    """Reads and repairs the keys of one lock store."""

    def __init__(
        self, client: redis.Redis, prefix: str, progress: Callable[[str], None] | None = None,
        progress_every: int = PROGRESS_EVERY,
    ) -> None:  # fmt: skip
        """
        Args:
            client: the lock store.
            prefix: the key prefix of its keys.
            progress: where to write a long scan's progress lines (``None``: nowhere).
            progress_every: how many keys a scan walks between two progress lines.
        """
        self.client = client
        self.prefix = prefix
        self.progress = progress
        self.progress_every = progress_every
        #: Set as a command sends its first write: a reply that does not come after that
        #: leaves the write done or not (see ``_LockGroup``).
        self.writing = False

    def parse(self, name: str) -> tuple[str, str | None]:
        """The lock key ``name`` names, and the done-marker key if ``name`` is one (see
        :func:`_parse_request_name`)."""
        return _parse_request_name(self.prefix, name)

    def lock_key(self, name: str) -> str:
        """The lock key of the request ``name`` names (see :meth:`parse`)."""
        return self.parse(name)[0]

    def tag(self, lock_key: str) -> str:
        return lock_key.removesuffix(":lock")

    def scan(self, pattern: str) -> Iterator[str]:
        """The keys matching ``pattern``, each once: SCAN may return a key more than once (when
        the keyspace shrinks between two steps, say)."""
        seen: set[str] = set()
        progress = _ScanProgress(self.client, self.progress, self.progress_every)
        cursor = 0
        while True:
            cursor, keys = self.client.scan(cursor, match=_raw(pattern), count=SCAN_BATCH)
            for key in keys:
                text = _text(key)
                if text not in seen:
                    seen.add(text)
                    yield text
            if not cursor:
                progress.done(len(seen))
                return
            progress.step(len(seen))

    def done_keys(self, tag: str) -> list[str]:
        """The done-marker keys of the request ``tag`` names, of every task of its scope."""
        return list(self.scan(f"{_escape(f'{tag}:done:')}*"))

    def leases(self, keys: list[str]) -> list[LeaseInfo]:
        """Read the leases under ``keys`` in one pipelined round trip per batch."""
        return [lease for lease, _ in self._read(keys) if lease is not None]

    def lease(self, lock_key: str) -> tuple[LeaseInfo | None, bytes]:
        """The lease at ``lock_key`` (``None``: none), and what the key holds, for
        :meth:`release` to delete only that (``b""`` if it is not a string)."""
        [(lease, value)] = self._read([lock_key])
        return lease, value

    def _read(self, keys: list[str]) -> list[tuple[LeaseInfo | None, bytes]]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(_raw(key))
            pipe.pttl(_raw(key))
        replies = pipe.execute(raise_on_error=False)
        now_ms = time.time() * 1000
        found: list[tuple[LeaseInfo | None, bytes]] = []
        for key, value, pttl in zip(keys, replies[::2], replies[1::2], strict=True):
            if isinstance(pttl, redis.ResponseError):
                raise pttl
            if value is None or pttl == -2:
                found.append((None, b""))  # released between SCAN and read
                continue
            if _wrong_type(value):  # not a string at all
                found.append((_foreign(key, pttl), b""))
                continue
            found.append((self._lease_of(key, value, pttl, now_ms), value))
        return found

    @staticmethod
    def _lease_of(key: str, value: bytes, pttl: Any, now_ms: float | None = None) -> LeaseInfo:
        """The lease the lock ``key`` holds as ``value``, or a foreign one if celery-lock did
        not write it (listed, so that it can be found and released)."""
        now_ms = time.time() * 1000 if now_ms is None else now_ms
        try:
            entry = decode_lock(value)
            holder = entry.holder
            return LeaseInfo(
                key=key,
                task_id=holder.task_id,
                task=holder.task_name,
                worker=f"{holder.host}:{holder.pid}",
                age_s=round((now_ms - entry.since_ms) / 1000, 3) if entry.since_ms else None,
                ttl_left_s=_ttl_left(pttl),
                fence=entry.fence,
            )
        except (ValueError, KeyError, TypeError, OverflowError):
            # OverflowError: a "since" no float holds, for the age.
            return _foreign(key, pttl)

    def held(self) -> list[LeaseInfo]:
        """Every lease held now."""
        keys = list(self.scan(f"{_escape(self.prefix)}:{{*}}:lock"))
        leases: list[LeaseInfo] = []
        for start in range(0, len(keys), SCAN_BATCH):
            leases += self.leases(keys[start : start + SCAN_BATCH])
        return sorted(leases, key=lambda lease: lease.key)

    def show(self, name: str) -> dict[str, Any]:
        """The lease, fence and done-markers of one request.

        A fence or done-marker that holds something celery-lock did not write (what a
        :class:`~celery_lock.exceptions.LockStateError` asks to repair) is reported as such,
        e.g. ``"<not a string: hash>"``, instead of failing the command.
        """
        key = self.lock_key(name)
        tag = self.tag(key)
        leases = self.leases([key])
        done_prefix = f"{tag}:done:"
        done_keys = self.done_keys(tag)
        pipe = self.client.pipeline(transaction=False)
        for string_key in [f"{tag}:fence", *done_keys]:
            pipe.get(_raw(string_key))
            pipe.pttl(_raw(string_key))
            pipe.type(_raw(string_key))
        replies = pipe.execute(raise_on_error=False)
        for reply in replies[1::3] + replies[2::3]:
            if isinstance(reply, redis.ResponseError):
                raise reply
        (fence, _, fence_type), *markers = zip(
            replies[::3], replies[1::3], replies[2::3], strict=True
        )
        done = {}
        for done_key, (task_id, pttl, key_type) in zip(done_keys, markers, strict=True):
            if task_id is None:
                continue  # expired or deleted between SCAN and read
            # The task name is all that follows the tag's ":done:": it may hold ":done:" too.
            entry: dict[str, Any] = {"task_id": _not_a_string(key_type)}
            if not _wrong_type(task_id):
                marker = decode_done(task_id)
                entry["task_id"] = marker.task_id
                if marker.handed_on_at is not None:  # a replaced run's, see lease.Done
                    entry["handed_on_at"] = marker.handed_on_at
                    entry["sent"] = marker.sent
            entry["ttl_left_s"] = _ttl_left(pttl)
            done[done_key.removeprefix(done_prefix)] = entry
        return {
            "key": key,
            "lease": asdict(leases[0]) if leases else None,
            "fence": _fence(fence, fence_type),
            "done": done,
        }

    def release(self, lock_key: str, holding: bytes) -> int:
        """Delete the lease at ``lock_key`` only while it still holds ``holding`` (what
        :meth:`lease` read). Return 1 if deleted, 0 if there was no lease, -1 if the key holds
        another value now (say, a new holder's lease)."""
        self.writing = True
        return int(self.client.eval(_RELEASE_UNCHANGED, 1, _raw(lock_key), holding))

    def take(self, lock_key: str) -> LeaseInfo | None:
        """Delete the lease at ``lock_key`` whoever holds it, and return what it was (``None``:
        there was none), read in the same step, so that the caller can say whose it was."""
        self.writing = True
        taken = self.client.eval(_TAKE, 1, _raw(lock_key))
        if taken is None:
            return None
        value, pttl = taken
        return self._lease_of(lock_key, value, pttl)

    def forget(self, name: str, task: str | None) -> tuple[str | None, list[str]]:
        """Delete the done-markers of ``name``: the one ``name`` is, the one of ``task``, or
        else every task's. Return the one done-marker key looked for (``None``: all of them)
        and the deleted keys."""
        lock_key, done_key = self.parse(name)
        tag = self.tag(lock_key)
        if task is not None:
            # The done-marker keys hold the task name made safe, as the library writes it.
            task_key = f"{tag}:done:{stored_key_part(task)}"
            if done_key is not None and done_key != task_key:
                raise click.UsageError(f"{name} is not the done-marker of --task {task}")
            done_key = task_key
        if done_key is not None:
            # One marker, known by its key: no scan. A done-marker key as pasted (from a
            # LockStateError) is that task's marker only, not every stage's of the request.
            self.writing = True
            return done_key, [done_key] if self.client.delete(_raw(done_key)) else []
        keys = self.done_keys(tag)
        if not keys:
            return None, []
        # One DEL per key, in one round trip: a marker that expired since the SCAN found it
        # was not forgotten, and is not reported as such.
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.delete(_raw(key))
        self.writing = True
        return None, [key for key, gone in zip(keys, pipe.execute(), strict=True) if gone]


class _ScanProgress:
    """Reports a long SCAN as it goes: a line every ``every`` keys walked, and a summary at the
    end if it reported any. Each SCAN step walks about ``SCAN_BATCH`` keys of the database
    (whether they match or not), so the keys walked are counted as steps times that: the
    server does not say how many it walked."""

    def __init__(
        self, client: redis.Redis, write: Callable[[str], None] | None, every: int
    ) -> None:
        self.client = client
        self.write = write if every > 0 else None
        self.every = every
        self.steps = 0
        self.started = time.monotonic()
        self.reported = False
        self.total: int | None = None

    def step(self, found: int) -> None:
        """One SCAN step done, ``found`` matching keys so far."""
        self.steps += 1
        walked = self.steps * SCAN_BATCH
        if self.write is None or walked // self.every == (walked - SCAN_BATCH) // self.every:
            return
        if not self.reported:
            self.reported = True
            try:
                self.total = int(self.client.dbsize())
            except redis.ResponseError:  # an ACL without DBSIZE: progress without a total
                self.total = None
        of = "" if self.total is None else f" of {self.total}"
        about = walked if self.total is None else min(walked, self.total)
        self.write(f"scanned about {about}{of} keys, {found} matching so far")

    def done(self, found: int) -> None:
        """The scan is over, with ``found`` matching keys: sum it up if it reported."""
        if self.write is None or not self.reported:
            return
        keys = f"about {(self.steps + 1) * SCAN_BATCH}" if self.total is None else self.total
        elapsed = time.monotonic() - self.started
        self.write(f"scanned {keys} keys in {elapsed:.1f}s, {found} matching")


# Deletes the lease at KEYS[1] only if the key holds what it held when the user was asked:
# ARGV[1], or (given "") any value that is not a string. A lease that lapsed in the meantime
# and was granted again belongs to another holder, whom the user was not asked about.
_RELEASE_UNCHANGED = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return 0 end
local now = kind == 'string' and redis.call('GET', KEYS[1]) or ''
if now ~= ARGV[1] then return -1 end
return redis.call('DEL', KEYS[1])
"""


# Deletes the lease at KEYS[1] whoever holds it, and returns what it held ('' if not a string)
# and the time it had left, or nil if there was none: release --yes says whose lease it deleted.
_TAKE = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return false end
local was = kind == 'string' and redis.call('GET', KEYS[1]) or ''
local left = redis.call('PTTL', KEYS[1])
redis.call('DEL', KEYS[1])
return {was, left}
"""


def _foreign(key: str, pttl: Any) -> LeaseInfo:
    """A value under a lock key that celery-lock did not write."""
    return LeaseInfo(key, "?", "?", "?", None, _ttl_left(pttl), None)


def _fence(value: Any, key_type: Any) -> int | str | None:
    """The fence counter as ``show`` reports it: its value, ``None`` if there is none, or what
    is wrong with it."""
    if value is None:
        return None
    if _wrong_type(value):
        return _not_a_string(key_type)
    number = redis_integer(_text(value))
    return f"<not an integer: {_text(value)!r}>" if number is None else number


def _escape(text: str) -> str:
    """Escape glob characters for SCAN MATCH."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


@dataclass(frozen=True)
class _Options:
    url: str | None
    prefix: str | None
    json: bool
    progress_every: int


def _setting(field: str, value: Any, name: str, option: str | None) -> Any:
    """``value`` of one setting checked on its own; a bad one is a usage error that names
    ``option`` (the command-line option that would override it), if given."""
    try:
        return check_value(field, value, name)
    except ConfigurationError as exc:
        hint = f" (or pass {option})" if option else ""
        raise click.UsageError(f"{exc}{hint}") from exc


def _store(app: Celery, options: _Options, app_given: bool = True) -> tuple[str, str, str]:
    """The lock store URL and key prefix to use, the options', else the app's, and the name of
    what the URL came from, for errors about it (``--url``, the setting as written, or
    ``broker_url`` where the broker's URL stands in for it).

    Only these two settings are read, each checked on its own: another invalid celery-lock
    setting (say, a heartbeat interval above the TTL) is the worker's concern, not this
    command's.
    """
    conf = app.conf
    if options.prefix is not None:
        prefix = _setting("key_prefix", options.prefix, "--prefix", None)
    else:
        conf_prefix, name = conf_value(conf, "celery_lock_key_prefix")
        prefix = (
            LockSettings.key_prefix
            if conf_prefix is None
            else _setting("key_prefix", conf_prefix, name, "--prefix")
        )
    if options.url is not None:
        return _setting("redis_url", options.url, "--url", None), prefix, "--url"
    conf_url, name = conf_value(conf, "celery_lock_redis_url")
    if conf_url is not None:
        conf_url = _setting("redis_url", conf_url, name, "--url")
    try:
        url = lock_store_url(app, LockSettings(redis_url=conf_url))
        return url, prefix, name if conf_url is not None else "broker_url"
    except ConfigurationError as exc:
        # Without -A, Celery's default app has no settings to read: suggest it too.
        hint = "or pass --url" if app_given else "or pass -A with your app, or --url"
        raise click.UsageError(f"{exc} ({hint})") from exc


def _parse_request_name(prefix: str, name: str) -> tuple[str, str | None]:
    """The lock key ``name`` names under ``prefix``, and the done-marker key if ``name`` is one.

    ``name`` is one of the request's keys (its lock, fence or a done-marker key, as logged)
    or ``<scope>:<request key>``. In the second form both parts are made safe as the
    library makes them (a long or unsafe request key becomes a readable prefix and a
    digest), unless they already are: ``shop.process:order 42`` and
    ``shop.process:order42~<digest>`` name the same lock.

    Raises:
        click.UsageError: ``name`` is a key under another prefix, or a key under this
            prefix that is none of a request's keys (read as a request name, either would
            name a request that does not exist, and every command would find nothing), or
            names no request at all.
    """
    key = _KEY.fullmatch(name)
    if key is not None:
        if key["prefix"] != prefix:
            raise click.UsageError(
                f"{name} is a key under prefix {key['prefix']!r}, not the configured "
                f"{prefix!r}: pass --prefix {key['prefix']} (before the subcommand)"
            )
        tag = f"{key['prefix']}:{key['tag']}"
        return f"{tag}:lock", name if key["suffix"].startswith(":done:") else None
    if name.startswith(f"{prefix}:{{"):
        # A key of this prefix pasted not quite whole (the tag alone, a trailing space,
        # ":done" without its task): read as <scope>:<request key>, it would name a request
        # of scope "celery-lock" that does not exist, and every command would find nothing.
        raise click.BadParameter(
            f"{name!r} is under prefix {prefix!r} but is none of a request's keys: "
            f"give its '...:lock', '...:fence' or '...:done:<task>' key whole",
            param_hint="'KEY'",
        )
    scope, colon, request_key = name.partition(":")
    if not colon or not scope:
        raise click.BadParameter(
            f"{name!r} names no request: give one of its keys "
            f"('{prefix}:{{<scope>:<request key>}}:lock') or <scope>:<request key>",
            param_hint="'KEY'",
        )
    tag = f"{prefix}:{{{stored_key_part(scope)}:{stored_key_part(request_key)}}}"
    return f"{tag}:lock", None


def _unknown_scope(app: Celery, prefix: str, name: str) -> str | None:
    """A warning for a ``<scope>:<request key>`` name whose scope no ``LockedTask`` of ``app``
    uses (a task's short name, say, for its full one), with the closest that one does: every
    command would find nothing there, and say only that. ``None`` for any other name, and
    where the app registers no ``LockedTask`` (another app's tasks may use the scope)."""
    from .task import LockedTask  # noqa: PLC0415 - the library's tasks, not needed by the others

    if _KEY.fullmatch(name) or name.startswith(f"{prefix}:{{"):
        return None
    try:  # a hint only: an app whose modules fail to import can still be repaired
        app.loader.import_default_modules()  # the tasks of `include` and autodiscovery too
        scopes = {
            task.lock_scope or task.name
            for task in app.tasks.values()
            if isinstance(task, LockedTask)
        }
    except Exception:  # whatever the app's own modules raise
        return None
    scope = name.partition(":")[0]
    # As the keys hold them: a scope typed as stored (digested) is the scope.
    if not scopes or stored_key_part(scope) in {scope_key_part(s) for s in scopes}:
        return None
    colon = sorted(s for s in scopes if s.startswith(f"{scope}:"))
    if colon:  # split at its first ':', as every name is
        return (
            f"scope {colon[0]!r} holds a ':', and {name!r} names scope {scope!r}: give the "
            f"request's lock key (celery lock key derives it)"
        )
    meant = difflib.get_close_matches(scope, sorted(scopes), n=1, cutoff=0.4)
    hint = f"; did you mean {meant[0]!r}?" if meant else ""
    if meant and ":" in meant[0]:  # typed before a request key, it would be split at its ':'
        hint += " It holds a ':': give the request's lock key (celery lock key derives it)"
    return f"no LockedTask of this app has scope {scope!r} (its task name or lock_scope){hint}"


def _two_readings(prefix: str, name: str) -> str | None:
    """A warning for a ``<scope>:<request key>`` name whose request key looks as the library
    stores one it digests (``order42~<digest>``): it is read as that stored key, though a
    request whose raw key is that very text is another one, keyed by a digest of it. Which
    was meant cannot be told (and a client may choose its own key so), so both are named.
    ``None`` for any other name."""
    if _KEY.fullmatch(name) or name.startswith(f"{prefix}:{{"):
        return None
    scope, _, request_key = name.partition(":")
    stored, raw = stored_key_part(request_key), safe_key_part(request_key)
    if stored == raw:  # text kept as typed, or digested either way
        return None
    tag = f"{prefix}:{{{stored_key_part(scope)}:"
    return (
        f"{request_key!r} is read as a request key as stored: {tag}{stored}}}:lock; a request "
        f"whose raw key is that text is another one: {tag}{raw}}}:lock (give its lock key "
        "whole to mean it)"
    )


def _admin(ctx: click.Context, name: str | None = None) -> LockAdmin:
    """The lock store the command works on, reached; ``name``, a request's KEY, checked first:
    one that names no request is a usage error, whether or not the store answers."""
    app: Celery = ctx.find_root().obj.app
    options = ctx.find_object(_Options)
    assert options is not None
    url, prefix, setting = _store(app, options, bool(ctx.find_root().params.get("app")))
    if name is not None:
        _parse_request_name(prefix, name)
        warnings = [_two_readings(prefix, name)]
        if ctx.find_root().params.get("app"):
            warnings.append(_unknown_scope(app, prefix, name))
        for warning in warnings:
            if warning is not None:
                click.echo(f"Warning: {warning}", err=True)
    try:
        client = client_for_url(url, socket_connect_timeout=5, socket_timeout=10)
        reach(client)  # not PING, which a user allowed only what the scripts need may not send
    except redis.AuthenticationError as exc:  # NOAUTH, WRONGPASS: the URL's user or password
        raise click.ClickException(f"cannot log in to the lock store: {exc}") from exc
    except redis.exceptions.NoPermissionError as exc:
        if "script" not in str(exc).lower():  # a SELECT of a database, say
            raise click.ClickException(f"the lock store refused the connection: {exc}") from exc
        raise click.ClickException(  # an ACL user without @scripting
            f"the lock store's user may not send SCRIPT EXISTS, which every command sends "
            f"first ({exc}): it needs +@read +@write +@scripting on the keys under the prefix "
            f"(docs/settings.md)"
        ) from exc
    except redis.ResponseError as exc:  # a database the user may not SELECT, or none such
        raise click.ClickException(f"the lock store refused the connection: {exc}") from exc
    except redis.InvalidResponse as exc:  # a protocol error: another service's port
        raise click.ClickException(
            f"the lock store does not speak Redis ({str(exc).rstrip('.')}): wrong host or port "
            f"in {setting}?"
        ) from exc
    except (redis.RedisError, ValueError) as exc:
        raise click.ClickException(f"cannot reach the lock store: {exc}") from exc
    # A node of a cluster of several masters holds a share of the keys: ls would list its
    # leases alone, and show and forget miss what the other masters hold.
    try:
        check_single_endpoint(client, setting)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from exc
    # Progress is for an operator watching a terminal: a script or a cron job that reads
    # stderr gets only errors there.
    terminal = sys.stderr.isatty()
    progress = _on_stderr if terminal else None
    admin = LockAdmin(client, prefix, progress, options.progress_every)
    ctx.meta[_ADMIN] = admin  # for _LockGroup, which reports a failure in its writes
    return admin


#: Where :func:`_admin` leaves the command's :class:`LockAdmin` in the click context's meta.
_ADMIN = "celery_lock.admin"


def _on_stderr(line: str) -> None:
    click.echo(line, err=True)


class _LockGroup(click.Group):
    """Turns a lock store that fails in the middle of a command into an error (exit status 1)
    with a message, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (redis.TimeoutError, redis.ConnectionError) as exc:
            admin = ctx.meta.get(_ADMIN)
            if admin is None or not admin.writing:
                raise click.ClickException(
                    f"the lock store failed: {type(exc).__name__}: {exc}"
                ) from exc
            # The store may have taken the write and then stalled or dropped the connection
            # before the reply: it may be done, or done later (a stalled store), or never.
            raise click.ClickException(
                f"the lock store did not answer ({type(exc).__name__}: {exc}): what "
                f"{ctx.invoked_subcommand} was deleting may be deleted or not; `lock show` "
                f"with the same key and options tells"
            ) from exc
        except redis.RedisError as exc:
            raise click.ClickException(
                f"the lock store failed: {type(exc).__name__}: {exc}"
            ) from exc


def _emit(ctx: click.Context, data: Any, text: str) -> None:
    options = ctx.find_object(_Options)
    click.echo(json.dumps(data, indent=2, sort_keys=True) if options and options.json else text)


@click.group(name="lock", cls=_LockGroup)
@click.option(
    "--url", metavar="URL", help="Lock store URL (default: the app's celery_lock_redis_url)."
)
@click.option("--prefix", help="Key prefix (default: the app's celery_lock_key_prefix).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
@click.option(
    "--progress-every", type=click.IntRange(min=0), default=PROGRESS_EVERY, show_default=True,
    metavar="KEYS",
    help="While a command scans the lock store, report on stderr every KEYS keys walked, "
    "if stderr is a terminal (0: never).",
)  # fmt: skip
@click.pass_context
def lock(
    ctx: click.Context, url: str | None, prefix: str | None, as_json: bool, progress_every: int
) -> None:
    """Inspect and repair celery-lock leases and done-markers."""
    ctx.obj = _Options(url=url, prefix=prefix, json=as_json, progress_every=progress_every)


def _format_leases(leases: list[LeaseInfo]) -> str:
    if not leases:
        return "no leases held"
    header = ("KEY", "TASK", "TASK ID", "WORKER", "AGE", "TTL LEFT", "FENCE")
    rows = [
        (_printable(lease.key), _printable(lease.task), _printable(lease.task_id),
         _printable(lease.worker),
         "-" if lease.age_s is None else f"{lease.age_s:.1f}s",
         _left(lease.ttl_left_s).removesuffix(" left"), str(lease.fence))
        for lease in leases
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
             for row in [header, *rows]]  # fmt: skip
    return "\n".join(line.rstrip() for line in lines) + f"\n{len(leases)} lease(s) held"


@lock.command(name="ls")
@click.pass_context
def ls_command(ctx: click.Context) -> None:
    """List the leases held now: key, task, holder task id, worker, age, TTL left, fence."""
    leases = _admin(ctx).held()
    _emit(ctx, [asdict(lease) for lease in leases], _format_leases(leases))


@lock.command(name="show")
@click.argument("key")
@click.pass_context
def show_command(ctx: click.Context, key: str) -> None:
    """Show one request's lease, fence and done-markers.

    KEY names the request: one of its keys, as ls lists them, or <scope>:<request key>."""
    info = _admin(ctx, key).show(key)
    lease = info["lease"]
    lines = [f"key       {_printable(info['key'])}"]
    if lease is None:
        lines.append("lease     none")
    else:
        age = "-" if lease["age_s"] is None else f"{lease['age_s']:.1f}s"
        lines += [f"holder    {_holder(LeaseInfo(**lease))}",
                  f"age       {age}, {_left(lease['ttl_left_s'])}"]  # fmt: skip
    lines.append(f"fence     {_fence_shown(lease, info['fence'])}")
    lines += [f"done      {_printable(task)} {_how_done(d)} ({_left(d['ttl_left_s'], 0)})"
              for task, d in sorted(info["done"].items())] or ["done      none"]  # fmt: skip
    _emit(ctx, info, "\n".join(lines))


def _fence_shown(lease: dict[str, Any] | None, counter: int | str | None) -> str:
    """``show``'s fence line: the lease's own fence where there is a lease (what ``release
    --fence`` takes), the counter beside it where a grant since read moved it on; else the
    counter, the last grant's fence."""
    if lease is None or lease["fence"] is None:
        return "none" if counter is None else str(counter)
    if counter == lease["fence"]:
        return str(lease["fence"])
    return f"{lease['fence']} (the counter is at {'none' if counter is None else counter})"


def _how_done(marker: dict[str, Any]) -> str:
    """``by <task id>``, or, for a request a run handed on with ``self.replace``, ``handed on
    by <task id> at depth <n>`` (``being handed on`` until the replacement was sent)."""
    if "handed_on_at" in marker:
        how = "handed on" if marker["sent"] else "being handed on"
        return f"{how} by {_printable(marker['task_id'])} at depth {marker['handed_on_at']}"
    # A direct call (task(...)) has no task id: its marker names none.
    return f"by {_printable(marker['task_id']) or 'a direct call'}"


@lock.command(name="key")
@click.argument("task_name", metavar="TASK")
@click.option(
    "-a", "--args", "args", type=JSON_ARRAY, default=None,
    help="The call's positional arguments, as a JSON array.",
)  # fmt: skip
@click.option(
    "-k", "--kwargs", "kwargs", type=JSON_OBJECT, default=None,
    help="The call's keyword arguments, as a JSON object.",
)  # fmt: skip
@click.pass_context
def key_command(
    ctx: click.Context,
    task_name: str,
    args: list[Any] | None,
    kwargs: dict[str, Any] | None,
) -> None:
    """Print the lock key of the request a call of TASK works on, as its worker derives it.

    The arguments are read as JSON, as the worker receives them (-a and -k as celery call takes
    them). Pass the key to show, forget or release: it names the request whatever its key holds
    (a digest, a scope with a ':'). The lock store is not asked."""
    from .task import LockedTask  # noqa: PLC0415 - the library's tasks, not needed by the others

    app: Celery = ctx.find_root().obj.app
    app.loader.import_default_modules()  # the tasks of `include` and autodiscovery too
    task = app.tasks.get(task_name)
    if task is None:
        raise click.UsageError(
            f"no task named {task_name!r} in this app: pass -A with the app that registers it"
        )
    if not isinstance(task, LockedTask):
        raise click.UsageError(f"{task_name} is not a LockedTask: its calls take no lock")
    try:
        keys = task.request_keys(tuple(args or ()), kwargs or {})
    except (LockKeyError, ConfigurationError) as exc:
        raise click.UsageError(str(exc)) from exc
    options = ctx.find_object(_Options)
    if options is not None and options.prefix is not None:
        prefix = _setting("key_prefix", options.prefix, "--prefix", None)
        task_prefix = task.lock_settings().key_prefix
        keys = RequestKeys.of_lock(prefix + keys.lock[len(task_prefix) :], task.name)
    _emit(ctx, asdict(keys), _printable(keys.lock))


@lock.command(name="release")
@click.argument("key")
@click.option("--force", is_flag=True, help="Required: the holder may still be running.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option(
    "--fence", type=int, metavar="FENCE",
    help="Release only the lease granted with this fence (as ls and show print it), without "
    "asking; a lease granted since is kept, and the command fails.",
)  # fmt: skip
@click.pass_context
def release_command(
    ctx: click.Context, key: str, force: bool, yes: bool, fence: int | None
) -> None:
    """Delete a lease whoever holds it (its holder, if alive, finds it lost).

    KEY names the request: one of its keys, as ls lists them, or <scope>:<request key>."""
    if not force:
        raise click.UsageError("release deletes a lease its holder may still need: add --force")
    admin = _admin(ctx, key)
    lock_key = admin.lock_key(key)
    released: LeaseInfo | None = None
    if yes and fence is None:
        released = admin.take(lock_key)
    else:
        # Delete only the lease there is, once it is known which: not a lease that lapsed
        # while the user read the question (or since ls or show printed its fence) and was
        # granted again, to another task id or to a redelivery of the same one.
        lease, holding = admin.lease(lock_key)
        if lease is not None:
            if fence is not None and lease.fence != fence:
                what = (
                    "a value celery-lock did not write"
                    if lease.fence is None
                    else f"the lease granted with fence {lease.fence} "
                    f"({_held(lease, _inspect_command(ctx))})"
                )
                raise click.ClickException(
                    f"not released: {_printable(lock_key)} holds {what}, not the lease granted "
                    f"with fence {fence}"
                )
            if fence is None:  # on stderr: stdout is for the result
                held = _held(lease, _inspect_command(ctx))
                click.confirm(f"Release {_printable(lock_key)}, {held}?", abort=True, err=True)
            outcome = admin.release(lock_key, holding)
            if outcome < 0:
                raise click.ClickException(
                    f"not released: {_printable(lock_key)} changed hands "
                    f"{'since it was read' if fence is not None else 'while you were asked'} "
                    f"(run release again to see its holder)"
                )
            released = lease if outcome > 0 else None
    data: dict[str, Any] = {"key": lock_key, "released": released is not None}
    if released is None:
        text = f"no lease at {_printable(lock_key)}"
    else:
        data["holder"] = asdict(released)
        text = f"released {_printable(lock_key)}, {_was_held(released)}"
    _emit(ctx, data, text)


def _was_held(lease: LeaseInfo) -> str:
    """Whose ``lease`` was, as ``release`` reports it once it is deleted."""
    if lease.fence is None:
        return "which held a value celery-lock did not write"
    return f"held by {_holder(lease)}"


def _holder(lease: LeaseInfo) -> str:
    """``<task id> (<task>) on <worker>``, made printable."""
    task_id, task, worker = (_printable(text) for text in (lease.task_id, lease.task, lease.worker))
    return f"{task_id} ({task}) on {worker}"


def _inspect_command(ctx: click.Context) -> str:
    """The ``celery inspect`` command of the app the command was run for, as it was named."""
    app = ctx.find_root().params.get("app")
    if app is None:
        return "celery inspect"
    # Celery 5.7 keeps -A's text; older releases hand the app itself, its text lost.
    return f"celery -A {app if isinstance(app, str) else '<app>'} inspect"


def _held(lease: LeaseInfo, inspect: str = "celery inspect") -> str:
    """Who holds ``lease`` and for how long, as the release prompt says it, with how to tell
    whether the holder still runs (``inspect``: the ``celery inspect`` command of its app)."""
    left = _left(lease.ttl_left_s)
    if lease.fence is None:  # every lease celery-lock writes has one
        return f"which holds a value celery-lock did not write ({left})"
    age = "an unknown time" if lease.age_s is None else f"{lease.age_s:.1f}s"
    return (
        f"{_was_held(lease)} for {age} ({left}; alive if `{inspect} query_task "
        f"{shlex.quote(_printable(lease.task_id))}` finds it active)"  # the producer's text
    )


@lock.command(name="forget")
@click.argument("key")
@click.option("--task", help="Forget only this task's done-marker (default: every task's).")
@click.pass_context
def forget_command(ctx: click.Context, key: str, task: str | None) -> None:
    """Drop a request's done-marker(s), so the request may run again.

    KEY names the request: one of its keys, as ls lists them, or <scope>:<request key>. Given
    a done-marker key, only that task's marker (as with --task): the request's other stages
    stay done."""
    admin = _admin(ctx, key)
    one, deleted = admin.forget(key, task)
    if one:
        nothing = f"no done-marker at {_printable(one)}"
    else:
        nothing = f"no done-marker of {_printable(admin.lock_key(key))}"
    forgot = "\n".join(f"forgot {_printable(k)}" for k in deleted)
    _emit(ctx, {"deleted": deleted}, forgot or nothing)
