"""docs/tutorials/hf-onnx-ensembles.md, run as the page shows it: its shell commands (transerve as `python -m
transerve`, the server on free ports), its Python blocks against that server, on small random-weight models in
place of the page's checkpoints."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO_ROOT, start_transerve
from support.doc_blocks import code_blocks, commands
from support.hf_models import build_tiny_model, minilm_path

PAGE = REPO_ROOT / "docs" / "tutorials" / "hf-onnx-ensembles.md"
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH")])))


def run(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    argv = shlex.split(command)
    if argv[0] == "transerve":
        argv = [sys.executable, "-m", "transerve", *argv[1:]]
    return subprocess.run(argv, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


def base_bert(path: Path) -> Path:
    import transformers

    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=30522, max_position_embeddings=128)
    transformers.BertModel(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(minilm_path() / name, path / name)
    return path


@pytest.mark.slow  # three exports, a server of eleven models, 200 measured requests: about a minute on 2 cores
def test_the_tutorial_runs_as_written(tmp_path: Path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("transformers")
    build_tiny_model("seqcls", tmp_path / "sst2-model")
    build_tiny_model("qa", tmp_path / "squad-model")
    base_bert(tmp_path / "base-model")
    install, export, serve, measure, stats = (commands(block) for block in code_blocks(PAGE, "bash"))
    assert install == ["pip install -e '.[export]' 'tritonclient[http]'"]  # the suite's environment has both

    for command in export:
        result = run(command, tmp_path)
        assert result.returncode == 0, result.stderr
    # The refusal the page describes, of base-model as seqcls, with its words.
    refused = run("transerve export base-model --task seqcls --format onnx --output refused", tmp_path)
    assert refused.returncode == 2
    assert ("has no weights for the seqcls head (classifier.bias, classifier.weight would be random)"
            in refused.stderr)

    assert serve == ["transerve serve --model-repository model_repository"]
    (call,) = code_blocks(PAGE, "python")
    with start_transerve(tmp_path / "model_repository") as server:
        printed = subprocess.run([sys.executable, "-c", call.replace("localhost:8000", server.http_url)],
                                 capture_output=True, text=True, timeout=120, check=True).stdout
        assert printed.splitlines() == [
            "LOGITS (2, 3)",
            f"HIDDEN_STATE (2, {tokens(printed)}, 32)",
            f"START_LOGITS (2, {tokens(printed)}) END_LOGITS (2, {tokens(printed)})",
        ]
        (perf,) = measure
        measured = run(perf.replace("localhost:8000", server.http_url), tmp_path)
        assert measured.returncode in (0, 1), measured.stderr  # 1: a level did not stabilise on a busy machine
        assert "Request concurrency: 1" in measured.stdout and "Request concurrency: 4" in measured.stdout
        assert len(re.findall(r"Throughput: [\d.]+ infer/sec", measured.stdout)) == 2, measured.stdout
        for command in stats:
            result = run(command.replace("localhost:8000", server.http_url), tmp_path)
            (model,) = json.loads(result.stdout)["model_stats"]
            assert model["inference_count"] >= 201 and model["execution_count"] >= 1


def tokens(printed: str) -> int:
    return int(re.search(r"HIDDEN_STATE \(2, (\d+), 32\)", printed)[1])
