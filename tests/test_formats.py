"""Golden formats: the Redis keys a call locks, and the values stored under them, as literals.

During a rolling upgrade, workers of the old and the new release run side by side on one lock
store. If the new release derives another request key for the same call, the two copies of a
request lock different keys and both run; if it writes a lock or a done-marker that the old one
reads differently (or reads the old one's differently), a lease is misread. So the expected
values below were derived once, from the code as it stood, and pasted here as text.

Never regenerate them to make a failing test pass. A failure here means that a change (to
``celery_lock/keys.py``, the task's key layout, the scripts or the holder's JSON) changes what
a release stores or how it reads what the previous one stored: undo it, or keep it on purpose
and update the literals in the same commit as a CHANGELOG "**Upgrade note:**" naming the keys or
values that change, for a release with a new version (docs/concepts.md, "What stays stable
across releases"). Add cases freely; change an existing one only with such a note.

The key tests touch no Redis; the value tests run against the session's ``redis-server``.
"""

from __future__ import annotations

import datetime
import decimal
import enum
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_lock import LockedTask
from celery_lock.keys import RequestKeys
from celery_lock.lease import Acquired, Done, HandOn, Held, Holder, Lease, new_token
from celery_lock.store import LockStore

ROOT = Path(__file__).resolve().parent.parent

app = Celery("formats_tests", broker="memory://", set_as_current=False)
app.conf.celery_lock_redis_url = "redis://127.0.0.1:1/0"  # never contacted by the key tests

# shared=False: a shared task is added to *every* app that finalizes later in this process.
TASK_OPTIONS: dict[str, Any] = {"base": LockedTask, "shared": False, "lazy": False}


@app.task(name="formats.by_name", lock_key="request_idx", **TASK_OPTIONS)
def by_name(request_idx: Any, tenant: str = "acme") -> Any:
    return request_idx


@app.task(name="formats.by_template", lock_key="{tenant}:{request_idx}", **TASK_OPTIONS)
def by_template(tenant: Any, request_idx: Any) -> Any:
    return request_idx


@app.task(name="formats.by_item", lock_key="{order[tenant]}/{order[id]}", **TASK_OPTIONS)
def by_item(order: Any) -> Any:
    return order


def order_key(order_id: Any, tenant: str = "acme") -> str:
    """A callable ``lock_key``: what it returns is the request key."""
    return f"{tenant}/{order_id}"


@app.task(name="formats.by_callable", lock_key=order_key, **TASK_OPTIONS)
def by_callable(order_id: Any, tenant: str = "acme") -> Any:
    return order_id


@app.task(name="formats.by_digest", **TASK_OPTIONS)
def by_digest(a: Any, b: Any = 2, c: Any = None) -> Any:
    return a


# Two tasks of one scope: one lock and fence per request, a done-marker per task name.
@app.task(name="formats.charge", lock_key="order_id", lock_scope="payments", **TASK_OPTIONS)
def charge(order_id: Any) -> Any:
    return order_id


@app.task(name="formats.refund", lock_key="order_id", lock_scope="payments", **TASK_OPTIONS)
def refund(order_id: Any) -> Any:
    return order_id


# A scope holding ":", which the hash tag would read as another split of scope and request key:
# digested, without the ":".
@app.task(name="formats.invoice", lock_key="order_id", lock_scope="billing:eu", **TASK_OPTIONS)
def invoice(order_id: Any) -> Any:
    return order_id


# A task name the keys cannot hold as it is (a space, braces, non-ASCII), under a prefix of
# its own: the scope and the done-marker's task name are digested, the prefix kept.
@app.task(
    name="formats.Tâche {spéciale}",
    lock_key="request_idx",
    lock_key_prefix="acme/prod.locks:v1",
    **TASK_OPTIONS,
)
def odd_name(request_idx: Any) -> Any:
    return request_idx


@app.task(name="formats.under_prefix", lock_key_prefix="acme/prod.locks:v1", **TASK_OPTIONS)
def default_under_prefix(a: Any) -> Any:
    return a


class Kind(str, enum.Enum):
    REFUND = "refund"


class Level(enum.IntEnum):
    HIGH = 3


AWARE = datetime.datetime(
    2026, 11, 21, 8, 30, 15, 250000, tzinfo=datetime.timezone(datetime.timedelta(hours=2))
)
NAIVE = datetime.datetime(2026, 11, 21, 8, 30, 15)
DAY = datetime.date(2026, 11, 21)
ID = uuid.UUID("12345678-1234-5678-1234-567812345678")
NESTED = {"items": [{"sku": "x-1", "qty": 2}, {"sku": "y-2", "qty": 1}], "tags": {"b", "a"}}

