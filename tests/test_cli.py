"""``celery -A app lock ...`` against the session's redis-server with real leases."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import pty
import re
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import redis
from celery.bin.celery import celery
from click.testing import CliRunner
from conftest import granted

from celery_lock.cli import LockAdmin
from celery_lock.config import LockSettings
from celery_lock.keys import KeyDeriver, RequestKeys, safe_key_part, scope_key_part
from celery_lock.lease import Acquired, HandOn, Holder, Lease, encode_lock, new_token
from celery_lock.store import LockStore
from celery_lock.testing import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent


def celery_lock_cli(
    env: dict[str, str], *args: str, stdin: str = "", app: str = "tests.apps.storm_app"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, "lock", *args],
        env={**os.environ, **env}, cwd=ROOT, input=stdin, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip


@pytest.fixture
def store(worker_env: dict[str, str]) -> LockStore:
    return LockStore.from_url(worker_env["STORM_LOCK_URL"])


def take(store: LockStore, request: int, task_id: str, task: str = "storm.process") -> Lease:
    """Take a real lease in scope ``storm.process`` as task ``task`` would."""
    keys = RequestKeys.build("celery-lock", "storm.process", str(request), task)
    holder = Holder(task_id, task, "host-a", 4242)
    token = new_token()
    fence = granted(store.acquire(keys, token, 30_000, holder, 60_000))
    return Lease(store, keys, token, 30_000, fence, holder)


def done_then_held_by_the_next_stage(store: LockStore, request: int) -> Lease:
    """Request ``request`` completed by ``storm.process`` (task-<request>) and now held by the
    next stage, ``storm.next`` (task-<request + 1>); return the completed lease."""
    lease = take(store, request, f"task-{request}")
    store.release(lease, success=True, done_ttl_ms=60_000)
    take(store, request, f"task-{request + 1}", task="storm.next")
    return lease


def test_ls_lists_held_leases_with_holder_worker_age_ttl_and_fence(
    worker_env: dict[str, str], store: LockStore
) -> None:
    for request in range(3):
        take(store, request, f"task-{request}")
    done = celery_lock_cli(worker_env, "ls")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == [
        "KEY",
        "TASK",
        "TASK",
        "ID",
        "WORKER",
        "AGE",
        "TTL",
        "LEFT",
        "FENCE",
    ]
    assert "celery-lock:{storm.process:1}:lock" in lines[2]
    assert lines[2].split()[1] == "storm.process"
    assert "task-1" in lines[2]
    assert "host-a:4242" in lines[2]
    assert lines[-1] == "3 lease(s) held"


def test_ls_lists_a_foreign_value_under_a_lock_key_so_it_can_be_released(
    worker_env: dict[str, str], store: LockStore
) -> None:
    take(store, 1, "task-1")
    store.client.hset("celery-lock:{storm.process:2}:lock", "owner", "someone")  # not ours
    store.client.set("celery-lock:{storm.process:3}:lock", "garbage")
    done = celery_lock_cli(worker_env, "ls")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[1:-1]}
    assert rows["celery-lock:{storm.process:1}:lock"][:2] == ["storm.process", "task-1"]
    assert rows["celery-lock:{storm.process:2}:lock"][:3] == ["?", "?", "?"]
    assert rows["celery-lock:{storm.process:3}:lock"][:3] == ["?", "?", "?"]


def test_ls_json_is_machine_readable(worker_env: dict[str, str], store: LockStore) -> None:
    taken = take(store, 7, "task-7")
    done = celery_lock_cli(worker_env, "--json", "ls")
    [lease] = json.loads(done.stdout)
    assert lease["key"] == "celery-lock:{storm.process:7}:lock"
    assert lease["task_id"] == "task-7"
    assert lease["fence"] == taken.fence
    assert 0 < lease["ttl_left_s"] <= 30
    assert lease["age_s"] >= 0


def test_ls_scans_past_one_batch(worker_env: dict[str, str], store: LockStore) -> None:
    for request in range(1200):  # more than one SCAN batch and one pipeline batch
        take(store, request, f"t{request}")
    done = celery_lock_cli(worker_env, "--json", "ls")
    assert len(json.loads(done.stdout)) == 1200


def test_show_reports_lease_fence_and_done_markers(
    worker_env: dict[str, str], store: LockStore
) -> None:
    completed = done_then_held_by_the_next_stage(store, 5)
    done = celery_lock_cli(worker_env, "--json", "show", "storm.process:5")
    info = json.loads(done.stdout)
    assert info["lease"]["task_id"] == "task-6"
    assert info["fence"] == completed.fence + 1
    assert info["done"]["storm.process"]["task_id"] == "task-5"
    text = celery_lock_cli(worker_env, "show", "celery-lock:{storm.process:5}:lock").stdout
    assert "holder    task-6 (storm.next) on host-a:4242" in text
    assert f"fence     {completed.fence + 1}\n" in text


def test_show_s_fence_line_is_the_lease_s_own_which_release_fence_takes(
    worker_env: dict[str, str], store: LockStore
) -> None:
    # The counter moved on since the lease was granted (a grant between the reads of a show
    # that scans first): the line showed the counter, and release --fence given it refused to
    # delete the lease shown, or deleted a newer one.
    lease = take(store, 8, "task-8")
    store.client.incrby(lease.keys.fence, 5)
    shown = celery_lock_cli(worker_env, "show", "storm.process:8")
    assert f"fence     {lease.fence} (the counter is at {lease.fence + 5})\n" in shown.stdout
    fence = shown.stdout.split("fence     ")[1].split()[0]
    released = celery_lock_cli(
        worker_env, "release", "--force", "storm.process:8", "--fence", fence
    )
    assert released.returncode == 0, released.stderr
    assert store.client.get(lease.keys.lock) is None


def test_text_output_escapes_what_a_terminal_would_act_on_in_what_the_store_holds(
    worker_env: dict[str, str], store: LockStore
) -> None:
    """A task id is the producer's (a client's key used as one): escape codes in it reached the
    operator's terminal, and a lone surrogate reached it as the byte 0xFF."""
    ansi = "ok\x1b[2K\r\x1b]0;owned\x07\n"
    surrogate = json.loads('"req-7\\udcff"')
    store.release(take(store, 5, surrogate, task="storm.next"), success=True, done_ttl_ms=60_000)
    keys = RequestKeys.build("celery-lock", "storm.process", "5", "storm.process")
    holder = Holder(ansi, "storm.\x1bprocess", "host\x1b[31m", 4242)
    granted(store.acquire(keys, new_token(), 30_000, holder, 60_000))
    store.client.set(keys.lock.replace(":lock", ":done:x\x1by"), "task-9")
    # Text that reads as an escape is escaped too: else it would show as the surrogate above.
    store.client.set(keys.lock.replace(":lock", ":done:lit"), "req-7\\udcff")
    escaped = "ok\\x1b[2K\\r\\x1b]0;owned\\x07\\n"
    listed = celery_lock_cli(worker_env, "ls")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split("\n")[1].split()[:4] == [
        keys.lock, "storm.\\x1bprocess", escaped, "host\\x1b[31m:4242"
    ]  # fmt: skip
    shown = celery_lock_cli(worker_env, "show", "storm.process:5")
    assert shown.returncode == 0, shown.stderr
    assert f"holder    {escaped} (storm.\\x1bprocess) on host\\x1b[31m:4242\n" in shown.stdout
    assert "done      storm.next by req-7\\udcff (" in shown.stdout
    assert "done      x\\x1by by task-9 (no TTL)\n" in shown.stdout
    assert "done      lit by req-7\\\\udcff (no TTL)\n" in shown.stdout
    asked = celery_lock_cli(worker_env, "release", "storm.process:5", "--force", stdin="n\n")
    assert f"held by {escaped} (storm.\\x1bprocess) on host\\x1b[31m:4242 for" in asked.stderr
    forgot = celery_lock_cli(worker_env, "forget", "storm.process:5")
    assert forgot.returncode == 0, forgot.stderr
    assert f"forgot {keys.lock[: -len(':lock')]}:done:x\\x1by" in forgot.stdout.split("\n")
    # A key the operator typed is echoed escaped as well (pasted from a log, say).
    typed_key = keys.lock.replace(":lock", ":done:a\x1b[7mb")
    typed = celery_lock_cli(worker_env, "forget", typed_key)
    assert typed.returncode == 0, typed.stderr
    assert typed.stdout == "no done-marker at " + typed_key.replace("\x1b", "\\x1b") + "\n"
    for done in (listed, shown, asked, forgot, typed):
        assert "\x1b" not in done.stdout + done.stderr


