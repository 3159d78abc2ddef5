"""The generation backend served by a real `transerve serve`, called with real tritonclient clients.

Random-weight T5 and GPT-2 models (tests/support/generation_models.py) are served through CTranslate2 (converted)
and through the torch engine (the Hugging Face folder); outputs are compared with transformers' `generate` on the
same weights, token for token.
"""

from __future__ import annotations

import json
import queue
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
from support import start_transerve
from support.cuda import ctranslate2_cuda_problem
from support.generation_models import build_generation_model
from support.repositories import write_model

ctranslate2 = pytest.importorskip("ctranslate2")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

MAX_NEW_TOKENS = 16

SEED_INTERFACE = """
input [
  { name: "INPUT_ID" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "REQUEST_INPUT_LEN" data_type: TYPE_UINT32 dims: [ 1 ] },
  { name: "REQUEST_OUTPUT_LEN" data_type: TYPE_UINT32 dims: [ 1 ] optional: true }
]
output [
  { name: "OUTPUT0" data_type: TYPE_UINT32 dims: [ -1, -1 ] },
  { name: "OUTPUT1" data_type: TYPE_UINT32 dims: [ -1 ] }
]
"""

FT_INTERFACE = """
input [
  { name: "input_ids" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "sequence_length" data_type: TYPE_UINT32 dims: [ 1 ] },
  { name: "max_output_len" data_type: TYPE_UINT32 dims: [ 1 ] optional: true },
  { name: "beam_width" data_type: TYPE_UINT32 dims: [ 1 ] optional: true },
  { name: "runtime_top_k" data_type: TYPE_UINT32 dims: [ 1 ] optional: true },
  { name: "min_length" data_type: TYPE_UINT32 dims: [ 1 ] optional: true },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "stop_words_list" data_type: TYPE_INT32 dims: [ 2, -1 ] optional: true },
  { name: "bad_words_list" data_type: TYPE_INT32 dims: [ 2, -1 ] optional: true }
]
output [
  { name: "output_ids" data_type: TYPE_UINT32 dims: [ -1, -1 ] },
  { name: "sequence_length" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "cum_log_probs" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "output_log_probs" data_type: TYPE_FP32 dims: [ -1, -1 ] },
  { name: "prefix_length" data_type: TYPE_UINT32 dims: [ -1 ] }
]
"""

#: Streaming tests ask CTranslate2 for this many tokens: enough that a tiny model's stream spans several loop turns.
STREAM_TOKENS = 200
#: The torch budget model's kv_cache_tokens.
BUDGET = 3000
#: A one-step ensemble over the budget model: how a one-response text request reaches a generator.
BUDGET_ENSEMBLE = """
name: "t5_budget_ensemble" platform: "ensemble" max_batch_size: 16
input [
  { name: "input_ids" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "sequence_length" data_type: TYPE_UINT32 dims: [ 1 ] }
]
output [
  { name: "output_ids" data_type: TYPE_UINT32 dims: [ -1, -1 ] },
  { name: "output_length" data_type: TYPE_UINT32 dims: [ -1 ] }
]
ensemble_scheduling { step [ {
  model_name: "t5_torch_budget" model_version: -1
  input_map { key: "input_ids" value: "input_ids" }
  input_map { key: "sequence_length" value: "sequence_length" }
  output_map { key: "output_ids" value: "output_ids" }
  output_map { key: "sequence_length" value: "output_length" }
} ] }
"""
PROMPT = "translate English to German: The house is wonderful."
PROMPTS = [PROMPT, "Hello world", "The quick brown fox jumps over the lazy dog."]


def config(name: str, interface: str, engine: str, decoupled: bool = False, extra: str = "",
           instances: str = "{ kind: KIND_CPU }") -> str:
    policy = "model_transaction_policy { decoupled: true }\n" if decoupled else ""
    return (
        f'name: "{name}"\nbackend: "generation"\nmax_batch_size: 16\n{policy}{interface}'
        f'parameters {{ key: "engine" value {{ string_value: "{engine}" }} }}\n'
        f'parameters {{ key: "max_new_tokens" value {{ string_value: "{MAX_NEW_TOKENS}" }} }}\n'
        'parameters { key: "intra_op_threads" value { string_value: "1" } }\n'
        f"instance_group [{instances}]\n{extra}"
    )


