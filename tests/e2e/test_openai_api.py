"""The OpenAI-compatible API (`/v1/...` on the HTTP port), called with the official `openai` client.

The repository (tests/support/openai_models.py) holds a random-weight GPT-2 with a chat template, converted for
the torch engine (decoupled: `gpt`; not decoupled: `gpt_plain`) and for CTranslate2 (`gpt_ct2`), and the real
all-MiniLM-L6-v2 exported as an embedding ensemble (`minilm`). Greedy answers are compared with transformers'
`generate` on the same folder (chat prompts rendered by `apply_chat_template`), embeddings with
sentence-transformers.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from support import ServerProcess, start_transerve
from support.openai_models import (
    EMBEDDING,
    GENERATORS,
    MODEL_IDS,
    N_POSITIONS,
    Generation,
    GPT2Reference,
    build_chat_gpt2,
    build_repository,
    sentence_embeddings,
)

openai = pytest.importorskip("openai")
pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

#: New tokens most tests ask for: a random model rarely draws its end token this early, so they end by length.
MAX_TOKENS = 24
PROMPT = "Hello world, how are you today?"
PROMPTS = [PROMPT, "The quick brown fox", "Serving transformer models"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
CONVERSATION = [*MESSAGES, {"role": "assistant", "content": "Fine."}, {"role": "user", "content": "And you?"}]
STREAMING = ["gpt", "gpt_ct2"]
#: Korean and emoji prompts: one whose greedy answer is clean text with a character split across tokens is used.
MULTIBYTE_PROMPTS = ["세계 안녕", "안녕하세요 안녕하세요", "세계 🚀", "emoji 반갑습니다", "하세요 🙂 emoji", "안녕 🙂",
                     "반갑습니다 🚀", "🙂 세계"]
EMBEDDING_TEXTS = ["A man is eating food.", "안녕하세요 😀 naïve café", "serving " * 200]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    return build_repository(tmp_path_factory.mktemp("openai"))


def same_text(served: str, expected: Generation) -> bool:
    """The served text is transformers' decode of the same ids; at a length cut the half character that a
    byte-level tokenizer may leave at the end (decoded as U+FFFD) may be held back."""
    return served == expected.text or (expected.finish_reason == "length" and served == expected.text.rstrip("\ufffd"))


def check_error(body: object, status: int, status_expected: int, mentions: str, param: str | None = None) -> None:
    """OpenAI's error object (`{"error": {...}}`, which the client unwraps): message, type, param and code."""
    assert status == status_expected, body
    assert isinstance(body, dict) and {"message", "type", "param", "code"} <= set(body), body
    assert isinstance(body["message"], str) and mentions in body["message"], body
    assert isinstance(body["type"], str) and body["type"], body
    if param is not None:
        assert body["param"] == param, body


def post(server: ServerProcess, path: str, body: object) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(f"{server.base_url}/v1/{path}", data=data, headers={"Content-Type": "application/json"},
                         timeout=60)


def still_serving(server: ServerProcess, client) -> None:
    assert server.alive(), server.log_tail()
    answer = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2


def scrape(server: ServerProcess) -> str:
    answer = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10)
    assert answer.status_code == 200
    return answer.text


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample `name` whose labels include `labels` (0 when there is none)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        sample, value = line.rsplit(" ", 1)
        found = dict(re.findall(r'(\w+)="([^"]*)"', sample[len(name):]))
        if sample.split("{")[0] == name and all(found.get(k) == v for k, v in labels.items()):
            return float(value)
    return 0.0


# /v1/models


def test_models_lists_exactly_what_can_be_called(client):
    """The generators and the embedding ensemble, not the tokenizers, detokenizers, text ensembles or steps."""
    models = client.models.list()
    assert sorted(model.id for model in models.data) == MODEL_IDS
    for model in models.data:
        assert model.object == "model"
        assert isinstance(model.created, int)
        assert isinstance(model.owned_by, str)


