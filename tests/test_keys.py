"""Request keys and the Redis keys of a request: stable, distinct, one hash slot, bounded.

Nothing here talks to Redis: the lock store URL is set but never contacted.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import hashlib
import inspect
import json
import operator
import os
import re
import string
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from celery import Celery, Task
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kombu.utils import json as kombu_json
from redis.crc import key_slot

from celery_lock import ConfigurationError, LockedTask, LockKeyError
from celery_lock import keys as keys_module
from celery_lock.keys import (
    MAX_KEY_LENGTH,
    KeyDeriver,
    RequestKeys,
    digest_arguments,
    safe_key_part,
    scope_key_part,
    stored_key_part,
)

ROOT = Path(__file__).resolve().parent.parent

app = Celery("keys_tests", broker="memory://", set_as_current=False)
app.conf.celery_lock_redis_url = "redis://127.0.0.1:1/0"

# shared=False: a shared task is added to *every* app that finalizes later in this process.
TASK_OPTIONS: dict[str, Any] = {"base": LockedTask, "shared": False, "lazy": False}


@app.task(name="keys_tests.by_name", lock_key="request_idx", **TASK_OPTIONS)
def by_name(request_idx: Any, tenant: str = "acme") -> Any:
    return request_idx


@app.task(name="keys_tests.by_template", lock_key="{tenant}:{request_idx}", **TASK_OPTIONS)
def by_template(tenant: Any, request_idx: Any) -> Any:
    return request_idx


@app.task(name="keys_tests.by_kwargs", lock_key="{tenant}:{request_idx}", **TASK_OPTIONS)
def by_kwargs(**fields: Any) -> Any:
    return fields


@app.task(name="keys_tests.by_optional", lock_key="request_idx", **TASK_OPTIONS)
def by_optional(request_idx: Any = None) -> Any:
    return request_idx


@app.task(name="keys_tests.by_digest", **TASK_OPTIONS)
def by_digest(a: Any, b: Any = 2, c: Any = None) -> Any:
    return a


# -- shared with the subprocess of the cross-process tests -------------------------------------

SHARED_SOURCE = '''
import hashlib
import inspect

from celery_lock.keys import KeyDeriver, RequestKeys, digest_arguments, safe_key_part


def by_name(request_idx, tenant="acme", *, priority=0):
    pass


def by_template(tenant, request_idx, note=None):
    pass


def by_default(a, b=2, *rest, c=None, **extra):
    pass


def key_of(request_idx, *args, **kwargs):
    return request_idx


SPECS = {
    "name": (by_name, "request_idx"),
    "template": (by_template, "{tenant}:{request_idx}"),
    "conversions": (by_template, "{tenant!s}/{request_idx!r}"),
    "callable": (by_name, key_of),
    "digest": (by_default, None),
}


def derive(spec_name, args, kwargs, prefix, scope):
    """The request key and the three Redis keys of one call."""
    func, spec = SPECS[spec_name]
    task_name = "tests." + func.__name__
    deriver = KeyDeriver.create(task_name, inspect.signature(func), spec)
    request_key = deriver.request_key(tuple(args), kwargs)
    keys = RequestKeys.build(prefix, scope or task_name, request_key, task_name)
    return [request_key, keys.lock, keys.fence, keys.done]


def compute(case):
    kind = case[0]
    if kind == "part":
        return safe_key_part(case[1])
    if kind == "digest":
        return digest_arguments(case[1], case[2])
    return derive(*case[1:])
'''

CHILD_SOURCE = (
    SHARED_SOURCE
    + """
import json
import sys


def decode(value):
    if not isinstance(value, dict):
        return value
    ((tag, items),) = value.items()
    if tag == "bytes":
        return bytes.fromhex(items)
    if tag == "dict":
        return {key: decode(item) for key, item in items}
    kind = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag]
    return kind(decode(item) for item in items)


cases = [decode(case) for case in json.load(sys.stdin)]
json.dump([compute(case) for case in cases], sys.stdout)
"""
)

SHARED: dict[str, Any] = {}
exec(SHARED_SOURCE, SHARED)  # the very code the subprocess runs


def encode(value: Any) -> Any:
    """A JSON form of ``value`` that keeps its types and its dict and set iteration order."""
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, dict):
        return {"dict": [[key, encode(item)] for key, item in value.items()]}
    for kind in (list, tuple, frozenset, set):
        if isinstance(value, kind):
            return {kind.__name__: [encode(item) for item in value]}
    return value


def keys_in_fresh_process(cases: list[Any]) -> list[Any]:
    """Run ``compute`` on every case in a new interpreter with a different hash seed."""
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = "4242" if env.get("PYTHONHASHSEED") != "4242" else "2424"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD_SOURCE],
        input=json.dumps([encode(case) for case in cases]),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result: list[Any] = json.loads(proc.stdout)
    return result


def assert_same_keys_in_fresh_process(cases: list[Any]) -> None:
    here = [json.loads(json.dumps(SHARED["compute"](case))) for case in cases]
    there = keys_in_fresh_process(cases)
    assert len(there) == len(cases)
    for case, mine, theirs in zip(cases, here, there, strict=True):
        assert mine == theirs, f"keys differ across processes for {case!r}"


# -- strategies ----------------------------------------------------------------------------------

SAFE_ALPHABET = string.ascii_letters + string.digits + "_.:@/+=-"
SAFE_CHARS = "ABCXYZabcxyz0189_.:@/+=-"
json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
hashables = st.recursive(
    st.none() | st.integers() | st.text(max_size=5) | st.binary(max_size=5),
    lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=3),
    max_leaves=4,
)
# Everything the default digest accepts: JSON-like values, bytes, tuples, sets, frozensets.
digestible = st.recursive(
    json_scalars | st.binary(max_size=8) | st.sets(hashables, max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
huge_text = st.builds(operator.mul, st.text(min_size=1, max_size=8), st.integers(1_250, 2_500))
# Request keys as a caller may hand them in: long, binary, braces, control characters.
raw_keys = st.one_of(
    st.text(),
    st.text(alphabet="{}:ab \t\n\x00\x7f~é", max_size=200),
    huge_text,
    st.sampled_from(["x" * 10_000, "{" * 10_000, "}{" * 5_000, "\x00" * 10_000]),
    st.binary(max_size=2_000),
    st.integers(),
    st.booleans(),
)
prefixes = st.text(
    alphabet=st.characters(blacklist_characters="{} \n", blacklist_categories=("Cs",)),
    min_size=1,
    max_size=20,
)
# What a lock_key callable may return; an argument in a name or template key may also be a bool
# or a container (None is refused).
key_values = st.text() | st.binary(max_size=20) | st.integers()
scalar_values = key_values | st.booleans()
container_values = (
    st.lists(scalar_values, max_size=3)
    | st.tuples(scalar_values, scalar_values)
    | st.sets(hashables, max_size=4)
    | st.dictionaries(st.text(max_size=5), scalar_values, max_size=3)
)
call_values = scalar_values | container_values


@st.composite
def derive_cases(draw: st.DrawFn) -> list[Any]:
    spec = draw(st.sampled_from(["name", "template", "conversions", "callable", "digest"]))
    # ``!r`` shows a container's repr, which is not canonical: conversions get scalars only.
    values = {"callable": key_values, "conversions": scalar_values}.get(spec, call_values)
    key, tenant = draw(values), draw(values)
    args: list[Any]
    kwargs: dict[str, Any]
    if spec in ("name", "callable"):
        args, kwargs = draw(st.sampled_from([([key], {}), ([], {"request_idx": key})]))
    elif spec in ("template", "conversions"):
        args, kwargs = draw(
            st.sampled_from([([tenant, key], {}), ([], {"request_idx": key, "tenant": tenant})])
        )
    else:
        args = draw(st.lists(digestible, min_size=1, max_size=4))
        names = st.text(min_size=1, max_size=5).filter(lambda n: n not in ("a", "b", "rest"))
        kwargs = draw(st.dictionaries(names, digestible, max_size=3))
    prefix = draw(prefixes)
    scope = draw(st.none() | st.text(max_size=20))
    return ["derive", spec, args, kwargs, prefix, scope]


def deriver(task: Any) -> KeyDeriver:
    return KeyDeriver.create(task.name, inspect.signature(task.run), task.lock_key)


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes, as :func:`redis.crc.key_slot` finds it."""
    start = key.index("{")
    return key[start + 1 : key.index("}", start + 1)]


def slot(key: str) -> int:
    return key_slot(key.encode())


# -- (a) stable ------------------------------------------------------------------------------------


def test_safe_key_parts_are_the_same_in_a_fresh_process() -> None:
    cases: list[Any] = []

    @settings(max_examples=150, deadline=None, database=None)
    @given(raw=raw_keys.filter(lambda r: isinstance(r, (str, bytes))))
    def collect(raw: str | bytes) -> None:
        cases.append(["part", raw])

    collect()
    assert_same_keys_in_fresh_process(cases)


def test_argument_digests_are_the_same_in_a_fresh_process() -> None:
    cases: list[Any] = []

    @settings(max_examples=150, deadline=None, database=None)
    @given(task_name=st.text(), arguments=st.dictionaries(st.text(max_size=8), digestible))
    def collect(task_name: str, arguments: dict[str, Any]) -> None:
        cases.append(["digest", task_name, arguments])

    collect()
    cases.append(["digest", "t", {"s": {"b", "a", "c", "d", "e", "f", "g", "h"}}])
    assert_same_keys_in_fresh_process(cases)


def test_derived_request_keys_are_the_same_in_a_fresh_process() -> None:
    cases: list[Any] = []

    @settings(max_examples=200, deadline=None, database=None)
    @given(case=derive_cases())
    def collect(case: list[Any]) -> None:
        cases.append(case)

    collect()
    assert_same_keys_in_fresh_process(cases)