#: Each call of the corpus: the task, its positional and its keyword arguments.
CASES: dict[str, tuple[Any, tuple[Any, ...], dict[str, Any]]] = {
    "name/str": (by_name, ("order-42",), {}),
    "name/int": (by_name, (42,), {}),
    "name/negative-int": (by_name, (-7,), {}),
    "name/big-int": (by_name, (2**70,), {}),
    "name/true": (by_name, (True,), {}),
    "name/false": (by_name, (False,), {}),
    "name/bytes": (by_name, (b"\x00\xffbin",), {}),
    "name/float": (by_name, (1.5,), {}),
    "name/decimal": (by_name, (decimal.Decimal("1.50"),), {}),
    "name/uuid": (by_name, (ID,), {}),
    "name/datetime-aware": (by_name, (AWARE,), {}),
    "name/datetime-naive": (by_name, (NAIVE,), {}),
    "name/date": (by_name, (DAY,), {}),
    "name/str-enum": (by_name, (Kind.REFUND,), {}),
    "name/int-enum": (by_name, (Level.HIGH,), {}),
    "name/list": (by_name, ([3, 1, 2],), {}),
    "name/tuple": (by_name, ((1, "a"),), {}),
    "name/dict": (by_name, ({"b": 1, "a": [1, 2]},), {}),
    "name/dict-int-keys": (by_name, ({10: "x", 2: "y"},), {}),
    "name/set": (by_name, ({"b", "a", "c"},), {}),
    "name/frozenset": (by_name, (frozenset({3, 1, 2}),), {}),
    "name/nested": (by_name, (NESTED,), {}),
    "name/long-str": (by_name, ("order-" + "x" * 200,), {}),
    "name/unsafe-str": (by_name, ("order 42 {eu}",), {}),
    "name/non-ascii-str": (by_name, ("commande-é",), {}),
    "name/keyword": (by_name, (), {"request_idx": 42, "tenant": "other"}),
    "template/str-int": (by_template, ("acme", 42), {}),
    "template/keywords": (by_template, (), {"request_idx": 42, "tenant": "acme"}),
    "template/none-part": (by_template, ("acme", None), {}),
    "template/bool": (by_template, ("acme", True), {}),
    "template/bytes": (by_template, ("acme", b"\x00\xff"), {}),
    "template/float": (by_template, ("acme", 0.1), {}),
    "template/decimal": (by_template, ("acme", decimal.Decimal("2.5")), {}),
    "template/uuid": (by_template, ("acme", ID), {}),
    "template/datetime-aware": (by_template, ("acme", AWARE), {}),
    "template/datetime-naive": (by_template, ("acme", NAIVE), {}),
    "template/date": (by_template, ("acme", DAY), {}),
    "template/enums": (by_template, (Kind.REFUND, Level.HIGH), {}),
    "template/list": (by_template, ("acme", [1, 2]), {}),
    "template/dict": (by_template, ("acme", {"b": 2, "a": 1}), {}),
    "template/set": (by_template, ("acme", {"y", "x"}), {}),
    "template/nested": (by_template, ("acme", NESTED), {}),
    "template/unsafe": (by_template, ("acme corp", "{42}"), {}),
    "template/long": (by_template, ("acme", "y" * 200), {}),
    # The separator in a value before it: digested, apart from the call it would read as.
    "template/separator-in-value": (by_template, ("acme:eu", 1), {}),
    "template/separator-in-last": (by_template, ("acme", "eu:1"), {}),
    "template/item": (by_item, ({"id": 42, "tenant": "acme"},), {}),
    "callable/positional": (by_callable, (42,), {}),
    "callable/keywords": (by_callable, (), {"order_id": 42, "tenant": "other"}),
    "callable/unsafe": (by_callable, ("order 42",), {}),
    "default/positional": (by_digest, (1,), {}),
    "default/keyword": (by_digest, (), {"a": 1}),
    "default/defaults-given": (by_digest, (1, 2, None), {}),
    "default/other-b": (by_digest, (1,), {"b": 3}),
    "default/str": (by_digest, ("order-42",), {}),
    "default/containers": (by_digest, ([1, 2], {"y": (3, 4), "x": None}), {}),
    "default/set": (by_digest, ({"b", "a"},), {}),
    "default/bytes": (by_digest, (b"ab",), {}),
    "default/decimal-uuid": (by_digest, (decimal.Decimal("1.50"), ID), {}),
    "default/datetime-aware": (by_digest, (AWARE,), {}),
    "default/datetime-naive-date": (by_digest, (NAIVE, DAY), {}),
    "default/enums": (by_digest, (Kind.REFUND, Level.HIGH), {}),
    "default/float": (by_digest, (1.5,), {}),
    "default/dict-int-keys": (by_digest, ({10: "x", 2: "y"},), {}),
    "default/tag-like-dict": (by_digest, ({"__bytes__": "6162"},), {}),
    "scope/charge": (charge, (42,), {}),
    "scope/refund": (refund, (42,), {}),
    "scope/colon": (invoice, (42,), {}),
    "odd-name/name-key": (odd_name, (42,), {}),
    "odd-prefix/default": (default_under_prefix, (42,), {}),
}

