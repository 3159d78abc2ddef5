"""What `transerve export` reads from a Hugging Face model folder, checked before anything heavy is imported."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"
)


class ExportError(Exception):
    """The export cannot go on; the message says why in one line."""


@dataclass(frozen=True, slots=True)
class ModelFolder:
    path: Path
    config: dict[str, Any]
    tokenizer_file: Path
    #: The longest input, in tokens: sentence-transformers' max_seq_length, else the tokenizer's and the model's.
    max_length: int
    pad_id: int
    #: sentence-transformers pooling ("mean" or "cls"; "mean" for a plain transformers folder) and whether the
    #: pipeline normalizes its embeddings.
    pooling: str
    normalize: bool

    @property
    def hidden_size(self) -> int:
        return int(self.config.get("hidden_size") or self.config.get("dim") or self.config.get("d_model") or 0)

    @property
    def labels(self) -> list[str]:
        """Class names in id order, as `id2label` gives them (LABEL_<i> where it has none)."""
        id2label = self.config.get("id2label") or {}
        count = int(self.config.get("num_labels") or len(id2label) or 2)
        return [str(id2label.get(str(index), id2label.get(index, f"LABEL_{index}"))) for index in range(count)]


def read_folder(path: Path) -> ModelFolder:
    """The folder's model, tokenizer and sentence-transformers settings; ExportError when it is not a
    Hugging Face model folder that can be exported."""
    where = f"'{path}' is not a Hugging Face model folder"
    if not path.is_dir():
        raise ExportError(f"{where}: no such folder")
    config = _json(path / "config.json", where)
    if config is None or "model_type" not in config:
        raise ExportError(f"{where}: it has no config.json with a model_type")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ExportError(f"{where}: it has no weights ({', '.join(WEIGHT_FILES[::2])})")
    tokenizer_file = path / "tokenizer.json"
    tokenizer = _json(tokenizer_file, where)
    if tokenizer is None:
        raise ExportError(f"'{path}' has no tokenizer.json (a fast tokenizer), which the tokenizer model needs")
    tokenizer_config = _json(path / "tokenizer_config.json", where) or {}
    sentence_config = _json(path / "sentence_bert_config.json", where) or {}
    limits = [
        sentence_config.get("max_seq_length"),
        tokenizer_config.get("model_max_length"),
        config.get("max_position_embeddings"),
    ]
    # sentence-transformers' own limit wins; otherwise the tightest of the tokenizer's and the model's.
    max_length = int(limits[0] or min((int(v) for v in limits[1:] if v and int(v) < 1_000_000), default=512))
    return ModelFolder(
        path=path,
        config=config,
        tokenizer_file=tokenizer_file,
        max_length=max_length,
        pad_id=_pad_id(tokenizer, config),
        pooling=_pooling(path, where),
        normalize=_normalizes(path, where),
    )


def _json(path: Path, where: str) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{where}: cannot read {path.name}: {exc}") from None


def _pad_id(tokenizer: dict[str, Any], config: dict[str, Any]) -> int:
    padding = tokenizer.get("padding") or {}
    if "pad_id" in padding:
        return int(padding["pad_id"])
    return int(config.get("pad_token_id") or 0)


def _pooling(path: Path, where: str) -> str:
    modules = _json(path / "modules.json", where) or []
    for module in modules:
        if module.get("type", "").endswith("Pooling"):
            settings = _json(path / module.get("path", "") / "config.json", where) or {}
            if settings.get("pooling_mode_cls_token"):
                return "cls"
            if not settings.get("pooling_mode_mean_tokens", True):
                raise ExportError(f"'{path}': only mean and CLS pooling are supported, not {settings}")
    return "mean"


def _normalizes(path: Path, where: str) -> bool:
    """sentence-transformers normalizes only with a Normalize module; a plain transformers folder is
    normalized (the embedding task's contract: unit vectors, cosine is a dot product)."""
    modules = _json(path / "modules.json", where)
    if modules is None:
        return True
    return any(module.get("type", "").endswith("Normalize") for module in modules)