@settings(max_examples=150)
@given(a=json_values, b=json_values, c=json_values)
def test_default_key_ignores_how_the_arguments_are_passed(a: Any, b: Any, c: Any) -> None:
    derive = deriver(by_digest)
    expected = derive.request_key((a, b, c), {})
    assert derive.request_key((a,), {"c": c, "b": b}) == expected
    assert derive.request_key((), {"b": b, "c": c, "a": a}) == expected
    assert derive.request_key((a, b), {"c": c}) == expected


def _by_name(tenant: Any, request_idx: Any, note: Any) -> None:
    pass


@settings(max_examples=300)
@given(
    value=st.integers()
    | st.integers(min_value=10**127, max_value=10**200)
    | st.text()
    | huge_text
    | st.sampled_from(["", "-", "{x}", "a~b", "héllo", "\ud800", "0" * 129, "-1" * 70]),
    other=json_values,
)
def test_a_name_key_of_positional_arguments_is_the_key_bound_arguments_give(
    value: Any, other: Any
) -> None:
    # An int or str passed by position under lock_key="request_idx" is keyed without binding
    # the arguments: the same key as the steps that bind them (passed by name).
    derive = KeyDeriver.create("t", inspect.signature(_by_name), "request_idx")
    bound = {"tenant": other, "request_idx": value, "note": other}
    assert derive.request_key((other, value, other), {}) == derive.request_key((), bound)


@settings(max_examples=150)
@given(a=json_values)
def test_default_key_applies_defaults(a: Any) -> None:
    derive = deriver(by_digest)
    assert derive.request_key((a,), {}) == derive.request_key((a, 2, None), {})
    assert derive.request_key((), {"a": a}) == derive.request_key((), {"a": a, "b": 2})


@settings(max_examples=150)
@given(
    items=st.dictionaries(
        st.text(max_size=8).filter(lambda n: n not in ("a", "b", "rest")), json_values, min_size=2
    )
)
def test_default_key_ignores_dict_order(items: dict[str, Any]) -> None:
    backwards = dict(reversed(list(items.items())))
    assert digest_arguments("t", {"a": items}) == digest_arguments("t", {"a": backwards})
    assert digest_arguments("t", items) == digest_arguments("t", backwards)
    derive = KeyDeriver.create("t", inspect.signature(SHARED["by_default"]), None)
    assert derive.request_key((1,), items) == derive.request_key((1,), backwards)


@settings(max_examples=150)
@given(members=st.lists(hashables, min_size=2, max_size=8, unique=True))
def test_default_key_ignores_set_order(members: list[Any]) -> None:
    forwards, backwards = set(), set()
    for member in members:
        forwards.add(member)
    for member in reversed(members):
        backwards.add(member)
    assert digest_arguments("t", {"s": forwards}) == digest_arguments("t", {"s": backwards})


def test_default_key_treats_a_tuple_like_the_list_a_worker_receives() -> None:
    assert digest_arguments("t", {"a": (1, (2, b"x"))}) == digest_arguments(
        "t", {"a": [1, [2, b"x"]]}
    )


# -- (b) distinct ----------------------------------------------------------------------------------


@settings(max_examples=150)
@given(request_keys=st.lists(st.text() | huge_text, min_size=2, max_size=20, unique=True))
def test_distinct_text_request_keys_give_distinct_keys(request_keys: list[str]) -> None:
    derive = deriver(by_name)
    keys = [
        RequestKeys.build("celery-lock", by_name.name, derive.request_key((k,), {}), by_name.name)
        for k in request_keys
    ]
    assert len({k.lock for k in keys}) == len(request_keys)
    assert len({k.fence for k in keys}) == len(request_keys)
    assert len({k.done for k in keys}) == len(request_keys)


@settings(max_examples=150)
@given(
    calls=st.lists(
        st.tuples(json_values, json_values, json_values),
        min_size=2,
        max_size=10,
        unique_by=lambda call: json.dumps(call, sort_keys=True),
    )
)
def test_distinct_arguments_give_distinct_default_keys(calls: list[tuple[Any, ...]]) -> None:
    derive = deriver(by_digest)
    assert len({derive.request_key(call, {}) for call in calls}) == len(calls)


@settings(max_examples=100)
@given(names=st.lists(st.text(), min_size=2, max_size=5, unique=True), a=json_values)
def test_distinct_task_names_give_distinct_default_keys(names: list[str], a: Any) -> None:
    assert len({digest_arguments(name, {"a": a}) for name in names}) == len(names)


@pytest.mark.parametrize(
    ("one", "other"),
    [("1", 1), (1, 1.0), (1, True), (0, False), (None, "null"), ("ab", b"ab"), ([1, 2], {1, 2})],
    ids=["str-int", "int-float", "int-bool", "zero-false", "none-str", "str-bytes", "list-set"],
)
def test_default_key_tells_types_apart(one: Any, other: Any) -> None:
    assert digest_arguments("t", {"a": one}) != digest_arguments("t", {"a": other})


TAGGED_VALUES = [
    b"ab",
    {1, 2},
    frozenset({"x"}),
    uuid.UUID(int=7),
    decimal.Decimal("1.50"),
    datetime.datetime(2026, 11, 21, 12, 30),
    datetime.date(2026, 11, 21),
    datetime.time(12, 30),
]


@pytest.mark.parametrize("value", TAGGED_VALUES, ids=lambda value: type(value).__name__)
def test_a_dict_written_like_a_tagged_value_is_another_request(value: Any) -> None:
    # {"__bytes__": "6162"} is what the canonical JSON writes for b"ab": a caller's dict of
    # that shape had the key of b"ab", and one of the two requests was skipped as done.
    written = json.loads(json.dumps(value, default=keys_module._canonical))
    assert isinstance(written, dict)
    assert digest_arguments("t", {"a": written}) != digest_arguments("t", {"a": value})
    assert by_name.request_keys(([written],), {}) != by_name.request_keys(([value],), {})
    # and the dict holding such a dict is not the dict it holds
    held = {"__dict__": written}
    assert digest_arguments("t", {"a": held}) != digest_arguments("t", {"a": written})


# Templates of two fields or more: the text before the first field, between fields, after the last.
SEPARATED_TEMPLATES = {
    "{tenant}:{request_idx}": ("", [":"], ""),
    "{tenant}--{request_idx}": ("", ["--"], ""),
    "t={tenant}/{request_idx}!": ("t=", ["/"], "!"),
    "{tenant}:{request_idx}:{note}": ("", [":", ":"], ""),
    "{{{tenant}}}{{{request_idx}}}": ("{", ["}{"], "}"),
}


def splits(text: str, separators: list[str]) -> list[tuple[str, ...]]:
    """Every tuple of values that ``separators`` join into ``text``."""
    if not separators:
        return [(text,)]
    first, rest = separators[0], separators[1:]
    return [
        (text[:at], *tail)
        for at in range(len(text) + 1)
        if text.startswith(first, at)
        for tail in splits(text[at + len(first) :], rest)
    ]


@settings(max_examples=300)
@given(spec=st.sampled_from(sorted(SEPARATED_TEMPLATES)), inner=st.text(":-/}{ab", max_size=10))
@example(spec="{tenant}:{request_idx}", inner="acme:eu:1")
def test_values_joined_into_one_text_give_distinct_keys(spec: str, inner: str) -> None:
    # Every way of reading the text as the template's values is a request of its own: joined
    # as they are, ("acme:eu", 1) and ("acme", "eu:1") read alike, and the second request
    # would be skipped as a duplicate of the first.
    lead, separators, trail = SEPARATED_TEMPLATES[spec]
    calls = splits(inner, separators)
    derive = KeyDeriver.create("t", inspect.signature(SHARED["by_template"]), spec)
    keys = {derive.request_key(call, {}) for call in calls}
    assert len(keys) == len(calls)
    # ... and the call whose values hold no separator before the last is joined as it was.
    unambiguous = [
        c for c in calls if not any(sep[0] in v for v, sep in zip(c[:-1], separators, strict=True))
    ]
    for call in unambiguous:
        assert derive.request_key(call, {}) == safe_key_part(lead + inner + trail)


def test_a_value_holding_the_separator_after_it_is_digested_apart() -> None:
    derive = KeyDeriver.create(
        "t", inspect.signature(SHARED["by_template"]), "{tenant}:{request_idx}"
    )
    split_early, split_late = (
        derive.request_key(("acme:eu", 1), {}),
        derive.request_key(("acme", "eu:1"), {}),
    )
    assert split_early != split_late
    # Only the ambiguous call is digested, with the joined text as its readable prefix; a value
    # in the last field joins as before, as do values without the separator.
    assert re.fullmatch(r"acme:eu:1~[0-9a-f]{32}", split_early)
    assert split_late == "acme:eu:1"
    assert derive.request_key(("acme", "2024-05-06T07:08:09+00:00"), {}) == (
        "acme:2024-05-06T07:08:09+00:00"
    )
    assert derive.request_key(("acme", 42), {}) == "acme:42"
    # Only the first character of a separator is looked for: "-" alone is not "--", but it
    # could end a value that the separator then follows ("a-" + "--" + "b", "a" + "--" + "-b").
    dashed = KeyDeriver.create(
        "t", inspect.signature(SHARED["by_template"]), "{tenant}--{request_idx}"
    )
    assert dashed.request_key(("a-", "b"), {}) != dashed.request_key(("a", "-b"), {})
    assert dashed.request_key(("a", "-b"), {}) == "a---b"


@settings(max_examples=300)
@given(
    splits=st.lists(
        st.tuples(
            st.text(alphabet=":ab~", min_size=1, max_size=5), st.text(alphabet=":ab", max_size=5)
        ),
        min_size=2,
        unique=True,
    )
)
def test_distinct_scope_and_key_splits_give_distinct_keys(splits: list[tuple[str, str]]) -> None:
    # The hash tag joins the scope and the request key with ":": scope "a:b" with key "c" and
    # scope "a" with key "b:c" are two requests.
    locks = {RequestKeys.build("p", scope, safe_key_part(key), "t").lock for scope, key in splits}
    assert len(locks) == len(splits)