def test_release_needs_force_and_asks_unless_yes(
    worker_env: dict[str, str], store: LockStore
) -> None:
    lease = take(store, 3, "task-3")
    client = store.client
    refused = celery_lock_cli(worker_env, "release", "storm.process:3")
    assert refused.returncode != 0
    assert "--force" in refused.stderr
    declined = celery_lock_cli(worker_env, "release", "storm.process:3", "--force", stdin="n\n")
    assert declined.returncode != 0
    assert client.exists(lease.keys.lock)
    confirmed = celery_lock_cli(worker_env, "release", "storm.process:3", "--force", stdin="y\n")
    assert confirmed.returncode == 0
    assert not client.exists(lease.keys.lock)
    take(store, 3, "task-4")
    assert (
        celery_lock_cli(worker_env, "release", "storm.process:3", "--force", "--yes").returncode
        == 0
    )
    assert not client.exists(lease.keys.lock)


def test_forget_drops_done_marker_so_request_may_run_again(
    worker_env: dict[str, str], store: LockStore
) -> None:
    lease = take(store, 9, "task-9")
    store.release(lease, success=True, done_ttl_ms=60_000)
    assert store.client.exists(lease.keys.done)
    done = celery_lock_cli(worker_env, "forget", "storm.process:9")
    assert done.stdout.strip() == f"forgot {lease.keys.done}"
    assert not store.client.exists(lease.keys.done)
    assert isinstance(take(store, 9, "task-10"), Lease)


def test_listing_uses_scan_never_keys(worker_env: dict[str, str], store: LockStore) -> None:
    take(store, 1, "task-1")
    client: redis.Redis = store.client
    before = client.info("commandstats")
    celery_lock_cli(worker_env, "ls")
    after = client.info("commandstats")
    assert after.get("cmdstat_keys", {}).get("calls", 0) == before.get("cmdstat_keys", {}).get(
        "calls", 0
    )
    assert after["cmdstat_scan"]["calls"] > before.get("cmdstat_scan", {}).get("calls", 0)


def test_unreachable_store_is_a_clean_error(worker_env: dict[str, str]) -> None:
    port = free_port()  # free a moment ago: nothing listens there
    done = celery_lock_cli(worker_env, "--url", f"redis://127.0.0.1:{port}/0", "ls")
    assert done.returncode == 1
    assert "cannot reach the lock store" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("command", "url_from"),
    [(["ls"], "--url"), (["show", "storm.process:1"], "conf"),
     (["forget", "storm.process:1"], "conf"), (["ls"], "broker")],
)  # fmt: skip
def test_a_node_of_a_cluster_of_several_masters_is_a_clean_error(
    worker_env: dict[str, str],
    redis_cluster: Callable[[int], list[RedisServer]],
    command: list[str],
    url_from: str,
) -> None:
    """The CLI's client talks to the one node the URL names: ls listed that node's leases
    alone, silently, and show and forget failed or missed what another master holds."""
    node, *_ = redis_cluster(3)
    if url_from == "--url":
        done = celery_lock_cli(worker_env, "--url", node.url, *command)
        setting = "--url"
    elif url_from == "broker":  # no celery_lock_redis_url: the broker's URL stands in
        conf = {"BARE_CONF": json.dumps({"broker_url": node.url})}
        done = celery_lock_cli({**worker_env, **conf}, *command, app="tests.apps.bare_app")
        setting = "broker_url"
    else:
        done = celery_lock_cli({**worker_env, "STORM_LOCK_URL": node.url}, *command)
        setting = "celery_lock_redis_url"
    assert done.returncode == 1, done.stdout
    assert (
        f"Error: {setting}: lock store 127.0.0.1:{node.port} is a node of a Redis Cluster of 3 "
        "masters"
    ) in done.stderr
    assert "a single endpoint (a plain Redis server, or a cluster of one master)" in done.stderr
    assert ("Set celery_lock_redis_url" in done.stderr) == (url_from == "broker")
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


def test_ls_on_a_cluster_of_one_master_lists_every_lease(
    worker_env: dict[str, str], redis_cluster: Callable[[int], list[RedisServer]]
) -> None:
    [node] = redis_cluster(1)
    store = LockStore.from_url(node.url)
    try:
        for request in range(10):  # in slots all over the range
            take(store, request, f"task-{request}")
    finally:
        store.close()
    done = celery_lock_cli(worker_env, "--url", node.url, "--json", "ls")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)) == 10


def test_a_url_whose_path_is_no_database_number_is_a_usage_error(
    worker_env: dict[str, str], store: LockStore
) -> None:
    """redis-py reads such a URL as database 0: ls listed another database's leases."""
    take(store, 1, "task-1")
    url = worker_env["STORM_LOCK_URL"].rsplit("/", 1)[0] + "/locks"
    done = celery_lock_cli(worker_env, "--url", url, "ls")
    assert done.returncode == 2, done.stdout
    assert "the URL's path 'locks' is not a database number" in done.stderr


def test_a_store_that_refuses_the_connection_is_a_clean_error(worker_env: dict[str, str]) -> None:
    url = worker_env["STORM_LOCK_URL"].rsplit("/", 1)[0] + "/99"  # no such database
    done = celery_lock_cli(worker_env, "--url", url, "ls")
    assert done.returncode == 1
    assert "Error: the lock store refused the connection: DB index is out of range" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_store_url_at_a_port_that_does_not_speak_redis_is_a_clean_error(
    worker_env: dict[str, str], not_redis: str
) -> None:
    """A protocol error (RabbitMQ's port answers with its own header) said "cannot reach the
    lock store", which sent the operator after the network, not the URL."""
    done = celery_lock_cli(worker_env, "--url", f"redis://{not_redis}/0", "ls")
    assert done.returncode == 1
    assert "Error: the lock store does not speak Redis (Protocol error" in done.stderr
    assert "): wrong host or port in --url?" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_request_key_the_library_made_safe_is_found_as_written_and_as_stored(
    worker_env: dict[str, str], store: LockStore
) -> None:
    stored = safe_key_part("order 42")  # as the library keys it: a prefix and a digest
    assert stored != "order 42"
    keys = RequestKeys.build("celery-lock", "storm.process", stored, "storm.process")
    outcome = store.acquire(keys, new_token(), 30_000, Holder("task-7", "storm.process", "h", 1),
                            60_000)  # fmt: skip
    assert isinstance(outcome, Acquired)
    for name in ("storm.process:order 42", f"storm.process:{stored}", keys.lock):
        info = json.loads(celery_lock_cli(worker_env, "--json", "show", name).stdout)
        assert info["lease"]["task_id"] == "task-7", name


