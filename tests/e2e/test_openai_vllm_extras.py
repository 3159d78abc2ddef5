"""vLLM's request extras that the generators act on, through a real server and the official `openai` client:
`repetition_penalty` and `min_p` equal to transformers' `generate` with the same arguments (torch engine) and to
CTranslate2's own `generate_batch` (CTranslate2, which has no min-p: a 400 naming it), a seed that gives each of a
prompt's n choices its own draw (vLLM's seed + index), `priority` honoured by the engine's queue (a model that decodes
one sequence at a time serves the better priority before earlier worse ones), and a request's own `chat_template`
on a server started with --trust-request-chat-template, rendered as transformers' `apply_chat_template` renders it.

The repository: the random-weight GPT-2 of tests/support/openai_models.py, converted for the torch engine and
CTranslate2, and once more for the torch engine with `max_batch_rows` 1.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from support import ServerProcess, start_transerve
from support.openai_models import GPT2Reference, build_chat_gpt2

openai = pytest.importorskip("openai")
ctranslate2 = pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")

PROMPT = "Hello world, how are you today?"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
MAX_TOKENS = 24
#: One sequence at a time: what the priority test queues behind.
ONE_ROW = "gpt_one"
#: The one-row model's positions.
LONG_CONTEXT = 32768
#: A template of the request's own: other markers than the model's, and a variable of chat_template_kwargs.
REQUEST_TEMPLATE = (
    "{% for message in messages %}[{{ message['role'] | upper }}{% if tag %}:{{ tag }}{% endif %}] "
    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    from support.generation_models import build_generation_model

    from transerve.convert.command import convert

    root = tmp_path_factory.mktemp("openai_extras")
    folder = build_chat_gpt2(root / "gpt2")
    repository = root / "repository"
    for name, engine in (("gpt", "torch"), ("gpt_ct2", "ctranslate2")):
        convert(folder, repository, engine=engine, name=name, max_batch_size=8, decoupled=True)
    # The one-row model: a long context, so that a stream can hold its row for as long as a loaded machine needs
    # to queue the priority test's requests behind it.
    long_folder = build_generation_model("gpt2", root / "gpt2_long", config={"n_positions": LONG_CONTEXT})
    convert(long_folder, repository, engine="torch", name=ONE_ROW, max_batch_size=8, decoupled=True)
    config = repository / ONE_ROW / "config.pbtxt"
    text, count = re.subn(r'(key: "max_batch_rows"\s*value \{\s*string_value: )"\d+"', r'\1"1"', config.read_text())
    if not count:
        text += 'parameters { key: "max_batch_rows" value: { string_value: "1" } }\n'
    config.write_text(text)
    return repository, folder


@pytest.fixture(scope="module")
def server(built) -> Iterator[ServerProcess]:
    with start_transerve(built[0], "--trust-request-chat-template") as running:
        yield running


def refused(call, param: str, mentions: str | None = None) -> dict:
    """`call()` is a 400 naming `param` (and `mentions` in its message, default the name)."""
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    assert caught.value.status_code == 400, caught.value.body
    body = caught.value.body
    assert isinstance(body, dict) and (mentions or param) in body["message"], body
    if param:
        assert body["param"] == param, body
    return body


def generated(reference: GPT2Reference, ids: list[int], max_new_tokens: int, seed: int | None = None,
              **kwargs) -> str:
    """transformers' `generate` on the folder the served models came from, cut after the end token; sampled from
    its global generator seeded with `seed`, as the torch engine seeds a sequence's own."""
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = reference.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       max_new_tokens=max_new_tokens, pad_token_id=reference.eos, **kwargs)
    new = out[0, len(ids):].tolist()
    if reference.eos in new:
        new = new[:new.index(reference.eos) + 1]
    return reference.decode(new)


def ctranslate2_greedy(built, reference: GPT2Reference, ids: list[int], max_new_tokens: int, **kwargs) -> str:
    """CTranslate2's own greedy `generate_batch` on the served model's folder, called as the engine calls it."""
    generator = ctranslate2.Generator(str(built[0] / "gpt_ct2" / "1" / "model"), device="cpu")
    result = generator.generate_batch([reference.tokenizer.convert_ids_to_tokens(ids)], max_length=max_new_tokens,
                                      include_prompt_in_result=False, sampling_topk=1, end_token=[reference.eos],
                                      return_end_token=True, **kwargs)[0]
    return reference.decode(result.sequences_ids[0])


# ---- repetition_penalty -------------------------------------------------------------------------------------------

