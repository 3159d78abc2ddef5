"""The torch engine against transformers' `generate` on the same random weights, token for token: greedy, beams,
sampling, the rules and the model's own constraints, on every architecture (token selection, model loading)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.generation_models import ARCHITECTURES  # noqa: E402
from support.torch_engine import TEXTS, Model, common_token, run, submit, tokens  # noqa: E402

from transerve.backends.generation.engine import (  # noqa: E402
    DecodingOptions,
    GenerationRequest,
    GenerationResult,
)
from transerve.backends.generation.torch.engine import TorchEngine  # noqa: E402
from transerve.core.errors import ErrorCode, ServerError  # noqa: E402


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers(models, arch):
    model = models[arch]
    for text in TEXTS:
        ids = model.ids(text)
        result = run(model.engine, ids, DecodingOptions(max_new_tokens=20))
        assert tokens(result) == model.reference(ids, max_new_tokens=20)
        assert result.finish_reason == "length"
        end = common_token(model, ids)
        result = run(model.engine, ids, DecodingOptions(max_new_tokens=20, end_ids=[end]))
        expected = model.reference(ids, end_ids=[end], max_new_tokens=20)
        assert tokens(result) == expected and expected[0][-1] == end
        assert result.finish_reason == "end"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_beam_search_matches_transformers(models, arch):
    model = models[arch]
    for text in TEXTS:
        ids = model.ids(text)
        end = common_token(model, ids)
        for length_penalty in (1.0, 0.6, 2.0):
            options = DecodingOptions(max_new_tokens=16, beam_width=4, num_return_sequences=2,
                                      length_penalty=length_penalty)
            result = run(model.engine, ids, options)
            kwargs = {"num_beams": 4, "num_return_sequences": 2, "length_penalty": length_penalty,
                      "max_new_tokens": 16}
            assert tokens(result) == model.reference(ids, **kwargs)
            # An end token that finishes hypotheses early exercises the finished-hypotheses bookkeeping.
            options.end_ids = [end]
            result = run(model.engine, ids, options)
            assert tokens(result) == model.reference(ids, end_ids=[end], **kwargs), (text, length_penalty)
            assert len(result.hypotheses) == 2
            assert result.hypotheses[0].score >= result.hypotheses[1].score


def test_the_model_loads_on_a_thread_that_has_ended(models, monkeypatch):
    """Loading runs OpenMP parallel regions (packing weights does); a thread that lives on would keep an OpenMP
    pool that slows the engine thread's decoding (see `_on_own_thread`), so the load runs on a thread of its own.
    A failure there still reaches the caller."""
    loaded_on: list[threading.Thread] = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        loaded_on.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    engine = TorchEngine(models["gpt2"].path)
    try:
        assert loaded_on and loaded_on[0] is not threading.current_thread() and not loaded_on[0].is_alive()
    finally:
        engine.close()
        engine.join(timeout=30)

    def fail(*args, **kwargs):
        raise OSError("weights unreadable")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail)
    with pytest.raises(OSError, match="weights unreadable"):
        TorchEngine(models["gpt2"].path)


@pytest.mark.parametrize("arch", ["t5", "gpt2"])
def test_torch_linear_kernels_on_request_give_generate_output_too(models, arch):
    """The default engines compute their linear layers on oneDNN (GPT-2's Conv1D modules included); with
    `onednn_linear=False` the model keeps torch's own modules, and both decode as `generate` does."""
    from transerve.backends.generation.torch.onednn_linear import onednn_available

    model = models[arch]
    kinds = {type(m).__name__ for m in model.engine.runner.forward.model.modules()}
    state = torch.get_rng_state()
    if onednn_available(torch):
        assert torch.equal(torch.get_rng_state(), state)  # the check draws no random numbers
        assert model.engine.onednn_linear and "OneDnnLinear" in kinds and not kinds & {"Linear", "Conv1D"}
        hf = model.engine.runner.forward.model
        embedding = hf.get_input_embeddings().weight
        linears = [m for m in hf.modules() if type(m).__name__ == "OneDnnLinear"]
        # Every weight is packed in oneDNN's layout; a tied LM head as a copy, the embedding table staying plain.
        assert all(linear.packed and linear.weight.is_mkldnn for linear in linears)
        assert not embedding.is_mkldnn and hf.get_output_embeddings().weight.is_mkldnn
    engine = TorchEngine(model.path, onednn_linear=False)
    try:
        assert not engine.onednn_linear
        assert "OneDnnLinear" not in {type(m).__name__ for m in engine.runner.forward.model.modules()}
        ids = model.ids(TEXTS[1])
        assert tokens(run(engine, ids, DecodingOptions(max_new_tokens=12))) == model.reference(ids, max_new_tokens=12)
    finally:
        engine.close()


def test_beam_scores_match_transformers(models):
    model = models["t5"]
    ids = model.ids(TEXTS[0])
    result = run(model.engine, ids, DecodingOptions(max_new_tokens=10, beam_width=4, num_return_sequences=4))
    with torch.inference_mode():
        out = model.hf.generate(torch.tensor([ids]), num_beams=4, num_return_sequences=4, max_new_tokens=10,
                                output_scores=True, return_dict_in_generate=True)
    assert [h.score for h in result.hypotheses] == pytest.approx(out.sequences_scores.tolist(), abs=1e-5)


def test_streaming_sends_each_token_as_it_is_produced(models):
    model = models["t5"]
    pieces: list[list[int]] = []
    ids = model.ids(TEXTS[0])
    result = submit(model.engine, ids, DecodingOptions(max_new_tokens=12), on_tokens=pieces.append).result(60)
    assert all(len(piece) == 1 for piece in pieces)
    expected = model.reference(ids, max_new_tokens=12)[0]
    assert [piece[0] for piece in pieces] == result.hypotheses[0].token_ids == expected


def test_engine_describes_its_model(models):
    assert models["t5"].engine.is_encoder_decoder and not models["gpt2"].engine.is_encoder_decoder
    assert models["t5"].engine.eos_token_ids == [1] and models["gpt2"].engine.eos_token_ids == [0]
    assert models["gpt2"].engine.max_input_length == 256
    assert models["t5"].engine.max_input_length == 128  # relative positions: the tokenizer's model_max_length
    assert models["bart"].engine.vocab_size == models["bart"].hf.config.vocab_size


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_greedy_and_beam_match_transformers(models):
    model = models["bart"]
    engine = TorchEngine(model.path, device="cuda")
    model.hf.to("cuda")
    try:
        for text in TEXTS:
            ids = model.ids(text)
            result = run(engine, ids, DecodingOptions(max_new_tokens=12))
            assert tokens(result) == model.reference(ids, max_new_tokens=12)
            result = run(engine, ids, DecodingOptions(max_new_tokens=12, beam_width=4, num_return_sequences=2))
            assert tokens(result) == model.reference(ids, max_new_tokens=12, num_beams=4, num_return_sequences=2)
    finally:
        model.hf.to("cpu")
        engine.close()


SAMPLING = {"temperature": 0.8, "top_k": 50, "top_p": 0.9}


@pytest.mark.parametrize("arch", ["t5", "gpt2"])
def test_sampling_is_reproducible_alone_and_in_a_busy_batch(models, arch):
    model = models[arch]
    ids = model.ids(TEXTS[0])
    options = DecodingOptions(max_new_tokens=24, sampling=True, random_seed=7, end_ids=[], **SAMPLING)
    alone = tokens(run(model.engine, ids, options))
    # The same draw as transformers' sampling from a generator seeded alike (its global one).
    torch.manual_seed(7)
    assert alone == model.reference(ids, end_ids=[], do_sample=True, max_new_tokens=24, **SAMPLING)
    busy = [submit(model.engine, model.ids(text), DecodingOptions(max_new_tokens=30, sampling=True, **SAMPLING))
            for text in TEXTS]
    steps = threading.Semaphore(0)
    busy.append(submit(model.engine, ids, DecodingOptions(max_new_tokens=40), on_tokens=lambda new: steps.release()))
    assert steps.acquire(timeout=30)
    again = submit(model.engine, ids, options)
    assert tokens(again.result(timeout=60)) == alone
    for future in busy:
        assert isinstance(future.result(timeout=60), GenerationResult)
    other = DecodingOptions(max_new_tokens=24, sampling=True, random_seed=8, end_ids=[], **SAMPLING)
    assert tokens(run(model.engine, ids, other)) != alone


def test_sampling_with_top_k_1_is_greedy(models):
    model = models["marian"]
    for text in TEXTS:
        ids = model.ids(text)
        options = DecodingOptions(max_new_tokens=15, sampling=True, top_k=1, temperature=0.7, random_seed=3)
        assert tokens(run(model.engine, ids, options)) == model.reference(ids, max_new_tokens=15)


@pytest.mark.parametrize("arch", ["bart", "gpt2"])
def test_repetition_penalty_matches_transformers(models, arch):
    model = models[arch]
    for text in TEXTS:
        ids = model.ids(text)
        plain = run(model.engine, ids, DecodingOptions(max_new_tokens=20, end_ids=[]))
        result = run(model.engine, ids, DecodingOptions(max_new_tokens=20, end_ids=[], repetition_penalty=1.5))
        assert tokens(result) == model.reference(ids, end_ids=[], max_new_tokens=20, repetition_penalty=1.5)
        assert tokens(result) != tokens(plain)
        beam = DecodingOptions(max_new_tokens=12, beam_width=3, repetition_penalty=1.5)
        assert tokens(run(model.engine, ids, beam)) == model.reference(
            ids, max_new_tokens=12, num_beams=3, repetition_penalty=1.5
        )


@pytest.mark.parametrize("arch", ["t5", "gpt2"])
def test_min_new_tokens_masks_end_tokens_before(models, arch):
    model = models[arch]
    ids = model.ids(TEXTS[0])
    end = common_token(model, ids)
    options = DecodingOptions(max_new_tokens=20, end_ids=[end], min_new_tokens=10)
    result = tokens(run(model.engine, ids, options))
    assert result == model.reference(ids, end_ids=[end], max_new_tokens=20, min_new_tokens=10)
    assert end not in result[0][:10]


@pytest.mark.parametrize("arch", ["marian", "gpt2"])
def test_bad_words_are_never_produced(models, arch):
    model = models[arch]
    ids = model.ids(TEXTS[2])
    greedy = tokens(run(model.engine, ids, DecodingOptions(max_new_tokens=16, end_ids=[])))[0]
    single, pair = [greedy[2]], greedy[5:7]
    options = DecodingOptions(max_new_tokens=16, end_ids=[], bad_words=[single, pair])
    result = tokens(run(model.engine, ids, options))
    assert result == model.reference(ids, end_ids=[], max_new_tokens=16, bad_words_ids=[single, pair])
    assert single[0] not in result[0]
    assert all(result[0][i:i + 2] != pair for i in range(len(result[0]) - 1))
    beam = DecodingOptions(max_new_tokens=10, beam_width=3, bad_words=[single, pair])
    assert tokens(run(model.engine, ids, beam)) == model.reference(
        ids, max_new_tokens=10, num_beams=3, bad_words_ids=[single, pair]
    )


def test_stop_sequences_end_generation_after_the_stop_tokens(models):
    model = models["t5"]
    ids = model.ids(TEXTS[0])
    greedy = tokens(run(model.engine, ids, DecodingOptions(max_new_tokens=20, end_ids=[])))[0]
    result = run(model.engine, ids, DecodingOptions(max_new_tokens=20, end_ids=[], stop_sequences=[greedy[4:7]]))
    assert tokens(result) == [greedy[:7]]
    # Token ids as the backend may hold them (numpy arrays, tuples) mean the same.
    import numpy as np

    options = DecodingOptions(max_new_tokens=20, end_ids=np.array([], dtype=np.int64),
                              stop_sequences=[tuple(np.array(greedy[4:7], dtype=np.uint32))])
    assert tokens(run(model.engine, np.array(ids, dtype=np.uint32), options)) == [greedy[:7]]
    assert result.finish_reason == "end"


def test_log_probs_match_transformers_scores(models):
    model = models["gpt2"]
    ids = model.ids(TEXTS[0])
    result = run(model.engine, ids, DecodingOptions(max_new_tokens=8, end_ids=[], return_log_probs=True,
                                                     repetition_penalty=1.2))
    with torch.inference_mode():
        out = model.hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, repetition_penalty=1.2,
                                output_scores=True, return_dict_in_generate=True, eos_token_id=[], pad_token_id=0)
    chosen = out.sequences[0, len(ids):].tolist()
    expected = [
        torch.log_softmax(scores[0], -1)[token].item() for scores, token in zip(out.scores, chosen, strict=True)
    ]
    hypothesis = result.hypotheses[0]
    assert hypothesis.token_ids == chosen
    assert hypothesis.log_probs == pytest.approx(expected, abs=1e-5)
    assert hypothesis.score == pytest.approx(sum(expected), abs=1e-4)
    beam = run(model.engine, ids, DecodingOptions(max_new_tokens=8, beam_width=4, num_return_sequences=2,
                                                  length_penalty=0.5, return_log_probs=True))
    for hypothesis in beam.hypotheses:
        length = len(hypothesis.token_ids) ** 0.5
        assert sum(hypothesis.log_probs) / length == pytest.approx(hypothesis.score, abs=1e-4)


