"""FasterTransformer's Megatron GPT converter, redone for tests, and the Megatron-LM checkpoint it reads.

`megatron_ckpt_convert` follows dev/v5.0_beta's `examples/pytorch/gpt/utils/megatron_ckpt_convert.py` step by step
(its fused-qkv default and Megatron's checkpoint version 0, where each rank's `query_key_value` rows are that rank's
q, then k, then v): trained on fewer ranks than inferred on, it splits each trained rank's tensors further
(`split_and_convert`); trained on more, it joins them (`merge_and_convert`). Every tensor is transposed (`.T`) and
written float32; `model.wpe.bin` comes from rank 0, `model.wte.bin` is the trained ranks' vocabulary shards joined;
no config.ini is written (fastertransformer_backend dev/v1.1_beta's GPT config carries the sizes).

`megatron_gpt_checkpoint` writes the converter's input from a Hugging Face GPT-2, as Megatron-LM lays out a
tensor-parallel GPT checkpoint: `mp_rank_XX/model_optim_rng.pt`, its `model.language_model` holding `embedding`
(`word_embeddings`, split by vocabulary rows across ranks; `position_embeddings`) and `transformer` (Linear weights
`[out, in]`; column-parallel ones split on their output rows, row-parallel ones on their input columns, layer norms
and row-parallel biases on every rank).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHECKPOINT = "model_optim_rng.pt"
#: Tensors FasterTransformer's converter writes once (rank 0), as they are on every rank.
_SHARED = ("input_layernorm.weight", "input_layernorm.bias", "attention.dense.bias", "post_attention_layernorm.weight",
           "post_attention_layernorm.bias", "mlp.dense_4h_to_h.bias", "final_layernorm.weight",
           "final_layernorm.bias")


# ---- the converter's input: a Megatron-LM checkpoint ----------------------------------------------------------


def megatron_gpt_checkpoint(model, folder: Path, ranks: int = 1) -> Path:
    """`folder/mp_rank_XX/model_optim_rng.pt` for a `GPT2LMHeadModel`, over `ranks` tensor-parallel ranks."""
    import torch

    state = {name: tensor.detach().float() for name, tensor in model.transformer.state_dict().items()}
    d, layers = model.config.n_embd, model.config.n_layer

    def rows(tensor, rank: int):
        return torch.chunk(tensor, ranks, dim=0)[rank].clone()

    def columns(tensor, rank: int):
        return torch.chunk(tensor, ranks, dim=1)[rank].clone()

    for rank in range(ranks):
        transformer = {}
        for i in range(layers):
            hf, mg = f"h.{i}", f"layers.{i}"
            for part in ("weight", "bias"):
                transformer[f"{mg}.input_layernorm.{part}"] = state[f"{hf}.ln_1.{part}"].clone()
                transformer[f"{mg}.post_attention_layernorm.{part}"] = state[f"{hf}.ln_2.{part}"].clone()
            q, k, v = state[f"{hf}.attn.c_attn.weight"].T.split(d, dim=0)  # Linear rows: [q; k; v]
            transformer[f"{mg}.attention.query_key_value.weight"] = torch.cat([rows(w, rank) for w in (q, k, v)])
            q, k, v = state[f"{hf}.attn.c_attn.bias"].split(d)
            transformer[f"{mg}.attention.query_key_value.bias"] = torch.cat([rows(b, rank) for b in (q, k, v)])
            transformer[f"{mg}.attention.dense.weight"] = columns(state[f"{hf}.attn.c_proj.weight"].T, rank)
            transformer[f"{mg}.attention.dense.bias"] = state[f"{hf}.attn.c_proj.bias"].clone()
            transformer[f"{mg}.mlp.dense_h_to_4h.weight"] = rows(state[f"{hf}.mlp.c_fc.weight"].T, rank)
            transformer[f"{mg}.mlp.dense_h_to_4h.bias"] = rows(state[f"{hf}.mlp.c_fc.bias"], rank)
            transformer[f"{mg}.mlp.dense_4h_to_h.weight"] = columns(state[f"{hf}.mlp.c_proj.weight"].T, rank)
            transformer[f"{mg}.mlp.dense_4h_to_h.bias"] = state[f"{hf}.mlp.c_proj.bias"].clone()
        transformer["final_layernorm.weight"] = state["ln_f.weight"].clone()
        transformer["final_layernorm.bias"] = state["ln_f.bias"].clone()
        embedding = {"word_embeddings": {"weight": rows(state["wte.weight"], rank)},
                     "position_embeddings": {"weight": state["wpe.weight"].clone()}}
        shard = folder / f"mp_rank_{rank:02d}"
        shard.mkdir(parents=True, exist_ok=True)
        torch.save({"model": {"language_model": {"embedding": embedding, "transformer": transformer}},
                    "checkpoint_version": 0}, shard / CHECKPOINT)
    return folder


# ---- dev/v5.0_beta: megatron_ckpt_convert.py --------------------------------------------------------------------


def megatron_ckpt_convert(in_file: Path, saved_dir: Path, trained_gpu_num: int, infer_gpu_num: int) -> Path:
    """`python megatron_ckpt_convert.py -o saved_dir -i in_file -t_g T -i_g N -h_n H` with its defaults (fused
    qkv, checkpoint version 0, where the script uses `-h_n` for nothing); returns `saved_dir/<N>-gpu`."""
    saved = Path(saved_dir) / f"{infer_gpu_num}-gpu"
    saved.mkdir(parents=True, exist_ok=True)
    if trained_gpu_num > infer_gpu_num:
        _merge_and_convert(Path(in_file), saved, trained_gpu_num, infer_gpu_num)
    else:
        _split_and_convert(Path(in_file), saved, trained_gpu_num, infer_gpu_num)
    return saved


def _load(prefix: Path, rank: int) -> dict:
    import torch

    return torch.load(prefix / f"mp_rank_{rank:02d}" / CHECKPOINT)


def _write_wpe(prefix: Path, saved: Path) -> None:
    model_00 = _load(prefix, 0)
    model_00["model"]["language_model"]["embedding"]["position_embeddings"]["weight"].cpu().numpy().astype(
        np.float32).tofile(saved / "model.wpe.bin")  # not transposed


def _split_and_convert(prefix: Path, saved: Path, t_gpu_num: int, i_gpu_num: int) -> None:
    """Trained on fewer ranks: each trained rank's tensors split `factor` ways, rank `i * factor + j`."""
    assert i_gpu_num % t_gpu_num == 0
    factor = i_gpu_num // t_gpu_num
    _write_wpe(prefix, saved)
    w_e_list = []
    for i in range(t_gpu_num):
        m = _load(prefix, i)
        transformer_model = m["model"]["language_model"]["transformer"]
        w_e_list.append(m["model"]["language_model"]["embedding"]["word_embeddings"]["weight"].cpu().numpy()
                        .astype(np.float32))
        for key, value in transformer_model.items():
            _split_process(i, saved, factor, key, value.cpu().numpy().T.astype(np.float32))  # the script's `.T`
    np.concatenate(w_e_list, axis=0).tofile(saved / "model.wte.bin")