def test_repetition_penalty_equals_transformers_generate_greedy_and_in_chat(client, reference):
    ids = reference.ids(PROMPT)
    plain = reference.complete(PROMPT, MAX_TOKENS).text
    for penalty in (1.5, 0.7):
        expected = generated(reference, ids, MAX_TOKENS, do_sample=False, repetition_penalty=penalty)
        answer = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"repetition_penalty": penalty})
        assert answer.choices[0].text == expected, penalty
        streamed = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True, extra_body={"repetition_penalty": penalty})
        assert "".join(chunk.choices[0].text for chunk in streamed) == expected
    assert generated(reference, ids, MAX_TOKENS, do_sample=False, repetition_penalty=1.5) != plain
    chat_ids = reference.chat_ids(MESSAGES)
    chat = client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"repetition_penalty": 1.5})
    assert chat.choices[0].message.content == generated(reference, chat_ids, MAX_TOKENS, do_sample=False,
                                                        repetition_penalty=1.5)


def test_repetition_penalty_on_ctranslate2_is_its_own_penalty(client, reference, built):
    ids = reference.ids(PROMPT)
    expected = ctranslate2_greedy(built, reference, ids, MAX_TOKENS, repetition_penalty=1.5)
    assert expected != ctranslate2_greedy(built, reference, ids, MAX_TOKENS)  # it changes the answer
    answer = client.completions.create(model="gpt_ct2", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"repetition_penalty": 1.5})
    assert answer.choices[0].text == expected


@pytest.mark.parametrize("value", [0, -1.0, 2.5, "1.2", True])
def test_repetition_penalty_out_of_its_range_is_a_400(client, value):
    refused(lambda: client.completions.create(model="gpt", prompt=PROMPT, max_tokens=2,
                                              extra_body={"repetition_penalty": value}), "repetition_penalty")


# ---- min_p ----------------------------------------------------------------------------------------------------------

