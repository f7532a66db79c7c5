"""celery-lock: effectively-once Celery tasks with per-request Redis leases.

See :mod:`celery_lock.task` for the user guide.
"""

from importlib.metadata import PackageNotFoundError, version

from . import signals
from .canvas import check_canvas
from .config import LockSettings
from .exceptions import (
    CeleryLockError,
    ConfigurationError,
    DuplicateTaskError,
    LockContendedError,
    LockKeyError,
    LockLostError,
    LockStateError,
    LockStoreError,
    LockStoreUnavailableError,
    ResultUnavailableError,
)
from .fencing import FencedRedis, StaleFenceError, fenced_set, fenced_update
from .request import LockedRequest
from .result import follow
from .states import SKIPPED, is_skipped
from .task import LockedTask
from .worker import install

try:
    __version__ = version("celery-lock")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "SKIPPED",
    "CeleryLockError",
    "ConfigurationError",
    "DuplicateTaskError",
    "FencedRedis",
    "LockContendedError",
    "LockKeyError",
    "LockLostError",
    "LockSettings",
    "LockStateError",
    "LockStoreError",
    "LockStoreUnavailableError",
    "LockedRequest",
    "LockedTask",
    "ResultUnavailableError",
    "StaleFenceError",
    "__version__",
    "check_canvas",
    "fenced_set",
    "fenced_update",
    "follow",
    "install",
    "is_skipped",
    "signals",
]