def test_the_models_generation_config_constraints_apply(models, tmp_path):
    import json
    import shutil

    source = models["bart"]
    ids = source.ids(TEXTS[0])
    greedy = tokens(run(source.engine, ids, DecodingOptions(max_new_tokens=12)))[0]
    path = shutil.copytree(source.path, tmp_path / "bart")
    settings = json.loads((path / "generation_config.json").read_text())
    settings.update(forced_bos_token_id=5, forced_eos_token_id=2, bad_words_ids=[[greedy[3]]], no_repeat_ngram_size=2)
    (path / "generation_config.json").write_text(json.dumps(settings))
    model = Model("bart", path)
    try:
        for options, kwargs in [
            (DecodingOptions(max_new_tokens=30), {"max_new_tokens": 30}),
            (DecodingOptions(max_new_tokens=30, beam_width=3), {"max_new_tokens": 30, "num_beams": 3}),
        ]:
            result = tokens(run(model.engine, ids, options))
            assert result == model.reference(ids, **kwargs)
            assert result[0][0] == 5 and result[0][-1] == 2 and greedy[3] not in result[0]
            pairs = list(zip(result[0], result[0][1:], strict=False))
            assert len(pairs) == len(set(pairs))
    finally:
        model.engine.close()


def test_compute_types(models):
    engine = TorchEngine(models["t5"].path, compute_type="bfloat16")
    try:
        result = run(engine, models["t5"].ids(TEXTS[0]), DecodingOptions(max_new_tokens=6, end_ids=[], beam_width=2))
        assert len(result.hypotheses[0].token_ids) == 6
    finally:
        engine.close()
    with pytest.raises(ServerError) as error:
        TorchEngine(models["t5"].path, compute_type="int8")
    assert error.value.code is ErrorCode.INVALID_ARG and "float16" in error.value.message


