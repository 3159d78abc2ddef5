"""Loading a transformers model for the torch engine: on its device, its linear layers swapped for oneDNN's, on a
thread that ends with the load, and the facts (`ModelFacts`) the scheduler and token selection read of it. A part of
its own because it runs once per instance, before anything decodes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transerve.backends.generation.torch.sampling import ModelRules
from transerve.backends.threaded import import_engine
from transerve.backends.torch_attention import use_decoding_attention
from transerve.core.errors import invalid_arg

if TYPE_CHECKING:

    pass

logger = logging.getLogger(__name__)

COMPUTE_TYPES = ("float32", "float16", "bfloat16")
#: Longest source of a model without absolute positions (T5) whose tokenizer does not say.
DEFAULT_MAX_INPUT_LENGTH = 512


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What admission and token selection need to know of the model, read once at load."""

    is_encoder_decoder: bool
    eos_token_ids: list[int]
    vocab_size: int
    #: Decoder positions (absolute position embeddings), None when unbounded (relative).
    max_positions: int | None
    max_input_length: int
    early_stopping: bool | str
    #: The constraints of the model's generation config that `generate` applies whatever the call asks.
    rules: ModelRules
    #: The decoder start token (encoder-decoder models), and the padding token.
    start_id: int | None
    pad_id: int


def load(model_dir: Path, device: str, compute_type: str, onednn_linear: bool) -> tuple[Any, bool, ModelFacts]:
    """The model on its device, whether its linear layers compute on oneDNN (`onednn_linear`: CPU float32 only),
    and its facts."""
    import_engine("torch", "generation")
    transformers = import_engine("transformers", "generation")
    if compute_type not in COMPUTE_TYPES:
        raise invalid_arg(f"compute_type {compute_type!r} is not one of {', '.join(COMPUTE_TYPES)} for torch")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    encoder_decoder = bool(config.is_encoder_decoder)
    loader = transformers.AutoModelForSeq2SeqLM if encoder_decoder else transformers.AutoModelForCausalLM
    model, onednn = _on_own_thread(lambda: _load_model(loader, model_dir, device, compute_type, onednn_linear))
    generation = model.generation_config
    eos = generation.eos_token_id if generation.eos_token_id is not None else getattr(config, "eos_token_id", None)
    eos_token_ids: list[int] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    text = config.get_text_config(decoder=True)
    pad = generation.pad_token_id if generation.pad_token_id is not None else getattr(config, "pad_token_id", None)
    pad = pad if pad is not None else (eos_token_ids[0] if eos_token_ids else 0)
    start = generation.decoder_start_token_id
    if start is None:
        start = getattr(config, "decoder_start_token_id", None)
        start = start if start is not None else getattr(config, "bos_token_id", None)
    if encoder_decoder and start is None:
        raise invalid_arg(f"{model_dir}: the model names no decoder_start_token_id")
    facts = ModelFacts(
        is_encoder_decoder=encoder_decoder,
        eos_token_ids=eos_token_ids,
        vocab_size=text.vocab_size,
        max_positions=_max_positions(text),
        max_input_length=_max_input_length(model_dir, config),
        early_stopping=generation.early_stopping,
        rules=_model_rules(generation, encoder_decoder),
        start_id=start,
        pad_id=pad,
    )
    return model, onednn, facts


def _load_model(loader: Any, model_dir: Path, device: str, compute_type: str, onednn_linear: bool) -> tuple[Any, bool]:
    """The model on its device, and whether its linear layers compute on oneDNN (`onednn_linear`: CPU float32)."""
    import torch

    use_decoding_attention(torch, torch.device(device))  # the key length changes every step
    model = loader.from_pretrained(model_dir, dtype=getattr(torch, compute_type))
    model.to(torch.device(device)).eval()
    if not (onednn_linear and model.device.type == "cpu" and compute_type == "float32"):
        return model, False
    from transerve.backends.generation.torch.onednn_linear import onednn_available, use_onednn_linears

    if onednn_available(torch):
        return model, use_onednn_linears(model) > 0
    logger.warning("%s: this torch build has no working oneDNN linear; using torch's own", model_dir)
    return model, False


def _on_own_thread(function: Callable[[], Any]) -> Any:
    """`function()` on a thread that ends with it. torch's OpenMP runtime (libgomp) keeps a pool of worker threads
    for each thread that has run a parallel region, for as long as that thread lives; once a process holds more
    such threads than cores, every pool's workers stop spinning between regions and go to sleep, and waking them
    costs each parallel region time. Loading runs parallel regions (packing weights for oneDNN does), so it must
    not leave a pool behind in the caller's thread (an executor's, which lives on), or the engine thread decodes
    slower (benchmarks/README.md, "Figures behind the code")."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-generation-load") as loader:
        return loader.submit(function).result()


def _model_rules(generation: Any, encoder_decoder: bool) -> ModelRules:
    """The constraints of the model's generation config that `generate` applies whatever the call asks."""
    forced_last = generation.forced_eos_token_id
    return ModelRules(
        bad_words=[list(word) for word in generation.bad_words_ids or []],
        forced_first=generation.forced_bos_token_id if encoder_decoder else None,
        forced_last=None if forced_last is None else [forced_last] if isinstance(forced_last, int) else forced_last,
        no_repeat_ngram_size=generation.no_repeat_ngram_size or 0,
    )


def _max_positions(config: Any) -> int | None:
    """Decoder positions the model has (absolute position embeddings), None when unbounded (relative)."""
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _max_input_length(model_dir: Path, config: Any) -> int:
    """Longest input: the model's position table, else the tokenizer's `model_max_length`, else 512."""
    positions = _max_positions(config)
    if positions is not None:
        return positions
    tokenizer_config = model_dir / "tokenizer_config.json"
    if tokenizer_config.is_file():
        value = json.loads(tokenizer_config.read_text()).get("model_max_length")
        if isinstance(value, int) and 0 < value < 1_000_000:
            return value
    return DEFAULT_MAX_INPUT_LENGTH