class Reference:
    """transformers' `generate` on the Hugging Face folder the served models were made from."""

    def __init__(self, hf_dir: Path) -> None:
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
        config = transformers.AutoConfig.from_pretrained(hf_dir)
        self.encoder_decoder = bool(config.is_encoder_decoder)
        loader = transformers.AutoModelForSeq2SeqLM if self.encoder_decoder else transformers.AutoModelForCausalLM
        self.model = loader.from_pretrained(hf_dir).eval()
        self.eos = self.model.generation_config.eos_token_id
        #: generate's answers, computed once per test session (tests share prompts).
        self._answers: dict[tuple, list[list[int]]] = {}

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def generate(self, ids: list[int], beams: int = 1, max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
        """Output ids per beam as served: new tokens up to the end token (encoder-decoder), prompt first (GPT)."""
        key = (tuple(ids), beams, max_new_tokens)
        if key not in self._answers:
            self._answers[key] = self._generate(ids, beams, max_new_tokens)
        return self._answers[key]

    def _generate(self, ids: list[int], beams: int, max_new_tokens: int) -> list[list[int]]:
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), do_sample=False, num_beams=beams,
                                      num_return_sequences=beams, max_new_tokens=max_new_tokens)
        prompt = [] if self.encoder_decoder else ids
        sequences = []
        for row in out.tolist():
            new = row[1:] if self.encoder_decoder else row[len(ids):]
            if self.eos in new:
                new = new[: new.index(self.eos) + 1]
            sequences.append(prompt + new)
        return sequences


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("generation_models")
    paths = {}
    for arch in ("t5", "gpt2"):
        hf_dir = build_generation_model(arch, root / arch)
        ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(root / f"{arch}_ct2"),
                                                                         quantization="float32")
        paths[arch] = hf_dir
        paths[f"{arch}_ct2"] = root / f"{arch}_ct2"
    return paths


@pytest.fixture(scope="module")
def references(built) -> dict[str, Reference]:
    return {arch: Reference(built[arch]) for arch in ("t5", "gpt2")}


@pytest.fixture(scope="module")
def server(built, tmp_path_factory):
    repo = tmp_path_factory.mktemp("generation_repository")
    models = {
        # name: (folder served, interface, engine, decoupled[, more config])
        # FasterTransformer's configs carry dynamic_batching: accepted, and dropped (the engine batches).
        "fastertransformer": ("t5_ct2", SEED_INTERFACE, "ctranslate2", False, "dynamic_batching { }\n"),
        "t5": ("t5_ct2", FT_INTERFACE, "ctranslate2", False),
        "t5_stream": ("t5_ct2", FT_INTERFACE, "ctranslate2", True),
        "gpt2": ("gpt2_ct2", FT_INTERFACE, "ctranslate2", False),
        "fastertransformer_torch": ("t5", SEED_INTERFACE, "torch", False),
        "t5_torch": ("t5", FT_INTERFACE, "torch", False),
        "t5_torch_stream": ("t5", FT_INTERFACE, "torch", True),
        "gpt2_torch": ("gpt2", FT_INTERFACE, "torch", False),
        "t5_torch_request_stream": ("t5", FT_INTERFACE, "torch", True,
                                    'parameters { key: "scheduling" value { string_value: "request" } }\n'),
        # A KV budget one long sequence fills: what comes next waits for it to leave.
        "t5_torch_budget_stream": ("t5", FT_INTERFACE, "torch", True,
                                   f'parameters {{ key: "kv_cache_tokens" value {{ string_value: "{BUDGET}" }} }}\n'),
        "t5_torch_budget": ("t5", FT_INTERFACE, "torch", False,
                            f'parameters {{ key: "kv_cache_tokens" value {{ string_value: "{BUDGET}" }} }}\n'),
    }
    for name, (source, interface, engine, decoupled, *extra) in models.items():
        shutil.copytree(built[source], repo / name / "1" / "model")
        (repo / name / "config.pbtxt").write_text(config(name, interface, engine, decoupled, *extra))
    write_model(repo, "missing_folder", config("missing_folder", FT_INTERFACE, "ctranslate2"))
    broken = {
        "bad_parameter": config("bad_parameter", FT_INTERFACE, "ctranslate2").replace(
            'key: "intra_op_threads" value { string_value: "1" }',
            'key: "max_batch_rows" value { string_value: "many" }',
        ),
        "bad_input": config("bad_input", FT_INTERFACE.replace('"runtime_top_k"', '"top_k_runtime"'), "ctranslate2"),
    }
    for name, text in broken.items():
        shutil.copytree(built["t5_ct2"], repo / name / "1" / "model")
        (repo / name / "config.pbtxt").write_text(text)
    write_model(repo, "t5_budget_ensemble", BUDGET_ENSEMBLE)
    # Not strictly ready: one model is meant to fail its load.
    with start_transerve(repo, "--strict-readiness=false") as running:
        yield running


