"""The generation benchmarks' models and load: random-weight t5-small and GPT-2 small shapes, converted by
`transerve convert` for every served configuration, a seeded load of prompts and new-token counts, and the engine
called directly (CTranslate2 ceilings, time to first token) as the floor under the served numbers.

Every request must get exactly what it asked for, so the end token of every request is an id the model never
picks: `silence_token` scales that vocabulary entry's output row down to nearly zero.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common.machine import OtherWork, wait_for_quiet

#: Served configurations: (suffix, engine, quantization, torch scheduling).
SERVED = (
    ("ct2_float32", "ctranslate2", "float32", None),
    ("ct2_int8", "ctranslate2", "int8", None),
    ("torch_inflight", "torch", "float32", "inflight"),
    ("torch_request", "torch", "float32", "request"),
    ("torch_static", "torch", "float32", "static"),
)
#: Decoupled configurations for time to first token.
STREAMED = (
    ("ct2_float32_stream", "ctranslate2", "float32", None),
    ("ct2_int8_stream", "ctranslate2", "int8", None),
    ("torch_inflight_stream", "torch", "float32", "inflight"),
)
PROMPT_LENGTHS = (8, 64)
NEW_TOKENS = (8, 128)
#: Prompt token ids are drawn from the byte-level alphabet, which both tokenizers hold past their specials.
PROMPT_IDS = (3, 259)


@dataclass(frozen=True)
class Shape:
    architecture: str
    title: str
    sizes: dict[str, int]
    #: Other transformers config fields of the real model.
    config: dict[str, int]


SHAPES = {
    "t5": Shape("t5", "T5, t5-small shape (d_model 512, 6+6 layers, vocab 32128)",
                {"d_model": 512, "layers": 6, "vocab_size": 32128}, {"d_ff": 2048, "num_heads": 8, "d_kv": 64}),
    "gpt2": Shape("gpt2", "GPT-2 small shape (d_model 768, 12 layers, vocab 50257)",
                  {"d_model": 768, "layers": 12, "vocab_size": 50257}, {"n_head": 12, "n_positions": 1024}),
}
QUICK_SHAPES = {
    "t5": Shape("t5", "T5, tiny (--quick)", {"d_model": 64, "layers": 2, "vocab_size": 2000}, {}),
    "gpt2": Shape("gpt2", "GPT-2, tiny (--quick)", {"d_model": 64, "layers": 2, "vocab_size": 2000}, {}),
}


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    new_tokens: int


@dataclass
class Measured:
    """One configuration's numbers; rounds of the same configuration merge (tokens and time summed)."""

    model: str
    key: str
    label: str
    tokens: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    #: Per completed request: the new tokens it asked for (pairs with `latencies_ms`).
    lengths: list[int] = field(default_factory=list)
    errors: int = 0
    #: Cores' worth of CPU other processes used during the run (the most of merged rounds).
    background: float = 0.0
    note: str = ""

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def merge(self, other: Measured) -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.latencies_ms += other.latencies_ms
        self.lengths += other.lengths
        self.errors += other.errors
        self.background = max(self.background, other.background)
        self.note = other.note or self.note

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")


@dataclass
class FirstToken:
    """Time to first token of one streaming configuration, and the time per token after the first."""

    model: str
    key: str
    label: str
    ttft_ms: list[float] = field(default_factory=list)
    per_token_ms: list[float] = field(default_factory=list)

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.ttft_ms, q)) if self.ttft_ms else float("nan")


@dataclass
class Model:
    """One benchmarked model: its Hugging Face folder, the repository `transerve convert` wrote, its ids."""

    name: str
    shape: Shape
    hf_dir: Path
    repository: Path
    encoder_decoder: bool
    eos_id: int
    pad_id: int
    #: The end id every request names: an id whose output row was scaled down so that it is never picked.
    end_id: int

    def ct2_dir(self, precision: str) -> Path:
        return self.repository / f"{self.name}_ct2_{precision}" / "1" / "model"


# ------------------------------------------------------------------------------------------------ models