def test_a_model_is_retrieved_by_id_and_an_unknown_one_is_a_404(client):
    assert client.models.retrieve("gpt_ct2").id == "gpt_ct2"
    for name in ("nope", "gpt_text", "minilm_tokenizer"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve(name)
        check_error(caught.value.body, caught.value.status_code, 404, name)
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    check_error(caught.value.body, caught.value.status_code, 404, "nope")
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
    check_error(caught.value.body, caught.value.status_code, 404, "nope")


# /v1/completions


@pytest.mark.parametrize("model", list(GENERATORS))
def test_greedy_completion_is_transformers_text_with_exact_usage(client, reference, model):
    expected = reference.complete(PROMPT, MAX_TOKENS)
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       user="alice")
    assert answer.object == "text_completion"
    assert answer.model == model
    (choice,) = answer.choices
    assert choice.index == 0
    assert same_text(choice.text, expected), (choice.text, expected)
    assert choice.finish_reason == expected.finish_reason
    assert answer.usage.prompt_tokens == len(expected.prompt_ids)
    assert answer.usage.completion_tokens == len(expected.ids)
    assert answer.usage.total_tokens == len(expected.prompt_ids) + len(expected.ids)


@pytest.mark.parametrize("model", STREAMING)
def test_prompts_as_a_list_of_strings_and_as_token_ids(client, reference, model):
    expected = [reference.complete(prompt, MAX_TOKENS) for prompt in PROMPTS]
    answer = client.completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    for choice, generation in zip(answer.choices, expected, strict=True):
        assert same_text(choice.text, generation), (choice.text, generation)
    assert answer.usage.prompt_tokens == sum(len(generation.prompt_ids) for generation in expected)
    assert answer.usage.completion_tokens == sum(len(generation.ids) for generation in expected)
    ids = expected[0].prompt_ids
    one = client.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert same_text(one.choices[0].text, expected[0])
    assert one.usage.prompt_tokens == len(ids)
    several = client.completions.create(model=model, prompt=[g.prompt_ids for g in expected[:2]],
                                        max_tokens=MAX_TOKENS, temperature=0)
    assert [same_text(c.text, g) for c, g in zip(several.choices, expected[:2], strict=True)] == [True, True]


def test_echo_puts_the_prompt_before_the_completion(client, reference):
    expected = reference.complete(PROMPT, MAX_TOKENS)
    answer = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, echo=True)
    text = answer.choices[0].text
    assert text.startswith(PROMPT)
    assert same_text(text[len(PROMPT):], expected)
    from_ids = client.completions.create(model="gpt", prompt=expected.prompt_ids, max_tokens=MAX_TOKENS,
                                         temperature=0, echo=True)
    assert from_ids.choices[0].text == text


def test_a_suffix_is_refused(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="gpt", prompt=PROMPT, suffix="the end", max_tokens=4)
    check_error(caught.value.body, caught.value.status_code, 400, "suffix", param="suffix")


# /v1/chat/completions


@pytest.mark.parametrize("model", list(GENERATORS))
@pytest.mark.parametrize("messages", [MESSAGES, CONVERSATION], ids=["system_user", "conversation"])
def test_greedy_chat_is_transformers_text_on_the_templated_prompt(client, reference, model, messages):
    expected = reference.chat(messages, MAX_TOKENS)
    assert expected.prompt_ids[0] == reference.eos  # the template's bos_token, as its one special id
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert answer.object == "chat.completion"
    assert answer.model == model
    (choice,) = answer.choices
    assert choice.message.role == "assistant"
    assert same_text(choice.message.content, expected), (choice.message.content, expected)
    assert choice.finish_reason == expected.finish_reason
    assert answer.usage.prompt_tokens == len(expected.prompt_ids)
    assert answer.usage.completion_tokens == len(expected.ids)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_max_completion_tokens_bounds_a_chat_answer(client, reference):
    expected = reference.chat(MESSAGES, 5)
    answer = client.chat.completions.create(model="gpt", messages=MESSAGES, max_completion_tokens=5, temperature=0)
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 5
    assert same_text(answer.choices[0].message.content, expected)


# Streaming


@pytest.mark.parametrize("model", list(GENERATORS))
def test_streamed_completion_deltas_make_the_whole_answer(client, reference, model):
    """A decoupled generator streams piece by piece; `gpt_plain` (not decoupled) answers in one chunk."""
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    usage = chunks.pop()
    assert usage.choices == [] and usage.usage.model_dump() == whole.usage.model_dump()
    assert all(chunk.object == "text_completion" and chunk.usage is None for chunk in chunks)
    assert len({chunk.id for chunk in [*chunks, usage]}) == 1
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert [chunk.choices[0].finish_reason for chunk in chunks][-1] == whole.choices[0].finish_reason
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks[:-1])
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices[0].text]
    if model == "gpt_plain":
        assert len(texts) == 1
    elif model == "gpt":  # CTranslate2 may decode this tiny model's 24 tokens within one turn of the event loop
        assert len(texts) > 1