def _split_process(i: int, saved: Path, factor: int, key: str, val: np.ndarray) -> None:
    def split(value: np.ndarray, axis: int) -> None:
        for j, part in enumerate(np.split(value, factor, axis=axis)):
            part.tofile(saved / f"model.{key}.{i * factor + j}.bin")

    if any(part in key for part in _SHARED):
        if i == 0:
            val.tofile(saved / f"model.{key}.bin")
    elif "attention.dense.weight" in key or "mlp.dense_4h_to_h.weight" in key:
        split(val, 0)
    elif "mlp.dense_h_to_4h.weight" in key or "mlp.dense_h_to_4h.bias" in key:
        split(val, -1)
    elif "attention.query_key_value.bias" in key:
        split(val.reshape(3, val.shape[-1] // 3), -1)
    elif "attention.query_key_value.weight" in key:
        split(val.reshape(val.shape[0], 3, val.shape[-1] // 3), -1)
    else:
        print(f"[ERROR] cannot find key '{key}'")


def _merge_and_convert(prefix: Path, saved: Path, t_gpu_num: int, i_gpu_num: int) -> None:
    """Trained on more ranks: `factor` trained ranks' tensors joined into each inference rank."""
    assert t_gpu_num % i_gpu_num == 0
    factor = t_gpu_num // i_gpu_num
    _write_wpe(prefix, saved)
    w_e_list = []
    for i in range(i_gpu_num):
        transformer_models = []
        for j in range(factor):
            model = _load(prefix, i * factor + j)
            w_e_list.append(model["model"]["language_model"]["embedding"]["word_embeddings"]["weight"].cpu().numpy()
                            .astype(np.float32))
            transformer_models.append(model["model"]["language_model"]["transformer"])
        for key in transformer_models[0]:
            vals = [transformer_models[k][key].cpu().numpy().T for k in range(factor)]
            path = saved / f"model.{key}.{i}.bin"
            if any(part in key for part in _SHARED):
                if i == 0:
                    np.squeeze(vals[0]).astype(np.float32).tofile(saved / f"model.{key}.bin")
            elif "attention.dense.weight" in key or "mlp.dense_4h_to_h.weight" in key:
                np.concatenate(vals, axis=0).astype(np.float32).tofile(path)
            elif "mlp.dense_h_to_4h.weight" in key or "mlp.dense_h_to_4h.bias" in key:
                np.concatenate(vals, axis=-1).astype(np.float32).tofile(path)
            elif "attention.query_key_value.bias" in key:
                parts = [val.reshape(3, val.shape[-1] // 3) for val in vals]
                np.concatenate(parts, axis=-1).astype(np.float32).tofile(path)
            elif "attention.query_key_value.weight" in key:
                parts = [val.reshape(val.shape[0], 3, val.shape[-1] // 3) for val in vals]
                np.concatenate(parts, axis=-1).astype(np.float32).tofile(path)
            else:
                print(f"[ERROR] cannot find key '{key}'")
    np.concatenate(w_e_list, axis=0).tofile(saved / "model.wte.bin")
