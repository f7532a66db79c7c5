"""What a caller gets back from the result backend: :func:`follow` on a skipped copy, and
celery-lock's errors as ``AsyncResult.get()`` rebuilds them from a stored failure.

The follow tests play the worker's part by hand: the skipped copy's meta and the holder's state
go straight into the in-process result backend, the done-marker into the session's Redis through
:class:`LockStore`'s own scripts. No worker runs, so each test pins exactly what ``follow`` sees.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery._state import _set_task_join_will_block
from celery.backends.base import KeyValueStoreBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult, GroupResult
from celery.states import STARTED

from celery_lock import (
    SKIPPED,
    CeleryLockError,
    ConfigurationError,
    DuplicateTaskError,
    LockContendedError,
    LockedTask,
    LockKeyError,
    LockLostError,
    LockStateError,
    LockStoreError,
    LockStoreUnavailableError,
    ResultUnavailableError,
    StaleFenceError,
    follow,
    is_skipped,
)
from celery_lock.keys import RequestKeys
from celery_lock.lease import Acquired, Holder, Lease, new_token
from celery_lock.runtime import reset_runtime
from celery_lock.states import skipped_marker
from celery_lock.store import LockStore

TIMEOUT = 10
pytestmark = pytest.mark.usefixtures("close_lock_runtime")
TASK = "r.process"
KEYS = RequestKeys.build("celery-lock", TASK, "7", TASK)


def skipped_copy(app: Celery, holder: str, reason: str = "running") -> AsyncResult[Any]:
    """A copy skipped because ``holder`` held (or had completed) request 7 of ``r.process``."""
    copy_id = new_token()
    app.backend.store_result(copy_id, skipped_marker(KEYS.lock, reason, holder, TASK), SKIPPED)
    return AsyncResult(copy_id, app=app)


def complete(store: LockStore, holder: str) -> None:
    """Take request 7's lease as ``holder`` and release it as a success: its done-marker."""
    token = new_token()
    outcome = store.acquire(KEYS, token, 60_000, Holder(holder, TASK, "elsewhere", 1), 60_000)
    assert isinstance(outcome, Acquired)
    lease = Lease(store, KEYS, token, 60_000, outcome.fence, Holder(holder, TASK, "elsewhere", 1))
    store.release(lease, success=True, done_ttl_ms=60_000)


# -- follow -----------------------------------------------------------------------------------


class _OwnBackend(KeyValueStoreBackend):
    """A task's result backend of its own (``@app.task(backend=...)``), apart from the app's."""

    def __init__(self, app: Celery) -> None:
        super().__init__(app=app)
        self.data: dict[Any, Any] = {}

    def get(self, key: Any) -> Any:
        return self.data.get(key)

    def mget(self, keys: Any) -> list[Any]:
        return [self.data.get(key) for key in keys]

    def set(self, key: Any, value: Any) -> None:
        self.data[key] = value

    def delete(self, key: Any) -> None:
        self.data.pop(key, None)


def test_follow_finds_the_holder_in_the_result_backend_of_the_copy(celery_app: Celery) -> None:
    # The app's backend knows neither task: asked there, follow waited for ever.
    own = _OwnBackend(celery_app)
    own.store_result("holder-id", "processed 7", "SUCCESS")
    copy_id = new_token()
    own.store_result(copy_id, skipped_marker(KEYS.lock, "running", "holder-id", TASK), SKIPPED)
    copy: AsyncResult[Any] = AsyncResult(copy_id, backend=own, app=celery_app)
    assert follow(copy, timeout=TIMEOUT, interval=0.05) == "processed 7"


