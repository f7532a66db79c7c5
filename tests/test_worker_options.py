"""Worker command-line options, through a real ``celery worker`` subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pytest
import redis
from celery import Celery
from conftest import settle

from celery_lock import ConfigurationError, LockedTask
from celery_lock.lease import Holder, encode_lock
from celery_lock.testing import CeleryWorker, RedisServer
from celery_lock.worker import _check_options_fit

pytestmark = pytest.mark.worker

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.apps.storm_app"


def celery(
    *args: str, env: dict[str, str], timeout: float = 60, app: str = APP
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, *args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


@pytest.fixture
def worker(
    spawn_worker: Callable[..., CeleryWorker], worker_env: dict[str, str]
) -> Callable[..., CeleryWorker]:
    """``worker(*options)``: a two-process storm_app worker started with ``options``."""
    return lambda *options: spawn_worker(APP, worker_env, *options, concurrency=2)


def test_worker_help_lists_lock_options(worker_env: dict[str, str]) -> None:
    out = celery("worker", "--help", env={**os.environ, **worker_env}).stdout
    for option in ("--lock-redis-url", "--lock-ttl", "--lock-on-duplicate"):
        assert option in out


@pytest.mark.parametrize(
    ("option", "value", "problem"),
    [("--lock-ttl", "-5", "must be at least 0.1 seconds, got -5.0"),
     ("--lock-redis-url", "http://nope", "expected a redis://")],
)  # fmt: skip
def test_bad_worker_option_is_a_one_line_usage_error(
    worker_env: dict[str, str], option: str, value: str, problem: str
) -> None:
    done = celery("worker", option, value, "--pool", "solo", env={**os.environ, **worker_env})
    assert done.returncode == 2  # click's usage error, before the worker starts
    assert f"Invalid value for '{option}': {problem}" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_worker_option_contradicting_the_conf_is_a_one_line_usage_error(
    worker_env: dict[str, str],
) -> None:
    """--lock-ttl 1 under celery_lock_heartbeat_interval = 1.5 (valid without the option)."""
    env = {**os.environ, **worker_env, "STORM_CONF": '{"celery_lock_heartbeat_interval": 1.5}'}
    done = celery("worker", "--lock-ttl", "1", "--lock-on-duplicate", "retry", "--pool", "solo",
                  env=env)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert (
        "Error: Invalid value for '--lock-ttl': 1.0 conflicts with celery_lock_heartbeat_interval: "
        "must be shorter than the lease TTL (1.0s), got 1.5s"
    ) in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.parametrize(
    ("conf", "problem"),
    [({"celery_lock_ttl": -5}, "celery_lock_ttl: must be at least 0.1 seconds, got -5"),
     ({"celery_lock_on_duplicate": "drop"}, "celery_lock_on_duplicate: must be one of")],
)  # fmt: skip
def test_an_invalid_setting_of_the_app_stops_the_worker_with_one_line(
    worker_env: dict[str, str], conf: dict[str, Any], problem: str
) -> None:
    env = {**os.environ, **worker_env, "STORM_CONF": json.dumps(conf)}
    done = celery("worker", "--pool", "solo", env=env)
    assert done.returncode == 1, done.stderr
    assert f"Error: celery-lock: {problem}" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_binding_a_locked_task_installs_celery_lock_without_install_being_called() -> None:
    """Celery calls ``Task.on_bound`` when a task binds to its app: a worker of an app that never
    called ``celery_lock.install`` still runs the start-up checks (and the heartbeat's signals),
    so an invalid setting stops it instead of every task failing."""
    env = {**os.environ, "BARE_CONF": json.dumps({"celery_lock_ttl": -5})}
    done = celery("worker", "--pool", "solo", env=env, timeout=30, app="tests.apps.bare_app")
    assert done.returncode == 1, done.stderr
    assert "Error: celery-lock: celery_lock_ttl: must be at least 0.1 seconds" in done.stderr


def test_worker_option_contradicting_a_task_option_names_both() -> None:
    app = Celery("options_tests", broker="memory://", set_as_current=False)
    app.conf.celery_lock_redis_url = "redis://127.0.0.1:1/0"

    @app.task(base=LockedTask, name="options_tests.t", shared=False, lock_heartbeat_interval=10)
    def t(request_idx: Any) -> None:
        pass

    given = {"celery_lock_ttl": ("--lock-ttl", 5.0)}
    conflict = (
        "5.0 conflicts with options_tests.t.lock_heartbeat_interval: must be shorter than the "
        "lease TTL (5.0s, --lock-ttl), got 10.0s"
    )
    with click.Context(click.Command("worker")), pytest.raises(click.BadParameter) as raised:
        _check_options_fit(app, given)  # from the command line: Click's usage error
    assert raised.value.format_message() == f"Invalid value for '--lock-ttl': {conflict}"
    with pytest.raises(ConfigurationError) as typed:
        _check_options_fit(app, given)  # from Python (app.Worker): a typed error
    assert (typed.value.setting, typed.value.problem) == ("--lock-ttl", conflict)
    _check_options_fit(app, {"celery_lock_ttl": ("--lock-ttl", 30.0)})  # fits: no error
    app.conf.celery_lock_ttl = 5  # the app's own contradiction: left to the checks that follow
    _check_options_fit(app, given)


def test_lock_on_duplicate_option_overrides_conf(
    make_producer: Callable[..., Celery],
    worker: Any,
    worker_env: dict[str, str],
    lock_redis: redis.Redis,
) -> None:
    """With --lock-on-duplicate raise, a copy of a running request fails instead of skipping."""
    worker("--lock-on-duplicate", "raise", "--lock-ttl", "7")
    app = make_producer(worker_env["STORM_BROKER_URL"], worker_env["STORM_BACKEND_URL"])
    # Hold request 5 as another copy would, then send a copy.
    holder = Holder(task_id="holder", task_name="storm.process", host="elsewhere", pid=1)
    lock_redis.set("celery-lock:{storm.process:5}:lock", encode_lock("t", 1, holder, 0), px=60_000)
    result = app.send_task("storm.process", args=(5,))
    assert settle([result]) == {"FAILURE": 1}
    assert "already running as task holder" in str(result.result)

    # --lock-ttl 7 applies to the leases this worker takes.
    app.send_task("storm.process", args=(6,)).get(timeout=30)
    records = redis.Redis.from_url(worker_env["STORM_RECORD_URL"])
    [run] = [json.loads(raw) for raw in records.lrange("storm:runs", 0, -1)]
    assert run["ttl"] == 7.0
    records.close()


def test_the_lock_store_password_is_masked_where_celery_masks_the_brokers(
    worker: Any, worker_env: dict[str, str]
) -> None:
    """``celery inspect conf`` (Flower's worker configuration tab) and ``celery report`` show
    ``app.conf``; the lock store URL, given as a worker option or a setting, holds a password as
    the broker URL may."""
    worker("--lock-redis-url", "redis://:s3cret@localhost:1/0")
    shown = celery("inspect", "conf", "--json", env=worker_env)
    assert shown.returncode == 0, shown.stderr
    [conf] = json.loads(shown.stdout).values()
    assert conf["celery_lock_redis_url"] == "********"
    assert "s3cret" not in shown.stdout

    report = celery("report", env={**worker_env, "STORM_LOCK_URL": "redis://:s3cret@h:6379/2"})
    assert report.returncode == 0, report.stderr
    assert "celery_lock_redis_url: '********'" in report.stdout
    assert "s3cret" not in report.stdout


def test_the_lock_store_password_is_masked_in_a_report_of_an_app_never_finalized() -> None:
    """``celery report`` never finalizes the app, so no LockedTask binds to install
    celery-lock: the masking came only with install, and the report showed the password."""
    program = (
        "import celery_lock\n"
        "from celery import Celery\n"
        "app = Celery('report', set_as_current=False)\n"
        "app.conf.celery_lock_redis_url = 'redis://:s3cret@locks.example:6379/2'\n"
        "@app.task(base=celery_lock.LockedTask, lock_key='order')\n"
        "def charge(order): ...\n"
        "print(app.bugreport())\n"
    )
    report = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert report.returncode == 0, report.stderr
    assert "celery_lock_redis_url: '********'" in report.stdout
    assert "s3cret" not in report.stdout


def test_a_lock_store_not_reachable_at_start_is_warned_about_and_the_worker_starts(
    worker: Any,
) -> None:
    """Every task would be deferred without a word at start: one warning says why. A warning,
    not a refusal: the store may come up later."""
    started = worker("--lock-redis-url", "redis://localhost:1/0")  # ready: it did start
    log = started.log()
    assert log.count("not reachable") == 1, log  # one store: the app's and its tasks'
    assert re.search(
        r"WARNING.*celery-lock: lock store localhost:1 not reachable: .+; tasks will be deferred "
        r"\(or run unlocked under fail_open\) until it is",
        log,
    ), log


def test_the_worker_logs_which_lock_store_it_uses(worker: Any) -> None:
    """Two pools started with different --lock-redis-url values ran the same request twice,
    and neither log said which store it used: one INFO line at start says it (the password
    masked), where the URL came from, the key prefix and the lease TTL, and the tasks whose
    own options differ."""
    with RedisServer(extra_args=["--requirepass", "s3cret-pw"]) as guarded:
        url = f"redis://:s3cret-pw@127.0.0.1:{guarded.port}/0"
        started = worker("--lock-redis-url", url, "--lock-ttl", "30")
        log = started.log()
        started.stop()
    [line] = [line for line in log.splitlines() if "celery-lock: lock store" in line]
    assert (
        f"INFO/MainProcess] celery-lock: lock store redis://:***@127.0.0.1:{guarded.port}/0 "
        "(from --lock-redis-url), key prefix 'celery-lock', lease TTL 30s; storm.busy: lease TTL "
        "2s; storm.long: lease TTL 2s"
    ) in line
    assert "s3cret" not in log


def test_a_lock_store_on_a_node_of_a_cluster_of_several_masters_stops_the_worker(
    worker_env: dict[str, str], redis_cluster: Callable[[int], list[RedisServer]]
) -> None:
    """Started, such a worker failed every task whose keys hash to another master's slot
    (MOVED), and ran the rest: one line says why it does not start, and what URL it needs."""
    node, *_ = redis_cluster(2)
    env = {**os.environ, **worker_env}
    done = celery("worker", "--lock-redis-url", node.url, "--pool", "solo", env=env)
    assert done.returncode == 1, done.stderr
    assert (
        f"Error: celery-lock: --lock-redis-url: lock store 127.0.0.1:{node.port} is a node "
        "of a Redis Cluster of 2 masters"
    ) in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.parametrize("mistake", ["wrong password", "no such database", "not redis"])
def test_a_lock_store_url_the_server_refuses_stops_the_worker(
    worker_env: dict[str, str], not_redis: str, mistake: str
) -> None:
    """Started with one warning, such a worker failed every task unrun (LockStoreError) and
    acked it: the queue drained into FAILURE. One line says what to fix in which URL, naming
    the option or the setting it came from, and the worker does not start."""
    with RedisServer(extra_args=["--requirepass", "right-pw"]) as guarded:
        urls = {
            "wrong password": f"redis://:wrong-pw@127.0.0.1:{guarded.port}/0",
            "no such database": f"redis://:right-pw@127.0.0.1:{guarded.port}/99",
            "not redis": f"redis://{not_redis}/0",
        }
        address = not_redis if mistake == "not redis" else f"127.0.0.1:{guarded.port}"
        refusals = {
            "wrong password": "refused the user or password: invalid username-password pair",
            "no such database": "refused the URL's database: DB index is out of range",
            "not redis": "does not speak Redis (Protocol error",
        }
        fixes = {
            "wrong password": "put the user and password the server expects in the URL",
            "no such database": "use a database the server has",
            "not redis": "wrong host or port?",
        }
        env = {**os.environ, **worker_env}
        done = celery("worker", "--lock-redis-url", urls[mistake], "--pool", "solo", env=env)
        # From the app's setting, the line names the setting.
        by_conf = celery("worker", "--pool", "solo", env={**env, "STORM_LOCK_URL": urls[mistake]})
    assert done.returncode == 1, done.stderr
    assert (
        f"Error: celery-lock: --lock-redis-url: lock store {address} {refusals[mistake]}"
    ) in done.stderr
    assert fixes[mistake] in done.stderr
    assert "wrong-pw" not in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert by_conf.returncode == 1, by_conf.stderr
    assert f"Error: celery-lock: celery_lock_redis_url: lock store {address}" in by_conf.stderr


@pytest.mark.parametrize(("pool", "warned"), [("threads", True), ("prefork", False)])
def test_too_few_lock_store_connections_for_a_threads_pool_are_warned_about_at_start(
    spawn_worker: Callable[..., CeleryWorker], worker_env: dict[str, str], pool: str, warned: bool
) -> None:
    """settings.md: under a threads pool, max_connections must be at least the threads plus
    one (the heartbeat). Four threads on two connections would wait, retry and be deferred as
    if the store were down, without a word at start. A prefork child runs one body: two do."""
    env = {**worker_env, "STORM_LOCK_URL": f"{worker_env['STORM_LOCK_URL']}?max_connections=2"}
    log = spawn_worker(APP, env, pool=pool, concurrency=4).log()
    expected = (
        "allows 2 connections per process (max_connections), fewer than the 4 task bodies a "
        "process runs at once and its heartbeat"
    )
    assert (expected in log) is warned, log
    assert ("max_connections=5 or more" in log) is warned, log
