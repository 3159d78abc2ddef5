"""vLLM's side of the OpenAI API, called with the official `openai` client (and `requests` for vLLM's own routes):
the request fields transerve honours, refuses or accepts as metadata, vLLM's service routes (`/health`,
`/tokenize`, `/detokenize`, `/version`), `x-request-id` and `Retry-After`, vLLM's metric names, and embeddings from
token ids, truncated, or cut to fewer dimensions.

The repository: the random-weight GPT-2 of tests/support/openai_models.py with a template that also reads
`documents` and a `chat_template_kwargs` variable, converted for the torch engine and CTranslate2; the real
all-MiniLM-L6-v2 exported as an embedding ensemble that allows Matryoshka cuts; and a generator whose load fails
(a model the server has but cannot serve: 503). References are transformers (greedy `generate`, the tokenizer,
`apply_chat_template`) and sentence-transformers.
"""

from __future__ import annotations

import base64
import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import requests
from support import ServerProcess, start_transerve
from support.openai_models import EMBEDDING, GPT2Reference, build_chat_gpt2, scrape, sentence_embeddings

openai = pytest.importorskip("openai")
pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

#: The test template: the documents and a `hint` variable (chat_template_kwargs) before the ChatML-like messages.
TEMPLATE = (
    "{{ bos_token }}"
    "{% if documents %}{% for doc in documents %}<doc>{{ doc['title'] }}: {{ doc['text'] }}</doc>\n{% endfor %}"
    "{% endif %}"
    "{% if hint %}<hint>{{ hint }}</hint>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPT = "Hello world, how are you today?"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
MAX_TOKENS = 24
GENERATORS = {"gpt": "torch", "gpt_ct2": "ctranslate2"}
#: The sizes the exported MiniLM allows `dimensions` to cut its 384 to.
MATRYOSHKA = (64, 128, 256)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    from support.hf_models import minilm_path

    from transerve.convert.command import convert
    from transerve.export.command import export

    root = tmp_path_factory.mktemp("openai_vllm")
    folder = build_chat_gpt2(root / "gpt2")
    (folder / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    repository = root / "repository"
    for name, engine in GENERATORS.items():
        convert(folder, repository, engine=engine, name=name, max_batch_size=8, decoupled=True)
    export(minilm_path(), "embedding", "onnx", repository, EMBEDDING, max_batch_size=8, dynamic_batching=True)
    config = repository / EMBEDDING / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters { key: "openai_matryoshka_dimensions" value: { string_value: '
                      f'"{",".join(map(str, MATRYOSHKA))}" }} }}\n')
    broken = repository / "broken"  # a generator whose weights are missing: it fails to load
    shutil.copytree(repository / "gpt", broken)
    shutil.rmtree(broken / "1" / "model")
    (broken / "config.pbtxt").write_text((broken / "config.pbtxt").read_text().replace('"gpt"', '"broken"'))
    return repository, folder


@pytest.fixture(scope="module")
def server(built) -> Iterator[ServerProcess]:
    with start_transerve(built[0], "--exit-on-error=false", "--strict-readiness=false") as running:
        yield running


@contextmanager
def refusal(param: str, mentions: str | None = None) -> Iterator[None]:
    """The block's call is a 400 in OpenAI's shape, naming `param` (and in its message `mentions`, default the
    name)."""
    with pytest.raises(openai.APIStatusError) as caught:
        yield
    assert caught.value.status_code == 400, caught.value.body
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    assert (mentions or param.split(".")[-1]) in body["message"], body


def greedy(client, model: str, **fields):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, **fields)


# ---- the field allow-list ------------------------------------------------------------------------------------

VLLM_EXTRAS_NOT_HONOURED = {
    "length_penalty": 0.5, "use_beam_search": True,
    "bad_words": ["x"], "allowed_token_ids": [1, 2], "request_id": "mine",
}


@pytest.mark.parametrize("model", list(GENERATORS))
def test_fields_the_server_does_not_act_on_are_refused_naming_them(client, model):
    for name, value in VLLM_EXTRAS_NOT_HONOURED.items():
        with refusal(name):
            greedy(client, model, extra_body={name: value})
        with refusal(name):
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, extra_body={name: value})
    with refusal("echo"):
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, extra_body={"echo": True})
    with refusal("tool_choice", "openai_tool_call_parser"):  # tools need a parser for the model's answers
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    with refusal("chat_template", "--trust-request-chat-template"):  # this server was not started with it
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                       extra_body={"chat_template": "{{ messages }}"})
    with refusal("stream_options.other"):
        greedy(client, model, stream=True, stream_options={"include_usage": True, "other": 1})
    with refusal("priority"):  # honoured within vLLM's range here (test_openai_vllm_extras.py)
        greedy(client, model, extra_body={"priority": 10**7})
    with refusal("spaces_between_special_tokens"):
        greedy(client, model, extra_body={"spaces_between_special_tokens": "no"})
    with refusal("normalize"):
        client.embeddings.create(model=EMBEDDING, input="hi", extra_body={"normalize": False})
    # What is refused leaves the server serving.
    assert greedy(client, model).usage.completion_tokens == MAX_TOKENS