def test_follow_refuses_a_group_s_result(celery_app: Celery) -> None:
    # A GroupResult has no state of its own: follow failed on a missing private method.
    group_result = GroupResult("group-id", [AsyncResult("a", app=celery_app)], app=celery_app)
    with pytest.raises(TypeError, match="follow each of its results"):
        follow(group_result, timeout=TIMEOUT)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argument", "error", "problem"),
    [
        ({"timeout": float("nan")}, ValueError, "timeout must be 0 or more seconds"),
        ({"timeout": -1}, ValueError, "timeout must be 0 or more seconds"),
        ({"interval": 0}, ValueError, "interval must be more than 0 seconds"),
        ({"interval": -1}, ValueError, "interval must be more than 0 seconds"),
        ({"interval": "0.1"}, TypeError, "interval must be a number of seconds"),
        ({"grace": "x"}, TypeError, "grace must be a number of seconds"),
        ({"grace": float("inf")}, ValueError, "grace must be 0 or more seconds"),
        ({"max_hops": -1}, ValueError, "max_hops must be 0 or more"),
        ({"max_hops": 2.5}, TypeError, "max_hops must be a whole number"),
    ],
    ids=lambda value: repr(value) if isinstance(value, dict) else "",
)
def test_follow_refuses_an_argument_it_cannot_wait_with_before_any_wait(
    celery_app: Celery, argument: dict[str, Any], error: type[Exception], problem: str
) -> None:
    # A result that already succeeded: without the check, max_hops=-1 raised TimeoutError
    # for it, timeout=nan waited on others for ever, and interval=0 polled without a pause.
    result = AsyncResult("done-already", app=celery_app)
    celery_app.backend.store_result(result.id, 7, "SUCCESS")
    with pytest.raises(error, match=f"follow\\(\\) {problem}"):
        follow(result, **argument)


def test_follow_returns_none_at_once_for_a_call_that_ignores_its_result(celery_app: Celery) -> None:
    @celery_app.task(base=LockedTask, lock_key="request_idx", name="r.quiet", shared=False)
    def quiet(request_idx: int) -> int:
        return request_idx

    result = quiet.apply_async((7,), ignore_result=True)  # no state will ever be stored
    assert result.get(timeout=TIMEOUT) is None  # as Celery does
    assert follow(result, timeout=TIMEOUT) is None


def test_follow_returns_an_eager_call_s_value_at_once(celery_app: Celery) -> None:
    @celery_app.task(base=LockedTask, lock_key="request_idx", name="r.eager", shared=False)
    def eager(request_idx: int) -> int:
        return request_idx * 2

    first = eager.apply((7,))
    assert follow(first, timeout=TIMEOUT) == 14  # an EagerResult: ready as made
    skipped = eager.apply((7,))  # done: state IGNORED, which is no ready state
    # The holder's result is stored nowhere: None, as get(), with no waiting.
    assert follow(skipped, timeout=1) == skipped.get() is None
    # The skip is the result (no marker dict, as a worker stores): is_skipped tells it too.
    assert is_skipped(skipped.result)
    assert (skipped.result.reason, skipped.result.holder) == ("done", first.id)
    assert not is_skipped(follow(eager.apply((8,)), timeout=1))


@pytest.mark.celery(task_store_eager_result=True)
def test_follow_leads_from_an_eager_copy_skipped_to_its_holder_s_stored_result(
    celery_app: Celery,
) -> None:
    # It returned None, as the copy's get() does, though the skip names its holder and the
    # holder's result was in the backend.
    @celery_app.task(base=LockedTask, lock_key="request_idx", name="r.stored", shared=False)
    def stored(request_idx: int) -> int:
        return request_idx * 3

    first = stored.apply((7,))
    skipped = stored.apply((7,))
    assert skipped.state == "IGNORED"
    assert follow(skipped, timeout=1) == follow(first, timeout=1) == 21

    # A task with a result backend of its own stores its eager results there.
    @celery_app.task(base=LockedTask, lock_key="request_idx", name="r.own", shared=False,
                     backend=_OwnBackend(celery_app))  # fmt: skip
    def own(request_idx: int) -> int:
        return request_idx * 5

    own.apply((7,))
    assert follow(own.apply((7,)), timeout=1) == 35