def prepare_tensor(name: str, array: np.ndarray):
    """The seed client's helper, as it wrote it."""
    tensor = httpclient.InferInput(name, array.shape, np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def ft_inputs(module, ids: list[int], **tensors: tuple[str, object]):
    """`input_ids` and `sequence_length` (and any decoding tensors) of one row, for tritonclient `module`."""
    arrays = {"input_ids": np.array([ids], np.uint32), "sequence_length": np.array([[len(ids)]], np.uint32)}
    arrays.update({name: np.array([[value]], dtype) for name, (dtype, value) in tensors.items()})
    inputs = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, array.shape, np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def beams_of(output_ids: np.ndarray, lengths: np.ndarray, row: int = 0) -> list[list[int]]:
    return [output_ids[row, beam, : lengths[row, beam]].tolist() for beam in range(output_ids.shape[1])]


@pytest.mark.parametrize("model", ["fastertransformer", "fastertransformer_torch"])
def test_seed_client_gets_transformers_greedy_output(server, references, model):
    """The FasterTransformer T5 client, unchanged but for its URL: INPUT_ID / REQUEST_INPUT_LEN in, OUTPUT0/1 out."""
    reference = references["t5"]
    encoded = reference.tokenizer(PROMPTS, return_tensors="np", padding=True)
    input_ids = encoded.input_ids.astype(np.uint32)
    mem_seq_len = encoded.attention_mask.sum(axis=1).reshape(-1, 1).astype(np.uint32)
    with httpclient.InferenceServerClient(server.http_url) as client:
        inputs = [prepare_tensor("INPUT_ID", input_ids), prepare_tensor("REQUEST_INPUT_LEN", mem_seq_len)]
        result = client.infer(model, inputs)
    output0, output1 = result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1")
    assert output0.dtype == np.uint32 and output0.shape[:2] == (len(PROMPTS), 1) and output1.shape == (3, 1)
    for row, text in enumerate(PROMPTS):
        assert beams_of(output0, output1, row) == reference.generate(reference.ids(text))
        translation = reference.tokenizer.decode(output0[row][0][: output1[row][0]], skip_special_tokens=True)
        assert translation == reference.tokenizer.decode(reference.generate(reference.ids(text))[0],
                                                         skip_special_tokens=True)
    assert output0[1, 0, output1[1, 0]:].tolist() == [0] * (output0.shape[2] - output1[1, 0])  # zero-padded


@pytest.mark.parametrize("model", ["t5", "t5_torch"])
def test_beam_search_returns_transformers_beams(server, references, model):
    reference = references["t5"]
    ids = reference.ids(PROMPT)
    expected = reference.generate(ids, beams=4)
    with httpclient.InferenceServerClient(server.http_url) as client:
        # beam_width as an input tensor (FasterTransformer) and as a request parameter give the same beams
        by_tensor = client.infer(model, ft_inputs(httpclient, ids, beam_width=(np.uint32, 4)))
        by_parameter = client.infer(model, ft_inputs(httpclient, ids), parameters={"beam_width": 4})
    for result in (by_tensor, by_parameter):
        beams = beams_of(result.as_numpy("output_ids"), result.as_numpy("sequence_length"))
        assert len(beams) == 4
        assert beams[0] == expected[0]
        assert sorted(map(tuple, beams)) == sorted(map(tuple, expected))
        scores = result.as_numpy("cum_log_probs")
        assert scores is None  # log-probabilities only when asked for


@pytest.mark.parametrize("model", ["gpt2", "gpt2_torch"])
def test_decoder_only_output_starts_with_the_prompt(server, references, model):
    reference = references["gpt2"]
    ids = reference.ids("The quick brown fox")
    with httpclient.InferenceServerClient(server.http_url) as client:
        result = client.infer(model, ft_inputs(httpclient, ids))
    (sequence,) = beams_of(result.as_numpy("output_ids"), result.as_numpy("sequence_length"))
    assert sequence[: len(ids)] == ids
    assert [sequence] == reference.generate(ids)
    assert result.as_numpy("prefix_length").tolist() == [[len(ids)]]


@pytest.mark.parametrize("model", ["t5", "t5_torch"])
def test_sixteen_concurrent_requests_each_get_their_own_output(server, references, model):
    reference = references["t5"]
    texts = [f"translate English to German: sentence {i} is {'very ' * (i % 5)}long." for i in range(16)]

    def ask(text: str) -> list[list[int]]:
        with httpclient.InferenceServerClient(server.http_url) as client:
            result = client.infer(model, ft_inputs(httpclient, reference.ids(text)))
        return beams_of(result.as_numpy("output_ids"), result.as_numpy("sequence_length"))

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, texts))
    assert answers == [ask(text) for text in texts]  # each alone
    assert len({tuple(answer[0]) for answer in answers}) > 12  # outputs differ, so a mix-up would show
    assert answers[0] == reference.generate(reference.ids(texts[0]))


