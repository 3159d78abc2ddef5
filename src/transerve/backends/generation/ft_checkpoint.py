"""FasterTransformer's converted checkpoints read back into Hugging Face models.

FasterTransformer's converters (`huggingface_t5_ckpt_convert.py`, `huggingface_gpt_convert.py` and the ones that
share their layout) write a folder `<N>-gpu/` holding `config.ini` and one raw little-endian float32 or float16 file
per tensor: 2-D weights transposed to `[in, out]`, and those FasterTransformer splits across N tensor-parallel ranks
written once per rank (`<name>.<rank>.bin`). This reverses that: every file is checked against the shape
`config.ini` implies (a truncated file fails the load naming it), the ranks are joined, the transposes undone,
and the tensors assigned to a `T5ForConditionalGeneration` or `GPT2LMHeadModel` whose config is rebuilt from
`config.ini`. The model is what the generation backend's engines load (docs/generation.md, "FasterTransformer
repositories").
"""

from __future__ import annotations

import configparser
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from transerve.backends.threaded import import_engine
from transerve.core.errors import unavailable

#: `model_type` values read here, and the Hugging Face class each becomes.
MODEL_TYPES = {"T5": "T5ForConditionalGeneration", "GPT": "GPT2LMHeadModel"}
_WEIGHT_TYPES = {"fp32": np.float32, "fp16": np.float16}


def read_checkpoint(folder: Path, model_type: str) -> Any:
    """The Hugging Face model (float32, CPU, eval mode) of the checkpoint in `folder`; UNAVAILABLE naming the file
    or setting at fault when the folder is not a complete checkpoint of `model_type`."""
    if model_type not in MODEL_TYPES:
        raise unavailable(f"model_type '{model_type}' is not one transerve reads; it reads {', '.join(MODEL_TYPES)}")
    if not folder.is_dir():
        raise unavailable(f"the checkpoint folder '{folder}' does not exist")
    ini = _read_ini(folder / "config.ini")
    reader = _read_t5 if model_type == "T5" else _read_gpt
    config, state = reader(ini, folder)
    return _assemble(MODEL_TYPES[model_type], config, state)


# ---- T5 ----------------------------------------------------------------------------------------------------------


