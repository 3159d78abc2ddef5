"""`transerve client` on ensembles `transerve export` wrote: the text input and the output found in the config
(a classifier's one BYTES output, `label`; an embedding ensemble's one output), or named with --output-name; the
lines equal what `infer` answers for the same texts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

httpclient = pytest.importorskip("tritonclient.http")

SRC = Path(__file__).resolve().parents[2] / "src"
TEXTS = ["A man is eating food.", "The new movie is awesome.", "안녕하세요 😀 naïve café", "", "Short."]


def client(server, tmp_path: Path, model: str, *args: str) -> list[str]:
    path, output = tmp_path / "input.txt", tmp_path / f"{model}{len(args)}.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    env = dict(os.environ, PYTHONPATH=str(SRC))
    done = subprocess.run([sys.executable, "-m", "transerve", "client", "-m", model, "-u", server.http_url,
                           "--input-file", str(path), "--output-file", str(output), "--batch-size", "2", *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return output.read_bytes().decode().split("\n")[:-1]


def infer(server, model: str, output: str) -> np.ndarray:
    texts = [text for text in TEXTS if text]
    tensor = httpclient.InferInput("input_text", [len(texts), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text.encode()] for text in texts], dtype=object))
    return httpclient.InferenceServerClient(server.http_url).infer(model, [tensor]).as_numpy(output)


def test_exported_ensembles_through_the_file_client(exported_server, tmp_path):
    labels = client(exported_server, tmp_path, "seqcls_ts")
    assert labels[3] == "" and [label for label in labels if label] == [
        label.decode() for label in infer(exported_server, "seqcls_ts", "label").reshape(-1)]
    for model, output, extra in (("seqcls_ts", "probabilities", ("--output-name", "probabilities")),
                                 ("minilm_ts", "embedding", ())):
        rows = [line for line in client(exported_server, tmp_path, model, *extra) if line]
        np.testing.assert_allclose([[float(value) for value in row.split(" ")] for row in rows],
                                   infer(exported_server, model, output), atol=1e-5)  # batched apart: padding differs
