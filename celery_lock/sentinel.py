"""Redis Sentinel: a lock store found through its sentinels, as kombu finds a Redis broker.

A sentinel URL lists the sentinels, ``;``-separated, and names the master they watch::

    app.conf.celery_lock_redis_url = (
        "sentinel://:secret@10.0.0.1:26379/2;sentinel://10.0.0.2:26379;"
        "sentinel://10.0.0.3:26379?master_name=locks"
    )

The user, password and database are those of the master (as kombu reads them from a sentinel
broker URL), given on the first sentinel; ``?sentinel_username=`` and ``?sentinel_password=``
log in to the sentinels themselves, and ``?min_other_sentinels=`` (0 by default) makes the
client trust only a sentinel that sees at least that many others. When
``celery_lock_redis_url`` is unset and the broker is a sentinel URL, the lock store is the
broker's master, found the same way, with ``master_name``, ``min_other_sentinels`` and
``sentinel_kwargs`` (its ``username`` and ``password``) from ``broker_transport_options``.

The client is redis-py's own (:meth:`redis.sentinel.Sentinel.master_for`): each new connection
asks the sentinels where the master is, and a connection to a master demoted by a failover
(``READONLY``) is dropped, so the next try, and every later task, reaches the new master.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.sentinel import Sentinel

__all__ = ["DEFAULT_SENTINEL_PORT", "SentinelURL", "is_sentinel_url", "sentinel_master_client"]

#: The port of a sentinel URL that gives none: Redis Sentinel's own, as kombu assumes.
DEFAULT_SENTINEL_PORT = 26379

_SCHEME = "sentinel"
#: Query arguments a sentinel URL may give; any other is refused rather than ignored.
_QUERY = ("master_name", "sentinel_username", "sentinel_password", "min_other_sentinels")


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` is a ``sentinel://`` URL (a list of sentinels)."""
    return url.split("://", 1)[0] == _SCHEME


@dataclass(frozen=True)
class SentinelURL:
    """A ``sentinel://`` URL, read.

    Raises:
        ValueError: from :meth:`parse`, saying what is wrong; never with the URL in it (it may
            hold a password).
    """

    #: ``(host, port)`` of each sentinel, in the URL's order.
    sentinels: tuple[tuple[str, int], ...]
    #: The name the sentinels know the master by (``sentinel monitor <name> ...``).
    master_name: str
    #: The master's database number.
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    #: How many other sentinels a sentinel must see for its answer to count (redis-py's
    #: ``min_other_sentinels``, as kombu's transport option of that name).
    min_other_sentinels: int = 0

    @classmethod
    def parse(cls, url: str) -> SentinelURL:
        """Read ``sentinel://[[user]:password@]host[:port][/db][;sentinel://host[:port]]...``
        with ``?master_name=`` (and optionally ``sentinel_username``, ``sentinel_password``,
        ``min_other_sentinels``) on any one of its parts."""
        sentinels: list[tuple[str, int]] = []
        query: dict[str, str] = {}
        db, username, password = 0, None, None
        for index, part in enumerate(url.split(";")):
            split = urlsplit(part.strip())
            if split.scheme != _SCHEME:
                raise ValueError(f"part {index + 1} of the sentinel list is not a sentinel:// URL")
            try:
                port = split.port or DEFAULT_SENTINEL_PORT
            except ValueError:
                raise ValueError(f"sentinel {index + 1} has a port that is no number") from None
            if not split.hostname:
                raise ValueError(f"sentinel {index + 1} names no host")
            sentinels.append((split.hostname, port))
            path = unquote(split.path).strip("/")
            if index == 0:
                if path and not path.isdigit():
                    raise ValueError(f"the database {path!r} is not a number (write /2)")
                db = int(path or 0)
                username = unquote(split.username) if split.username else None
                password = unquote(split.password) if split.password is not None else None
            elif path or split.username or split.password:
                # kombu reads these from the first sentinel only: say so rather than ignore them.
                raise ValueError(
                    f"sentinel {index + 1} gives a user, password or database: give them on the "
                    "first sentinel, where they are read"
                )
            for name, values in parse_qs(split.query, keep_blank_values=True).items():
                if name not in _QUERY:
                    takes = ", ".join(_QUERY)
                    raise ValueError(f"unknown query argument {name!r} (it takes {takes})")
                if len(values) > 1 or (name in query and query[name] != values[0]):
                    raise ValueError(f"the query argument {name!r} is given more than once")
                query[name] = values[0]
        master_name = query.get("master_name", "")
        if not master_name:
            raise ValueError(
                "names no master: add ?master_name=<the name the sentinels monitor it by>"
            )
        others = query.get("min_other_sentinels", "0")
        if not others.isdigit():
            raise ValueError(f"min_other_sentinels must be a whole number, got {others!r}")
        return cls(
            sentinels=tuple(sentinels),
            master_name=master_name,
            db=db,
            username=username,
            password=password or None,
            sentinel_username=query.get("sentinel_username") or None,
            sentinel_password=query.get("sentinel_password") or None,
            min_other_sentinels=int(others),
        )


def sentinel_master_client(url: str, **options: Any) -> redis.Redis:
    """A client of the master that the sentinels of ``url`` name (no round trip until used).

    ``options`` go to the master's connections, as to ``redis.Redis.from_url``; the socket
    timeouts and the ``retry`` among them to the sentinels' too.
    """
    target = SentinelURL.parse(url)
    sentinel_options = {
        name: value
        for name, value in options.items()
        if name.startswith("socket_") or name == "retry"
    }
    if target.sentinel_username is not None:
        sentinel_options["username"] = target.sentinel_username
    if target.sentinel_password is not None:
        sentinel_options["password"] = target.sentinel_password
    manager = Sentinel(  # type: ignore[no-untyped-call]
        list(target.sentinels),
        min_other_sentinels=target.min_other_sentinels,
        sentinel_kwargs=sentinel_options,
    )
    client: redis.Redis = manager.master_for(  # type: ignore[no-untyped-call]
        target.master_name,
        db=target.db,
        username=target.username,
        password=target.password,
        **options,
    )
    return client
