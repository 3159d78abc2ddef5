"""benchmarks/gpu_check.py, issue 22's GPU check: no GPU here, so its dry run (tiny models, float32, on the CPU,
the GPU tests only collected) goes through every part once and must print every row of the table for both models,
without errors, and the goals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("ctranslate2")
pytest.importorskip("aiohttp")


@pytest.mark.slow
def test_the_dry_run_goes_through_every_part_and_prints_the_issues_table(tmp_path: Path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT))  # benchmarks run as modules from the repository root
    from benchmarks.gpu_check import ROWS

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)]))
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--workdir", str(tmp_path),
                             "--profile", "0.5"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = result.stdout
    assert "no GPU (dry run on the CPU)" in report
    lines = report.splitlines()
    for key, label in ROWS:
        start = "| " + label.format(rows=8, clients=8, small=4, threads=2) + " |"
        (row,) = [line for line in lines if line.startswith(start)]
        cells = [cell.strip() for cell in row.removeprefix(start).strip(" |").split("|")]
        assert len(cells) == 2 and all(cell and "errors" not in cell for cell in cells), (key, row)
    assert "Time to first token at concurrency 1" in report and "Goals (issue 22)" in report
    assert sum(line.startswith("| served in-flight") for line in lines) == 4  # two goals, two models
    assert "GPU tests: " in report and "collected" in report
    assert "not served" not in report
    for model in ("t5", "gpt2"):  # --profile: each model's engine under torch's profiler, its ops on stderr
        assert f"profile: {model}, engine alone, inflight, 8 rows" in result.stderr
    assert "Self CPU time total" in result.stderr
    for model in ("t5", "gpt2"):  # each model's attention calls by kind, with the kernel torch can take
        assert f"{model}: attention kernels by call (engine alone, in-flight, 8 rows)" in result.stderr
    assert " calls  math " in result.stderr  # on the CPU torch's CUDA checks refuse every call


def test_configs_of_an_engine_not_installed_are_left_out(monkeypatch, capsys):
    """The GPU machine has no CTranslate2 unless its wheel is carried there: the check then runs the torch rows
    instead of failing when it converts the first CTranslate2 model."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from benchmarks import gpu_check

    real = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec",
                        lambda name, *a: None if name == "ctranslate2" else real(name, *a))
    configs = gpu_check.installed(gpu_check.served_configs(64, "float16"))
    assert {served.engine for served in configs.values()} == {"torch"}
    assert set(configs) == {"served_inflight_rows", "served_inflight_default", "served_static_rows", "torch_stream"}
    assert "ctranslate2 is not installed" in capsys.readouterr().err
