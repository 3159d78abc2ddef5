"""FasterTransformer's converted checkpoints read back into Hugging Face models.

FasterTransformer's converters write a folder `<N>-gpu/` holding one raw little-endian float32 or float16 file per
tensor: 2-D weights transposed to `[in, out]`, and those FasterTransformer splits across N tensor-parallel ranks
written once per rank (`<name>.<rank>.bin`). Their generations differ in `config.ini`, told apart here by its keys:

- T5, dev/v5.0_beta's `t5_ckpt_convert.py` (FasterTransformer's T5 tutorial for Triton): `[encoder]`/`[decoder]`
  hold the Hugging Face config's own keys (`relative_attention_num_buckets`, no `weight_data_type`: float32), no
  `lm_head.weight` file (tied models only), no gated feed-forward weights;
- T5, the later `huggingface_t5_ckpt_convert.py`: the same sections with `relative_attention_num_buckets` renamed
  `..._or_max_pos_seq_len`, `weight_data_type`, a `[structure]` section, `lm_head.weight` and gated weights;
- GPT, `huggingface_gpt_convert.py` on main (`[gpt]` with FasterTransformer's keys: `head_num`, `num_layer`, ...)
  and at v5.0 (`[gpt]` holding the Hugging Face config's keys, `n_head`, `n_layer`, ..., and the script's
  arguments); dev/v5.0_beta's GPT converters write no `config.ini` at all, the sizes being the model config's
  parameters then (`head_num`, `size_per_head`, `decoder_layers`, `vocab_size`, ... as fastertransformer_backend
  dev/v1.1_beta's GPT config declares them).

This reverses that: every file is checked against the shape the sizes imply (a truncated file fails the load naming
it), the ranks are joined, the transposes undone, and the tensors assigned to a `T5ForConditionalGeneration` or
`GPT2LMHeadModel`. The model is what the generation backend's engines load (docs/generation.md, "FasterTransformer
repositories").
"""

from __future__ import annotations

import configparser
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from transerve.backends.threaded import import_engine
from transerve.core.errors import unavailable

#: `model_type` values read here, and the Hugging Face class each becomes.
MODEL_TYPES = {"T5": "T5ForConditionalGeneration", "GPT": "GPT2LMHeadModel"}
_WEIGHT_TYPES = {"fp32": np.float32, "fp16": np.float16}


def read_checkpoint(folder: Path, model_type: str, parameters: Mapping[str, str] | None = None) -> Any:
    """The Hugging Face model (float32, CPU, eval mode) of the checkpoint in `folder`; UNAVAILABLE naming the file
    or setting at fault when the folder is not a complete checkpoint of `model_type`. `parameters` (the model
    config's) give a GPT checkpoint's sizes where the folder has no `config.ini` (dev/v5.0_beta's converters)."""
    if model_type not in MODEL_TYPES:
        raise unavailable(f"model_type '{model_type}' is not one transerve reads; it reads {', '.join(MODEL_TYPES)}")
    if not folder.is_dir():
        raise unavailable(f"the checkpoint folder '{folder}' does not exist")
    if model_type == "GPT" and not (folder / "config.ini").is_file():
        config, state = _read_gpt(_gpt_sizes_from_parameters(folder, parameters or {}), folder)
    else:
        ini = _read_ini(folder / "config.ini")
        config, state = _read_t5(ini, folder) if model_type == "T5" else _read_gpt(_gpt_sizes(ini, folder), folder)
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
        relative_attention_num_buckets=_buckets(encoder),
        relative_attention_max_distance=_int(encoder, "relative_attention_max_distance", 128),
        layer_norm_epsilon=float(encoder.get("layer_norm_epsilon", "1e-6")), feed_forward_proj=ff,
        tie_word_embeddings=_flag(encoder.get("tie_word_embeddings", "True")),
        pad_token_id=_optional_int(decoder, "pad_token_id", 0), eos_token_id=_optional_int(decoder, "eos_token_id", 1),
        decoder_start_token_id=_optional_int(decoder, "decoder_start_token_id", 0),
    )
    #: dev/v5.0_beta's t5_ckpt_convert.py: the Hugging Face keys unrenamed, float32, no lm_head, no gated weights.
    first_generation = "relative_attention_num_buckets_or_max_pos_seq_len" not in encoder
    if gated and first_generation:
        raise unavailable(f"{folder}: this T5 has a gated feed-forward ({ff}), whose weights dev/v5.0_beta's "
                          "t5_ckpt_convert.py does not write; convert it with huggingface_t5_ckpt_convert.py")
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
    elif first_generation:
        raise unavailable(f"{folder}: this T5 does not tie its output layer to the embeddings, and dev/v5.0_beta's "
                          "t5_ckpt_convert.py writes no lm_head.weight; convert it with huggingface_t5_ckpt_convert.py")
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