def test_metadata_fields_are_accepted_and_change_nothing(client, reference):
    expected = reference.complete(PROMPT, MAX_TOKENS)
    for model in GENERATORS:
        plain = greedy(client, model)
        tagged = greedy(client, model, user="alice", extra_body={"metadata": {"team": "a"}, "store": False,
                                                                "service_tier": "auto"})
        assert plain.choices[0].text == tagged.choices[0].text == expected.text
        chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0,
                                              user="bob", store=False, metadata={"k": "v"}, service_tier="auto")
        assert chat.usage.completion_tokens == 4
    embedded = client.embeddings.create(model=EMBEDDING, input="hi", user="carol")
    assert len(embedded.data[0].embedding) == 384


# ---- vLLM's extras, honoured -----------------------------------------------------------------------------------

@pytest.mark.parametrize("model", list(GENERATORS))
def test_stop_token_ids_end_the_choice_at_the_id_as_vllm_keeps_it(client, reference, model):
    expected = reference.complete(PROMPT, MAX_TOKENS)
    stop = expected.ids[5]
    end = expected.ids.index(stop) + 1
    answer = greedy(client, model, extra_body={"stop_token_ids": [stop]})
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == end
    assert answer.choices[0].text == reference.decode(expected.ids[:end])
    streamed = list(greedy(client, model, stream=True, extra_body={"stop_token_ids": [stop]}))
    assert "".join(chunk.choices[0].text for chunk in streamed) == answer.choices[0].text


