"""The sdist carries what the test-suite reads: every ``ROOT / ...`` path a test names, so that
the suite runs from an unpacked sdist as it does from a checkout (pyproject.toml's sdist
``include`` says so)."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip(
    "hatchling", reason="hatchling is not installed: it belongs in the `test` extra"
)

ROOT = Path(__file__).resolve().parent.parent
#: ``ROOT / "docs" / "cli.md"``, as the tests name the files of the source tree they read.
ROOT_PATH = re.compile(r'ROOT((?:\s*/\s*"[^"]+")+)')
#: Read only when there: the version control of a checkout, which no sdist carries.
NOT_SHIPPED = {".git"}


def paths_the_tests_read() -> set[str]:
    paths = set()
    for test in (ROOT / "tests").glob("*.py"):
        for match in ROOT_PATH.finditer(test.read_text()):
            paths.add("/".join(re.findall(r'"([^"]+)"', match[1])))
    return paths - NOT_SHIPPED


def test_the_sdist_carries_every_file_the_tests_read(tmp_path: Path) -> None:
    build = "import sys, hatchling.build; print(hatchling.build.build_sdist(sys.argv[1]))"
    name = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=120,
    ).stdout.split()[-1]  # fmt: skip
    with tarfile.open(tmp_path / name) as sdist:
        members = {member.name.partition("/")[2] for member in sdist.getmembers()}
    read = paths_the_tests_read()
    assert "README.md" in read  # the pattern finds what the tests read
    missing = sorted(
        path for path in read if path not in members and not any(
            member.startswith(f"{path}/") for member in members
        )
    )  # fmt: skip
    assert not missing, f"the sdist lacks what the tests read: {missing}"
