"""benchmarks/regression.py: the committed baseline covers every case, and the verdict follows the tolerance.

The measuring itself starts servers and takes a minute; these tests replace it, so they check only the comparison
and the exit codes a developer relies on before merging.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def regression(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT))  # benchmarks run as modules from the repository root
    from benchmarks import regression

    return regression


def measured(ratios: dict[str, float]) -> dict[str, dict[str, float]]:
    return {"reference": {"us": 20.0, "ratio": 1.0}, **{case: {"us": ratio * 20.0, "ratio": ratio}
                                                         for case, ratio in ratios.items()}}


def test_the_committed_baseline_names_every_case_and_a_tolerance(regression) -> None:
    baseline = json.loads(regression.BASELINE.read_text())
    assert set(baseline["cases"]) == set(regression.CASES)
    assert all(case["ratio"] > 0 for case in baseline["cases"].values())
    assert 0 < baseline["tolerance"] < 1


def test_a_ratio_past_the_tolerance_fails_and_one_within_it_passes(regression) -> None:
    baseline = {"cases": {"grpc": {"ratio": 10.0}, "http_json": {"ratio": 10.0}}}
    table, ok = regression.compare(measured({"grpc": 12.0, "http_json": 9.0}), baseline, 0.25)
    assert ok
    assert "+20%" in table and "-10%" in table
    table, ok = regression.compare(measured({"grpc": 13.0}), baseline, 0.25)
    assert not ok
    assert "SLOWER" in table


def test_a_case_without_a_baseline_does_not_fail(regression) -> None:
    table, ok = regression.compare(measured({"python_ipc": 50.0}), {"cases": {}}, 0.25)
    assert ok
    assert "no baseline" in table


def test_main_exits_1_when_slower_and_update_rewrites_the_baseline(regression, monkeypatch, tmp_path) -> None:
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps({"tolerance": 0.2, "cases": {"grpc": {"ratio": 10.0}}}))
    monkeypatch.setattr(regression, "measure", lambda cases, rounds, seconds: measured({"grpc": 13.0}))
    assert regression.main(["--cases", "grpc", "--baseline", str(path)]) == 1
    assert regression.main(["--cases", "grpc", "--baseline", str(path), "--tolerance", "0.5"]) == 0
    assert regression.main(["--cases", "grpc", "--baseline", str(path), "--update"]) == 0
    written = json.loads(path.read_text())
    assert written["cases"]["grpc"]["ratio"] == 13.0
    assert written["tolerance"] == 0.2
    assert regression.main(["--cases", "grpc", "--baseline", str(path)]) == 0


def test_the_reference_workload_is_timed(regression) -> None:
    assert regression.reference_us(repeats=200) > 0


def test_against_a_commit_compares_round_by_round_and_fails_past_the_margin(regression, monkeypatch) -> None:
    per = {"new": {"grpc": [11.0, 9.0, 10.5], "http_json": [30.0, 36.0, 33.0]},
           "old": {"grpc": [10.0, 10.0, 10.0], "http_json": [30.0, 30.0, 30.0]}}
    table, ok = regression.compare_against(per, "abc123", 0.10)
    assert ok  # grpc's median ratio is 1.05; http_json's 1.10, at the margin
    assert "| grpc | 10.5 | 10.0 | 1.050 | ok |" in table
    table, ok = regression.compare_against(per, "abc123", 0.05)
    assert not ok and "SLOWER by more than 5%" in table
    monkeypatch.setattr(regression, "measure_against", lambda cases, rounds, seconds, ref: per)
    assert regression.main(["--cases", "grpc,http_json", "--against", "abc123"]) == 0
    assert regression.main(["--cases", "grpc,http_json", "--against", "abc123", "--margin", "0.05"]) == 1


@pytest.mark.slow
def test_against_the_same_commit_serves_both_versions(regression) -> None:
    """Both versions really serve: HEAD against itself, one short round of the JSON case."""
    per = regression.measure_against(["http_json"], 1, 0.3, "HEAD")
    assert per["new"]["http_json"][0] > 0 and per["old"]["http_json"][0] > 0
