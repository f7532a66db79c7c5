"""Every code block in README.md, docs/*.md and the examples' READMEs is real code, and the site
builds.

Each fenced block is checked according to a marker: an HTML comment on the line before its fence
(invisible on the rendered site)::

    <!-- docs-test: run -->             Python: run. A page's run blocks run in order in one
                                        process and share their globals, like a doctest session.
    <!-- docs-test: file [PATH] -->     Python: written to the page's directory as PATH (default:
                                        the ``# PATH`` comment on its first line), so run blocks,
                                        workers and shell commands of the page can import it.
    <!-- docs-test: worker -->          bash: its ``celery -A APP worker ...`` line is started as a
                                        real worker (``CeleryWorker``) before the page's steps run.
    <!-- docs-test: console -->         console: every ``$ command`` line is run in the page's
                                        session, in order, and its output compared with the lines
                                        after it (task ids, durations and spacing normalized).
    <!-- docs-test: shell -->           bash: every line is run in the page's directory; exit 0.
    <!-- docs-test: output -->          text: the stdout of the run block before it, normalized.
    <!-- docs-test: worker-log -->      text: each line is in the log of the page's worker, once
                                        timestamps, task ids and pool process numbers are
                                        normalized.
    <!-- docs-test: signatures MODULE -->  Python stub: each ``def``/``class`` in it matches the
                                        real one in MODULE (parameters, defaults, attributes).
    <!-- docs-test: exceptions -->      text: the exception tree matches the real hierarchy.
    <!-- docs-test: compile-only WHY --> Python: compiled only (e.g. it needs celery-once).
    (no marker)                         Python: compiled, and every module and name it imports
                                        is imported.

A page session gets a private ``redis-server``: in the code and commands it runs,
``localhost:6379`` is replaced by that server's address, so the documented URLs stay the usual
ones. Beyond the blocks, the prose is checked against the code: every ``--lock-*`` option exists
on the worker, every ``celery ... lock ...`` command line parses, the settings tables list every
setting with its default, the API page names every public name, ``celery_lock.x.y`` names
resolve, and every relative link leads to a file and, with ``#anchor``, to one of its headings.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import click
import pytest
from programs import run_program

import celery_lock
from celery_lock import CeleryLockError, LockSettings
from celery_lock.cli import lock as lock_command
from celery_lock.testing import CeleryWorker, RedisServer
from celery_lock.worker import WORKER_OPTIONS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLE_READMES = sorted((ROOT / "examples").glob("**/README.md"))
DOC_FILES = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *EXAMPLE_READMES]

FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<kind>[\w-]+)\s*(?P<arg>.*?)\s*-->\s*$")
MARKERS = {
    "run": {"python"},
    "file": {"python"},
    "worker": {"bash"},
    "console": {"console"},
    "shell": {"bash"},
    "output": {"text"},
    "worker-log": {"text"},
    "signatures": {"python"},
    "exceptions": {"text"},
    "compile-only": {"python"},
}
UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")
DURATION = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?s\b")
LOG_STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+")
POOL_PROCESS = re.compile(r"ForkPoolWorker-\d+")
JSON_SECONDS = re.compile(r'("(?:age_s|ttl_left_s)": )-?[\d.]+')
# A new request's first fence is the clock in microseconds: 16 digits, until the year 2286.
CLOCK_FENCE = re.compile(r"\b1\d{15}\b")
DOCS_REDIS = "localhost:6379"


@dataclass(frozen=True)
class Block:
    """One fenced block of a Markdown file."""

    path: Path
    line: int  # of the block's first content line, 1-based
    lang: str
    text: str
    marker: str | None
    arg: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def file_name(self) -> str:
        """Where a ``file`` block goes: the marker's argument or its ``# path`` first line."""
        if self.arg:
            return self.arg
        first = self.text.splitlines()[0]
        assert first.startswith("# "), f"{self.where}: a file block names its path"
        return first[2:].strip()

    def source(self) -> str:
        """The text, padded so that line numbers in errors are the Markdown file's."""
        return "\n" * (self.line - 1) + self.text


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        previous = next((line for line in reversed(lines[:i]) if line.strip()), "")
        marker = MARKER.match(previous)
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        body = [line.removeprefix(indent) for line in lines[i + 1 : end]]
        found.append(
            Block(
                path=path,
                line=i + 2,
                lang=opening["lang"] or "text",
                text="\n".join(body) + "\n",
                marker=marker["kind"] if marker else None,
                arg=marker["arg"] if marker else "",
            )
        )
        i = end + 1
    return found


