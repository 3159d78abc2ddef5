"""`top_logprobs`: each generated token's likeliest tokens with their log-probabilities, in both engines and served,
against transformers' `generate(output_scores=True)` on the same random weights; and the requests refused."""

from __future__ import annotations

import queue
import shutil
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")
grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")

from support import start_transerve  # noqa: E402
from support.generation_models import build_generation_model  # noqa: E402
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

from transerve.backends.generation.ctranslate2.engine import CTranslate2Engine  # noqa: E402
from transerve.backends.generation.engine import DecodingOptions, GenerationRequest, GenerationResult  # noqa: E402
from transerve.backends.generation.options import Limits, decoding_options  # noqa: E402
from transerve.backends.generation.torch.engine import TorchEngine  # noqa: E402
from transerve.convert.repository import Options, generator_config  # noqa: E402
from transerve.core.errors import ErrorCode, ServerError  # noqa: E402
from transerve.export.repository import _write_config  # noqa: E402

PROMPT = "The quick brown fox jumps"
TOKENS = 8
K = 5
#: Streamed requests' length: CTranslate2 makes a tiny model's tokens faster than the event loop turns.
STREAM_TOKENS = {"torch": 32, "ctranslate2": 200}


class Reference:
    """transformers' greedy `generate` with its scores: the new tokens and each step's log-softmax."""

    def __init__(self, hf_dir: Path) -> None:
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
        config = transformers.AutoConfig.from_pretrained(hf_dir)
        self.encoder_decoder = bool(config.is_encoder_decoder)
        loader = transformers.AutoModelForSeq2SeqLM if self.encoder_decoder else transformers.AutoModelForCausalLM
        self.model = loader.from_pretrained(hf_dir).eval()

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def top(self, ids: list[int], tokens: int = TOKENS) -> tuple[list[int], list[torch.Tensor]]:
        """New tokens (no end token stops them) and each step's log-probabilities over the vocabulary."""
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=tokens, eos_token_id=[],
                                      pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        skip = 1 if self.encoder_decoder else len(ids)
        return out.sequences[0, skip:].tolist(), [torch.log_softmax(s[0], -1) for s in out.scores]


def unused(tokens: list[int]) -> int:
    """An end id greedy decoding does not pick here, so that no end token stops it, as in the reference."""
    return next(token for token in range(1, 400) if token not in tokens)


def assert_top_matches(top_lists, log_probs, tokens, reference_tokens, reference_steps, k, abs_tol):
    """Each step's top list is the reference's k likeliest (ids, and log-probabilities within `abs_tol`); the
    chosen token is first, at exactly its `log_probs` entry."""
    assert tokens == reference_tokens
    assert len(top_lists) == len(log_probs) == len(tokens)
    for top, chosen, chosen_log_prob, step in zip(top_lists, tokens, log_probs, reference_steps, strict=True):
        values, indices = torch.topk(step, k)
        assert [token for token, _ in top] == indices.tolist()
        assert [value for _, value in top] == pytest.approx(values.tolist(), abs=abs_tol)
        assert top[0] == (chosen, chosen_log_prob)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("top_logprobs")
    paths = {}
    for arch in ("gpt2", "t5"):
        paths[arch] = build_generation_model(arch, root / arch)
        paths[f"{arch}_ct2"] = root / f"{arch}_ct2"
        ctranslate2.converters.TransformersConverter(str(paths[arch])).convert(str(paths[f"{arch}_ct2"]),
                                                                              quantization="float32")
    return paths


@pytest.fixture(scope="module")
def references(built) -> dict[str, Reference]:
    return {arch: Reference(built[arch]) for arch in ("gpt2", "t5")}


@pytest.fixture(scope="module")
def engines(built):
    made = {}
    for arch in ("gpt2", "t5"):
        made[f"{arch}_torch"] = TorchEngine(built[arch], intra_op_threads=1)
        made[f"{arch}_ct2"] = CTranslate2Engine(built[f"{arch}_ct2"], intra_op_threads=1)
    yield made
    for engine in made.values():
        engine.close()


def generate(engine, ids: list[int], stream: bool = False, **options) -> tuple[GenerationResult | Exception, list]:
    future: Future = Future()
    streamed: list[tuple] = []
    engine.submit(GenerationRequest(ids, DecodingOptions(**options), stream=stream),
                  lambda *report: streamed.append(report), future.set_result)
    return future.result(timeout=60), streamed


