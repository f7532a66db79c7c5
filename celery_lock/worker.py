"""Wiring celery-lock into an app: worker options, a worker bootstep, process signals.

``install(app)`` is idempotent. Binding a :class:`~celery_lock.LockedTask` to an app calls it, but
a task binds only when the app finalizes, after ``celery worker`` has read its command line: call
``install(app)`` in the module that creates the app to get the worker options::

    app = Celery("shop")
    celery_lock.install(app)

    $ celery -A shop worker --lock-redis-url redis://locks:6379/0 --lock-ttl 30 \
        --lock-on-duplicate retry
"""

from __future__ import annotations

import atexit
import functools
import logging
import re
import weakref
from collections import ChainMap
from collections.abc import Mapping
from typing import Any

import click
from celery import Celery, bootsteps
from celery import _state as celery_state
from celery.app import utils as celery_app_utils
from celery.signals import (
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_shutdown,
)

from .canvas import STEP_OPTIONS, check_later_steps
from .checks import bodies_per_process, store_prefixes, warn_at_startup
from .config import DUPLICATE_POLICIES, LockSettings, check_value
from .events import wait_for_events_apart
from .exceptions import ConfigurationError
from .runtime import get_runtime, reset_runtime
from .store import LockStore

__all__ = ["LockStep", "install"]

logger = logging.getLogger(__name__)

_INSTALLED = "_celery_lock_installed"

#: The apps whose releases left for later this process settles as it exits.
_SETTLED_AT_EXIT: weakref.WeakSet[Celery] = weakref.WeakSet()

#: Worker command-line option -> the ``app.conf`` setting it overrides for that worker.
WORKER_OPTIONS = {
    "lock_redis_url": "celery_lock_redis_url",
    "lock_ttl": "celery_lock_ttl",
    "lock_on_duplicate": "celery_lock_on_duplicate",
}


class LockStep(bootsteps.Step):
    """Worker bootstep: applies ``--lock-*`` options and checks the settings before the pool forks.

    An invalid setting stops the worker here, before it consumes a message.
    """

    name = "celery-lock"

    def __init__(self, parent: Any, **options: Any) -> None:
        try:
            flags = self._start(parent, options)
            super().__init__(parent, **options)
            bodies = bodies_per_process(
                getattr(parent, "pool_cls", None), getattr(parent, "concurrency", None) or 1
            )
            self._check(parent.app, bodies, flags)
        except ConfigurationError as exc:
            if click.get_current_context(silent=True) is None:
                raise  # a worker started from Python (app.Worker, start_worker): a typed error
            # From `celery worker`: one line naming the setting, exit status 1, as Click
            # reports an error, rather than a traceback.
            raise click.ClickException(f"celery-lock: {exc}") from exc

    @staticmethod
    def _start(parent: Any, options: dict[str, Any]) -> dict[str, str]:
        """Apply the worker options to the app's settings, and resolve them; return the
        settings the options set, each with its option's flag."""
        app: Celery = parent.app
        given: dict[str, tuple[str, Any]] = {}  # setting -> (option's flag, its value)
        for option, setting in WORKER_OPTIONS.items():
            value = options.get(option)
            if value is not None:
                flag = "--" + option.replace("_", "-")
                given[setting] = (flag, check_value(option.removeprefix("lock_"), value, flag))
        _check_options_fit(app, given)
        for setting, (_, value) in given.items():
            app.conf[setting] = value
        # Task.send_event would force events on; celery-lock sends them only with -E.
        if getattr(parent, "task_events", None) is not None:
            app.conf.worker_send_task_events = bool(parent.task_events)
        LockSettings.resolve(app.conf)
        reset_runtime(app)
        return {setting: flag for setting, (flag, _) in given.items()}

    @staticmethod
    def _check(app: Celery, bodies: int, flags: Mapping[str, str]) -> None:
        """Warn about settings that contradict the guarantees (see :mod:`celery_lock.checks`);
        ``bodies``: how many task bodies a worker process runs at once; ``flags``: the settings
        worker options set, each with its option's flag."""
        stores = {url: LockStore.from_url(url) for url in store_prefixes(app)}
        try:
            warn_at_startup(app, stores, bodies, flags)
        finally:
            for store in stores.values():
                store.close()
        reset_runtime(app)  # no connection of the main process crosses the fork


def _first_problem(app: Celery, conf: Mapping[str, Any]) -> ConfigurationError | None:
    """The first invalid combination in the settings of the app and its tasks, read from
    ``conf``, or ``None``."""
    from .task import LockedTask  # noqa: PLC0415 - task imports this module

    try:
        LockSettings.resolve(conf)
        for task in app.tasks.values():
            if isinstance(task, LockedTask):
                LockSettings.resolve(conf, task._lock_task_options(), task.name)
    except ConfigurationError as exc:
        return exc
    return None