def stream_responses(server, model: str, inputs, parameters: dict, timeout: float = 60.0) -> list:
    """Every response of one ModelStreamInfer request, up to the final flag (an empty final included)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, parameters=parameters, enable_empty_final_response=True)
        responses = []
        while True:
            result, error = results.get(timeout=timeout)
            assert error is None, error
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return responses
    finally:
        client.stop_stream()
        client.close()


def whole_answer(server, model: str, ids: list[int], tokens: int) -> list[int]:
    """The decoupled model's answer without streaming (one response)."""
    (response,) = stream_responses(server, model, ft_inputs(grpcclient, ids), {"max_tokens": tokens})
    (sequence,) = beams_of(response.as_numpy("output_ids"), response.as_numpy("sequence_length"))
    return sequence


@pytest.mark.parametrize(("model", "tokens"), [("t5_stream", STREAM_TOKENS), ("t5_torch_stream", 32)])
def test_grpc_stream_sends_tokens_as_they_come_and_equals_the_whole_answer(server, references, model, tokens):
    reference = references["t5"]
    ids = reference.ids(PROMPT)
    expected = whole_answer(server, model, ids, tokens)
    assert len(expected) == tokens  # the random model produces no end token this early
    responses = stream_responses(server, model, ft_inputs(grpcclient, ids), {"stream": True, "max_tokens": tokens})
    carried = [r for r in responses if r.as_numpy("output_ids") is not None]
    assert len(carried) >= 2  # not one answer at the end
    assert responses[-1].get_response().parameters["triton_final_response"].bool_param
    received: list[int] = []
    for result in carried:
        output_ids, lengths = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
        prefix = int(result.as_numpy("prefix_length")[0, 0])
        assert prefix == len(received)  # prefix_length: what earlier responses carried
        sequence = output_ids[0, 0, : lengths[0, 0]].tolist()
        assert sequence[:prefix] == received
        received = sequence
    assert received == expected


def test_grpc_stream_flag_as_an_input_tensor_and_without_stream_one_response(server, references):
    reference = references["t5"]
    ids = reference.ids("Hello world")
    # stream false: one response, carrying the final flag, equal to transformers' generate
    assert whole_answer(server, "t5_stream", ids, MAX_NEW_TOKENS) == reference.generate(ids)[0]
    expected = whole_answer(server, "t5_stream", ids, STREAM_TOKENS)
    by_tensor = stream_responses(server, "t5_stream", ft_inputs(grpcclient, ids, stream=(np.bool_, True)),
                                 {"max_tokens": STREAM_TOKENS})
    carried = [r for r in by_tensor if r.as_numpy("output_ids") is not None]
    assert len(carried) >= 2
    assert beams_of(carried[-1].as_numpy("output_ids"), carried[-1].as_numpy("sequence_length")) == [expected]