# ---- the engines ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine_name", ["gpt2_torch", "gpt2_ct2", "t5_torch", "t5_ct2"])
def test_greedy_top_log_probs_equal_transformers(engines, references, engine_name):
    reference = references[engine_name.split("_")[0]]
    ids = reference.ids(PROMPT)
    expected_tokens, steps = reference.top(ids)
    result, streamed = generate(engines[engine_name], ids, stream=True, max_new_tokens=TOKENS,
                                end_ids=[unused(expected_tokens)], top_logprobs=K, return_log_probs=True)
    (hypothesis,) = result.hypotheses
    # torch computes the log-softmax transformers does (on its own cache: last bits differ); CTranslate2 its own.
    tolerance = 1e-4 if engine_name.endswith("torch") else 1e-3
    assert_top_matches(hypothesis.top_log_probs, hypothesis.log_probs, hypothesis.token_ids, expected_tokens, steps,
                       K, tolerance)
    # Streamed, each token comes with its log-probability and top list.
    assert [token for tokens, _, _ in streamed for token in tokens] == hypothesis.token_ids
    assert [lp for _, log_probs, _ in streamed for lp in log_probs] == hypothesis.log_probs
    assert [top for _, _, tops in streamed for top in tops] == hypothesis.top_log_probs


@pytest.mark.parametrize("engine_name", ["gpt2_torch", "gpt2_ct2"])
def test_sampled_tokens_have_their_log_prob_in_the_top_list(engines, references, engine_name):
    ids = references["gpt2"].ids(PROMPT)
    result, _ = generate(engines[engine_name], ids, max_new_tokens=TOKENS, sampling=True, top_k=0,
                         temperature=1.5, random_seed=3, top_logprobs=20)
    (hypothesis,) = result.hypotheses
    assert len(hypothesis.top_log_probs) == len(hypothesis.token_ids) == len(hypothesis.log_probs)
    for token, log_prob, top in zip(hypothesis.token_ids, hypothesis.log_probs, hypothesis.top_log_probs,
                                    strict=True):
        assert len(top) == 20
        values = [value for _, value in top]
        assert values == pytest.approx(sorted(values, reverse=True), abs=1e-6)
        assert (token, log_prob) in top or log_prob <= values[-1] + 1e-6


@pytest.mark.parametrize("engine_name", ["gpt2_torch", "gpt2_ct2"])
def test_without_top_logprobs_nothing_is_computed_or_streamed_extra(engines, references, engine_name):
    ids = references["gpt2"].ids(PROMPT)
    result, streamed = generate(engines[engine_name], ids, stream=True, max_new_tokens=4)
    assert result.hypotheses[0].top_log_probs is None and result.hypotheses[0].log_probs is None
    assert all(len(report) == 1 for report in streamed)  # token ids alone, as before
    logged, streamed = generate(engines[engine_name], ids, stream=True, max_new_tokens=4, return_log_probs=True)
    assert logged.hypotheses[0].top_log_probs is None
    assert all(len(report) == 3 and report[2] is None for report in streamed)


@pytest.mark.parametrize("engine_name", ["gpt2_torch", "gpt2_ct2"])
@pytest.mark.parametrize(("options", "message"), [
    ({"top_logprobs": 2, "beam_width": 2, "num_return_sequences": 1}, "beam_width 1"),
    ({"top_logprobs": 21}, "top_logprobs must lie in [0, 20]"),
])
def test_engines_refuse_what_they_cannot_report(engines, references, engine_name, options, message):
    outcome, _ = generate(engines[engine_name], references["gpt2"].ids(PROMPT), max_new_tokens=4, **options)
    assert isinstance(outcome, ServerError) and outcome.code is ErrorCode.INVALID_ARG
    assert message in str(outcome)


@pytest.mark.parametrize(("values", "message"), [
    ({"top_logprobs": 21}, "top_logprobs must lie in [0, 20]"),
    ({"top_logprobs": -1}, "top_logprobs must lie in [0, 20]"),
    ({"top_logprobs": 3, "beam_width": 2}, "beam_width 1"),
])
def test_decoding_options_refuse_bad_top_logprobs(values, message):
    with pytest.raises(ServerError, match=message.replace("[", r"\[").replace("]", r"\]")) as raised:
        decoding_options(values, Limits(max_new_tokens=8, max_batch_rows=16, decoupled=False))
    assert raised.value.code is ErrorCode.INVALID_ARG


def test_top_logprobs_turns_log_probs_on():
    limits = Limits(max_new_tokens=8, max_batch_rows=16, decoupled=False)
    options, _ = decoding_options({"top_logprobs": 4}, limits)
    assert options.top_logprobs == 4 and options.return_log_probs
    options, _ = decoding_options({}, limits)
    assert options.top_logprobs == 0 and not options.return_log_probs


