"""The torch engine's tests' shared parts: a test model with its transformers reference, and how a test submits
to an engine and reads its result (tests/generation/test_torch_*.py)."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch
import transformers

from transerve.backends.generation.engine import DecodingOptions, GenerationRequest, GenerationResult
from transerve.backends.generation.torch.engine import TorchEngine

TEXTS = [
    "translate English to German: The house is wonderful.",
    "Hello world",
    "The quick brown fox jumps over the lazy dog. Hello world, how are you today?",
]


class Model:
    """One test model: its folder, tokenizer, transformers model (the reference) and a shared engine."""

    def __init__(self, arch: str, path: Path) -> None:
        from tokenizers import Tokenizer

        self.arch = arch
        self.path = path
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        loader = transformers.AutoModelForCausalLM if arch == "gpt2" else transformers.AutoModelForSeq2SeqLM
        self.hf = loader.from_pretrained(path).eval()
        self.engine = TorchEngine(path, intra_op_threads=0)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def reference(self, ids: list[int], end_ids: list[int] | None = None, **kwargs) -> list[list[int]]:
        """transformers' new tokens per returned sequence, cut after the first end token."""
        ends = end_ids if end_ids is not None else self.engine.eos_token_ids
        if end_ids is not None:
            kwargs["eos_token_id"] = end_ids
            kwargs.setdefault("pad_token_id", self.hf.generation_config.pad_token_id or 0)
        with torch.inference_mode():
            kwargs.setdefault("do_sample", False)
            out = self.hf.generate(torch.tensor([ids], device=self.hf.device), **kwargs)
        skip = 1 if self.hf.config.is_encoder_decoder else len(ids)
        sequences = []
        for row in out.tolist():
            new = row[skip:]
            cut = [i for i, token in enumerate(new) if token in ends]
            sequences.append(new[: cut[0] + 1] if cut else new)
        return sequences


def joining_load(model: Model) -> list[tuple[list[int], DecodingOptions, dict]]:
    """Sequences of different lengths and options, with the `generate` arguments that give their output."""
    load = []
    for index, text in enumerate(TEXTS * 2):
        ids = model.ids(text)[: 4 + 5 * index]
        if index % 3 == 2:
            options = DecodingOptions(max_new_tokens=6 + index, beam_width=3, num_return_sequences=2)
            kwargs = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 6 + index}
        else:
            options = DecodingOptions(max_new_tokens=5 + 3 * index)
            kwargs = {"max_new_tokens": 5 + 3 * index}
        load.append((ids, options, kwargs))
    return load


def submit(engine: TorchEngine, ids: list[int], options: DecodingOptions, on_tokens=None) -> Future:
    future: Future = Future()
    engine.submit(GenerationRequest(ids, options, stream=on_tokens is not None), on_tokens, future.set_result)
    return future


def run(engine: TorchEngine, ids: list[int], options: DecodingOptions) -> GenerationResult:
    result = submit(engine, ids, options).result(timeout=60)
    assert isinstance(result, GenerationResult), result
    return result


def tokens(result: GenerationResult) -> list[list[int]]:
    return [hypothesis.token_ids for hypothesis in result.hypotheses]


def common_token(model: Model, ids: list[int]) -> int:
    """A token greedy decoding produces a few steps in: an end id that ends sequences early."""
    return model.reference(ids, max_new_tokens=8)[0][4]