def test_follow_of_an_eager_copy_skipped_does_not_read_a_backend_eager_results_skip(
    lock_url: str,
) -> None:
    # Eager tests often configure a result backend that is not running: without
    # task_store_eager_result nothing is stored there, and follow() must not go and look.
    app = Celery("eager_unread", broker="memory://", backend="redis://127.0.0.1:1/0",
                 set_as_current=False)  # fmt: skip
    app.conf.celery_lock_redis_url = lock_url

    @app.task(base=LockedTask, lock_key="request_idx", name="r.unread", shared=False)
    def unread(request_idx: int) -> int:
        return request_idx

    try:
        unread.apply((7,))
        assert follow(unread.apply((7,)), timeout=1) is None
    finally:
        reset_runtime(app)
        app.close()


def test_follow_inside_a_task_refuses_before_it_waits(celery_app: Celery) -> None:
    # It polled the holder first and refused only in its last get(): a pool process held for
    # the holder's whole run, or a TimeoutError where the docs promise Celery's RuntimeError.
    celery_app.backend.store_result("busy-id", {"pid": 1}, STARTED)
    copy = skipped_copy(celery_app, "busy-id")
    _set_task_join_will_block(True)  # as in a worker's pool process
    try:
        with pytest.raises(RuntimeError, match=r"Never call result\.get"):
            follow(copy, timeout=3, interval=0.05)  # was: a TimeoutError after 3 s
        with pytest.raises(CeleryTimeoutError):  # allowed to wait, it does
            follow(copy, timeout=0.3, interval=0.05, disable_sync_subtasks=False)
    finally:
        _set_task_join_will_block(False)


def test_follow_gives_up_on_a_started_holder_that_completed_but_stored_no_result(
    celery_app: Celery, store: LockStore
) -> None:
    # task_track_started: the holder stored STARTED, wrote its done-marker, and was killed
    # before it stored its result. Its state stays STARTED for ever.
    celery_app.backend.store_result("started-id", {"pid": 1}, STARTED)
    complete(store, "started-id")
    copy = skipped_copy(celery_app, "started-id")
    with pytest.raises(ResultUnavailableError) as caught:
        follow(copy, timeout=TIMEOUT, interval=0.05, grace=0.3)
    assert (caught.value.task_id, caught.value.lock_name) == ("started-id", KEYS.lock)


def test_follow_waits_for_a_started_holder_that_has_not_completed(
    celery_app: Celery, store: LockStore
) -> None:
    celery_app.backend.store_result("running-id", {"pid": 1}, STARTED)
    copy = skipped_copy(celery_app, "running-id")
    with pytest.raises(CeleryTimeoutError) as caught:
        follow(copy, timeout=0.8, interval=0.05, grace=0.1)
    assert not isinstance(caught.value, ResultUnavailableError)


@pytest.fixture
def amqp_producer() -> Iterator[Celery]:
    """A producer whose broker is RabbitMQ, with the lock store's URL given only to workers."""
    app = Celery(
        "amqp_producer",
        broker="amqp://guest:guest@127.0.0.1:1//",
        backend="cache+memory://",
        set_as_current=False,
    )
    yield app
    reset_runtime(app)
    app.close()


