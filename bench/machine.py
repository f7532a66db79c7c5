"""What the numbers were measured on: CPU, cores, memory, Python, redis-server, packages, load."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

#: Distributions whose versions go into every result.
PACKAGES = (
    "celery-lock",
    "celery",
    "kombu",
    "billiard",
    "redis",
    "tenacity",
    "hiredis",
    "python-redis-lock",
    "pottery",
    "celery-once",
    "celery-singleton",
)


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_mhz() -> float | None:
    """The clock of the first core in MHz, from ``/proc/cpuinfo``.

    A VM's model name can stand for several machines ("Intel(R) Xeon(R) Processor" has been a
    2.1, a 2.6 and a 2.8 GHz machine here, whose round trips to Redis differ threefold), so the
    clock goes with it wherever runs are told apart.
    """
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return round(float(line.split(":", 1)[1]), 1)
    except (OSError, ValueError):
        pass
    return None


def name(machine: dict[str, Any]) -> str:
    """The CPU a run recorded, with its clock when known: what tells two machines apart."""
    cpu = str(machine.get("cpu", "unknown machine"))
    mhz = machine.get("cpu_mhz")
    return f"{cpu}, {mhz / 1000:.1f} GHz" if mhz else cpu


def memory_gib() -> float | None:
    """Total memory in GiB, from ``/proc/meminfo``."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def redis_server_version(executable: str) -> str:
    """``v=...`` from ``redis-server --version``."""
    try:
        out = subprocess.run(
            [executable, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    for part in out.split():
        if part.startswith("v="):
            return part[2:]
    return out.strip() or "unknown"


def package_versions() -> dict[str, str]:
    """Installed versions of :data:`PACKAGES` (``"-"`` when not installed)."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "-"
    return found


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def source_tree() -> str | None:
    """The commit of the checkout being measured, ``+`` marking uncommitted changes to its
    tracked files; ``None`` outside a git checkout.

    Runs of two versions of the code must not be pooled as one: the commit says which is which.
    """
    try:
        commit = _git("rev-parse", "--short=12", "HEAD")
        changes = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}+" if changes else commit


def _git(*args: str) -> str:
    """What ``git ARGS`` prints in this checkout, stripped."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
    )
    return done.stdout.strip()


def describe(redis_executable: str) -> dict[str, Any]:
    """Everything :mod:`bench.report` prints about the machine."""
    return {
        "cpu": cpu_model(),
        "cpu_mhz": cpu_mhz(),
        "cores": os.cpu_count(),
        "memory_gib": memory_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "redis_server": redis_server_version(redis_executable),
        "redis_server_path": redis_executable,
        "packages": package_versions(),
        "commit": source_tree(),
        "load_at_start": load_average(),
    }
