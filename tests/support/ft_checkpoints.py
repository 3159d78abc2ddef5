"""FasterTransformer's checkpoint converters, redone for tests, one function per converter script.

Each function takes what its script takes (`-i` the Hugging Face folder or file, `-o` the output folder, the
tensor-parallel size, `-weight_data_type`) and does what the script does, step by step in its order: which model
class it loads, which parameters it iterates (`named_parameters()`, which leaves tied weights out, or
`state_dict()`, which keeps them), what each tensor's name is matched against, which ones it transposes, how it
splits them across ranks and along which axis, what it names each file, and what it writes to `config.ini`. Written
here from reading those scripts at NVIDIA/FasterTransformer, so that tests serve the folders a user's conversion
leaves behind without FasterTransformer, CUDA or a GPU:

- `t5_ckpt_convert`: dev/v5.0_beta's `examples/pytorch/t5/utils/t5_ckpt_convert.py`, the 000 tutorial's converter;
- `huggingface_t5_ckpt_convert`: the later `examples/pytorch/t5/utils/huggingface_t5_ckpt_convert.py` (main);
- `huggingface_gpt_convert`: `examples/pytorch/gpt/utils/huggingface_gpt_convert.py` at v5.0 (`config.ini` holds
  the script's arguments and the Hugging Face config's attributes) and on main (FasterTransformer's own keys);
- `huggingface_jp_gpt_convert`: dev/v5.0_beta's `examples/pytorch/gpt/utils/huggingface_jp_gpt_convert.py` (a
  `torch.save`d state dict in, float32 out, no `config.ini`).
"""

from __future__ import annotations

import configparser
from pathlib import Path

import numpy as np

WEIGHT_TYPES = {"fp32": np.float32, "fp16": np.float16}
#: The T5 converters' tensors split along axis 0 (their input axis, once transposed).
_OUTPUT_PROJECTIONS = ("SelfAttention.o.weight", "EncDecAttention.o.weight", "DenseReluDense.wo.weight")


def _split_write(value: np.ndarray, factor: int, axis: int, path_of) -> None:
    """`np.split` into `factor` parts along `axis`, part `j` written to `path_of(j)`: every converter's split."""
    for j, part in enumerate(np.split(value, factor, axis=axis)):
        part.tofile(path_of(j))


# ---- T5, dev/v5.0_beta: t5_ckpt_convert.py -----------------------------------------------------------------------


def t5_ckpt_convert(in_file: Path, saved_dir: Path, infer_gpu_num: int) -> Path:
    """`python t5_ckpt_convert.py -o saved_dir -i in_file -infer_gpu_num N`; returns `saved_dir/<N>-gpu`."""
    import transformers

    saved = Path(saved_dir) / f"{infer_gpu_num:d}-gpu"
    saved.mkdir(parents=True, exist_ok=True)
    model = transformers.T5ForConditionalGeneration.from_pretrained(in_file)
    config = configparser.ConfigParser()
    config["encoder"] = {}
    for key, val in model.encoder.config.to_dict().items():
        config["encoder"][key] = f"{val}"
    config["decoder"] = {}
    for key, val in model.decoder.config.to_dict().items():
        config["decoder"][key] = f"{val}"
    with open(saved / "config.ini", "w") as configfile:
        config.write(configfile)
    for name, param in model.named_parameters():
        _v5_beta_split_and_convert(name, param, infer_gpu_num, saved)
    _fuse_decoder_qkv(model, infer_gpu_num, saved, np.float32)
    return saved


def _v5_beta_split_and_convert(key: str, param, factor: int, saved: Path) -> None:
    # every tensor transposed (`val.T`: a 1-D one is left as it is) and made float32
    val = param.detach().float().cpu().numpy().T
    if "shared.weight" in key:
        val.tofile(saved / f"{key}.bin")
        val.T.tofile(saved / f"{key}_T.bin")
    elif "layer_norm.weight" in key:
        val.tofile(saved / f"{key}.bin")
    elif any(part in key for part in _OUTPUT_PROJECTIONS):
        _split_write(val, factor, 0, lambda j: saved / f"{key}.{j:d}.bin")
    elif "DenseReluDense.wi.weight" in key or ("encoder" in key and any(
        part in key for part in ("SelfAttention.q.weight", "SelfAttention.k.weight", "SelfAttention.v.weight")
    )) or any(part in key for part in ("EncDecAttention.q.weight", "EncDecAttention.k.weight",
                                       "EncDecAttention.v.weight")):
        _split_write(val, factor, -1, lambda j: saved / f"{key}.{j:d}.bin")
    elif "relative_attention_bias" in key:
        _split_write(val, factor, 0, lambda j: saved / f"{key}.{j:d}.bin")
    elif "decoder" in key and any(
        part in key for part in ("SelfAttention.q.weight", "SelfAttention.k.weight", "SelfAttention.v.weight")
    ):
        pass  # fused by _fuse_decoder_qkv
    # anything else (lm_head.weight of an untied model, gated wi_0/wi_1) is reported by the script and not written


