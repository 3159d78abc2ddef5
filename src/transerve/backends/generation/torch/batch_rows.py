"""The torch engine's `max_batch_rows` when the config does not set it: 32 on the CPU, sized on a GPU.

32 rows is a CPU figure: a step's cost grows with its rows there, but more slowly than its rows, and a sequence that
finds no free row waits for a whole request to end: 32 streaming clients waited far longer for their first token on
16 rows than on 32, which also gave more tokens/s (benchmarks/README.md, "OpenAI API against vLLM"). On a GPU a step
of 64 rows costs about what a step of 16 does, so the row count should be as large as memory allows: the KV cache
buffers hold `max_batch_rows` rows for the longest history running (`cache_buffers.py`), so the rows are what the
free memory holds at the longest history one row can have, within a share of it, and no more than the
`kv_cache_tokens` budget could ever admit of short sequences. docs/generation.md, "On a GPU", states the rule.
"""

from __future__ import annotations

from typing import Any

#: The CPU default, and what a config's absent `max_batch_rows` means there.
CPU_ROWS = 32
#: The most rows a GPU default gives: beyond this, steps stop getting cheaper per row on the GPUs measured.
MAX_GPU_ROWS = 256
#: The share of the free GPU memory (after the weights loaded) the KV cache buffers may fill at the longest history.
CACHE_MEMORY_SHARE = 0.5
#: The fewest tokens of the `kv_cache_tokens` budget a row takes (a short prompt and answer): more rows than the
#: budget holds of those could never all run.
SHORT_ROW_TOKENS = 64
#: GPU row counts are rounded down to a multiple of this (bucketed shapes for kernels and captured graphs).
ROW_MULTIPLE = 8


def gpu_batch_rows(free_bytes: int, bytes_per_token: int, longest_row_tokens: int, kv_cache_tokens: int) -> int:
    """Rows for a GPU with `free_bytes` free: what `CACHE_MEMORY_SHARE` of them holds at `longest_row_tokens` tokens
    of `bytes_per_token` each, at most `kv_cache_tokens // SHORT_ROW_TOKENS` and `MAX_GPU_ROWS`, rounded down to a
    multiple of `ROW_MULTIPLE` when there are that many; at least 1."""
    row_bytes = max(1, bytes_per_token * max(1, min(longest_row_tokens, kv_cache_tokens)))
    rows = min(int(free_bytes * CACHE_MEMORY_SHARE) // row_bytes, kv_cache_tokens // SHORT_ROW_TOKENS, MAX_GPU_ROWS)
    if rows >= ROW_MULTIPLE:
        rows -= rows % ROW_MULTIPLE
    return max(1, rows)


def kv_bytes_per_token(config: Any, element_bytes: int) -> int:
    """The cache bytes one token of history takes: keys and values of every decoder layer (`kv_width` each)."""
    layers = next(value for value in (getattr(config, "decoder_layers", None),
                                      getattr(config, "num_decoder_layers", None),
                                      config.num_hidden_layers) if isinstance(value, int) and value > 0)
    return 2 * layers * kv_width(config) * element_bytes


def kv_width(config: Any) -> int:
    """One token's keys (or values) in one layer: key/value heads times the head size. Not the model's width:
    grouped-query attention keeps fewer key/value heads than query heads (Llama 3 8B: a quarter of the width), and
    T5's heads times `d_kv` need not be its `d_model` (t5-11b: 16 times it)."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_size = (getattr(config, "head_dim", None) or getattr(config, "d_kv", None)
                 or (config.hidden_size // heads if heads else None))
    return kv_heads * head_size if kv_heads and head_size else config.hidden_size


def longest_row_tokens(is_encoder_decoder: bool, max_input_length: int, max_positions: int | None) -> int:
    """The longest history one row can hold: a decoder-only model's positions; an encoder-decoder model's source
    (its cross-attention keys) and as many decoder steps as its positions (or, unbounded, its source) allow."""
    if not is_encoder_decoder:
        return max_positions or max_input_length
    return max_input_length + (max_positions or max_input_length)


def default_batch_rows(model: Any, device: Any, is_encoder_decoder: bool, max_input_length: int,
                       max_positions: int | None, kv_cache_tokens: int) -> int:
    """`CPU_ROWS` off the GPU; on it, `gpu_batch_rows` from the device's free memory now (the weights loaded)."""
    if device.type != "cuda":
        return CPU_ROWS
    import torch

    free_bytes, _ = torch.cuda.mem_get_info(device)
    element_bytes = next(model.parameters()).element_size()
    text = model.config.get_text_config(decoder=True)
    return gpu_batch_rows(free_bytes, kv_bytes_per_token(text, element_bytes),
                          longest_row_tokens(is_encoder_decoder, max_input_length, max_positions), kv_cache_tokens)
