"""The one table of `make bench` (bench/table.py, python -m bench) with made-up figures: medians
and ratios, the goals' verdicts, the printed table, bench/results.json. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.table import (
    Figure,
    at_most,
    below,
    equal_to,
    floor_plus,
    markdown,
    measured,
    number,
    ratio_at_most,
    render,
    results,
)

ROOT = Path(__file__).resolve().parents[2]


def test_a_figure_is_the_median_of_its_repeats_and_its_ratio_the_median_of_theirs():
    f = measured("b", "x", "ms", [3.0, 10.0, 4.0], [1.0, 2.0, 2.0], floor_how="two writes")
    assert (f.value, f.floor, f.repeats) == (4.0, 2.0, 3)
    # per-repeat ratios 3, 5, 2: the median is 3, not 4 / 2
    assert f.ratio == 3.0
    assert f.samples == (3.0, 10.0, 4.0) and f.floors == (1.0, 2.0, 2.0)
    bare = measured("b", "y", "MiB", [70.0])
    assert (bare.floor, bare.ratio, bare.goal, bare.met) == (None, None, None, None)


def test_values_and_floors_must_pair_up():
    with pytest.raises(ValueError, match="2 values but 1 floors"):
        measured("b", "x", "ms", [1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        measured("b", "x", "ms", [])


@pytest.mark.parametrize(
    ("goal", "values", "floors", "met"),
    [
        (ratio_at_most(3), [3.0], [1.0], True),
        (ratio_at_most(3), [3.1], [1.0], False),
        (ratio_at_most(0.25), [20.0], [100.0], True),
        (at_most(80, "MiB"), [80.0], None, True),
        (at_most(80, "MiB"), [80.5], None, False),
        (below(2, "MiB"), [2.0], None, False),
        (below(2, "MiB"), [1.9], None, True),
        (equal_to(0), [0.0], None, True),
        (equal_to(0), [1.0], None, False),
        (floor_plus(0.3, "s"), [0.55], [0.3], True),
        (floor_plus(0.3, "s"), [0.65], [0.3], False),
    ],
)
def test_goals(goal, values, floors, met):
    assert measured("b", "x", "u", values, floors, goal=goal).met is met


def test_a_ratio_goal_without_a_floor_is_not_met():
    assert measured("b", "x", "ms", [1.0], goal=ratio_at_most(3)).met is False
    assert measured("b", "x", "s", [1.0], goal=floor_plus(0.3, "s")).met is False


def test_goal_texts():
    assert ratio_at_most(3).text == "<= 3x floor"
    assert ratio_at_most(0.25).text == "<= 0.25x floor"
    assert at_most(80, "MiB").text == "<= 80 MiB"
    assert below(2, "MiB").text == "< 2 MiB"
    assert equal_to(0).text == "= 0"
    assert floor_plus(0.3, "s").text == "<= floor + 0.3 s"


@pytest.mark.parametrize(
    ("value", "unit", "text"),
    [
        (3.24, "ms", "3.24 ms"),
        (32.71, "ms", "32.7 ms"),
        (261.4, "ms", "261 ms"),
        (1234.5, "ms", "1,234 ms"),
        (0.4567, "ms", "0.457 ms"),
        (5.0, "count", "5"),
        (0.0, "count", "0"),
        (2.5, "", "2.50"),
        (float("inf"), "ms", "inf ms"),
    ],
)
def test_numbers(value, unit, text):
    assert number(value, unit) == text


def figures():
    return [
        measured("prepare", "prepare p50", "ms", [3.0, 3.2], [1.0, 1.0],
                 floor_how="two fsync'd writes", goal=ratio_at_most(3)),
        measured("prepare", "prepare p99", "ms", [6.0], [1.0],
                 floor_how="two fsync'd writes", goal=ratio_at_most(5)),
        measured("coldstart", "exec to GetInfo", "s", [0.5], [0.3],
                 floor_how="python -c import", goal=floor_plus(0.3, "s")),
        measured("rss", "steady RSS", "MiB", [70.0], goal=at_most(80, "MiB")),
        measured("slices", "build p50", "ms", [5.1]),
    ]  # fmt: skip


def test_the_table_has_one_row_per_figure_and_a_legend_of_the_floors():
    lines = render(figures())
    assert lines[0].split() == ["benchmark", "figure", "value", "floor", "ratio", "goal", "met?"]
    assert set(lines[1]) <= {"-", " "}
    rows = lines[2:7]
    assert [r.split()[0] for r in rows] == ["prepare", "prepare", "coldstart", "rss", "slices"]
    p50, p99, start, rss, build = rows
    assert "3.10 ms" in p50 and "1.00 ms [a]" in p50 and "3.10x" in p50 and p50.endswith("NO")
    assert "[a]" in p99 and "6.00x" in p99 and p99.endswith("NO")
    assert "0.5 s" in start and "[b]" in start and start.endswith("yes")
    assert "70.0 MiB" in rss and rss.endswith("yes")
    assert build.split()[-4:] == ["-", "-", "-", "-"]
    text = "\n".join(lines)
    assert "  [a] two fsync'd writes" in text
    assert "  [b] python -c import" in text
    assert lines[-1] == "goals met: 2 of 4"
    # every row is as wide as the header's columns: the columns line up
    starts = [lines[0].index("value"), lines[0].index("goal")]
    assert all(len(r) >= starts[1] for r in rows)


def test_the_markdown_table():
    lines = markdown(figures())
    assert lines[0].startswith("| benchmark | figure | value |")
    assert len(lines) == 2 + 5
    assert (
        lines[2] == "| prepare | prepare p50 | 3.10 ms | 1.00 ms [a] | 3.10x | <= 3x floor | NO |"
    )
    assert "| 0.3 s [b] |" in lines[4] and "| - | - |" in lines[-1]


def test_the_markdown_table_of_a_results_json(tmp_path, capsys):
    from bench.table import main as table_main

    doc = results(
        figures(),
        quick=False,
        started=0.0,
        wall_s=450.0,
        benchmarks={},
        machine_info={
            "cpus": 2,
            "load_average_before": [1.5, 1, 1],
            "load_average_after": [2, 1, 1],
        },
    )
    assert markdown(doc["figures"]) == markdown(figures())
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    assert table_main([str(path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == (
        "1970-01-01T00:00:00Z, 2 CPUs, wall time 7.5 min, 1-minute load average 1.50 before and"
        " 2.00 after; goals met: 2 of 4"
    )
    table = markdown(figures())
    assert printed[2 : 2 + len(table)] == table
    assert printed[2 + len(table) :] == ["", "- [a] two fsync'd writes", "- [b] python -c import"]


def test_results_json_shape():
    doc = results(
        figures(),
        quick=True,
        started=0.0,
        wall_s=12.5,
        benchmarks={"prepare": {"wall_s": 10.0, "figures": 2}},
        machine_info={"cpus": 2},
    )
    doc = json.loads(json.dumps(doc))  # plain JSON
    assert doc["started"] == "1970-01-01T00:00:00Z"
    assert (doc["quick"], doc["wall_s"], doc["machine"]) == (True, 12.5, {"cpus": 2})
    assert doc["goals"] == {"met": 2, "missed": 2, "total": 4}
    first = doc["figures"][0]
    assert first == {
        "benchmark": "prepare",
        "name": "prepare p50",
        "value": 3.1,
        "unit": "ms",
        "floor": 1.0,
        "floor_how": "two fsync'd writes",
        "ratio": 3.1,
        "goal": "<= 3x floor",
        "met": False,
        "repeats": 2,
        "samples": [3.0, 3.2],
        "floors": [1.0, 1.0],
        "note": None,
    }
    assert doc["figures"][-1]["goal"] is None and doc["figures"][-1]["met"] is None


def fake(figs: list[Figure], seen: list[bool]):
    def run(quick: bool) -> list[Figure]:
        seen.append(quick)
        return figs

    return run


def broken(quick: bool) -> list[Figure]:
    raise RuntimeError("the daemon did not start")


def test_a_run_of_all_prints_one_table_and_writes_results_json(tmp_path, capsys):
    seen: list[bool] = []
    fs = figures()
    benchmarks = {"one": fake(fs[:2], seen), "two": fake(fs[2:], seen)}
    out = tmp_path / "results.json"
    assert main(["--quick"], benchmarks, out) == 0
    assert seen == [True, True]
    printed = capsys.readouterr().out
    assert printed.count("benchmark  figure") == 1
    assert "goals met: 2 of 4" in printed
    doc = json.loads(out.read_text())
    assert doc["quick"] is True
    assert [f["name"] for f in doc["figures"]] == [f.name for f in fs]
    assert set(doc["benchmarks"]) == {"one", "two"}


def test_naming_a_benchmark_runs_it_alone_and_leaves_results_json_alone(tmp_path, capsys):
    seen: list[bool] = []
    benchmarks = {"one": fake(figures()[:1], seen), "two": fake(figures()[1:], seen)}
    out = tmp_path / "results.json"
    assert main(["two"], benchmarks, out) == 0
    assert seen == [False]
    assert not out.exists()
    assert "prepare p99" in capsys.readouterr().out
    assert main(["three"], benchmarks, out) == 2


def test_a_failing_benchmark_is_reported_and_the_others_still_run(tmp_path, capsys):
    seen: list[bool] = []
    benchmarks = {"bad": broken, "good": fake(figures()[:1], seen)}
    out = tmp_path / "results.json"
    assert main([], benchmarks, out) == 1
    printed = capsys.readouterr().out
    assert "bad: FAILED" in printed and "the daemon did not start" in printed
    assert "prepare p50" in printed
    doc = json.loads(out.read_text())
    assert doc["benchmarks"]["bad"]["error"] == "RuntimeError: the daemon did not start"
    assert len(doc["figures"]) == 1


def test_make_bench_quick_passes_the_flag():
    def dry(*args: str) -> str:
        done = subprocess.run(
            ["make", "-n", "bench", *args],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        return next(line.rstrip() for line in done.stdout.splitlines() if "-m bench" in line)

    assert dry("QUICK=1").endswith("-m bench --quick")
    assert dry().endswith("-m bench")


def test_results_json_is_ignored_by_git():
    done = subprocess.run(
        ["git", "check-ignore", "bench/results.json", "bench/results/prepare.json"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.stdout.split() == ["bench/results.json", "bench/results/prepare.json"]