#: The keys of each call: (lock, fence, done). Derived once; see the module's docstring.
GOLDEN: dict[str, tuple[str, str, str]] = {
    "callable/keywords": (
        "celery-lock:{formats.by_callable:other/42}:lock",
        "celery-lock:{formats.by_callable:other/42}:fence",
        "celery-lock:{formats.by_callable:other/42}:done:formats.by_callable",
    ),
    "callable/positional": (
        "celery-lock:{formats.by_callable:acme/42}:lock",
        "celery-lock:{formats.by_callable:acme/42}:fence",
        "celery-lock:{formats.by_callable:acme/42}:done:formats.by_callable",
    ),
    "callable/unsafe": (
        "celery-lock:{formats.by_callable:acme/order42~6132d698f28f3bfb77405ad2be4486d2}:lock",
        "celery-lock:{formats.by_callable:acme/order42~6132d698f28f3bfb77405ad2be4486d2}:fence",
        "celery-lock:{formats.by_callable:acme/order42~6132d698f28f3bfb77405ad2be4486d2}:done:formats.by_callable",
    ),
    "default/bytes": (
        "celery-lock:{formats.by_digest:args~782fd2de4bc353f1aa36ca079ee35fba}:lock",
        "celery-lock:{formats.by_digest:args~782fd2de4bc353f1aa36ca079ee35fba}:fence",
        "celery-lock:{formats.by_digest:args~782fd2de4bc353f1aa36ca079ee35fba}:done:formats.by_digest",
    ),
    "default/containers": (
        "celery-lock:{formats.by_digest:args~67b5c61d15511739928d974bc97add5a}:lock",
        "celery-lock:{formats.by_digest:args~67b5c61d15511739928d974bc97add5a}:fence",
        "celery-lock:{formats.by_digest:args~67b5c61d15511739928d974bc97add5a}:done:formats.by_digest",
    ),
    "default/datetime-aware": (
        "celery-lock:{formats.by_digest:args~5b49d55fe8c64105981c0b1a5f6640d1}:lock",
        "celery-lock:{formats.by_digest:args~5b49d55fe8c64105981c0b1a5f6640d1}:fence",
        "celery-lock:{formats.by_digest:args~5b49d55fe8c64105981c0b1a5f6640d1}:done:formats.by_digest",
    ),
    "default/datetime-naive-date": (
        "celery-lock:{formats.by_digest:args~42ced05752c3a38e6bb208a1163a0d46}:lock",
        "celery-lock:{formats.by_digest:args~42ced05752c3a38e6bb208a1163a0d46}:fence",
        "celery-lock:{formats.by_digest:args~42ced05752c3a38e6bb208a1163a0d46}:done:formats.by_digest",
    ),
    "default/decimal-uuid": (
        "celery-lock:{formats.by_digest:args~438ff3c48501d9c64aad110416845524}:lock",
        "celery-lock:{formats.by_digest:args~438ff3c48501d9c64aad110416845524}:fence",
        "celery-lock:{formats.by_digest:args~438ff3c48501d9c64aad110416845524}:done:formats.by_digest",
    ),
    "default/defaults-given": (
        "celery-lock:{formats.by_digest:args~11810eec536723668ad82ac70ac5b226}:lock",
        "celery-lock:{formats.by_digest:args~11810eec536723668ad82ac70ac5b226}:fence",
        "celery-lock:{formats.by_digest:args~11810eec536723668ad82ac70ac5b226}:done:formats.by_digest",
    ),
    "default/dict-int-keys": (
        "celery-lock:{formats.by_digest:args~fb9eabc190675254fc070288cc0c5186}:lock",
        "celery-lock:{formats.by_digest:args~fb9eabc190675254fc070288cc0c5186}:fence",
        "celery-lock:{formats.by_digest:args~fb9eabc190675254fc070288cc0c5186}:done:formats.by_digest",
    ),
    "default/enums": (
        "celery-lock:{formats.by_digest:args~248888f14a40ae7966fadbc1f0f19938}:lock",
        "celery-lock:{formats.by_digest:args~248888f14a40ae7966fadbc1f0f19938}:fence",
        "celery-lock:{formats.by_digest:args~248888f14a40ae7966fadbc1f0f19938}:done:formats.by_digest",
    ),
    "default/float": (
        "celery-lock:{formats.by_digest:args~252dccbd8dbf64b77879425706f97032}:lock",
        "celery-lock:{formats.by_digest:args~252dccbd8dbf64b77879425706f97032}:fence",
        "celery-lock:{formats.by_digest:args~252dccbd8dbf64b77879425706f97032}:done:formats.by_digest",
    ),
    "default/keyword": (
        "celery-lock:{formats.by_digest:args~11810eec536723668ad82ac70ac5b226}:lock",
        "celery-lock:{formats.by_digest:args~11810eec536723668ad82ac70ac5b226}:fence",
        "celery-lock:{formats.by_digest:args~11810eec536723668ad82ac70ac5b226}:done:formats.by_digest",
    ),
    "default/other-b": (
        "celery-lock:{formats.by_digest:args~ce90c272022d523cfa919197279e2959}:lock",
        "celery-lock:{formats.by_digest:args~ce90c272022d523cfa919197279e2959}:fence",
        "celery-lock:{formats.by_digest:args~ce90c272022d523cfa919197279e2959}:done:formats.by_digest",
    ),
    "default/positional": (
        "celery-lock:{formats.by_digest:args~11810eec536723668ad82ac70ac5b226}:lock",
        "celery-lock:{formats.by_digest:args~11810eec536723668ad82ac70ac5b226}:fence",
        "celery-lock:{formats.by_digest:args~11810eec536723668ad82ac70ac5b226}:done:formats.by_digest",
    ),
    "default/set": (
        "celery-lock:{formats.by_digest:args~06f46a84775398196b3cff5726deacdc}:lock",
        "celery-lock:{formats.by_digest:args~06f46a84775398196b3cff5726deacdc}:fence",
        "celery-lock:{formats.by_digest:args~06f46a84775398196b3cff5726deacdc}:done:formats.by_digest",
    ),
    "default/str": (
        "celery-lock:{formats.by_digest:args~454711e0ce2da1ef7f9fc227a43248ff}:lock",
        "celery-lock:{formats.by_digest:args~454711e0ce2da1ef7f9fc227a43248ff}:fence",
        "celery-lock:{formats.by_digest:args~454711e0ce2da1ef7f9fc227a43248ff}:done:formats.by_digest",
    ),
    "default/tag-like-dict": (
        "celery-lock:{formats.by_digest:args~eac25085b7df2f82d4c022057c4769a0}:lock",
        "celery-lock:{formats.by_digest:args~eac25085b7df2f82d4c022057c4769a0}:fence",
        "celery-lock:{formats.by_digest:args~eac25085b7df2f82d4c022057c4769a0}:done:formats.by_digest",
    ),
    "name/big-int": (
        "celery-lock:{formats.by_name:1180591620717411303424}:lock",
        "celery-lock:{formats.by_name:1180591620717411303424}:fence",
        "celery-lock:{formats.by_name:1180591620717411303424}:done:formats.by_name",
    ),
    "name/bytes": (
        "celery-lock:{formats.by_name:bin~ea0e89fbadcf620c3567eabff488e5d3}:lock",
        "celery-lock:{formats.by_name:bin~ea0e89fbadcf620c3567eabff488e5d3}:fence",
        "celery-lock:{formats.by_name:bin~ea0e89fbadcf620c3567eabff488e5d3}:done:formats.by_name",
    ),
    "name/date": (
        "celery-lock:{formats.by_name:2026-11-21}:lock",
        "celery-lock:{formats.by_name:2026-11-21}:fence",
        "celery-lock:{formats.by_name:2026-11-21}:done:formats.by_name",
    ),
    "name/datetime-aware": (
        "celery-lock:{formats.by_name:2026-11-2108:30:15.250000+02:00~c632569bf81fde970a6c0c728bd0b32a}:lock",
        "celery-lock:{formats.by_name:2026-11-2108:30:15.250000+02:00~c632569bf81fde970a6c0c728bd0b32a}:fence",
        "celery-lock:{formats.by_name:2026-11-2108:30:15.250000+02:00~c632569bf81fde970a6c0c728bd0b32a}:done:formats.by_name",
    ),
    "name/datetime-naive": (
        "celery-lock:{formats.by_name:2026-11-2108:30:15~ed45798198e82ed5a0e3117f95381cfc}:lock",
        "celery-lock:{formats.by_name:2026-11-2108:30:15~ed45798198e82ed5a0e3117f95381cfc}:fence",
        "celery-lock:{formats.by_name:2026-11-2108:30:15~ed45798198e82ed5a0e3117f95381cfc}:done:formats.by_name",
    ),
    "name/decimal": (
        "celery-lock:{formats.by_name:1.50}:lock",
        "celery-lock:{formats.by_name:1.50}:fence",
        "celery-lock:{formats.by_name:1.50}:done:formats.by_name",
    ),
    "name/dict": (
        "celery-lock:{formats.by_name:a:12b:1~94a786c3662bc7beeb598efa7d8cb58d}:lock",
        "celery-lock:{formats.by_name:a:12b:1~94a786c3662bc7beeb598efa7d8cb58d}:fence",
        "celery-lock:{formats.by_name:a:12b:1~94a786c3662bc7beeb598efa7d8cb58d}:done:formats.by_name",
    ),
    "name/dict-int-keys": (
        "celery-lock:{formats.by_name:10:x2:y~5b96bff78682e777d6ef2bf1c1bfa5c4}:lock",
        "celery-lock:{formats.by_name:10:x2:y~5b96bff78682e777d6ef2bf1c1bfa5c4}:fence",
        "celery-lock:{formats.by_name:10:x2:y~5b96bff78682e777d6ef2bf1c1bfa5c4}:done:formats.by_name",
    ),
    "name/false": (
        "celery-lock:{formats.by_name:false}:lock",
        "celery-lock:{formats.by_name:false}:fence",
        "celery-lock:{formats.by_name:false}:done:formats.by_name",
    ),
    "name/float": (
        "celery-lock:{formats.by_name:1.5}:lock",
        "celery-lock:{formats.by_name:1.5}:fence",
        "celery-lock:{formats.by_name:1.5}:done:formats.by_name",
    ),
    "name/frozenset": (
        "celery-lock:{formats.by_name:__set__:123~54471dcf03028e1f9cece0542a4932c0}:lock",
        "celery-lock:{formats.by_name:__set__:123~54471dcf03028e1f9cece0542a4932c0}:fence",
        "celery-lock:{formats.by_name:__set__:123~54471dcf03028e1f9cece0542a4932c0}:done:formats.by_name",
    ),
    "name/int": (
        "celery-lock:{formats.by_name:42}:lock",
        "celery-lock:{formats.by_name:42}:fence",
        "celery-lock:{formats.by_name:42}:done:formats.by_name",
    ),
    "name/int-enum": (
        "celery-lock:{formats.by_name:3}:lock",
        "celery-lock:{formats.by_name:3}:fence",
        "celery-lock:{formats.by_name:3}:done:formats.by_name",
    ),
    "name/keyword": (
        "celery-lock:{formats.by_name:42}:lock",
        "celery-lock:{formats.by_name:42}:fence",
        "celery-lock:{formats.by_name:42}:done:formats.by_name",
    ),
    "name/list": (
        "celery-lock:{formats.by_name:312~51bda7ab4e44726cde71fcb6e4b51535}:lock",
        "celery-lock:{formats.by_name:312~51bda7ab4e44726cde71fcb6e4b51535}:fence",
        "celery-lock:{formats.by_name:312~51bda7ab4e44726cde71fcb6e4b51535}:done:formats.by_name",
    ),
    "name/long-str": (
        "celery-lock:{formats.by_name:order-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx~db0ab7291691805ca22ec6db0eaa36ed}:lock",
        "celery-lock:{formats.by_name:order-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx~db0ab7291691805ca22ec6db0eaa36ed}:fence",
        "celery-lock:{formats.by_name:order-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx~db0ab7291691805ca22ec6db0eaa36ed}:done:formats.by_name",
    ),
    "name/negative-int": (
        "celery-lock:{formats.by_name:-7}:lock",
        "celery-lock:{formats.by_name:-7}:fence",
        "celery-lock:{formats.by_name:-7}:done:formats.by_name",
    ),
    "name/nested": (
        "celery-lock:{formats.by_name:items:qty:2sku:x-1qty:1~9815870c4f5bf0436f3b86188720fe3a}:lock",
        "celery-lock:{formats.by_name:items:qty:2sku:x-1qty:1~9815870c4f5bf0436f3b86188720fe3a}:fence",
        "celery-lock:{formats.by_name:items:qty:2sku:x-1qty:1~9815870c4f5bf0436f3b86188720fe3a}:done:formats.by_name",
    ),
    "name/non-ascii-str": (
        "celery-lock:{formats.by_name:commande-~f0b0143ca955119275a37c7bf48aab2d}:lock",
        "celery-lock:{formats.by_name:commande-~f0b0143ca955119275a37c7bf48aab2d}:fence",
        "celery-lock:{formats.by_name:commande-~f0b0143ca955119275a37c7bf48aab2d}:done:formats.by_name",
    ),
    "name/set": (
        "celery-lock:{formats.by_name:__set__:abc~f5c1d0841da91c4d9bd88b1d600f7162}:lock",
        "celery-lock:{formats.by_name:__set__:abc~f5c1d0841da91c4d9bd88b1d600f7162}:fence",
        "celery-lock:{formats.by_name:__set__:abc~f5c1d0841da91c4d9bd88b1d600f7162}:done:formats.by_name",
    ),
    "name/str": (
        "celery-lock:{formats.by_name:order-42}:lock",
        "celery-lock:{formats.by_name:order-42}:fence",
        "celery-lock:{formats.by_name:order-42}:done:formats.by_name",
    ),
    "name/str-enum": (
        "celery-lock:{formats.by_name:refund}:lock",
        "celery-lock:{formats.by_name:refund}:fence",
        "celery-lock:{formats.by_name:refund}:done:formats.by_name",
    ),
    "name/true": (
        "celery-lock:{formats.by_name:true}:lock",
        "celery-lock:{formats.by_name:true}:fence",
        "celery-lock:{formats.by_name:true}:done:formats.by_name",
    ),
    "name/tuple": (
        "celery-lock:{formats.by_name:1a~2010945388e2de98f5651051478912aa}:lock",
        "celery-lock:{formats.by_name:1a~2010945388e2de98f5651051478912aa}:fence",
        "celery-lock:{formats.by_name:1a~2010945388e2de98f5651051478912aa}:done:formats.by_name",
    ),
    "name/unsafe-str": (
        "celery-lock:{formats.by_name:order42eu~fdd7ce6622a54b766a5c9f60ccc33419}:lock",
        "celery-lock:{formats.by_name:order42eu~fdd7ce6622a54b766a5c9f60ccc33419}:fence",
        "celery-lock:{formats.by_name:order42eu~fdd7ce6622a54b766a5c9f60ccc33419}:done:formats.by_name",
    ),
    "name/uuid": (
        "celery-lock:{formats.by_name:12345678-1234-5678-1234-567812345678}:lock",
        "celery-lock:{formats.by_name:12345678-1234-5678-1234-567812345678}:fence",
        "celery-lock:{formats.by_name:12345678-1234-5678-1234-567812345678}:done:formats.by_name",
    ),
    "odd-name/name-key": (
        "acme/prod.locks:v1:{formats.Tchespciale~111a7ac124179c0b4c164d05d4ababe6:42}:lock",
        "acme/prod.locks:v1:{formats.Tchespciale~111a7ac124179c0b4c164d05d4ababe6:42}:fence",
        "acme/prod.locks:v1:{formats.Tchespciale~111a7ac124179c0b4c164d05d4ababe6:42}:done:formats.Tchespciale~111a7ac124179c0b4c164d05d4ababe6",
    ),
    "odd-prefix/default": (
        "acme/prod.locks:v1:{formats.under_prefix:args~456d39f4cf0e9d63598d50a9a40ed9e0}:lock",
        "acme/prod.locks:v1:{formats.under_prefix:args~456d39f4cf0e9d63598d50a9a40ed9e0}:fence",
        "acme/prod.locks:v1:{formats.under_prefix:args~456d39f4cf0e9d63598d50a9a40ed9e0}:done:formats.under_prefix",
    ),
    "scope/charge": (
        "celery-lock:{payments:42}:lock",
        "celery-lock:{payments:42}:fence",
        "celery-lock:{payments:42}:done:formats.charge",
    ),
    "scope/colon": (
        "celery-lock:{billingeu~ab0778d965e8f3b0b21bc5146a043495:42}:lock",
        "celery-lock:{billingeu~ab0778d965e8f3b0b21bc5146a043495:42}:fence",
        "celery-lock:{billingeu~ab0778d965e8f3b0b21bc5146a043495:42}:done:formats.invoice",
    ),
    "scope/refund": (
        "celery-lock:{payments:42}:lock",
        "celery-lock:{payments:42}:fence",
        "celery-lock:{payments:42}:done:formats.refund",
    ),
    "template/bool": (
        "celery-lock:{formats.by_template:acme:true}:lock",
        "celery-lock:{formats.by_template:acme:true}:fence",
        "celery-lock:{formats.by_template:acme:true}:done:formats.by_template",
    ),
    "template/bytes": (
        "celery-lock:{formats.by_template:acme:4b4d76d09517cf312f14d2fa28fe62d156~869c3dabfa342ccf67b00fc768d8a6bf}:lock",
        "celery-lock:{formats.by_template:acme:4b4d76d09517cf312f14d2fa28fe62d156~869c3dabfa342ccf67b00fc768d8a6bf}:fence",
        "celery-lock:{formats.by_template:acme:4b4d76d09517cf312f14d2fa28fe62d156~869c3dabfa342ccf67b00fc768d8a6bf}:done:formats.by_template",
    ),
    "template/date": (
        "celery-lock:{formats.by_template:acme:2026-11-21}:lock",
        "celery-lock:{formats.by_template:acme:2026-11-21}:fence",
        "celery-lock:{formats.by_template:acme:2026-11-21}:done:formats.by_template",
    ),
    "template/datetime-aware": (
        "celery-lock:{formats.by_template:acme:2026-11-2108:30:15.250000+02:00~260ec3f931ab7537273933b36b9765e2}:lock",
        "celery-lock:{formats.by_template:acme:2026-11-2108:30:15.250000+02:00~260ec3f931ab7537273933b36b9765e2}:fence",
        "celery-lock:{formats.by_template:acme:2026-11-2108:30:15.250000+02:00~260ec3f931ab7537273933b36b9765e2}:done:formats.by_template",
    ),
    "template/datetime-naive": (
        "celery-lock:{formats.by_template:acme:2026-11-2108:30:15~bbc633bf6dbff4a372f41d95842fb815}:lock",
        "celery-lock:{formats.by_template:acme:2026-11-2108:30:15~bbc633bf6dbff4a372f41d95842fb815}:fence",
        "celery-lock:{formats.by_template:acme:2026-11-2108:30:15~bbc633bf6dbff4a372f41d95842fb815}:done:formats.by_template",
    ),
    "template/decimal": (
        "celery-lock:{formats.by_template:acme:2.5}:lock",
        "celery-lock:{formats.by_template:acme:2.5}:fence",
        "celery-lock:{formats.by_template:acme:2.5}:done:formats.by_template",
    ),
    "template/dict": (
        "celery-lock:{formats.by_template:acme:a:1b:2~356e4d4399f10fe9ef009ea89452b764}:lock",
        "celery-lock:{formats.by_template:acme:a:1b:2~356e4d4399f10fe9ef009ea89452b764}:fence",
        "celery-lock:{formats.by_template:acme:a:1b:2~356e4d4399f10fe9ef009ea89452b764}:done:formats.by_template",
    ),
    "template/enums": (
        "celery-lock:{formats.by_template:refund:3}:lock",
        "celery-lock:{formats.by_template:refund:3}:fence",
        "celery-lock:{formats.by_template:refund:3}:done:formats.by_template",
    ),
    "template/float": (
        "celery-lock:{formats.by_template:acme:0.1}:lock",
        "celery-lock:{formats.by_template:acme:0.1}:fence",
        "celery-lock:{formats.by_template:acme:0.1}:done:formats.by_template",
    ),
    "template/item": (
        "celery-lock:{formats.by_item:acme/42}:lock",
        "celery-lock:{formats.by_item:acme/42}:fence",
        "celery-lock:{formats.by_item:acme/42}:done:formats.by_item",
    ),
    "template/keywords": (
        "celery-lock:{formats.by_template:acme:42}:lock",
        "celery-lock:{formats.by_template:acme:42}:fence",
        "celery-lock:{formats.by_template:acme:42}:done:formats.by_template",
    ),
    "template/list": (
        "celery-lock:{formats.by_template:acme:12~191921f26be78cf3ead29745923178a7}:lock",
        "celery-lock:{formats.by_template:acme:12~191921f26be78cf3ead29745923178a7}:fence",
        "celery-lock:{formats.by_template:acme:12~191921f26be78cf3ead29745923178a7}:done:formats.by_template",
    ),
    "template/long": (
        "celery-lock:{formats.by_template:acme:yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy~c3d10fff31dbd1c3e395ad95a397a4d5}:lock",
        "celery-lock:{formats.by_template:acme:yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy~c3d10fff31dbd1c3e395ad95a397a4d5}:fence",
        "celery-lock:{formats.by_template:acme:yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy~c3d10fff31dbd1c3e395ad95a397a4d5}:done:formats.by_template",
    ),
    "template/nested": (
        "celery-lock:{formats.by_template:acme:items:qty:2sku:x-1q~4fb9bf26bef5c7345f0931e7f11dd31b}:lock",
        "celery-lock:{formats.by_template:acme:items:qty:2sku:x-1q~4fb9bf26bef5c7345f0931e7f11dd31b}:fence",
        "celery-lock:{formats.by_template:acme:items:qty:2sku:x-1q~4fb9bf26bef5c7345f0931e7f11dd31b}:done:formats.by_template",
    ),
    "template/none-part": (
        "celery-lock:{formats.by_template:acme:null}:lock",
        "celery-lock:{formats.by_template:acme:null}:fence",
        "celery-lock:{formats.by_template:acme:null}:done:formats.by_template",
    ),
    "template/separator-in-last": (
        "celery-lock:{formats.by_template:acme:eu:1}:lock",
        "celery-lock:{formats.by_template:acme:eu:1}:fence",
        "celery-lock:{formats.by_template:acme:eu:1}:done:formats.by_template",
    ),
    "template/separator-in-value": (
        "celery-lock:{formats.by_template:acme:eu:1~66cf142293dfbbddb9232ce813181b05}:lock",
        "celery-lock:{formats.by_template:acme:eu:1~66cf142293dfbbddb9232ce813181b05}:fence",
        "celery-lock:{formats.by_template:acme:eu:1~66cf142293dfbbddb9232ce813181b05}:done:formats.by_template",
    ),
    "template/set": (
        "celery-lock:{formats.by_template:acme:__set__:xy~4db916c985cda802b00053791912f722}:lock",
        "celery-lock:{formats.by_template:acme:__set__:xy~4db916c985cda802b00053791912f722}:fence",
        "celery-lock:{formats.by_template:acme:__set__:xy~4db916c985cda802b00053791912f722}:done:formats.by_template",
    ),
    "template/str-int": (
        "celery-lock:{formats.by_template:acme:42}:lock",
        "celery-lock:{formats.by_template:acme:42}:fence",
        "celery-lock:{formats.by_template:acme:42}:done:formats.by_template",
    ),
    "template/unsafe": (
        "celery-lock:{formats.by_template:acmecorp:42~3ef4cecf98b7d69fbf289ce358a0e852}:lock",
        "celery-lock:{formats.by_template:acmecorp:42~3ef4cecf98b7d69fbf289ce358a0e852}:fence",
        "celery-lock:{formats.by_template:acmecorp:42~3ef4cecf98b7d69fbf289ce358a0e852}:done:formats.by_template",
    ),
    "template/uuid": (
        "celery-lock:{formats.by_template:acme:12345678-1234-5678-1234-567812345678}:lock",
        "celery-lock:{formats.by_template:acme:12345678-1234-5678-1234-567812345678}:fence",
        "celery-lock:{formats.by_template:acme:12345678-1234-5678-1234-567812345678}:done:formats.by_template",
    ),
}


