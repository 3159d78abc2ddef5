"""LightSeq-format model files (protobuf and HDF5) written from small random-weight Hugging Face models, laid out
as LightSeq's export scripts write them (`hf_bart_export.py`, `hf_gpt2_export.py`, `hf_bert_export.py`): kernels
transposed to [in, out], q/k/v fused along the output axis, the encoder-decoder attention's k/v of every decoder
layer in the target embedding, post-LN norms shifted one layer on, position tables from position 0, the target
token embedding transposed. Only the test suite writes these files; transerve reads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from transerve.backends.lightseq.schema import message_class

#: Weights drawn wider than the default init so that logits are peaked (greedy decoding not decided by noise).
INIT_STD = 0.3
#: Added to BART's end-token logit bias: with it, seed 0's beams end early for some inputs and not for others.
EOS_BIAS = 4.0


def tiny_bart(vocab: int = 64, hidden: int = 32, layers: int = 2, positions: int = 40, seed: int = 0) -> Any:
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.BartConfig(
        vocab_size=vocab, d_model=hidden, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=2 * hidden, decoder_ffn_dim=2 * hidden,
        max_position_embeddings=positions, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None, forced_bos_token_id=None, init_std=INIT_STD,
        scale_embedding=False, activation_function="gelu",
    )
    model = transformers.BartForConditionalGeneration(config).eval()
    _spread_norms(model)
    with torch.no_grad():  # the end token likelier, so that some beams end before the length limit
        model.final_logits_bias[0, config.eos_token_id] += EOS_BIAS
    return model


def tiny_gpt2(vocab: int = 64, hidden: int = 32, layers: int = 2, positions: int = 40, seed: int = 0) -> Any:
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=positions, bos_token_id=2,
        eos_token_id=2, pad_token_id=2, initializer_range=INIT_STD,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    _spread_norms(model)
    return model


def _spread_norms(model: Any) -> None:
    """Layer norms drawn away from (1, 0), so a norm read into the wrong place changes the outputs."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.uniform_(-0.5, 0.5)


def _np(tensor: Any) -> np.ndarray:
    return tensor.detach().float().numpy()


def _kernel(linear: Any) -> np.ndarray:
    return _np(linear.weight).T


def _qkv(attention: Any) -> tuple[np.ndarray, np.ndarray]:
    parts = (attention.q_proj, attention.k_proj, attention.v_proj)
    return (np.concatenate([_kernel(p) for p in parts], axis=-1),
            np.concatenate([_np(p.bias) for p in parts], axis=-1))


