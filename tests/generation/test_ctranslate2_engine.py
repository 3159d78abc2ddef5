"""The CTranslate2 engine against transformers' `generate` on the same random weights, token for token."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
from support.cuda import ctranslate2_cuda_problem
from support.generation_models import ARCHITECTURES, build_generation_model

from transerve.backends.generation.engine import DecodingOptions, GenerationRequest, GenerationResult
from transerve.core.errors import ErrorCode, ServerError

ctranslate2 = pytest.importorskip("ctranslate2")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from transerve.backends.generation.ctranslate2.engine import CTranslate2Engine  # noqa: E402

TEXTS = ["translate English to German: The house is wonderful.", "Hello world", "The quick brown fox jumps"]


class Model:
    def __init__(self, arch: str, hf_dir: Path, ct2_dir: Path) -> None:
        from tokenizers import Tokenizer

        self.arch = arch
        self.hf_dir = hf_dir
        self.ct2_dir = ct2_dir
        self.tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
        self.hf = transformers.AutoModelForSeq2SeqLM if arch != "gpt2" else transformers.AutoModelForCausalLM
        self.hf = self.hf.from_pretrained(hf_dir).eval()
        self.engine = CTranslate2Engine(ct2_dir, intra_op_threads=1)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def reference(self, ids: list[int], **kwargs) -> list[list[int]]:
        """transformers' new tokens per returned sequence, cut after the first end token."""
        with torch.no_grad():
            out = self.hf.generate(torch.tensor([ids]), do_sample=False, **kwargs)
        skip = 1 if self.hf.config.is_encoder_decoder else len(ids)
        eos = self.hf.generation_config.eos_token_id
        sequences = []
        for row in out.tolist():
            new = row[skip:]
            if eos in new:
                new = new[: new.index(eos) + 1]
            sequences.append(new)
        return sequences


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Model]:
    root = tmp_path_factory.mktemp("ct2_engine")
    built = {}
    for arch in ARCHITECTURES:
        hf_dir = build_generation_model(arch, root / arch)
        ct2_dir = root / f"{arch}_ct2"
        ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(ct2_dir), quantization="float32")
        built[arch] = Model(arch, hf_dir, ct2_dir)
    yield built
    for model in built.values():
        model.engine.close()


def generate(engine, ids: list[int], stream: bool = False, **options) -> tuple[GenerationResult, list[int]]:
    future: Future = Future()
    streamed: list[int] = []
    engine.submit(GenerationRequest(ids, DecodingOptions(**options), stream=stream), streamed.extend,
                  future.set_result)
    outcome = future.result(timeout=60)
    if isinstance(outcome, Exception):
        raise outcome
    return outcome, streamed


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_equals_transformers(models, arch):
    model = models[arch]
    for text in TEXTS:
        ids = model.ids(text)
        result, _ = generate(model.engine, ids, max_new_tokens=20)
        assert [h.token_ids for h in result.hypotheses] == model.reference(ids, max_new_tokens=20)
        assert result.finish_reason == ("end" if result.hypotheses[0].token_ids[-1] in model.engine.eos_token_ids
                                        else "length")


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("length_penalty", [0.6, 2.0])
def test_beam_search_equals_transformers(models, arch, length_penalty):
    model = models[arch]
    for text in TEXTS[:2]:
        ids = model.ids(text)
        result, _ = generate(model.engine, ids, max_new_tokens=16, beam_width=4, num_return_sequences=2,
                             length_penalty=length_penalty)
        expected = model.reference(ids, max_new_tokens=16, num_beams=4, num_return_sequences=2,
                                   length_penalty=length_penalty)
        assert [h.token_ids for h in result.hypotheses] == expected


