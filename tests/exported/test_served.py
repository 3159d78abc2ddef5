"""Exported repositories served by transerve, answers checked against the libraries the models come from:
sentence-transformers for the real MiniLM, transformers for the small random models."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support.hf_models import LABELS

TEXTS = [
    "A man is eating food.",
    "The new movie is awesome, everyone should see it at least twice this year.",
    "안녕하세요 😀 naïve café",
    "",
    "serving " * 300,  # longer than MiniLM's 256 tokens: truncated as sentence-transformers truncates
]
CONTEXT = ("transerve is an inference server written in Python. It serves Triton model repositories over HTTP and "
           "gRPC, and it exports Hugging Face models to ONNX or TorchScript.")
QUESTIONS = ["What does transerve serve?", "Which formats does it export to?", "What is it written in?"]


def texts_input(module: object, name: str, texts: list[str]) -> object:
    tensor = module.InferInput(name, [len(texts), 1], "BYTES")  # type: ignore[attr-defined]
    tensor.set_data_from_numpy(np.array([[text.encode()] for text in texts], dtype=object))
    return tensor


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def sentence_transformer(model_folders: dict[str, Path]) -> object:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    return sentence_transformers.SentenceTransformer(str(model_folders["minilm"]), device="cpu")


@pytest.mark.parametrize("model", ["minilm_onnx", "minilm_ts"])
def test_minilm_embeddings_match_sentence_transformers(exported_server, sentence_transformer, model):
    expected = sentence_transformer.encode(TEXTS, convert_to_numpy=True)
    client = httpclient.InferenceServerClient(exported_server.http_url)
    together = client.infer(model, [texts_input(httpclient, "input_text", TEXTS)]).as_numpy("embedding")
    assert together.shape == (len(TEXTS), 384)
    assert cosine(together, expected).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, rtol=1e-5)
    # One request per sentence, all at once: the model batches them (bucketed for ONNX), padding and trimming.
    with concurrent.futures.ThreadPoolExecutor(len(TEXTS)) as pool:
        alone = list(pool.map(
            lambda text: httpclient.InferenceServerClient(exported_server.http_url)
            .infer(model, [texts_input(httpclient, "input_text", [text])]).as_numpy("embedding")[0], TEXTS))
    assert cosine(np.stack(alone), expected).min() >= 0.9999


def transformers_model(folder: Path, auto_class: str) -> tuple[object, object]:
    import transformers

    model = getattr(transformers, auto_class).from_pretrained(str(folder)).eval()
    return transformers.AutoTokenizer.from_pretrained(str(folder)), model


@pytest.mark.parametrize("model", ["seqcls_onnx", "seqcls_ts"])
def test_sequence_classification_matches_transformers(exported_server, model_folders, model):
    import torch

    tokenizer, reference = transformers_model(model_folders["seqcls"], "AutoModelForSequenceClassification")
    with torch.no_grad():
        logits = np.concatenate([reference(**tokenizer(t, truncation=True, max_length=128, return_tensors="pt"))
                                 .logits.numpy() for t in TEXTS])
    expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    result = httpclient.InferenceServerClient(exported_server.http_url).infer(
        model, [texts_input(httpclient, "input_text", TEXTS)])
    np.testing.assert_allclose(result.as_numpy("probabilities"), expected, atol=1e-5)
    assert [label.decode() for label in result.as_numpy("label").reshape(-1)] == [LABELS[i] for i in
                                                                                 expected.argmax(axis=1)]
    np.testing.assert_allclose(result.as_numpy("score").reshape(-1), expected.max(axis=1), atol=1e-5)
    ranked = httpclient.InferenceServerClient(exported_server.http_url).infer(
        model, [texts_input(httpclient, "input_text", TEXTS)],
        outputs=[httpclient.InferRequestedOutput("probabilities", class_count=2)]).as_numpy("probabilities")
    for row, probabilities in zip(ranked.tolist(), expected, strict=True):  # "probability:index:label", likeliest first
        order = np.argsort(-probabilities, kind="stable")[:2]
        assert [entry.decode().split(":", 1)[1] for entry in row] == [f"{i}:{LABELS[i]}" for i in order]
        np.testing.assert_allclose([float(entry.decode().split(":")[0]) for entry in row], probabilities[order],
                                   atol=1e-5)


def reference_answer(tokenizer: object, reference: object, question: str, context: str) -> tuple[str, float]:
    """The best span by a plain double loop over context tokens, from the transformers model's logits."""
    import torch

    encoded = tokenizer(question, context, truncation="only_second", max_length=128, return_offsets_mapping=True,
                        return_tensors="pt")
    offsets = encoded.pop("offset_mapping")[0].tolist()
    context_tokens = [i for i, sequence in enumerate(encoded.sequence_ids(0)) if sequence == 1]
    with torch.no_grad():
        output = reference(**encoded)
    starts = torch.softmax(output.start_logits[0, context_tokens], dim=0).tolist()
    ends = torch.softmax(output.end_logits[0, context_tokens], dim=0).tolist()
    best = (-1.0, 0, 0)
    for i in range(len(context_tokens)):
        for j in range(i, min(i + 30, len(context_tokens))):
            best = max(best, (starts[i] * ends[j], i, j))
    score, i, j = best
    return context[offsets[context_tokens[i]][0]:offsets[context_tokens[j]][1]], score