@pytest.mark.parametrize("model", list(GENERATORS))
def test_streamed_chat_starts_with_the_role_and_ends_with_the_reason(client, reference, model):
    expected = reference.chat(MESSAGES, MAX_TOKENS)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert same_text(content, expected), (content, expected)
    with_usage = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
    assert with_usage[-1].choices == []
    assert with_usage[-1].usage.prompt_tokens == len(expected.prompt_ids)
    assert with_usage[-1].usage.completion_tokens == len(expected.ids)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in with_usage[:-1]) == content


def multibyte_case(reference: GPT2Reference) -> tuple[str, int, str]:
    """A Korean or emoji prompt and a token count whose greedy text is clean (no U+FFFD) and holds a character
    whose bytes two tokens carry: what a stream must not split."""
    for prompt in MULTIBYTE_PROMPTS:
        ids = reference.complete(prompt, MAX_TOKENS).ids
        for end in range(len(ids), 1, -1):
            text = reference.decode(ids[:end])
            split = any(reference.decode(ids[:cut]).endswith("\ufffd") for cut in range(1, end))
            if "\ufffd" not in text and split and reference.eos not in ids[:end]:
                return prompt, end, text
    raise AssertionError("no prompt of MULTIBYTE_PROMPTS has a clean greedy answer with a split character")


@pytest.mark.parametrize("model", STREAMING)
def test_streamed_deltas_never_split_a_character(client, reference, model):
    prompt, tokens, expected = multibyte_case(reference)
    assert any(len(character.encode()) > 1 for character in expected)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0,
                                            stream=True))
    deltas = [chunk.choices[0].text for chunk in chunks]
    assert not any("\ufffd" in delta for delta in deltas), deltas
    assert "".join(deltas) == expected
    chat = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=tokens, temperature=0, stream=True))
    pieces = [chunk.choices[0].delta.content or "" for chunk in chat]
    whole = reference.chat([{"role": "user", "content": prompt}], tokens).text
    # The chat answer is another continuation: only what is whole in it must come whole.
    assert "".join(pieces) == whole or "".join(pieces) == whole.rstrip("\ufffd")
    if "\ufffd" not in whole:
        assert not any("\ufffd" in piece for piece in pieces), pieces


# Sampling, stop strings, limits


@pytest.mark.parametrize("model", STREAMING)
def test_n_choices_with_a_seed_are_reproducible_and_differ(client, model):
    def sample() -> list[str]:
        answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, n=3, seed=7,
                                           temperature=1)
        assert [choice.index for choice in answer.choices] == [0, 1, 2]
        lengths = [MAX_TOKENS for choice in answer.choices if choice.finish_reason == "length"]
        if len(lengths) == 3:
            assert answer.usage.completion_tokens == 3 * MAX_TOKENS
        return [choice.text for choice in answer.choices]

    first = sample()
    assert sample() == first
    assert len(set(first)) > 1, first
    chat = [client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, n=3, seed=7,
                                           temperature=1) for _ in range(2)]
    texts = [[choice.message.content for choice in answer.choices] for answer in chat]
    assert texts[0] == texts[1]
    assert len(set(texts[0])) > 1


def stop_string(text: str) -> str:
    """Three characters of clean text well inside `text`, whose first occurrence is not at its start."""
    for start in range(3, len(text) - 3):
        candidate = text[start:start + 3]
        if "\ufffd" not in candidate and candidate.strip() and text.index(candidate) > 0:
            return candidate
    raise AssertionError(f"no stop string in {text!r}")


@pytest.mark.parametrize("model", list(GENERATORS))
def test_a_stop_string_cuts_the_text_before_it(client, reference, model):
    text = reference.complete(PROMPT, MAX_TOKENS).text
    stop = stop_string(text)
    expected = text[: text.index(stop)]
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       stop=[stop, "never appears"])
    assert answer.choices[0].text == expected
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens < MAX_TOKENS
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    chat_text = reference.chat(MESSAGES, MAX_TOKENS).text
    chat_stop = stop_string(chat_text)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                          stop=chat_stop)
    assert chat.choices[0].message.content == chat_text[: chat_text.index(chat_stop)]
    assert chat.choices[0].finish_reason == "stop"