def test_every_call_of_the_corpus_has_golden_keys() -> None:
    assert sorted(CASES) == sorted(GOLDEN)


@pytest.mark.parametrize("case", sorted(CASES))
def test_request_keys_are_the_golden_ones(case: str) -> None:
    task, args, kwargs = CASES[case]
    keys = task.request_keys(args, kwargs)
    assert (keys.lock, keys.fence, keys.done) == GOLDEN[case]


# -- the values stored under the keys ----------------------------------------------------------

#: The lock's value: ``"<token> <fence> <holder JSON>"``. The scripts compare the token by
#: prefix and read the fence as the number after it; ``celery lock`` and a copy that finds the
#: lease held read the holder's JSON.
LOCK_VALUE = re.compile(r"(?P<token>[0-9a-f]{32}) (?P<fence>[1-9][0-9]*) (?P<holder>\{.*\})")
#: The holder's fields, in the order they are written.
HOLDER_FIELDS = ["task_id", "task", "host", "pid", "since"]

#: A lease as a worker of an earlier release writes it, taken as it is: whatever writes it,
#: the current scripts and ``celery lock`` must read it alike.
OLD_TOKEN = "0123456789abcdef0123456789abcdef"
OLD_HOLDER = (
    '{"task_id": "old-task-7", "task": "formats.by_name", "host": "old-host", "pid": 4242, '
    '"since": 1795000000000}'
)
OLD_LOCK = f"{OLD_TOKEN} 7 {OLD_HOLDER}"