def test_a_request_key_typed_as_stored_is_read_so_with_a_warning_naming_the_raw_request(
    worker_env: dict[str, str], store: LockStore
) -> None:
    """``order42~<digest>`` is how the library stores ``order 42``, and also a raw request key
    of its own (a client may choose it), stored as another digest: the command reads the
    stored form, as documented, and says which other request the text would name."""
    stored = safe_key_part("order 42")
    raw = safe_key_part(stored)
    assert raw not in (stored, "order 42")
    lock = f"celery-lock:{{storm.process:{stored}}}:lock"
    other = f"celery-lock:{{storm.process:{raw}}}:lock"
    warning = (
        f"Warning: {stored!r} is read as a request key as stored: {lock}; a request whose raw "
        f"key is that text is another one: {other} (give its lock key whole to mean it)\n"
    )
    shown = celery_lock_cli(worker_env, "--json", "show", f"storm.process:{stored}")
    assert json.loads(shown.stdout)["key"] == lock
    assert shown.stderr == warning
    for command in (["forget"], ["release", "--force", "--yes"]):
        done = celery_lock_cli(worker_env, *command, f"storm.process:{stored}")
        assert done.returncode == 0, done.stderr
        assert done.stderr == warning, command
    # Names that are one request only: no warning.
    for name in ("storm.process:order 42", lock, other, "storm.process:7"):
        done = celery_lock_cli(worker_env, "show", name)
        assert (done.returncode, done.stderr) == (0, ""), name


def test_show_reports_a_fence_and_a_done_marker_that_are_not_strings(
    worker_env: dict[str, str], store: LockStore
) -> None:
    # What a LockStateError asks the user to repair: show must still show it.
    lease = take(store, 4, "task-4")
    store.release(lease, success=True, done_ttl_ms=60_000)
    client = store.client
    client.delete(lease.keys.fence)
    client.hset(lease.keys.fence, "n", "1")
    other_done = lease.keys.done.replace(":done:storm.process", ":done:storm.next")
    client.rpush(other_done, "not ours")
    done = celery_lock_cli(worker_env, "--json", "show", "storm.process:4")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["fence"] == "<not a string: hash>"
    assert info["done"]["storm.process"]["task_id"] == "task-4"
    assert info["done"]["storm.next"] == {"task_id": "<not a string: list>", "ttl_left_s": -1.0}
    client.delete(lease.keys.fence)
    client.set(lease.keys.fence, "seven")
    text = celery_lock_cli(worker_env, "show", "storm.process:4")
    assert text.returncode == 0, text.stderr
    assert "fence     <not an integer: 'seven'>" in text.stdout
    assert "done      storm.next by <not a string: list>" in text.stdout
    for text in ("1_000", str(2**63)):  # integers to Python, not to INCR
        client.set(lease.keys.fence, text)
        shown = celery_lock_cli(worker_env, "--json", "show", "storm.process:4").stdout
        assert json.loads(shown)["fence"] == f"<not an integer: '{text}'>"


@contextlib.contextmanager
def acl_user(url: str, user: str, *rules: str) -> Iterator[str]:
    """A URL of the lock store at ``url`` as ``user`` (password ``pw``) with the ACL ``rules``,
    deleted at the end."""
    admin = redis.Redis.from_url(url)
    rules = ("on", ">pw", *rules)
    try:  # redis-py's CLIENT SETINFO on connect: Redis 7.0 knows no such command, and refuses it
        admin.execute_command("ACL", "SETUSER", user, *rules, "+client|setinfo")
    except redis.ResponseError:
        admin.execute_command("ACL", "SETUSER", user, *rules)
    try:
        yield url.replace("redis://", f"redis://{user}:pw@", 1)
    finally:
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()


@pytest.fixture
def connect_only_url(worker_env: dict[str, str]) -> Iterator[str]:
    """A URL of the lock store as a user that may connect (and make the CLI's first round trip,
    ``SCRIPT EXISTS``) but not read or write any key."""
    rules = ("-@all", "+script|exists", "+select")
    with acl_user(worker_env["STORM_LOCK_URL"], "cli-connect-only", *rules) as url:
        yield url


@pytest.mark.parametrize(
    "command",
    [
        ["ls"],
        ["show", "storm.process:1"],
        ["forget", "storm.process:1"],
        ["release", "storm.process:1", "--force", "--yes"],
    ],
    ids=lambda command: command[0],
)
def test_a_lock_store_that_fails_mid_command_is_a_clean_error(
    worker_env: dict[str, str], connect_only_url: str, command: list[str]
) -> None:
    done = celery_lock_cli(worker_env, "--url", connect_only_url, *command)
    assert done.returncode == 1, done.stderr
    assert "Error: the lock store failed: NoPermissionError" in done.stderr
    assert "Traceback" not in done.stderr


def test_release_json_output_stays_json_when_it_asks(
    worker_env: dict[str, str], store: LockStore
) -> None:
    lease = take(store, 3, "task-3")
    done = celery_lock_cli(worker_env, "--json", "release", "storm.process:3", "--force",
                           stdin="y\n")  # fmt: skip
    assert done.returncode == 0, done.stderr
    released = json.loads(done.stdout)
    assert (released["key"], released["released"]) == (lease.keys.lock, True)
    assert (released["holder"]["task_id"], released["holder"]["fence"]) == ("task-3", lease.fence)
    assert 0 < released["holder"]["ttl_left_s"] <= 30
    assert f"Release {lease.keys.lock}, held by task-3" in done.stderr
    assert "[y/N]" in done.stderr


def test_an_invalid_setting_the_cli_does_not_use_does_not_stop_it(
    worker_env: dict[str, str], store: LockStore
) -> None:
    take(store, 1, "task-1")
    env = {**worker_env, "STORM_CONF": '{"celery_lock_heartbeat_interval": 100}'}  # > the TTL
    for args in (["ls"], ["--url", worker_env["STORM_LOCK_URL"], "ls"]):
        done = celery_lock_cli(env, "--json", *args)
        assert done.returncode == 0, done.stderr
        assert [lease["task_id"] for lease in json.loads(done.stdout)] == ["task-1"]


def test_an_invalid_url_or_prefix_setting_names_the_option_that_overrides_it(
    worker_env: dict[str, str], store: LockStore
) -> None:
    take(store, 1, "task-1")
    url = worker_env["STORM_LOCK_URL"]
    bad_url = {**worker_env, "STORM_LOCK_URL": "http://nowhere"}  # celery_lock_redis_url
    done = celery_lock_cli(bad_url, "ls")
    assert done.returncode == 2
    assert "celery_lock_redis_url" in done.stderr
    assert "(or pass --url)" in done.stderr
    assert celery_lock_cli(bad_url, "--url", url, "ls").returncode == 0  # not read at all
    bad_prefix = {**worker_env, "STORM_CONF": '{"celery_lock_key_prefix": "a b"}'}
    done = celery_lock_cli(bad_prefix, "--url", url, "ls")
    assert done.returncode == 2
    assert "celery_lock_key_prefix" in done.stderr
    assert "(or pass --prefix)" in done.stderr
    assert "--url" not in done.stderr
    done = celery_lock_cli(bad_prefix, "--prefix", "celery-lock", "ls")
    assert done.returncode == 0, done.stderr
    assert "task-1" in done.stdout


def test_forget_task_matches_the_task_name_as_the_done_marker_key_holds_it(
    worker_env: dict[str, str], store: LockStore
) -> None:
    task = "storm.stage two"  # not a plain key part: the done-marker key holds it made safe
    assert safe_key_part(task) != task
    first = take(store, 8, "task-8", task=task)
    store.release(first, success=True, done_ttl_ms=60_000)
    other = take(store, 8, "task-9")
    store.release(other, success=True, done_ttl_ms=60_000)
    done = celery_lock_cli(worker_env, "forget", "storm.process:8", "--task", task)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"forgot {first.keys.done}"
    assert not store.client.exists(first.keys.done)
    assert store.client.exists(other.keys.done)  # another task's marker stays


def test_a_pasted_fence_or_done_marker_key_names_its_request(
    worker_env: dict[str, str], store: LockStore
) -> None:
    lease = done_then_held_by_the_next_stage(store, 6)
    for name in (lease.keys.fence, lease.keys.done):
        info = json.loads(celery_lock_cli(worker_env, "--json", "show", name).stdout)
        assert info["key"] == lease.keys.lock, name
        assert info["lease"]["task_id"] == "task-7", name
        assert info["done"]["storm.process"]["task_id"] == "task-6", name
    done = celery_lock_cli(worker_env, "forget", lease.keys.done)
    assert done.stdout.strip() == f"forgot {lease.keys.done}"
    assert not store.client.exists(lease.keys.done)


