"""Redis Sentinel: a lock store found through its sentinels, as kombu finds a Redis broker.

A sentinel URL lists the sentinels, ``;``-separated, and names the master they watch::

    app.conf.celery_lock_redis_url = (
        "sentinel://:secret@10.0.0.1:26379/2;sentinel://10.0.0.2:26379;"
        "sentinel://10.0.0.3:26379?master_name=locks"
    )

The user, password and database are those of the master (as kombu reads them from a sentinel
broker URL), given on the first sentinel; ``?sentinel_username=`` and ``?sentinel_password=``
log in to the sentinels themselves, and ``?min_other_sentinels=`` (0 by default) makes the
client trust only a sentinel that sees at least that many others. ``?ssl=true`` reaches the
master over TLS, with the ``ssl_*`` options redis-py's ``rediss://`` URLs take
(``&ssl_ca_certs=/etc/ssl/ca.pem``); ``?sentinel_ssl=true`` and ``sentinel_ssl_*`` do the same
for the sentinels. When ``celery_lock_redis_url`` is unset and the broker is a sentinel URL, the
lock store is the broker's master, found the same way, with ``master_name``,
``min_other_sentinels`` and ``sentinel_kwargs`` (its ``username``, ``password`` and TLS options)
from ``broker_transport_options``, and the TLS options of ``broker_use_ssl``.

The client is redis-py's own (:meth:`redis.sentinel.Sentinel.master_for`): each new connection
asks the sentinels where the master is, and a connection to a master demoted by a failover
(``READONLY``) is dropped, so the next try, and every later task, reaches the new master.
"""

from __future__ import annotations

import functools
import inspect
import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

import redis
from redis.connection import URL_QUERY_ARGUMENT_PARSERS, SSLConnection
from redis.sentinel import Sentinel

__all__ = ["DEFAULT_SENTINEL_PORT", "SentinelURL", "is_sentinel_url", "sentinel_master_client"]

#: The port of a sentinel URL that gives none: Redis Sentinel's own, as kombu assumes.
DEFAULT_SENTINEL_PORT = 26379

_SCHEME = "sentinel"
#: Query arguments a sentinel URL may give besides the TLS ones; any other is refused rather
#: than ignored.
_QUERY = ("master_name", "sentinel_username", "sentinel_password", "min_other_sentinels")
#: What turns TLS on for the master's connections, and what for the sentinels'.
_MASTER_TLS, _SENTINEL_TLS = "ssl", "sentinel_ssl"


def split_url(url: str) -> SplitResult:
    """``urlsplit(url)``, with the checks of brackets that urllib makes only from Python 3.11.4
    and 3.10.16 (CVE-2024-11168), made on every Python (``ValueError``): a host in brackets
    must be an IPv6 address (an older urllib read ``redis://[zz]/0`` as the host ``zz``, which
    fails every connection, and ``redis://h[x]/0`` as ``x``). A ``[`` or ``]`` in the user
    part is refused before urllib reads it: a newer one would quote the bracketed part of the
    password in its error."""
    netloc = re.split("[/?#]", url.partition("://")[2], maxsplit=1)[0]  # as urllib splits it
    userinfo, _, host = netloc.rpartition("@")
    if "[" in userinfo or "]" in userinfo:
        raise ValueError("the URL's user or password holds '[' or ']': write them %5B and %5D")
    split = urlsplit(url)
    if "[" in host and "]" in host:
        bracketed = host.partition("[")[2].partition("]")[0]
        if bracketed.startswith("v"):
            if not re.fullmatch(r"v[a-fA-F0-9]+\..+", bracketed):
                raise ValueError("IPvFuture address is invalid")
        elif isinstance(ipaddress.ip_address(bracketed), ipaddress.IPv4Address):
            raise ValueError("An IPv4 address cannot be in brackets")
    return split