def _check_options_fit(app: Celery, given: Mapping[str, tuple[str, Any]]) -> None:
    """Refuse worker options that contradict the app's settings or task options (``--lock-ttl
    5`` under ``celery_lock_heartbeat_interval = 10``) with a one-line usage error naming both,
    as Click reports a bad value (exit status 2), rather than a traceback naming the setting
    alone. A contradiction within the app's own settings is left to the checks that follow.

    Raises:
        click.BadParameter: the settings are valid without the options, but not with them
            (:class:`ConfigurationError` naming the options, for a worker started from Python).
    """
    if not given:
        return
    overrides = {setting: value for setting, (_, value) in given.items()}
    problem = _first_problem(app, ChainMap(overrides, app.conf))
    if problem is None or _first_problem(app, app.conf) is not None:
        return
    # The options that, left out alone, make the settings valid again; else all of them.
    culprits = [
        setting
        for setting in overrides
        if _first_problem(
            app, ChainMap({k: v for k, v in overrides.items() if k != setting}, app.conf)
        )
        is None
    ] or list(overrides)
    # The options are in the settings they override: name them as they were given.
    conflict = str(problem)
    for setting, (flag, _) in given.items():
        conflict = re.sub(rf"\b{re.escape(setting)}\b", flag, conflict)
    message = f"{', '.join(f'{given[s][1]!r}' for s in culprits)} conflicts with {conflict}"
    ctx = click.get_current_context(silent=True)
    if ctx is None:  # a worker started from Python (app.Worker, start_worker): a typed error
        raise ConfigurationError(" / ".join(given[s][0] for s in culprits), message)
    raise click.BadParameter(message, ctx=ctx, param_hint=[given[s][0] for s in culprits])