ALL_BLOCKS = [block for path in DOC_FILES for block in blocks_of(path)]
PYTHON_BLOCKS = [block for block in ALL_BLOCKS if block.lang in ("python", "py")]
SHELL_BLOCKS = [block for block in ALL_BLOCKS if block.lang in ("bash", "sh", "console")]
FILE_MODULES = {
    Path(block.file_name).parts[0].removesuffix(".py")
    for block in PYTHON_BLOCKS
    if block.marker == "file"
}


def ids(blocks: list[Block]) -> list[str]:
    return [block.where for block in blocks]


def normalize(text: str) -> str:
    """Output as compared: task ids, fences started from the clock, durations and runs of
    spaces do not count."""
    text = UUID.sub("<id>", text)
    text = CLOCK_FENCE.sub("<fence>", text)
    text = LOG_STAMP.sub("<when>", text)
    text = POOL_PROCESS.sub("ForkPoolWorker-<n>", text)
    text = JSON_SECONDS.sub(r"\1<n>", text)
    text = DURATION.sub("<t>", text)
    return "\n".join(" ".join(line.split()) for line in text.strip().splitlines())


# -- every block ------------------------------------------------------------------------------


def test_markers_are_known_and_fit_their_block() -> None:
    for block in ALL_BLOCKS:
        if block.marker is not None:
            assert block.marker in MARKERS, f"{block.where}: unknown marker {block.marker!r}"
            assert block.lang in MARKERS[block.marker], (
                f"{block.where}: a {block.marker} marker on a {block.lang} block"
            )
    assert len(PYTHON_BLOCKS) > 20


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=ids(PYTHON_BLOCKS))
def test_python_block_compiles(block: Block) -> None:
    compile(block.source(), str(block.path), "exec")


def _imports(tree: ast.AST) -> Iterator[tuple[str, list[str]]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, [alias.name for alias in node.names]


IMPORT_CHECKED = [b for b in PYTHON_BLOCKS if b.marker in (None, "run", "file")]


@pytest.mark.parametrize("block", IMPORT_CHECKED, ids=ids(IMPORT_CHECKED))
def test_python_block_imports_resolve(block: Block) -> None:
    """What a block imports exists (run blocks import it again when they run)."""
    for module_name, names in _imports(ast.parse(block.text)):
        if module_name.split(".")[0] in FILE_MODULES:
            continue  # a module the docs write as a file block (shop.py, tests/...)
        module = importlib.import_module(module_name)
        for name in names:
            if not hasattr(module, name):
                importlib.import_module(f"{module_name}.{name}")


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    found: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 2):
        try:
            found = getattr(found, part)
        except AttributeError:
            found = importlib.import_module(".".join(parts[:i]))
    return found


def test_dotted_celery_lock_names_in_docs_resolve() -> None:
    """``celery_lock.x.y`` in prose and code names something real."""
    pattern = re.compile(r"\bcelery_lock(?:\.[A-Za-z_]\w*)+")
    for path in DOC_FILES:
        for dotted in sorted(set(pattern.findall(path.read_text()))):
            if dotted.endswith((".py", ".md")):
                continue  # a file name
            _resolve(dotted)


def test_celery_lock_setting_names_in_docs_exist() -> None:
    known = {*LockSettings.setting_names(), "celery_lock_deferrals"}  # the deferral header
    for path in DOC_FILES:
        for name in set(re.findall(r"\bcelery_lock_[a-z_]+\b", path.read_text())):
            assert name in known, f"{path.name}: {name} is not a setting"


# -- stubs and trees compared with the code ---------------------------------------------------

NO_DEFAULT = object()
ANY_DEFAULT = object()