@pytest.mark.parametrize("model", list(GENERATORS))
def test_include_stop_str_in_output_keeps_the_stop_string(client, reference, model):
    expected = reference.complete(PROMPT, MAX_TOKENS)
    stop = expected.text[6:9]
    cut = expected.text.find(stop)
    without = greedy(client, model, stop=[stop])
    assert without.choices[0].text == expected.text[:cut]
    within = greedy(client, model, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert within.choices[0].text == expected.text[:cut + len(stop)]
    assert within.choices[0].finish_reason == "stop"
    streamed = list(greedy(client, model, stop=[stop], stream=True, extra_body={"include_stop_str_in_output": True}))
    assert "".join(chunk.choices[0].text for chunk in streamed) == within.choices[0].text


def test_skip_special_tokens_and_tokens_as_ids_decode_as_transformers(client, reference):
    """Sampled choices until one ends with the end token (a special token): with `skip_special_tokens: false`
    its text holds it, as transformers' decode with skip_special_tokens=False gives (and
    `spaces_between_special_tokens: false`, which a fast tokenizer's decode leaves as it is); the ids come from
    the log-probabilities named `token_id:<id>` (`return_tokens_as_token_ids`)."""
    found = None
    for seed in range(8):
        fields = {"n": 16, "temperature": 2.0, "seed": seed, "logprobs": 0, "max_tokens": MAX_TOKENS}
        kept = client.completions.create(model="gpt", prompt=PROMPT, **fields,
                                         extra_body={"skip_special_tokens": False, "return_tokens_as_token_ids": True,
                                                     "spaces_between_special_tokens": False})
        skipped = client.completions.create(model="gpt", prompt=PROMPT, **fields)
        for with_special, without in zip(kept.choices, skipped.choices, strict=True):
            tokens = with_special.logprobs.tokens
            assert all(token.startswith("token_id:") for token in tokens)
            ids = [int(token.split(":")[1]) for token in tokens]
            assert with_special.text == reference.tokenizer.decode(ids, skip_special_tokens=False,
                                                                   spaces_between_special_tokens=False)
            assert without.text == reference.tokenizer.decode(ids, skip_special_tokens=True)
            assert without.logprobs.tokens[0] != tokens[0]  # text, not `token_id:`
            if ids[-1] == reference.eos:
                found = with_special.text
        if found is not None:
            break
    assert found is not None and found.endswith(reference.tokenizer.eos_token)


@pytest.mark.parametrize("model", list(GENERATORS))
def test_truncate_prompt_tokens_keeps_the_last_tokens(client, reference, model):
    long_prompt = " ".join(["serving transformer models quickly"] * 40)
    ids = reference.ids(long_prompt)
    expected = reference.greedy(ids[-7:], 8)
    for prompt in (long_prompt, ids):
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                           extra_body={"truncate_prompt_tokens": 7})
        assert answer.usage.prompt_tokens == 7
        assert answer.choices[0].text == expected.text
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    assert chat.choices[0].message.content == reference.greedy(reference.chat_ids(MESSAGES)[-5:], 4).text
    with refusal("truncate_prompt_tokens"):
        greedy(client, model, extra_body={"truncate_prompt_tokens": 0})


def chat_ids(reference: GPT2Reference, messages, **options) -> list[int]:
    text = reference.tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return list(reference.tokenizer(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("model", list(GENERATORS))
def test_chat_template_fields_render_as_apply_chat_template(client, reference, model, server):
    documents = [{"title": "Doc", "text": "Transformers serve text."}]
    partial = [*MESSAGES, {"role": "assistant", "content": "I am fine, and"}]
    cases = [
        ({"add_generation_prompt": False}, MESSAGES, {"add_generation_prompt": False}),
        ({"add_generation_prompt": False, "continue_final_message": True}, partial,
         {"add_generation_prompt": False, "continue_final_message": True}),
        ({"documents": documents}, MESSAGES, {"add_generation_prompt": True, "documents": documents}),
        ({"chat_template_kwargs": {"hint": "short"}}, MESSAGES, {"add_generation_prompt": True, "hint": "short"}),
    ]
    for fields, messages, options in cases:
        ids = chat_ids(reference, messages, **options)
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                                extra_body=fields)
        assert answer.usage.prompt_tokens == len(ids), fields
        assert answer.choices[0].message.content == reference.greedy(ids, 6).text, fields
        tokenized = requests.post(f"{server.base_url}/tokenize", json={"model": model, "messages": messages,
                                                                      **fields}, timeout=30).json()
        assert tokenized["tokens"] == ids, fields
    with refusal("continue_final_message"):
        client.chat.completions.create(model=model, messages=partial, max_tokens=2,
                                       extra_body={"continue_final_message": True})


@pytest.mark.parametrize("model", list(GENERATORS))
def test_continuous_usage_stats_give_each_chunk_its_choice_usage(client, model, reference):
    prompt_tokens = len(reference.ids(PROMPT))
    chunks = list(greedy(client, model, n=2, stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True}))
    *deltas, last = chunks
    seen: dict[int, int] = {}
    for chunk in deltas:
        usage, index = chunk.usage, chunk.choices[0].index
        assert usage.prompt_tokens == prompt_tokens
        assert usage.completion_tokens >= seen.get(index, 0)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        seen[index] = usage.completion_tokens
    assert seen == {0: MAX_TOKENS, 1: MAX_TOKENS}
    assert last.choices == [] and last.usage.completion_tokens == 2 * MAX_TOKENS
    with refusal("stream_options.continuous_usage_stats"):
        greedy(client, model, stream=True, stream_options={"continuous_usage_stats": True})