def _fuse_decoder_qkv(model, factor: int, saved: Path, dtype: type[np.generic]) -> None:
    """The decoder's self-attention q, k, v: each transposed to [d_model, inner], concatenated on the last axis,
    viewed as [d_model, 3, inner] and split along the last axis."""
    import torch

    params = {name: param for name, param in model.named_parameters() if "decoder" in name and "SelfAttention" in name}
    for i in range(model.decoder.config.num_layers):
        prefix = f"decoder.block.{i}.layer.0.SelfAttention"
        shape = params[f"{prefix}.q.weight"].T.shape
        qkv = torch.cat([params[f"{prefix}.{part}.weight"].T for part in "qkv"], dim=-1)
        qkv = qkv.reshape([shape[0], 3, shape[1]]).float().cpu().detach().numpy().astype(dtype)
        _split_write(qkv, factor, -1, lambda j, prefix=prefix: saved / f"{prefix}.qkv.weight.{j}.bin")


# ---- T5, main: huggingface_t5_ckpt_convert.py --------------------------------------------------------------------


def huggingface_t5_ckpt_convert(in_file: Path, saved_dir: Path, inference_tensor_para_size: int,
                                weight_data_type: str = "fp32") -> Path:
    """`python huggingface_t5_ckpt_convert.py -o saved_dir -i in_file -i_g N -weight_data_type T`."""
    import transformers

    saved = Path(saved_dir) / f"{inference_tensor_para_size:d}-gpu"
    saved.mkdir(parents=True, exist_ok=True)
    model = transformers.T5ForConditionalGeneration.from_pretrained(in_file)
    structure = {"t5_with_bias": "false", "use_gated_activation": "false", "position_embedding_type": "relative"}
    if "gated" in model.encoder.config.feed_forward_proj:
        structure["use_gated_activation"] = "1"
    config = configparser.ConfigParser()
    for section, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
        config[section] = {}
        for key, val in stack.config.to_dict().items():
            config[section][key] = f"{val}"
        config[section]["weight_data_type"] = weight_data_type
    for section in ("encoder", "decoder"):
        config[section]["relative_attention_num_buckets_or_max_pos_seq_len"] = config[section].pop(
            "relative_attention_num_buckets")
    config["structure"] = structure
    with open(saved / "config.ini", "w") as configfile:
        config.write(configfile)
    dtype = WEIGHT_TYPES[weight_data_type]
    for name, param in model.state_dict().items():
        _main_split_and_convert(name, param.cpu().detach().numpy().astype(dtype), inference_tensor_para_size, saved)
    _fuse_decoder_qkv(model, inference_tensor_para_size, saved, dtype)
    return saved


def _main_split_and_convert(key: str, val: np.ndarray, factor: int, saved: Path) -> None:
    if val.ndim == 2:
        val = val.transpose(1, 0)
    saved_key = key
    if "shared.weight" in key:
        val.tofile(saved / f"{saved_key}.bin")
        val.T.tofile(saved / f"{saved_key}_T.bin")
    elif "lm_head.weight" in key:
        val.transpose(1, 0).tofile(saved / f"{saved_key}.bin")  # back to [vocab, d_model]
    elif "layer_norm.weight" in key:
        val.tofile(saved / f"{saved_key}.bin")
    elif any(part in key for part in _OUTPUT_PROJECTIONS):
        _split_write(val, factor, 0, lambda j: saved / f"{saved_key}.{j:d}.bin")
    elif "DenseReluDense.wi.weight" in key or ("encoder" in key and any(
        part in key for part in ("SelfAttention.q.weight", "SelfAttention.k.weight", "SelfAttention.v.weight")
    )) or any(part in key for part in ("EncDecAttention.q.weight", "EncDecAttention.k.weight",
                                       "EncDecAttention.v.weight")):
        _split_write(val, factor, -1, lambda j: saved / f"{saved_key}.{j:d}.bin")
    elif "DenseReluDense.wi_0.weight" in key or "DenseReluDense.wi_1.weight" in key:
        saved_key = key.replace("wi_0", "wi") if "wi_0" in key else key.replace("wi_1", "wi2")
        _split_write(val, factor, -1, lambda j: saved / f"{saved_key}.{j:d}.bin")
    elif "relative_attention_bias" in key:
        _split_write(val, factor, 0, lambda j: saved / f"{saved_key}.{j:d}.bin")
    # the decoder's self-attention q/k/v are fused by _fuse_decoder_qkv; embed_tokens are shared.weight