def _literal(node: ast.expr | None) -> Any:
    if node is None:
        return NO_DEFAULT
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ANY_DEFAULT


def _stub_parameters(args: ast.arguments) -> list[tuple[str, Any, Any]]:
    kind = inspect.Parameter
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    found = [
        (arg.arg, kind.POSITIONAL_ONLY if i < len(args.posonlyargs) else kind.POSITIONAL_OR_KEYWORD,
         _literal(default))
        for i, (arg, default) in enumerate(zip(positional, defaults, strict=True))
    ]  # fmt: skip
    if args.vararg:
        found.append((args.vararg.arg, kind.VAR_POSITIONAL, NO_DEFAULT))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        found.append((arg.arg, kind.KEYWORD_ONLY, _literal(default)))
    if args.kwarg:
        found.append((args.kwarg.arg, kind.VAR_KEYWORD, NO_DEFAULT))
    return found


def _compare_signature(where: str, stub: list[tuple[str, Any, Any]], real: Any) -> None:
    actual = [
        (p.name, p.kind, NO_DEFAULT if p.default is inspect.Parameter.empty else p.default)
        for p in inspect.signature(real).parameters.values()
    ]
    assert [(n, k) for n, k, _ in stub] == [(n, k) for n, k, _ in actual], (
        f"{where}: documented parameters differ from {real!r}"
    )
    for (name, _, documented), (_, _, default) in zip(stub, actual, strict=True):
        if documented is ANY_DEFAULT:
            assert default is not NO_DEFAULT, f"{where}: {name} has no default"
        else:
            assert documented == default or (documented is default), (
                f"{where}: {name} defaults to {default!r}, documented {documented!r}"
            )


def _decorators(node: ast.FunctionDef) -> set[str]:
    return {ast.unparse(d) for d in node.decorator_list}


def _check_function(where: str, node: ast.FunctionDef, owner: Any) -> None:
    assert hasattr(owner, node.name), f"{where}: {owner!r} has no {node.name}"
    if "property" in _decorators(node):
        assert isinstance(inspect.getattr_static(owner, node.name), property)
        return
    stub = _stub_parameters(node.args)
    static = inspect.getattr_static(owner, node.name) if inspect.isclass(owner) else None
    if isinstance(static, classmethod):
        assert "classmethod" in _decorators(node), f"{where}: {node.name} is a classmethod"
        stub = stub[1:]
    elif isinstance(static, staticmethod):
        assert "staticmethod" in _decorators(node), f"{where}: {node.name} is a staticmethod"
    _compare_signature(f"{where} {node.name}", stub, getattr(owner, node.name))


def _check_attribute(where: str, name: str, value: ast.expr | None, owner: Any) -> None:
    if value is not None:
        documented = _literal(value)
        actual = getattr(owner, name)
        if documented is not ANY_DEFAULT:
            assert actual == documented, f"{where}: {name} is {actual!r}, documented {documented!r}"
        return
    if hasattr(owner, name) or name in getattr(owner, "__annotations__", {}):
        return
    assert inspect.isclass(owner), f"{where}: {owner!r} has no attribute {name}"
    assert f"self.{name} =" in inspect.getsource(owner), f"{where}: {owner!r} has no {name}"


def _check_stub(where: str, body: list[ast.stmt], owner: Any) -> None:
    for node in body:
        if isinstance(node, ast.FunctionDef):
            _check_function(where, node, owner)
        elif isinstance(node, ast.ClassDef):
            assert hasattr(owner, node.name), f"{where}: no class {node.name}"
            real = getattr(owner, node.name)
            for base in node.bases:
                base_name = ast.unparse(base).rsplit(".", 1)[-1]
                assert base_name in [b.__name__ for b in real.__mro__[1:]], (
                    f"{where}: {node.name} does not derive from {base_name}"
                )
            _check_stub(f"{where} {node.name}", node.body, real)
            # The other way too: a field or task option added to the class is added to the page.
            stubbed = {
                n.target.id
                for n in node.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            }
            declared = {name for name in inspect.get_annotations(real) if not name.startswith("_")}
            assert declared <= stubbed, f"{where} {node.name}: undocumented {declared - stubbed}"
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            _check_attribute(where, node.target.id, node.value, owner)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                assert isinstance(target, ast.Name)
                _check_attribute(where, target.id, node.value, owner)


