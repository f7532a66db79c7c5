"""``celery -A proj lock ...``: look at and repair leases and done-markers.

Installed as a Celery subcommand through the ``celery.commands`` entry point; it reads the lock
store URL and key prefix from the app's settings (``--url`` and ``--prefix`` override them)::

    $ celery -A shop lock ls                      # leases held now
    $ celery -A shop lock show shop.process:42    # one request: lease, fence, done-markers
    $ celery -A shop lock release shop.process:42 --force
    $ celery -A shop lock forget shop.process:42  # let a done request run again
    $ celery -A shop lock --json ls

A request is named either by one of its Redis keys (``celery-lock:{shop.process:42}:lock``, as
logs and events show it, or its ``:fence`` or ``:done:<task>`` key) or as
``<scope>:<request key>``. Every listing uses ``SCAN``, never ``KEYS``. A failing lock store is
reported as an error (exit status 1), never a traceback.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import click
import redis
from celery import Celery

from .config import LockSettings, check_value, conf_value
from .exceptions import ConfigurationError
from .keys import stored_key_part
from .lease import decode_lock
from .runtime import lock_store_url

__all__ = ["LeaseInfo", "lock"]

SCAN_BATCH = 500


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


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


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

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def lock_key(self, name: str) -> str:
        """The lock key of ``name``: a lock key as logged, or ``<scope>:<request key>``.

        In the second form both parts are made safe as the library makes them (a long or
        unsafe request key becomes a readable prefix and a digest), unless they already are:
        ``shop.process:order 42`` and ``shop.process:order42~<digest>`` name the same lock.
        """
        head = f"{self.prefix}:{{"
        if name.startswith(head):
            # A key as logged: the lock, the fence or a done-marker. Neither the scope nor the
            # request key holds a brace (the library digests them), so the first "}" ends the tag.
            end = name.find("}", len(head))
            suffix = name[end + 1 :] if end >= 0 else ""
            if suffix in (":lock", ":fence") or suffix.startswith(":done:"):
                return f"{name[: end + 1]}:lock"
        scope, colon, request_key = name.partition(":")
        if not colon:
            return f"{self.prefix}:{{{name}}}:lock"
        return f"{self.prefix}:{{{stored_key_part(scope)}:{stored_key_part(request_key)}}}:lock"

    def tag(self, lock_key: str) -> str:
        return lock_key.removesuffix(":lock")

    def scan(self, pattern: str) -> Iterator[str]:
        for key in self.client.scan_iter(match=pattern, count=SCAN_BATCH):
            yield _text(key)

    def leases(self, keys: list[str]) -> list[LeaseInfo]:
        """Read the leases under ``keys`` in one pipelined round trip per batch."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
            pipe.pttl(key)
        replies = pipe.execute(raise_on_error=False)
        now_ms = time.time() * 1000
        found = []
        for key, value, pttl in zip(keys, replies[::2], replies[1::2], strict=True):
            if isinstance(pttl, redis.ResponseError):
                raise pttl
            if value is None or pttl == -2:
                continue  # released between SCAN and read
            try:
                if _wrong_type(value):  # not a string at all
                    raise ValueError(str(value))
                entry = decode_lock(value)
            except (ValueError, KeyError, TypeError):
                # Not a lock celery-lock wrote: listed, so that it can be found and released.
                found.append(LeaseInfo(key, "?", "?", "?", None, _ttl_left(pttl), None))
                continue
            holder = entry.holder
            found.append(
                LeaseInfo(
                    key=key,
                    task_id=holder.task_id,
                    task=holder.task_name,
                    worker=f"{holder.host}:{holder.pid}",
                    age_s=round((now_ms - entry.since_ms) / 1000, 3) if entry.since_ms else None,
                    ttl_left_s=_ttl_left(pttl),
                    fence=entry.fence,
                )
            )
        return found

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
        done_keys = list(self.scan(f"{_escape(tag)}:done:*"))
        pipe = self.client.pipeline(transaction=False)
        for string_key in [f"{tag}:fence", *done_keys]:
            pipe.get(string_key)
            pipe.pttl(string_key)
            pipe.type(string_key)
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
            done[done_key.rsplit(":done:", 1)[1]] = {
                "task_id": _not_a_string(key_type) if _wrong_type(task_id) else _text(task_id),
                "ttl_left_s": _ttl_left(pttl),
            }
        return {
            "key": key,
            "lease": asdict(leases[0]) if leases else None,
            "fence": _fence(fence, fence_type),
            "done": done,
        }

    def release(self, name: str) -> bool:
        """Delete the lease of ``name`` whoever holds it; return whether there was one."""
        return bool(self.client.delete(self.lock_key(name)))

    def forget(self, name: str, task: str | None) -> list[str]:
        """Delete the done-markers of ``name`` (of one task, or all); return the deleted keys."""
        tag = self.tag(self.lock_key(name))
        # The done-marker keys hold the task name made safe, as the library writes it.
        pattern = f"{_escape(tag)}:done:{_escape(stored_key_part(task)) if task else '*'}"
        keys = list(self.scan(pattern))
        if keys:
            self.client.delete(*keys)
        return keys