def test_batched_rows_equal_single_rows(models):
    """Sequences of different lengths and max_new_tokens decoded in one call get what each gets alone."""
    model = models["t5"]
    requests = [(model.ids(text), n) for text, n in zip(TEXTS * 2, [3, 20, 7, 12, 1, 9], strict=True)]
    alone = [generate(model.engine, ids, max_new_tokens=n)[0].hypotheses[0].token_ids for ids, n in requests]
    futures = []
    for ids, n in requests:
        future: Future = Future()
        model.engine.submit(GenerationRequest(ids, DecodingOptions(max_new_tokens=n)), None, future.set_result)
        futures.append(future)
    together = [f.result(timeout=60).hypotheses[0].token_ids for f in futures]
    assert together == alone
    assert all(len(tokens) <= n for tokens, (_, n) in zip(together, requests, strict=True))


def test_scores_and_log_probs(models):
    model = models["gpt2"]
    ids = model.ids(TEXTS[1])
    greedy, _ = generate(model.engine, ids, max_new_tokens=8, return_log_probs=True)
    best = greedy.hypotheses[0]
    assert len(best.log_probs) == len(best.token_ids)
    assert best.score == pytest.approx(sum(best.log_probs), abs=1e-4)
    with torch.no_grad():
        logits = model.hf(torch.tensor([ids + best.token_ids])).logits[0].log_softmax(-1)
    expected = [logits[len(ids) - 1 + i, t].item() for i, t in enumerate(best.token_ids)]
    assert best.log_probs == pytest.approx(expected, abs=1e-3)
    beam, _ = generate(model.engine, ids, max_new_tokens=8, beam_width=3, num_return_sequences=3,
                       return_log_probs=True)
    for hypothesis in beam.hypotheses:
        assert len(hypothesis.log_probs) == len(hypothesis.token_ids)
        assert all(lp <= 0 for lp in hypothesis.log_probs)
    assert beam.hypotheses[0].score >= beam.hypotheses[-1].score


@pytest.mark.parametrize("arch", ["bart", "gpt2"])
def test_min_new_tokens_and_end_ids(models, arch):
    model = models[arch]
    ids = model.ids(TEXTS[0])
    result, _ = generate(model.engine, ids, max_new_tokens=20, min_new_tokens=15)
    assert [h.token_ids for h in result.hypotheses] == model.reference(ids, max_new_tokens=20, min_new_tokens=15)
    free = generate(model.engine, ids, max_new_tokens=20)[0].hypotheses[0].token_ids
    end = free[2]
    stopped = generate(model.engine, ids, max_new_tokens=20, end_ids=[end])[0]
    assert stopped.hypotheses[0].token_ids == free[: free.index(end) + 1]
    assert stopped.finish_reason == "end"


def test_stop_sequences_and_bad_words(models):
    model = models["gpt2"]
    ids = model.ids(TEXTS[2])
    free = generate(model.engine, ids, max_new_tokens=12)[0].hypotheses[0].token_ids
    stop = free[3:5]
    stopped = generate(model.engine, ids, max_new_tokens=12, stop_sequences=[stop])[0]
    end = next(i for i in range(2, len(free) + 1) if free[i - 2 : i] == stop)
    assert stopped.hypotheses[0].token_ids == free[:end]
    assert stopped.finish_reason == "end"
    banned = generate(model.engine, ids, max_new_tokens=12, bad_words=[[free[0]]])[0].hypotheses[0].token_ids
    assert free[0] not in banned
    beam = generate(model.engine, ids, max_new_tokens=12, beam_width=2, stop_sequences=[[free[1]]])[0]
    assert beam.hypotheses[0].token_ids[-1] == free[1] or free[1] not in beam.hypotheses[0].token_ids


def test_sampling_with_a_seed_is_reproducible(models):
    model = models["t5"]
    ids = model.ids(TEXTS[0])
    options = {"max_new_tokens": 16, "sampling": True, "top_k": 0, "temperature": 1.5, "random_seed": 1234}
    first = generate(model.engine, ids, **options)[0].hypotheses[0].token_ids
    # Unseeded sampling in between moves CTranslate2's generators on; the seeded result must not change.
    generate(model.engine, ids, max_new_tokens=16, sampling=True, temperature=1.5)
    again = generate(model.engine, ids, **options)[0].hypotheses[0].token_ids
    other = generate(model.engine, ids, **{**options, "random_seed": 99})[0].hypotheses[0].token_ids
    assert first == again
    assert first != other
    assert first != generate(model.engine, ids, max_new_tokens=16)[0].hypotheses[0].token_ids