SIGNATURE_BLOCKS = [b for b in PYTHON_BLOCKS if b.marker == "signatures"]


@pytest.mark.parametrize("block", SIGNATURE_BLOCKS, ids=ids(SIGNATURE_BLOCKS))
def test_documented_signatures_match_the_code(block: Block) -> None:
    _check_stub(block.where, ast.parse(block.text).body, importlib.import_module(block.arg))


def _celery_lock_errors() -> set[type]:
    found: set[type] = set()
    todo = [CeleryLockError]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("celery_lock"):
            found.add(cls)
        todo += cls.__subclasses__()
    return found


TREE_BLOCKS = [b for b in ALL_BLOCKS if b.marker == "exceptions"]


@pytest.mark.parametrize("block", TREE_BLOCKS, ids=ids(TREE_BLOCKS))
def test_exception_tree_matches_the_code(block: Block) -> None:
    """Each class sits under its real base, with its constructor as documented; none is left out."""
    line_pattern = re.compile(
        r"^(?P<lead>[\s│├└─]*)(?P<name>\w+)(?P<params>\([^)]*\))?(?P<rest>.*)$"
    )
    parents: dict[int, type] = {}
    documented: set[type] = set()
    for line in block.text.splitlines():
        match = line_pattern.match(line)
        assert match, f"{block.where}: cannot read {line!r}"
        depth = len(match["lead"]) // 4
        cls = getattr(celery_lock, match["name"])
        documented.add(cls)
        if depth:
            assert cls.__bases__[0] is parents[depth - 1], f"{block.where}: base of {cls}"
        parents[depth] = cls
        if match["params"]:
            tree = ast.parse(f"def f{match['params']}: pass").body[0]
            assert isinstance(tree, ast.FunctionDef)
            own = _stub_parameters(tree.args)
            _compare_signature(
                f"{block.where} {cls.__name__}",
                [("self", inspect.Parameter.POSITIONAL_OR_KEYWORD, NO_DEFAULT), *own],
                cls.__init__,
            )
        for also in re.findall(r"also an? ([\w.]+)", match["rest"]):
            module, _, name = also.rpartition(".")
            base = getattr(importlib.import_module(module) if module else builtins, name)
            assert issubclass(cls, base), f"{cls} is not a {also}"
    assert documented == _celery_lock_errors()


# -- settings, options, commands and names in the prose ---------------------------------------