def _read_t5(ini: configparser.ConfigParser, folder: Path) -> tuple[Any, dict[str, np.ndarray]]:
    transformers = import_engine("transformers", "generation")
    if not ini.has_section("encoder"):
        raise unavailable(f"{folder / 'config.ini'} has no [encoder] section: it is not a T5 checkpoint")
    encoder = ini["encoder"]
    decoder = ini["decoder"] if ini.has_section("decoder") and ini["decoder"] else None
    if decoder is None:
        raise unavailable(f"{folder / 'config.ini'} has no [decoder] section: an encoder-only T5 checkpoint cannot "
                          "generate")
    structure = ini["structure"] if ini.has_section("structure") else {}
    if _flag(structure.get("t5_with_bias", "false")) or structure.get("position_embedding_type", "relative") not in (
        "relative", "0"
    ):
        raise unavailable("this T5 checkpoint has biases or absolute position embeddings (a NeMo/Megatron T5); "
                          "transerve reads Hugging Face T5 checkpoints (huggingface_t5_ckpt_convert.py)")
    ff = encoder.get("feed_forward_proj", "relu")
    gated = ff.startswith("gated-") or _flag(structure.get("use_gated_activation", "false"))
    if gated and not ff.startswith("gated-"):
        ff = f"gated-{ff}"
    config = transformers.T5Config(
        vocab_size=_int(encoder, "vocab_size"), d_model=_int(encoder, "d_model"), d_kv=_int(encoder, "d_kv"),
        d_ff=_int(encoder, "d_ff"), num_layers=_int(encoder, "num_layers"),
        num_decoder_layers=_int(decoder, "num_layers"), num_heads=_int(encoder, "num_heads"),
        relative_attention_num_buckets=_int(encoder, "relative_attention_num_buckets_or_max_pos_seq_len"),
        relative_attention_max_distance=_int(encoder, "relative_attention_max_distance", 128),
        layer_norm_epsilon=float(encoder.get("layer_norm_epsilon", "1e-6")), feed_forward_proj=ff,
        tie_word_embeddings=_flag(encoder.get("tie_word_embeddings", "True")),
        pad_token_id=_optional_int(decoder, "pad_token_id", 0), eos_token_id=_optional_int(decoder, "eos_token_id", 1),
        decoder_start_token_id=_optional_int(decoder, "decoder_start_token_id", 0),
    )
    files = _Files(folder, _weight_type(encoder.get("weight_data_type", "fp32")), "encoder.block.0.layer.0."
                   "SelfAttention.q.weight")
    d, inner, ff_dim, vocab = config.d_model, config.num_heads * config.d_kv, config.d_ff, config.vocab_size
    state: dict[str, np.ndarray] = {}
    if files.exists("shared.weight_T"):
        state["shared.weight"] = files.whole("shared.weight_T", (vocab, d))
    else:
        state["shared.weight"] = files.whole("shared.weight", (d, vocab)).T
    if files.exists("lm_head.weight"):
        state["lm_head.weight"] = files.whole("lm_head.weight", (vocab, d))
    elif config.tie_word_embeddings:
        state["lm_head.weight"] = state["shared.weight"]
    else:
        files.whole("lm_head.weight", (vocab, d))  # raises: missing
    for stack in ("encoder", "decoder"):
        state[f"{stack}.embed_tokens.weight"] = state["shared.weight"]
        state[f"{stack}.final_layer_norm.weight"] = files.whole(f"{stack}.final_layer_norm.weight", (d,))
        layers = config.num_layers if stack == "encoder" else config.num_decoder_layers
        for i in range(layers):
            block = f"{stack}.block.{i}.layer"
            attention = f"{block}.0.SelfAttention"
            if stack == "encoder":
                for part in "qkv":
                    state[f"{attention}.{part}.weight"] = files.joined(f"{attention}.{part}.weight", (d, inner), -1).T
            else:
                qkv = files.joined(f"{attention}.qkv.weight", (d, 3, inner), -1)
                for index, part in enumerate("qkv"):
                    state[f"{attention}.{part}.weight"] = qkv[:, index, :].T
            state[f"{attention}.o.weight"] = files.joined(f"{attention}.o.weight", (inner, d), 0).T
            if i == 0:
                bias = f"{attention}.relative_attention_bias.weight"
                state[bias] = files.joined(bias, (config.num_heads, config.relative_attention_num_buckets), 0).T
            state[f"{block}.0.layer_norm.weight"] = files.whole(f"{block}.0.layer_norm.weight", (d,))
            feed_forward = 1
            if stack == "decoder":
                cross = f"{block}.1.EncDecAttention"
                for part in "qkv":
                    state[f"{cross}.{part}.weight"] = files.joined(f"{cross}.{part}.weight", (d, inner), -1).T
                state[f"{cross}.o.weight"] = files.joined(f"{cross}.o.weight", (inner, d), 0).T
                state[f"{block}.1.layer_norm.weight"] = files.whole(f"{block}.1.layer_norm.weight", (d,))
                feed_forward = 2
            dense = f"{block}.{feed_forward}.DenseReluDense"
            if gated:
                state[f"{dense}.wi_0.weight"] = files.joined(f"{dense}.wi.weight", (d, ff_dim), -1).T
                state[f"{dense}.wi_1.weight"] = files.joined(f"{dense}.wi2.weight", (d, ff_dim), -1).T
            else:
                state[f"{dense}.wi.weight"] = files.joined(f"{dense}.wi.weight", (d, ff_dim), -1).T
            state[f"{dense}.wo.weight"] = files.joined(f"{dense}.wo.weight", (ff_dim, d), 0).T
            norm = f"{block}.{feed_forward}.layer_norm.weight"
            state[norm] = files.whole(norm, (d,))
    return config, state


