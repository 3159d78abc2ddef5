"""FasterTransformer checkpoint folders written from Hugging Face models, as FasterTransformer's converters lay them
out (`examples/pytorch/t5/utils/huggingface_t5_ckpt_convert.py`, `examples/pytorch/gpt/utils/
huggingface_gpt_convert.py`): `<N>-gpu/config.ini` and one raw little-endian file per tensor, 2-D weights
transposed to `[in, out]`, tensor-parallel splits written once per rank. Written here from the layout those scripts
produce (their names, transposes and split axes), not from their code, so that tests need neither FasterTransformer
nor a GPU.
"""

from __future__ import annotations

import configparser
from pathlib import Path

import numpy as np

WEIGHT_TYPES = {"fp32": np.float32, "fp16": np.float16}


def write_t5_checkpoint(model, saved_dir: Path, tensor_para_size: int = 1, weight_data_type: str = "fp32") -> Path:
    """`saved_dir/<N>-gpu/` for a `T5ForConditionalGeneration`; returns that folder."""
    folder = saved_dir / f"{tensor_para_size}-gpu"
    folder.mkdir(parents=True, exist_ok=True)
    dtype = WEIGHT_TYPES[weight_data_type]
    ini = configparser.ConfigParser(interpolation=None)
    gated = "gated" in model.encoder.config.feed_forward_proj
    for section, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
        values = {key: f"{value}" for key, value in stack.config.to_dict().items()}
        values["relative_attention_num_buckets_or_max_pos_seq_len"] = values.pop("relative_attention_num_buckets")
        values["weight_data_type"] = weight_data_type
        ini[section] = values
    ini["structure"] = {"t5_with_bias": "false", "use_gated_activation": "1" if gated else "false",
                        "position_embedding_type": "relative"}
    with (folder / "config.ini").open("w") as file:
        ini.write(file)

    def save(name: str, array: np.ndarray) -> None:
        array.astype(dtype).tofile(folder / f"{name}.bin")

    def split(name: str, array: np.ndarray, axis: int) -> None:
        for rank, part in enumerate(np.split(array, tensor_para_size, axis=axis)):
            save(f"{name}.{rank}", part)

    state = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    for name, value in state.items():
        value = value.T if value.ndim == 2 else value
        if "shared.weight" in name:
            save(name, value)
            save(f"{name}_T", value.T)
        elif "lm_head.weight" in name:
            save(name, value.T)
        elif "layer_norm.weight" in name:
            save(name, value)
        elif any(part in name for part in ("SelfAttention.o.", "EncDecAttention.o.", "DenseReluDense.wo.")):
            split(name, value, 0)
        elif "DenseReluDense.wi_0." in name or "DenseReluDense.wi_1." in name:
            split(name.replace("wi_0", "wi").replace("wi_1", "wi2"), value, -1)
        elif "relative_attention_bias" in name:
            split(name, value, 0)
        elif "DenseReluDense.wi." in name or "EncDecAttention." in name or (
            name.startswith("encoder") and "SelfAttention." in name
        ):
            split(name, value, -1)
        # the decoder's self-attention q/k/v are fused below; embed_tokens are shared.weight
    for i in range(model.config.num_decoder_layers):
        prefix = f"decoder.block.{i}.layer.0.SelfAttention"
        q, k, v = (state[f"{prefix}.{part}.weight"].T for part in "qkv")
        qkv = np.concatenate([q, k, v], axis=-1).reshape(q.shape[0], 3, q.shape[1])
        split(f"{prefix}.qkv.weight", qkv, -1)
    return folder