def _checked(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Check an option's value as the bootstep will, so a bad one is a one-line usage error
    (``Invalid value for '--lock-ttl': ...``, exit status 2) rather than a traceback."""
    if value is None or param.name is None:
        return value
    flag = "--" + param.name.replace("_", "-")
    try:
        return check_value(param.name.removeprefix("lock_"), value, flag)
    except ConfigurationError as exc:
        raise click.BadParameter(exc.problem, ctx=ctx, param=param) from exc


def _worker_options() -> list[click.Option]:
    return [
        click.Option(
            ["--lock-redis-url"],
            callback=_checked,
            help="celery-lock: lock store URL (redis://...).",
        ),
        click.Option(
            ["--lock-ttl"], type=float, callback=_checked, help="celery-lock: lease TTL in seconds."
        ),
        click.Option(
            ["--lock-on-duplicate"],
            type=click.Choice(DUPLICATE_POLICIES),
            help="celery-lock: what a copy does when another copy runs.",
        ),
    ]


def install(app: Celery) -> Celery:
    """Add the worker options and bootstep, start/stop the heartbeat with pool processes, and
    check a call's later steps when it is published (:mod:`celery_lock.canvas`).

    Returns the app, so it can be used inline. Calling it again does nothing.
    """
    if app.__dict__.get(_INSTALLED):
        return app
    setattr(app, _INSTALLED, True)
    app.user_options["worker"].update(_worker_options())
    app.steps["worker"].add(LockStep)
    _check_later_steps_at_publish(app)

    # The receivers are the process's, but the signals do not say which app's worker sent
    # them: they hold the app weakly and leave alone an app that was closed (a test's app,
    # closed by its fixture). Held strongly, every app a test suite installed would live for
    # ever, and each later in-process worker would start a heartbeat thread for each of them
    # that nothing stops.
    app_ref = weakref.ref(app)

    def start_heartbeat(**_: Any) -> None:
        running = app_ref()
        if running is not None and _is_open(running):
            get_runtime(running).heartbeat.start()

    def stop_heartbeat(**_: Any) -> None:
        # A body cut short (revoke(terminate=True), a shutdown that stops waiting) releases its
        # lease in LockedTask's finally: billiard turns SIGTERM into an exception in pool
        # processes. Anything still held is handed back here, so a message that comes back
        # (shutdown, late ack) runs at once rather than after a TTL.
        running = app_ref()
        if running is None:
            return
        heartbeat = get_runtime(running).heartbeat
        heartbeat.hand_back()
        heartbeat.stop()
        wait_for_events_apart(5.0)  # a task-lock-lost still on its way

    def settle_releases(**_: Any) -> None:
        running = app_ref()
        if running is not None and _is_open(running):
            get_runtime(running).heartbeat.settle_releases()
            wait_for_events_apart(5.0)  # a task-skipped or task-lock-lost still on its way

    def settle_releases_at_exit(**_: Any) -> None:
        # Solo, threads, gevent and eventlet run the bodies in the worker's own process, which
        # sends no worker_process_shutdown: a release its store refused for now is tried as
        # the process exits (after Python has joined a threads pool's bodies), and at
        # worker_shutdown too. Celery sends that on a warm shutdown only, but a restart
        # (SIGHUP) execs the new worker from an atexit hook of its own, which runs before this
        # one. Settled twice, the second finds nothing. A prefork worker's main process has
        # none to try.
        running = app_ref()
        if running is not None and running not in _SETTLED_AT_EXIT:
            _SETTLED_AT_EXIT.add(running)
            atexit.register(settle_releases)

    uid = f"celery-lock-{id(app)}"
    worker_process_init.connect(start_heartbeat, weak=False, dispatch_uid=f"{uid}-init")
    worker_process_shutdown.connect(stop_heartbeat, weak=False, dispatch_uid=f"{uid}-shutdown")
    worker_init.connect(settle_releases_at_exit, weak=False, dispatch_uid=f"{uid}-worker-init")
    worker_shutdown.connect(settle_releases, weak=False, dispatch_uid=f"{uid}-worker-shutdown")
    # Once the app is gone its id may name a new app, whose receivers a dispatch_uid still
    # registered would keep out.
    weakref.finalize(app, _disconnect, uid)
    return app


def _check_later_steps_at_publish(app: Celery) -> None:
    """Have ``app.send_task``, which every ``apply_async`` publishes through, whatever the
    first step's task class, check the call's later steps first (:func:`check_later_steps`).

    In ``send_task`` because Celery offers no hook that can refuse a publish: an exception
    raised by a ``before_task_publish`` receiver is logged, and the message sent all the same.
    A call with a parent (a ``parent_id`` given, or published from a running task) is left
    alone: its later steps are the rest of a canvas a worker passes on (the next step of a
    chain, a chord's body, a replacement), which the caller that published the canvas checked,
    and an error raised there would fail the step that has run, not the one that cannot. So is
    a retry (``retries`` given), the same call again: under Celery 5.7's
    ``task_retry_on_worker_lost`` the worker's main process publishes a killed step's retry,
    and an error there would fail that step rather than retry it.

    The check then publishes through the ``send_task`` the app's class has at that moment, not
    the one it had here: a wrapper the class gets later (sentry-sdk's, at ``sentry_sdk.init``)
    or a test's ``mock.patch.object(Celery, "send_task")`` still takes every call. One set on
    the app itself before this is kept.
    """
    own = app.__dict__.get("send_task")

    @functools.wraps(app.send_task)
    def send_task_checked(name: str, *args: Any, **options: Any) -> Any:
        # A call without later steps, most of them, is let through at the cost of four dict
        # reads (map, not a generator, whose frame costs more than the reads), before the
        # parent is looked for (app.current_worker_task walks a stack).
        if (
            any(map(options.get, STEP_OPTIONS))
            and not options.get("parent_id")
            and not options.get("retries")
            and app.current_worker_task is None
        ):
            check_later_steps(app, options)
        send_task = own if own is not None else _class_send_task(app)
        return send_task(name, *args, **options)

    app.send_task = send_task_checked  # type: ignore[method-assign]


def _class_send_task(app: Celery) -> Any:
    """``app.send_task`` as the app's class defines it now, bound to ``app``: found past the
    app's own attribute, as Python's lookup would find it without that."""
    for klass in type(app).__mro__:
        if "send_task" in vars(klass):
            send_task = vars(klass)["send_task"]
            bind = getattr(type(send_task), "__get__", None)  # a function; not a mock
            return send_task if bind is None else bind(send_task, app, type(app))
    raise AttributeError(f"{type(app).__name__} has no send_task")  # not a Celery app


def _disconnect(uid: str) -> None:
    worker_process_init.disconnect(dispatch_uid=f"{uid}-init")
    worker_process_shutdown.disconnect(dispatch_uid=f"{uid}-shutdown")
    worker_init.disconnect(dispatch_uid=f"{uid}-worker-init")
    worker_shutdown.disconnect(dispatch_uid=f"{uid}-worker-shutdown")


def _is_open(app: Celery) -> bool:
    """Whether ``app`` has not been closed (``Celery.close`` deregisters it)."""
    return app in celery_state._get_active_apps()  # type: ignore[attr-defined]


def _hide_lock_store_url_in_reports() -> None:
    """Mask ``celery_lock_redis_url`` wherever Celery masks secret settings.

    ``celery inspect conf`` (Flower's worker configuration tab) and ``celery report`` show
    ``app.conf`` with the settings whose names match Celery's ``HIDDEN_SETTINGS`` masked; the
    lock store URL, which may hold a password as the broker URL does, matched none of them.
    Done when this module is imported, not by :func:`install`: ``celery report`` never
    finalizes the app, so no task binds to install celery-lock.
    """
    # celery-types does not declare HIDDEN_SETTINGS; filter_hidden_settings reads it per call.
    hidden: re.Pattern[str] = celery_app_utils.HIDDEN_SETTINGS  # type: ignore[attr-defined]
    if "LOCK_REDIS_URL" not in hidden.pattern:
        celery_app_utils.HIDDEN_SETTINGS = re.compile(  # type: ignore[attr-defined]
            f"{hidden.pattern}|LOCK_REDIS_URL", hidden.flags
        )


_hide_lock_store_url_in_reports()
