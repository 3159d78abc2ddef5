"""vLLM's request extras in the generation engines: the min-p cut equal to transformers' MinPLogitsWarper (alone and
after temperature, top-k and top-p, in `generate`'s order), CTranslate2's refusal of min-p, the /v2 name of the
option, and admission by priority then arrival in both engines (a model that decodes one sequence at a time: the
sequence with the better priority runs before earlier worse ones)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")

from transformers.generation.logits_process import (  # noqa: E402
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from transerve.backends.generation.ctranslate2.engine import CTranslate2Engine  # noqa: E402
from transerve.backends.generation.engine import DecodingOptions, GenerationRequest, GenerationResult  # noqa: E402
from transerve.backends.generation.options import Limits, decoding_options, parameter_values  # noqa: E402
from transerve.backends.generation.torch.engine import TorchEngine  # noqa: E402
from transerve.backends.generation.torch.sampling import cut_min_p, warp  # noqa: E402
from transerve.core.errors import ErrorCode, ServerError  # noqa: E402
from transerve.core.protocol_parameters import DEFAULT_LEVEL, level_of_openai_priority, queue_level  # noqa: E402


def test_the_min_p_cut_equals_transformers_min_p_warper():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0, 2.9, -4.0, 0.0]])
    for min_p in (0.0, 0.05, 0.3, 0.5, 0.9, 1.0):
        expected = MinPLogitsWarper(min_p)(None, logits.clone())
        cut = logits.clone()
        cut_min_p(cut, min_p)
        assert torch.equal(cut, expected), min_p
    # The known vector: the likeliest is 3.0; at 0.5 only the tokens within log(2) of it stay.
    cut = logits.clone()
    cut_min_p(cut, 0.5)
    assert torch.isfinite(cut[0]).nonzero().flatten().tolist() == [4, 5]
    random = torch.randn(4, 1000, generator=torch.Generator().manual_seed(3)) * 3
    for row in random:
        expected = MinPLogitsWarper(0.1)(None, row[None].clone())
        cut = row[None].clone()
        cut_min_p(cut, 0.1)
        assert torch.equal(cut, expected)


def test_warp_applies_min_p_after_temperature_top_k_and_top_p_as_generate_does():
    scores = torch.randn(1, 500, generator=torch.Generator().manual_seed(5)) * 4
    options = DecodingOptions(sampling=True, temperature=0.7, top_k=40, top_p=0.95, min_p=0.2)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(40), TopPLogitsWarper(0.95),
                                   MinPLogitsWarper(0.2)])
    expected = warpers(None, scores.clone())
    warped = scores.clone()
    warp(warped, options)
    assert torch.equal(warped, expected)
    assert 1 < int(torch.isfinite(warped).sum()) < 40  # min-p cut more than top-k did


def test_min_p_is_a_v2_parameter_bounded_and_only_acts_when_sampling():
    limits = Limits(max_new_tokens=16, max_batch_rows=4, decoupled=False)
    options, _ = decoding_options(parameter_values({"min_p": 0.25, "top_p": 1.0}), limits)
    assert options.sampling and options.min_p == 0.25
    greedy, _ = decoding_options(parameter_values({"min_p": 0.25}), limits)  # temperature alone samples not either
    assert not greedy.sampling and greedy.min_p == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ServerError, match="min_p") as caught:
            decoding_options(parameter_values({"min_p": bad, "top_p": 1.0}), limits)
        assert caught.value.code == ErrorCode.INVALID_ARG


def test_the_openai_priority_maps_onto_triton_levels_in_vllm_order():
    assert level_of_openai_priority(0) == DEFAULT_LEVEL == queue_level(0)
    assert level_of_openai_priority(-1_000_000) == 1  # vLLM's best: Triton's highest level
    assert level_of_openai_priority(-3) < level_of_openai_priority(0) < level_of_openai_priority(2)
    assert queue_level(1) == 1 and queue_level(7) == 7


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    from support.generation_models import build_generation_model

    return build_generation_model("gpt2", tmp_path_factory.mktemp("request_extras") / "gpt2")


def _submit_in_order(engine, order: list[str]) -> dict[str, Future]:
    """A first sequence that holds the only row while the others are submitted (its first token's callback waits,
    which stops the engine's decoding), then worse, worse and better priorities in that order of arrival; each
    sequence's name goes into `order` as it finishes."""
    running, release = threading.Event(), threading.Event()

    def hold(tokens, *rest) -> None:
        running.set()
        assert release.wait(timeout=60)

    futures: dict[str, Future] = {}

    def submit(name: str, priority: int, on_tokens=None) -> None:
        future: Future = Future()
        futures[name] = future

        def done(outcome) -> None:
            order.append(name)
            future.set_result(outcome)

        options = DecodingOptions(max_new_tokens=4, end_ids=[])
        engine.submit(GenerationRequest([5, 6, 7], options, stream=on_tokens is not None, priority=priority),
                      on_tokens, done)

    submit("first", DEFAULT_LEVEL, hold)
    assert running.wait(timeout=60)
    submit("worse", DEFAULT_LEVEL + 5)
    submit("default", DEFAULT_LEVEL)
    submit("better", DEFAULT_LEVEL - 5)
    submit("worse again", DEFAULT_LEVEL + 5)
    release.set()
    for future in futures.values():
        assert isinstance(future.result(timeout=60), GenerationResult)
    return futures


def test_the_torch_engine_admits_by_priority_then_arrival(gpt2):
    engine = TorchEngine(gpt2, max_batch_rows=1)
    try:
        order: list[str] = []
        _submit_in_order(engine, order)
        assert order == ["first", "better", "default", "worse", "worse again"]
    finally:
        engine.close()


def test_the_ctranslate2_engine_takes_calls_by_priority_then_arrival(gpt2, tmp_path):
    ct2_dir = tmp_path / "gpt2_ct2"
    ctranslate2.converters.TransformersConverter(str(gpt2)).convert(str(ct2_dir), quantization="float32")
    engine = CTranslate2Engine(ct2_dir, intra_op_threads=1, max_batch_rows=1, max_concurrent_calls=1)
    try:
        order: list[str] = []
        _submit_in_order(engine, order)
        assert order == ["first", "better", "default", "worse", "worse again"]
        # min-p: refused for a sampled sequence, naming it; a greedy one ignores it as transformers does.
        future: Future = Future()
        engine.submit(GenerationRequest([5, 6], DecodingOptions(max_new_tokens=2, sampling=True, min_p=0.1)), None,
                      future.set_result)
        refused = future.result(timeout=60)
        assert isinstance(refused, ServerError) and refused.code == ErrorCode.INVALID_ARG
        assert "min_p" in str(refused)
    finally:
        engine.close()