def celery_lock_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.storm_app", "lock", *args],
        env={**os.environ, **env}, cwd=ROOT, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip


@pytest.fixture
def by_name_here(celery_app: Celery) -> Any:
    """``formats.by_name`` on the session's redis-server: the golden keys of the corpus."""

    @celery_app.task(base=LockedTask, lock_key="request_idx", name="formats.by_name")
    def run(request_idx: Any, tenant: str = "acme") -> Any:
        return request_idx

    return run


@pytest.mark.usefixtures("close_lock_runtime")
def test_a_grant_stores_the_lock_fence_counter_and_done_marker_in_the_golden_formats(
    celery_app: Celery, lock_redis: redis.Redis
) -> None:
    seen: dict[str, Any] = {}

    @celery_app.task(base=LockedTask, bind=True, lock_key="request_idx", name="formats.by_name")
    def record(self: Any, request_idx: Any) -> str:
        keys = self.request_keys((request_idx,), {})
        seen.update(
            lock=lock_redis.get(keys.lock),
            fence=lock_redis.get(keys.fence),
            fence_type=lock_redis.type(keys.fence),
            lock_fence=self.request.lock_fence,
        )
        return "ran"

    before_us = time.time_ns() // 1000
    assert record.apply((42,), task_id="golden-task-1").get() == "ran"
    after_us = time.time_ns() // 1000
    lock, fence, done = GOLDEN["name/int"]
    assert record.request_keys((42,), {}) == RequestKeys(lock, fence, done)

    parsed = LOCK_VALUE.fullmatch(seen["lock"].decode())
    assert parsed, seen["lock"]
    # A new request's first fence: the granting process's clock, in microseconds.
    assert int(parsed["fence"]) == seen["lock_fence"]
    assert before_us <= seen["lock_fence"] <= after_us
    holder = json.loads(parsed["holder"])
    assert list(holder) == HOLDER_FIELDS
    assert holder["task_id"] == "golden-task-1"
    assert holder["task"] == "formats.by_name"
    assert isinstance(holder["host"], str)
    assert (type(holder["pid"]), type(holder["since"])) == (int, int)
    # The fence counter: a plain string counter (INCR), its value the last fence granted.
    assert (seen["fence_type"], seen["fence"]) == (b"string", parsed["fence"].encode())
    # The done-marker: the id of the task that completed the request, as a plain string.
    assert lock_redis.type(done) == b"string"
    assert lock_redis.get(done) == b"golden-task-1"
    assert not lock_redis.exists(lock)