def test_follow_warns_once_when_the_app_cannot_tell_where_the_lock_store_is(
    amqp_producer: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    # Waiting cannot learn that the holder completed without storing a result: follow says
    # why it waits, once, instead of waiting in silence.
    copy = skipped_copy(amqp_producer, "quiet-id")
    with caplog.at_level("WARNING", logger="celery_lock"):
        for _ in range(2):  # once per app and process: follow may run on every web request
            with pytest.raises(CeleryTimeoutError):
                follow(copy, timeout=0.4, interval=0.05, grace=0.1)
    [warning] = [r.getMessage() for r in caplog.records if "cannot tell" in r.getMessage()]
    assert "quiet-id" in warning
    assert "celery_lock_redis_url" in warning


def test_follow_without_a_lock_store_still_returns_a_holder_s_stored_result(
    amqp_producer: Celery,
) -> None:
    # The holder is still running when follow() first looks, and stores its result later.
    amqp_producer.backend.store_result("holder-id", {"pid": 1}, STARTED)
    copy = skipped_copy(amqp_producer, "holder-id")
    finishing = threading.Timer(0.5, amqp_producer.backend.mark_as_done, ("holder-id", 42))
    finishing.start()
    try:
        assert follow(copy, timeout=TIMEOUT, interval=0.05, grace=0.1) == 42
    finally:
        finishing.cancel()
        finishing.join(TIMEOUT)


def test_follow_keeps_waiting_while_the_lock_store_is_unreachable(celery_app: Celery) -> None:
    celery_app.conf.celery_lock_redis_url = "redis://127.0.0.1:1/0"  # nothing listens there
    copy = skipped_copy(celery_app, "quiet-id")
    with pytest.raises(CeleryTimeoutError) as caught:
        follow(copy, timeout=0.5, interval=0.05, grace=0.1)
    assert not isinstance(caught.value, ResultUnavailableError)


# -- errors through a result backend ----------------------------------------------------------

#: One of every error, each with every constructor argument set.
ERRORS: list[CeleryLockError] = [
    ConfigurationError("celery_lock_ttl", "must be positive"),
    LockKeyError("the call lacks request_idx", task_name="shop.process"),
    LockStoreError("NOPERM", lock_name="celery-lock:{shop.process:7}:lock"),
    LockStoreUnavailableError("acquire failed", lock_name="celery-lock:{shop.process:7}:lock"),
    LockStateError(
        "the fence is not an integer",
        lock_name="celery-lock:{shop.process:7}:lock",
        key="celery-lock:{shop.process:7}:fence",
    ),
    DuplicateTaskError("celery-lock:{shop.process:7}:lock", "holder-id"),
    LockContendedError("celery-lock:{shop.process:7}:lock", "holder-id"),
    LockContendedError("celery-lock:{shop.process:7}:lock", "holder-id", enclosing=True),
    LockLostError("celery-lock:{shop.process:7}:lock"),
    ResultUnavailableError("holder-id", "celery-lock:{shop.process:7}:lock"),
    StaleFenceError("orders:7", 3, 5),
    StaleFenceError("orders:8", 3, missing=True),
    StaleFenceError("orders:9", 3, detail="another transaction changed it"),
]
ERROR_IDS = [f"{type(error).__name__}-{i}" for i, error in enumerate(ERRORS)]


def same_error(rebuilt: BaseException, error: CeleryLockError) -> None:
    assert type(rebuilt) is type(error)
    assert vars(rebuilt) == vars(error)  # every attribute, as the worker raised it
    assert rebuilt.args == error.args
    assert str(rebuilt) == str(error)


@pytest.mark.parametrize("serializer", ["json", "pickle"])
@pytest.mark.parametrize("error", ERRORS, ids=ERROR_IDS)
def test_error_keeps_its_attributes_through_a_result_backend(
    error: CeleryLockError, serializer: str
) -> None:
    app = Celery("errors", backend="cache+memory://", set_as_current=False)
    app.conf.result_serializer = serializer
    app.conf.result_accept_content = ["json", "pickle"]
    try:
        backend = app.backend
        stored = backend.encode(backend.prepare_exception(error))
        same_error(backend.exception_to_python(backend.decode(stored)), error)
    finally:
        app.close()


@pytest.mark.parametrize("error", ERRORS, ids=ERROR_IDS)
def test_error_keeps_its_attributes_through_pickle(error: CeleryLockError) -> None:
    same_error(pickle.loads(pickle.dumps(error)), error)


def test_errors_keep_their_messages() -> None:
    assert str(ERRORS[1]) == "shop.process: the call lacks request_idx"
    assert str(LockKeyError("no such argument")) == "no such argument"
    assert str(ERRORS[2]) == "NOPERM (lock celery-lock:{shop.process:7}:lock)"
    assert str(ERRORS[4]) == "the fence is not an integer (lock celery-lock:{shop.process:7}:lock)"