def test_seeded_requests_after_the_first_use_the_replica_loaded_ahead(models, monkeypatch):
    model = models["gpt2"]
    ids = model.ids(TEXTS[1])
    options = {"max_new_tokens": 12, "sampling": True, "top_k": 0, "temperature": 1.5, "random_seed": 77}
    first = generate(model.engine, ids, **options)[0].hypotheses[0].token_ids
    deadline = time.monotonic() + 60
    while not model.engine.seeded_replica_ready:
        assert time.monotonic() < deadline, "no replica was loaded ahead after a seeded request"
        time.sleep(0.05)

    def no_load(*args, **kwargs):
        raise RuntimeError("loading is off in this test")

    # With loading off, the next seeded request can only run on the replica loaded ahead; the load after it fails
    # and is only logged.
    monkeypatch.setattr(model.engine, "_load", no_load)
    assert generate(model.engine, ids, **options)[0].hypotheses[0].token_ids == first
    assert not model.engine.seeded_replica_ready
    monkeypatch.undo()
    assert generate(model.engine, ids, **options)[0].hypotheses[0].token_ids == first


def test_int8(models, tmp_path):
    model = models["marian"]
    ct2_dir = tmp_path / "marian_int8"
    ctranslate2.converters.TransformersConverter(str(model.hf_dir)).convert(str(ct2_dir), quantization="int8")
    engine = CTranslate2Engine(ct2_dir, compute_type="int8", intra_op_threads=1)
    try:
        result, _ = generate(engine, model.ids(TEXTS[0]), max_new_tokens=10)
        tokens = result.hypotheses[0].token_ids
        assert 1 <= len(tokens) <= 10
        assert all(0 <= t < engine.vocab_size for t in tokens)
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["t5", "gpt2"])
def test_streamed_tokens_equal_the_result(models, arch):
    model = models[arch]
    result, streamed = generate(model.engine, model.ids(TEXTS[0]), stream=True, max_new_tokens=20)
    assert streamed == result.hypotheses[0].token_ids
    assert len(streamed) > 1


def test_cancel_stops_early(models):
    model = models["gpt2"]
    engine = model.engine
    ids = model.ids(TEXTS[1])
    future: Future = Future()
    seen = threading.Event()
    handle = None

    def on_tokens(tokens: list[int]) -> None:
        seen.set()
        handle.cancel()

    # No end token: the sequence would run its whole length.
    options = DecodingOptions(max_new_tokens=200, end_ids=[engine.vocab_size - 1], bad_words=[[engine.vocab_size - 1]])
    handle = engine.submit(GenerationRequest(ids, options, stream=True), on_tokens, future.set_result)
    result = future.result(timeout=60)
    assert seen.is_set()
    assert result.finish_reason == "cancelled"
    assert len(result.hypotheses[0].token_ids) < 5


def test_requests_it_can_never_serve_are_refused(models):
    gpt2 = models["gpt2"].engine
    cases = [
        ([], {}, "no tokens"),
        ([1] * 300, {}, "at most"),
        ([1] * 200, {"max_new_tokens": 100}, "positions"),
        ([1, 2], {"beam_width": 0}, "beam_width"),
        ([gpt2.vocab_size], {}, "token ids"),
        ([1, 2], {"beam_width": 2, "stop_sequences": [[1, 2]]}, "stop sequences"),
        ([1, 2], {"bad_words": [[]]}, "bad_words"),
    ]
    for ids, options, words in cases:
        with pytest.raises(ServerError) as caught:
            generate(gpt2, ids, **options)
        assert caught.value.code is ErrorCode.INVALID_ARG
        assert words in caught.value.message
    assert generate(gpt2, [1, 2], max_new_tokens=3)[0].hypotheses[0].token_ids