def test_a_scope_holding_a_colon_is_digested_without_it() -> None:
    assert scope_key_part("request") == "request"
    assert re.fullmatch(r"billingeu~[0-9a-f]{32}", scope_key_part("billing:eu"))
    assert scope_key_part("billing:eu") != scope_key_part("billing::eu")
    assert (
        RequestKeys.build("p", "a:b", "c", "t").lock != RequestKeys.build("p", "a", "b:c", "t").lock
    )


# -- (c) one hash slot -----------------------------------------------------------------------------


@settings(max_examples=200)
@given(
    prefix=prefixes,
    scope=st.text() | huge_text,
    raw=raw_keys,
    task_name=st.text() | huge_text,
    spec=st.sampled_from(["request_idx", None]),
)
def test_keys_of_one_request_share_one_hash_slot(
    prefix: str, scope: str, raw: Any, task_name: str, spec: str | None
) -> None:
    derive = KeyDeriver.create(task_name, inspect.signature(SHARED["by_name"]), spec)
    request_key = derive.request_key((raw,), {})
    keys = RequestKeys.build(prefix, scope, request_key, task_name)

    tag = f"{scope_key_part(scope)}:{request_key}"
    assert hash_tag(keys.lock) == hash_tag(keys.fence) == hash_tag(keys.done) == tag
    assert slot(keys.lock) == slot(keys.fence) == slot(keys.done) == slot(tag)


def test_keys_follow_the_documented_layout() -> None:
    keys = RequestKeys.build("celery-lock", "tasks.process", "42", "tasks.process")
    assert keys.lock == "celery-lock:{tasks.process:42}:lock"
    assert keys.fence == "celery-lock:{tasks.process:42}:fence"
    assert keys.done == "celery-lock:{tasks.process:42}:done:tasks.process"
    assert hash_tag(keys.lock) == "tasks.process:42"


def test_tasks_sharing_a_scope_share_the_lock_but_not_the_done_marker() -> None:
    pending = RequestKeys.build("p", "request", "42", "tasks.pending")
    process = RequestKeys.build("p", "request", "42", "tasks.process")
    assert (pending.lock, pending.fence) == (process.lock, process.fence)
    assert pending.done != process.done
    assert slot(pending.done) == slot(process.done)


def test_a_scope_whose_key_an_annotation_gives_is_not_refused() -> None:
    # task_annotations apply when the task binds, after the class was created: the scope's key
    # is known only then (docs/concepts.md).
    annotated = Celery("keys_annotated", broker="memory://", set_as_current=False)
    annotated.conf.task_annotations = {"keys_tests.annotated": {"lock_key": "order"}}

    @annotated.task(name="keys_tests.annotated", lock_scope="orders", **TASK_OPTIONS)
    def charge(order: int, amount: int) -> None: ...

    assert charge.request_keys((7, 10), {}).lock == "celery-lock:{orders:7}:lock"


def test_a_scope_with_the_default_key_is_refused_when_the_task_binds() -> None:
    # The default key digests the task's name: two tasks of one scope had two keys for one
    # request, and each ran while the other held it, without a word.
    def shared(x: Any) -> Any:
        return x

    with pytest.raises(ConfigurationError, match=r"keys_tests\.shared\.lock_scope: 'shared' needs"):
        app.task(name="keys_tests.shared", lock_scope="shared", **TASK_OPTIONS)(shared)


# -- (d) bounded -----------------------------------------------------------------------------------


@settings(max_examples=200)
@given(prefix=prefixes, scope=raw_keys, raw=raw_keys, task_name=raw_keys)
def test_keys_are_bounded_whatever_the_input(
    prefix: str, scope: Any, raw: Any, task_name: Any
) -> None:
    scope, task_name = str(scope), str(task_name)
    request_key = KeyDeriver.create(
        task_name, inspect.signature(SHARED["by_name"]), "request_idx"
    ).request_key((raw,), {})
    keys = RequestKeys.build(prefix, scope, request_key, task_name)

    assert len(request_key) <= MAX_KEY_LENGTH
    assert not set(request_key) & set("{} \n\x00")
    assert len(keys.lock) <= len(prefix) + 2 * MAX_KEY_LENGTH + len(":{:}:lock")
    assert len(keys.done) <= len(prefix) + 3 * MAX_KEY_LENGTH + len(":{:}:done:")


@settings(max_examples=150)
@given(raw=raw_keys.filter(lambda r: isinstance(r, (str, bytes))))
def test_safe_key_part_is_plain_or_a_digest(raw: str | bytes) -> None:
    part = safe_key_part(raw)
    plain = isinstance(raw, str) and len(raw) <= MAX_KEY_LENGTH and set(raw) <= set(SAFE_ALPHABET)
    if plain:
        assert part == raw
    else:
        assert re.fullmatch(r"[A-Za-z0-9_.:@/+=-]{0,40}~[0-9a-f]{32}", part), part


@settings(max_examples=150)
@given(
    readable=st.text(alphabet=SAFE_CHARS, min_size=1, max_size=40),
    tail=st.sampled_from(["{x}", " ", "\x00", "é", "~", "}" * 300, "a" * 200]),
    rest=st.text(max_size=50),
)
def test_digested_keys_keep_a_readable_prefix(readable: str, tail: str, rest: str) -> None:
    for raw in (readable + tail + rest, (readable + tail + rest).encode()):
        part = safe_key_part(raw)
        assert part.startswith(readable)
        assert "~" in part


# -- examples ------------------------------------------------------------------------------------


def test_argument_name_key_is_the_argument_value() -> None:
    keys = by_name.request_keys((42,), {})
    assert keys.lock == "celery-lock:{keys_tests.by_name:42}:lock"
    assert by_name.request_keys((), {"request_idx": 42, "tenant": "x"}) == keys


def test_template_key_joins_the_named_arguments() -> None:
    keys = by_template.request_keys(("acme",), {"request_idx": 7})
    assert hash_tag(keys.lock) == "keys_tests.by_template:acme:7"


def test_template_over_kwargs_is_checked_at_publish_time() -> None:
    keys = by_kwargs.request_keys((), {"request_idx": 7, "tenant": "acme", "note": "x"})
    assert hash_tag(keys.lock) == "keys_tests.by_kwargs:acme:7"
    with (
        mock.patch.object(Task, "apply_async") as published,
        pytest.raises(
            LockKeyError, match=r"keys_tests\.by_kwargs: the call has no argument 'tenant'"
        ),
    ):
        by_kwargs.delay(request_idx=7)
    published.assert_not_called()


def test_template_conversions_render_the_value_not_the_object() -> None:
    derive = KeyDeriver.create(
        "t", inspect.signature(SHARED["by_template"]), "{tenant!s}:{request_idx!r}"
    )
    assert derive.request_key(("acme", "x"), {}) == safe_key_part("acme:'x'")
    assert derive.request_key(("acme", 7), {}) == "acme:7"


def test_template_that_cannot_format_the_value_raises_lock_key_error() -> None:
    derive = KeyDeriver.create(
        "t", inspect.signature(SHARED["by_template"]), "{tenant}:{request_idx:d}"
    )
    assert derive.request_key(("acme", 7), {}) == "acme:7"
    with pytest.raises(LockKeyError, match=r"t: cannot render lock_key .*request_idx:d"):
        derive.request_key(("acme", "seven"), {})


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        ("order-7", "order-7"),
        # Bytes are digested with a tag of their own (0xFE, which UTF-8 text never holds).
        (b"order-7", "order-7~" + hashlib.sha256(b"\xfeorder-7").hexdigest()[:32]),
        (7, "7"),
    ],
    ids=["str", "bytes", "int"],
)
def test_callable_key_is_what_the_callable_returns(returned: Any, expected: str) -> None:
    seen: list[Any] = []

    def key_of(*args: Any, **kwargs: Any) -> Any:
        seen.append((args, kwargs))
        return returned

    @app.task(
        name=f"keys_tests.by_callable_{type(returned).__name__}", lock_key=key_of, **TASK_OPTIONS
    )
    def by_callable(request_idx: Any) -> Any:
        return request_idx

    keys = by_callable.request_keys((1,), {"x": 2})
    assert hash_tag(keys.lock) == f"{by_callable.name}:{expected}"
    assert seen == [((1,), {"x": 2})]


class _Opaque:
    """An object whose str() is its memory address."""


@pytest.mark.parametrize("returned", [None, _Opaque()], ids=["none", "object"])
def test_callable_key_returning_no_usable_key_is_refused_at_publish(returned: Any) -> None:
    # None would make every call one request, an address each call a request of its own.
    @app.task(
        name=f"keys_tests.returns_{type(returned).__name__}",
        lock_key=lambda *args, **kwargs: returned,
        **TASK_OPTIONS,
    )
    def returns(order_id: Any) -> Any:
        return order_id

    with (
        mock.patch.object(Task, "apply_async") as published,
        pytest.raises(LockKeyError) as raised,
    ):
        returns.delay(7)
    published.assert_not_called()
    assert raised.value.task_name == returns.name
    assert "returned no usable key" in str(raised.value)


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        (True, "true"),
        (1.5, "1.5"),
        (["order-7"], safe_key_part('["order-7"]')),
        (uuid.UUID(int=7), "00000000-0000-0000-0000-000000000007"),
    ],
    ids=["bool", "float", "list", "uuid"],
)
def test_callable_key_may_return_what_an_argument_may_be(returned: Any, expected: str) -> None:
    spec = KeyDeriver.create("t", inspect.signature(by_name), lambda *a, **kw: returned)
    assert spec.request_key((1,), {}) == expected