# ---- vLLM's service routes and headers -------------------------------------------------------------------------

def test_health_version_and_models_answer_as_vllm(server, client):
    health = requests.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 200 and health.content == b""
    assert requests.post(f"{server.base_url}/health", timeout=10).status_code == 405
    version = requests.get(f"{server.base_url}/version", timeout=10).json()
    assert isinstance(version["version"], str) and version["version"]
    cards = {model.id: model for model in client.models.list().data}
    assert set(cards) == {*GENERATORS, EMBEDDING}
    assert cards["gpt"].max_model_len == cards["gpt_ct2"].max_model_len == 2048
    assert cards[EMBEDDING].max_model_len == 256


def test_tokenize_and_detokenize_equal_the_tokenizer(server, reference):
    url = server.base_url
    answer = requests.post(f"{url}/tokenize", json={"model": "gpt", "prompt": PROMPT}, timeout=30).json()
    ids = reference.ids(PROMPT)
    assert answer == {"count": len(ids), "max_model_len": 2048, "tokens": ids}
    strs = requests.post(f"{url}/tokenize", json={"model": "gpt_ct2", "prompt": PROMPT, "return_token_strs": True},
                         timeout=30).json()
    assert strs["token_strs"] == [reference.tokenizer.decode([i]) for i in ids]
    chat = requests.post(f"{url}/tokenize", json={"model": "gpt", "messages": MESSAGES}, timeout=30).json()
    assert chat["tokens"] == chat_ids(reference, MESSAGES, add_generation_prompt=True)
    back = requests.post(f"{url}/detokenize", json={"model": "gpt", "tokens": ids}, timeout=30).json()
    assert back == {"prompt": reference.decode(ids)}
    for path, body, param in (("tokenize", {"model": "gpt", "prompt": 3}, "prompt"),
                              ("tokenize", {"model": "gpt", "prompt": "a", "extra": 1}, "extra"),
                              ("detokenize", {"model": "gpt", "tokens": [10**9]}, "tokens"),
                              ("detokenize", {"model": "nope", "tokens": [1]}, "model")):
        refusal = requests.post(f"{url}/{path}", json=body, timeout=30)
        assert refusal.status_code in (400, 404) and refusal.json()["error"]["param"] == param, refusal.text


def test_every_v1_answer_carries_a_request_id_and_a_503_a_retry_after(server, client):
    mine = client.completions.with_raw_response.create(model="gpt", prompt=PROMPT, max_tokens=2,
                                                       extra_headers={"x-request-id": "abc-123"})
    assert mine.headers["x-request-id"] == "abc-123"
    made = requests.get(f"{server.base_url}/v1/models", timeout=10)
    made_too = requests.get(f"{server.base_url}/v1/models", timeout=10)
    assert len(made.headers["x-request-id"]) == 32 and made.headers["x-request-id"] != made_too.headers["x-request-id"]
    long_id = requests.get(f"{server.base_url}/v1/models", headers={"x-request-id": "x" * 500}, timeout=10)
    assert long_id.headers["x-request-id"] != "x" * 500  # not echoed past its bound
    missing = requests.post(f"{server.base_url}/v1/completions", json={"model": "nope", "prompt": "a"}, timeout=10)
    assert missing.status_code == 404 and "x-request-id" in missing.headers
    unready = requests.post(f"{server.base_url}/v1/completions", json={"model": "broken", "prompt": "a"}, timeout=10)
    assert unready.status_code == 503, unready.text
    assert unready.headers["Retry-After"] == "1" and "x-request-id" in unready.headers


# ---- vLLM's metrics --------------------------------------------------------------------------------------------

