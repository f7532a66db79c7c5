"""``python -m bench.pool``: rounds of several runs pooled per machine, with the median's interval.

Pure computation on result files shaped as ``python -m bench`` writes them: no server, no worker.
"""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from bench.endtoend import LOCKED, PLAIN
from bench.lockcycle import CELERY_LOCK, FLOOR, SCRIPTED_FLOOR
from bench.pool import Pooled, main, median_interval, pool, pool_lock_cycles

ROOT = Path(__file__).resolve().parent.parent
VERDICT = re.compile(r" (met|missed|open)$")


@pytest.mark.parametrize(
    ("n", "ranks"),
    # The ranks of the order statistics that bound a 95% interval of the median, as the
    # binomial tables give them (n = 6 and 7: the whole range; fewer: none).
    [(5, None), (6, (1, 6)), (7, (1, 7)), (10, (2, 9)), (20, (6, 15)), (22, (6, 17))],
)
def test_median_interval_takes_the_order_statistics_of_the_binomial_tables(
    n: int, ranks: tuple[int, int] | None
) -> None:
    samples = [float(rank) for rank in range(n, 0, -1)]  # rank r has value r, given unsorted
    interval = median_interval(samples)
    assert interval == (None if ranks is None else tuple(float(r) for r in ranks))


def test_a_verdict_needs_the_whole_interval_on_one_side_of_the_goal() -> None:
    assert Pooled(((0.96, 0.97, 0.98, 0.99, 1.0, 1.01),)).verdict(0.95) == "met"
    assert Pooled(((0.90, 0.91, 0.92, 0.93, 0.94, 0.949),)).verdict(0.95) == "missed"
    assert Pooled(((0.90, 0.91, 0.96, 0.97, 0.98, 0.99),)).verdict(0.95) == "open"
    assert Pooled(((0.99, 0.99, 0.99),)).verdict(0.95) == "open"  # too few rounds for an interval


def test_one_run_at_odds_with_the_others_keeps_the_verdict_open() -> None:
    # Taken as 60 independent rounds, two runs at 0.96 outvote one at 0.90, and the median's
    # interval lies wholly at 0.96. But a third of the runs disagree: drawing runs again
    # brings the 0.90 run in twice often enough for the interval to reach it.
    agreeing = tuple(0.96 + i * 1e-4 for i in range(20))
    at_odds = tuple(0.90 + i * 1e-4 for i in range(20))
    assert Pooled((agreeing + agreeing + at_odds,)).verdict(0.95) == "met"  # one run of 60
    pooled = Pooled((agreeing, agreeing, at_odds))
    assert pooled.verdict(0.95) == "open"
    assert pooled.interval is not None
    assert pooled.interval[0] < 0.91
    assert pooled.median == Pooled((agreeing + agreeing + at_odds,)).median


def test_runs_that_agree_keep_the_rounds_interval() -> None:
    run = (0.96, 0.97, 0.98, 0.99, 1.0, 1.01, 0.97, 0.98)
    assert Pooled((run, run, run)).interval == median_interval(run * 3)


def _run(
    cpu: str, rates: dict[str, list[float]], size: str = "2", mhz: float | None = None
) -> dict[str, Any]:
    contenders = {name: {"samples": {"worker": r, "end_to_end": r}} for name, r in rates.items()}
    machine: dict[str, Any] = {"cpu": cpu} if mhz is None else {"cpu": cpu, "cpu_mhz": mhz}
    return {"machine": machine, "endtoend": {"by_processes": {size: {"contenders": contenders}}}}


