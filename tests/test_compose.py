"""docker-compose.yml: every service's command is one the project really accepts.

No Docker engine is needed: each ``celery ... worker`` / ``flower`` command of the file is run
here with ``--help`` appended (with the service's environment), each python command's script is
run with ``--help`` and its exact arguments are parsed by the script's own parser, and the ports
and URLs are checked against each other and against what ``examples/pipeline/app.py`` reads.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest

from celery_lock.config import check_value

yaml = pytest.importorskip(
    "yaml", reason="PyYAML is not installed: it belongs in the `test` extra (pyproject.toml)"
)

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
APP_MODULE = "examples.pipeline.app"
APP_SOURCE = ROOT / "examples" / "pipeline" / "app.py"
STAGES = ("pending", "process", "callback")
#: ``--lock-*`` worker option -> the LockSettings field that validates its value.
LOCK_OPTIONS = {
    "--lock-redis-url": "redis_url",
    "--lock-ttl": "ttl",
    "--lock-on-duplicate": "on_duplicate",
}


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    return dict(compose["services"])


def environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's ``environment``, given as a mapping or as a list of ``NAME=value``."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(name): str(value) for name, value in env.items()}


def command(service: dict[str, Any]) -> list[str]:
    cmd = service["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else [str(part) for part in cmd]


def option(cmd: list[str], name: str) -> str | None:
    """The value of ``name`` in ``cmd`` (``name value`` or ``name=value``), or None."""
    for index, part in enumerate(cmd):
        if part == name:
            return cmd[index + 1]
        if part.startswith(f"{name}="):
            return part.split("=", 1)[1]
    return None


def published(service: dict[str, Any]) -> dict[int, int]:
    """The ``ports`` of a service as {container port: host port}."""
    mapping = {}
    for entry in service.get("ports", []):
        host, _, container = str(entry).rpartition(":")
        mapping[int(container)] = int(host or container)
    return mapping


def run_here(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``args`` in the repository with the service's environment on top of ours."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        args, cwd=ROOT, env={**os.environ, **env, "PYTHONPATH": path},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def celery_help(service: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    cmd = command(service)
    assert cmd[0] == "celery"
    return run_here([sys.executable, "-m", "celery", *cmd[1:], "--help"], environment(service))


def app_reads() -> set[str]:
    """The PIPELINE_* variables examples/pipeline/app.py reads."""
    return set(re.findall(r'os\.environ\.get\("(PIPELINE_[A-Z_]+)"', APP_SOURCE.read_text()))


def python_commands(service: dict[str, Any]) -> Iterator[list[str]]:
    """The python commands of a service: its command, or the parts of ``sh -c 'a && b'``."""
    cmd = command(service)
    parts = [shlex.split(part) for part in cmd[2].split("&&")] if cmd[:2] == ["sh", "-c"] else [cmd]
    for part in parts:
        assert part[0] in ("python", "python3"), f"not a python command: {part}"
        yield part


def load_script(path: Path) -> ModuleType:
    """Import a script by its path, without running its ``__main__`` part."""
    name = f"compose_check_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_services_images_and_ports(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == {"redis", "rabbitmq", *STAGES, "producer", "flower"}
    assert services["redis"]["image"] == "redis:7"
    assert published(services["redis"]) == {6379: 6379}
    assert services["rabbitmq"]["image"] == "rabbitmq:3-management"
    assert published(services["rabbitmq"]) == {5672: 5672, 15672: 15672}
    for name, service in services.items():
        for dependency in service.get("depends_on", []):
            assert dependency in services, f"{name} depends on unknown service {dependency}"


def test_pipeline_services_build_the_example_image(services: dict[str, dict[str, Any]]) -> None:
    for name in (*STAGES, "producer", "flower"):
        build = services[name]["build"]
        context = (ROOT / build["context"]).resolve()
        assert context == ROOT, f"{name}: the image installs the repository: context must be ."
        dockerfile = context / build["dockerfile"]
        text = dockerfile.read_text()
        assert re.search(r"^FROM python:3\.11-slim\b", text, re.MULTILINE)
        assert "pip install -e ." in text
        assert "flower" in text, "the flower service runs from the same image"
        assert (dockerfile.parent / f"{dockerfile.name}.dockerignore").is_file()


def test_environment_points_at_the_right_services(services: dict[str, dict[str, Any]]) -> None:
    redis_ports = published(services["redis"])
    rabbitmq_ports = published(services["rabbitmq"])
    read = app_reads()
    for name in (*STAGES, "producer", "flower"):
        env = environment(services[name])
        unknown = set(env) - read
        assert not unknown, f"{name}: app.py does not read {sorted(unknown)}"
        broker = urlsplit(env["PIPELINE_BROKER_URL"])
        assert (broker.scheme, broker.hostname) == ("amqp", "rabbitmq")
        assert broker.port in rabbitmq_ports, f"{name}: broker port {broker.port} not published"
        databases = set()
        for variable in ("PIPELINE_BACKEND_URL", "PIPELINE_LOCK_URL", "PIPELINE_RECORD_URL"):
            url = urlsplit(env[variable])
            assert (url.scheme, url.hostname) == ("redis", "redis"), f"{name}: {variable}"
            assert url.port in redis_ports, f"{name}: {variable} port {url.port} not published"
            databases.add(url.path)
        assert len(databases) == 3, f"{name}: results, leases and record share a database"
        for dependency in ("redis", "rabbitmq"):
            assert dependency in services[name]["depends_on"], f"{name} must wait for {dependency}"


@pytest.mark.parametrize("stage", STAGES)
def test_worker_service_command_is_accepted(
    services: dict[str, dict[str, Any]], stage: str
) -> None:
    service = services[stage]
    cmd = command(service)
    assert cmd[:4] == ["celery", "-A", APP_MODULE, "worker"]
    assert option(cmd, "-Q") == stage, "each stage's pool consumes its own queue"
    assert option(cmd, "-c") == "2"
    assert "-E" in cmd, "Flower needs task events"
    used = [name for name in LOCK_OPTIONS if option(cmd, name) is not None]
    assert used, "the workers take their lock settings from the --lock-* options"
    assert option(cmd, "--lock-redis-url") == environment(service)["PIPELINE_LOCK_URL"]
    for name in used:
        value: Any = option(cmd, name)
        check_value(LOCK_OPTIONS[name], float(value) if name == "--lock-ttl" else value, name)

    done = celery_help(service)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in used:
        assert name in done.stdout, f"`celery worker --help` does not list {name}"


def test_flower_service_command_is_accepted(services: dict[str, dict[str, Any]]) -> None:
    service = services["flower"]
    cmd = command(service)
    assert cmd[:4] == ["celery", "-A", APP_MODULE, "flower"]
    port = int(option(cmd, "--port") or 5555)
    assert port == 5555
    assert published(service) == {port: port}
    if importlib.util.find_spec("flower") is None:
        pytest.skip("flower is not installed here: `celery flower --help` cannot be checked")
    done = celery_help(service)
    assert done.returncode == 0, done.stderr[-2000:]
    # Flower's own options are tornado options, not in the click help: parse them as it does.
    parse = (
        "import sys, flower.options\n"
        "from tornado.options import options\n"
        "options.parse_command_line(['flower', *sys.argv[1:]])\n"
        "print(options.port)"
    )
    flower_args = cmd[4:]
    done = run_here([sys.executable, "-c", parse, *flower_args], environment(service))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == str(port)


def test_producer_service_commands_are_accepted(services: dict[str, dict[str, Any]]) -> None:
    service = services["producer"]
    for name in STAGES:
        assert name in service["depends_on"], f"the producer must start after {name}"
    parsed = {}
    for cmd in python_commands(service):
        script = ROOT / cmd[1]
        assert script.is_file(), f"{cmd[1]} does not exist"
        # The exact arguments, through the script's own parser (exit 2 on an unknown one).
        parsed[script.name] = load_script(script).build_parser().parse_args(cmd[2:])
        done = run_here([sys.executable, cmd[1], "--help"], environment(service))
        assert done.returncode == 0, done.stderr[-2000:]
        assert "usage:" in done.stdout
    assert list(parsed) == ["producer.py", "verify.py"], "the producer runs producer, then verify"
    assert parsed["verify.py"].wait > 0, "verify must wait for the run to finish"