def _documented_default(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return f"`{value}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f'`"{value}"`'


@pytest.mark.parametrize("path", [ROOT / "README.md", DOCS / "settings.md"], ids=lambda p: p.name)
def test_settings_tables_list_every_setting_with_its_default(path: Path) -> None:
    rows = [line for line in path.read_text().splitlines() if line.startswith("|")]
    for field in fields(LockSettings):
        setting, option = f"celery_lock_{field.name}", f"lock_{field.name}"
        [row] = [row for row in rows if row.startswith(f"| `{setting}`")]
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[1] == f"`{option}`", row
        default = cells[-1]
        if field.name == "heartbeat_interval":
            assert "TTL / 3" in default, row
        elif field.name == "redis_url":
            assert "broker URL" in default, row
        else:
            assert _documented_default(field.default) in default, row
    # The task-only options: every lock_* option of LockedTask that is not a setting's.
    settings_options = {f"lock_{field.name}" for field in fields(LockSettings)}
    task_only = {
        name
        for name in inspect.get_annotations(celery_lock.LockedTask)
        if name.startswith("lock_") and name not in settings_options
    }
    assert task_only >= {"lock_key", "lock_scope"}
    for option in task_only:
        assert [row for row in rows if f"`{option}`" in row], f"{path.name}: {option}"


@pytest.fixture(scope="module")
def worker_help() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.storm_app", "worker", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout


def test_every_lock_option_in_the_docs_exists_on_the_worker(worker_help: str) -> None:
    offered = set(re.findall(r"--lock-[a-z-]+", worker_help))
    assert offered, "install(app) adds no --lock-* option"
    mentioned = {m for path in DOC_FILES for m in re.findall(r"--lock-[a-z-]+", path.read_text())}
    assert mentioned <= offered
    settings_page = (DOCS / "settings.md").read_text()
    for option in offered:
        assert f"`{option}" in settings_page, f"settings.md does not document {option}"


def _command_lines() -> Iterator[tuple[Block, list[str]]]:
    for block in SHELL_BLOCKS:
        for text in block.text.splitlines():
            line = text.split(" #", 1)[0].strip().removeprefix("$ ")
            if line.startswith("celery "):
                yield block, shlex.split(line)


def test_worker_options_table_names_the_setting_each_overrides() -> None:
    page = (DOCS / "settings.md").read_text()
    rows = [row for row in page.splitlines() if row.startswith("| `--lock-")]
    table: dict[str, str] = {}
    for row in rows:
        cells = [cell.strip().strip("`") for cell in row.strip("|").split("|")]
        table[cells[0].split()[0]] = cells[1]
    assert table == {
        "--" + option.replace("_", "-"): setting for option, setting in WORKER_OPTIONS.items()
    }


def test_worker_command_lines_use_real_options(worker_help: str) -> None:
    for block, argv in _command_lines():
        if "worker" in argv:
            for arg in argv[argv.index("worker") + 1 :]:
                if arg.startswith("--"):
                    assert arg.split("=")[0] in worker_help, f"{block.where}: {arg}"


def test_lock_command_lines_parse() -> None:
    """``celery ... lock ...`` lines parse as the real command would (nothing is run)."""
    checked = 0
    for block, argv in _command_lines():
        if "lock" not in argv:
            continue
        args = argv[argv.index("lock") + 1 :]
        with lock_command.make_context("lock", args) as ctx:
            # Click 8 keeps the subcommand apart (protected_args, deprecated); Click 9 will not.
            remaining = [*vars(ctx).get("_protected_args", []), *ctx.args]
            name, command, rest = lock_command.resolve_command(ctx, remaining)
            assert command is not None, f"{block.where}: {name}"
            command.make_context(name or "", rest, parent=ctx)
        checked += 1
    assert checked >= 8


def test_cli_page_documents_every_command_and_option() -> None:
    page = (DOCS / "cli.md").read_text()
    assert isinstance(lock_command, click.Group)
    for param in lock_command.params:
        for opt in param.opts:
            assert f"`{opt}" in page, f"cli.md: lock {opt}"
    for name, command in lock_command.commands.items():
        assert f"### `lock {name}`" in page, f"cli.md: no section for lock {name}"
        for param in command.params:
            for opt in getattr(param, "opts", []):
                if opt.startswith("--") and opt != "--help":
                    assert f"`{opt}" in page, f"cli.md: lock {name} {opt}"


def test_api_page_names_every_public_name() -> None:
    page = (DOCS / "api.md").read_text()
    modules = ["celery_lock"] + [
        f"celery_lock.{path.stem}"
        for path in sorted(Path(celery_lock.__file__).parent.glob("*.py"))
        if not path.stem.startswith("_")
    ]
    for module in modules:
        for name in importlib.import_module(module).__all__:
            assert re.search(rf"\b{re.escape(name)}\b", page), f"api.md: {module}.{name}"


def test_ci_runs_the_readmes_test_commands_as_written() -> None:
    """CI must run the README's own install-and-test commands, not commands of its own that a
    change to either could make differ."""
    readme = ROOT / "README.md"
    lines = readme.read_text().splitlines()
    start = lines.index("## Run the tests") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("## "))
    commands = [
        line
        for block in blocks_of(readme)
        if block.lang == "bash" and start < block.line <= end
        for line in block.text.splitlines()
    ]
    assert len(commands) >= 2  # the suite, and its in-process part on the oldest releases
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in commands:
        assert command in ci, f".ci/run does not run the README's {command!r}"


# -- page sessions: run blocks, files, workers and commands, in the page's order --------------