def _fence(value: Any, key_type: Any) -> int | str | None:
    """The fence counter as ``show`` reports it: its value, ``None`` if there is none, or what
    is wrong with it."""
    if value is None:
        return None
    if _wrong_type(value):
        return _not_a_string(key_type)
    try:
        return int(value)
    except ValueError:
        return f"<not an integer: {_text(value)!r}>"


def _escape(text: str) -> str:
    """Escape glob characters for SCAN MATCH."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


@dataclass(frozen=True)
class _Options:
    url: str | None
    prefix: str | None
    json: bool


def _setting(field: str, value: Any, name: str, option: str | None) -> Any:
    """``value`` of one setting checked on its own; a bad one is a usage error that names
    ``option`` (the command-line option that would override it), if given."""
    try:
        return check_value(field, value, name)
    except ConfigurationError as exc:
        hint = f" (or pass {option})" if option else ""
        raise click.UsageError(f"{exc}{hint}") from exc


def _store(app: Celery, options: _Options) -> tuple[str, str]:
    """The lock store URL and key prefix to use: the options', else the app's.

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
        return _setting("redis_url", options.url, "--url", None), prefix
    conf_url, name = conf_value(conf, "celery_lock_redis_url")
    if conf_url is not None:
        conf_url = _setting("redis_url", conf_url, name, "--url")
    try:
        return lock_store_url(app, LockSettings(redis_url=conf_url)), prefix
    except ConfigurationError as exc:
        raise click.UsageError(f"{exc} (or pass --url)") from exc


def _admin(ctx: click.Context) -> LockAdmin:
    app: Celery = ctx.find_root().obj.app
    options = ctx.find_object(_Options)
    assert options is not None
    url, prefix = _store(app, options)
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10)
        client.ping()
    except (redis.RedisError, ValueError) as exc:
        raise click.ClickException(f"cannot reach the lock store: {exc}") from exc
    return LockAdmin(client, prefix)


class _LockGroup(click.Group):
    """Turns a lock store that fails in the middle of a command into an error (exit status 1)
    with a message, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except redis.RedisError as exc:
            raise click.ClickException(
                f"the lock store failed: {type(exc).__name__}: {exc}"
            ) from exc


def _emit(ctx: click.Context, data: Any, text: str) -> None:
    options = ctx.find_object(_Options)
    click.echo(json.dumps(data, indent=2, sort_keys=True) if options and options.json else text)


@click.group(name="lock", cls=_LockGroup)
@click.option("--url", help="Lock store URL (default: the app's celery_lock_redis_url).")
@click.option("--prefix", help="Key prefix (default: the app's celery_lock_key_prefix).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
@click.pass_context
def lock(ctx: click.Context, url: str | None, prefix: str | None, as_json: bool) -> None:
    """Inspect and repair celery-lock leases and done-markers."""
    ctx.obj = _Options(url=url, prefix=prefix, json=as_json)


def _format_leases(leases: list[LeaseInfo]) -> str:
    if not leases:
        return "no leases held"
    header = ("KEY", "TASK", "TASK ID", "WORKER", "AGE", "TTL LEFT", "FENCE")
    rows = [
        (lease.key, lease.task, lease.task_id, lease.worker,
         "-" if lease.age_s is None else f"{lease.age_s:.1f}s",
         f"{lease.ttl_left_s:.1f}s", str(lease.fence))
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
    """Show one request's lease, fence counter and done-markers."""
    info = _admin(ctx).show(key)
    lease = info["lease"]
    lines = [f"key       {info['key']}"]
    if lease is None:
        lines.append("lease     none")
    else:
        age = "-" if lease["age_s"] is None else f"{lease['age_s']:.1f}s"
        lines += [f"holder    {lease['task_id']} ({lease['task']}) on {lease['worker']}",
                  f"age       {age}, {lease['ttl_left_s']:.1f}s left"]  # fmt: skip
    lines.append(f"fence     {info['fence']}")
    lines += [f"done      {task} by {d['task_id']} ({d['ttl_left_s']:.0f}s left)"
              for task, d in sorted(info["done"].items())] or ["done      none"]  # fmt: skip
    _emit(ctx, info, "\n".join(lines))


@lock.command(name="release")
@click.argument("key")
@click.option("--force", is_flag=True, help="Required: the holder may still be running.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def release_command(ctx: click.Context, key: str, force: bool, yes: bool) -> None:
    """Delete a lease whoever holds it (its holder, if alive, finds it lost)."""
    if not force:
        raise click.UsageError("release deletes a lease its holder may still need: add --force")
    admin = _admin(ctx)
    lock_key = admin.lock_key(key)
    if not yes:
        click.confirm(f"Release {lock_key}?", abort=True, err=True)  # stdout is for the result
    released = admin.release(key)
    _emit(ctx, {"key": lock_key, "released": released},
          f"released {lock_key}" if released else f"no lease at {lock_key}")  # fmt: skip


@lock.command(name="forget")
@click.argument("key")
@click.option("--task", help="Forget only this task's done-marker (default: every task's).")
@click.pass_context
def forget_command(ctx: click.Context, key: str, task: str | None) -> None:
    """Drop a request's done-marker(s), so the request may run again."""
    deleted = _admin(ctx).forget(key, task)
    _emit(ctx, {"deleted": deleted},
          "\n".join(f"forgot {k}" for k in deleted) or "no done-marker found")  # fmt: skip
