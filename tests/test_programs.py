"""The bounded runner of programs that start servers and workers of their own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from programs import run_program

CLEANS_UP = """
import pathlib, sys, time
try:
    time.sleep(60)
except KeyboardInterrupt:
    pathlib.Path(sys.argv[1]).write_text("stopped what it started")
    sys.exit(130)
"""


def test_a_program_that_ends_is_captured() -> None:
    done = run_program([sys.executable, "-c", "print('out'); exit(3)"], timeout=30)
    assert (done.returncode, done.stdout) == (3, "out\n")


def test_an_overrunning_program_is_interrupted_and_left_to_clean_up(tmp_path: Path) -> None:
    marker = tmp_path / "cleaned"
    with pytest.raises(pytest.fail.Exception, match="ran over 1s"):
        run_program([sys.executable, "-c", CLEANS_UP, str(marker)], timeout=1)
    assert marker.read_text() == "stopped what it started"  # SIGINT, not SIGKILL