def test_rounds_are_paired_within_a_run_and_pooled_per_machine() -> None:
    # Round by round celery-lock keeps 0.9 of a plain task, though the rates swing tenfold:
    # a ratio of medians, or of rounds paired across runs, would not give 0.9.
    first = _run("A", {PLAIN: [100, 1000, 500], LOCKED: [90, 900, 450], FLOOR: [95, 950, 475]})
    second = _run("A", {PLAIN: [2000, 300, 700], LOCKED: [1800, 270, 630]})
    elsewhere = _run("B", {PLAIN: [100, 100], LOCKED: [50, 50]})
    pooled = pool([first, second, elsewhere])
    assert set(pooled) == {"A", "B"}
    ratios = pooled["A"]["2"][LOCKED, PLAIN].ratios
    assert ratios == pytest.approx([0.9] * 6)
    assert [len(run) for run in pooled["A"]["2"][LOCKED, PLAIN].runs] == [3, 3]
    assert pooled["A"]["2"][LOCKED, FLOOR].ratios == pytest.approx([90 / 95] * 3)
    assert pooled["B"]["2"][LOCKED, PLAIN].ratios == pytest.approx([0.5, 0.5])


def test_one_model_name_at_two_clocks_is_two_machines() -> None:
    # A VM's CPU says "Intel(R) Xeon(R) Processor" at 2.1 and at 2.6 GHz alike; runs that
    # recorded no clock (before it was recorded) are pooled by the name alone.
    xeon = "Intel(R) Xeon(R) Processor"
    runs = [
        _run(xeon, {PLAIN: [100, 100], LOCKED: [80, 80]}, mhz=2100.0),
        _run(xeon, {PLAIN: [100, 100], LOCKED: [95, 95]}, mhz=2599.998),
        _run(xeon, {PLAIN: [100, 100], LOCKED: [90, 90]}),
    ]
    pooled = pool(runs)
    assert set(pooled) == {f"{xeon}, 2.1 GHz", f"{xeon}, 2.6 GHz", xeon}
    assert pooled[f"{xeon}, 2.6 GHz"]["2"][LOCKED, PLAIN].ratios == pytest.approx([0.95, 0.95])


def test_runs_against_two_redis_server_versions_are_pooled_apart() -> None:
    runs = [_run("A", {PLAIN: [100, 100], LOCKED: [80, 80]}) for _ in range(2)]
    runs[0]["machine"]["redis_server"] = "6.2.14"
    runs[1]["machine"]["redis_server"] = "7.0.15"
    assert set(pool(runs)) == {"A, redis-server 6.2.14", "A, redis-server 7.0.15"}


def test_the_command_prints_a_verdict_per_worker_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = []
    for number, locked in enumerate(([97.0, 98.0, 99.0], [96.0, 97.0, 98.0])):
        path = tmp_path / f"run{number}.json"
        path.write_text(json.dumps(_run("AMD EPYC", {PLAIN: [100.0] * 3, LOCKED: locked})))
        files.append(str(path))
    assert main(files) == 0
    out = capsys.readouterr().out
    assert "worker rate, 2 runs pooled" in out
    assert "AMD EPYC" in out
    assert "| 2 | 6 | 2 | 0.975 [0.96, 0.99] met |" in " ".join(out.split())


def test_the_command_says_when_runs_measured_different_versions_of_the_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = []
    for number, commit in enumerate(("aaa111", "bbb222", "bbb222", None)):
        run = _run("AMD EPYC", {PLAIN: [100.0] * 3, LOCKED: [97.0, 98.0, 99.0]})
        if commit:
            run["machine"]["commit"] = commit
        path = tmp_path / f"run{number}.json"
        path.write_text(json.dumps(run))
        files.append(str(path))
    assert main(files) == 0
    out = capsys.readouterr().out
    assert (
        "celery-lock at aaa111, bbb222 and at commits some runs did not record"
        " (different versions of the code may be pooled as one)"
    ) in out
    assert main(files[1:3]) == 0
    out = capsys.readouterr().out
    assert "celery-lock at bbb222\n" in out
    assert "different versions" not in out


def _cycles(cpu: str, rates: dict[str, list[float]]) -> dict[str, Any]:
    contenders = {name: {"samples": r} for name, r in rates.items()}
    return {"machine": {"cpu": cpu}, "lockcycle": {"contenders": contenders}}


