"""Running a program that starts servers and workers of its own, bounded.

``subprocess.run(timeout=...)`` SIGKILLs an overrunning program, and whatever it started in a
session of its own (the demo's and the examples' ``redis-server`` and ``celery worker``) lives
on after the test. :func:`run_program` interrupts it first, as Ctrl-C would, so that it stops
what it started; only a program that does not end within :data:`CLEANUP_SECONDS` is killed.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
from collections.abc import Sequence
from typing import Any

import pytest

#: How long an interrupted program may take to stop what it started.
CLEANUP_SECONDS = 60


def run_program(
    command: Sequence[str], *, timeout: float, **popen: Any
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to its end, capturing its output as text; fail the test if it overruns
    ``timeout`` seconds, after interrupting it (SIGINT) and letting it clean up."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                stdout, stderr = proc.communicate(timeout=CLEANUP_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate(timeout=10)
            pytest.fail(
                f"{shlex.join(command)} ran over {timeout}s:\n{stdout[-2000:]}\n{stderr[-4000:]}"
            )
    return subprocess.CompletedProcess(list(command), proc.returncode, stdout, stderr)