def test_callable_key_reading_a_keyword_of_a_positional_call_is_refused() -> None:
    """The slip that made every call one request "null": the argument came by position."""

    @app.task(
        name="keys_tests.by_keyword",
        lock_key=lambda *args, **kwargs: kwargs.get("order_id"),
        **TASK_OPTIONS,
    )
    def by_keyword(order_id: Any) -> Any:
        return order_id

    assert hash_tag(by_keyword.request_keys((), {"order_id": 7}).lock).endswith(":7")
    with pytest.raises(LockKeyError, match=r"keys_tests\.by_keyword: .* None is no request key"):
        by_keyword.request_keys((7,), {})


def test_a_lock_key_method_taking_self_is_refused_at_class_creation() -> None:
    # Written as a method on a subclass: called with the call's arguments only, self would take
    # order_id, and every publish would fail saying order_id was missing.
    class ByOrder(LockedTask):
        def lock_key(self, order_id: Any, **_: Any) -> Any:  # type: ignore[override]
            return order_id

    with pytest.raises(
        LockKeyError,
        match=r"keys_tests\.by_order: lock_key callable .*ByOrder\.lock_key takes self first, "
        r"but it is called with the call's arguments only, not the task",
    ):

        @app.task(name="keys_tests.by_order", base=ByOrder, shared=False, lazy=False)
        def by_order(order_id: Any) -> Any:
            return order_id

    with pytest.raises(LockKeyError, match=r"lock_key callable .*<lambda> takes self first"):

        @app.task(name="keys_tests.bound", bind=True, lock_key=lambda self, n: n, **TASK_OPTIONS)
        def bound(self: Any, n: Any) -> Any:
            return n


def test_a_lock_key_callable_mirroring_a_first_argument_named_self_is_accepted() -> None:
    # Not bound: the task's own first argument is named self, and the callable gets it.
    @app.task(name="keys_tests.unbound_self", lock_key=lambda self, n: n, **TASK_OPTIONS)
    def unbound_self(self: Any, n: Any) -> Any:
        return n

    assert hash_tag(unbound_self.request_keys(("a", 7), {}).lock).endswith(":7")


def test_a_key_error_hints_at_bind_when_the_first_parameter_is_named_self() -> None:
    @app.task(name="keys_tests.forgot_bind", lock_key="order_id", **TASK_OPTIONS)
    def forgot_bind(self: Any, order_id: Any) -> Any:
        return order_id

    with pytest.raises(
        LockKeyError,
        match=r"missing a required argument: 'order_id' \(the task's first parameter is named "
        r"self: was bind=True forgotten\?\)",
    ):
        forgot_bind.request_keys((42,), {})
    with pytest.raises(LockKeyError) as raised:
        by_template.request_keys((1,), {})  # a first parameter of another name: no hint
    assert "bind=True" not in str(raised.value)


def test_callable_key_that_raises_fails_with_lock_key_error_at_publish() -> None:
    def key_of(invoice: Any) -> Any:
        return invoice["number"]

    @app.task(name="keys_tests.by_invoice", lock_key=key_of, **TASK_OPTIONS)
    def by_invoice(invoice: Any) -> Any:
        return invoice

    with (
        mock.patch.object(Task, "apply_async") as published,
        pytest.raises(
            LockKeyError, match=r"keys_tests\.by_invoice: .*key_of raised KeyError"
        ) as raised,
    ):
        by_invoice.delay({"total": 100})
    published.assert_not_called()
    assert isinstance(raised.value.__cause__, KeyError)


@pytest.mark.parametrize(
    "call",
    [((None,), {}), ((), {"request_idx": None}), ((), {})],
    ids=["positional", "keyword", "default"],
)
def test_none_argument_in_a_name_key_is_refused_at_publish(call: Any) -> None:
    args, kwargs = call
    with (
        mock.patch.object(Task, "apply_async") as published,
        pytest.raises(
            LockKeyError, match=r"keys_tests\.by_optional: .* None alone, .* for 'request_idx'"
        ),
    ):
        by_optional.apply_async(args, kwargs)
    published.assert_not_called()


def test_none_in_a_template_reads_as_null_unless_the_key_is_none_alone() -> None:
    # An optional part of a key that still varies: as before, None reads as null.
    assert by_template.request_keys((None, 7), {}) == by_template.request_keys(("null", 7), {})
    with pytest.raises(LockKeyError, match=r"keys_tests\.by_template: .* None alone"):
        by_template.request_keys((None, None), {})


def test_values_celery_s_json_carries_read_as_tagged_canonical_json() -> None:
    # A UUID, a datetime or a Decimal inside a container; keys of several types in a dict.
    when = datetime.datetime(2026, 11, 22, 5, 0, tzinfo=datetime.timezone.utc)
    value = {"id": uuid.UUID(int=7), "at": when, "amount": decimal.Decimal("9.50"), 1: "one"}
    key = deriver(by_name).request_key((value,), {})
    assert key == deriver(by_name).request_key((dict(reversed(value.items())),), {})
    assert key != deriver(by_name).request_key(({**value, "amount": decimal.Decimal("9.5")},), {})
    assert by_digest.request_keys(([uuid.UUID(int=7)],), {})  # the default digest takes them too


def test_a_container_json_cannot_hold_reads_as_its_str_when_that_names_the_value() -> None:
    class Point:
        def __init__(self, x: int) -> None:
            self.x = x

        def __repr__(self) -> str:
            return f"Point({self.x})"

    assert deriver(by_name).request_key(([Point(1)],), {}) == safe_key_part("[Point(1)]")


@pytest.mark.parametrize("task", [by_name, by_template], ids=["name", "template"])
def test_a_dict_argument_keys_one_request_whatever_its_order(task: Any) -> None:
    forwards = task.request_keys(({"a": 1, "b": [2, 3]}, {"x": 1, "y": 2}), {})
    backwards = task.request_keys(({"b": [2, 3], "a": 1}, {"y": 2, "x": 1}), {})
    assert forwards == backwards
    assert forwards != task.request_keys(({"a": 1, "b": [3, 2]}, {"x": 1, "y": 2}), {})


def test_a_tuple_argument_keys_like_the_list_a_worker_receives() -> None:
    assert by_name.request_keys(((1, "a"),), {}) == by_name.request_keys(([1, "a"],), {})
    assert by_template.request_keys(("acme", (1, 2)), {}) == by_template.request_keys(
        ("acme", [1, 2]), {}
    )


def test_a_container_argument_reads_as_its_canonical_json() -> None:
    request_key = deriver(by_name).request_key(({"b": {2, 1}, "a": (1,)},), {})
    assert request_key == safe_key_part('{"a":[1],"b":{"__set__":["1","2"]}}')


def test_a_container_holding_an_object_without_text_raises_lock_key_error() -> None:
    with pytest.raises(LockKeyError, match=r"keys_tests\.by_name: cannot render lock_key"):
        by_name.request_keys(([object()],), {})


def test_an_int_past_python_s_digit_limit_raises_lock_key_error_by_position_as_by_name() -> None:
    """``str()`` refuses an int of more digits than Python's limit (4300 by default): the key
    cannot be made, a LockKeyError (refused at publish), not a bare ValueError. Python's reason
    reads "the limit (4300 digits)", on 3.10 "the limit (4300)"."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    if not limit:
        pytest.skip("this Python writes an int of any size as text")
    derive = KeyDeriver.create("t", inspect.signature(_by_name), "request_idx")
    huge = 10**limit  # one digit more than the limit
    named = {"tenant": "acme", "request_idx": huge, "note": None}
    for args, kwargs in (("acme", huge, None), {}), ((), named):
        with pytest.raises(LockKeyError, match=r"t: cannot render lock_key .* \(\d+(?: digits)?\)"):
            derive.request_key(args, kwargs)
    returned = KeyDeriver.create("t", inspect.signature(_by_name), lambda *args, **kwargs: huge)
    with pytest.raises(LockKeyError, match=r"returned no usable key: .*\(\d+(?: digits)?\)"):
        returned.request_key(("acme", 1, None), {})


def test_bytes_in_a_template_are_digested_not_written_as_hex() -> None:
    blob = b"\x01\x02"
    keys = by_template.request_keys(("acme", blob), {})
    assert keys != by_template.request_keys(("acme", blob.hex()), {})
    request_key = deriver(by_template).request_key(("acme", blob), {})
    # The digest's text in a str, spelled alike, is another request (see the test below).
    assert request_key != safe_key_part(f"acme:{safe_key_part(blob)}")
    assert re.fullmatch(r"acme:[0-9a-f]{32}[0-9a-f]*~[0-9a-f]{32}", request_key)


@pytest.mark.parametrize(
    ("spec", "calls"),
    [
        ("{tenant}:{order_id}", [("acme", b"x"), ("acme", "<x>")]),
        ("{tenant}:{order_id}", [(b"x", b"y"), (b"x", "<y>"), ("<x>", b"y"), ("<x>", "<y>")]),
        ("order-{order_id}", [("", b"x"), ("", "<x>")]),
    ],
)
def test_a_bytes_value_in_a_template_and_the_text_of_its_digest_are_keyed_apart(
    spec: str, calls: list[tuple[Any, Any]]
) -> None:
    # A bytes value is put in as its digest, which a str value can spell: "<x>" is the text
    # safe_key_part(b"x") gives, put in as a str.
    def spelled(value: Any) -> Any:
        return safe_key_part(value[1:-1].encode()) if value in ("<x>", "<y>") else value

    derive = KeyDeriver.create("t", inspect.signature(lambda tenant, order_id: 0), spec)
    keys = [derive.request_key(tuple(map(spelled, call)), {}) for call in calls]
    assert len(set(keys)) == len(keys), dict(zip(map(str, calls), keys, strict=True))


def test_default_key_is_a_digest_of_the_task_name_and_bound_arguments() -> None:
    keys = by_digest.request_keys((1,), {})
    request_key = digest_arguments("keys_tests.by_digest", {"a": 1, "b": 2, "c": None})
    assert request_key.startswith("args~")
    assert hash_tag(keys.lock) == f"keys_tests.by_digest:{request_key}"


def test_a_bound_task_wrapped_without_functools_wraps_is_keyed_by_its_arguments() -> None:
    # ``self`` arrives in the wrapper's *args, as the caller's arguments do: dropping the first
    # parameter for ``self`` dropped *args itself, and every call by position was refused.
    def logged(fun: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fun(*args, **kwargs)

        return wrapper

    @app.task(name="keys_tests.wrapped", bind=True, **TASK_OPTIONS)
    @logged
    def wrapped(self: Any, request_idx: Any) -> Any:
        return request_idx

    assert wrapped.request_keys((7,), {}) == wrapped.request_keys((7,), {})
    assert wrapped.request_keys((7,), {}) != wrapped.request_keys((8,), {})


def test_lock_key_naming_a_missing_argument_fails_at_class_creation() -> None:
    with pytest.raises(LockKeyError) as raised:

        @app.task(name="keys_tests.missing", lock_key="nope", **TASK_OPTIONS)
        def missing(request_idx: Any) -> None:
            pass

    assert "'nope'" in str(raised.value)
    assert "keys_tests.missing" in str(raised.value)
    assert raised.value.task_name == "keys_tests.missing"


@pytest.mark.parametrize(
    ("spec", "hint"),
    [("global", "such as '{{global}}' (its key is the text '{global}')"),
     ("", "such as '{{global}}'"),
     ([], "not list; for one request whatever the arguments, write a template of literal text"),
     # Never the one-request hint for a likely typo: a lock per request would become one.
     ("request_id", "; did you mean 'request_idx'?"),
     ("tenant.id", "; to reach into an argument, write a template: '{tenant.id}'"),
     (["request_idx", "tenant"], "not list: write '{request_idx}:{tenant}' instead"),
     (("request_idx",), "not tuple: write 'request_idx' instead")],
)  # fmt: skip
def test_lock_key_as_the_peers_spell_it_is_told_how_to_write_it(spec: Any, hint: str) -> None:
    """celery-once's ``keys=[]`` (one request whatever the arguments) and its, or
    celery-singleton's, list of names: the error says what stands for them."""
    with pytest.raises(LockKeyError) as raised:

        @app.task(name=f"keys_tests.peer_spelling_{spec!r}", lock_key=spec, **TASK_OPTIONS)
        def peer_spelling(request_idx: Any, tenant: Any) -> None:
            pass

    assert hint in str(raised.value)


