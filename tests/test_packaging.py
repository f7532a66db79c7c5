"""What the build backend makes of pyproject.toml: an sdist that carries what the test-suite
reads (every ``ROOT / ...`` path a test names, so that the suite runs from an unpacked sdist as
it does from a checkout), and metadata that every hatchling the build allows writes validly."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.metadata import Metadata
from packaging.requirements import Requirement

pytest.importorskip(
    "hatchling", reason="hatchling is not installed: it belongs in the `test` extra"
)

ROOT = Path(__file__).resolve().parent.parent
#: ``ROOT / "docs" / "cli.md"``, as the tests name the files of the source tree they read.
ROOT_PATH = re.compile(r'ROOT((?:\s*/\s*"[^"]+")+)')
#: Read only when there: the version control of a checkout, which no sdist carries.
NOT_SHIPPED = {".git"}
#: The first hatchling that writes Metadata-Version 2.4, which ``License-Expression`` and
#: ``License-File`` (``license = "MIT"``) need: older ones write them under 2.1 or 2.3, which
#: PyPI and ``twine check`` refuse, and 1.26 writes the older ``License`` field instead.
LICENSE_EXPRESSION_HATCHLING = "1.27.0"


def build(kind: str, directory: Path) -> Path:
    """Build the ``sdist`` or ``wheel`` of the source tree with the installed hatchling."""
    code = f"import sys, hatchling.build; print(hatchling.build.build_{kind}(sys.argv[1]))"
    name = subprocess.run(
        [sys.executable, "-c", code, str(directory)],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=120,
    ).stdout.split()[-1]  # fmt: skip
    return directory / name


def paths_the_tests_read() -> set[str]:
    paths = set()
    for test in (ROOT / "tests").glob("*.py"):
        for match in ROOT_PATH.finditer(test.read_text()):
            paths.add("/".join(re.findall(r'"([^"]+)"', match[1])))
    return paths - NOT_SHIPPED


def test_the_sdist_carries_every_file_the_tests_read(tmp_path: Path) -> None:
    with tarfile.open(build("sdist", tmp_path)) as sdist:
        members = {member.name.partition("/")[2] for member in sdist.getmembers()}
    read = paths_the_tests_read()
    assert "README.md" in read  # the pattern finds what the tests read
    missing = sorted(
        path for path in read if path not in members and not any(
            member.startswith(f"{path}/") for member in members
        )
    )  # fmt: skip
    assert not missing, f"the sdist lacks what the tests read: {missing}"


def test_every_hatchling_the_build_allows_writes_valid_license_metadata(tmp_path: Path) -> None:
    """hatchling 1.18 to 1.25, which ``build-system.requires`` allowed, wrote the license as
    ``License-Expression`` under Metadata-Version 2.1 or 2.3: a wheel PyPI refuses."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    requires = re.search(r'^requires = \["(hatchling[^"]*)"\]', pyproject, re.MULTILINE)
    assert requires is not None
    allowed = Requirement(requires[1]).specifier
    assert not allowed.contains("1.26.3"), f"build-system allows hatchling {allowed}"
    assert allowed.contains(LICENSE_EXPRESSION_HATCHLING)
    wheel = build("wheel", tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        [name] = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        text = archive.read(name)
    metadata = Metadata.from_email(text, validate=True)  # raises on a field its version lacks
    assert metadata.license_expression == "MIT"