def test_vllm_metrics_count_what_the_answers_reported(server, client):
    for model in GENERATORS:
        before = scrape(server)
        prompt = completion = 0
        answers = [greedy(client, model), greedy(client, model, n=2),
                   client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0)]
        for answer in answers:
            prompt += answer.usage.prompt_tokens
            completion += answer.usage.completion_tokens
        streamed = list(greedy(client, model, stream=True, stream_options={"include_usage": True}))
        prompt += streamed[-1].usage.prompt_tokens
        completion += streamed[-1].usage.completion_tokens
        after = scrape(server)
        label = f'model_name="{model}"'

        def grew(name: str, labels: str = label, after=after, before=before) -> float:
            return after[(name, labels)] - before.get((name, labels), 0.0)

        assert grew("vllm:prompt_tokens_total") == prompt
        assert grew("vllm:generation_tokens_total") == completion
        assert grew("vllm:e2e_request_latency_seconds_count") == 4
        assert grew("vllm:request_success_total", f'finished_reason="length",{label}') == 5  # n=2: two
        assert grew("vllm:time_to_first_token_seconds_count") == 5
        # One gap per later arrival of a choice's tokens (a fast engine may hand over several tokens at once).
        gaps = grew("vllm:inter_token_latency_seconds_count")
        assert gaps == grew("vllm:time_per_output_token_seconds_count")
        assert 0 <= gaps <= completion - 5
        assert after[("vllm:num_requests_running", label)] == 0
        assert after[("vllm:num_requests_waiting", label)] == 0
        bucket = f'{label},le="+Inf"'
        assert after[("vllm:e2e_request_latency_seconds_bucket", bucket)] == \
            after[("vllm:e2e_request_latency_seconds_count", label)]
        # A client that goes away mid-stream: its choice ends as an abort, and runs no longer.
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=1500, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        running = scrape(server)
        assert running[("vllm:num_requests_running", label)] == 1
        assert running[("vllm:num_requests_waiting", label)] == 0
        # The torch engine's key/value budget holds the stream's share; CTranslate2 states no budget.
        assert (running.get(("vllm:kv_cache_usage_perc", label), 0.0) > 0) == (GENERATORS[model] == "torch")
        stream.close()
        abort = ("vllm:request_success_total", f'finished_reason="abort",{label}')
        deadline = time.monotonic() + 30
        while scrape(server).get(abort, 0.0) == after.get(abort, 0.0) and time.monotonic() < deadline:
            time.sleep(0.1)
        while scrape(server)[("vllm:num_requests_running", label)] and time.monotonic() < deadline:
            time.sleep(0.05)  # the engine drops the cancelled sequence at its next step
        ended = scrape(server)
        assert ended[abort] == after.get(abort, 0.0) + 1
        assert ended[("vllm:num_requests_running", label)] == 0
        assert ended[("vllm:generation_tokens_total", label)] == after[("vllm:generation_tokens_total", label)]


