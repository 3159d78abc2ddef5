"""What the CTranslate2 engine needs to know about a converted model directory before loading it.

CTranslate2 takes and returns token strings, so the engine maps ids through the model's own vocabulary file. The
kind of model (encoder-decoder or decoder-only) shows in which vocabulary files the converter wrote, and the
longest sequence a model can take is the row count of its position table, read from the headers of model.bin
(the weights are skipped, not loaded). Models without a position table (T5's relative attention, rotary
embeddings) are bounded by the tokenizer's `model_max_length` when the directory has one.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from transerve.core.errors import unavailable

#: Used when neither a position table nor a tokenizer limit says otherwise (CTranslate2's own input default).
DEFAULT_MAX_LENGTH = 1024


@dataclass(frozen=True, slots=True)
class Ct2ModelInfo:
    is_encoder_decoder: bool
    #: Token strings by id: the target (decoder) vocabulary.
    target_vocabulary: list[str]
    #: Token strings by id for the encoder's input; the target vocabulary for decoder-only models.
    source_vocabulary: list[str]
    eos_token_ids: list[int]
    #: Rows of the encoder's position table; None when it has none (encoder-decoder models only).
    encoder_positions: int | None
    #: Rows of the decoder's position table: its prompt (decoder-only) plus all it generates must fit.
    decoder_positions: int | None
    #: The input limit where a position table says nothing.
    default_max_input: int


def _read_vocabulary(path: Path) -> list[str]:
    if path.suffix == ".json":
        return json.loads(path.read_text(encoding="utf-8"))
    return path.read_text(encoding="utf-8").rstrip("\n").split("\n")


def _find_vocabulary(model_dir: Path, stem: str) -> Path | None:
    for suffix in (".json", ".txt"):
        path = model_dir / f"{stem}{suffix}"
        if path.is_file():
            return path
    return None


def _variable_shapes(model_bin: BinaryIO) -> dict[str, list[int]]:
    """Each variable's shape from model.bin's headers (format of ctranslate2.specs.ModelSpec._serialize)."""

    def read(fmt: str) -> int:
        return struct.unpack(fmt, model_bin.read(struct.calcsize(fmt)))[0]

    def read_string() -> str:
        return model_bin.read(read("H"))[:-1].decode("utf-8")

    read("I")  # binary version
    read_string()  # spec name
    read("I")  # spec revision
    shapes = {}
    for _ in range(read("I")):
        name = read_string()
        shapes[name] = [read("I") for _ in range(read("B"))]
        read("B")  # dtype
        model_bin.seek(read("I"), 1)
    for _ in range(read("I")):
        alias, target = read_string(), read_string()
        if target in shapes:
            shapes[alias] = shapes[target]
    return shapes


def _tokenizer_limit(model_dir: Path) -> int | None:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return None
    limit = json.loads(path.read_text(encoding="utf-8")).get("model_max_length")
    # transformers writes a huge sentinel (1e30) when the tokenizer has no limit.
    return int(limit) if isinstance(limit, int | float) and 0 < limit < 1_000_000 else None


def _eos_ids(model_dir: Path, config: dict, vocabulary: list[str]) -> list[int]:
    """The converter's eos token, plus any further ones generation_config.json lists (Llama 3 has several)."""
    index = {token: i for i, token in reversed(list(enumerate(vocabulary)))}
    ids = [index[config["eos_token"]]] if config.get("eos_token") in index else []
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        extra = json.loads(generation_config.read_text(encoding="utf-8")).get("eos_token_id")
        for token_id in extra if isinstance(extra, list) else [extra] if isinstance(extra, int) else []:
            if token_id not in ids and 0 <= token_id < len(vocabulary):
                ids.append(token_id)
    return ids


def read_model_info(model_dir: Path) -> Ct2ModelInfo:
    """UNAVAILABLE when `model_dir` is not a CTranslate2 model directory."""
    model_bin = model_dir / "model.bin"
    if not model_bin.is_file():
        raise unavailable(f"{model_dir} is not a CTranslate2 model directory (no model.bin)")
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    shared = _find_vocabulary(model_dir, "shared_vocabulary")
    source, target = _find_vocabulary(model_dir, "source_vocabulary"), _find_vocabulary(model_dir, "target_vocabulary")
    decoder_only = _find_vocabulary(model_dir, "vocabulary")
    if shared is not None or (source is not None and target is not None):
        is_encoder_decoder = True
        source_vocabulary = _read_vocabulary(shared or source)
        target_vocabulary = source_vocabulary if shared is not None else _read_vocabulary(target)
    elif decoder_only is not None:
        is_encoder_decoder = False
        source_vocabulary = target_vocabulary = _read_vocabulary(decoder_only)
    else:
        raise unavailable(f"{model_dir} has no CTranslate2 vocabulary file")
    with model_bin.open("rb") as stream:
        shapes = _variable_shapes(stream)

    def positions(prefix: str) -> int | None:
        shape = shapes.get(f"{prefix}/position_encodings/encodings")
        return shape[0] if shape else None

    return Ct2ModelInfo(
        is_encoder_decoder=is_encoder_decoder,
        target_vocabulary=target_vocabulary,
        source_vocabulary=source_vocabulary,
        eos_token_ids=_eos_ids(model_dir, config, target_vocabulary),
        encoder_positions=positions("encoder") if is_encoder_decoder else None,
        decoder_positions=positions("decoder"),
        default_max_input=_tokenizer_limit(model_dir) or DEFAULT_MAX_LENGTH,
    )