def test_forget_given_a_done_marker_key_forgets_that_task_s_marker_only(
    worker_env: dict[str, str], store: LockStore
) -> None:
    # The key a LockStateError names: forgetting it must not make another stage run again.
    pending = take(store, 9, "task-9", task="storm.pending")
    store.release(pending, success=True, done_ttl_ms=60_000)
    settle = take(store, 9, "task-10", task="storm.settle")
    store.release(settle, success=True, done_ttl_ms=60_000)
    done = celery_lock_cli(worker_env, "forget", pending.keys.done)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"forgot {pending.keys.done}"
    assert not store.client.exists(pending.keys.done)
    assert store.client.exists(settle.keys.done)
    again = celery_lock_cli(worker_env, "forget", pending.keys.done)
    assert again.stdout.strip() == f"no done-marker at {pending.keys.done}"
    # --task naming another task than the key is a contradiction, not a choice between them.
    both = celery_lock_cli(worker_env, "forget", settle.keys.done, "--task", "storm.pending")
    assert both.returncode == 2
    assert store.client.exists(settle.keys.done)
    # The lock or fence key names the request: every marker, as a request name does.
    done = celery_lock_cli(worker_env, "forget", settle.keys.fence)
    assert done.stdout.strip() == f"forgot {settle.keys.done}"
    done = celery_lock_cli(worker_env, "forget", settle.keys.lock)
    assert done.stdout.strip() == f"no done-marker of {settle.keys.lock}"


def test_forget_of_one_marker_deletes_its_key_without_scanning(
    worker_env: dict[str, str], store: LockStore
) -> None:
    client: redis.Redis = store.client
    for task in ("storm.one", "storm.two"):
        store.release(take(store, 2, task, task=task), success=True, done_ttl_ms=60_000)
    keys = RequestKeys.build("celery-lock", "storm.process", "2", "storm.one")
    scans = client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0)
    by_task = celery_lock_cli(worker_env, "forget", "storm.process:2", "--task", "storm.two")
    assert by_task.stdout.strip() == f"forgot {keys.lock.removesuffix(':lock')}:done:storm.two"
    by_key = celery_lock_cli(worker_env, "forget", keys.done)
    assert by_key.stdout.strip() == f"forgot {keys.done}"
    # A SCAN walks the whole keyspace: one known key needs none.
    assert client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0) == scans


@pytest.mark.parametrize("command", ["show", "forget", "release"])
def test_a_key_under_another_prefix_is_a_usage_error_naming_the_prefix_to_pass(
    worker_env: dict[str, str], store: LockStore, command: str
) -> None:
    # Read as a request name it would be digested into another request's key: "none", "no
    # lease", "no done-marker", exit 0, while the lease is held.
    keys = RequestKeys.build("myprefix", "storm.x", "1", "storm.x")
    outcome = store.acquire(keys, new_token(), 30_000, Holder("task-1", "storm.x", "h", 1),
                            60_000)  # fmt: skip
    assert isinstance(outcome, Acquired)
    extra = ["--force", "--yes"] if command == "release" else []
    done = celery_lock_cli(worker_env, command, keys.lock, *extra)
    assert done.returncode == 2, done.stdout
    assert "prefix 'myprefix', not the configured 'celery-lock'" in done.stderr
    assert "pass --prefix myprefix" in done.stderr
    assert store.client.exists(keys.lock)
    done = celery_lock_cli(worker_env, "--prefix", "myprefix", command, keys.lock, *extra)
    assert done.returncode == 0, done.stderr
    if command == "show":
        assert "holder    task-1 (storm.x) on h:1" in done.stdout


@pytest.mark.parametrize("name", ["", "storm.process", ":5"])
@pytest.mark.parametrize("command", ["show", "forget", "release"])
def test_a_name_that_is_no_key_and_no_scope_and_request_key_is_a_usage_error(
    worker_env: dict[str, str], command: str, name: str
) -> None:
    extra = ["--force", "--yes"] if command == "release" else []
    done = celery_lock_cli(worker_env, command, name, *extra)
    assert done.returncode == 2, done.stdout
    assert "names no request" in done.stderr
    # Checked before the store is reached: the usage error, not "cannot reach the lock store".
    unreachable = {**worker_env, "STORM_LOCK_URL": f"redis://127.0.0.1:{free_port()}/0"}
    done = celery_lock_cli(unreachable, command, name, *extra)
    assert (done.returncode, "names no request" in done.stderr) == (2, True), done.stderr


@pytest.mark.parametrize(
    "suffix", ["", ":lock ", ":done", ":locks"], ids=["tag", "space", "done", "locks"]
)
@pytest.mark.parametrize("command", ["show", "forget", "release"])
def test_a_key_of_the_prefix_that_is_none_of_a_request_s_keys_is_a_usage_error(
    worker_env: dict[str, str], store: LockStore, command: str, suffix: str
) -> None:
    """Read as <scope>:<request key>, such a name was a request of scope "celery-lock": show
    said "lease none" while the lease was held, and release found no lease to delete."""
    take(store, 1, "task-1")
    extra = ["--force", "--yes"] if command == "release" else []
    name = "celery-lock:{storm.process:1}" + suffix
    done = celery_lock_cli(worker_env, command, name, *extra)
    assert done.returncode == 2, done.stdout
    assert f"{name!r} is under prefix 'celery-lock' but is none of a request's keys" in done.stderr
    assert store.client.exists("celery-lock:{storm.process:1}:lock")


def test_show_of_an_unknown_request_says_none_throughout(worker_env: dict[str, str]) -> None:
    done = celery_lock_cli(worker_env, "show", "storm.process:404")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1:] == ["lease     none", "fence     none", "done      none"]


def test_a_lease_and_a_done_marker_without_a_ttl_show_no_ttl(
    worker_env: dict[str, str], store: LockStore
) -> None:
    # A key without a TTL is what a LockStateError names: not a lease lapsing in -1 s.
    lease = done_then_held_by_the_next_stage(store, 3)
    store.client.persist(lease.keys.lock)
    store.client.persist(lease.keys.done)
    listed = celery_lock_cli(worker_env, "ls")
    [row] = listed.stdout.splitlines()[1:-1]
    assert row.split()[-3:] == ["no", "TTL", str(lease.fence + 1)]
    shown = celery_lock_cli(worker_env, "show", "storm.process:3").stdout
    assert "s, no TTL\n" in shown
    assert "done      storm.process by task-3 (no TTL)" in shown
    assert "-1" not in listed.stdout + shown


def test_show_tells_a_request_handed_on_by_a_replace_from_one_completed(
    worker_env: dict[str, str], store: LockStore
) -> None:
    store.release(take(store, 4, "task-4"), success=True, done_ttl_ms=60_000)
    handed = take(store, 4, "task-9", task="storm.fetch")
    handed.handed_on = HandOn(2, "task-8")  # as a run that called self.replace releases it
    store.release(handed, success=True, done_ttl_ms=60_000)
    done = LockAdmin(store.client, "celery-lock").show("storm.process:4")["done"]
    assert (done["storm.process"]["task_id"], "handed_on_at" in done["storm.process"]) == (
        "task-4", False
    )  # fmt: skip
    fetched = done["storm.fetch"]
    assert (fetched["task_id"], fetched["handed_on_at"], fetched["sent"]) == ("task-9", 2, False)
    shown = celery_lock_cli(worker_env, "show", "storm.process:4").stdout
    assert "done      storm.fetch being handed on by task-9 at depth 2 (" in shown
    assert "done      storm.process by task-4 (" in shown
    assert store.confirm_hand_on(handed, 60_000)  # as once the replacement was sent
    shown = celery_lock_cli(worker_env, "show", "storm.process:4").stdout
    assert "done      storm.fetch handed on by task-9 at depth 2 (" in shown
    store.client.set(handed.keys.done, "", px=60_000)  # as a direct call's run writes it
    shown = celery_lock_cli(worker_env, "show", "storm.process:4").stdout
    assert "done      storm.fetch by a direct call (" in shown


