"""Progress lines on stderr, so a run of a quarter of an hour says where it is.

Standard output carries only the tables; each line here starts with ``[bench]`` and the time the
run has taken so far.
"""

from __future__ import annotations

import sys
import time

_STARTED = time.monotonic()


def note(message: str) -> None:
    """Print ``[bench] <elapsed> <message>`` on stderr, at once."""
    elapsed = time.monotonic() - _STARTED
    print(f"[bench] {elapsed:6.0f}s  {message}", file=sys.stderr, flush=True)