def prepare_model(name: str, shape: Shape, workdir: Path) -> Model:
    """Build (once per workdir) the random-weight model, silence its end id, and convert it for every config."""
    import transformers

    from tests.support.generation_models import build_generation_model
    from transerve.convert.command import convert

    folder = workdir / f"{name}-{shape.sizes['d_model']}x{shape.sizes['layers']}-{shape.sizes['vocab_size']}"
    hf_dir, repository = folder / "hf", folder / "repository"
    done = folder / "complete"
    config = transformers.AutoConfig.from_pretrained(hf_dir) if done.exists() else None
    if config is None:
        shutil.rmtree(folder, ignore_errors=True)
        print(f"building the {shape.title} model in {folder}...", file=sys.stderr)
        build_generation_model(shape.architecture, hf_dir, d_model=shape.sizes["d_model"],
                               layers=shape.sizes["layers"], vocab_size=shape.sizes["vocab_size"], config=shape.config)
        silence_token(hf_dir, shape.sizes["vocab_size"] - 1)
        config = transformers.AutoConfig.from_pretrained(hf_dir)
        done.touch()
    for suffix, engine, quantization, scheduling in SERVED + STREAMED:  # those a kept workdir lacks too
        if (repository / f"{name}_{suffix}").is_dir():
            continue
        written = convert(hf_dir, repository, engine, quantization, f"{name}_{suffix}", max_batch_size=8,
                          decoupled=suffix.endswith("_stream"))
        for extra in written[1:]:  # the tokenizer, detokenizer and text ensemble: not measured here
            shutil.rmtree(repository / extra)
        if scheduling:
            set_parameter(repository / f"{name}_{suffix}" / "config.pbtxt", "scheduling", scheduling)
    encoder_decoder = bool(config.is_encoder_decoder)
    return Model(name, shape, hf_dir, repository, encoder_decoder, eos_id=int(config.eos_token_id),
                 pad_id=int(config.pad_token_id if config.pad_token_id is not None else config.eos_token_id),
                 end_id=shape.sizes["vocab_size"] - 1)


def build_model(workdir: Path, arch: str, quick: bool) -> Path:
    """The plain random-weight model of `arch`'s shape (built once per workdir; no end id silenced, not converted):
    what the benchmarks that drive the torch engine or its `ModelRunner` in process load."""
    from tests.support.generation_models import build_generation_model

    shape = (QUICK_SHAPES if quick else SHAPES)[arch]
    sizes = shape.sizes
    path = workdir / f"{arch}-{sizes['d_model']}x{sizes['layers']}-{sizes['vocab_size']}"
    if not (path / "complete").exists():
        print(f"building the model in {path}...", file=sys.stderr)
        build_generation_model(arch, path, **sizes, config=shape.config)
        (path / "complete").touch()
    return path


def silence_token(hf_dir: Path, token: int) -> None:
    """Scale `token`'s output-embedding row by 1e-3: its logit stays near 0, far below the best, so greedy
    decoding never picks it and it can serve as an end id that never ends a sequence early."""
    import torch
    import transformers

    auto = transformers.AutoModelForSeq2SeqLM if transformers.AutoConfig.from_pretrained(hf_dir).is_encoder_decoder \
        else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(hf_dir)
    with torch.no_grad():
        model.get_output_embeddings().weight[token] *= 1e-3
    model.save_pretrained(hf_dir)


def set_parameter(config_path: Path, key: str, value: str) -> None:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(config_path.read_text(), model_config_pb2.ModelConfig())
    config.parameters[key].string_value = value
    config_path.write_text(text_format.MessageToString(config))