# Log-probabilities: the chosen token's and the likeliest ones', from the engines' distribution.


def transformers_log_probs(reference: GPT2Reference, prompt_ids: list[int], ids: list[int]) -> np.ndarray:
    """Each generated token's log-probability under transformers (log_softmax of the raw logits)."""
    import torch

    with torch.no_grad():
        logits = reference.model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1: -1]
    chosen = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(ids)), torch.tensor(ids)]
    return chosen.numpy()


@pytest.mark.parametrize("model", STREAMING)
def test_completion_logprobs_have_one_entry_per_token(client, reference, model):
    expected = reference.complete(PROMPT, MAX_TOKENS)
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    logprobs = answer.choices[0].logprobs
    tokens = answer.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == tokens
    assert len(logprobs.text_offset) == tokens
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: the chosen token is the likeliest
        assert token in top
    np.testing.assert_allclose(logprobs.token_logprobs,
                               transformers_log_probs(reference, expected.prompt_ids, expected.ids), atol=1e-3)


@pytest.mark.parametrize("model", STREAMING)
def test_chat_logprobs_with_top_logprobs(client, reference, model):
    expected = reference.chat(MESSAGES, MAX_TOKENS)
    answer = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == len(expected.ids)
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    assert b"".join(bytes(entry.bytes) for entry in content).decode("utf-8", "replace") == expected.text
    np.testing.assert_allclose([entry.logprob for entry in content],
                               transformers_log_probs(reference, expected.prompt_ids, expected.ids), atol=1e-3)


