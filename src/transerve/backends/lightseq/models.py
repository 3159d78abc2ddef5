"""LightSeq's weights as Hugging Face models that compute what LightSeq computes.

- Transformer (post-LN, learned positions, shared source/target embeddings: what `hf_bart_export.py` writes)
  -> `BartForConditionalGeneration`. LightSeq keeps each post-LN layer norm in the layer *after* the one that
  applies it (a layer starts by normalizing its input; the embedding's norm holds the last layer's), so the norms are
  shifted back here. Its position table starts at position 0; BART's has two unused rows first.
- Gpt (`hf_gpt2_export.py`) -> `GPT2LMHeadModel`: the same pre-LN layout, kernels already in Conv1D's [in, out].
- Bert (`hf_bert_export.py`) -> `BertModel` whose token-type embedding is zero (LightSeq has none: the export folds
  type 0 into the position table), norms shifted back as for the Transformer.

Where the math differs: LightSeq's GELU is the tanh approximation (`gelu_new` here for Gpt; BART and BERT use
the exact GELU, within about 1e-3 of it); LightSeq computes in float16 on GPUs. Refused with FormatError: pre-LN
Transformer and Bert files (fairseq's `--encoder-normalize-before` exports), separate source and target
vocabularies, multilingual models (`multilg_type`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transerve.backends.lightseq.weights import FormatError, LightSeqWeights


def _t(array: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(array))


def _size(weights: LightSeqWeights, path: str, per: int = 1) -> int:
    value = weights.arrays.get(path)
    if value is None:
        raise FormatError(f"the {weights.model_type} model file has no '{path}'")
    if per <= 0 or value.size % per:
        raise FormatError(f"'{path}' holds {value.size} values, not a multiple of {per}")
    return value.size // per


def _stack_sizes(weights: LightSeqWeights) -> tuple[int, int, int, int, int]:
    """A Gpt or Bert file's sizes, read off its arrays: hidden, vocabulary, positions, layers, feed-forward inner."""
    hidden = _size(weights, "src_embedding/norm_scale")
    vocab = _size(weights, "src_embedding/token_embedding", hidden)
    positions = _size(weights, "src_embedding/position_embedding", hidden)
    layers = weights.layers.get("encoder_stack", 0)
    if not layers:
        raise FormatError(f"the {weights.model_type} file has no layers (encoder_stack)")
    return hidden, vocab, positions, layers, _size(weights, "encoder_stack/0/ffn_first_bias")


def _heads(weights: LightSeqWeights, hidden: int) -> int:
    heads = int(weights.conf.get("head_num") or 0)
    if heads <= 0 or hidden % heads:
        raise FormatError(f"model_conf head_num {heads} does not divide the hidden size {hidden}")
    return heads


def _norm(module: Any, weights: LightSeqWeights, prefix: str, hidden: int) -> None:
    module.weight.data = _t(weights.array(f"{prefix}_scale", hidden))
    module.bias.data = _t(weights.array(f"{prefix}_bias", hidden))


def _linear(module: Any, kernel: np.ndarray, bias: np.ndarray) -> None:
    """LightSeq's kernels are [in, out]; torch's Linear weights [out, in]."""
    module.weight.data = _t(kernel.T)
    module.bias.data = _t(bias)


def _attention(attention: Any, weights: LightSeqWeights, prefix: str, hidden: int) -> None:
    """Self-attention from LightSeq's fused [in, 3, out] kernel and [3, out] bias."""
    kernel = weights.array(f"{prefix}_kernel_qkv", hidden, 3 * hidden)
    bias = weights.array(f"{prefix}_bias_qkv", 3 * hidden)
    for index, name in enumerate(("q_proj", "k_proj", "v_proj")):
        part = slice(index * hidden, (index + 1) * hidden)
        _linear(getattr(attention, name), kernel[:, part], bias[part])
    _linear(attention.out_proj, weights.array(f"{prefix}_kernel_output", hidden, hidden),
            weights.array(f"{prefix}_bias_output", hidden))


def _ffn(layer: Any, weights: LightSeqWeights, prefix: str, hidden: int, inner: int) -> None:
    _linear(layer.fc1, weights.array(f"{prefix}/ffn_first_kernel", hidden, inner),
            weights.array(f"{prefix}/ffn_first_bias", inner))
    _linear(layer.fc2, weights.array(f"{prefix}/ffn_second_kernel", inner, hidden),
            weights.array(f"{prefix}/ffn_second_bias", hidden))