def test_lock_cycles_are_pooled_per_machine_and_held_against_the_goal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # celery-lock's cycle keeps 0.7 of the floor's in every round, however fast the round.
    first = _cycles("A", {FLOOR: [1000, 2000, 4000], CELERY_LOCK: [700, 1400, 2800]})
    second = _cycles("A", {FLOOR: [500, 900, 3000], CELERY_LOCK: [350, 630, 2100]})
    pooled = pool_lock_cycles([first, second])
    assert pooled["A"][CELERY_LOCK, FLOOR].ratios == pytest.approx([0.7] * 6)
    assert (CELERY_LOCK, SCRIPTED_FLOOR) not in pooled["A"]  # that floor did not run
    files = []
    for number, run in enumerate((first, second)):
        path = tmp_path / f"cycles{number}.json"
        path.write_text(json.dumps(run))
        files.append(str(path))
    assert main(files) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "lock cycles per second, 2 runs pooled" in out
    assert "| A | 6 | 2 | 0.700 [0.70, 0.70] missed |" in out


def test_the_command_refuses_runs_without_a_section_it_pools(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "storm-only.json"
    path.write_text(json.dumps({"machine": {"cpu": "x"}, "storm": {}}))
    assert main([str(path)]) == 2
    assert "none of these runs has an endtoend or lockcycle section" in capsys.readouterr().err


def _rows(text: str) -> dict[str, list[str]]:
    """Table rows by worker size: the cells after it, verdicts and the rounds column dropped."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and cells[0] in {"1", "2", "4"}:
            rows[cells[0]] = [VERDICT.sub("", cell) for cell in cells[1:] if "[" in cell]
    return rows


@pytest.fixture(scope="module")
def kept_runs_pooled() -> str:
    """What ``python -m bench.pool docs/benchmarks/runs/*.json`` prints: pooled once for every
    table the docs quote from it."""
    runs = sorted(str(path) for path in (ROOT / "docs" / "benchmarks" / "runs").glob("*.json"))
    assert runs
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(runs) == 0
    return out.getvalue()


@pytest.mark.parametrize(
    ("machine", "table_starts", "table_ends"),
    [
        ("Intel(R) Xeon(R) Processor, 2.6 GHz", "On an Intel machine at 2.6 GHz", "There the goal"),
        (
            "Intel(R) Xeon(R) Processor, 2.0 GHz",
            "On a fourth Intel machine, at 2.0 GHz",
            "There celery-lock",
        ),
        ("AMD EPYC, 2.6 GHz", "On an AMD EPYC machine at 2.6 GHz", "Every interval there"),
    ],
    ids=["intel-2.6", "intel-2.0", "amd-2.6"],
)
def test_the_docs_table_is_what_the_runs_kept_with_the_docs_give(
    kept_runs_pooled: str, machine: str, table_starts: str, table_ends: str
) -> None:
    # docs/benchmarks.md quotes the pooled runs in docs/benchmarks/runs/: the figures must be
    # the ones bench.pool computes from them, cell for cell.
    section = kept_runs_pooled.split(f"{machine}, redis-server 6.2.14:")[1]
    pooled = _rows(section.split(":\n", maxsplit=1)[0])  # up to the next heading
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    quoted = _rows(page.split(table_starts)[1].split(table_ends)[0])
    assert set(quoted) == {"1", "2", "4"}
    for size, cells in quoted.items():
        assert cells == pooled[size][: len(cells)], size


@pytest.mark.parametrize(
    ("name", "content"), [("missing.json", None), ("broken.json", "{"), ("list.json", "[]")]
)
def test_the_command_names_a_file_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, content: str | None
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        main([str(path)])
    assert exit_.value.code == 2
    assert f"{path}: not a result file python -m bench wrote" in capsys.readouterr().err
