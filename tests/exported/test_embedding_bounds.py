"""Ids outside an exported model's embedding tables are the client's error: a 400 naming the input and the
vocabulary's range, for that request alone, from the onnxruntime and the pytorch (TorchScript) backends, over
HTTP and gRPC; the requests batched with a bad one are answered, and the server keeps serving."""

from __future__ import annotations

import concurrent.futures
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import start_transerve
from tritonclient.utils import InferenceServerException

VOCABULARY = 30522  # the tiny BERTs share MiniLM's tokenizer
MODELS = ["seqcls_onnx_model", "seqcls_ts_model"]


def token_inputs(module: object, ids: np.ndarray, types: np.ndarray | None = None) -> list[object]:
    arrays = {"input_ids": ids, "attention_mask": np.ones_like(ids),
              "token_type_ids": np.zeros_like(ids) if types is None else types}
    tensors = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(array.shape), "INT64")  # type: ignore[attr-defined]
        tensor.set_data_from_numpy(array.astype(np.int64))
        tensors.append(tensor)
    return tensors


def refusal(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("model", MODELS)
def test_an_id_outside_the_vocabulary_is_a_400_naming_the_input_and_its_range(exported_server, model):
    client = httpclient.InferenceServerClient(exported_server.http_url)
    good = np.array([[101, 2023, 102]])
    for bad_ids, shown in ((np.array([[101, VOCABULARY, 102]]), VOCABULARY), (np.array([[-1, 5, 102]]), -1)):
        error = refusal(lambda ids=bad_ids: client.infer(model, token_inputs(httpclient, ids)))
        assert error.status() == "400", error
        assert (f"input 'input_ids' holds id {shown}, outside the vocabulary (0..{VOCABULARY - 1}) of the embedding "
                "table 'model.bert.embeddings.word_embeddings.weight'") in error.message()
    error = refusal(lambda: client.infer(model, token_inputs(httpclient, good, np.array([[0, 1, 2]]))))
    assert error.status() == "400" and "input 'token_type_ids' holds id 2, outside the vocabulary (0..1)" in str(error)
    # Random ids, as perf_analyzer's random bytes make them, are refused the same way.
    random = np.random.default_rng(0).integers(-(2**62), 2**62, (2, 128))
    assert refusal(lambda: client.infer(model, token_inputs(httpclient, random))).status() == "400"
    assert client.infer(model, token_inputs(httpclient, good)).as_numpy("logits").shape == (1, 3)

    grpc = grpcclient.InferenceServerClient(exported_server.grpc_url)
    error = refusal(lambda: grpc.infer(model, token_inputs(grpcclient, np.array([[VOCABULARY + 7]]))))
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert f"holds id {VOCABULARY + 7}, outside the vocabulary (0..{VOCABULARY - 1})" in error.message()
    assert grpc.infer(model, token_inputs(grpcclient, good)).as_numpy("logits").shape == (1, 3)


@pytest.fixture(scope="module")
def batching_server(exported_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    """The two classifiers again, each holding requests for 0.3 s so that concurrent ones share a batch."""
    repository = tmp_path_factory.mktemp("bounds")
    for model in MODELS:
        shutil.copytree(exported_repository / model, repository / model)
        config = repository / model / "config.pbtxt"
        text = config.read_text().replace("dynamic_batching {\n}\n", "")
        config.write_text(text + "dynamic_batching { max_queue_delay_microseconds: 300000 }\n")
    with start_transerve(repository) as server:
        yield server


@pytest.mark.parametrize("model", MODELS)
def test_a_bad_request_does_not_fail_the_requests_batched_with_it(batching_server, model):
    def send(ids: list[int]) -> str:
        client = httpclient.InferenceServerClient(batching_server.http_url)
        try:
            return str(client.infer(model, token_inputs(httpclient, np.array([ids]))).as_numpy("logits").shape)
        except InferenceServerException as exc:
            return f"{exc.status()} {exc.message()}"

    before = httpclient.InferenceServerClient(batching_server.http_url).get_inference_statistics(model)
    rows = [[101, 7, 102], [101, VOCABULARY + 1, 102], [101, 8, 102], [-5, 5, 102]]  # one shape: one batch
    with concurrent.futures.ThreadPoolExecutor(len(rows)) as pool:
        answers = list(pool.map(send, rows))
    assert answers[0] == answers[2] == "(1, 3)", answers
    assert answers[1].startswith(f"400 input 'input_ids' holds id {VOCABULARY + 1}, outside the vocabulary"), answers
    assert answers[3].startswith("400 input 'input_ids' holds id -5"), answers
    after = httpclient.InferenceServerClient(batching_server.http_url).get_inference_statistics(model)
    executions = after["model_stats"][0]["execution_count"] - before["model_stats"][0].get("execution_count", 0)
    assert executions == 1  # the two good requests ran together; the bad ones never reached the engine