def test_close_fails_pending_sequences(models):
    """Running sequences (stopped at their next token, or at the end of a beam-search call) and waiting ones get
    UNAVAILABLE."""
    model = models["gpt2"]
    engine = CTranslate2Engine(model.ct2_dir, intra_op_threads=1)
    ids = model.ids(TEXTS[0])
    running = threading.Event()
    futures = []
    for beam_width in (1, 2, 3):  # a call each: with two callers, one more runs and one waits at close()
        future: Future = Future()
        options = DecodingOptions(max_new_tokens=150, beam_width=beam_width, end_ids=[engine.vocab_size - 1],
                                  bad_words=[[engine.vocab_size - 1]])
        engine.submit(GenerationRequest(ids, options, stream=True), lambda tokens: running.set(), future.set_result)
        futures.append(future)
    assert running.wait(30)
    engine.close()
    outcomes = [f.result(timeout=60) for f in futures]
    assert all(isinstance(o, ServerError) and o.code is ErrorCode.UNAVAILABLE for o in outcomes)
    late: Future = Future()
    engine.submit(GenerationRequest(ids, DecodingOptions()), None, late.set_result)
    assert late.result(timeout=5).code is ErrorCode.UNAVAILABLE


@pytest.mark.gpu
@pytest.mark.skipif(ctranslate2_cuda_problem() is not None, reason=str(ctranslate2_cuda_problem()))
@pytest.mark.parametrize("compute_type", ["float32", "float16", "int8_float16"])
def test_cuda(models, compute_type):
    model = models["t5"]
    engine = CTranslate2Engine(model.ct2_dir, device="cuda", compute_type=compute_type)
    try:
        ids = model.ids(TEXTS[0])
        result, streamed = generate(engine, ids, stream=True, max_new_tokens=16)
        tokens = result.hypotheses[0].token_ids
        assert streamed == tokens
        if compute_type == "float32":
            assert [tokens] == model.reference(ids, max_new_tokens=16)
        assert 1 <= len(tokens) <= 16
    finally:
        engine.close()


def test_engine_describes_the_model(models):
    assert models["t5"].engine.is_encoder_decoder
    assert not models["gpt2"].engine.is_encoder_decoder
    assert models["bart"].engine.eos_token_ids == [2]
    assert models["gpt2"].engine.max_input_length == 255
    assert models["t5"].engine.vocab_size == models["t5"].hf.config.vocab_size
    # CTranslate2's Marian converter drops the trailing <pad>, which is only ever the decoder's start token.
    assert models["marian"].engine.vocab_size == models["marian"].hf.config.vocab_size - 1


def test_calls_run_concurrently(models):
    """A short request whose options cannot join a running long call starts at once on the second replica."""
    model = models["gpt2"]
    engine = model.engine  # max_concurrent_calls 2 (the default)
    ids = model.ids(TEXTS[1])
    started, release = threading.Event(), threading.Event()

    def hold(tokens: list[int]) -> None:  # the long call stays inside its first step until released
        started.set()
        release.wait(30)

    long: Future = Future()
    # No end token: the long sequence would run its whole length; its end ids put it in a call of its own.
    options = DecodingOptions(max_new_tokens=200, end_ids=[engine.vocab_size - 1], bad_words=[[engine.vocab_size - 1]])
    handle = engine.submit(GenerationRequest(ids, options, stream=True), hold, long.set_result)
    try:
        assert started.wait(30)
        short, _ = generate(engine, ids, max_new_tokens=3)
        assert not long.done()
        assert 1 <= len(short.hypotheses[0].token_ids) <= 3
    finally:
        handle.cancel()
        release.set()
    assert long.result(timeout=60).finish_reason == "cancelled"