# /v1/embeddings


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def minilm_tokens(built: tuple[Path, Path], texts: list[str]) -> int:
    """What sentence-transformers feeds MiniLM: [CLS] text [SEP]."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(built[0] / f"{EMBEDDING}_tokenizer" / "1" / "tokenizer.json"))
    tokenizer.no_padding()  # its tokenizer.json pads and truncates to 128: the tokenizer model turns both off
    tokenizer.no_truncation()
    return sum(len(tokenizer.encode(text).ids) for text in texts)


def test_embeddings_equal_sentence_transformers_as_floats_and_base64(server, client, built):
    expected = sentence_embeddings(EMBEDDING_TEXTS)
    answer = client.embeddings.create(model=EMBEDDING, input=EMBEDDING_TEXTS)
    assert answer.object == "list" and answer.model == EMBEDDING
    assert [item.index for item in answer.data] == [0, 1, 2]
    floats = np.array([item.embedding for item in answer.data], dtype=np.float32)
    assert floats.shape == (3, 384)
    assert cosine(floats, expected).min() >= 0.9999
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == minilm_tokens(built, EMBEDDING_TEXTS)
    one = client.embeddings.create(model=EMBEDDING, input=EMBEDDING_TEXTS[0])
    assert len(one.data) == 1
    assert cosine(np.array([one.data[0].embedding]), expected[:1]).min() >= 0.9999
    raw = post(server, "embeddings", {"model": EMBEDDING, "input": EMBEDDING_TEXTS, "encoding_format": "base64"})
    assert raw.status_code == 200, raw.text
    decoded = np.stack([np.frombuffer(base64.b64decode(item["embedding"]), dtype=np.float32)
                        for item in raw.json()["data"]])
    np.testing.assert_array_equal(decoded, floats)
    # The client asks for base64 itself when no format is named and decodes it: the same vectors again.
    assert cosine(np.array([item.embedding for item in client.embeddings.create(
        model=EMBEDDING, input=EMBEDDING_TEXTS, encoding_format="float").data]), expected).min() >= 0.9999


def test_embedding_dimensions_and_too_long_inputs_are_refused_and_models_serve_only_their_own_api(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=EMBEDDING, input="hello", dimensions=64)
    check_error(caught.value.body, caught.value.status_code, 400, "dimensions", param="dimensions")
    with pytest.raises(openai.BadRequestError) as caught:  # MiniLM reads 256 tokens: OpenAI refuses, never cuts
        client.embeddings.create(model=EMBEDDING, input=["hello", "serving " * 300])
    check_error(caught.value.body, caught.value.status_code, 400, "256", param="input")
    for call in (lambda: client.embeddings.create(model="gpt", input="hello"),
                 lambda: client.completions.create(model=EMBEDDING, prompt="hello", max_tokens=2),
                 lambda: client.chat.completions.create(model=EMBEDDING, messages=MESSAGES, max_tokens=2)):
        with pytest.raises(openai.APIStatusError) as caught:
            call()
        assert caught.value.status_code in (400, 404)
        check_error(caught.value.body, caught.value.status_code, caught.value.status_code, "")


# Errors


TOO_LONG = "hello " * (N_POSITIONS + 100)
#: (path, body, the word the message must name, the param OpenAI names, or None where it names none)
BAD_REQUESTS = {
    "negative_max_tokens": ("completions", {"model": "gpt", "prompt": PROMPT, "max_tokens": -1}, "max_tokens",
                            "max_tokens"),
    "chat_negative_max_tokens": ("chat/completions", {"model": "gpt", "messages": MESSAGES, "max_tokens": -1},
                                 "max_tokens", "max_tokens"),
    "temperature_5": ("completions", {"model": "gpt", "prompt": PROMPT, "temperature": 5}, "temperature",
                      "temperature"),
    "top_p_2": ("chat/completions", {"model": "gpt", "messages": MESSAGES, "top_p": 2}, "top_p", "top_p"),
    "n_0": ("completions", {"model": "gpt", "prompt": PROMPT, "n": 0}, "n", "n"),
    "presence_penalty": ("completions", {"model": "gpt", "prompt": PROMPT, "presence_penalty": 0.5},
                         "presence_penalty", "presence_penalty"),
    "frequency_penalty": ("chat/completions", {"model": "gpt", "messages": MESSAGES, "frequency_penalty": 0.5},
                          "frequency_penalty", "frequency_penalty"),
    "unknown_role": ("chat/completions", {"model": "gpt", "messages": [{"role": "wizard", "content": "hi"}]},
                     "wizard", None),
    "empty_messages": ("chat/completions", {"model": "gpt", "messages": []}, "messages", "messages"),
    "prompt_too_long": ("completions", {"model": "gpt_ct2", "prompt": TOO_LONG, "max_tokens": 4}, "", None),
    "chat_too_long": ("chat/completions", {"model": "gpt",
                                           "messages": [{"role": "user", "content": TOO_LONG}]}, "", None),
    "empty_prompt_list": ("completions", {"model": "gpt", "prompt": []}, "prompt", "prompt"),
    "max_tokens_text": ("completions", {"model": "gpt", "prompt": PROMPT, "max_tokens": "ten"}, "max_tokens",
                        "max_tokens"),
    "messages_text": ("chat/completions", {"model": "gpt", "messages": "hello"}, "messages", "messages"),
    "prompt_object": ("completions", {"model": "gpt", "prompt": {"text": "hi"}}, "prompt", "prompt"),
    "prompt_negative_id": ("completions", {"model": "gpt", "prompt": [1, -5]}, "prompt", None),
    "model_number": ("completions", {"model": 5, "prompt": PROMPT}, "model", "model"),
    "no_model": ("chat/completions", {"messages": MESSAGES}, "model", "model"),
    "content_number": ("chat/completions", {"model": "gpt", "messages": [{"role": "user", "content": 5}]},
                       "content", None),
    "stream_options_without_stream": ("completions", {"model": "gpt", "prompt": PROMPT,
                                                      "stream_options": {"include_usage": True}},
                                      "stream_options", "stream_options"),
    "embedding_input_number": ("embeddings", {"model": EMBEDDING, "input": 3.5}, "input", "input"),
    "embedding_empty_input": ("embeddings", {"model": EMBEDDING, "input": []}, "input", "input"),
    "encoding_format": ("embeddings", {"model": EMBEDDING, "input": "x", "encoding_format": "int8"},
                        "encoding_format", "encoding_format"),
    "body_a_list": ("completions", [1, 2, 3], "", None),
    # Refused before they are tokenized or decoded: a huge text or id list never stalls the server.
    "huge_prompt": ("completions", {"model": "gpt", "prompt": "hello " * 700_000, "max_tokens": 4}, "characters",
                    "prompt"),
    "huge_id_prompt": ("completions", {"model": "gpt", "prompt": [1] * 500_000, "max_tokens": 4}, "tokens",
                       "prompt"),
    "huge_chat": ("chat/completions", {"model": "gpt", "messages": [{"role": "user", "content": "hi " * 300}] * 4096},
                  "characters", "messages"),
    "huge_embedding_input": ("embeddings", {"model": EMBEDDING, "input": ["x", "serving " * 350_000]}, "characters",
                             "input"),
    "chat_template_kwargs_messages": ("chat/completions", {"model": "gpt", "messages": MESSAGES,
                                                           "chat_template_kwargs": {"messages": []}},
                                      "chat_template_kwargs", "chat_template_kwargs"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_are_openai_400s_and_the_server_keeps_serving(server, client, case):
    path, body, mentions, param = BAD_REQUESTS[case]
    answer = post(server, path, body)
    assert answer.headers["content-type"].startswith("application/json"), answer.text
    check_error(answer.json().get("error"), answer.status_code, 400, mentions, param)
    if case.endswith("too_long"):
        assert re.search(rf"\b{N_POSITIONS}\b|\b{N_POSITIONS - 1}\b", answer.json()["error"]["message"]), answer.text
    still_serving(server, client)


def test_malformed_json_is_a_400_and_the_server_keeps_serving(server, client):
    for path in ("completions", "chat/completions", "embeddings"):
        answer = post(server, path, b'{"model": "gpt", "prompt": "hi"')
        check_error(answer.json().get("error"), answer.status_code, 400, "")
    still_serving(server, client)


def test_the_client_sees_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="gpt", prompt=PROMPT, presence_penalty=0.5, max_tokens=2)
    check_error(caught.value.body, caught.value.status_code, 400, "presence_penalty", param="presence_penalty")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="gpt", messages=[], max_tokens=2)
    check_error(caught.value.body, caught.value.status_code, 400, "messages")


def test_a_model_without_a_chat_template_refuses_chat_and_completes(tmp_path):
    folder = build_chat_gpt2(tmp_path / "hf")
    (folder / "chat_template.jinja").unlink()
    from transerve.convert.command import convert

    convert(folder, tmp_path / "repo", engine="ctranslate2", name="plain")
    with start_transerve(tmp_path / "repo") as server, \
            openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="plain", messages=MESSAGES, max_tokens=2)
        check_error(caught.value.body, caught.value.status_code, 400, "template")
        assert client.completions.create(model="plain", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_a_text_model_opts_in_through_its_config_parameters(tmp_path, reference):
    """A convert's text ensemble (text_input -> text_output) named in the config as a completions model; its
    generator opted out. The prompt goes as text, the answer comes back as text, usage counted with the tokenizer
    its first step holds."""
    folder = build_chat_gpt2(tmp_path / "hf")
    from transerve.convert.command import convert

    convert(folder, tmp_path / "repo", engine="ctranslate2", name="txt")
    with (tmp_path / "repo" / "txt_text" / "config.pbtxt").open("a") as config:
        for key, value in (("openai_api", "completions"), ("openai_text_input", "text_input"),
                           ("openai_text_output", "text_output")):
            config.write(f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n')
    with (tmp_path / "repo" / "txt" / "config.pbtxt").open("a") as config:
        config.write('parameters { key: "openai_api" value { string_value: "none" } }\n')
    expected = reference.complete(PROMPT, 8)
    with start_transerve(tmp_path / "repo") as server, \
            openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        assert [model.id for model in client.models.list().data] == ["txt_text"]
        answer = client.completions.create(model="txt_text", prompt=PROMPT, max_tokens=8, temperature=0)
        assert same_text(answer.choices[0].text, expected), (answer.choices[0].text, expected)
        assert answer.usage.prompt_tokens == len(expected.prompt_ids)
        streamed = client.completions.create(model="txt_text", prompt=PROMPT, max_tokens=8, temperature=0,
                                             stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == answer.choices[0].text
        with pytest.raises(openai.BadRequestError) as caught:  # the tokenizer step has no chat template
            client.chat.completions.create(model="txt_text", messages=MESSAGES, max_tokens=2)
        check_error(caught.value.body, caught.value.status_code, 400, "template")
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="txt_text", prompt=[1, 2, 3], max_tokens=2)
        check_error(caught.value.body, caught.value.status_code, 400, "text prompts", "prompt")


def test_restricted_api_groups_guard_the_openai_routes(built):
    """`--http-restricted-api`: model listing is the metadata group, completions and embeddings inference."""
    with start_transerve(built[0], "--http-restricted-api=inference:key=secret") as server:
        url = f"{server.base_url}/v1"
        assert requests.get(f"{url}/models", timeout=30).status_code == 200
        for path, body in (("completions", {"model": "gpt", "prompt": PROMPT, "max_tokens": 2}),
                           ("embeddings", {"model": EMBEDDING, "input": PROMPT})):
            refused = requests.post(f"{url}/{path}", json=body, timeout=30)
            check_error(refused.json()["error"], refused.status_code, 403, "restricted")
            allowed = requests.post(f"{url}/{path}", json=body, headers={"key": "secret"}, timeout=60)
            assert allowed.status_code == 200, allowed.text
    with start_transerve(built[0], "--http-restricted-api=metadata:key=secret") as server:
        refused = requests.get(f"{server.base_url}/v1/models", timeout=30)
        check_error(refused.json()["error"], refused.status_code, 403, "restricted")


# Cancellation, metrics, statistics


def ended_requests(server: ServerProcess, model: str) -> int:
    """The model's requests that have ended, as its statistics count them (succeeded or failed)."""
    answer = requests.get(f"{server.base_url}/v2/models/{model}/stats", timeout=10)
    assert answer.status_code == 200
    stats = answer.json()["model_stats"][0]["inference_stats"]
    return stats["success"]["count"] + stats["fail"]["count"]