def test_lock_key_as_a_list_of_anything_else_gets_no_hint() -> None:
    with pytest.raises(LockKeyError) as raised:

        @app.task(name="keys_tests.list_of_ints", lock_key=[1, 2], **TASK_OPTIONS)
        def list_of_ints(request_idx: Any) -> None:
            pass

    assert str(raised.value).endswith("not list")


def test_lock_key_naming_a_missing_argument_fails_at_finalize_for_a_lazy_task() -> None:
    lazy_app = Celery("keys_tests_lazy", broker="memory://", set_as_current=False)

    @lazy_app.task(base=LockedTask, name="keys_tests_lazy.missing", lock_key="nope", shared=False)
    def missing(request_idx: Any) -> None:
        pass

    with pytest.raises(
        LockKeyError, match=r"keys_tests_lazy\.missing: lock_key 'nope' names 'nope'"
    ):
        lazy_app.finalize()


@pytest.mark.parametrize(
    "template",
    ["{tenant", "{tenant}}", "{tenant}:{request_idx", "{tenant!rr}", "{tenant!x}",
     # Empty or misplaced parts after the argument, which str.format refuses only as it formats.
     "{tenant.}", "{tenant[]}", "{tenant..x}", "{tenant[0]x}", "{tenant}:{request_idx.real.}"],
)  # fmt: skip
def test_malformed_template_fails_at_class_creation(template: str) -> None:
    with pytest.raises(
        LockKeyError, match=r"keys_tests\.malformed: lock_key template .* is malformed"
    ):

        @app.task(name="keys_tests.malformed", lock_key=template, **TASK_OPTIONS)
        def malformed(tenant: Any, request_idx: Any) -> None:
            pass


@pytest.mark.parametrize(
    "template",
    ["{tenant:{request_idx}}", "{tenant:>{request_idx}}:{request_idx}",
     "{tenant}:{request_idx!r:>{tenant}}", "{tenant:{}}", "{tenant:{0}}", "{tenant:{x.y}}"],
    ids=["spec", "width-of-a-keyed-field", "after-conversion", "auto-numbered", "positional",
         "not-an-argument"],
)  # fmt: skip
def test_a_template_taking_a_format_spec_from_a_field_fails_at_class_creation(
    template: str,
) -> None:
    """str.format fills ``{tenant:>{width}}``'s spec from another field: ``("x", 3)`` and
    ``("  x", 1)`` would read alike, and a field that only the spec names failed at publish."""
    with pytest.raises(
        LockKeyError, match=r"keys_tests\.nested: lock_key template .* takes the format spec"
    ):

        @app.task(name="keys_tests.nested", lock_key=template, **TASK_OPTIONS)
        def nested(tenant: Any, request_idx: Any) -> None:
            pass


def test_a_format_spec_with_an_escaped_brace_is_literal_text() -> None:
    # "{{" in a spec is a brace, as in str.format: a datetime's strftime spec may hold one.
    derive = KeyDeriver.create("t", inspect.signature(_cart_task), "{cart:%Y{{%m}}}:{note}")
    when = datetime.date(2024, 5, 1)
    assert derive.request_key((when, 1), {}) == safe_key_part("2024{05}:1")


@pytest.mark.parametrize(
    "template",
    ["{tenant}{request_idx}", "x:{tenant}{request_idx!r}:y", "{tenant:>4}{request_idx.real}"],
    ids=["adjacent", "among-literals", "spec-and-sub-field"],
)
def test_a_template_joining_two_fields_without_a_separator_fails_at_class_creation(
    template: str,
) -> None:
    """``("1", "23")`` and ``("12", "3")`` read alike as ``123``: one request, and one of the
    two was skipped as a duplicate of the other."""
    with pytest.raises(
        LockKeyError, match=r"keys_tests\.glued: lock_key template .* add a separator"
    ):

        @app.task(name="keys_tests.glued", lock_key=template, **TASK_OPTIONS)
        def glued(tenant: Any, request_idx: Any) -> None:
            pass


@pytest.mark.parametrize(
    ("template", "problem"),
    [("{tenant}{0}", "must name its fields"), ("{tenant}{}", "must name its fields"),
     ("{tenant}{request_idx.__class__}", "reaches a dunder attribute"),
     ("{tenant}{request_idx!x}", "unknown conversion"),
     ("{tenant}{request_idx.}", "empty or misplaced attribute"),
     ("{tenant}{request_idx:{tenant}}", "takes the format spec")],
    ids=["positional", "auto-numbered", "dunder", "conversion", "empty-part", "spec-field"],
)  # fmt: skip
def test_a_glued_field_that_is_itself_refused_is_named_for_its_own_problem(
    template: str, problem: str
) -> None:
    # Asked for a separator, "{tenant}:{0}" would be refused next, for what was wrong first.
    with pytest.raises(LockKeyError, match=problem) as raised:

        @app.task(name="keys_tests.glued_bad", lock_key=template, **TASK_OPTIONS)
        def glued_bad(tenant: Any, request_idx: Any) -> None:
            pass

    assert "separator" not in str(raised.value)


@pytest.mark.parametrize("spec", ["{cart}-{note}", "cart:{cart}{{}}{note}{{y}}", "{cart}{{{note}"])
def test_a_template_whose_fields_a_literal_separates_is_accepted(spec: str) -> None:
    # An escaped brace is literal text, and separates as any other does.
    derive = KeyDeriver.create("t", inspect.signature(_cart_task), spec)
    assert derive.request_key(("1", 23), {}) != derive.request_key(("12", 3), {})


@pytest.mark.parametrize("spec", ["opts", "{opts}", "{tenant}:{opts[request_idx]}"])
def test_lock_key_naming_the_kwargs_parameter_itself_fails_at_class_creation(spec: str) -> None:
    with pytest.raises(
        LockKeyError, match=r"keys_tests\.by_opts: lock_key .* names the \*\*opts parameter"
    ):

        @app.task(name="keys_tests.by_opts", lock_key=spec, **TASK_OPTIONS)
        def by_opts(tenant: Any, **opts: Any) -> None:
            pass


@pytest.mark.parametrize("scope", [123, ["request"], b"request", ""])
def test_an_invalid_lock_scope_fails_at_class_creation(scope: Any) -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"keys_tests\.scoped\.lock_scope: must be a non-empty string or None",
    ):

        @app.task(
            name="keys_tests.scoped", lock_key="request_idx", lock_scope=scope, **TASK_OPTIONS
        )
        def scoped(request_idx: Any) -> None:
            pass


@pytest.mark.parametrize(
    "template",
    [
        "{{request_idx}}", "{{ request_idx }}", "id-{{request_idx}}", "{{request_idx!r}}",
        "{{request_idx:>5}}", "{{request_idx.real}}", "{{request_idx[0]}}",
    ],
)  # fmt: skip
def test_a_template_whose_only_field_is_escaped_fails_at_class_creation(template: str) -> None:
    # Doubled braces are literal text: every call would key one request, and all but the first
    # would be skipped as its duplicates. ("{{global}}", which names no argument, is one request
    # on purpose: test_a_template_without_fields_is_one_constant_key.)
    with pytest.raises(
        LockKeyError, match=r"keys_tests\.constant: .* names no argument .* '\{request_idx\}'"
    ):

        @app.task(name="keys_tests.constant", lock_key=template, **TASK_OPTIONS)
        def constant(request_idx: Any) -> None:
            pass