@pytest.mark.usefixtures("close_lock_runtime")
def test_a_lease_an_earlier_release_wrote_is_read_as_held_extended_and_released(
    by_name_here: Any, store: LockStore, lock_redis: redis.Redis
) -> None:
    keys = RequestKeys(*GOLDEN["name/int"])
    lock_redis.set(keys.lock, OLD_LOCK, px=60_000)
    lock_redis.set(keys.fence, 7)
    other = Holder("new-task-8", "formats.by_name", "new-host", 1)

    outcome = store.acquire(keys, new_token(), 30_000, other, 60_000)
    assert isinstance(outcome, Held)
    assert (outcome.task_id, outcome.task_name) == ("old-task-7", "formats.by_name")
    assert 0 < outcome.pttl_ms <= 60_000
    skipped = by_name_here.apply((42,), task_id="new-task-8").result  # eager: IGNORED
    assert (skipped.reason, skipped.holder) == ("running", "old-task-7")

    # The holder's own token: re-entrant at its fence, extended, released with a done-marker.
    old_holder = Holder("old-task-7", "formats.by_name", "old-host", 4242)
    assert store.acquire(keys, OLD_TOKEN, 30_000, old_holder, 60_000) == Acquired(fence=7)
    assert lock_redis.get(keys.lock) == OLD_LOCK.encode()  # kept as written
    lease = Lease(store, keys, OLD_TOKEN, 30_000, 7, old_holder)
    stranger = Lease(store, keys, new_token(), 30_000, 7, other)
    assert store.extend_all([lease, stranger]) == [True, False]
    assert store.release(lease, success=True, done_ttl_ms=60_000)
    assert store.acquire(keys, new_token(), 30_000, other, 60_000) == Done(task_id="old-task-7")