def test_a_client_that_goes_away_mid_stream_cancels_its_sequence(server):
    """A stream asked for ~2000 tokens (min_tokens: no early end) is dropped after its first chunks: the model's
    statistics count the request as ended long before those tokens could have been decoded. The torch engine
    only: CTranslate2 decodes this tiny model's 2000 tokens in well under a second, too fast to tell."""
    long, probe = N_POSITIONS - 48, 100
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        started = time.monotonic()
        client.completions.create(model="gpt", prompt=PROMPT, max_tokens=probe, temperature=0,
                                  extra_body={"min_tokens": probe})
        per_token = (time.monotonic() - started) / probe  # an underestimate: later tokens attend to more
        before = ended_requests(server, "gpt")
        stream = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=long, temperature=0, stream=True,
                                           extra_body={"min_tokens": long})
        received = [chunk for _, chunk in zip(range(3), stream, strict=False)]
        assert len(received) == 3
        dropped = time.monotonic()
        stream.close()
    budget = 0.25 * long * per_token
    while ended_requests(server, "gpt") == before:
        assert time.monotonic() - dropped < budget, f"not ended {budget:.1f} s after the client went away"
        time.sleep(0.02)
    assert server.alive()


def test_token_timing_histograms_and_statistics_count_the_requests(server, client):
    def successes() -> int:
        answer = requests.get(f"{server.base_url}/v2/models/gpt/stats", timeout=10)
        assert answer.status_code == 200
        return answer.json()["model_stats"][0]["inference_stats"]["success"]["count"]

    before = successes()
    client.completions.create(model="gpt", prompt=PROMPT, max_tokens=8, temperature=0)
    list(client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=8, temperature=0, stream=True))
    assert successes() == before + 2
    text = scrape(server)
    for name in ("transerve_time_to_first_token_seconds", "transerve_time_per_output_token_seconds"):
        assert f"# TYPE {name} histogram" in text
        count = metric(text, f"{name}_count", model="gpt")
        assert count >= 2
        assert metric(text, f"{name}_bucket", model="gpt", le="+Inf") == count
        assert metric(text, f"{name}_sum", model="gpt") > 0


# The async client


def test_async_client_requests_at_once_each_get_their_own_answer(server, reference):
    expected = [reference.complete(prompt, MAX_TOKENS) for prompt in PROMPTS]

    async def run() -> tuple[list[str], str]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                                      timeout=120) as client:
            answers = await asyncio.gather(*(
                client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
                for prompt in PROMPTS for model in STREAMING))
            stream = await client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                          temperature=0, stream=True)
            streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
        return [answer.choices[0].text for answer in answers], streamed

    texts, streamed = asyncio.run(run())
    for index, text in enumerate(texts):
        assert same_text(text, expected[index // len(STREAMING)]), (index, text)
    assert same_text(streamed, reference.chat(MESSAGES, MAX_TOKENS))
