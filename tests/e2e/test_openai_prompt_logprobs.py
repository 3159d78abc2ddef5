"""The prompt's log-probabilities over the OpenAI API, as lm-evaluation-harness and vLLM's users ask for them:
completions' `echo` with `logprobs` (OpenAI's legacy object, the prompt's tokens first, the first one null),
`max_tokens: 0` to score without generating, and vLLM's `prompt_logprobs` on completions and chat; and
`prompt_logprobs` as a /v2 request parameter with its output tensors.

The repository: the random-weight GPT-2 of tests/support/openai_models.py converted for the torch engine
(decoupled and not) and CTranslate2, and a random T5 (an encoder-decoder model, which scores no prompt). The
reference is transformers' log-softmax of the same GPT-2 over the same ids, within 1e-4 (float32).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import requests
from support import ServerProcess
from support.openai_models import GPT2Reference, build_chat_gpt2

openai = pytest.importorskip("openai")
pytest.importorskip("ctranslate2")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

GENERATORS = {"gpt": ("torch", True), "gpt_plain": ("torch", False), "gpt_ct2": ("ctranslate2", True)}
TEXT = "The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "user", "content": "Hello world, how are you today?"}]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    from support.generation_models import build_generation_model

    from transerve.convert.command import convert

    root = tmp_path_factory.mktemp("prompt_logprobs")
    folder = build_chat_gpt2(root / "gpt2")
    repository = root / "repository"
    for name, (engine, decoupled) in GENERATORS.items():
        convert(folder, repository, engine=engine, name=name, max_batch_size=8, decoupled=decoupled)
    convert(build_generation_model("t5", root / "t5"), repository, engine="torch", name="t5", max_batch_size=8)
    with open(repository / "t5" / "config.pbtxt", "a") as config:  # declared, so that the engine is what refuses
        config.write('output {\n  name: "prompt_log_probs"\n  data_type: TYPE_FP32\n  dims: [-1]\n}\n')
    return repository, folder


def log_softmax(reference: GPT2Reference, ids: list[int]) -> np.ndarray:
    """transformers' log-softmax at every position of `ids` ([len(ids), vocabulary], float32)."""
    with torch.no_grad():
        logits = reference.model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).numpy()


def post(server: ServerProcess, path: str, body: dict) -> requests.Response:
    return requests.post(f"{server.base_url}/v1/{path}", json=body, timeout=60)


@pytest.mark.parametrize("model", sorted(GENERATORS))
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, reference, model, max_tokens):
    """lm-eval's loglikelihood request: token ids, `echo`, `logprobs`, `max_tokens` 1 (or 0). Every prompt token
    after the first has transformers' log-probability given the tokens before it, the top maps transformers'
    likeliest tokens, the first token null; `max_tokens` 0 generates nothing."""
    ids = reference.ids(TEXT)
    expected = log_softmax(reference, ids)
    answer = client.completions.create(model=model, prompt=ids, echo=True, logprobs=3, max_tokens=max_tokens,
                                       temperature=0, extra_body={"return_tokens_as_token_ids": True})
    choice = answer.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + max_tokens == len(logprobs.token_logprobs)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, len(ids)):
        assert abs(logprobs.token_logprobs[position] - expected[position - 1, ids[position]]) < TOLERANCE
        best = np.argsort(-expected[position - 1])[:3]
        top = logprobs.top_logprobs[position]
        for token_id in best:
            assert abs(top[f"token_id:{token_id}"] - expected[position - 1, token_id]) < TOLERANCE, top
    assert logprobs.tokens[:len(ids)] == [f"token_id:{token_id}" for token_id in ids]
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert choice.text.startswith(reference.decode(ids)) and choice.finish_reason == "length"
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == max_tokens
    if max_tokens:  # the generated token: greedy, with its own log-probability after the prompt's
        generated = int(np.argmax(expected[-1]))
        assert logprobs.tokens[-1] == f"token_id:{generated}"
        assert abs(logprobs.token_logprobs[-1] - expected[-1, generated]) < TOLERANCE


