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
