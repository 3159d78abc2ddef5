"""The torch engine's decoding step timed alone: `torch/model_runner.ModelRunner.step` at a number of rows, with a cache
of `STEPS_BEFORE` steps, as the engine builds the runner on CPU float32 (packed oneDNN weights)."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common.generation_models import PROMPT_IDS, PROMPT_LENGTHS

ROWS = (1, 2, 4, 6, 8, 10, 12, 14, 16)
BATCH = 16
STEPS_BEFORE = 60


def load_runner(model_dir: Path, threads: int) -> tuple[Any, Any]:
    """The model's `ModelRunner` as the engine builds it on CPU float32 (packed oneDNN weights), and its config."""
    import torch
    import transformers

    from transerve.backends.generation.torch.model_runner import ModelRunner
    from transerve.backends.generation.torch.onednn_linear import use_onednn_linears

    torch.set_num_threads(threads)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    loader = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    model = loader.from_pretrained(model_dir).eval()
    use_onednn_linears(model, pack=True)  # the engine's default on CPU float32
    return ModelRunner(model, model.generation_config.decoder_start_token_id, config.pad_token_id or 0, BATCH), config


def measure(model_dir: Path, threads: int, repeats: int, rows_counts: tuple[int, ...] = ROWS) -> dict[int, float]:
    """This process: the median ms of a step at each row count, with `STEPS_BEFORE` steps in the cache."""
    import torch

    runner, config = load_runner(model_dir, threads)
    rng = random.Random(0)
    costs = {}
    with torch.inference_mode():
        for rows in rows_counts:
            inputs = [[rng.randrange(*PROMPT_IDS) for _ in range(rng.randint(*PROMPT_LENGTHS))] for _ in range(rows)]
            batch, first = runner.new_rows(inputs, [1] * rows)
            tokens = first if config.is_encoder_decoder else first.argmax(-1)
            times = []
            for step in range(STEPS_BEFORE + repeats):
                started = time.perf_counter()
                tokens = runner.step(batch, tokens).argmax(-1)
                if step >= STEPS_BEFORE:
                    times.append(time.perf_counter() - started)
            costs[rows] = statistics.median(times) * 1000
    return costs