@pytest.mark.parametrize("model", ["gpt", "gpt_ct2"])
def test_vllm_prompt_logprobs_on_completions(server, reference, model):
    """vLLM's `prompt_logprobs` on a choice: null first, then per token a map from token id to its log-probability,
    rank and text, with the prompt's own token and the likeliest ones; the completion is the usual one."""
    ids = reference.ids(TEXT)
    expected = log_softmax(reference, ids)
    response = post(server, "completions", {"model": model, "prompt": TEXT, "max_tokens": 2, "temperature": 0,
                                            "prompt_logprobs": 2})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for position in range(1, len(ids)):
        entry = scored[position]
        own = entry[str(ids[position])]
        assert abs(own["logprob"] - expected[position - 1, ids[position]]) < TOLERANCE
        assert own["rank"] == int((expected[position - 1] > expected[position - 1, ids[position]]).sum()) + 1
        assert own["decoded_token"] == reference.tokenizer.decode([ids[position]])
        best = np.argsort(-expected[position - 1])[:2]
        for rank, token_id in enumerate(best, start=1):
            assert entry[str(int(token_id))]["rank"] == rank
            assert abs(entry[str(int(token_id))]["logprob"] - expected[position - 1, token_id]) < TOLERANCE
        assert len(entry) <= 3
    assert choice["text"] == reference.complete(TEXT, 2).text.rstrip("\ufffd") or choice["text"] == \
        reference.complete(TEXT, 2).text
    assert choice["logprobs"] is None


def test_vllm_prompt_logprobs_on_chat_score_the_rendered_prompt(server, reference):
    """Chat: one `prompt_logprobs` list beside the choices, over the prompt the chat template rendered."""
    ids = reference.chat_ids(MESSAGES)
    expected = log_softmax(reference, ids)
    response = post(server, "chat/completions", {"model": "gpt", "messages": MESSAGES, "max_tokens": 2,
                                                 "temperature": 0, "prompt_logprobs": 0, "n": 2})
    assert response.status_code == 200, response.text
    document = response.json()
    scored = document["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    values = [scored[position][str(ids[position])]["logprob"] for position in range(1, len(ids))]
    assert np.allclose(values, [expected[p - 1, ids[p]] for p in range(1, len(ids))], atol=TOLERANCE)
    assert len(document["choices"]) == 2


def test_v2_generate_parameters_and_outputs(server, reference):
    """/v2: `prompt_logprobs` as a request parameter; `prompt_log_probs` and `prompt_ranks` [batch, L - 1] and the
    top tensors [batch, L - 1, k] come back, with `max_new_tokens` 0 the prompt as the output ids."""
    import tritonclient.http as httpclient

    ids = reference.ids(TEXT)
    expected = log_softmax(reference, ids)
    with httpclient.InferenceServerClient(server.http_url) as triton:
        inputs = [httpclient.InferInput("input_ids", [1, len(ids)], "UINT32"),
                  httpclient.InferInput("sequence_length", [1, 1], "UINT32")]
        inputs[0].set_data_from_numpy(np.array([ids], np.uint32))
        inputs[1].set_data_from_numpy(np.array([[len(ids)]], np.uint32))
        names = ["output_ids", "prompt_log_probs", "prompt_top_ids", "prompt_top_log_probs", "prompt_ranks"]
        result = triton.infer("gpt_plain", inputs, parameters={"prompt_logprobs": 2, "max_new_tokens": 0},
                              outputs=[httpclient.InferRequestedOutput(name) for name in names])
    scores = result.as_numpy("prompt_log_probs")
    assert scores.shape == (1, len(ids) - 1)
    assert np.allclose(scores[0], [expected[p - 1, ids[p]] for p in range(1, len(ids))], atol=TOLERANCE)
    top_ids, top_values = result.as_numpy("prompt_top_ids"), result.as_numpy("prompt_top_log_probs")
    assert top_ids.shape == top_values.shape == (1, len(ids) - 1, 2)
    assert (top_ids[0] == np.argsort(-expected[:-1], axis=-1)[:, :2]).all()
    ranks = [int((expected[p - 1] > expected[p - 1, ids[p]]).sum()) + 1 for p in range(1, len(ids))]
    assert result.as_numpy("prompt_ranks").tolist() == [ranks]
    assert result.as_numpy("output_ids").reshape(-1).tolist() == ids


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"model": "t5", "prompt_logprobs": 0}, None),
    ({"model": "t5", "echo": True, "logprobs": 0, "max_tokens": 0}, None),
    ({"model": "t5", "echo": True, "logprobs": 1}, "echo"),  # no top outputs declared: refused before the model
])
def test_refused_with_a_400_naming_the_field(server, client, body, param):
    response = post(server, "completions", {"model": "gpt", "prompt": TEXT, "max_tokens": 1, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    else:  # an encoder-decoder model: its engine refuses
        assert "decoder-only" in error["message"], error
    assert client.completions.create(model="gpt", prompt=TEXT, max_tokens=1).usage.completion_tokens == 1
