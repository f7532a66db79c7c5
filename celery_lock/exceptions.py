"""Errors raised by celery-lock.

Every error the library raises on purpose derives from :class:`CeleryLockError`::

    CeleryLockError
    ├── ConfigurationError        a setting or task option has an invalid value
    ├── LockKeyError              the request key cannot be derived from a task's arguments
    ├── LockStoreError            the lock store (Redis) answered an error that is not transient
    │   ├── LockStoreUnavailableError
    │   │                         unreachable, or refusing for now, after bounded retries
    │   └── LockStateError        a key of the request holds a value celery-lock did not write
    ├── DuplicateTaskError        on_duplicate="raise" and another copy holds the request
    ├── LockContendedError        the request is held and an eager or direct call cannot defer
    ├── LockLostError             the lease of a running task expired or was taken over
    ├── ResultUnavailableError    follow(): a finished holder's result is not in the backend
    └── StaleFenceError           a fenced write carried a fence below the store's, or found
                                  no record to update
"""

from __future__ import annotations

from celery.exceptions import TimeoutError as CeleryTimeoutError

__all__ = [
    "CeleryLockError",
    "ConfigurationError",
    "DuplicateTaskError",
    "LockContendedError",
    "LockKeyError",
    "LockLostError",
    "LockStateError",
    "LockStoreError",
    "LockStoreUnavailableError",
    "ResultUnavailableError",
    "StaleFenceError",
]


class CeleryLockError(Exception):
    """Base class of every error celery-lock raises on purpose.

    Each error keeps its constructor arguments in ``args``, so Celery can rebuild it from a
    result backend and ``AsyncResult.get()`` raises the same type the worker raised.
    """


class ConfigurationError(CeleryLockError, ValueError):
    """A setting or task option has an invalid value.

    Args:
        setting: the setting's name as the user wrote it (``celery_lock_ttl``, ``lock_ttl``,
            ``--lock-ttl``), so the message points at what to change.
        problem: what is wrong with its value.
    """

    def __init__(self, setting: str, problem: str = "") -> None:
        super().__init__(setting, problem)
        self.setting = setting
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.setting}: {self.problem}"


class LockKeyError(CeleryLockError, ValueError):
    """The request key cannot be derived from the task's arguments.

    Raised at class creation when ``lock_key`` names no argument of the task, and at publish
    or call time when a call lacks the arguments the key is made of.

    Args:
        message: what is wrong with the key or the call.
        task_name: the task whose key it is, when known.
    """

    # ``task_name`` is positional too, and kept in ``args``: a JSON result backend rebuilds an
    # error as ``cls(*args)``, so an attribute kept only by keyword would come back ``None``.
    def __init__(self, message: str, task_name: str | None = None) -> None:
        super().__init__(message, task_name)
        self.task_name = task_name

    def __str__(self) -> str:
        message = str(self.args[0])
        return f"{self.task_name}: {message}" if self.task_name else message


class LockStoreError(CeleryLockError):
    """The lock store failed or answered an error; raised as such for an error reply that is
    neither transient nor about the request's keys (``NOPERM``, an unknown command), and for a
    wrong user or password (``WRONGPASS``, ``NOAUTH``).

    A task meeting one fails: trying again later would not help.

    Args:
        message: what the store answered, or what failed.
        lock_name: the lock's Redis key, when the error is about one request.
    """

    # Positional too, and kept in ``args``, for the reason given at LockKeyError.
    def __init__(self, message: str, lock_name: str | None = None) -> None:
        super().__init__(message, lock_name)
        self.lock_name = lock_name

    def __str__(self) -> str:
        message = str(self.args[0])
        return f"{message} (lock {self.lock_name})" if self.lock_name else message


class LockStoreUnavailableError(LockStoreError):
    """The lock store stayed unreachable, or kept refusing for now (``LOADING``, ``READONLY``,
    ``OOM``, ``BUSY``, ...), for every one of a bounded number of jittered tries.

    A task meeting one is deferred (fail closed) or, with ``celery_lock_fail_open``, runs
    unlocked.
    """


