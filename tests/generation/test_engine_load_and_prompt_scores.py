"""The torch engine's own account of its load (`load()`: sequences decoding, waiting, the key/value budget's use,
which vLLM's `num_requests_running`/`waiting` and `kv_cache_usage_perc` report), and its prompt scores
(`prompt_logprobs`): equal to transformers' log-softmax of the same model, with or without tokens generated after,
for a one-token prompt too, and refused for an encoder-decoder model."""

from __future__ import annotations

import time

import pytest
from support.torch_engine import submit

from transerve.backends.generation.engine import DecodingOptions
from transerve.backends.generation.torch.engine import TorchEngine
from transerve.core.errors import ServerError

torch = pytest.importorskip("torch")
TOLERANCE = 1e-4


def expected_scores(model, ids: list[int], top: int) -> tuple[list[float], list[list[int]], list[int]]:
    with torch.inference_mode():
        log_probs = torch.log_softmax(model.hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    chosen = log_probs.gather(1, torch.tensor(ids[1:])[:, None])
    ranks = ((log_probs > chosen).sum(dim=-1) + 1).tolist()
    return chosen[:, 0].tolist(), log_probs.topk(top, dim=-1).indices.tolist() if top else [], ranks


@pytest.mark.parametrize("max_new_tokens", [0, 5])
def test_prompt_scores_equal_transformers(models, max_new_tokens):
    model = models["gpt2"]
    ids = model.ids("The quick brown fox jumps over the lazy dog.")
    result = submit(model.engine, ids, DecodingOptions(max_new_tokens=max_new_tokens, prompt_logprobs=3)).result(60)
    chosen, best, ranks = expected_scores(model, ids, 3)
    assert result.prompt is not None and len(result.prompt.log_probs) == len(ids) - 1
    assert max(abs(a - b) for a, b in zip(result.prompt.log_probs, chosen, strict=True)) < TOLERANCE
    assert [[token for token, _ in step] for step in result.prompt.top] == best
    assert result.prompt.ranks == ranks
    if max_new_tokens:  # the tokens after the scored prompt are the usual greedy ones
        assert result.hypotheses[0].token_ids == model.reference(ids, max_new_tokens=max_new_tokens)[0]
    else:
        assert result.hypotheses[0].token_ids == [] and result.finish_reason == "length"


def test_a_one_token_prompt_has_nothing_to_score(models):
    model = models["gpt2"]
    result = submit(model.engine, model.ids("Hello")[:1], DecodingOptions(max_new_tokens=0, prompt_logprobs=0))
    prompt = result.result(60).prompt
    assert prompt is not None and prompt.log_probs == prompt.ranks == [] and prompt.top == []


def test_an_encoder_decoder_model_scores_no_prompt(models):
    model = models["t5"]
    outcome = submit(model.engine, model.ids("Hello world"), DecodingOptions(max_new_tokens=0, prompt_logprobs=0))
    error = outcome.result(60)
    assert isinstance(error, ServerError) and "decoder-only" in str(error)
    with pytest.raises(ServerError, match="at least 1"):  # without prompt_logprobs, 0 new tokens is no request
        raise submit(model.engine, model.ids("Hello world"), DecodingOptions(max_new_tokens=0)).result(60)


def test_load_counts_running_and_waiting_sequences_and_the_budget(models, tmp_path):
    from support.generation_models import build_generation_model

    path = build_generation_model("gpt2", tmp_path / "gpt2", config={"n_positions": 2048})
    engine = TorchEngine(path, max_batch_rows=1, kv_cache_tokens=4096)
    ids = models["gpt2"].ids("Hello world")
    options = DecodingOptions(max_new_tokens=1500, min_new_tokens=1500)  # no end token: they run till closed
    try:
        futures = [submit(engine, ids, options) for _ in range(3)]
        deadline = time.monotonic() + 30
        while engine.load().running < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        load = engine.load()
        assert (load.running, load.waiting) == (1, 2)
        assert load.kv_cache_usage == pytest.approx((len(ids) + 1500) / 4096)
    finally:
        engine.close()
        engine.join(30)
    assert all(isinstance(future.result(60), ServerError) for future in futures)  # closed: UNAVAILABLE
    load = engine.load()
    assert (load.running, load.waiting, load.kv_cache_usage) == (0, 0, 0.0)


def test_instances_loads_add_up_as_one_models():
    from transerve.core.engine_load import EngineLoad, PrefixCacheCounts

    total = EngineLoad.total([EngineLoad(2, 1, 0.5, PrefixCacheCounts(100, 64, 2, 1)), EngineLoad(1, 0, 0.25),
                              EngineLoad(0, 3, None, PrefixCacheCounts(10, 0, 0, 1))])
    assert total == EngineLoad(3, 4, 0.375, PrefixCacheCounts(110, 64, 2, 2))
    assert EngineLoad.total([EngineLoad(1, 0)]) == EngineLoad(1, 0, None, None)