@pytest.mark.parametrize(("model", "long", "probe"), [("t5_stream", 20000, 1000), ("t5_torch_budget_stream", 0, 100)])
def test_cancelling_a_stream_stops_its_decoding(server, references, model, long, probe):
    """A stream asked for thousands of tokens is cancelled after its first response, and a request follows that
    can only start once that sequence is gone (CTranslate2 decodes one call at a time; the torch model's KV
    budget holds one such sequence): it does not wait for the thousands, and the server keeps serving."""
    reference = references["t5"]
    ids = reference.ids(PROMPT)
    long = long or BUDGET - len(ids)
    started = time.monotonic()  # the model's decoding speed, alone and not streamed
    stream_responses(server, model, ft_inputs(grpcclient, ids), {"max_tokens": probe, "min_length": probe})
    per_token = (time.monotonic() - started) / probe
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(model, ft_inputs(grpcclient, ids), parameters={
        "stream": True, "max_tokens": long, "min_length": long})
    result, error = results.get(timeout=60)
    assert error is None, error
    produced = int(result.as_numpy("sequence_length")[0, 0])
    client.stop_stream(cancel_requests=True)
    client.close()
    asked = time.monotonic()
    answer = stream_responses(server, model, ft_inputs(grpcclient, ids), {"max_tokens": 4})[-1]
    waited = time.monotonic() - asked
    assert answer.as_numpy("sequence_length")[0, 0] == 4
    assert waited < 0.25 * (long - produced) * per_token, (waited, per_token)


@pytest.mark.parametrize(("transport", "model"), [
    ("http", "t5_torch_budget"), ("grpc", "t5_torch_budget"), ("http", "t5_budget_ensemble")])
def test_a_request_whose_client_goes_away_stops_decoding(server, references, transport, model):
    """Not streamed: the client of a request asked for thousands of tokens goes away while it decodes (closes
    its HTTP connection; its gRPC deadline passes); a request follows that can only start once that sequence is
    gone (the KV budget holds one such sequence), and it does not wait for the thousands. Through an ensemble
    too: the ensemble request's cancellation cancels its running generation step."""
    reference = references["t5"]
    ids = reference.ids(PROMPT)
    long, probe = BUDGET - len(ids), 100

    def body(tokens: int) -> bytes:
        return json.dumps({"inputs": [
            {"name": "input_ids", "datatype": "UINT32", "shape": [1, len(ids)], "data": ids},
            {"name": "sequence_length", "datatype": "UINT32", "shape": [1, 1], "data": [len(ids)]},
        ], "parameters": {"max_tokens": tokens, "min_length": tokens}}).encode()

    url = f"{server.base_url}/v2/models/t5_torch_budget/infer"
    started = time.monotonic()  # the model's decoding speed, alone, through `model`
    answer = requests.post(f"{server.base_url}/v2/models/{model}/infer", data=body(probe), timeout=60)
    assert answer.status_code == 200, answer.text
    per_token = (time.monotonic() - started) / probe
    decoding = 20 * per_token + 0.2
    if transport == "http":
        host, port = server.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as connection:
            payload = body(long)
            connection.sendall(b"POST /v2/models/%s/infer HTTP/1.1\r\nHost: x\r\n"
                               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                               % (model.encode(), len(payload), payload))
            time.sleep(decoding)
    else:
        with grpcclient.InferenceServerClient(server.grpc_url) as client, \
                pytest.raises(InferenceServerException) as caught:
            client.infer(model, ft_inputs(grpcclient, ids), client_timeout=decoding,
                         parameters={"max_tokens": long, "min_length": long})
        assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    asked = time.monotonic()
    answer = requests.post(url, data=body(4), timeout=60)
    waited = time.monotonic() - asked
    assert answer.status_code == 200, answer.text
    lengths = next(output for output in answer.json()["outputs"] if output["name"] == "sequence_length")
    assert lengths["data"] == [4]
    assert waited < 0.25 * long * per_token, (waited, per_token)