@dataclass(frozen=True, slots=True)
class _GptSizes:
    """A GPT checkpoint's sizes, from whichever place its converter generation keeps them."""

    heads: int
    layers: int
    hidden: int
    inter: int
    vocab: int
    positions: int
    start_id: int | None
    end_id: int | None
    layer_norm_eps: float
    weight_type: type[np.generic]


def _gpt_sizes(ini: configparser.ConfigParser, folder: Path) -> _GptSizes:
    """`[gpt]` in FasterTransformer's keys (huggingface_gpt_convert.py on main) or Hugging Face's (at v5.0)."""
    if not ini.has_section("gpt"):
        raise unavailable(f"{folder / 'config.ini'} has no [gpt] section: it is not a GPT checkpoint")
    gpt = ini["gpt"]
    own = "head_num" in gpt
    heads = _int(gpt, "head_num" if own else "n_head")
    hidden = heads * _int(gpt, "size_per_head") if own else _int(gpt, "n_embd")
    inter = _optional_int(gpt, "inter_size" if own else "n_inner", None)
    return _GptSizes(
        heads=heads, layers=_int(gpt, "num_layer" if own else "n_layer"), hidden=hidden,
        inter=inter if inter is not None else 4 * hidden, vocab=_int(gpt, "vocab_size"),
        positions=_int(gpt, "max_pos_seq_len" if own else "n_positions"),
        start_id=_optional_int(gpt, "start_id" if own else "bos_token_id", None),
        end_id=_optional_int(gpt, "end_id" if own else "eos_token_id", None),
        layer_norm_eps=float(gpt.get("layernorm_eps" if own else "layer_norm_epsilon", "1e-5")),
        weight_type=_weight_type(gpt.get("weight_data_type", "fp32")),
    )


def _gpt_sizes_from_parameters(folder: Path, parameters: Mapping[str, str]) -> _GptSizes:
    """No `config.ini` (dev/v5.0_beta's GPT converters, float32 files): the model config's parameters, as
    fastertransformer_backend dev/v1.1_beta's GPT config declares them; the positions from `model.wpe.bin`."""
    section = _Parameters(parameters)
    heads, layers = _int(section, "head_num"), _int(section, "decoder_layers")
    hidden = heads * _int(section, "size_per_head")
    wpe = folder / "model.wpe.bin"
    if not wpe.is_file():
        raise unavailable(f"the checkpoint '{folder}' has neither config.ini nor a tensor file 'model.wpe.bin'")
    row = hidden * np.dtype(np.float32).itemsize
    if wpe.stat().st_size % row:
        raise unavailable(f"tensor file '{wpe}' holds {wpe.stat().st_size} bytes, not a whole number of float32 "
                          f"rows of head_num * size_per_head = {hidden}")
    return _GptSizes(
        heads=heads, layers=layers, hidden=hidden, inter=_int(section, "inter_size", 4 * hidden),
        vocab=_int(section, "vocab_size"), positions=wpe.stat().st_size // row,
        start_id=_optional_int(section, "start_id", None), end_id=_optional_int(section, "end_id", None),
        layer_norm_eps=1e-5, weight_type=np.float32,
    )


class _Parameters(dict):
    """The model config's parameters where a `config.ini` section would be: named in errors as parameters."""

    name = "parameters"

    def __init__(self, parameters: Mapping[str, str]) -> None:
        super().__init__((key, value) for key, value in parameters.items() if value.strip())


def _read_gpt(sizes: _GptSizes, folder: Path) -> tuple[Any, dict[str, np.ndarray]]:
    transformers = import_engine("transformers", "generation")
    heads, layers, d = sizes.heads, sizes.layers, sizes.hidden
    inter, vocab, positions = sizes.inter, sizes.vocab, sizes.positions
    config = transformers.GPT2Config(
        vocab_size=vocab, n_embd=d, n_layer=layers, n_head=heads, n_positions=positions, n_inner=inter,
        bos_token_id=sizes.start_id, eos_token_id=sizes.end_id, layer_norm_epsilon=sizes.layer_norm_eps,
    )
    files = _Files(folder, sizes.weight_type, "model.layers.0.attention.query_key_value.weight")
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


def _where(section: Any) -> str:
    if isinstance(section, _Parameters):
        return "the model config's parameters (the checkpoint has no config.ini)"
    return f"config.ini's [{section.name}] section"


def _int(section: Any, key: str, default: int | None = None) -> int:
    text = section.get(key)
    if text is None:
        if default is None:
            raise unavailable(f"{_where(section)} has no '{key}'")
        return default
    try:
        return int(text)
    except ValueError:
        raise unavailable(f"{_where(section)}: '{key}' must be an integer, got '{text}'") from None


def _buckets(encoder: Any) -> int:
    """T5's relative-attention buckets: renamed by the later converter, the Hugging Face key in v5.0_beta's."""
    if "relative_attention_num_buckets_or_max_pos_seq_len" in encoder:
        return _int(encoder, "relative_attention_num_buckets_or_max_pos_seq_len")
    return _int(encoder, "relative_attention_num_buckets")


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