@functools.cache
def _tls_parameters() -> dict[str, Callable[[str], Any]]:
    """The ``ssl_*`` options this redis-py's TLS connections take from a URL, each with how its
    text is read: as redis-py reads it from a ``rediss://`` URL's query, a flag as ``true`` or
    ``false`` (redis-py would read ``false`` as a true string), anything else as text. Options
    that only an object can give (``ssl_ocsp_context``) are left out. Read once per process:
    redis-py's signature does not change under it."""
    readers: dict[str, Callable[[str], Any]] = {}
    for name, parameter in inspect.signature(SSLConnection.__init__).parameters.items():
        if not name.startswith("ssl_") or name == "ssl_ocsp_context":
            continue
        if name == "ssl_cert_reqs":
            readers[name] = _cert_reqs
        elif isinstance(parameter.default, bool):
            readers[name] = _flag
        else:
            readers[name] = cast(Callable[[str], Any], URL_QUERY_ARGUMENT_PARSERS.get(name, str))
    return readers


def _cert_reqs(text: str) -> str:
    """``ssl_cert_reqs`` as redis-py spells it (its connections refuse any other only when
    they first connect): ``none``, ``optional`` or ``required``."""
    if text not in ("none", "optional", "required"):
        raise ValueError(f"{text!r} is not none, optional or required (as redis-py spells it)")
    return text


def _flag(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError(f"{text!r} is not true or false")
    return text.lower() == "true"


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
    #: The TLS options of the master's connections (``{"ssl_ca_certs": ...}``, read), or
    #: ``None`` where they do not use TLS.
    master_tls: Mapping[str, Any] | None = None
    #: The TLS options of the sentinels' connections, or ``None`` where they do not use TLS.
    sentinel_tls: Mapping[str, Any] | None = None

    @classmethod
    def parse(cls, url: str) -> SentinelURL:
        """Read ``sentinel://[[user]:password@]host[:port][/db][;sentinel://host[:port]]...``
        with ``?master_name=`` (and optionally ``sentinel_username``, ``sentinel_password``,
        ``min_other_sentinels``, and the TLS options ``ssl``, ``ssl_*``, ``sentinel_ssl`` and
        ``sentinel_ssl_*``) on any one of its parts."""
        tls_parameters = _tls_parameters()
        sentinels: list[tuple[str, int]] = []
        query: dict[str, str] = {}
        db, username, password = 0, None, None
        for index, part in enumerate(url.split(";")):
            split = split_url(part.strip())
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
                if name not in _QUERY and _tls_option(name) not in (*tls_parameters, "ssl"):
                    takes = ", ".join((*_QUERY, "ssl", "ssl_*", "sentinel_ssl", "sentinel_ssl_*"))
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
            master_tls=_read_tls(query, _MASTER_TLS, tls_parameters),
            sentinel_tls=_read_tls(query, _SENTINEL_TLS, tls_parameters),
        )


def _tls_option(name: str) -> str:
    """The TLS option a query argument gives, for the master or the sentinels alike:
    ``sentinel_ssl_ca_certs`` gives ``ssl_ca_certs``, as ``ssl_ca_certs`` does."""
    return name.removeprefix("sentinel_")


def _read_tls(
    query: Mapping[str, str], switch: str, parameters: Mapping[str, Callable[[str], Any]]
) -> dict[str, Any] | None:
    """The TLS options that the query gives the connections ``switch`` (``ssl`` or
    ``sentinel_ssl``) turns TLS on for, read; ``None`` where it is not ``true``."""
    prefix = switch.removesuffix("ssl")
    # Every such name is one of ``parameters``: parse refused any other.
    given = {
        _tls_option(name): text for name, text in query.items() if name.startswith(f"{switch}_")
    }
    try:
        enabled = _flag(query.get(switch, "false"))
    except ValueError:
        raise ValueError(f"{switch} must be true or false, got {query[switch]!r}") from None
    if not enabled:
        if given:
            names = ", ".join(prefix + name for name in given)
            raise ValueError(f"{names}: given without {switch}=true, which turns their TLS on")
        return None
    options: dict[str, Any] = {}
    for name, text in given.items():
        try:
            options[name] = parameters[name](text)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{prefix}{name}: {exc}") from None
    return options


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
    if target.sentinel_tls is not None:
        sentinel_options.update(ssl=True, **target.sentinel_tls)
    if target.master_tls is not None:
        options = {**options, "ssl": True, **target.master_tls}
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