def test_generate_stream_sends_server_sent_events(server, references):
    reference = references["t5"]
    ids = reference.ids(PROMPT)
    expected = whole_answer(server, "t5_stream", ids, STREAM_TOKENS)
    body = {"input_ids": ids, "sequence_length": len(ids), "stream": True, "max_tokens": STREAM_TOKENS}
    answer = requests.post(f"{server.base_url}/v2/models/t5_stream/generate_stream", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    events = [json.loads(line[len("data: "):]) for line in answer.text.split("\n") if line.startswith("data: ")]
    assert len(events) >= 2
    last = events[-1]
    assert last["output_ids"][: last["sequence_length"]] == expected
    assert [event["prefix_length"] for event in events[1:]] == [e["sequence_length"] for e in events[:-1]]


BAD_INPUTS = [
    ({"ids": [], "parameters": {}}, "the input is empty (length 0)"),
    ({"ids": [5] * 5000, "parameters": {}}, "the input has 5000 tokens, more than the"),
    ({"ids": [5, 6, 1], "parameters": {"temprature": 0.5}}, "unknown decoding parameter 'temprature'"),
    ({"ids": [5, 6, 1], "parameters": {"beam_width": 0}}, "beam_width must be at least 1, got 0"),
    ({"ids": [5, 6, 1], "parameters": {"stream": True}}, "this model is not decoupled"),
]


@pytest.mark.parametrize(("case", "words"), BAD_INPUTS, ids=["empty", "too_long", "unknown", "beam_0", "stream"])
def test_bad_input_is_a_clear_400_over_http_and_invalid_argument_over_grpc(server, case, words):
    ids = case["ids"]
    body = {
        "inputs": [
            {"name": "input_ids", "datatype": "UINT32", "shape": [1, len(ids)], "data": ids},
            {"name": "sequence_length", "datatype": "UINT32", "shape": [1, 1], "data": [len(ids)]},
        ],
        "parameters": case["parameters"],
    }
    answer = requests.post(f"{server.base_url}/v2/models/t5/infer", json=body, timeout=60)
    assert answer.status_code == 400
    assert words in answer.json()["error"]
    with grpcclient.InferenceServerClient(server.grpc_url) as client, pytest.raises(InferenceServerException) as caught:
        client.infer("t5", ft_inputs(grpcclient, ids), parameters=case["parameters"])
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert words in caught.value.message()
    assert server.alive()


def test_models_that_cannot_load_are_unavailable_with_the_reason_and_the_rest_serves(server):
    index = requests.post(f"{server.base_url}/v2/repository/index", json={}, timeout=30).json()
    states = {entry["name"]: entry for entry in index}
    reasons = {
        "missing_folder": "model directory '",
        "bad_parameter": "parameter 'max_batch_rows' must be an integer, got 'many'",
        "bad_input": "input 'top_k_runtime' is not one the generation backend knows",
    }
    for name, words in reasons.items():
        assert states[name]["state"] == "UNAVAILABLE"
        assert words in states[name]["reason"]
    assert "runtime_top_k" in states["bad_input"]["reason"]  # the supported names are listed
    ready = ("fastertransformer", "fastertransformer_torch", "t5", "t5_stream", "gpt2", "t5_torch", "t5_torch_stream",
             "gpt2_torch", "t5_torch_request_stream", "t5_torch_budget_stream", "t5_torch_budget")
    assert all(states[name]["state"] == "READY" for name in ready)


def test_dynamic_batching_is_dropped_from_the_config(server):
    answer = requests.get(f"{server.base_url}/v2/models/fastertransformer/config", timeout=30).json()
    assert answer["backend"] == "generation" and "dynamic_batching" not in answer
    assert "dynamic_batching is ignored" in server.log


@pytest.mark.parametrize("model", ["t5", "t5_torch"])
def test_sampling_with_a_seed_is_reproducible(server, references, model):
    reference = references["t5"]
    ids = reference.ids(PROMPT)

    def sample(seed: int) -> list[list[int]]:
        with httpclient.InferenceServerClient(server.http_url) as client:
            result = client.infer(model, ft_inputs(httpclient, ids), parameters={
                "top_k": 50, "temperature": 3.0, "random_seed": seed})
        return beams_of(result.as_numpy("output_ids"), result.as_numpy("sequence_length"))

    draws = {seed: sample(seed) for seed in range(4)}
    assert all(sample(seed) == draw for seed, draw in draws.items())
    assert len({tuple(draw[0]) for draw in draws.values()}) > 1  # the seeds do sample differently
    assert draws[0] != reference.generate(ids)


@pytest.mark.parametrize(("model", "short_first"), [("t5_torch_stream", True), ("t5_torch_request_stream", False)])
def test_in_flight_batching_lets_a_short_request_finish_before_a_long_one(server, references, model, short_first):
    """The short request arrives while the long one is decoding (its first token is out) on the torch engine: with
    in-flight batching it joins and finishes first; with request-level batching (`scheduling: request`) it waits."""
    reference = references["t5"]
    ids = reference.ids(PROMPT)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error, time.monotonic())))
    try:
        client.async_stream_infer(model, ft_inputs(grpcclient, ids), enable_empty_final_response=True,
                                  parameters={"stream": True, "max_tokens": 100, "min_length": 100})
        result, error, _ = results.get(timeout=60)
        assert error is None, error
        short = stream_responses(server, model, ft_inputs(grpcclient, ids), {"max_tokens": 4})
        short_done = time.monotonic()
        assert short[-1].as_numpy("sequence_length")[0, 0] == 4
        while True:
            result, error, at = results.get(timeout=120)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        assert (short_done < at) is short_first
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("model", ["t5", "t5_torch"])
def test_a_request_the_engine_refuses_is_a_400_and_the_model_keeps_serving(server, references, model):
    """Beyond the torch engine's KV budget (the engine's INVALID_ARG), or the vocabulary (the backend's, naming the
    input and the range): a 400."""
    ids = references["t5"].ids(PROMPT)
    ids_sent, parameters, words = {
        "t5": (ids[:-1] + [100000], {}, "input 'input_ids' holds token id 100000, outside this model's vocabulary "
                                        "[0, "),
        "t5_torch": (ids, {"max_tokens": 100000}, "this model's budget is 65536 (kv_cache_tokens)"),
    }[model]
    body = {
        "inputs": [
            {"name": "input_ids", "datatype": "UINT32", "shape": [1, len(ids_sent)], "data": ids_sent},
            {"name": "sequence_length", "datatype": "UINT32", "shape": [1, 1], "data": [len(ids_sent)]},
        ],
        "parameters": parameters,
    }
    answer = requests.post(f"{server.base_url}/v2/models/{model}/infer", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert words in answer.json()["error"]
    with httpclient.InferenceServerClient(server.http_url) as client:
        assert client.infer(model, ft_inputs(httpclient, ids)).as_numpy("output_ids") is not None


@pytest.mark.parametrize("model", ["t5", "t5_torch"])
def test_rows_of_one_request_decode_with_their_own_tensors(server, references, model):
    """Two rows, the second with beam_width 2 and a shorter max_output_len: each as it would be alone, stacked."""
    reference = references["t5"]
    first, second = reference.ids(PROMPTS[0]), reference.ids(PROMPTS[2])
    width = max(len(first), len(second))
    arrays = {
        "input_ids": np.array([first + [0] * (width - len(first)), second + [0] * (width - len(second))], np.uint32),
        "sequence_length": np.array([[len(first)], [len(second)]], np.uint32),
        "beam_width": np.array([[1], [2]], np.uint32),
        "max_output_len": np.array([[MAX_NEW_TOKENS], [6]], np.uint32),
    }
    inputs = []
    for name, array in arrays.items():
        inputs.append(httpclient.InferInput(name, array.shape, np_to_triton_dtype(array.dtype)))
        inputs[-1].set_data_from_numpy(array)
    with httpclient.InferenceServerClient(server.http_url) as client:
        result = client.infer(model, inputs)
    output_ids, lengths = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
    assert output_ids.shape[:2] == (2, 2)
    assert beams_of(output_ids, lengths, 0) == reference.generate(first) + [[]]  # one beam, then an empty one
    assert beams_of(output_ids, lengths, 1) == reference.generate(second, beams=2, max_new_tokens=6)


@pytest.fixture(scope="module")
def gpu_server(built, tmp_path_factory):
    """Both engines on KIND_GPU instances; ready whatever loads (CTranslate2's CUDA libraries may be missing)."""
    repo = tmp_path_factory.mktemp("generation_gpu_repository")
    for name, source, engine in (("t5_gpu", "t5_ct2", "ctranslate2"), ("t5_torch_gpu", "t5", "torch")):
        shutil.copytree(built[source], repo / name / "1" / "model")
        text = config(name, FT_INTERFACE, engine, instances="{ kind: KIND_GPU gpus: [ 0 ] }")
        (repo / name / "config.pbtxt").write_text(text)
    with start_transerve(repo, "--strict-readiness=false") as running:
        yield running


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("model", ["t5_gpu", "t5_torch_gpu"])
def test_gpu_instances_decode_as_transformers_does(gpu_server, references, model):
    if model == "t5_gpu" and ctranslate2_cuda_problem() is not None:
        pytest.skip(str(ctranslate2_cuda_problem()))
    reference = references["t5"]
    ids = reference.ids(PROMPT)
    with httpclient.InferenceServerClient(gpu_server.http_url) as client:
        greedy = client.infer(model, ft_inputs(httpclient, ids))
        beams = client.infer(model, ft_inputs(httpclient, ids), parameters={"beam_width": 4})
    assert beams_of(greedy.as_numpy("output_ids"), greedy.as_numpy("sequence_length")) == reference.generate(ids)
    best = beams_of(beams.as_numpy("output_ids"), beams.as_numpy("sequence_length"))[0]
    assert best == reference.generate(ids, beams=4)[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or "cuBLAS" not in str(ctranslate2_cuda_problem()),
                    reason="a CUDA GPU where CTranslate2 cannot load CUDA 12's cuBLAS")
def test_a_gpu_model_whose_engine_cannot_decode_there_is_unavailable_at_load_with_the_reason(gpu_server):
    """On a CUDA 13 host without the gpu extra (issue 22): UNAVAILABLE at load with the reason, where it used to
    be READY and fail every request."""
    index = requests.post(f"{gpu_server.base_url}/v2/repository/index", json={}, timeout=30).json()
    (entry,) = [entry for entry in index if entry["name"] == "t5_gpu"]
    assert entry["state"] == "UNAVAILABLE"
    assert "libcublas.so.12" in entry["reason"] and "transerve[gpu]" in entry["reason"]
    with httpclient.InferenceServerClient(gpu_server.http_url) as client:
        assert not client.is_model_ready("t5_gpu")
        assert client.is_model_ready("t5_torch_gpu")


def words_tensor(name: str, words: list[list[int]]):
    """FasterTransformer's flattened word list for one row: [1, 2, L], ids then end offsets padded with -1."""
    flat = [token for word in words for token in word]
    offsets = list(np.cumsum([len(word) for word in words]))
    array = np.array([[flat, offsets + [-1] * (len(flat) - len(offsets))]], np.int32)
    tensor = httpclient.InferInput(name, array.shape, "INT32")
    tensor.set_data_from_numpy(array)
    return tensor


@pytest.mark.parametrize("model", ["t5", "t5_torch"])
def test_stop_and_bad_words_as_parameters_and_as_fastertransformer_tensors(server, references, model):
    reference = references["t5"]
    ids = reference.ids(PROMPT)
    (greedy,) = reference.generate(ids)
    stop = greedy[2:4]
    end = next(i + 2 for i in range(len(greedy)) if greedy[i:i + 2] == stop)
    with httpclient.InferenceServerClient(server.http_url) as client:
        by_parameter = client.infer(model, ft_inputs(httpclient, ids), parameters={"stop": json.dumps([stop])})
        by_tensor = client.infer(model, ft_inputs(httpclient, ids) + [words_tensor("stop_words_list", [stop])])
        banned = client.infer(model, ft_inputs(httpclient, ids) + [words_tensor("bad_words_list", [greedy[:1]])])
    for result in (by_parameter, by_tensor):
        assert beams_of(result.as_numpy("output_ids"), result.as_numpy("sequence_length")) == [greedy[:end]]
    (sequence,) = beams_of(banned.as_numpy("output_ids"), banned.as_numpy("sequence_length"))
    assert sequence[0] != greedy[0] and greedy[0] not in sequence


@pytest.mark.parametrize("model", ["t5", "t5_torch", "gpt2"])
def test_log_probabilities_when_asked_for(server, references, model):
    reference = references["gpt2" if model == "gpt2" else "t5"]
    ids = reference.ids(PROMPT)
    with httpclient.InferenceServerClient(server.http_url) as client:
        asked = client.infer(model, ft_inputs(httpclient, ids), parameters={"return_log_probs": True})
        named = client.infer(model, ft_inputs(httpclient, ids), outputs=[
            httpclient.InferRequestedOutput("output_ids"), httpclient.InferRequestedOutput("cum_log_probs")])
    (sequence,) = beams_of(asked.as_numpy("output_ids"), asked.as_numpy("sequence_length"))
    generated = len(sequence) - int(asked.as_numpy("prefix_length")[0, 0])
    log_probs = asked.as_numpy("output_log_probs")[0, 0]
    assert log_probs.shape == (generated,) and (log_probs <= 0).all()
    cumulative = float(asked.as_numpy("cum_log_probs")[0, 0])
    assert cumulative == pytest.approx(float(log_probs.sum()), abs=1e-3)
    assert float(named.as_numpy("cum_log_probs")[0, 0]) == pytest.approx(cumulative, abs=1e-5)