# ---- GPT: huggingface_gpt_convert.py (v5.0 and main), huggingface_jp_gpt_convert.py (dev/v5.0_beta) -------------

#: The Hugging Face GPT-2 names the GPT converters look for, in their order, and FasterTransformer's for each.
_GPT_PATTERNS = (
    ("ln_1.bias", "input_layernorm.bias"),
    ("ln_1.weight", "input_layernorm.weight"),
    ("attn.c_attn.bias", "attention.query_key_value.bias"),
    ("attn.c_attn.weight", "attention.query_key_value.weight"),
    ("attn.c_proj.bias", "attention.dense.bias"),
    ("attn.c_proj.weight", "attention.dense.weight"),
    ("ln_2.bias", "post_attention_layernorm.bias"),
    ("ln_2.weight", "post_attention_layernorm.weight"),
    ("mlp.c_fc.bias", "mlp.dense_h_to_4h.bias"),
    ("mlp.c_fc.weight", "mlp.dense_h_to_4h.weight"),
    ("mlp.c_proj.bias", "mlp.dense_4h_to_h.bias"),
    ("mlp.c_proj.weight", "mlp.dense_4h_to_h.weight"),
)


def huggingface_gpt_convert(in_file: Path, saved_dir: Path, infer_gpu_num: int, weight_data_type: str = "fp32",
                            version: str = "main", trained_gpu_num: int = 1) -> Path:
    """`python huggingface_gpt_convert.py -o saved_dir -i in_file -i_g N -weight_data_type T` as of `version`
    ("v5.0" or "main"); returns `saved_dir/<N>-gpu`."""
    import transformers

    saved = f"{saved_dir}/{infer_gpu_num}-gpu/"
    Path(saved).mkdir(parents=True, exist_ok=True)
    assert infer_gpu_num % trained_gpu_num == 0
    factor = infer_gpu_num // trained_gpu_num
    model = transformers.GPT2Model.from_pretrained(in_file)
    hf_config = vars(model.config)
    config = configparser.ConfigParser()
    config["gpt"] = {}
    try:
        if version == "v5.0":
            arguments = {"saved_dir": saved_dir, "in_file": in_file, "trained_gpu_num": trained_gpu_num,
                         "infer_gpu_num": infer_gpu_num, "processes": 4, "weight_data_type": weight_data_type}
            for key, value in arguments.items():
                config["gpt"][key] = f"{value}"
            for key, value in hf_config.items():
                config["gpt"][key] = f"{value}"
            config["gpt"]["weight_data_type"] = weight_data_type
        else:
            config["gpt"]["model_name"] = "gpt" if hf_config["_name_or_path"] == "" else hf_config["_name_or_path"]
            config["gpt"]["head_num"] = str(hf_config["n_head"])
            n_embd = hf_config["n_embd"]
            config["gpt"]["size_per_head"] = str(n_embd // hf_config["n_head"])
            config["gpt"]["inter_size"] = str(n_embd * 4)
            config["gpt"]["max_pos_seq_len"] = str(hf_config["n_positions"])
            config["gpt"]["num_layer"] = str(hf_config["n_layer"])
            config["gpt"]["vocab_size"] = str(hf_config["vocab_size"])
            config["gpt"]["start_id"] = str(hf_config["bos_token_id"])
            config["gpt"]["end_id"] = str(hf_config["eos_token_id"])
            config["gpt"]["weight_data_type"] = weight_data_type
            config["gpt"]["tensor_para_size"] = str(infer_gpu_num)
        with open(saved + "/config.ini", "w") as configfile:
            config.write(configfile)
    except Exception:  # the script, too, goes on without config.ini
        print("Fail to save the config in config.ini.")
    dtype = WEIGHT_TYPES[weight_data_type]
    for name, param in model.named_parameters():
        if "weight" not in name and "bias" not in name:
            continue
        value = param.detach().cpu().numpy().astype(dtype)
        whole = {"wpe.weight": "model.wpe.bin", "wte.weight": "model.wte.bin",
                 "ln_f.bias": "model.final_layernorm.bias.bin", "ln_f.weight": "model.final_layernorm.weight.bin",
                 "lm_head.weight": "model.lm_head.weight.bin"}
        if name in whole:
            value.tofile(saved + whole[name])
            continue
        for hf_pattern, ft_pattern in _GPT_PATTERNS:
            if hf_pattern in name:
                _gpt_split_and_convert(0, saved, factor, name.replace("h.", "layers.").replace(hf_pattern, ft_pattern),
                                       value)
    return Path(saved)


def huggingface_jp_gpt_convert(in_file: Path, saved_dir: Path, infer_gpu_num: int, trained_gpu_num: int = 1) -> Path:
    """`python huggingface_jp_gpt_convert.py -o saved_dir -i in_file -i_g N`: `in_file` is a `torch.save`d
    `GPT2LMHeadModel` state dict; float32 files, no config.ini."""
    import torch

    saved = f"{saved_dir}/{infer_gpu_num}-gpu/"
    Path(saved).mkdir(parents=True, exist_ok=True)
    assert infer_gpu_num % trained_gpu_num == 0
    factor = infer_gpu_num // trained_gpu_num
    model = torch.load(in_file)
    whole = {"transformer.wpe.weight": "model.wpe.bin", "transformer.wte.weight": "model.wte.bin",
             "transformer.ln_f.bias": "model.final_layernorm.bias.bin",
             "transformer.ln_f.weight": "model.final_layernorm.weight.bin",
             "lm_head.weight": "model.lm_head.weight.bin"}
    for name in model:
        if "weight" not in name and "bias" not in name:
            continue
        value = model[name].cpu().numpy().astype(np.float32)
        if name in whole:
            value.tofile(saved + whole[name])
            continue
        for hf_pattern, ft_pattern in _GPT_PATTERNS:
            if hf_pattern in name:
                _gpt_split_and_convert(0, saved, factor,
                                       name.replace("transformer.h.", "layers.").replace(hf_pattern, ft_pattern), value)
    return Path(saved)


def _gpt_split_and_convert(i: int, saved: str, factor: int, key: str, val: np.ndarray) -> None:
    """The GPT converters' `split_and_convert_process`: GPT-2's Conv1D weights are [in, out] already."""
    if any(part in key for part in ("input_layernorm.weight", "input_layernorm.bias", "attention.dense.bias",
                                    "post_attention_layernorm.weight", "post_attention_layernorm.bias",
                                    "mlp.dense_4h_to_h.bias", "final_layernorm.weight", "final_layernorm.bias")):
        if i == 0:
            val.tofile(saved + "/model." + key + ".bin")
    elif "attention.dense.weight" in key or "mlp.dense_4h_to_h.weight" in key:
        _split_write(val, factor, 0, lambda j: f"{saved}/model.{key}.{i * factor + j}.bin")
    elif "mlp.dense_h_to_4h.weight" in key or "mlp.dense_h_to_4h.bias" in key:
        _split_write(val, factor, -1, lambda j: f"{saved}/model.{key}.{i * factor + j}.bin")
    elif "attention.query_key_value.bias" in key:
        local_dim = val.shape[-1] // 3
        _split_write(val.reshape(3, local_dim), factor, -1,
                     lambda j: f"{saved}/model.{key}.{i * factor + j}.bin")
    elif "attention.query_key_value.weight" in key:
        hidden_dim, local_dim = val.shape[0], val.shape[-1] // 3
        _split_write(val.reshape(hidden_dim, 3, local_dim), factor, -1,
                     lambda j: f"{saved}/model.{key}.{i * factor + j}.bin")
    else:
        print(f"[ERROR] cannot find key '{key}'")