# ---- served ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(built, tmp_path_factory):
    """The generator configs `transerve convert` writes, over the GPT-2 folder (torch) and its CTranslate2 model;
    `gpt2_no_top` declares no top outputs (a config written before them)."""
    repo = tmp_path_factory.mktemp("top_logprobs_repository")
    for engine, source in (("torch", "gpt2"), ("ctranslate2", "gpt2_ct2")):
        for decoupled in (False, True):
            name = f"gpt2_{engine}{'_stream' if decoupled else ''}"
            config = generator_config(Options(name, engine, "float32", 4, decoupled, decoder_only=True))
            config.parameters["intra_op_threads"].string_value = "1"
            _write_config(repo, config)
            shutil.copytree(built[source], repo / name / "1" / "model")
    config = generator_config(Options("gpt2_no_top", "torch", "float32", 4, False, decoder_only=True))
    config.parameters["intra_op_threads"].string_value = "1"
    kept = [output for output in config.output if "top" not in output.name]
    del config.output[:]
    config.output.extend(kept)
    _write_config(repo, config)
    shutil.copytree(built["gpt2"], repo / "gpt2_no_top" / "1" / "model")
    with start_transerve(repo) as running:
        yield running


def inputs(module, ids: list[int]):
    arrays = {"input_ids": np.array([ids], np.uint32), "sequence_length": np.array([[len(ids)]], np.uint32)}
    made = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, array.shape, np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        made.append(tensor)
    return made


def stream_responses(server, model: str, ids: list[int], parameters: dict) -> list:
    """Every response of one ModelStreamInfer request, up to the final flag."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, inputs(grpcclient, ids), parameters=parameters,
                                  enable_empty_final_response=True)
        responses = []
        while True:
            result, error = results.get(timeout=60)
            assert error is None, error
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return responses
    finally:
        client.stop_stream()
        client.close()


def generated(result, prompt: int) -> tuple[list[int], np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """A response's new token ids, their log-probabilities, top ids and top log-probabilities."""
    length = int(result.as_numpy("sequence_length")[0, 0])
    tokens = result.as_numpy("output_ids")[0, 0, prompt:length].tolist()
    log_probs, top_ids, top_values = (result.as_numpy(name) for name in (
        "output_log_probs", "output_top_ids", "output_top_log_probs"))
    return (tokens, None if log_probs is None else log_probs[0, 0], None if top_ids is None else top_ids[0, 0],
            None if top_values is None else top_values[0, 0])


def served_top(tokens, log_probs, top_ids, top_values) -> list[list[tuple[int, float]]]:
    assert top_ids.shape == top_values.shape == (len(tokens), K)
    assert top_ids.dtype == np.uint32 and top_values.dtype == np.float32
    assert log_probs.shape == (len(tokens),)
    return [list(zip(ids.tolist(), values.tolist(), strict=True)) for ids, values in zip(top_ids, top_values,
                                                                                          strict=True)]


@pytest.mark.parametrize("engine", ["torch", "ctranslate2"])
def test_served_top_log_probs_equal_transformers_streamed_and_not(server, references, engine):
    reference = references["gpt2"]
    ids = reference.ids(PROMPT)
    expected_tokens, steps = reference.top(ids)
    parameters = {"max_tokens": TOKENS, "top_logprobs": K, "end_id": unused(expected_tokens)}
    with httpclient.InferenceServerClient(server.http_url) as client:
        whole = client.infer(f"gpt2_{engine}", inputs(httpclient, ids), parameters=parameters)
        plain = client.infer(f"gpt2_{engine}", inputs(httpclient, ids), parameters={"max_tokens": TOKENS})
    tokens, log_probs, top_ids, top_values = generated(whole, len(ids))
    top = served_top(tokens, log_probs, top_ids, top_values)
    assert_top_matches(top, log_probs.tolist(), tokens, expected_tokens, steps, K, 1e-4 if engine == "torch" else 1e-3)
    # Not asked: neither the top outputs nor the log-probabilities travel.
    assert {o["name"] for o in plain.get_response()["outputs"]} == {"output_ids", "sequence_length", "prefix_length"}

    # Streamed: long enough that a tiny model's tokens span several responses; equal to the answer in one.
    long = {**parameters, "max_tokens": STREAM_TOKENS[engine],
            "end_id": unused(reference.top(ids, STREAM_TOKENS[engine])[0])}
    with httpclient.InferenceServerClient(server.http_url) as client:
        tokens, log_probs, top_ids, top_values = generated(
            client.infer(f"gpt2_{engine}", inputs(httpclient, ids), parameters=long), len(ids))
    top = served_top(tokens, log_probs, top_ids, top_values)
    responses = stream_responses(server, f"gpt2_{engine}_stream", ids, {**long, "stream": True})
    carried = [r for r in responses if r.as_numpy("output_ids") is not None]
    assert len(carried) >= 2
    for response in carried:  # every generated token so far, aligned with the ids after the prompt
        so_far = generated(response, len(ids))
        assert so_far[0] == tokens[:len(so_far[0])]
        assert served_top(*so_far) == top[:len(so_far[0])]
        assert so_far[1].tolist() == log_probs[:len(so_far[0])].tolist()
    assert generated(carried[-1], len(ids))[0] == tokens
    unasked = stream_responses(server, f"gpt2_{engine}_stream", ids, {"max_tokens": TOKENS, "stream": True})
    assert all(r.as_numpy("output_log_probs") is None and r.as_numpy("output_top_ids") is None for r in unasked)
    logged = stream_responses(server, f"gpt2_{engine}_stream", ids,
                              {"max_tokens": TOKENS, "stream": True, "return_log_probs": True})
    for response in (r for r in logged if r.as_numpy("output_ids") is not None):
        so_far = generated(response, len(ids))
        assert so_far[1].shape == (len(so_far[0]),) and so_far[2] is None