def test_cancelled_beam_search_returns_its_best_hypotheses_so_far(models):
    model = models["t5"]
    steps = threading.Semaphore(0)
    beam_done: Future = Future()
    beam = model.engine.submit(
        GenerationRequest(model.ids(TEXTS[0]), DecodingOptions(max_new_tokens=120, end_ids=[], beam_width=3,
                                                               num_return_sequences=2)),
        None, beam_done.set_result,
    )
    pacer = submit(model.engine, model.ids(TEXTS[1]), DecodingOptions(max_new_tokens=5, end_ids=[]),
                   on_tokens=lambda new: steps.release())
    for _ in range(3):
        assert steps.acquire(timeout=30)
    beam.cancel()
    result = beam_done.result(timeout=30)
    assert result.finish_reason == "cancelled"
    assert len(result.hypotheses) == 2
    assert all(0 < len(h.token_ids) < 120 for h in result.hypotheses)
    assert result.hypotheses[0].score >= result.hypotheses[1].score
    assert len(tokens(pacer.result(timeout=30))[0]) == 5


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_decoding_raises_no_transformers_deprecation_warnings(models, arch):
    """The engine calls transformers' current API (the cache passed as `cache`, not the deprecated
    `past_key_values`): no FutureWarning or DeprecationWarning per call reaches the server's log."""
    import warnings

    model = models[arch]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(model.engine, model.ids(TEXTS[0]), DecodingOptions(max_new_tokens=4))
        run(model.engine, model.ids(TEXTS[1]), DecodingOptions(max_new_tokens=4, beam_width=2))
    deprecations = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert deprecations == []