# ---- GPT ---------------------------------------------------------------------------------------------------------


def _read_gpt(ini: configparser.ConfigParser, folder: Path) -> tuple[Any, dict[str, np.ndarray]]:
    transformers = import_engine("transformers", "generation")
    if not ini.has_section("gpt"):
        raise unavailable(f"{folder / 'config.ini'} has no [gpt] section: it is not a GPT checkpoint")
    gpt = ini["gpt"]
    heads, layers = _int(gpt, "head_num"), _int(gpt, "num_layer")
    d = heads * _int(gpt, "size_per_head")
    inter, vocab, positions = _int(gpt, "inter_size", 4 * d), _int(gpt, "vocab_size"), _int(gpt, "max_pos_seq_len")
    config = transformers.GPT2Config(
        vocab_size=vocab, n_embd=d, n_layer=layers, n_head=heads, n_positions=positions, n_inner=inter,
        bos_token_id=_optional_int(gpt, "start_id", None), eos_token_id=_optional_int(gpt, "end_id", None),
        layer_norm_epsilon=float(gpt.get("layernorm_eps", "1e-5")),
    )
    files = _Files(folder, _weight_type(gpt.get("weight_data_type", "fp32")),
                   "model.layers.0.attention.query_key_value.weight")
    state = {
        "transformer.wte.weight": files.whole("model.wte", (vocab, d)),
        "transformer.wpe.weight": files.whole("model.wpe", (positions, d)),
        "transformer.ln_f.weight": files.whole("model.final_layernorm.weight", (d,)),
        "transformer.ln_f.bias": files.whole("model.final_layernorm.bias", (d,)),
    }
    tied = not files.exists("model.lm_head.weight")
    state["lm_head.weight"] = state["transformer.wte.weight"] if tied else files.whole("model.lm_head.weight",
                                                                                         (vocab, d))
    config.tie_word_embeddings = tied
    for i in range(layers):
        ft, hf = f"model.layers.{i}", f"transformer.h.{i}"
        for part in ("weight", "bias"):
            state[f"{hf}.ln_1.{part}"] = files.whole(f"{ft}.input_layernorm.{part}", (d,))
            state[f"{hf}.ln_2.{part}"] = files.whole(f"{ft}.post_attention_layernorm.{part}", (d,))
        state[f"{hf}.attn.c_attn.weight"] = files.joined(f"{ft}.attention.query_key_value.weight", (d, 3, d),
                                                         -1).reshape(d, 3 * d)
        state[f"{hf}.attn.c_attn.bias"] = files.joined(f"{ft}.attention.query_key_value.bias", (3, d), -1).reshape(-1)
        state[f"{hf}.attn.c_proj.weight"] = files.joined(f"{ft}.attention.dense.weight", (d, d), 0)
        state[f"{hf}.attn.c_proj.bias"] = files.whole(f"{ft}.attention.dense.bias", (d,))
        state[f"{hf}.mlp.c_fc.weight"] = files.joined(f"{ft}.mlp.dense_h_to_4h.weight", (d, inter), -1)
        state[f"{hf}.mlp.c_fc.bias"] = files.joined(f"{ft}.mlp.dense_h_to_4h.bias", (inter,), -1)
        state[f"{hf}.mlp.c_proj.weight"] = files.joined(f"{ft}.mlp.dense_4h_to_h.weight", (inter, d), 0)
        state[f"{hf}.mlp.c_proj.bias"] = files.whole(f"{ft}.mlp.dense_4h_to_h.bias", (d,))
    return config, state


# ---- files -------------------------------------------------------------------------------------------------------