def test_cores_are_divided_among_concurrent_calls(models):
    """Unless configured, each replica computes with its share of the cores, so calls at once do not oversubscribe."""
    cores = len(os.sched_getaffinity(0))
    for calls, expected in ((1, cores), (2, max(1, cores // 2)), (cores * 2, 1)):
        engine = CTranslate2Engine(models["gpt2"].ct2_dir, max_concurrent_calls=calls)
        try:
            assert engine.intra_threads == expected
        finally:
            engine.close()
    engine = CTranslate2Engine(models["gpt2"].ct2_dir, intra_op_threads=3, max_concurrent_calls=2)
    try:
        assert engine.intra_threads == 3
    finally:
        engine.close()


def test_one_call_at_a_time_when_configured(models):
    """With max_concurrent_calls 1, the short request waits for the long call to end."""
    model = models["gpt2"]
    engine = CTranslate2Engine(model.ct2_dir, intra_op_threads=1, max_concurrent_calls=1)
    try:
        ids = model.ids(TEXTS[1])
        long: Future = Future()
        started = threading.Event()
        options = DecodingOptions(max_new_tokens=60, end_ids=[engine.vocab_size - 1],
                                  bad_words=[[engine.vocab_size - 1]])
        engine.submit(GenerationRequest(ids, options, stream=True), lambda tokens: started.set(), long.set_result)
        assert started.wait(30)
        generate(engine, ids, max_new_tokens=3)
        assert long.done()
        assert len(long.result().hypotheses[0].token_ids) == 60
    finally:
        engine.close()


AMD_AVX512 = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse4_1 avx avx2 avx512f avx512bw\n"
AMD_AVX2 = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse4_1 avx avx2\n"
INTEL_AVX512 = "vendor_id\t: GenuineIntel\nflags\t\t: fpu sse4_1 avx avx2 avx512f avx512bw\n"


@pytest.mark.parametrize(("device", "compute_type", "threads", "cpuinfo", "environ", "hinted"), [
    ("cpu", "float32", 2, AMD_AVX512, {}, True),
    ("cpu", "float32", 1, AMD_AVX512, {}, False),  # one thread: AVX2 was no faster
    ("cpu", "float32", 2, AMD_AVX512, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, False),  # the operator chose
    ("cpu", "float32", 2, AMD_AVX512, {"DNNL_MAX_CPU_ISA": "AVX2"}, False),
    ("cpu", "int8_float32", 2, AMD_AVX512, {}, False),  # AVX2 slows int8
    ("cuda", "float32", 0, AMD_AVX512, {}, False),
    ("cpu", "float32", 2, AMD_AVX2, {}, False),
    ("cpu", "float32", 2, INTEL_AVX512, {}, False),  # CTranslate2 uses MKL there
])
def test_isa_hint_only_for_float32_threads_on_amd_avx512_cpus(device, compute_type, threads, cpuinfo, environ,
                                                              hinted):
    from transerve.backends.generation.ctranslate2.engine import isa_hint

    hint = isa_hint(device, compute_type, threads, cpuinfo, environ)
    assert (hint is not None) == hinted
    if hinted:
        assert "ONEDNN_MAX_CPU_ISA=AVX2" in hint


def test_loading_logs_the_isa_hint_once_where_it_applies(models, caplog, monkeypatch):
    """The engine logs what `isa_hint` says about this machine, model and thread count, once per process."""
    from transerve.backends.generation.ctranslate2 import engine as ctranslate2_engine

    monkeypatch.setattr(ctranslate2_engine, "_hinted", threading.Event())
    expected = ctranslate2_engine.isa_hint("cpu", "float32", 2, Path("/proc/cpuinfo").read_text(), os.environ)
    with caplog.at_level("INFO", logger=ctranslate2_engine.__name__):
        CTranslate2Engine(models["gpt2"].ct2_dir, intra_op_threads=1, max_concurrent_calls=1).close()
        for _ in range(2):
            CTranslate2Engine(models["gpt2"].ct2_dir, intra_op_threads=2, max_concurrent_calls=1).close()
    hints = [r.getMessage() for r in caplog.records if "ONEDNN_MAX_CPU_ISA" in r.getMessage()]
    assert hints == ([expected] if expected else [])