@pytest.mark.parametrize("model", ["qa_onnx", "qa_ts"])
def test_question_answering_matches_transformers(exported_server, model_folders, model):
    tokenizer, reference = transformers_model(model_folders["qa"], "AutoModelForQuestionAnswering")
    expected = [reference_answer(tokenizer, reference, question, CONTEXT) for question in QUESTIONS]
    client = grpcclient.InferenceServerClient(exported_server.grpc_url)
    result = client.infer(model, [texts_input(grpcclient, "question", QUESTIONS),
                                  texts_input(grpcclient, "context", [CONTEXT] * len(QUESTIONS))])
    answers = [answer.decode() for answer in result.as_numpy("answer").reshape(-1)]
    assert answers == [answer for answer, _ in expected]
    np.testing.assert_allclose(result.as_numpy("score").reshape(-1), [score for _, score in expected], rtol=1e-4)
    for answer, start, end in zip(answers, result.as_numpy("start").reshape(-1), result.as_numpy("end").reshape(-1),
                                  strict=True):
        assert CONTEXT[start:end] == answer


@pytest.mark.parametrize("model", ["encode_onnx", "encode_ts"])
def test_token_states_match_transformers_for_a_model_without_token_types(exported_server, model_folders, model):
    import torch

    tokenizer, reference = transformers_model(model_folders["encode"], "AutoModel")
    texts = TEXTS[:3]
    result = httpclient.InferenceServerClient(exported_server.http_url).infer(
        model, [texts_input(httpclient, "input_text", texts)])
    states, mask = result.as_numpy("last_hidden_state"), result.as_numpy("attention_mask")
    for row, text in enumerate(texts):
        with torch.no_grad():
            expected = reference(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].numpy()
        assert int(mask[row].sum()) == len(expected)
        np.testing.assert_allclose(states[row, :len(expected)], expected, atol=1e-4)
    config = requests.get(f"{exported_server.base_url}/v2/models/{model}_model/config", timeout=10).json()
    assert [tensor["name"] for tensor in config["input"]] == ["input_ids", "attention_mask"]


def test_the_seed_tutorials_curl_json_and_metadata(exported_server):
    body = {"inputs": [{"name": "input_text", "shape": [2, 1], "datatype": "BYTES",
                        "data": [["I love this server"], ["this is terrible"]]}]}
    answer = requests.post(f"{exported_server.base_url}/v2/models/minilm_onnx/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    (output,) = answer.json()["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("embedding", "FP32", [2, 384])
    answer = requests.post(f"{exported_server.base_url}/v2/models/seqcls_ts/infer", json=body, timeout=30).json()
    labels = {output["name"]: output for output in answer["outputs"]}["label"]
    assert labels["datatype"] == "BYTES" and set(np.ravel(labels["data"])) <= set(LABELS)
    metadata = requests.get(f"{exported_server.base_url}/v2/models/qa_onnx", timeout=10).json()
    assert metadata["platform"] == "ensemble"
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [
        ("question", "BYTES", [-1, 1]), ("context", "BYTES", [-1, 1])]
    assert [t["name"] for t in metadata["outputs"]] == ["answer", "score", "start", "end", "start_logits",
                                                        "end_logits"]


def test_bad_input_is_refused_and_the_server_keeps_serving(exported_server):
    url = f"{exported_server.base_url}/v2/models"
    wrong_type = {"inputs": [{"name": "input_text", "shape": [1, 1], "datatype": "INT32", "data": [[1]]}]}
    answer = requests.post(f"{url}/minilm_onnx/infer", json=wrong_type, timeout=30)
    assert answer.status_code == 400 and "expects 'BYTES'" in answer.json()["error"]
    wrong_shape = {"inputs": [{"name": "input_text", "shape": [1, 2], "datatype": "BYTES", "data": [["a", "b"]]}]}
    assert requests.post(f"{url}/minilm_onnx/infer", json=wrong_shape, timeout=30).status_code == 400
    client = httpclient.InferenceServerClient(exported_server.http_url)
    not_utf8 = httpclient.InferInput("input_text", [1, 1], "BYTES")
    not_utf8.set_data_from_numpy(np.array([[b"\xff\xfe"]], dtype=object))
    with pytest.raises(Exception, match="not UTF-8"):
        client.infer("seqcls_onnx", [not_utf8])
    long_question = [texts_input(httpclient, "question", ["why " * 200]), texts_input(httpclient, "context", ["x"])]
    with pytest.raises(Exception, match="cannot tokenize"):
        client.infer("qa_ts", long_question)
    assert client.infer("seqcls_onnx", [texts_input(httpclient, "input_text", ["fine"])]).as_numpy("label").size == 1