class _Files:
    """The checkpoint's tensor files: whole (`<name>.bin`) or split per rank (`<name>.<rank>.bin`), each checked
    against its expected size before it is read."""

    def __init__(self, folder: Path, dtype: type[np.generic], probe: str) -> None:
        self.folder = folder
        self.dtype = np.dtype(dtype).newbyteorder("<")
        #: Tensor-parallel ranks: how many `<probe>.<rank>.bin` files there are in a row from 0.
        self.ranks = 0
        while (folder / f"{probe}.{self.ranks}.bin").is_file():
            self.ranks += 1
        if self.ranks == 0:
            raise unavailable(f"the checkpoint '{folder}' has no tensor file '{probe}.0.bin'")

    def exists(self, name: str) -> bool:
        return (self.folder / f"{name}.bin").is_file()

    def whole(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return self._read(f"{name}.bin", shape)

    def joined(self, name: str, shape: tuple[int, ...], axis: int) -> np.ndarray:
        """The tensor of `shape` that FasterTransformer split along `axis` into one file per rank."""
        if shape[axis] % self.ranks:
            raise unavailable(f"tensor '{name}' ({shape[axis]} along the split axis) cannot be split into "
                              f"{self.ranks} tensor-parallel ranks")
        part = list(shape)
        part[axis] //= self.ranks
        pieces = [self._read(f"{name}.{rank}.bin", tuple(part)) for rank in range(self.ranks)]
        return pieces[0] if self.ranks == 1 else np.concatenate(pieces, axis=axis)

    def _read(self, file: str, shape: tuple[int, ...]) -> np.ndarray:
        path = self.folder / file
        if not path.is_file():
            raise unavailable(f"the checkpoint '{self.folder}' has no tensor file '{file}'")
        expected = int(np.prod(shape)) * self.dtype.itemsize
        size = path.stat().st_size
        if size != expected:
            raise unavailable(f"tensor file '{path}' holds {size} bytes; shape {list(shape)} in {self.dtype.name} "
                              f"(config.ini's weight_data_type) takes {expected}")
        return np.fromfile(path, self.dtype).reshape(shape).astype(np.float32)


# ---- config.ini and the model ------------------------------------------------------------------------------------


def _read_ini(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=("#", ";"), strict=False)
    try:
        with path.open(encoding="utf-8") as file:
            parser.read_file(file)
    except FileNotFoundError:
        raise unavailable(f"the checkpoint folder '{path.parent}' has no config.ini") from None
    except (OSError, UnicodeDecodeError, configparser.Error) as exc:
        raise unavailable(f"{path} cannot be read: {' '.join(str(exc).split())[:200]}") from None
    return parser


def _int(section: Any, key: str, default: int | None = None) -> int:
    text = section.get(key)
    if text is None:
        if default is None:
            raise unavailable(f"config.ini's [{section.name}] section has no '{key}'")
        return default
    try:
        return int(text)
    except ValueError:
        raise unavailable(f"config.ini's [{section.name}] '{key}' must be an integer, got '{text}'") from None


def _optional_int(section: Any, key: str, default: int | None) -> int | None:
    text = section.get(key)
    return default if text is None else None if text.strip() in ("None", "") else _int(section, key)


def _flag(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes")


def _weight_type(text: str) -> type[np.generic]:
    if text not in _WEIGHT_TYPES:
        raise unavailable(f"config.ini's weight_data_type is '{text}'; transerve reads {', '.join(_WEIGHT_TYPES)}")
    return _WEIGHT_TYPES[text]


def _assemble(class_name: str, config: Any, state: dict[str, np.ndarray]) -> Any:
    """The model with `state` as its weights: built without initialising weights it is about to replace."""
    torch = import_engine("torch", "generation")
    transformers = import_engine("transformers", "generation")
    model_class: Callable[..., Any] = getattr(transformers, class_name)
    with torch.device("meta"):
        model = model_class(config)
    tensors: dict[int, Any] = {}  # tied weights stay one tensor
    weights = {name: tensors.setdefault(id(array), torch.from_numpy(np.ascontiguousarray(array)))
               for name, array in state.items()}
    expected = set(model.state_dict())
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise unavailable(f"the checkpoint does not match {class_name}: missing {missing[:5]}, unexpected {extra[:5]}")
    model.load_state_dict(weights, assign=True, strict=True)
    model.generation_config = transformers.GenerationConfig.from_model_config(config)
    return model.eval()