@pytest.mark.parametrize("template", ["{0}", "{}", "{0}:{request_idx}", "{0.x}"])
def test_positional_template_fails_at_class_creation(template: str) -> None:
    with pytest.raises(LockKeyError, match=r"keys_tests\.positional: .* must name its fields"):

        @app.task(name="keys_tests.positional", lock_key=template, **TASK_OPTIONS)
        def positional(request_idx: Any) -> None:
            pass


@pytest.mark.parametrize(
    "publish",
    [lambda: by_name.apply_async(args=()), by_name.delay, lambda: by_name.delay(x=1)],
    ids=["apply_async", "delay", "delay-wrong-kwarg"],
)
def test_call_without_the_key_argument_raises_and_publishes_nothing(publish: Any) -> None:
    with (
        mock.patch.object(Task, "apply_async") as published,
        pytest.raises(LockKeyError, match=r"keys_tests\.by_name: cannot derive .*'request_idx'"),
    ):
        publish()
    published.assert_not_called()


def test_call_with_the_key_argument_is_published() -> None:
    with mock.patch.object(Task, "apply_async") as published:
        by_name.delay(42)
    published.assert_called_once()
    assert published.call_args.args[0] == (42,)


def test_braces_in_a_request_key_are_digested() -> None:
    keys = by_name.request_keys(("{evil}",), {})
    request_key = keys.lock.split(f"{by_name.name}:", 1)[1].removesuffix("}:lock")
    assert "{" not in request_key
    assert "}" not in request_key
    assert request_key.startswith("evil~")
    assert keys.lock != by_name.request_keys(("evil",), {}).lock
    assert hash_tag(keys.lock) == f"keys_tests.by_name:{request_key}"


def test_non_json_argument_under_the_default_key_raises() -> None:
    with pytest.raises(LockKeyError) as raised:
        by_digest.request_keys((object(),), {})
    message = str(raised.value)
    assert message.startswith(
        "keys_tests.by_digest: the default lock_key needs JSON-like arguments"
    )
    assert "object" in message
    assert "set lock_key" in message


def test_non_json_argument_under_the_default_key_is_not_published() -> None:
    with (
        mock.patch.object(Task, "apply_async") as published,
        pytest.raises(LockKeyError, match="JSON-like"),
    ):
        by_digest.delay({1: object()})
    published.assert_not_called()


