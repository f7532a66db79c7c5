"""``celery -A proj lock ...``: look at and repair leases and done-markers.

Installed as a Celery subcommand through the ``celery.commands`` entry point; it reads the lock
store URL and key prefix from the app's settings (``--url`` and ``--prefix`` override them)::

    $ celery -A shop lock ls                      # leases held now
    $ celery -A shop lock show shop.process:42    # one request: lease, fence, done-markers
    $ celery -A shop lock release shop.process:42 --force
    $ celery -A shop lock forget shop.process:42  # let a done request run again
    $ celery -A shop lock --json ls

A request is named either by its lock's Redis key (``celery-lock:{shop.process:42}:lock``, as
logs and events show it) or as ``<scope>:<request key>``. Every listing uses ``SCAN``, never
``KEYS``.
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

from .config import LockSettings
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
        if name.startswith(f"{self.prefix}:{{") and name.endswith("}:lock"):
            return name
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
            if value is None or pttl == -2:
                continue  # released between SCAN and read
            try:
                if isinstance(value, redis.ResponseError):  # WRONGTYPE: not a string at all
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
        """The lease, fence and done-markers of one request."""
        key = self.lock_key(name)
        tag = self.tag(key)
        leases = self.leases([key])
        fence = self.client.get(f"{tag}:fence")
        done = {}
        for done_key in self.scan(f"{_escape(tag)}:done:*"):
            done[done_key.rsplit(":done:", 1)[1]] = {
                "task_id": _text(self.client.get(done_key) or b""),
                "ttl_left_s": round(self.client.pttl(done_key) / 1000, 3),
            }
        return {
            "key": key,
            "lease": asdict(leases[0]) if leases else None,
            "fence": int(fence) if fence is not None and fence.isdigit() else None,
            "done": done,
        }

    def release(self, name: str) -> bool:
        """Delete the lease of ``name`` whoever holds it; return whether there was one."""
        return bool(self.client.delete(self.lock_key(name)))

    def forget(self, name: str, task: str | None) -> list[str]:
        """Delete the done-markers of ``name`` (of one task, or all); return the deleted keys."""
        tag = self.tag(self.lock_key(name))
        pattern = f"{_escape(tag)}:done:{_escape(task) if task else '*'}"
        keys = list(self.scan(pattern))
        if keys:
            self.client.delete(*keys)
        return keys


def _escape(text: str) -> str:
    """Escape glob characters for SCAN MATCH."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


@dataclass(frozen=True)
class _Options:
    url: str | None
    prefix: str | None
    json: bool


def _admin(ctx: click.Context) -> LockAdmin:
    app: Celery = ctx.find_root().obj.app
    options = ctx.find_object(_Options)
    assert options is not None
    try:
        settings = LockSettings.resolve(app.conf)
        url = options.url or lock_store_url(app, settings)
        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10)
        client.ping()
    except ConfigurationError as exc:
        raise click.UsageError(f"{exc} (or pass --url)") from exc
    except (redis.RedisError, ValueError) as exc:
        raise click.ClickException(f"cannot reach the lock store: {exc}") from exc
    return LockAdmin(client, options.prefix or settings.key_prefix)


def _emit(ctx: click.Context, data: Any, text: str) -> None:
    options = ctx.find_object(_Options)
    click.echo(json.dumps(data, indent=2, sort_keys=True) if options and options.json else text)


@click.group(name="lock")
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
        click.confirm(f"Release {lock_key}?", abort=True)
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