#: A hand-on marker (``self.replace``) as this release writes it, before the replacement is sent:
#: the replaced run's depth, its root id and its task id, each after a 0xFF byte; and as it is
#: once the replacement was sent.
HANDING_ON_MARKER = b"\xffhanding-on:0\xffgolden-root\xffgolden-task-2"
HAND_ON_MARKER = b"\xffhanded-on:0\xffgolden-root\xffgolden-task-2"


@pytest.mark.usefixtures("close_lock_runtime")
def test_a_hand_on_marker_is_written_and_read_in_the_golden_format(
    store: LockStore, lock_redis: redis.Redis
) -> None:
    keys = RequestKeys(*GOLDEN["name/int"])
    holder = Holder("golden-task-2", "formats.by_name", "host", 1)
    token = new_token()
    fence = store.acquire(keys, token, 30_000, holder, 60_000)
    assert isinstance(fence, Acquired)
    lease = Lease(store, keys, token, 30_000, fence.fence, holder)
    lease.handed_on = HandOn(0, "golden-root")
    assert store.release(lease, success=True, done_ttl_ms=60_000)
    assert lock_redis.get(keys.done) == HANDING_ON_MARKER
    assert store.confirm_hand_on(lease, 60_000)
    assert lock_redis.get(keys.done) == HAND_ON_MARKER
    # Written as they are by another process: read as done, but by the replacement.
    other = Holder("other-task", "formats.by_name", "host", 1)
    for marker, sent in ((HANDING_ON_MARKER, False), (HAND_ON_MARKER, True)):
        lock_redis.set(keys.done, marker)
        handed_on = Done("golden-task-2", handed_on_at=0, root_id="golden-root", sent=sent)
        assert store.acquire(keys, new_token(), 30_000, other, 60_000) == handed_on
        replacement = store.acquire(keys, token, 30_000, holder, 60_000, 1, "golden-root")
        assert isinstance(replacement, Acquired)
        lock_redis.delete(keys.lock)


def test_celery_lock_show_reads_a_lease_and_done_marker_an_earlier_release_wrote(
    worker_env: dict[str, str], lock_redis: redis.Redis
) -> None:
    keys = RequestKeys(*GOLDEN["name/int"])
    lock_redis.set(keys.lock, OLD_LOCK, px=60_000)
    lock_redis.set(keys.fence, 7)
    # A done-marker of another task of the scope, as the earlier release wrote it.
    lock_redis.set("celery-lock:{formats.by_name:42}:done:formats.earlier", "old-task-5")

    shown = celery_lock_cli(worker_env, "--json", "show", keys.lock)
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    lease = info["lease"]
    assert (lease["task_id"], lease["task"], lease["worker"]) == (
        "old-task-7",
        "formats.by_name",
        "old-host:4242",
    )
    assert (lease["fence"], info["fence"]) == (7, 7)
    assert info["done"]["formats.earlier"]["task_id"] == "old-task-5"