RUNNER = """
import contextlib, io, json, os, shlex, subprocess, sys, traceback

steps = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
results = []
for step in steps:
    if step["kind"] == "python":
        buffer = io.StringIO()
        try:
            with contextlib.redirect_stdout(buffer):
                exec(compile(step["source"], step["path"], "exec"), namespace)
        except BaseException:
            sys.stdout.write(buffer.getvalue())
            traceback.print_exc()
            sys.exit(1)
        sys.stdout.write(buffer.getvalue())
        results.append({"output": buffer.getvalue()})
    else:
        argv = shlex.split(step["command"])
        if argv[0] == "celery":  # the venv's own script, so usage lines say "celery"
            script = os.path.join(os.path.dirname(sys.executable), "celery")
            argv = [script, *argv[1:]] if os.path.exists(script) else [
                sys.executable, "-m", "celery", *argv[1:]]
        elif argv[0] == "python":
            argv = [sys.executable, *argv[1:]]
        done = subprocess.run(argv, input=step["input"], capture_output=True, text=True,
                              timeout=120, check=False)
        print(f"$ {step['command']}", done.stdout, done.stderr, sep="\\n")
        results.append({"output": done.stdout + done.stderr, "returncode": done.returncode})
    sys.stdout.flush()
json.dump(results, open(sys.argv[2], "w"))
"""


@dataclass
class Step:
    """One thing a page session does, and what the page says it gives."""

    block: Block | None
    kind: str  # "python" or "command"
    text: str
    expected: str | None = None
    input: str = ""


def _console_steps(block: Block) -> list[Step]:
    steps: list[Step] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            steps.append(Step(block, "command", line[2:].split(" #", 1)[0].strip(), ""))
        elif line.endswith("[y/N]: y"):  # a prompt the reader answers: feed the answer
            steps[-1].input += "y\n"
            steps[-1].expected = f"{steps[-1].expected}{line.removesuffix('y')}"  # not echoed
        else:
            steps[-1].expected = f"{steps[-1].expected}{line}\n"
    return steps


def page_steps(path: Path) -> list[Step]:
    steps: list[Step] = []
    for block in blocks_of(path):
        if block.marker == "run":
            steps.append(Step(block, "python", block.source()))
        elif block.marker == "output":
            assert steps, f"{block.where}: output of what?"
            assert steps[-1].kind == "python", f"{block.where}: output of a command?"
            steps[-1].expected = block.text
        elif block.marker == "console":
            steps += _console_steps(block)
        elif block.marker == "shell":
            steps += [Step(block, "command", line) for line in block.text.splitlines() if line]
    return steps


def page_files(path: Path) -> dict[str, str]:
    return {b.file_name: b.text for b in blocks_of(path) if b.marker == "file"}


def page_workers(path: Path) -> list[list[str]]:
    found = []
    for block in blocks_of(path):
        if block.marker == "worker":
            [line] = [line for line in block.text.splitlines() if " worker" in line]
            found.append(shlex.split(line))
    return found