def test_release_without_a_lease_says_so_without_asking(
    worker_env: dict[str, str], store: LockStore
) -> None:
    done = celery_lock_cli(worker_env, "release", "storm.process:3", "--force")  # no answer
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no lease at celery-lock:{storm.process:3}:lock"
    assert "[y/N]" not in done.stderr


def test_release_asks_naming_the_holder_its_worker_and_how_long_it_has_held_it(
    worker_env: dict[str, str], store: LockStore
) -> None:
    lease = take(store, 3, "task-3")
    done = celery_lock_cli(worker_env, "release", "storm.process:3", "--force", stdin="y\n")
    assert done.returncode == 0, done.stderr
    prompt = f"Release {lease.keys.lock}, held by task-3 (storm.process) on host-a:4242 for "
    assert prompt in done.stderr
    # How to tell the holder is gone: a task a worker runs is active there. (The app as -A
    # named it, where Celery keeps that text: 5.7 does, older releases hand over the app.)
    app = "tests.apps.storm_app" if "-A tests.apps.storm_app " in done.stderr else "<app>"
    alive = f"s left; alive if `celery -A {app} inspect query_task task-3` finds it"
    assert f"{alive} active)? [y/N]" in done.stderr
    held = "held by task-3 (storm.process) on host-a:4242"
    assert done.stdout.strip() == f"released {lease.keys.lock}, {held}"
    # A task id is the producer's: the command it is put in quotes it for a shell.
    take(store, 3, "x $(touch pwned)")
    hostile = celery_lock_cli(worker_env, "release", "storm.process:3", "--force", stdin="n\n")
    assert "inspect query_task 'x $(touch pwned)'` finds it active" in hostile.stderr


def test_release_deletes_only_the_lease_it_asked_about(
    worker_env: dict[str, str], store: LockStore
) -> None:
    first = take(store, 3, "task-3")
    with subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.apps.storm_app", "lock", "release",
         "storm.process:3", "--force"],
        env={**os.environ, **worker_env}, cwd=ROOT, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    ) as asking:  # fmt: skip
        try:
            assert asking.stderr is not None
            asked = b""
            while b"[y/N]: " not in asked:
                chunk = os.read(asking.stderr.fileno(), 4096)
                assert chunk, asked
                asked += chunk
            assert b"held by task-3" in asked
            # While the user reads the question, the lease lapses and another copy takes it.
            store.client.delete(first.keys.lock)
            second = take(store, 3, "task-4")
            out, err = asking.communicate(b"y\n", timeout=60)
        finally:
            if asking.poll() is None:
                asking.kill()
    assert asking.returncode == 1, out
    assert b"changed hands" in err
    assert store.client.get(second.keys.lock) is not None


def test_release_yes_says_whose_lease_it_deleted(
    worker_env: dict[str, str], store: LockStore
) -> None:
    # Deleted whoever held it, and read in the same step: the output names that holder, not
    # one show named a moment before.
    lease = take(store, 3, "task-3")
    done = celery_lock_cli(worker_env, "release", "storm.process:3", "--force", "--yes")
    assert done.returncode == 0, done.stderr
    held = "held by task-3 (storm.process) on host-a:4242"
    assert done.stdout.strip() == f"released {lease.keys.lock}, {held}"
    assert not store.client.exists(lease.keys.lock)
    take(store, 3, "task-4")
    answer = json.loads(
        celery_lock_cli(
            worker_env, "--json", "release", "storm.process:3", "--force", "--yes"
        ).stdout
    )
    assert (answer["holder"]["task_id"], 0 < answer["holder"]["ttl_left_s"] <= 30) == (
        "task-4",
        True,
    )
    store.client.set(lease.keys.lock, "garbage")  # not celery-lock's: deleted all the same
    done = celery_lock_cli(worker_env, "--json", "release", "storm.process:3", "--force", "--yes")
    assert json.loads(done.stdout)["holder"]["task_id"] == "?"
    assert json.loads(done.stdout)["holder"]["ttl_left_s"] == -1.0  # written without a TTL
    assert not store.client.exists(lease.keys.lock)


def test_release_fence_deletes_only_the_lease_granted_with_that_fence(
    worker_env: dict[str, str], store: LockStore
) -> None:
    # ls printed task-3's lease with its fence; since then it lapsed and the request was granted
    # again, to a redelivery of the same task id: release --fence keeps the new lease, and fails.
    lease = take(store, 3, "task-3")
    store.client.delete(lease.keys.lock)
    second = take(store, 3, "task-3")
    release = ["release", "storm.process:3", "--force", "--fence"]
    refused = celery_lock_cli(worker_env, *release, str(lease.fence))
    assert refused.returncode == 1, refused.stderr
    assert (
        f"Error: not released: {lease.keys.lock} holds the lease granted with fence "
        f"{second.fence} (held by task-3 (storm.process)"
    ) in refused.stderr
    assert refused.stderr.rstrip().endswith(f"not the lease granted with fence {lease.fence}")
    assert store.client.get(second.keys.lock) is not None
    done = celery_lock_cli(worker_env, *release, str(second.fence))  # no question asked
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(f"released {lease.keys.lock}, held by task-3 ")
    assert not store.client.exists(lease.keys.lock)
    gone = celery_lock_cli(worker_env, *release, str(second.fence))
    assert (gone.returncode, gone.stdout.strip()) == (0, f"no lease at {lease.keys.lock}")
    store.client.hset(lease.keys.lock, "owner", "someone")  # not celery-lock's: kept
    foreign = celery_lock_cli(worker_env, *release, "1")
    assert foreign.returncode == 1, foreign.stderr
    assert "holds a value celery-lock did not write, not the lease granted with fence 1" in (
        foreign.stderr
    )
    assert store.client.exists(lease.keys.lock)


@pytest.mark.parametrize("fault", [redis.TimeoutError, redis.ConnectionError])
@pytest.mark.parametrize(
    ("command", "sends"),
    [
        (["release", "--force", "--yes"], "eval"),
        (["release", "--force", "--fence", "{fence}"], "eval"),
        (["forget"], "pipeline"),  # every task's done-marker, found by a scan
        (["forget", "--task", "storm.process"], "delete"),  # one, by its key
    ],
    ids=["release-yes", "release-fence", "forget", "forget-task"],
)
def test_a_write_without_a_reply_says_it_may_have_been_made(
    worker_env: dict[str, str],
    store: LockStore,
    command: list[str],
    sends: str,
    fault: type[Exception],
) -> None:
    # The store may take a write and stall, or drop the connection, before its reply: a
    # release or forget without one may be done (or done later), which "failed" did not say.
    # The fault comes from the client, as the command sends its write.
    fence = done_then_held_by_the_next_stage(store, 3).fence + 1
    real_execute = redis.client.Pipeline.execute

    def no_reply(*_: Any, **__: Any) -> None:
        raise fault("Timeout reading from socket")

    def no_reply_to_deletes(pipe: Any, *args: Any, **kwargs: Any) -> Any:
        if any(command[0][0] == "DEL" for command in pipe.command_stack):
            no_reply()
        return real_execute(pipe, *args, **kwargs)

    target, faulty = {
        "eval": ("redis.Redis.eval", no_reply),
        "delete": ("redis.Redis.delete", no_reply),
        "pipeline": ("redis.client.Pipeline.execute", no_reply_to_deletes),
    }[sends]
    name, *options = (part.format(fence=fence) for part in command)
    url = worker_env["STORM_LOCK_URL"]
    with mock.patch(target, faulty):
        done = CliRunner().invoke(celery, ["lock", "--url", url, name, "storm.process:3", *options])
    assert done.exit_code == 1, done.output
    assert (
        f"Error: the lock store did not answer ({fault.__name__}: Timeout reading from "
        f"socket): what {name} was deleting may be deleted or not; `lock show` with the same key "
        f"and options tells"
    ) in done.output