def write_gpt_checkpoint(model, saved_dir: Path, tensor_para_size: int = 1, weight_data_type: str = "fp32") -> Path:
    """`saved_dir/<N>-gpu/` for a `GPT2LMHeadModel` (its transformer, as the converter loads `GPT2Model`)."""
    folder = saved_dir / f"{tensor_para_size}-gpu"
    folder.mkdir(parents=True, exist_ok=True)
    dtype = WEIGHT_TYPES[weight_data_type]
    config = model.config
    ini = configparser.ConfigParser(interpolation=None)
    ini["gpt"] = {
        "model_name": "gpt", "head_num": str(config.n_head), "size_per_head": str(config.n_embd // config.n_head),
        "inter_size": str(config.n_embd * 4), "max_pos_seq_len": str(config.n_positions),
        "num_layer": str(config.n_layer), "vocab_size": str(config.vocab_size), "start_id": str(config.bos_token_id),
        "end_id": str(config.eos_token_id), "weight_data_type": weight_data_type,
        "tensor_para_size": str(tensor_para_size),
    }
    with (folder / "config.ini").open("w") as file:
        ini.write(file)
    renames = {
        "ln_1": "input_layernorm", "attn.c_attn": "attention.query_key_value", "attn.c_proj": "attention.dense",
        "ln_2": "post_attention_layernorm", "mlp.c_fc": "mlp.dense_h_to_4h", "mlp.c_proj": "mlp.dense_4h_to_h",
    }

    def save(name: str, array: np.ndarray) -> None:
        array.astype(dtype).tofile(folder / f"model.{name}.bin")

    def split(name: str, array: np.ndarray, axis: int) -> None:
        for rank, part in enumerate(np.split(array, tensor_para_size, axis=axis)):
            save(f"{name}.{rank}", part)

    for name, param in model.transformer.named_parameters():
        value = param.detach().float().numpy()
        if name in ("wte.weight", "wpe.weight"):
            save(name.removesuffix(".weight"), value)
            continue
        if name.startswith("ln_f."):
            save(name.replace("ln_f", "final_layernorm"), value)
            continue
        layer, rest = name.removeprefix("h.").split(".", 1)
        module, part = rest.rsplit(".", 1)
        ft = f"layers.{layer}.{renames[module]}.{part}"
        if module in ("ln_1", "ln_2") or (module in ("attn.c_proj", "mlp.c_proj") and part == "bias"):
            save(ft, value)
        elif module in ("attn.c_proj", "mlp.c_proj"):
            split(ft, value, 0)
        elif module == "mlp.c_fc":
            split(ft, value, -1)
        elif part == "weight":  # c_attn: [hidden, 3, hidden / N] per rank
            split(ft, value.reshape(value.shape[0], 3, -1), -1)
        else:
            split(ft, value.reshape(3, -1), -1)
    return folder


def main(argv: list[str] | None = None) -> None:
    """`python tests/support/ft_checkpoints.py t5|gpt HF_DIR SAVED_DIR`: the checkpoint of a Hugging Face folder,
    where FasterTransformer's converter is not at hand (docs/tutorials/fastertransformer-t5.md)."""
    import argparse

    import transformers

    parser = argparse.ArgumentParser(description="Write a FasterTransformer checkpoint (<N>-gpu/) of a Hugging Face "
                                     "T5 or GPT-2 folder, in the layout of FasterTransformer's converters.")
    parser.add_argument("model_type", choices=("t5", "gpt"))
    parser.add_argument("in_file", type=Path, help="the Hugging Face folder")
    parser.add_argument("saved_dir", type=Path, help="where <N>-gpu/ is written")
    parser.add_argument("--tensor-para-size", type=int, default=1)
    parser.add_argument("--weight-data-type", choices=tuple(WEIGHT_TYPES), default="fp32")
    args = parser.parse_args(argv)
    if args.model_type == "t5":
        model = transformers.T5ForConditionalGeneration.from_pretrained(args.in_file)
        folder = write_t5_checkpoint(model, args.saved_dir, args.tensor_para_size, args.weight_data_type)
    else:
        model = transformers.GPT2LMHeadModel.from_pretrained(args.in_file)
        folder = write_gpt_checkpoint(model, args.saved_dir, args.tensor_para_size, args.weight_data_type)
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