def run_page(
    path: Path,
    directory: Path,
    server: RedisServer,
    *,
    files: dict[str, str] | None = None,
    prelude: list[Step] | None = None,
    pytest_options: str = "",
) -> None:
    """Run a page's steps in ``directory`` against ``server``; compare what they print.

    ``files`` are written beside the page's own, and win over a page file of the same name;
    ``pytest_options`` are added to the options of every ``pytest`` a step runs.
    """
    address = f"127.0.0.1:{server.port}"
    for name, text in {**page_files(path), **(files or {})}.items():
        target = directory / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text.replace(DOCS_REDIS, address))
    steps = [*(prelude or []), *page_steps(path)]
    (directory / "_steps.json").write_text(
        json.dumps(
            [
                {
                    "kind": s.kind,
                    "path": str(s.block.path) if s.block else "test_docs.py",
                    "source": s.text.replace(DOCS_REDIS, address),
                    "command": s.text.replace(DOCS_REDIS, address),
                    "input": s.input,
                }
                for s in steps
            ]
        )
    )
    (directory / "_runner.py").write_text(RUNNER)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(directory), *sys.path]),
        "PYTHONUNBUFFERED": "1",
        "PYTEST_ADDOPTS": f"-p no:docker_tools -p no:cacheprovider {pytest_options}".strip(),
    }
    workers = []
    for documented in page_workers(path):
        argv = [arg.replace(DOCS_REDIS, address) for arg in documented]
        app = argv[argv.index("-A") + 1]
        extra = [*argv[argv.index("worker") + 1 :], "--without-mingle", "--without-gossip"]
        workers.append(CeleryWorker(app, cwd=directory, env=env, extra_args=extra))
    try:
        for worker in workers:
            worker.start(timeout=60)
        done = run_program(
            [sys.executable, "_runner.py", "_steps.json", "_results.json"],
            cwd=directory, env=env, timeout=150,
        )  # fmt: skip
    finally:
        for worker in workers:
            worker.stop()
    print(done.stdout)
    print(done.stderr, file=sys.stderr)
    logs = "".join(worker.log() for worker in workers)
    print(logs)
    assert done.returncode == 0, f"{path.name}: a step failed (see the captured output)"
    logged = set(normalize(logs).splitlines())
    for block in blocks_of(path):
        if block.marker == "worker-log":
            for line in normalize(block.text).splitlines():
                assert line in logged, f"{block.where}: the worker never logged {line!r}"
    results = json.loads((directory / "_results.json").read_text())
    assert len(results) == len(steps)
    for step, result in zip(steps, results, strict=True):
        where = step.block.where if step.block else "prelude"
        result["output"] = result["output"].replace(address, DOCS_REDIS)
        if step.kind == "command" and "Error:" not in (step.expected or ""):
            assert result["returncode"] == 0, f"{where}: {step.text} failed"
        if step.expected is not None:
            printed, documented = normalize(result["output"]), normalize(step.expected)
            assert printed == documented, (
                f"{where}: printed\n{printed}\n--- but the page shows ---\n{documented}"
            )


@pytest.fixture
def page_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


SESSION_PAGES = sorted(
    {b.path for b in ALL_BLOCKS if b.marker in ("run", "console", "shell", "worker")}
    - {DOCS / "cli.md"}
)


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(
            path,
            marks=[pytest.mark.worker] if page_workers(path) or path.name == "testing.md" else [],
        )
        for path in SESSION_PAGES
    ],
    ids=lambda path: path.name,
)
def test_page_runs_as_documented(path: Path, tmp_path: Path, page_redis: RedisServer) -> None:
    run_page(path, tmp_path, page_redis)


# The state the CLI page describes: charge(7) running on celery@web-1, charge(42) done.
CLI_PRELUDE = """
from celery_lock.keys import RequestKeys
from celery_lock.lease import Acquired, Holder, Lease, new_token
from celery_lock.store import LockStore

store = LockStore.from_url("redis://localhost:6379/2")
for order_id, task_id, pid in [(42, "1c5a5f06-3b7e-4d0a-9a51-0f6d3c7b9e21", 4242),
                               (7, "9b2e4c1d-5f6a-4e8b-8c7d-2a1b0e9f8d7c", 4243)]:
    keys = RequestKeys.build("celery-lock", "shop.charge", str(order_id), "shop.charge")
    holder = Holder(task_id, "shop.charge", "celery@web-1", pid)
    token = new_token()
    # Ten minutes: the lease outlives the page's commands however slow the machine is.
    grant = store.acquire(keys, token, 600_000, holder, 86_400_000)
    assert isinstance(grant, Acquired)
    if order_id == 42:
        store.release(Lease(store, keys, token, 600_000, grant.fence, holder), success=True,
                      done_ttl_ms=86_400_000)
store.client.close()
"""


def test_cli_page_commands_print_what_the_page_shows(
    tmp_path: Path, page_redis: RedisServer
) -> None:
    prelude = [Step(None, "python", CLI_PRELUDE)]
    run_page(
        DOCS / "cli.md", tmp_path, page_redis,
        files=page_files(DOCS / "quickstart.md"), prelude=prelude,
    )  # fmt: skip