@pytest.mark.parametrize("fault", [redis.TimeoutError, redis.ConnectionError])
@pytest.mark.parametrize(
    ("command", "method"),
    [(["release", "--force"], "lease"), (["show"], "show")],  # release: the read before asking
    ids=["release-read", "show"],
)
def test_a_read_without_a_reply_says_the_command_failed(
    worker_env: dict[str, str], command: list[str], method: str, fault: type[Exception]
) -> None:
    def no_reply(*_: Any, **__: Any) -> None:
        raise fault("Timeout reading from socket")

    url = worker_env["STORM_LOCK_URL"]
    name, *options = command
    with mock.patch.object(LockAdmin, method, no_reply):
        done = CliRunner().invoke(celery, ["lock", "--url", url, name, "storm.process:3", *options])
    assert done.exit_code == 1, done.output
    assert f"Error: the lock store failed: {fault.__name__}: Timeout reading from socket" in (
        done.output
    )


def test_a_user_without_scripting_is_told_what_it_lacks(worker_env: dict[str, str]) -> None:
    rules = ("~celery-lock:*", "+@read", "+select")
    with acl_user(worker_env["STORM_LOCK_URL"], "cli-read-only", *rules) as read_only:
        done = celery_lock_cli(worker_env, "--url", read_only, "ls")
    assert done.returncode == 1, done.stderr
    assert "Error: the lock store's user may not send SCRIPT EXISTS, which every command sends" in (
        done.stderr
    )
    assert "it needs +@read +@write +@scripting on the keys under the prefix" in done.stderr


def test_a_scope_no_task_of_the_app_uses_is_warned_about(
    worker_env: dict[str, str], store: LockStore
) -> None:
    # The task's short name for its full one: show found nothing there, and said only that.
    lease = take(store, 43, "task-43")
    store.release(lease, success=True, done_ttl_ms=60_000)
    done = celery_lock_cli(worker_env, "show", "process:43")
    assert done.returncode == 0, done.stderr
    assert (
        "Warning: no LockedTask of this app has scope 'process' (its task name or lock_scope); "
        "did you mean 'storm.process'?"
    ) in done.stderr
    assert "done      none" in done.stdout
    known = celery_lock_cli(worker_env, "show", "storm.process:43")
    assert "Warning" not in known.stderr
    assert "done      storm.process by task-43" in known.stdout
    shared = celery_lock_cli(worker_env, "show", "request:43")  # a lock_scope of the app's
    assert "Warning" not in shared.stderr
    # billing:eu, a lock_scope with a ':': typed whole, it names scope 'billing'; as stored, it
    # is that scope.
    colon = celery_lock_cli(worker_env, "show", "billing:eu:43")
    assert (
        "Warning: scope 'billing:eu' holds a ':', and 'billing:eu:43' names scope 'billing': "
        "give the request's lock key (celery lock key derives it)"
    ) in colon.stderr
    stored = scope_key_part("billing:eu")
    assert "Warning" not in celery_lock_cli(worker_env, "show", f"{stored}:43").stderr
    # The closest scope may hold a ':' too: typed as suggested, it would name another.
    typo = celery_lock_cli(worker_env, "show", "biling:43")
    assert (
        "did you mean 'billing:eu'? It holds a ':': give the request's lock key (celery lock key "
        "derives it)\n"
    ) in typo.stderr
    # A hint only: an app module that fails to import does not stop the command.
    broken = {**worker_env, "STORM_CONF": '{"include": ["tests.apps.no_such_module"]}'}
    shown = celery_lock_cli(broken, "show", "storm.process:43")
    assert shown.returncode == 0, shown.stderr
    assert "done      storm.process by task-43" in shown.stdout


def test_keys_that_are_not_utf_8_are_listed_and_named_back(
    worker_env: dict[str, str], store: LockStore
) -> None:
    # The library never writes such keys; a foreign writer may. ls left them out, and naming
    # one died with a traceback.
    holder = Holder("t-odd", "storm.process", "host-a", 1)
    odd = b"celery-lock:{storm.process:bad\xff}"
    store.client.set(odd + b":lock", encode_lock(new_token(), 7, holder, 0), px=60_000)
    store.client.set(odd + b":done:storm.process", b"t-done", px=60_000)
    [lease] = json.loads(celery_lock_cli(worker_env, "--json", "ls").stdout)
    assert lease["task_id"] == "t-odd"
    assert lease["key"] == "celery-lock:{storm.process:bad\udcff}:lock"
    listed = celery_lock_cli(worker_env, "ls")
    assert "celery-lock:{storm.process:bad\\udcff}:lock" in listed.stdout  # escaped as shown
    # Named back on a command line, as the bytes it is (Python reads them as surrogates).
    name = os.fsdecode(odd + b":lock")
    shown = celery_lock_cli(worker_env, "--json", "show", name)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["lease"]["task_id"] == "t-odd"
    forgot = celery_lock_cli(worker_env, "forget", name)
    assert forgot.returncode == 0, forgot.stderr
    assert not store.client.exists(odd + b":done:storm.process")
    released = celery_lock_cli(worker_env, "release", name, "--force", "--yes")
    assert released.returncode == 0, released.stderr
    assert not store.client.exists(odd + b":lock")


@pytest.mark.parametrize("how", ["wrong password", "no password"])
def test_a_failed_login_is_reported_as_such(
    worker_env: dict[str, str], connect_only_url: str, how: str
) -> None:
    if how == "wrong password":
        done = celery_lock_cli(
            worker_env, "--url", connect_only_url.replace(":pw@", ":nope@"), "ls"
        )
    else:
        with RedisServer(extra_args=["--requirepass", "secret"]) as server:
            done = celery_lock_cli(worker_env, "--url", f"redis://127.0.0.1:{server.port}/0", "ls")
    assert done.returncode == 1
    assert "cannot log in to the lock store" in done.stderr
    assert "cannot reach" not in done.stderr
    assert "Traceback" not in done.stderr


def test_options_come_from_celery_environment_variables_too(
    worker_env: dict[str, str], store: LockStore
) -> None:
    """Celery reads every option of its commands from ``CELERY_<COMMAND>_<OPTION>`` as well
    (click's auto_envvar_prefix), as docs/cli.md warns: release's two guards included."""
    lease = take(store, 5, "task-5")
    env = {**worker_env, "CELERY_LOCK_AS_JSON": "1"}
    listed = celery_lock_cli(env, "ls")
    assert json.loads(listed.stdout)[0]["key"] == lease.keys.lock
    released = celery_lock_cli(
        {**env, "CELERY_LOCK_RELEASE_FORCE": "1", "CELERY_LOCK_RELEASE_YES": "1"},
        "release", "storm.process:5",
    )  # fmt: skip
    answer = json.loads(released.stdout)
    assert (answer["key"], answer["released"], answer["holder"]["task_id"]) == (
        lease.keys.lock, True, "task-5"
    )  # fmt: skip
    assert not store.client.exists(lease.keys.lock)