class LockStateError(LockStoreError):
    """A key of the request holds a value celery-lock did not write: the lock is not a string
    of the form celery-lock writes (or has no TTL), the fence counter is not an integer, the
    done-marker is not a string.

    Trying again cannot help, and running unlocked is not safe: a task meeting one fails
    (even with ``celery_lock_fail_open``). Delete or repair the key named by ``key``.

    Args:
        message: what the key holds instead.
        lock_name: the lock's Redis key.
        key: the key that holds the foreign value.
    """

    def __init__(self, message: str, lock_name: str | None = None, key: str | None = None) -> None:
        super().__init__(message, lock_name)
        self.args = (message, lock_name, key)  # all three, so ``cls(*args)`` rebuilds it
        self.key = key


class DuplicateTaskError(CeleryLockError):
    """Another copy of the same task holds the request (policy ``on_duplicate="raise"``)."""

    def __init__(self, lock_name: str, holder: str = "") -> None:
        super().__init__(lock_name, holder)
        self.lock_name = lock_name
        self.holder = holder

    def __str__(self) -> str:
        return f"request {self.lock_name} is already running as task {self.holder}"


class LockContendedError(CeleryLockError):
    """The request is held and this call cannot be deferred (eager mode or a direct call).

    ``enclosing``: the holder is a call this one was made inside, in the same thread (an eager
    or direct call from the body of a task holding the same request), which only ends after
    this call does.
    """

    def __init__(self, lock_name: str, holder: str = "", enclosing: bool = False) -> None:
        super().__init__(lock_name, holder, enclosing)
        self.lock_name = lock_name
        self.holder = holder
        self.enclosing = enclosing

    def __str__(self) -> str:
        holder = f"task {self.holder}" if self.holder else "a direct call"
        if self.enclosing:
            return (
                f"request {self.lock_name} is held by {holder}, which this call was made "
                f"inside (an eager or direct call in its body); it cannot wait for its own "
                f"caller: publish it to a worker (delay, not eagerly), which defers it until "
                f"the body ends; test such a chain with a worker"
            )
        return f"request {self.lock_name} is held by {holder}; cannot defer this call"


class LockLostError(CeleryLockError):
    """The lease of a running task expired or was taken over by another holder."""

    def __init__(self, lock_name: str) -> None:
        super().__init__(lock_name)
        self.lock_name = lock_name

    def __str__(self) -> str:
        return f"lease on {self.lock_name} was lost while the task ran"


class ResultUnavailableError(CeleryLockError, CeleryTimeoutError):
    """:func:`~celery_lock.follow` reached a holder whose result will not come.

    The holder completed the request (its done-marker names it), but its result did not reach
    the result backend within ``follow``'s grace period: the task ignores its result, the
    result expired, or the holder died between completing and storing it. A subclass of
    Celery's ``TimeoutError``, which is what ``follow`` raised before it could tell.

    Args:
        task_id: the holder's task id.
        lock_name: the lock's Redis key.
    """

    def __init__(self, task_id: str, lock_name: str) -> None:
        super().__init__(task_id, lock_name)
        self.task_id = task_id
        self.lock_name = lock_name

    def __str__(self) -> str:
        return (
            f"task {self.task_id} completed {self.lock_name} but its result is not in the "
            "result backend: it ignores results, they expired, or it died before storing one"
        )


class StaleFenceError(CeleryLockError):
    """A fenced write was refused: it carried a fence smaller than one the store has already
    accepted, or (``missing``) the record it was to update does not exist.

    A smaller fence means the writer's lease was lost and a later holder of the request has
    written since.

    Args:
        record: the record written to (a Redis key, or ``table:key`` for SQL).
        fence: the writer's fence.
        current: the stored fence that outranks it, when known.
        missing: the record does not exist (:func:`~celery_lock.fenced_update` found no row).
        detail: why the write was refused, where the stored fence cannot say it: a refusal
            :func:`~celery_lock.fenced_update` cannot explain from the row as its transaction
            reads it, or a missing row (which may be one committed after the snapshot). The
            message is then this.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        record: str,
        fence: int,
        current: int | None = None,
        missing: bool = False,
        detail: str | None = None,
    ) -> None:
        super().__init__(record, fence, current, missing, detail)
        self.record = record
        self.fence = fence
        self.current = current
        self.missing = missing
        self.detail = detail

    def __str__(self) -> str:
        if self.detail:
            return f"fenced write with fence {self.fence} refused: {self.detail}"
        if self.missing:
            return (
                f"fenced write with fence {self.fence} refused: {self.record} does not exist "
                "(insert rows before fenced updates)"
            )
        stored = "a newer one" if self.current is None else str(self.current)
        return f"stale fence {self.fence} for {self.record}: the store holds {stored}"
