"""What docs/settings.md says about where settings come from, checked claim by claim; and the
places where a setting or option used to be taken without a word, or to fail later than it
could."""

from __future__ import annotations

import json
import sys
import time
import types
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from celery import _state as celery_state
from celery.schedules import crontab
from celery.schedules import schedule as celery_schedule
from celery.worker.request import Request

from celery_lock import ConfigurationError, LockedTask, LockSettings, checks
from celery_lock.request import LockedRequest
from celery_lock.runtime import lock_store_url, reset_runtime
from celery_lock.store import LockStore
from celery_lock.testing import CeleryWorker, RedisServer
from celery_lock.worker import LockStep

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.apps.storm_app"


def recorded_ttls(worker_env: dict[str, str]) -> dict[str, float]:
    """The lease TTL each recorded run had, by task name."""
    records = redis.Redis.from_url(worker_env["STORM_RECORD_URL"])
    try:
        runs = [json.loads(raw) for raw in records.lrange("storm:runs", 0, -1)]
    finally:
        records.close()
    return {run["task"]: run["ttl"] for run in runs}


# -- precedence, through real workers -----------------------------------------------------------


@pytest.mark.worker
@pytest.mark.parametrize("pool", ["solo", "threads", "prefork"])
def test_a_worker_option_applies_under_every_pool_and_a_task_option_still_wins(
    pool: str,
    spawn_worker: Callable[..., CeleryWorker],
    worker_env: dict[str, str],
    make_producer: Callable[..., Celery],
) -> None:
    """settings.md: --lock-ttl "overrides one app.conf setting for every task that worker runs
    (task options still win)". storm.long has lock_ttl=2.0 of its own."""
    spawn_worker(APP, worker_env, "--lock-ttl", "7", pool=pool, concurrency=2)
    app = make_producer(worker_env["STORM_BROKER_URL"], worker_env["STORM_BACKEND_URL"])
    app.send_task("storm.process", args=(1,)).get(timeout=30)
    app.send_task("storm.long", args=(2,), kwargs={"seconds": 0.1}).get(timeout=30)
    assert recorded_ttls(worker_env) == {"storm.process": 7.0, "storm.long": 2.0}


@pytest.mark.worker
def test_a_worker_option_from_celerys_environment_variable_wins_over_an_upper_case_setting(
    spawn_worker: Callable[..., CeleryWorker],
    worker_env: dict[str, str],
    make_producer: Callable[..., Celery],
) -> None:
    """Celery's CLI reads every worker option from CELERY_WORKER_<OPTION> too
    (auto_envvar_prefix), --lock-ttl included; and a worker option wins over app.conf's
    upper-case name (CELERY_LOCK_TTL, as Django settings write it)."""
    env = {
        **worker_env,
        "CELERY_WORKER_LOCK_TTL": "7",
        "STORM_CONF": json.dumps({"CELERY_LOCK_TTL": 9}),
    }
    spawn_worker(APP, env, pool="solo", concurrency=1)
    app = make_producer(worker_env["STORM_BROKER_URL"], worker_env["STORM_BACKEND_URL"])
    app.send_task("storm.process", args=(1,)).get(timeout=30)
    assert recorded_ttls(worker_env)["storm.process"] == 7.0


# -- app.conf, in process -----------------------------------------------------------------------