def _reference_bind(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """What Signature.bind makes of a call, or the TypeError it raises."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return TypeError
    bound.apply_defaults()
    return dict(bound.arguments)


def _plain(a: Any, b: Any, c: Any = 3) -> None: ...


def _keyword_only(a: Any, *, b: Any) -> None: ...


def _positional_only(a: Any, /, b: Any) -> None: ...


def _var_positional(a: Any, *rest: Any) -> None: ...


@settings(max_examples=300)
@example(function=_plain, positional=[1, 2, 3], named={})
@example(function=_plain, positional=[], named={"a": 1, "b": 2, "c": 3})
@example(function=_plain, positional=[], named={"a": 1, "b": 2, "d": 3})
@example(function=_plain, positional=[1, 2, 3, 4], named={})
@given(
    function=st.sampled_from([_plain, _keyword_only, _positional_only, _var_positional]),
    positional=st.lists(st.integers(), max_size=4),
    named=st.dictionaries(st.sampled_from(["a", "b", "c", "d", "rest"]), st.integers(), max_size=4),
)
def test_binding_a_call_matches_signature_bind(
    function: Any, positional: list[int], named: dict[str, int]
) -> None:
    """Binding skips Signature.bind when every ordinary parameter is given all by position or
    all by name; whatever the call, the result (or the refusal) is Signature.bind's."""
    signature = inspect.signature(function)
    derive = KeyDeriver.create("t", signature, None)
    expected = _reference_bind(signature, tuple(positional), named)
    if expected is TypeError:
        with pytest.raises(LockKeyError):
            derive.bind(tuple(positional), named)
    else:
        assert derive.bind(tuple(positional), named) == expected


def test_a_subclass_keeping_its_parents_run_keys_by_its_own_lock_key() -> None:
    class ByA(LockedTask):
        name = "t.by-a"
        lock_key = "a"

        def run(self, a: int, b: int) -> None:
            pass

    class ByB(ByA):
        name = "t.by-b"
        lock_key = "b"

    assert ByA._lock_deriver is not None
    assert ByB._lock_deriver is not None
    assert ByA._lock_deriver.request_key((1, 2), {}) == "1"
    assert ByB._lock_deriver.request_key((1, 2), {}) == "2"
    assert ByB._lock_deriver.request_key((1, 3), {}) == "3"


def test_an_abstract_base_without_run_builds_no_deriver() -> None:
    class Base(LockedTask):
        abstract = True
        lock_key = "request_idx"

    assert Base._lock_deriver is None


def test_a_typed_name_is_stored_as_the_library_stores_it() -> None:
    digested = safe_key_part("order 42")
    assert stored_key_part("order 42") == digested
    assert stored_key_part(digested) == digested  # already stored: kept, not digested again
    assert stored_key_part("order-42") == "order-42"


class _Named:
    def __str__(self) -> str:
        return "named-7"


@pytest.mark.parametrize("task", [by_name, by_template], ids=["name", "template"])
def test_an_argument_whose_only_text_is_its_address_is_refused(task: Any) -> None:
    # str() of it differs on every call: each call would be a request of its own, silently.
    with pytest.raises(LockKeyError, match="type _Opaque has no text of its own: pass a JSON"):
        task.request_keys((_Opaque(), _Opaque()), {})
    assert task.request_keys((_Named(), _Named()), {}) == task.request_keys(
        ("named-7", "named-7"), {}
    )


@pytest.mark.parametrize("template", ["{{global}}", "{{nightly-report}}"])
def test_a_template_without_fields_is_one_constant_key(template: str) -> None:
    # "{{global}}": every call one request, as written (a task that runs once at a time); so is
    # a constant that holds an argument's name as a word, not as an escaped field alone.
    def task(a: Any, report: Any = None) -> None:
        pass

    spec = KeyDeriver.create("t", inspect.signature(task), template)
    constant = safe_key_part(template.replace("{{", "{").replace("}}", "}"))
    assert spec.request_key((1,), {}) == spec.request_key((2,), {}) == constant


class _Order:
    def __init__(self, value: Any, id: Any = 7) -> None:
        self.value = value
        self.id = id

    def __str__(self) -> str:
        return "an order"


def _sub_field_deriver(spec: str) -> KeyDeriver:
    def task(order: Any, invoice: Any) -> None:
        pass

    return KeyDeriver.create("t", inspect.signature(task), spec)


def test_a_template_reaching_into_an_argument_reads_the_value_it_reaches() -> None:
    # "{order.value}" used to find the key field's own slot, and read the whole order.
    value_key = _sub_field_deriver("{order.value}")
    assert value_key.request_key((_Order(5), {}), {}) == "5"
    assert value_key.request_key((_Order(6), {}), {}) == "6"
    # What it reaches reads as an argument does: bool, containers, and so on.
    items = _sub_field_deriver("{invoice[items]}-{invoice[paid]}")
    forwards = items.request_key((None, {"items": {"a": 1, "b": 2}, "paid": True}), {})
    assert forwards == items.request_key((None, {"items": {"b": 2, "a": 1}, "paid": True}), {})
    assert forwards == safe_key_part('{"a":1,"b":2}-true')
    assert _sub_field_deriver("{order.id:05d}").request_key((_Order(1), {}), {}) == "00007"


@pytest.mark.parametrize("spec", ["{order.id}", "{invoice[number]}", "{invoice[number]!r}"])
def test_a_template_reaching_only_none_is_refused(spec: str) -> None:
    with pytest.raises(LockKeyError, match=r"t: lock_key .* None alone"):
        _sub_field_deriver(spec).request_key((_Order(5, id=None), {"number": None}), {})


def test_none_reached_beside_another_value_reads_as_null() -> None:
    derive = _sub_field_deriver("{order.value}:{invoice[number]}")
    assert derive.request_key((_Order(5), {"number": None}), {}) == "5:null"


def test_a_value_reached_whose_only_text_is_its_address_is_refused() -> None:
    with pytest.raises(LockKeyError, match="type _Opaque has no text of its own: pass a JSON"):
        _sub_field_deriver("{invoice[number]}").request_key((None, {"number": _Opaque()}), {})


class _Kind(str, enum.Enum):
    REFUND = "refund"


class _Priority(enum.IntEnum):
    HIGH = 1


@pytest.mark.parametrize("task", [by_name, by_template], ids=["name", "template"])
@pytest.mark.parametrize(("member", "sent"), [(_Kind.REFUND, "refund"), (_Priority.HIGH, 1)])
def test_an_enum_argument_keys_as_the_value_the_worker_receives(
    task: Any, member: Any, sent: Any
) -> None:
    # A direct or eager call passes the member; the worker gets its JSON value. One request.
    assert task.request_keys((member, member), {}) == task.request_keys((sent, sent), {})


@pytest.mark.parametrize("spec", ["{order.__class__}", "{order.__init__}", "{invoice[a].__doc__}"])
def test_a_template_reaching_a_dunder_attribute_fails_at_class_creation(spec: str) -> None:
    # They read as a class or a memory address, never as the argument's value.
    with pytest.raises(LockKeyError, match="reaches a dunder attribute"):
        _sub_field_deriver(spec)


def test_a_dunder_item_key_is_an_item_not_an_attribute() -> None:
    derive = _sub_field_deriver("{invoice[a.__b]}")
    assert derive.request_key((None, {"a.__b": 7}), {}) == "7"


# -- the caller's key is the worker's key ----------------------------------------------------------


def _as_worker_receives(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` after the message's JSON round trip: what the worker derives its key from."""
    return tuple(kombu_json.loads(kombu_json.dumps(list(args))))


def _cart_task(cart: Any, note: Any = None) -> None:
    pass


def _cart_deriver(spec: str | None) -> KeyDeriver:
    return KeyDeriver.create("t", inspect.signature(_cart_task), spec)


@pytest.mark.parametrize(
    "spec", [None, "cart", "{cart}:{note}"], ids=["digest", "name", "template"]
)
@pytest.mark.parametrize(
    "cart",
    [{2: "a", 10: "b"}, {2.0: "a", 10.0: "b"}, {"items": {3: 1, 20: 2}}],
    ids=["int-keys", "float-keys", "nested-int-keys"],
)
def test_a_dict_with_number_keys_keys_like_the_dict_the_worker_receives(
    spec: str | None, cart: dict[Any, Any]
) -> None:
    # Sorted as numbers at the caller (2 before 10), as text on the worker ("10" before "2").
    derive = _cart_deriver(spec)
    sent = (cart, "n")
    assert derive.request_key(sent, {}) == derive.request_key(_as_worker_receives(sent), {})


@pytest.mark.parametrize(
    ("key", "text"), [(2.0, "2.0"), (1e100, "1e+100"), (True, "true"), (None, "null")]
)
def test_a_number_key_reads_as_the_text_json_writes_for_it(key: Any, text: str) -> None:
    assert _cart_deriver("cart").request_key(({key: 1},), {}) == safe_key_part(f'{{"{text}":1}}')


@pytest.mark.parametrize(
    ("spec", "value"),
    [("{cart!r}", (1, 2)), ("{cart!r}", _Kind.REFUND), ("{cart:>6}", _Kind.REFUND)],
    ids=["repr-tuple", "repr-str-enum", "format-spec-str-enum"],
)
def test_a_template_conversion_keys_like_the_value_the_worker_receives(
    spec: str, value: Any
) -> None:
    derive = _cart_deriver(spec)
    sent = (value, None)
    assert derive.request_key(sent, {}) == derive.request_key(_as_worker_receives(sent), {})


class _HexId(uuid.UUID):
    """A UUID whose own text is its hex: kombu's JSON sends a plain UUID."""

    def __str__(self) -> str:
        return self.hex


class _DayFirst(datetime.date):
    """A date whose own text is day first: kombu's JSON sends its ISO text, read as a date."""

    def __str__(self) -> str:
        return self.strftime("%d/%m/%Y")


@pytest.mark.parametrize(
    "spec", [None, "cart", "{cart}:{note}"], ids=["digest", "name", "template"]
)
@pytest.mark.parametrize(
    "cart",
    [
        _HexId(int=5),
        _DayFirst(2026, 11, 21),
        {"__type__": "decimal", "__value__": "1.5"},  # a caller's dict, read as a Decimal
        [{"__type__": "uuid", "__value__": {"hex": "0" * 32}}],
    ],
    ids=["uuid-subclass", "date-subclass", "kombu-envelope", "nested-kombu-envelope"],
)
def test_a_value_kombu_sends_as_another_type_keys_as_the_worker_receives_it(
    spec: str | None, cart: Any
) -> None:
    derive = _cart_deriver(spec)
    sent = (cart, "n")
    assert derive.request_key(sent, {}) == derive.request_key(_as_worker_receives(sent), {})


def test_a_dict_shaped_like_kombu_s_envelope_of_no_type_it_knows_stays_a_dict() -> None:
    # kombu refuses such a message; another serializer carries the dict as it is.
    for unknown in ({"__type__": "nope", "__value__": 1}, {"__type__": "uuid", "__value__": 1}):
        assert _cart_deriver("cart").request_key((unknown,), {}).startswith("__type__:")


def test_an_item_template_the_publish_check_accepts_is_one_the_worker_accepts() -> None:
    # str.format looks "{cart[2]}" up as the int 2; the worker's dict has the key "2".
    derive = _cart_deriver("{cart[2]}")
    sent = ({2: "socks"}, None)
    assert derive.request_key(sent, {}) == "socks"
    assert derive.request_key(_as_worker_receives(sent), {}) == "socks"


class _Shipment:
    """Sent by kombu's JSON as what its ``__json__`` returns (kombu's hook for such objects)."""

    def __init__(self, number: str) -> None:
        self.number = number

    def __json__(self) -> dict[str, Any]:
        return {"number": self.number}

    def __str__(self) -> str:
        return f"shipment {self.number}"


def _outcome(derive: KeyDeriver, args: tuple[Any, ...]) -> str:
    try:
        return derive.request_key(args, {})
    except LockKeyError:
        return "LockKeyError"


@pytest.mark.parametrize(
    "spec",
    [None, "cart", "{cart}:{note}", "{cart[number]}", "{cart!r}", "{cart.number}",
     lambda cart, note: cart["number"]],
    ids=["digest", "name", "template", "item", "repr", "attribute", "callable"],
)  # fmt: skip
def test_an_object_sent_by_its_json_hook_keys_as_the_worker_receives_it(spec: Any) -> None:
    """The worker receives ``{"number": "S-1"}``: the caller keyed the object by its str(), so
    a direct call and a sent copy did not exclude each other, the default key refused a call
    the worker could key, and ``{cart.number}`` passed at publish and failed on the worker."""
    derive = _cart_deriver(spec)
    sent = (_Shipment("S-1"), "n")
    assert _outcome(derive, sent) == _outcome(derive, _as_worker_receives(sent))


class _Unset:
    """A "no value" sentinel that kombu's JSON sends as ``null`` (its ``__json__`` hook)."""

    def __json__(self) -> None:
        return None

    def __str__(self) -> str:
        return "unset"


@pytest.mark.parametrize("spec", ["cart", "{cart}", "{cart!r}"], ids=["name", "template", "repr"])
def test_an_object_the_worker_receives_as_none_cannot_make_a_key_alone(spec: str) -> None:
    """The worker receives ``None``, which it refuses as a key made of ``None`` alone: the
    caller keyed the object as ``null``, so the call passed at publish and failed on the
    worker, unrun, and every direct call with it was one request."""
    derive = _cart_deriver(spec)
    sent = (_Unset(), "n")
    assert _as_worker_receives(sent)[0] is None
    with pytest.raises(LockKeyError, match="None alone"):
        derive.request_key(sent, {})


@pytest.mark.skipif(
    not hasattr(Task, "_dump_pydantic_arguments"),
    reason="this Celery does not dump pydantic models at publish",
)
@pytest.mark.parametrize("spec", [None, "{order[id]}", "{order.id}"])
def test_a_pydantic_model_with_a_json_hook_keys_as_the_worker_receives_it(spec: Any) -> None:
    # Celery leaves such a model to kombu, which sends what __json__ returns.
    pydantic = pytest.importorskip("pydantic")

    class Order(pydantic.BaseModel):  # type: ignore[name-defined,misc]
        id: int

        def __json__(self) -> dict[str, Any]:
            return {"id": self.id}

    def ship(order: Order) -> None:
        pass

    ship.__annotations__["order"] = Order
    name = f"keys_tests.ship_model.{spec}"  # one task per key: a name registers once
    task = app.task(name=name, lock_key=spec, pydantic=True, **TASK_OPTIONS)(ship)

    def outcome(args: tuple[Any, ...]) -> str:
        try:
            return task.request_keys(args, {}).lock
        except LockKeyError:
            return "LockKeyError"

    sent = (Order(id=7),)
    assert outcome(sent) == outcome(_as_worker_receives(sent))


@pytest.mark.parametrize(
    ("spec", "value"),
    [("{cart.value}", _Kind.REFUND), ("{cart.name}", _Kind.REFUND),
     ("{cart.value}", _Priority.HIGH)],
    ids=["str-enum-value", "str-enum-name", "int-enum-value"],
)  # fmt: skip
def test_a_sub_field_the_worker_cannot_reach_fails_at_the_caller(spec: str, value: Any) -> None:
    """The worker receives an enum member as its value: a sub-field only the member has passed
    the publish check and failed on the worker, unrun."""
    derive = _cart_deriver(spec)
    with pytest.raises(LockKeyError, match="cannot render lock_key"):
        derive.request_key(_as_worker_receives((value, None)), {})
    with pytest.raises(LockKeyError, match="cannot render lock_key"):
        derive.request_key((value, None), {})


SET_OF_OBJECTS = """
import dataclasses, inspect, sys
from celery_lock.keys import KeyDeriver
@dataclasses.dataclass(frozen=True)
class Sku:
    code: str
def reserve(skus): pass
derive = KeyDeriver.create("t", inspect.signature(reserve), sys.argv[1])
print(derive.request_key(({Sku("socks"), Sku("shoes"), Sku("hat")},), {}))
"""


@pytest.mark.parametrize("spec", ["skus", "{skus!r}"], ids=["name", "repr"])
def test_a_set_json_cannot_hold_keys_alike_in_every_process(spec: str) -> None:
    # Its str() and repr() list the members in hash order, which follows the hash seed.
    keys = {
        subprocess.run(
            [sys.executable, "-c", SET_OF_OBJECTS, spec],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
        for seed in range(6)
    }
    assert len(keys) == 1, keys


def _holding_itself() -> list[Any]:
    loop: list[Any] = ["cart"]
    loop.append(loop)
    return loop


def _nested_too_deeply() -> list[Any]:
    outer: list[Any] = []
    inner = outer
    for _ in range(sys.getrecursionlimit() + 100):
        inner.append([])
        inner = inner[0]
    return outer


@pytest.mark.parametrize(
    "spec", [None, "cart", "{cart}:{note}", "{cart!r}"], ids=["digest", "name", "template", "repr"]
)
@pytest.mark.parametrize("make", [_holding_itself, _nested_too_deeply], ids=["loop", "deep"])
def test_a_value_holding_itself_or_nested_too_deeply_is_refused(
    spec: str | None, make: Any
) -> None:
    # Reading it as the worker receives it never ends: a LockKeyError, not a RecursionError.
    with pytest.raises(LockKeyError, match=r"^t: "):
        _cart_deriver(spec).request_key((make(), "n"), {})


# -- keys that show an address, callables, **kwargs clashes, annotations, datetimes ------------


@pytest.mark.parametrize(
    ("spec", "value"),
    [
        ("{cart.lower}:{note}", "acme"),  # meant str.lower(): reaches the bound method
        ("{cart.items}", {"sku": 1}),
        ("{cart.copy}", [1, 2]),
        ("{cart!r}", _Opaque()),
        ("{cart!a}", _Opaque()),
        ("{cart!r}", [_Opaque()]),
    ],
    ids=["str-method", "dict-method", "list-method", "repr-object", "ascii-object", "repr-list"],
)
def test_a_template_whose_text_is_a_memory_address_is_refused(spec: str, value: Any) -> None:
    """Two equal values (one request) at two addresses, as the caller and the worker hold
    them, would read as two keys: the copies would neither exclude nor skip each other."""
    with pytest.raises(LockKeyError, match="reads as a memory address"):
        _cart_deriver(spec).request_key((value, "n"), {})


def test_an_argument_whose_text_holds_another_object_s_address_is_refused() -> None:
    @dataclasses.dataclass
    class Order:  # a repr of its own, but it shows the customer's address
        id: int
        customer: _Opaque

    with pytest.raises(LockKeyError, match="cannot render lock_key"):
        _cart_deriver("cart").request_key((Order(7, _Opaque()),), {})
    upper = KeyDeriver.create("t", inspect.signature(_cart_task), lambda cart, *_: cart.upper)
    with pytest.raises(LockKeyError, match="returned no usable key"):
        upper.request_key(("acme",), {})


def _spread(*items: Any, **options: Any) -> None:
    pass


def _positional_only(order_id: Any, /, **options: Any) -> None:
    pass


@pytest.mark.parametrize(
    ("func", "one", "other"),
    [(_spread, ((1,), {"items": 2}), ((3,), {"items": 2})),
     (_positional_only, ((1,), {"order_id": 2}), ((3,), {"order_id": 2}))],
    ids=["var-positional", "positional-only"],
)  # fmt: skip
def test_a_keyword_collected_by_kwargs_never_hides_another_argument(
    func: Any, one: Any, other: Any
) -> None:
    """Merged into the bound arguments, ``items=2`` replaced ``*items``: two calls with
    different positional arguments were one request, and the second was skipped."""
    derive = KeyDeriver.create("t", inspect.signature(func), None)
    try:
        keys = {derive.request_key(*one), derive.request_key(*other)}
    except LockKeyError:
        return  # refused at publish: fine
    assert len(keys) == 2


class _Status(str, enum.Enum):
    PAID = "paid"


def test_a_callable_key_gets_the_arguments_as_the_worker_receives_them() -> None:
    """A callable that reads what only the caller's object has (an enum member's ``.value``)
    passed the publish check and failed on the worker for every copy; one that keys by the
    member's str() keyed a direct call apart from the worker's copy."""
    by_value = KeyDeriver.create("t", inspect.signature(_cart_task), lambda cart, *_: cart.value)
    sent = (_Status.PAID, None)
    with pytest.raises(LockKeyError):
        by_value.request_key(_as_worker_receives(sent), {})
    with pytest.raises(LockKeyError, match="lock_key callable"):
        by_value.request_key(sent, {})

    by_text = KeyDeriver.create("t", inspect.signature(_cart_task), lambda cart, *_: str(cart))
    assert by_text.request_key(sent, {}) == by_text.request_key(_as_worker_receives(sent), {})
    by_repr = KeyDeriver.create("t", inspect.signature(_cart_task), lambda cart, *_: repr(cart))
    pair = ((1, 2), None)
    assert by_repr.request_key(pair, {}) == by_repr.request_key(_as_worker_receives(pair), {})


class _Moment(datetime.datetime):
    """A datetime subclass (pendulum's, freezegun's): Celery's JSON sends a plain datetime."""


def test_a_datetime_subclass_keys_like_the_datetime_the_worker_receives() -> None:
    sent = (_Moment(2026, 11, 21, 9, 30, tzinfo=datetime.timezone.utc), None)
    received = _as_worker_receives(sent)
    assert type(received[0]) is datetime.datetime
    for spec in (None, "{cart}:{note}", "{cart!r}"):
        derive = _cart_deriver(spec)
        assert derive.request_key(sent, {}) == derive.request_key(received, {})


@pytest.mark.parametrize("spec", ["{cart!r}", "{cart:%Y-%m-%d %H:%M %Z}"])
def test_a_datetime_in_a_zone_keys_like_the_fixed_offset_the_worker_receives(spec: str) -> None:
    zone = pytest.importorskip("zoneinfo").ZoneInfo("Europe/Paris")
    sent = (datetime.datetime(2026, 11, 21, 9, 30, tzinfo=zone), None)
    derive = _cart_deriver(spec)
    assert derive.request_key(sent, {}) == derive.request_key(_as_worker_receives(sent), {})


@pytest.mark.parametrize(
    "value",
    [datetime.datetime(2026, 10, 25, 2, 30, fold=1), datetime.time(2, 30, fold=1)],
    ids=["datetime", "time"],
)
def test_a_wall_time_the_clock_repeats_keys_like_the_one_the_worker_receives(value: Any) -> None:
    # datetime.fromtimestamp() in the hour the clock goes back gives fold=1, which JSON does not
    # carry: {cart!r} showed it at the caller (a direct call) but not on the worker.
    sent = (value, None)
    derive = _cart_deriver("{cart!r}")
    assert derive.request_key(sent, {}) == derive.request_key(_as_worker_receives(sent), {})


def test_a_lock_key_set_by_task_annotations_is_the_one_the_task_keys_by() -> None:
    annotated = Celery("annotated", broker="memory://", set_as_current=False)
    annotated.conf.celery_lock_redis_url = "redis://127.0.0.1:1/0"
    annotated.conf.task_annotations = {"annotated.ship": {"lock_key": "order_id"}}

    @annotated.task(name="annotated.ship", base=LockedTask, shared=False)
    def ship(order_id: Any, sent_at: Any) -> Any:
        return order_id

    annotated.finalize()
    assert ship.lock_key == "order_id"
    # One request, however its other arguments differ.
    assert ship.request_keys((7, 1.0), {}).lock == ship.request_keys((7, 2.0), {}).lock
    assert hash_tag(ship.request_keys((7, 1.0), {}).lock) == "annotated.ship:7"


def test_an_invalid_lock_key_set_by_task_annotations_fails_when_the_task_binds() -> None:
    annotated = Celery("annotated_bad", broker="memory://", set_as_current=False)
    annotated.conf.celery_lock_redis_url = "redis://127.0.0.1:1/0"
    annotated.conf.task_annotations = {"annotated_bad.ship": {"lock_key": "orderid"}}

    @annotated.task(name="annotated_bad.ship", base=LockedTask, shared=False)
    def ship(order_id: Any) -> Any:
        return order_id

    with pytest.raises(LockKeyError, match="orderid"):
        annotated.finalize()
    # Celery marked the app finalized before binding: a process that caught the error went on
    # to publish every call keyed by the digest the annotation replaced. Each call is refused.
    with mock.patch.object(Task, "apply_async") as published:
        for _ in range(2):
            with pytest.raises(LockKeyError, match="orderid"):
                ship.delay(42)
    published.assert_not_called()
    with pytest.raises(LockKeyError, match="orderid"):
        ship.request_keys((42,), {})
    # Eager and direct calls too (the refusal left Celery's bind before its request stack).
    with pytest.raises(LockKeyError, match="orderid"):
        ship(42)
    eager = ship.apply((42,))
    assert (eager.state, type(eager.result)) == ("FAILURE", LockKeyError)


def test_an_invalid_lock_key_annotated_on_a_class_registered_under_another_name_refuses_calls() -> (
    None
):
    # The deriver is named after the class; a task registered under another name gets a renamed
    # copy of it, which a refusal must stay.
    annotated = Celery("annotated_cls", broker="memory://", set_as_current=False)
    annotated.conf.celery_lock_redis_url = "redis://127.0.0.1:1/0"
    # By name, not "*": the app's finalizing binds the shared tasks other test modules made,
    # and a LockedTask among them would be refused first, this one then never bound.
    annotated.conf.task_annotations = {"annotated_cls.shipping": {"lock_key": "orderid"}}

    class Ship(LockedTask):
        name = "annotated_cls.shipping"

        def run(self, order_id: Any) -> Any:
            return order_id

    ship = Ship()
    with pytest.raises(LockKeyError, match="orderid"):
        annotated.register_task(ship)
    ship.name = "annotated_cls.renamed"
    with (
        mock.patch.object(Task, "apply_async") as published,
        pytest.raises(LockKeyError, match="orderid"),
    ):
        ship.delay(42)
    published.assert_not_called()


def test_a_bytes_argument_and_a_str_argument_are_always_keyed_apart() -> None:
    # Digested alike, b"a b" and "a b" shared a key, while b"ab" and "ab" (plain text, kept
    # as written) did not.
    derive = _cart_deriver("cart")
    for text in ["ab", "a b", "x" * 200, "{braces}"]:
        assert derive.request_key((text,), {}) != derive.request_key((text.encode(),), {}), text