def transformer_arrays(model: Any) -> dict[str, np.ndarray]:
    """`hf_bart_export.py`'s layout of a BART model."""
    arrays: dict[str, np.ndarray] = {}
    encoder, decoder = model.model.encoder, model.model.decoder
    # post-LN norms one layer on: a layer's input norm is the previous layer's last one
    enc_norms = [encoder.layernorm_embedding] + [layer.final_layer_norm for layer in encoder.layers]
    for index, layer in enumerate(encoder.layers):
        prefix = f"encoder_stack/{index}/"
        kernel, bias = _qkv(layer.self_attn)
        arrays |= {
            prefix + "multihead_norm_scale": _np(enc_norms[index].weight),
            prefix + "multihead_norm_bias": _np(enc_norms[index].bias),
            prefix + "multihead_project_kernel_qkv": kernel, prefix + "multihead_project_bias_qkv": bias,
            prefix + "multihead_project_kernel_output": _kernel(layer.self_attn.out_proj),
            prefix + "multihead_project_bias_output": _np(layer.self_attn.out_proj.bias),
            prefix + "ffn_norm_scale": _np(layer.self_attn_layer_norm.weight),
            prefix + "ffn_norm_bias": _np(layer.self_attn_layer_norm.bias),
        } | _ffn(prefix, layer)
    dec_norms = [decoder.layernorm_embedding] + [layer.final_layer_norm for layer in decoder.layers]
    for index, layer in enumerate(decoder.layers):
        prefix = f"decoder_stack/{index}/"
        kernel, bias = _qkv(layer.self_attn)
        arrays |= {
            prefix + "self_norm_scale": _np(dec_norms[index].weight),
            prefix + "self_norm_bias": _np(dec_norms[index].bias),
            prefix + "self_project_kernel_qkv": kernel, prefix + "self_project_bias_qkv": bias,
            prefix + "self_project_kernel_output": _kernel(layer.self_attn.out_proj),
            prefix + "self_project_bias_output": _np(layer.self_attn.out_proj.bias),
            prefix + "encdec_norm_scale": _np(layer.self_attn_layer_norm.weight),
            prefix + "encdec_norm_bias": _np(layer.self_attn_layer_norm.bias),
            prefix + "encdec_project_kernel_q": _kernel(layer.encoder_attn.q_proj),
            prefix + "encdec_project_bias_q": _np(layer.encoder_attn.q_proj.bias),
            prefix + "encdec_project_kernel_output": _kernel(layer.encoder_attn.out_proj),
            prefix + "encdec_project_bias_output": _np(layer.encoder_attn.out_proj.bias),
            prefix + "ffn_norm_scale": _np(layer.encoder_attn_layer_norm.weight),
            prefix + "ffn_norm_bias": _np(layer.encoder_attn_layer_norm.bias),
        } | _ffn(prefix, layer)
    shared = _np(model.model.shared.weight)
    arrays |= {
        "src_embedding/token_embedding": shared,
        "src_embedding/position_embedding": _np(encoder.embed_positions.weight)[2:],
        "src_embedding/norm_scale": _np(enc_norms[-1].weight), "src_embedding/norm_bias": _np(enc_norms[-1].bias),
        "trg_embedding/token_embedding": shared.T,
        "trg_embedding/position_embedding": _np(decoder.embed_positions.weight)[2:],
        "trg_embedding/norm_scale": _np(dec_norms[-1].weight), "trg_embedding/norm_bias": _np(dec_norms[-1].bias),
        "trg_embedding/encode_output_project_kernel_kv": np.concatenate(
            [_kernel(p) for layer in decoder.layers for p in (layer.encoder_attn.k_proj, layer.encoder_attn.v_proj)],
            axis=-1),
        "trg_embedding/encode_output_project_bias_kv": np.concatenate(
            [_np(p.bias) for layer in decoder.layers for p in (layer.encoder_attn.k_proj, layer.encoder_attn.v_proj)]),
        "trg_embedding/shared_bias": _np(model.final_logits_bias)[0],
    }
    return arrays


def _ffn(prefix: str, layer: Any) -> dict[str, np.ndarray]:
    return {
        prefix + "ffn_first_kernel": _kernel(layer.fc1), prefix + "ffn_first_bias": _np(layer.fc1.bias),
        prefix + "ffn_second_kernel": _kernel(layer.fc2), prefix + "ffn_second_bias": _np(layer.fc2.bias),
    }


def transformer_conf(model: Any, **overrides: Any) -> dict[str, Any]:
    """`hf_bart_export.py`'s model_conf (beam search, 4 beams), with `overrides`."""
    config = model.config
    conf = {
        "head_num": config.encoder_attention_heads, "beam_size": 4, "extra_decode_length": 10,
        "length_penalty": 1.0, "src_padding_id": config.pad_token_id, "trg_start_id": config.decoder_start_token_id,
        "trg_end_id": config.eos_token_id, "diverse_lambda": 0.0, "sampling_method": "beam_search", "topp": 0.75,
        "topk": 1, "is_post_ln": True, "no_scale_embedding": not config.scale_embedding, "use_gelu": True,
    }
    return conf | overrides