@pytest.fixture
def eager_app(lock_url: str) -> Iterator[Celery]:
    app = Celery("claims", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.celery_lock_redis_url = lock_url
    app.conf.celery_lock_ttl = 30
    yield app
    reset_runtime(app)


def test_app_conf_changed_after_the_first_run_has_no_effect_until_the_runtime_is_reset(
    eager_app: Celery, lock_redis: redis.Redis
) -> None:
    """settings.md: "The settings of a task are resolved once per process, the first time the
    task runs. In a running worker, changes to app.conf after that point have no effect." The
    lease in Redis shows which TTL a run took."""

    @eager_app.task(base=LockedTask, bind=True, lock_key="i", name="claims.pttl", shared=False)
    def pttl(self: Any, i: int) -> int:
        return int(lock_redis.pttl(self.request.lock_key))

    assert 29_000 < pttl.apply(args=(1,)).get() <= 30_000
    eager_app.conf.celery_lock_ttl = 5
    assert 29_000 < pttl.apply(args=(2,)).get() <= 30_000  # still the first run's TTL
    reset_runtime(eager_app)
    assert 4_000 < pttl.apply(args=(3,)).get() <= 5_000


def test_under_another_namespace_the_upper_case_name_is_still_read() -> None:
    """settings.md: "Under another namespace (namespace="TASKS"), CELERY_LOCK_TTL is still
    read, as its upper-case name"; and with namespace="CELERY", CELERY_CELERY_LOCK_TTL too."""
    module = types.ModuleType("claims_django_settings")
    module.CELERY_LOCK_TTL = 30  # type: ignore[attr-defined]
    module.CELERY_CELERY_LOCK_DONE_TTL = 7200  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        tasks = Celery("tasks_ns", set_as_current=False)
        tasks.config_from_object(module.__name__, namespace="TASKS")
        assert LockSettings.resolve(tasks.conf).ttl == 30.0
        celery = Celery("celery_ns", set_as_current=False)
        celery.config_from_object(module.__name__, namespace="CELERY")
        settings = LockSettings.resolve(celery.conf)
        assert (settings.ttl, settings.done_ttl) == (30.0, 7200.0)
    finally:
        del sys.modules[module.__name__]


# -- said at once, or at start --------------------------------------------------------------------


def test_a_duration_too_large_for_a_float_is_a_configuration_error() -> None:
    """Every other out-of-range duration ("1e400", 1e300, 10 years and a second) is a
    ConfigurationError naming the setting; an int past float range raised OverflowError from
    math.isfinite, with no setting named."""
    with pytest.raises(ConfigurationError, match="celery_lock_ttl"):
        LockSettings.resolve({"celery_lock_ttl": 10**400})


@pytest.mark.parametrize(
    ("option", "said"),
    [
        ("lock_tll", "no such option of LockedTask, and nothing reads it (did you mean lock_ttl?)"),
        ("lock_expiry", "celery-singleton's option; lock_ttl stands for it"),
        ("unique_on", "celery-singleton's option; lock_key stands for it"),
        ("raise_on_duplicate", "celery-singleton's option; lock_on_duplicate='raise'"),
        ("once", "celery-once's option; lock_key, lock_ttl and lock_on_duplicate"),
    ],
)
def test_an_option_nothing_reads_is_refused_when_the_task_is_made(option: str, said: str) -> None:
    """A misspelled option (lock_tll), or a peer's left on a decorator after migrating
    (celery-singleton's lock_expiry, which docs/comparison.md maps to lock_ttl), used to be
    ignored without a word: the task ran with the default 60 s TTL."""
    app = Celery("claims_options", broker="memory://", set_as_current=False)
    app.conf.celery_lock_redis_url = "redis://127.0.0.1:1/0"

    @app.task(base=LockedTask, lock_key="i", name="claims.t", shared=False, **{option: 600})
    def t(i: int) -> int:
        return i

    with pytest.raises(ConfigurationError) as refused:
        app.finalize()  # the decorator's class is made here
    assert str(refused.value).startswith(f"claims.t.{option}: {said}")


def test_an_annotated_option_is_checked_and_an_own_task_class_attribute_is_not() -> None:
    """task_annotations set options on the task's class as the decorator does: a misspelled one
    is refused too. A lock_* attribute of a task class of the user's own is its own business."""
    app = Celery("claims_own", broker="memory://", set_as_current=False)
    app.conf.celery_lock_redis_url = "redis://127.0.0.1:1/0"

    class Audited(LockedTask):
        lock_audit_table = "audit"

    @app.task(base=Audited, lock_key="i", name="claims.own", shared=False)
    def own(i: int) -> int:
        return i

    app.finalize()
    assert app.tasks["claims.own"].lock_audit_table == "audit"

    annotated_app = Celery("claims_annotated", broker="memory://", set_as_current=False)
    annotated_app.conf.celery_lock_redis_url = "redis://127.0.0.1:1/0"
    annotated_app.conf.task_annotations = {"claims.annotated": {"lock_tll": 5}}

    @annotated_app.task(base=LockedTask, lock_key="i", name="claims.annotated", shared=False)
    def annotated(i: int) -> int:
        return i

    with pytest.raises(ConfigurationError, match=r"^claims.annotated.lock_tll: no such option"):
        annotated_app.finalize()


def test_a_misspelled_setting_is_warned_about_at_start() -> None:
    """celery_lock_redis (no _url) is read by nothing: the lock store silently becomes the
    broker's Redis. misnamed_settings catches lock_ttl (no celery_ prefix), not this."""
    app = Celery("claims_typo", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.celery_lock_redis = "redis://locks.example:6379/5"
    assert lock_store_url(app, LockSettings.resolve(app.conf)) == "redis://127.0.0.1:1/0"
    assert (
        "app.conf has celery_lock_redis, which is no celery-lock setting, and nothing reads it "
        "(did you mean celery_lock_redis_url?)"
    ) in checks.warn_at_startup(app, {})
    app.conf.CELERY_LOCK_TTL = 30  # an upper-case setting is known
    assert not any("CELERY_LOCK_TTL" in w for w in checks.warn_at_startup(app, {}))
    # Suggested as it was spelled: Django settings keep only upper-case names.
    app.conf.CELERY_LOCK_DONETTL = 5
    assert (
        "app.conf has CELERY_LOCK_DONETTL, which is no celery-lock setting, and nothing reads it "
        "(did you mean CELERY_LOCK_DONE_TTL?)"
    ) in checks.warn_at_startup(app, {})


def test_a_misspelled_django_setting_under_the_celery_namespace_is_warned_about() -> None:
    """settings.md: Django settings loaded with namespace="CELERY" spell the settings
    CELERY_CELERY_LOCK_*. A misspelled one was read by nothing, and said nothing."""

    class DjangoSettings:
        CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
        CELERY_CELERY_LOCK_ON_DUPLICATES = "raise"
        CELERY_CELERY_LOCK_TTL = 30  # read, and known

    app = Celery("claims_django", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    assert LockSettings.resolve(app.conf).ttl == 30.0
    warnings = checks.unknown_settings(app.conf)
    assert warnings == [
        "app.conf has CELERY_CELERY_LOCK_ON_DUPLICATES, which is no celery-lock setting, and "
        "nothing reads it (did you mean CELERY_CELERY_LOCK_ON_DUPLICATE?)"
    ]


def test_a_lock_store_user_shut_out_of_the_key_prefix_is_warned_about_at_start() -> None:
    """A broker user confined by ACL to its global_keyprefix, the lock store defaulting to the
    broker URL: every task fails (NOPERM on the acquire), yet the start-up checks said nothing
    (CONFIG GET is refused, SCRIPT EXISTS, which touches no key, is allowed)."""
    with RedisServer() as server:
        admin = server.client()
        admin.acl_setuser(
            "shop", enabled=True, passwords=["+pw"], keys=["shop:*"],
            commands=["+@all", "-@admin", "-@dangerous"],
        )  # fmt: skip
        admin.close()
        broker = f"redis://shop:pw@127.0.0.1:{server.port}/0"
        app = Celery("claims_acl", broker=broker, backend="cache+memory://", set_as_current=False)
        app.conf.broker_transport_options = {"global_keyprefix": "shop:"}

        @app.task(base=LockedTask, lock_key="i", name="claims.acl", shared=False)
        def t(i: int) -> int:
            return i

        url = lock_store_url(app, LockSettings.resolve(app.conf))
        assert url == broker
        assert t.apply(args=(1,)).state == "FAILURE"  # NOPERM: every task fails
        store = LockStore.from_url(url)
        try:
            warnings = checks.warn_at_startup(app, {url: store})
        finally:
            store.client.close()
            reset_runtime(app)
        assert [w for w in warnings if "refused its user the keys under 'celery-lock'" in w]
        # Allowed the prefix, it says nothing. (enabled=True: redis-py's default turns the user
        # off, which the check took for a wrong password, said nothing about the keys, and so
        # passed; it now stops the worker.)
        admin = server.client()
        admin.acl_setuser("shop", enabled=True, keys=["shop:*", "celery-lock:*"])
        admin.close()
        store = LockStore.from_url(url)
        try:
            assert not [w for w in checks.warn_at_startup(app, {url: store}) if "keys" in w]
        finally:
            store.client.close()


def test_a_redis_broker_url_kombu_accepts_gives_a_lock_store() -> None:
    """kombu takes connect_timeout and heartbeat from any broker URL's query (and its Redis
    transport ignores all but connect_timeout); redis-py refuses them, so the lock store that
    defaults to the broker URL was a ConfigurationError, and the worker did not start. They are
    left out, and connect_timeout is given as redis-py's socket_connect_timeout."""
    broker = "redis://127.0.0.1:1/0?heartbeat=10&connect_timeout=3&insist=1"
    app = Celery("claims_query", broker=broker, set_as_current=False)
    with app.connection_for_write() as connection:
        assert (connection.heartbeat, connection.connect_timeout) == (10.0, "3")  # kombu's
    url = lock_store_url(app, LockSettings())
    assert url == "redis://127.0.0.1:1/0?socket_connect_timeout=3"
    assert (
        LockStore.from_url(url).client.connection_pool.connection_kwargs["socket_connect_timeout"]
        == 3.0
    )


def test_a_worker_refused_for_a_task_without_a_lock_store_names_the_task() -> None:
    """Celery shares a task (shared=True, the default) with every app finalized in the process:
    an app on RabbitMQ that never uses celery-lock gets another app's LockedTask, celery-lock
    installed by its binding, and a worker that refused to start with "celery_lock_redis_url:
    not set, and the broker is not Redis", naming no task. It names the task now."""
    finalizers = set(celery_state._on_app_finalizers)
    shop = Celery("claims_shop", broker="redis://127.0.0.1:1/0", set_as_current=False)
    try:

        @shop.task(base=LockedTask, lock_key="i", name="claims.shop.charge")
        def charge(i: int) -> int:
            return i

        mail = Celery("claims_mail", broker="amqp://guest@127.0.0.1:1//", set_as_current=False)
        mail.finalize()
    finally:  # the shared task would join every app the rest of the session finalizes
        celery_state._on_app_finalizers.intersection_update(finalizers)
    assert "claims.shop.charge" in mail.tasks  # Celery's sharing, not celery-lock's
    with pytest.raises(ConfigurationError) as raised:
        LockStep(SimpleNamespace(app=mail, task_events=False))
    assert str(raised.value).startswith("celery_lock_redis_url: not set, and the broker is not")
    # The first such task mail has: other tests' shared tasks may come before charge.
    named = str(raised.value).rsplit("(task ", 1)[-1].removesuffix(")")
    assert isinstance(mail.tasks.get(named), LockedTask), str(raised.value)


def test_a_request_class_not_derived_from_locked_request_is_warned_about_at_start() -> None:
    """monitoring.md: a task with a request class of its own should derive it from
    LockedRequest. One that does not sent no task-skipped, and its deferred copies took the
    task's serializer, without a word at start."""

    class Audited(Request):
        pass

    class AuditedLocked(LockedRequest):
        pass

    app = Celery("claims_request", broker="memory://", set_as_current=False)
    app.conf.celery_lock_redis_url = "redis://127.0.0.1:1/0"

    @app.task(base=LockedTask, lock_key="i", name="claims.own", shared=False, Request=Audited)
    def own(i: int) -> int:
        return i

    @app.task(base=LockedTask, lock_key="i", name="claims.derived", shared=False)
    def derived(i: int) -> int:
        return i

    derived.Request = AuditedLocked  # a class, as Celery also takes it
    warnings = [w for w in checks.warn_at_startup(app, {}) if "request class" in w]
    assert warnings == [
        "claims.own: its request class "
        "test_a_request_class_not_derived_from_locked_request_is_warned_about_at_start.<locals>."
        "Audited is not derived from celery_lock.request.LockedRequest: a skipped copy sends no "
        "task-skipped event (Flower shows it as SKIPPED without one), and a deferred copy is "
        "published with the task's serializer, not its message's"
    ]


# -- a beat entry whose ticks are all one done request ------------------------------------------


@pytest.fixture
def beat_app() -> Celery:
    app = Celery("claims_beat", broker="redis://127.0.0.1:1/0", set_as_current=False)

    @app.task(base=LockedTask, name="claims.beat.sweep", shared=False)
    def sweep() -> None: ...

    @app.task(base=LockedTask, name="claims.beat.brief", lock_done_ttl=60, shared=False)
    def brief() -> None: ...

    @app.task(base=LockedTask, name="claims.beat.clocked", shared=False,
              lock_key=lambda: str(time.time() // 300))  # fmt: skip
    def clocked() -> None: ...

    @app.task(name="claims.beat.plain", shared=False)
    def plain() -> None: ...

    return app


@pytest.mark.parametrize(
    "schedule",
    [300, 300.0, timedelta(minutes=5), celery_schedule(timedelta(minutes=5))],
    ids=["int", "float", "timedelta", "schedule"],
)
def test_a_beat_entry_within_its_tasks_done_ttl_is_warned_about(
    beat_app: Celery, schedule: Any
) -> None:
    """concepts.md, Periodic tasks: an entry's ticks are one request, so with the default done
    TTL (a day) every tick after the first run is skipped as done. It used to pass unsaid."""
    entry = {"task": "claims.beat.sweep", "schedule": schedule}
    beat_app.conf.beat_schedule = {"sweep-5min": entry}
    assert checks.beat_warnings(beat_app) == [
        "beat entry 'sweep-5min' sends claims.beat.sweep the same arguments every 300s, within "
        "its done TTL (86400s): its ticks are one request, and each tick after the first run is "
        "skipped as done. Set lock_done_ttl below the period for runs that must not overlap, or "
        "key the task by the period (docs/concepts.md, Periodic tasks)"
    ]
    assert checks.beat_warnings(beat_app)[0] in checks.warn_at_startup(beat_app, {})


@pytest.mark.parametrize(
    "entry",
    [
        {"task": "claims.beat.brief", "schedule": 300},  # done TTL below the period
        {"task": "claims.beat.clocked", "schedule": 300},  # keyed by a function: may read time
        {"task": "claims.beat.plain", "schedule": 300},  # not a LockedTask
        {"task": "claims.beat.sweep", "schedule": crontab(minute="*/5")},  # not an interval
        {"task": "elsewhere.unknown", "schedule": 300},  # a task this app does not have
    ],
    ids=["done-ttl-below-period", "key-function", "plain-task", "crontab", "unknown-task"],
)
def test_a_beat_entry_whose_ticks_can_run_is_not_warned_about(
    beat_app: Celery, entry: dict[str, Any]
) -> None:
    beat_app.conf.beat_schedule = {"entry": entry}
    assert checks.beat_warnings(beat_app) == []


# -- a scope whose tasks lock apart ------------------------------------------------------------


def test_a_scope_whose_tasks_lock_under_other_prefixes_or_stores_is_warned_about() -> None:
    """concepts.md, Scope: the tasks of a scope exclude each other only where their leases are
    one key in one store. A stage with a key prefix or a lock store of its own ran while the
    others held the request, and nothing said so."""
    app = Celery("claims_scope", broker="redis://127.0.0.1:1/0", set_as_current=False)
    options: dict[str, Any] = {"base": LockedTask, "shared": False, "lock_key": "order"}

    @app.task(name="claims.scope.pending", lock_scope="order", **options)
    def pending(order: int) -> None: ...

    @app.task(name="claims.scope.ship", lock_scope="order", **options)
    def ship(order: int) -> None: ...

    @app.task(name="claims.scope.billing", lock_scope="order", lock_key_prefix="bill", **options)
    def billing(order: int) -> None: ...

    @app.task(name="claims.scope.settle", lock_scope="order", **options,
              lock_redis_url="redis://:secret@127.0.0.1:2/0")  # fmt: skip
    def settle(order: int) -> None: ...

    @app.task(name="claims.scope.refund", lock_scope="order", **options,
              lock_redis_url="redis://127.0.0.1:1")  # fmt: skip
    def refund(order: int) -> None: ...  # the broker's database 0 too, written another way

    @app.task(name="claims.scope.audit", lock_scope="audit", lock_key_prefix="bill", **options)
    def audit(order: int) -> None: ...  # a scope of one task: nothing to share

    assert checks.scope_warnings(app) == [
        "the tasks of lock_scope 'order' do not share their leases: claims.scope.billing lock "
        "under key prefix 'bill' on redis://127.0.0.1:1/0; claims.scope.pending, "
        "claims.scope.refund, claims.scope.ship lock under key prefix 'celery-lock' on "
        "redis://127.0.0.1:1/0; "
        "claims.scope.settle lock under key prefix 'celery-lock' on redis://:***@127.0.0.1:2/0 "
        "(give them one lock_key_prefix and one lock store)"
    ]
    assert checks.scope_warnings(app)[0] in checks.warn_at_startup(app, {})
