"""docs/tutorials/python-backend-ensembles.md, run as the page shows it: its files written where it says, its
shell commands run (transerve as `python -m transerve`, the server on free ports), its client against that
server, with a small random-weight classifier as `my-model`; labels and scores checked against transformers,
and the classifier's statistics showing that the dynamic batcher joined requests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support import REPO_ROOT, start_transerve
from support.doc_blocks import captioned_files, code_blocks, commands
from support.hf_models import LABELS, build_tiny_model

PAGE = REPO_ROOT / "docs" / "tutorials" / "python-backend-ensembles.md"


def expected(folder: Path, texts: list[str]) -> list[tuple[str, float]]:
    """transformers' labels and probabilities for `texts`, each padded to the page's 64 tokens as the page does."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        logits = model(**tokenizer(texts, padding="max_length", max_length=64, truncation=True,
                                   return_tensors="pt")).logits
    probabilities = torch.softmax(logits, dim=1).numpy()
    return [(LABELS[int(row.argmax())], float(row.max())) for row in probabilities]


def test_the_tutorial_runs_as_written(tmp_path: Path):
    pytest.importorskip("transformers")
    build_tiny_model("seqcls", tmp_path / "my-model")
    install, layout, serve, stats = (commands(block) for block in code_blocks(PAGE, "bash"))
    assert install == ["pip install -e '.[export]' 'tritonclient[http]'"]  # the suite's environment has both
    for command in layout:
        subprocess.run(command, shell=True, cwd=tmp_path, check=True, timeout=60)
    files = captioned_files(PAGE)
    assert sorted(files) == sorted(f"pipeline/{model}/{file}" for model in ("preprocess", "classifier", "postprocess")
                                   for file in ("config.pbtxt", "1/model.py")) + ["pipeline/sentiment/config.pbtxt"]
    for path, text in files.items():
        (tmp_path / path).write_text(text)
    assert serve == ["transerve serve --model-repository pipeline"]
    (client,) = [block for block in code_blocks(PAGE, "python") if "tritonclient" in block]
    with start_transerve(tmp_path / "pipeline") as server:
        printed = subprocess.run([sys.executable, "-c", client.replace("localhost:8000", server.http_url)],
                                 capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
        (curl,) = stats
        answer = subprocess.run(curl.replace("localhost:8000", server.http_url), shell=True, capture_output=True,
                                text=True, timeout=30, check=True).stdout
    reviews = [line.split(" ", 2)[2] for line in printed]
    assert len(reviews) == 16
    for line, (label, score) in zip(printed, expected(tmp_path / "my-model", reviews), strict=True):
        got_label, got_score, _ = line.split(" ", 2)
        assert got_label == label
        np.testing.assert_allclose(float(got_score), score, atol=2e-4)
    (model,) = json.loads(answer)["model_stats"]
    assert model["inference_count"] == 16
    assert model["execution_count"] < 16, model  # the batcher joined requests