def make_load(count: int, seed: int, model: Model) -> list[Request]:
    """`count` requests: prompts of PROMPT_LENGTHS ids (T5's end with its end-of-sequence token, as its tokenizer
    writes them), each asking for NEW_TOKENS new tokens; the same draws for every model."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        length = rng.randint(*PROMPT_LENGTHS)
        prompt = [rng.randrange(*PROMPT_IDS) for _ in range(length)]
        if model.encoder_decoder:
            prompt[-1] = model.eos_id
        requests.append(Request(tuple(prompt), rng.randint(*NEW_TOKENS)))
    return requests


def batches(requests: list[Request], size: int) -> list[list[Request]]:
    """The requests sorted by new tokens, in batches of `size`: the static batching that pads least."""
    ordered = sorted(requests, key=lambda r: (r.new_tokens, len(r.prompt)))
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


# ----------------------------------------------------------------------------------------------- ceiling


def ct2_vocabulary(model_dir: Path) -> list[str]:
    for name in ("shared_vocabulary.json", "vocabulary.json", "source_vocabulary.json"):
        if (model_dir / name).is_file():
            return json.loads((model_dir / name).read_text())
    raise SystemExit(f"no vocabulary in {model_dir}")


def ceiling_ct2(model: Model, precision: str, requests: list[Request], batch: int, threads: int,
                rounds: int, quiet: float, patience: float, calls: int = 1, device: str = "cpu") -> Measured:
    """CTranslate2 called directly on batches of `batch` requests: best of `rounds` passes over the requests.
    With `calls` > 1, that many threads take the batches in turn, each call on its own replica (`inter_threads`).
    `device` "cuda" runs it on the first GPU (benchmarks.gpu_check)."""
    import ctranslate2

    model_dir = model.ct2_dir(precision)
    vocabulary = ct2_vocabulary(model_dir)
    end = vocabulary[model.end_id]
    groups = [([[vocabulary[t] for t in r.prompt] for r in group], max(r.new_tokens for r in group))
              for group in batches(requests, batch)]
    kind = ctranslate2.Translator if model.encoder_decoder else ctranslate2.Generator
    engine = kind(str(model_dir), device=device, compute_type="default", intra_threads=threads, inter_threads=calls)
    if model.encoder_decoder:
        def decode(tokens: list[list[str]], length: int) -> list[int]:
            results = engine.translate_batch(tokens, beam_size=1, max_decoding_length=length, end_token=end,
                                             max_input_length=0)
            return [len(result.hypotheses[0]) for result in results]
    else:
        def decode(tokens: list[list[str]], length: int) -> list[int]:
            results = engine.generate_batch(tokens, beam_size=1, max_length=length, end_token=end,
                                            include_prompt_in_result=False)
            return [len(result.sequences_ids[0]) for result in results]

    def run() -> int:
        if calls == 1:
            return sum(sum(decode(tokens, length)) for tokens, length in groups)
        waiting = list(reversed(groups))
        produced: list[int] = []

        def caller() -> None:
            while waiting:
                try:
                    tokens, length = waiting.pop()
                except IndexError:
                    return
                produced.append(sum(decode(tokens, length)))

        callers = [threading.Thread(target=caller) for _ in range(calls)]
        for thread in callers:
            thread.start()
        for thread in callers:
            thread.join()
        return sum(produced)

    decode(groups[0][0][:2], 4)  # warm-up
    if calls == 1:
        key, label = f"ceiling_{precision}_t{threads}", f"CTranslate2 {precision}, direct, batch {batch}, " \
            f"intra_threads {threads or 'default'}"
    else:
        key, label = f"ceiling_{precision}_c{calls}", f"CTranslate2 {precision}, direct, batch {batch}, {calls} " \
            f"calls at once x intra_threads {threads}"
    return best_of(rounds, quiet, patience, model, key, label, run,
                   sum(len(tokens) * length for tokens, length in groups))


def best_of(rounds: int, quiet: float, patience: float, model: Model, key: str, label: str, run: Any,
            expected: int) -> Measured:
    best = Measured(model.name, key, label)
    for round_number in range(rounds):
        wait_for_quiet(quiet, patience)
        with OtherWork([]) as other:
            started = time.perf_counter()
            tokens = run()
            seconds = time.perf_counter() - started
        this = Measured(model.name, key, label, tokens, seconds, background=other.cores,
                        errors=int(tokens != expected))
        print(f"  {model.name} {label} (round {round_number + 1}): {this.rate:.1f} tokens/s, {tokens} tokens "
              f"(expected {expected}), other work {other.cores:.2f} cores", file=sys.stderr)
        if this.rate > best.rate:
            best = this
    return best


def ttft_direct_ct2(model: Model, precision: str, requests: list[Request], new: int, threads: int) -> FirstToken:
    """CTranslate2 called directly, one request at a time, `new` tokens each: the time from the call to its
    first token (step callback) and per token after that; the engine's own floor under the served numbers. The
    first request is not counted, as in `time_to_first_token`."""
    import ctranslate2

    model_dir = model.ct2_dir(precision)
    vocabulary = ct2_vocabulary(model_dir)
    end = vocabulary[model.end_id]
    kind = ctranslate2.Translator if model.encoder_decoder else ctranslate2.Generator
    engine = kind(str(model_dir), device="cpu", compute_type="default", intra_threads=threads)
    result = FirstToken(model.name, f"direct_{precision}_t{threads}",
                        f"CTranslate2 {precision} called directly, intra_threads {threads}")
    for index, request in enumerate(requests):
        tokens = [[vocabulary[t] for t in request.prompt]]
        times: list[float] = []
        options = {"beam_size": 1, "end_token": end,
                   "callback": lambda step, stamps=times: stamps.append(time.perf_counter())}
        sent = time.perf_counter()
        if model.encoder_decoder:
            engine.translate_batch(tokens, max_decoding_length=new, max_input_length=0, **options)
        else:
            engine.generate_batch(tokens, max_length=new, include_prompt_in_result=False, **options)
        if index and times:
            result.ttft_ms.append((times[0] - sent) * 1000)
            result.per_token_ms.append((times[-1] - times[0]) * 1000 / max(len(times) - 1, 1))
    return result