def test_vllm_metrics_count_v2_generate_requests_to_generators(server, reference):
    """`/v2/models/<generator>/generate[_stream]`: prompt tokens (the request's length) and the new ids the
    responses carry (`sequence_length` less `prefix_length`) are counted as the OpenAI layer counts its own."""
    ids = reference.ids(PROMPT)
    for model in GENERATORS:
        before = scrape(server)
        generated = 0
        for path, stream in (("generate", False), ("generate_stream", True)):
            body = {"input_ids": ids, "sequence_length": len(ids), "max_tokens": 6, "stream": stream}
            answer = requests.post(f"{server.base_url}/v2/models/{model}/{path}", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ")] \
                if stream else [answer.json()]
            generated += sum(int(np.ravel(event["sequence_length"])[0]) - int(np.ravel(event["prefix_length"])[0])
                             for event in events)
        assert generated == 12
        after = scrape(server)
        label = f'model_name="{model}"'
        for name, grown in (("vllm:prompt_tokens_total", 2 * len(ids)), ("vllm:generation_tokens_total", generated),
                            ("vllm:e2e_request_latency_seconds_count", 2),
                            ("vllm:time_to_first_token_seconds_count", 2)):
            assert after[(name, label)] - before.get((name, label), 0.0) == grown, name
        assert after[("vllm:num_requests_running", label)] == 0


# ---- embeddings ------------------------------------------------------------------------------------------------

def minilm_ids(built, text: str, keep: int | None = None) -> list[int]:
    """MiniLM's tokenizer as transformers runs it ([CLS] text [SEP]), truncated from the left to `keep` tokens
    as vLLM's tokenizers truncate."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(built[0] / f"{EMBEDDING}_tokenizer" / "1",
                                                           truncation_side="left")
    if keep is None:
        return list(tokenizer(text).input_ids)
    return list(tokenizer(text, truncation=True, max_length=keep).input_ids)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_embeddings_from_token_ids_equal_those_from_text(server, client, built):
    texts = ["A man is eating food.", "Serving transformer models."]
    expected = sentence_embeddings(texts)
    ids = [minilm_ids(built, text) for text in texts]
    many = client.embeddings.create(model=EMBEDDING, input=ids)
    assert cosine(np.array([item.embedding for item in many.data]), expected).min() >= 0.9999
    assert many.usage.prompt_tokens == sum(map(len, ids))
    one = client.embeddings.create(model=EMBEDDING, input=ids[0], encoding_format="float")
    assert cosine(np.array([one.data[0].embedding]), expected[:1]).min() >= 0.9999
    raw = requests.post(f"{server.base_url}/v1/embeddings", json={"model": EMBEDDING, "input": ids,
                                                                  "encoding_format": "base64"}, timeout=60).json()
    decoded = np.array([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in raw["data"]])
    assert cosine(decoded, expected).min() >= 0.9999
    with refusal("input"):
        client.embeddings.create(model=EMBEDDING, input=[[10**7]])
    with refusal("input"):
        client.embeddings.create(model=EMBEDDING, input=[list(range(1000, 1300))])


def test_embedding_truncation_and_matryoshka_dimensions(client, built):
    long_text = "serving " * 300  # past MiniLM's 256 tokens: refused unless truncated
    with refusal("input"):
        client.embeddings.create(model=EMBEDDING, input=long_text)
    from support.openai_models import _sentence_transformer

    kept = minilm_ids(built, long_text, keep=20)
    answer = client.embeddings.create(model=EMBEDDING, input=long_text, extra_body={"truncate_prompt_tokens": 20})
    assert answer.usage.prompt_tokens == 20
    expected = _sentence_transformer().encode([_sentence_transformer().tokenizer.decode(kept[1:-1])])
    assert cosine(np.array([answer.data[0].embedding]), expected).min() >= 0.9999
    full = np.array(client.embeddings.create(model=EMBEDDING, input=PROMPT).data[0].embedding)
    for size in MATRYOSHKA:
        cut = np.array(client.embeddings.create(model=EMBEDDING, input=PROMPT, dimensions=size).data[0].embedding)
        assert cut.shape == (size,)
        assert np.allclose(cut, full[:size] / np.linalg.norm(full[:size]), atol=1e-6)
    assert len(client.embeddings.create(model=EMBEDDING, input=PROMPT, dimensions=384).data[0].embedding) == 384
    with refusal("dimensions"):
        client.embeddings.create(model=EMBEDDING, input=PROMPT, dimensions=100)


def test_over_context_prompts_are_refused_before_the_model_on_every_engine(server, client):
    """A prompt past the context is a 400 on both engines, and no failure in the models' statistics."""
    too_long = [10 + index % 380 for index in range(2100)]  # the test vocabulary has 400 tokens
    for model in GENERATORS:
        with refusal("prompt"):
            client.completions.create(model=model, prompt=too_long, max_tokens=2)
        with refusal("max_tokens", "2048"):
            client.completions.create(model=model, prompt=too_long[:2040], max_tokens=20)
        stats = requests.get(f"{server.base_url}/v2/models/{model}/stats", timeout=10).json()
        assert stats["model_stats"][0]["inference_stats"]["fail"]["count"] == 0, json.dumps(stats)