def transformer_model(weights: LightSeqWeights) -> Any:
    """A `BartForConditionalGeneration` computing the LightSeq Transformer (see the module docstring)."""
    import transformers

    conf = weights.conf
    if not conf.get("is_post_ln"):
        raise FormatError("pre-LN Transformer files (is_post_ln false) are not served yet; post-LN (BART-like) are")
    if conf.get("multilg_type"):
        raise FormatError("multilingual Transformer files (multilg_type) are not served")
    hidden = _size(weights, "trg_embedding/norm_scale")
    vocab = _size(weights, "trg_embedding/token_embedding", hidden)
    if _size(weights, "src_embedding/token_embedding", hidden) != vocab:
        raise FormatError("separate source and target vocabularies are not served (BART shares one embedding)")
    encoders, decoders = weights.layers.get("encoder_stack", 0), weights.layers.get("decoder_stack", 0)
    if not encoders or not decoders:
        raise FormatError(f"the file has {encoders} encoder and {decoders} decoder layers; both must be present")
    inner = _size(weights, "decoder_stack/0/ffn_first_bias")
    max_step = _size(weights, "trg_embedding/position_embedding", hidden)
    heads = _heads(weights, hidden)
    end, start = int(conf.get("trg_end_id", 0)), int(conf.get("trg_start_id", 0))
    config = transformers.BartConfig(
        vocab_size=vocab, d_model=hidden, encoder_layers=encoders, decoder_layers=decoders,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=inner, decoder_ffn_dim=inner,
        activation_function="gelu" if conf.get("use_gelu") else "relu", max_position_embeddings=max_step,
        scale_embedding=not conf.get("no_scale_embedding"), dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=int(conf.get("src_padding_id", 0)), bos_token_id=start,
        eos_token_id=end, decoder_start_token_id=start, forced_eos_token_id=None, forced_bos_token_id=None,
        tie_word_embeddings=True,
    )
    model = transformers.BartForConditionalGeneration(config).eval()
    shared = weights.array("src_embedding/token_embedding", vocab, hidden)
    if not np.array_equal(shared, weights.array("trg_embedding/token_embedding", hidden, vocab).T):
        raise FormatError("the source and target token embeddings differ; BART shares one")
    model.model.shared.weight.data = _t(shared)
    model.model.encoder.embed_tokens.weight = model.model.shared.weight
    model.model.decoder.embed_tokens.weight = model.model.shared.weight
    model.lm_head.weight = model.model.shared.weight
    bias = weights.arrays.get("trg_embedding/shared_bias")
    model.final_logits_bias.data = _t(np.zeros((1, vocab), np.float32) if bias is None
                                      else weights.array("trg_embedding/shared_bias", 1, vocab))
    _encoder(model.model.encoder, weights, hidden, inner, encoders, max_step)
    _decoder(model.model.decoder, weights, hidden, inner, decoders, max_step)
    return model


def _positions(module: Any, weights: LightSeqWeights, path: str, hidden: int, max_step: int) -> None:
    table = np.zeros((max_step + 2, hidden), np.float32)  # BART's positions start at row 2
    table[2:] = weights.array(path, max_step, hidden)
    module.weight.data = _t(table)


def _encoder(encoder: Any, weights: LightSeqWeights, hidden: int, inner: int, layers: int, max_step: int) -> None:
    _positions(encoder.embed_positions, weights, "src_embedding/position_embedding", hidden, max_step)
    _norm(encoder.layernorm_embedding, weights, "encoder_stack/0/multihead_norm", hidden)
    for index, layer in enumerate(encoder.layers):
        prefix = f"encoder_stack/{index}"
        _attention(layer.self_attn, weights, f"{prefix}/multihead_project", hidden)
        _norm(layer.self_attn_layer_norm, weights, f"{prefix}/ffn_norm", hidden)
        _ffn(layer, weights, prefix, hidden, inner)
        following = f"encoder_stack/{index + 1}/multihead_norm" if index + 1 < layers else "src_embedding/norm"
        _norm(layer.final_layer_norm, weights, following, hidden)


def _decoder(decoder: Any, weights: LightSeqWeights, hidden: int, inner: int, layers: int, max_step: int) -> None:
    _positions(decoder.embed_positions, weights, "trg_embedding/position_embedding", hidden, max_step)
    _norm(decoder.layernorm_embedding, weights, "decoder_stack/0/self_norm", hidden)
    kv_kernel = weights.array("trg_embedding/encode_output_project_kernel_kv", hidden, layers * 2 * hidden)
    kv_bias = weights.array("trg_embedding/encode_output_project_bias_kv", layers * 2 * hidden)
    for index, layer in enumerate(decoder.layers):
        prefix = f"decoder_stack/{index}"
        _attention(layer.self_attn, weights, f"{prefix}/self_project", hidden)
        _norm(layer.self_attn_layer_norm, weights, f"{prefix}/encdec_norm", hidden)
        cross = layer.encoder_attn
        _linear(cross.q_proj, weights.array(f"{prefix}/encdec_project_kernel_q", hidden, hidden),
                weights.array(f"{prefix}/encdec_project_bias_q", hidden))
        for offset, projection in enumerate((cross.k_proj, cross.v_proj)):
            part = slice((2 * index + offset) * hidden, (2 * index + offset + 1) * hidden)
            _linear(projection, kv_kernel[:, part], kv_bias[part])
        _linear(cross.out_proj, weights.array(f"{prefix}/encdec_project_kernel_output", hidden, hidden),
                weights.array(f"{prefix}/encdec_project_bias_output", hidden))
        _norm(layer.encoder_attn_layer_norm, weights, f"{prefix}/ffn_norm", hidden)
        _ffn(layer, weights, prefix, hidden, inner)
        following = f"decoder_stack/{index + 1}/self_norm" if index + 1 < layers else "trg_embedding/norm"
        _norm(layer.final_layer_norm, weights, following, hidden)