@pytest.mark.parametrize(("model", "parameters", "message"), [
    ("gpt2_torch", {"top_logprobs": 21}, "top_logprobs must lie in [0, 20]"),
    ("gpt2_ctranslate2", {"top_logprobs": 2, "beam_width": 2}, "beam_width 1"),
    ("gpt2_torch", {"top_logprobs": "three"}, "must be an integer"),
    ("gpt2_no_top", {"top_logprobs": 2}, "'output_top_ids' and 'output_top_log_probs'"),
])
def test_served_refusals_are_clear_400s(server, references, model, parameters, message):
    ids = references["gpt2"].ids(PROMPT)
    with httpclient.InferenceServerClient(server.http_url) as client:
        with pytest.raises(InferenceServerException) as raised:
            client.infer(model, inputs(httpclient, ids), parameters={"max_tokens": 4, **parameters})
        assert message in raised.value.message()
        assert raised.value.status() == "400"
        # The model without top outputs serves everything else.
        answer = client.infer(model, inputs(httpclient, ids), parameters={"max_tokens": 4, "return_log_probs": True})
    assert answer.as_numpy("output_log_probs").shape == (1, 1, 4)


def test_top_outputs_are_stacked_zero_padded_and_sent_only_when_asked():
    from transerve.backends.generation.interface import RowResult, TensorInterface
    from transerve.core.types import InferRequest, RequestedOutput

    interface = TensorInterface(generator_config(Options("gpt2", "torch", "float32", 4, False, decoder_only=True)))
    results = [
        RowResult([[5, 6, 7]], [1], [-1.0], [[-0.5, -0.5]], [[[(6, -0.5), (9, -1.5)], [(7, -0.5), (8, -2.0)]]]),
        RowResult([[5, 6]], [1], [-0.25], [[-0.25]], [[[(6, -0.25), (3, -3.0)]]]),
    ]
    wanted = interface.wanted(InferRequest("gpt2", []), log_probs=True, top=True)
    tensors = {t.name: t for t in interface.response_tensors(results, wanted)}
    assert tensors["output_top_ids"].data.tolist() == [[[[6, 9], [7, 8]]], [[[6, 3], [0, 0]]]]
    assert tensors["output_top_log_probs"].data.tolist() == [[[[-0.5, -1.5], [-0.5, -2.0]]], [[[-0.25, -3.0],
                                                                                               [0.0, 0.0]]]]
    assert tensors["output_top_ids"].datatype == "UINT32" and tensors["output_top_log_probs"].datatype == "FP32"
    assert "output_top_ids" not in interface.wanted(InferRequest("gpt2", []), log_probs=True)
    named = InferRequest("gpt2", [], outputs=[RequestedOutput("output_ids"), RequestedOutput("output_top_ids")])
    assert interface.asks_log_probs(named)
    assert interface.wanted(named, log_probs=False) == ["output_ids", "output_top_ids"]
    first = TensorInterface(generator_config(Options("fastertransformer", "torch", "float32", 4, False, True)))
    with pytest.raises(ServerError, match="output_top_ids") as raised:
        first.check_top_outputs()
    assert raised.value.code is ErrorCode.INVALID_ARG
    interface.check_top_outputs()  # declared: nothing to refuse
