"""Token ids outside a generation model's vocabulary, end to end, on the torch and CTranslate2 engines: sent as
FasterTransformer's `input_ids` tensor (tritonclient, HTTP and gRPC), as `/v2/models/.../generate` token inputs,
and as OpenAI token-id prompts, each is a 400 naming the input and the range `[0, V)`, refused before the row
reaches the engine's running batch: a request decoding beside them is answered in full, and the model serves on.

The repository is `transerve convert`'s, from a random-weight GPT-2 (with a chat template, so that the OpenAI API
lists it) and T5, for both engines.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import requests
from support import start_transerve
from support.generation_models import build_generation_model
from support.openai_models import build_chat_gpt2

transformers = pytest.importorskip("transformers")
pytest.importorskip("ctranslate2")
openai = pytest.importorskip("openai")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

#: generator name -> (architecture, engine)
MODELS = {"gpt": ("gpt2", "torch"), "gpt_ct2": ("gpt2", "ctranslate2"), "t5": ("t5", "torch"),
          "t5_ct2": ("t5", "ctranslate2")}
#: New tokens of the request that decodes beside the refused ones: long enough to be running while they arrive.
BESIDE_TOKENS = 48


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transerve.convert.command import convert

    root = tmp_path_factory.mktemp("token_ids")
    folders = {"gpt2": build_chat_gpt2(root / "gpt2"), "t5": build_generation_model("t5", root / "t5")}
    repository = root / "repository"
    for name, (architecture, engine) in MODELS.items():
        convert(folders[architecture], repository, engine=engine, name=name, max_batch_size=8)
    vocabulary = {name: transformers.AutoConfig.from_pretrained(folders[architecture]).vocab_size
                  for name, (architecture, _) in MODELS.items()}
    with start_transerve(repository) as server:
        yield server, vocabulary


def _bad_ids(vocabulary: int) -> list[int]:
    """The first id past the table, the largest UINT32, and a random one in between."""
    return [vocabulary, 2**32 - 1, int(np.random.default_rng(vocabulary).integers(vocabulary + 1, 2**31))]


def _says(name: str, token: int, vocabulary: int) -> str:
    return f"input '{name}' holds token id {token}, outside this model's vocabulary [0, {vocabulary})"


def _beside(server, model: str) -> tuple[threading.Thread, list[requests.Response]]:
    """A good /generate request, decoding while the bad ones arrive."""
    answers: list[requests.Response] = []
    body = {"input_ids": [5, 6, 7], "sequence_length": 3, "max_tokens": BESIDE_TOKENS}
    thread = threading.Thread(target=lambda: answers.append(
        requests.post(f"{server.base_url}/v2/models/{model}/generate", json=body, timeout=120)))
    thread.start()
    return thread, answers


@pytest.mark.parametrize("model", list(MODELS))
def test_generate_token_inputs_outside_the_vocabulary_are_a_400(served, model):
    server, vocabulary = served
    thread, answers = _beside(server, model)
    for token in _bad_ids(vocabulary[model]):
        body = {"input_ids": [5, token, 7], "sequence_length": 3, "max_tokens": 4}
        answer = requests.post(f"{server.base_url}/v2/models/{model}/generate", json=body, timeout=60)
        assert answer.status_code == 400, answer.text
        assert _says("input_ids", token, vocabulary[model]) in answer.json()["error"]
    thread.join(120)
    (beside,) = answers
    assert beside.status_code == 200, beside.text
    assert len(beside.json()["output_ids"]) > 3


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("protocol", [httpclient, grpcclient])
def test_tensor_ids_outside_the_vocabulary_are_a_400(served, model, protocol):
    """A bad second row fails its request, named by its row."""
    server, vocabulary = served
    url = f"127.0.0.1:{server.http_port if protocol is httpclient else server.grpc_port}"
    thread, answers = _beside(server, model)
    for ids, token in [(np.array([[5, t, 7]], np.uint32), t) for t in _bad_ids(vocabulary[model])] + [
        (np.array([[5, 6, 7], [5, vocabulary[model], 7]], np.uint32), vocabulary[model]),
    ]:
        tensors = []
        for name, array in (("input_ids", ids), ("sequence_length", np.full([len(ids), 1], 3, np.uint32))):
            tensor = protocol.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        with protocol.InferenceServerClient(url) as client, pytest.raises(InferenceServerException) as caught:
            client.infer(model, tensors)
        assert caught.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        where = "row 1: " if len(ids) > 1 else ""
        assert where + _says("input_ids", token, vocabulary[model]) in caught.value.message()
    thread.join(120)
    assert answers[0].status_code == 200, answers[0].text


@pytest.mark.parametrize("model", ["gpt", "gpt_ct2"])
def test_openai_token_id_prompts_outside_the_vocabulary_are_a_400(served, model):
    server, vocabulary = served
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        thread, answers = _beside(server, model)
        for token in _bad_ids(vocabulary[model]):
            with pytest.raises(openai.BadRequestError) as caught:
                client.completions.create(model=model, prompt=[5, token, 7], max_tokens=4)
            assert f"[0, {vocabulary[model]})" in str(caught.value) and "prompt" in str(caught.value)
        thread.join(120)
        assert answers[0].status_code == 200, answers[0].text
        answer = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=4)
        assert answer.usage.completion_tokens >= 1


def test_the_served_ids_are_checked_against_the_models_own_table(served):
    """The range is the engine's: a model's vocabulary, not a fixed bound (each model names its own V)."""
    server, vocabulary = served
    for model in MODELS:
        top = vocabulary[model] - 1
        body = {"input_ids": [5, top, 7], "sequence_length": 3, "max_tokens": 2}
        answer = requests.post(f"{server.base_url}/v2/models/{model}/generate", json=body, timeout=60)
        assert answer.status_code == 200, (model, answer.text)
