"""The torch engine's default `max_batch_rows` (`batch_rows`): 32 on the CPU; on a GPU what the free memory holds
at the longest history a row can have, within the `kv_cache_tokens` budget and a cap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from transerve.backends.generation.torch.batch_rows import (
    CPU_ROWS,
    MAX_GPU_ROWS,
    default_batch_rows,
    gpu_batch_rows,
    kv_bytes_per_token,
    kv_width,
    longest_row_tokens,
)

GIB = 1 << 30
#: GPT-2 small in float16: 12 layers of 768, keys and values of 2 bytes.
GPT2_TOKEN = 2 * 12 * 768 * 2


@pytest.mark.parametrize(
    ("free", "per_token", "longest", "budget", "rows"),
    [
        (78 * GIB, GPT2_TOKEN, 1024, 65536, MAX_GPU_ROWS),  # an H100: the cap
        (2 * GIB, GPT2_TOKEN, 1024, 65536, 24),  # 1 GiB for the cache / 36 MiB a row = 28 rows, to a multiple of 8
        (78 * GIB, GPT2_TOKEN, 1024, 3000, 40),  # the budget: 3000 // 64 = 46 rows of short sequences, to 40
        (78 * GIB, GPT2_TOKEN, 1024, 1024, 16),  # a budget of one longest row still fits 16 short ones
        (60 * GIB, 2 * 32 * 4096 * 2, 8192, 65536, 7),  # an 8B model at 8k positions: 4 GiB a row; below 8 as is
        (100 << 20, GPT2_TOKEN, 1024, 65536, 1),  # memory for less than one row: still one
        (0, GPT2_TOKEN, 1024, 65536, 1),
    ],
)
def test_gpu_rows_from_free_memory_the_budget_and_the_cap(free, per_token, longest, budget, rows):
    assert gpu_batch_rows(free, per_token, longest, budget) == rows


def test_a_row_is_counted_at_most_at_the_whole_budget():
    """A history longer than `kv_cache_tokens` can never run: the budget bounds a row's size."""
    assert gpu_batch_rows(GIB, 100_000, 10**9, 4096) == gpu_batch_rows(GIB, 100_000, 4096, 4096) == 1


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (SimpleNamespace(num_hidden_layers=12, hidden_size=768), 2 * 12 * 768 * 2),  # GPT-2 (n_layer, n_embd)
        (SimpleNamespace(num_hidden_layers=6, num_decoder_layers=8, hidden_size=512), 2 * 8 * 512 * 2),  # T5
        (SimpleNamespace(num_hidden_layers=6, decoder_layers=3, hidden_size=512), 2 * 3 * 512 * 2),  # BART
        (SimpleNamespace(num_hidden_layers=6, num_decoder_layers=None, hidden_size=512), 2 * 6 * 512 * 2),
    ],
)
def test_cache_bytes_per_token_count_every_decoder_layer(config, expected):
    assert kv_bytes_per_token(config, element_bytes=2) == expected


@pytest.mark.parametrize(
    ("name", "settings", "width"),
    [
        ("GPT2Config", {"n_embd": 768, "n_head": 12}, 768),
        ("BartConfig", {"d_model": 1024, "encoder_attention_heads": 16}, 1024),
        ("T5Config", {"d_model": 1024, "num_heads": 128, "d_kv": 128}, 128 * 128),  # t5-11b: not its d_model
        ("LlamaConfig", {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}, 8 * 128),  # GQA
        ("LlamaConfig", {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64},
         8 * 64),
    ],
)
def test_the_cache_width_is_key_value_heads_times_head_size(name, settings, width):
    """Counted at the model's width, a grouped-query model's rows would be sized 4x too few, a T5 whose heads are
    wider than its d_model many times too many (more than the memory holds)."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, name)(**settings)
    assert kv_width(config) == width
    layers = config.get_text_config(decoder=True).num_hidden_layers if name != "T5Config" else config.num_decoder_layers
    assert kv_bytes_per_token(config, element_bytes=2) == 2 * layers * width * 2


def test_the_longest_row_by_kind_of_model():
    assert longest_row_tokens(False, max_input_length=1024, max_positions=1024) == 1024  # GPT-2: its positions
    assert longest_row_tokens(True, max_input_length=512, max_positions=None) == 1024  # T5: source + as many steps
    assert longest_row_tokens(True, max_input_length=512, max_positions=512) == 1024  # Marian


def test_the_engine_picks_32_on_the_cpu_and_sizes_on_a_gpu(models, monkeypatch):
    """On the CPU an engine without `max_batch_rows` decodes 32 rows; the GPU path reads the device's free memory
    (faked here) and the model's shape: the tiny GPT-2 (2 layers of 64, float32) at its 1024 positions."""
    import torch

    engine = models["gpt2"].engine
    assert engine.max_batch_rows == CPU_ROWS
    model = engine.runner.forward.model
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (GIB, 80 * GIB))
    rows = default_batch_rows(model, torch.device("cuda", 0), False, 1024, 1024, 65536)
    assert rows == gpu_batch_rows(GIB, 2 * 2 * 64 * 4, 1024, 65536) == MAX_GPU_ROWS
    assert default_batch_rows(model, torch.device("cpu"), False, 1024, 1024, 65536) == CPU_ROWS