def test_min_p_sampling_equals_transformers_and_a_min_p_of_one_is_greedy(client, reference, server):
    ids = reference.ids(PROMPT)
    for min_p in (0.05, 0.3):
        expected = generated(reference, ids, MAX_TOKENS, seed=11, do_sample=True, temperature=0.9, top_k=0,
                             top_p=1.0, min_p=min_p)
        answer = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.9,
                                           seed=11, extra_body={"min_p": min_p})
        assert answer.choices[0].text == expected, min_p
    greedy = reference.complete(PROMPT, MAX_TOKENS).text
    for seed in (1, 2):  # only the likeliest token survives a cut at its own probability
        answer = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.5,
                                           seed=seed, extra_body={"min_p": 1.0})
        assert answer.choices[0].text == greedy
    sampled = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.5, seed=1)
    assert sampled.choices[0].text != greedy
    # /v2 generate: min_p is the generators' parameter of that name.
    body = {"text_input": PROMPT, "parameters": {"max_tokens": MAX_TOKENS, "top_p": 1.0, "temperature": 1.5,
                                                 "min_p": 1.0, "random_seed": 3}}
    answer = requests.post(f"{server.base_url}/v2/models/gpt_text/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert greedy in answer.json()["text_output"]


def test_min_p_on_ctranslate2_is_refused_naming_it_and_bounded_everywhere(client):
    refused(lambda: client.completions.create(model="gpt_ct2", prompt=PROMPT, max_tokens=2, temperature=1.0,
                                              extra_body={"min_p": 0.1}), "", "min_p")
    greedy = client.completions.create(model="gpt_ct2", prompt=PROMPT, max_tokens=2, temperature=0,
                                       extra_body={"min_p": 0.1})  # greedy: no cut to make, as transformers
    assert greedy.usage.completion_tokens == 2
    for value in (-0.1, 1.1, "x"):
        refused(lambda value=value: client.completions.create(model="gpt", prompt=PROMPT, max_tokens=2,
                                                              extra_body={"min_p": value}), "min_p")


# ---- seed with n choices ------------------------------------------------------------------------------------------

def test_each_choice_of_a_seeded_request_has_its_own_reproducible_draw(client):
    def texts(**fields) -> list[str]:
        answer = client.completions.create(model="gpt", max_tokens=MAX_TOKENS, temperature=1.0, seed=21, **fields)
        return [choice.text for choice in sorted(answer.choices, key=lambda choice: choice.index)]

    first = texts(prompt=PROMPT, n=3)
    assert texts(prompt=PROMPT, n=3) == first
    assert len(set(first)) == 3, first
    # As vLLM seeds them: choice i of every prompt samples with seed + i, so one prompt twice gives the same pairs,
    # and a request's first choice is the one a request for one choice gets.
    twice = texts(prompt=[PROMPT, PROMPT], n=2)
    assert twice[:2] == twice[2:] == first[:2]
    assert texts(prompt=PROMPT, n=1) == first[:1]
    chat = [[choice.message.content for choice in client.chat.completions.create(
        model="gpt", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=21, n=3).choices]
        for _ in range(2)]
    assert chat[0] == chat[1] and len(set(chat[0])) == 3


# ---- priority -----------------------------------------------------------------------------------------------------

def test_a_better_priority_is_served_before_earlier_worse_ones(client, server):
    """On a model that decodes one sequence at a time: a long stream holds the row while two requests of a worse
    priority queue, then one of the default and one of a better priority; once the stream is closed, they run in
    priority order, and among equals in the order they came."""
    finished: list[str] = []
    lock = threading.Lock()

    def complete(name: str, priority: int) -> None:  # a client of its own: threads sharing one pool's connections
        with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as own:
            own.completions.create(model=ONE_ROW, prompt=PROMPT, max_tokens=4, temperature=0,
                                   extra_body={"priority": priority, "min_tokens": 4})
        with lock:
            finished.append(name)

    holder = client.completions.create(model=ONE_ROW, prompt=PROMPT, max_tokens=LONG_CONTEXT - 64, temperature=0,
                                       stream=True, extra_body={"min_tokens": LONG_CONTEXT - 64})
    chunks = iter(holder)
    next(chunks)  # it runs: the row is taken
    threads = []
    for name, priority in (("worse", 5), ("worse again", 5), ("default", 0), ("better", -5)):
        thread = threading.Thread(target=complete, args=(name, priority))
        thread.start()
        threads.append(thread)
        before = waiting(server)
        deadline = time.monotonic() + 30
        while waiting(server) < before + 1 and time.monotonic() < deadline:  # it waits in the engine's queue
            time.sleep(0.02)
        assert waiting(server) == before + 1
    holder.close()  # cancels it: the queue is served (in arrival order, had it ended before all were queued)
    for thread in threads:
        thread.join(timeout=60)
    assert finished == ["better", "default", "worse", "worse again"]


def waiting(server: ServerProcess) -> float:
    """The sequences waiting in the one-row model's engine queue (vLLM's waiting gauge, which the engine reports)."""
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    pattern = rf'^vllm:num_requests_waiting\{{model_name="{ONE_ROW}"\}} (\S+)$'
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("value", [10**6 + 1, -(10**6) - 1, 1.5, "1"])
def test_priority_out_of_its_range_is_a_400(client, value):
    refused(lambda: client.completions.create(model="gpt", prompt=PROMPT, max_tokens=2,
                                              extra_body={"priority": value}), "priority")


# ---- chat_template --------------------------------------------------------------------------------------------------

def test_a_request_template_renders_as_apply_chat_template(client, reference, server):
    for fields, options in (({}, {}), ({"chat_template_kwargs": {"tag": "x"}}, {"tag": "x"}),
                            ({"add_generation_prompt": False}, {"add_generation_prompt": False})):
        text = reference.tokenizer.apply_chat_template(MESSAGES, chat_template=REQUEST_TEMPLATE, tokenize=False,
                                                       **{"add_generation_prompt": True, **options})
        ids = list(reference.tokenizer(text, add_special_tokens=False).input_ids)
        answer = client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=6, temperature=0,
                                                extra_body={"chat_template": REQUEST_TEMPLATE, **fields})
        assert answer.usage.prompt_tokens == len(ids), fields
        assert answer.choices[0].message.content == reference.greedy(ids, 6).text, fields
        tokenized = requests.post(f"{server.base_url}/tokenize", json={
            "model": "gpt", "messages": MESSAGES, "chat_template": REQUEST_TEMPLATE, **fields}, timeout=30).json()
        assert tokenized["tokens"] == ids, fields
    own = client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=2, temperature=0)
    assert own.usage.prompt_tokens == len(reference.chat_ids(MESSAGES))  # without one, the model's template


@pytest.mark.parametrize(("template", "mentions"), [
    ("{% for m in messages %}", "chat_template"),  # a syntax error
    ("{{ raise_exception('no thanks') }}", "no thanks"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ messages.__class__.__mro__ }}", "chat_template"),  # the sandbox
    ("{{ 'x' * 10000000 }}", "chat_template"),
    ("{{ 2 ** 10000000 }}", "chat_template"),
    ("{% for i in range(100000) %}{{ 'many words ' * 50 }}{% endfor %}", "characters"),
    ("x" * (64 * 1024 + 1), "65536"),
    (["not", "a", "string"], "string"),
])
def test_bad_request_templates_are_400s_naming_chat_template(client, template, mentions):
    refused(lambda: client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=2,
                                                   extra_body={"chat_template": template}), "chat_template", mentions)
    assert client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=1).usage.completion_tokens == 1


def test_the_trust_flag_takes_tritons_boolean_forms_and_vllms_bare_one():
    from transerve.cli import build_parser

    def trusted(*flags: str) -> bool:
        return build_parser().parse_args(["serve", "--model-repository", "x", *flags]).trust_request_chat_template

    assert not trusted()
    assert trusted("--trust-request-chat-template")
    assert trusted("--trust-request-chat-template=true") and not trusted("--trust-request-chat-template=false")