def test_without_an_app_or_a_url_the_error_suggests_both(tmp_path: Path) -> None:
    # Celery's default app (no -A) has no settings: the lock store cannot be found.
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY")}
    done = subprocess.run(
        [sys.executable, "-m", "celery", "lock", "ls"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "(or pass -A with your app, or --url)" in done.stderr
    # With -A (an app without a lock store), only --url is left to suggest.
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.helper_apps.echo_app", "lock", "ls"],
        env={**env, "ECHO_BROKER_URL": "memory://"}, cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "not set, and the broker is not Redis" in done.stderr
    assert "(or pass --url)" in done.stderr


@pytest.mark.parametrize(
    "holder",
    [
        '{"task_id": "x", "task": "storm.process", "pid": 1e999}',  # a float JSON reads as inf
        '{"task_id": "x", "task": "storm.process", "since": 1' + "0" * 400 + "}",  # no float
        "[" * 100_000,  # nested deeper than the JSON parser recurses
    ],
    ids=["pid-inf", "since-past-float", "deep"],
)
def test_a_foreign_lock_value_with_numbers_or_nesting_python_cannot_read_is_listed(
    worker_env: dict[str, str], store: LockStore, holder: str
) -> None:
    # Not a lease celery-lock wrote: listed as such, so that it can be found and released.
    # One such value must not take down the whole listing with a traceback.
    take(store, 1, "task-1")
    foreign = "celery-lock:{storm.process:2}:lock"
    store.client.set(foreign, f"token 7 {holder}")
    listed = celery_lock_cli(worker_env, "--json", "ls")
    assert listed.returncode == 0, listed.stderr
    rows = {lease["key"]: lease for lease in json.loads(listed.stdout)}
    assert rows["celery-lock:{storm.process:1}:lock"]["task_id"] == "task-1"
    assert rows[foreign]["task_id"] == "?"
    shown = celery_lock_cli(worker_env, "show", "storm.process:2")
    assert shown.returncode == 0, shown.stderr
    released = celery_lock_cli(worker_env, "release", "storm.process:2", "--force", stdin="y\n")
    assert released.returncode == 0, released.stderr
    assert "which holds a value celery-lock did not write" in released.stderr
    assert not store.client.exists(foreign)


def test_show_names_each_task_s_done_marker_when_a_task_name_holds_done(
    worker_env: dict[str, str], store: LockStore
) -> None:
    # ":" is a plain character of a key part: a task name may hold ":done:" as written.
    tasks = ("storm.a:done:x", "storm.b:done:x")
    for number, task in enumerate(tasks):
        lease = take(store, 4, f"task-{number}", task=task)
        store.release(lease, success=True, done_ttl_ms=60_000)
    done = celery_lock_cli(worker_env, "--json", "show", "storm.process:4")
    assert done.returncode == 0, done.stderr
    assert {task: d["task_id"] for task, d in json.loads(done.stdout)["done"].items()} == {
        "storm.a:done:x": "task-0",
        "storm.b:done:x": "task-1",
    }


def shrinking_scan(client: redis.Redis, at_call: int, filler: int) -> tuple[Any, list[bytes]]:
    """A ``scan`` for ``client`` that deletes the ``filler`` keys (``other:<n>``) before its
    ``at_call``-th call and waits for the server to shrink its keyspace, and the list of every
    key the real SCAN returned."""
    real_scan = client.scan
    returned: list[bytes] = []
    calls = 0

    def scan(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == at_call:
            for start in range(0, filler, 1_000):
                client.delete(*[f"other:{n}" for n in range(start, min(start + 1_000, filler))])
            time.sleep(0.3)  # for the server's cron to shrink the keyspace
        cursor, keys = real_scan(*args, **kwargs)
        returned.extend(keys)
        return cursor, keys

    return scan, returned


def test_ls_lists_each_lease_once_when_scan_returns_a_key_twice(
    worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # SCAN may return a key more than once: here when the keyspace shrinks between two SCAN
    # steps (Redis then resumes in the smaller table and walks part of one bucket again).
    client = redis.Redis.from_url(worker_env["STORM_LOCK_URL"])
    admin = LockAdmin(client, "celery-lock")
    holder = Holder("task-1", "storm.process", "h", 1)
    real_scan = client.scan
    for trial in range(30):
        client.flushdb()
        pipe = client.pipeline(transaction=False)
        for request in range(1000):
            keys = RequestKeys.build("celery-lock", "storm.process", str(request), "storm.process")
            pipe.set(keys.lock, encode_lock(new_token(), 1, holder, 1), px=60_000)
        for n in range(20_000):
            pipe.set(f"other:{n}", "x")
        pipe.execute()
        scan, returned = shrinking_scan(client, at_call=2 + trial % 25, filler=20_000)
        monkeypatch.setattr(client, "scan", scan)
        listed = [lease.key for lease in admin.held()]
        monkeypatch.setattr(client, "scan", real_scan)
        if len(returned) > len(set(returned)):  # SCAN returned a key twice: ls must not
            assert len(listed) == len(set(listed)) == 1000
            client.close()
            return
    # A server whose SCAN does not repeat a key here (another hash table) has nothing to show.
    pytest.skip("SCAN never returned a key twice in 30 tries")


def test_forget_reports_only_the_markers_it_deleted(
    worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A marker that expires between the SCAN that finds it and the DEL was not forgotten.
    client = redis.Redis.from_url(worker_env["STORM_LOCK_URL"])
    kept = RequestKeys.build("celery-lock", "storm.process", "5", "storm.process")
    lapsing = RequestKeys.build("celery-lock", "storm.process", "5", "storm.next")
    client.set(kept.done, "task-1", px=60_000)
    client.set(lapsing.done, "task-2", px=60_000)
    real_scan = client.scan

    def scan(*args: Any, **kwargs: Any) -> Any:
        cursor, keys = real_scan(*args, **kwargs)
        client.delete(lapsing.done)  # it expires now
        return cursor, keys

    monkeypatch.setattr(client, "scan", scan)
    one, deleted = LockAdmin(client, "celery-lock").forget("storm.process:5", None)
    assert (one, deleted) == (None, [kept.done])
    client.close()


def test_forget_keeps_the_fence_counter_as_long_as_the_done_marker(
    worker_env: dict[str, str], store: LockStore
) -> None:
    # "The fence counter is kept, so the next grant still gets a larger fence than the last
    # one": also when the marker is forgotten late in its TTL. The grant and each heartbeat
    # make the counter live settings.fence_ttl_ms from their time; the release writes the
    # marker for the done TTL from its own, later: the counter must not lapse first.
    settings = LockSettings.resolve({"celery_lock_ttl": 3, "celery_lock_done_ttl": 4})
    keys = RequestKeys.build("celery-lock", "storm.process", "6", "storm.process")
    holder = Holder("task-1", "storm.process", "h", 1)
    token = new_token()
    fence = granted(store.acquire(keys, token, settings.ttl_ms, holder, settings.fence_ttl_ms))
    lease = Lease(store, keys, token, settings.ttl_ms, fence, holder, settings.fence_ttl_ms)
    time.sleep(settings.interval)  # the body runs: one heartbeat, as the worker's would beat
    assert store.extend_all([lease]) == [True]
    time.sleep(1.5)  # and a while more before the body returns
    assert store.release(lease, success=True, done_ttl_ms=settings.done_ttl_ms)
    # A counter that lived max(done TTL, lease TTL) from the beat would lapse 1.5 s before the
    # marker: a forget in those 1.5 s would let the next grant start a new counter, from its
    # own clock rather than from this one.
    # (Compared directly, so how long the CLI takes to start does not matter.)
    assert store.client.pttl(keys.fence) >= store.client.pttl(keys.done) > 0
    done = celery_lock_cli(worker_env, "forget", "storm.process:6")
    assert done.stdout.strip() == f"forgot {keys.done}", done.stderr
    next_holder = Holder("task-2", "storm.process", "h", 1)
    again = store.acquire(keys, new_token(), settings.ttl_ms, next_holder, settings.fence_ttl_ms)
    assert again == Acquired(fence + 1)


def on_a_terminal(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    """Run ``celery lock *args`` with its stderr on a pseudo-terminal, as an operator's shell
    would; return its exit status, its stdout, and what it wrote on the terminal."""
    leader, follower = pty.openpty()
    with tempfile.TemporaryFile() as stdout:
        with subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.apps.storm_app", "lock", *args],
            env={**os.environ, **env}, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=stdout,
            stderr=follower,
        ) as command:  # fmt: skip
            os.close(follower)
            terminal = b""
            try:
                while True:
                    ready, _, _ = select.select([leader], [], [], 60)
                    assert ready, terminal  # bounded: the command wrote or exited by now
                    try:
                        chunk = os.read(leader, 4096)
                    except OSError:  # EIO: the command exited, and the terminal closed
                        break
                    if not chunk:
                        break
                    terminal += chunk
                status = command.wait(timeout=60)
            finally:
                os.close(leader)
                if command.poll() is None:
                    command.kill()
        stdout.seek(0)
        return status, stdout.read().decode(), terminal.decode().replace("\r\n", "\n")


def fill(store: LockStore, leases: int, other_keys: int) -> None:
    """``leases`` leases held (requests 0 to leases - 1) among ``other_keys`` other keys."""
    for request in range(leases):
        take(store, request, f"t{request}")
    pipe = store.client.pipeline(transaction=False)
    for n in range(other_keys):
        pipe.set(f"other:{n}", "x")
    pipe.execute()


@pytest.mark.parametrize(
    "command", [["--json", "ls"], ["ls"], ["show", "storm.process:1"],
                ["forget", "storm.process:1"]], ids=["ls-json", "ls", "show", "forget"],
)  # fmt: skip
def test_a_long_scan_reports_its_progress_and_a_summary_on_the_terminal_only(
    worker_env: dict[str, str], store: LockStore, command: list[str]
) -> None:
    # A store of millions of keys takes seconds to scan: the operator sees it move, on stderr,
    # every --progress-every keys walked (here 500 of 3,024), and stdout stays the result.
    fill(store, leases=12, other_keys=3_000)
    keys = store.client.dbsize()  # 3,024: each lease's lock and fence, and the others
    status, out, terminal = on_a_terminal(worker_env, "--progress-every", "500", *command)
    assert status == 0, terminal
    lines = terminal.splitlines()
    assert len(lines) >= 3, terminal
    assert lines[0].startswith(f"scanned about 500 of {keys} keys, "), terminal
    assert lines[-1].startswith(f"scanned {keys} keys in "), terminal
    matching = 12 if "ls" in command else 0
    assert lines[-1].endswith(f"s, {matching} matching"), terminal
    if command == ["--json", "ls"]:
        assert len(json.loads(out)) == 12
    elif command == ["ls"]:
        assert out.splitlines()[-1] == "12 lease(s) held"
        assert "scanned" not in out
    else:
        assert "scanned" not in out
    # Not on a terminal (a script, a cron job), or with --progress-every 0: nothing on stderr.
    quiet = celery_lock_cli(worker_env, "--progress-every", "500", *command)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    status, _, terminal = on_a_terminal(worker_env, "--progress-every", "0", *command)
    assert (status, terminal) == (0, "")


def test_a_short_scan_prints_no_progress_on_the_terminal(
    worker_env: dict[str, str], store: LockStore
) -> None:
    fill(store, leases=3, other_keys=100)
    status, out, terminal = on_a_terminal(worker_env, "ls")  # the default: 1,000,000 keys
    assert (status, terminal) == (0, "")
    assert out.splitlines()[-1] == "3 lease(s) held"


def test_key_prints_the_lock_key_of_a_call_which_show_then_finds(
    worker_env: dict[str, str], store: LockStore
) -> None:
    take(store, 7, "task-7")
    printed = celery_lock_cli(worker_env, "key", "storm.process", "-a", "[7]")
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == "celery-lock:{storm.process:7}:lock\n"
    by_keyword = celery_lock_cli(
        worker_env, "key", "storm.process", "--kwargs", '{"request_idx": 7}'
    )
    assert by_keyword.stdout == printed.stdout
    # Each option in the environment too, named after it, as docs/cli.md says.
    for name, value in (
        ("CELERY_LOCK_KEY_ARGS", "[7]"),
        ("CELERY_LOCK_KEY_KWARGS", '{"request_idx": 7}'),
    ):
        from_env = celery_lock_cli({**worker_env, name: value}, "key", "storm.process")
        assert from_env.stdout == printed.stdout, (name, from_env.stderr)
    shown = celery_lock_cli(worker_env, "show", printed.stdout.strip())
    assert shown.returncode == 0, shown.stderr
    assert "holder    task-7 (storm.process)" in shown.stdout


def test_key_finds_a_key_that_cannot_be_typed_as_scope_and_request_key(
    worker_env: dict[str, str],
) -> None:
    # A template value holding the separator and a scope holding ':' are digested in the keys.
    printed = celery_lock_cli(
        worker_env, "--json", "key", "storm.tenant_order", "-a", '["acme:eu", 1]'
    )
    assert printed.returncode == 0, printed.stderr
    spec = "{tenant}:{request_idx}"
    derive = KeyDeriver.create(
        "storm.tenant_order", inspect.signature(lambda tenant, request_idx: 0), spec
    )
    expected = RequestKeys.build(
        "celery-lock", "billing:eu", derive.request_key(("acme:eu", 1), {}), "storm.tenant_order"
    )
    assert json.loads(printed.stdout) == dataclasses.asdict(expected)
    assert re.fullmatch(r"celery-lock:\{billingeu~\w{32}:acme:eu:1~\w{32}\}:lock", expected.lock)
    # --prefix reads the keys under another prefix, as the other commands do.
    other = celery_lock_cli(worker_env, "--prefix", "billing", "key", "storm.process", "-a", "[7]")
    assert other.stdout == "billing:{storm.process:7}:lock\n"


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["storm.nothing", "-a", "[7]"], "no task named 'storm.nothing' in this app"),
        (["celery.backend_cleanup"], "celery.backend_cleanup is not a LockedTask"),
        (["storm.process"], "missing a required argument: 'request_idx'"),
        (["storm.process", "-a", "[null]"], "cannot be made of None alone"),
        (["storm.process", "-a", "{7}"], "-a"),
    ],
)
def test_key_of_no_locked_task_or_of_a_call_without_a_key_is_a_usage_error(
    worker_env: dict[str, str], args: list[str], error: str
) -> None:
    refused = celery_lock_cli(worker_env, "key", *args)
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert error in " ".join(refused.stderr.split())
    assert "Traceback" not in refused.stderr


def test_key_reports_an_invalid_setting_of_the_task_as_a_usage_error(
    worker_env: dict[str, str],
) -> None:
    # Unlike the other commands, key reads the task's settings, as its worker would.
    conf = json.dumps({"celery_lock_ttl": 1.0, "celery_lock_heartbeat_interval": 5.0})
    refused = celery_lock_cli(
        {**worker_env, "STORM_CONF": conf}, "key", "storm.process", "-a", "[7]"
    )
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert "celery_lock_heartbeat_interval" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_key_does_not_ask_the_lock_store(worker_env: dict[str, str]) -> None:
    unreachable = {**worker_env, "STORM_LOCK_URL": f"redis://127.0.0.1:{free_port()}/0"}
    printed = celery_lock_cli(unreachable, "key", "storm.process", "-a", "[7]")
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == "celery-lock:{storm.process:7}:lock\n"


def test_the_help_names_the_options_and_the_key_as_docs_cli_md_does(
    worker_env: dict[str, str],
) -> None:
    table = (ROOT / "docs" / "cli.md").read_text().split("| option ", 1)[1].split("\n\n", 1)[0]
    documented = re.findall(r"^\| `(--[^`]+)`", table, flags=re.MULTILINE)
    assert "--json" in documented
    shown = celery_lock_cli(worker_env, "--help")
    assert shown.returncode == 0, shown.stderr
    for option in documented:
        assert re.search(rf"^\s+{re.escape(option)}\s", shown.stdout, re.MULTILINE), option
    # The two forms of "Naming a request".
    for command in ("show", "forget", "release"):
        shown = celery_lock_cli(worker_env, command, "--help")
        assert "one of its keys, as ls lists them, or <scope>:<request key>" in " ".join(
            shown.stdout.split()
        ), command