def gpt_arrays(model: Any) -> dict[str, np.ndarray]:
    """`hf_gpt2_export.py`'s layout of a GPT-2 model (Conv1D weights are already [in, out])."""
    body = model.transformer
    arrays = {
        "src_embedding/token_embedding": _np(body.wte.weight),
        "src_embedding/position_embedding": _np(body.wpe.weight),
        "src_embedding/norm_scale": _np(body.ln_f.weight), "src_embedding/norm_bias": _np(body.ln_f.bias),
    }
    for index, block in enumerate(body.h):
        prefix = f"encoder_stack/{index}/"
        arrays |= {
            prefix + "multihead_norm_scale": _np(block.ln_1.weight),
            prefix + "multihead_norm_bias": _np(block.ln_1.bias),
            prefix + "multihead_project_kernel_qkv": _np(block.attn.c_attn.weight),
            prefix + "multihead_project_bias_qkv": _np(block.attn.c_attn.bias),
            prefix + "multihead_project_kernel_output": _np(block.attn.c_proj.weight),
            prefix + "multihead_project_bias_output": _np(block.attn.c_proj.bias),
            prefix + "ffn_norm_scale": _np(block.ln_2.weight), prefix + "ffn_norm_bias": _np(block.ln_2.bias),
            prefix + "ffn_first_kernel": _np(block.mlp.c_fc.weight),
            prefix + "ffn_first_bias": _np(block.mlp.c_fc.bias),
            prefix + "ffn_second_kernel": _np(block.mlp.c_proj.weight),
            prefix + "ffn_second_bias": _np(block.mlp.c_proj.bias),
        }
    return arrays


def gpt_conf(model: Any, **overrides: Any) -> dict[str, Any]:
    """`hf_gpt2_export.py`'s model_conf (top-k 1: greedy), with `overrides`."""
    config = model.config
    conf = {
        "head_num": config.n_head, "src_padding_id": config.vocab_size, "sampling_method": "topk", "topp": 0.75,
        "topk": 1, "eos_id": config.eos_token_id, "extra_decode_length": 0,
    }
    return conf | overrides


def write(path: Path, model_type: str, arrays: dict[str, np.ndarray], conf: dict[str, Any]) -> Path:
    """The file at `path`: HDF5 for `.hdf5`, else protobuf."""
    if path.suffix == ".hdf5":
        _write_hdf5(path, arrays, conf)
    else:
        path.write_bytes(_message(model_type, arrays, conf).SerializeToString())
    return path


def _message(model_type: str, arrays: dict[str, np.ndarray], conf: dict[str, Any]) -> Any:
    message = message_class(model_type)()
    for path, value in sorted(arrays.items(), key=lambda item: _order(item[0])):
        parts = path.split("/")
        if len(parts) == 3:  # a stack's layer
            stack = getattr(message, parts[0])
            while len(stack) <= int(parts[1]):
                stack.add()
            getattr(stack[int(parts[1])], parts[2]).extend(value.ravel().tolist())
        else:
            getattr(getattr(message, parts[0]), parts[1]).extend(value.ravel().tolist())
    for key, value in conf.items():
        setattr(message.model_conf, key, value)
    return message


def _order(path: str) -> tuple:
    parts = path.split("/")
    return (parts[0], int(parts[1]) if len(parts) == 3 else -1, parts[-1])


def _write_hdf5(path: Path, arrays: dict[str, np.ndarray], conf: dict[str, Any]) -> None:
    import h5py

    with h5py.File(path, "w") as file:
        for name, value in arrays.items():
            file.create_dataset(name, data=value.ravel().astype(np.float32))
        for key, value in conf.items():
            if isinstance(value, str):  # LightSeq's export writes strings as int8 character codes
                file.create_dataset(f"model_conf/{key}", data=np.array([ord(c) for c in value], np.int8))
            else:
                file.create_dataset(f"model_conf/{key}", data=value)
        for stack in ("encoder_stack", "decoder_stack"):
            count = len({name.split("/")[1] for name in arrays if name.startswith(stack + "/")})
            if count:
                file.create_dataset(f"model_conf/n_{stack}", data=count)


def tiny_bert(vocab: int = 64, hidden: int = 32, layers: int = 2, positions: int = 40, seed: int = 0) -> Any:
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=2 * hidden, max_position_embeddings=positions, pad_token_id=0,
        initializer_range=INIT_STD, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    _spread_norms(model)
    return model