@pytest.mark.worker
def test_testing_page_runs_without_pytest_celery(tmp_path: Path, page_redis: RedisServer) -> None:
    """A reader who installed pytest alone gets Celery's ``celery_app`` fixture as the page says:
    without pytest-celery (here: its plugin turned off), nothing loads ``celery.contrib.pytest``,
    and the page's in-process test stopped at "recursive dependency involving fixture
    'celery_app'"."""
    page = DOCS / "testing.md"
    loads = [b for b in blocks_of(page) if b.lang == "python" and "pytest_plugins" in b.text]
    assert loads, "testing.md: no block loads celery.contrib.pytest without pytest-celery"
    conftest = page_files(page)["tests/conftest.py"] + "\n" + loads[0].text
    run_page(
        page, tmp_path, page_redis,
        files={"tests/conftest.py": conftest}, pytest_options="-p no:celery",
    )  # fmt: skip


# -- the site ---------------------------------------------------------------------------------


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is in the docs extra")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    # The changelog page is CHANGELOG.md itself (docs/changelog.md links to it), not a stub.
    changelog = (tmp_path / "site" / "changelog" / "index.html").read_text()
    assert "Keep a Changelog" in changelog
    assert "[Unreleased]" in changelog


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for path in DOCS.glob("*.md"):
        assert f": {path.name}" in nav, f"mkdocs.yml: {path.name} is not in the nav"


LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def _prose(path: Path) -> str:
    """The page without its fenced blocks, whose brackets are code, not links."""
    kept, fence = [], None
    for line in path.read_text().splitlines():
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening["fence"]
        elif fence is not None:
            fence = None if line.strip() == fence else fence
        else:
            kept.append(line)
    return "\n".join(kept)


def _anchors(path: Path) -> set[str]:
    """The anchors of a page's headings, as mkdocs (runs of spaces and hyphens as one ``-``) and
    GitHub (each space a ``-``) make them; a link may use either."""
    found = set()
    for line in _prose(path).splitlines():
        if line.startswith("#"):
            text = re.sub(r"[^\w\s-]", "", line.lstrip("#").strip().lower())
            found |= {re.sub(r"[\s-]+", "-", text), re.sub(r"\s", "-", text)}
    return found


def test_relative_links_lead_to_a_file_and_heading() -> None:
    """mkdocs checks the links of docs/ (when it is installed); this checks those of the README
    and the examples too, as GitHub shows them."""
    checked = 0
    for path in DOC_FILES:
        for match in LINK.finditer(_prose(path)):
            target = match["target"]
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            assert linked.exists(), f"{path.relative_to(ROOT)}: {target}: no such file"
            if anchor:
                assert anchor in _anchors(linked), f"{path.relative_to(ROOT)}: {target}: no heading"
            checked += 1
    assert checked > 50


# Output pasted as the tool printed it, whose lines are the tool's: a heading, then its lines.
PASTED_SECTIONS = {"### The goals, as the bench reports them"}


def test_prose_is_wrapped_at_100_columns() -> None:
    """Prose lines end by column 100, as the code does (pyproject's line-length). Code blocks,
    table rows (one line each in Markdown) and pasted output keep their own lines."""
    long_lines = []
    for path in DOC_FILES:
        fence: str | None = None
        pasted = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            opening = FENCE.match(line)
            if fence is None and opening:
                fence = opening["fence"]
            elif fence is not None:
                fence = None if line.strip() == fence else fence
            elif line.startswith("#"):
                pasted = line.strip() in PASTED_SECTIONS
            elif len(line) > 100 and not pasted and not line.lstrip().startswith("|"):
                long_lines.append(f"{path.relative_to(ROOT)}:{number} ({len(line)})")
    assert not long_lines, "lines longer than 100 columns:\n" + "\n".join(long_lines)


def test_output_normalization_keeps_what_matters() -> None:
    assert normalize("a  1c5a5f06-3b7e-4d0a-9a51-0f6d3c7b9e21   12.3s\n") == "a <id> <t>"
    assert normalize('"age_s": 1.5,') == '"age_s": <n>,'
    assert normalize("1 lease(s) held, fence 3") == "1 lease(s) held, fence 3"
    assert normalize("with fence 1795749525035218.") == "with fence <fence>."
    assert normalize("port 17957495250352180") == "port 17957495250352180"