def gpt_model(weights: LightSeqWeights) -> Any:
    """A `GPT2LMHeadModel` computing the LightSeq Gpt (see the module docstring)."""
    import transformers

    conf = weights.conf
    hidden, vocab, max_step, layers, inner = _stack_sizes(weights)
    eos = int(conf.get("eos_id", 0))
    pad = int(conf.get("src_padding_id", 0))
    config = transformers.GPT2Config(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=_heads(weights, hidden), n_inner=inner,
        n_positions=max_step, activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=pad if 0 <= pad < vocab else eos,
        tie_word_embeddings=True,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    body = model.transformer
    body.wte.weight.data = _t(weights.array("src_embedding/token_embedding", vocab, hidden))
    model.lm_head.weight = body.wte.weight
    body.wpe.weight.data = _t(weights.array("src_embedding/position_embedding", max_step, hidden))
    _norm(body.ln_f, weights, "src_embedding/norm", hidden)
    for index, block in enumerate(body.h):
        prefix = f"encoder_stack/{index}"
        _norm(block.ln_1, weights, f"{prefix}/multihead_norm", hidden)
        _norm(block.ln_2, weights, f"{prefix}/ffn_norm", hidden)
        # GPT-2's Conv1D weights are [in, out], as LightSeq's kernels
        block.attn.c_attn.weight.data = _t(weights.array(f"{prefix}/multihead_project_kernel_qkv", hidden, 3 * hidden))
        block.attn.c_attn.bias.data = _t(weights.array(f"{prefix}/multihead_project_bias_qkv", 3 * hidden))
        block.attn.c_proj.weight.data = _t(weights.array(f"{prefix}/multihead_project_kernel_output", hidden, hidden))
        block.attn.c_proj.bias.data = _t(weights.array(f"{prefix}/multihead_project_bias_output", hidden))
        block.mlp.c_fc.weight.data = _t(weights.array(f"{prefix}/ffn_first_kernel", hidden, inner))
        block.mlp.c_fc.bias.data = _t(weights.array(f"{prefix}/ffn_first_bias", inner))
        block.mlp.c_proj.weight.data = _t(weights.array(f"{prefix}/ffn_second_kernel", inner, hidden))
        block.mlp.c_proj.bias.data = _t(weights.array(f"{prefix}/ffn_second_bias", hidden))
    return model


def bert_model(weights: LightSeqWeights) -> Any:
    """A `BertModel` (no pooler) computing the LightSeq Bert (see the module docstring)."""
    import transformers

    conf = weights.conf
    if not conf.get("is_post_ln", True):
        raise FormatError("pre-LN Bert files (is_post_ln false) are not served yet")
    if conf.get("multilg_type"):
        raise FormatError("multilingual Bert files (multilg_type) are not served")
    hidden, vocab, positions, layers, inner = _stack_sizes(weights)
    config = transformers.BertConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=_heads(weights, hidden),
        intermediate_size=inner, hidden_act="gelu" if conf.get("use_gelu", True) else "relu",
        max_position_embeddings=positions, type_vocab_size=1, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=int(conf.get("src_padding_id", 0)),
    )
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    embeddings = model.embeddings
    embeddings.word_embeddings.weight.data = _t(weights.array("src_embedding/token_embedding", vocab, hidden))
    embeddings.position_embeddings.weight.data = _t(weights.array("src_embedding/position_embedding", positions,
                                                                  hidden))
    embeddings.token_type_embeddings.weight.data.zero_()  # LightSeq folded type 0 into the token embedding
    _norm(embeddings.LayerNorm, weights, "encoder_stack/0/multihead_norm", hidden)
    for index, layer in enumerate(model.encoder.layer):
        prefix = f"encoder_stack/{index}"
        kernel = weights.array(f"{prefix}/multihead_project_kernel_qkv", hidden, 3 * hidden)
        bias = weights.array(f"{prefix}/multihead_project_bias_qkv", 3 * hidden)
        for part, name in enumerate(("query", "key", "value")):
            columns = slice(part * hidden, (part + 1) * hidden)
            _linear(getattr(layer.attention.self, name), kernel[:, columns], bias[columns])
        _linear(layer.attention.output.dense, weights.array(f"{prefix}/multihead_project_kernel_output", hidden,
                                                             hidden),
                weights.array(f"{prefix}/multihead_project_bias_output", hidden))
        _norm(layer.attention.output.LayerNorm, weights, f"{prefix}/ffn_norm", hidden)
        _linear(layer.intermediate.dense, weights.array(f"{prefix}/ffn_first_kernel", hidden, inner),
                weights.array(f"{prefix}/ffn_first_bias", inner))
        _linear(layer.output.dense, weights.array(f"{prefix}/ffn_second_kernel", inner, hidden),
                weights.array(f"{prefix}/ffn_second_bias", hidden))
        following = f"encoder_stack/{index + 1}/multihead_norm" if index + 1 < layers else "src_embedding/norm"
        _norm(layer.output.LayerNorm, weights, following, hidden)
    return model