def bert_arrays(model: Any) -> dict[str, np.ndarray]:
    """`hf_bert_export.py`'s layout of a BERT model: token type 0 folded into the token embedding, post-LN norms
    one layer on."""
    embeddings = model.embeddings
    norms = [embeddings.LayerNorm]
    for layer in model.encoder.layer:
        norms += [layer.attention.output.LayerNorm, layer.output.LayerNorm]
    arrays = {
        "src_embedding/token_embedding": _np(embeddings.word_embeddings.weight)
        + _np(embeddings.token_type_embeddings.weight)[0],
        "src_embedding/position_embedding": _np(embeddings.position_embeddings.weight),
        "src_embedding/norm_scale": _np(norms[-1].weight), "src_embedding/norm_bias": _np(norms[-1].bias),
    }
    for index, layer in enumerate(model.encoder.layer):
        prefix = f"encoder_stack/{index}/"
        parts = (layer.attention.self.query, layer.attention.self.key, layer.attention.self.value)
        arrays |= {
            prefix + "multihead_norm_scale": _np(norms[2 * index].weight),
            prefix + "multihead_norm_bias": _np(norms[2 * index].bias),
            prefix + "multihead_project_kernel_qkv": np.concatenate([_kernel(p) for p in parts], axis=-1),
            prefix + "multihead_project_bias_qkv": np.concatenate([_np(p.bias) for p in parts]),
            prefix + "multihead_project_kernel_output": _kernel(layer.attention.output.dense),
            prefix + "multihead_project_bias_output": _np(layer.attention.output.dense.bias),
            prefix + "ffn_norm_scale": _np(norms[2 * index + 1].weight),
            prefix + "ffn_norm_bias": _np(norms[2 * index + 1].bias),
            prefix + "ffn_first_kernel": _kernel(layer.intermediate.dense),
            prefix + "ffn_first_bias": _np(layer.intermediate.dense.bias),
            prefix + "ffn_second_kernel": _kernel(layer.output.dense),
            prefix + "ffn_second_bias": _np(layer.output.dense.bias),
        }
    return arrays


def bert_conf(model: Any, **overrides: Any) -> dict[str, Any]:
    """`hf_bert_export.py`'s model_conf, with `overrides`."""
    conf = {"head_num": model.config.num_attention_heads, "src_padding_id": model.config.pad_token_id,
            "is_post_ln": True, "use_gelu": True}
    return conf | overrides


#: LightSeq's example model folders (configs only): tests/e2e/lightseq_models.
EXAMPLES = Path(__file__).resolve().parent.parent / "e2e" / "lightseq_models"
EXAMPLE_FILES = {
    "transformer_example": ("Transformer", "lightseq_bart_base.hdf5"),
    "gpt_example": ("Gpt", "lightseq_gpt2_base.hdf5"),
    "bert_example": ("Bert", "lightseq_bert_base_uncased.hdf5"),
}


def example_folder(repository: Path, example: str, name: str | None = None, filename: str | None = None,
                   cpu: bool = False) -> Path:
    """LightSeq's example model folder in `repository`: its config (renamed, another model file, or KIND_CPU when
    asked), an empty version folder."""
    folder = repository / (name or example)
    (folder / "1").mkdir(parents=True)
    text = (EXAMPLES / example / "config.pbtxt").read_text()
    if cpu:
        text = text.replace("KIND_GPU", "KIND_CPU")
    if name:
        text = text.replace(f'name: "{example}"', f'name: "{name}"')
    if filename:
        text = text.replace(f'"{EXAMPLE_FILES[example][1]}"', f'"{filename}"')
    (folder / "config.pbtxt").write_text(text)
    return folder


def example_repository(repository: Path, models: dict[str, Any], cpu: bool = False, **transformer: Any) -> Path:
    """LightSeq's three example models with their files written from `models` ("bart", "gpt2", "bert");
    `transformer` overrides the Transformer's model_conf."""
    bart, gpt, bert = models["bart"], models["gpt2"], models["bert"]
    contents = {
        "transformer_example": (transformer_arrays(bart), transformer_conf(bart, **transformer)),
        "gpt_example": (gpt_arrays(gpt), gpt_conf(gpt)),
        "bert_example": (bert_arrays(bert), bert_conf(bert)),
    }
    for example, (arrays, conf) in contents.items():
        model_type, filename = EXAMPLE_FILES[example]
        write(example_folder(repository, example, cpu=cpu) / filename, model_type, arrays, conf)
    return repository
