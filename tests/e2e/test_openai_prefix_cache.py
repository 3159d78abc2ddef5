"""The torch engine's prefix cache through the server: chat requests that share a long system prompt, one after
another and at once, get transformers' greedy answers from a model with the cache (`gpt`) and from one with
`prefix_cache_tokens: 0` (`gpt_cold`); the metrics port counts the cache's lookups and tokens for the first only.

The repository: the random-weight chat GPT-2 of tests/support/openai_models.py converted for the torch engine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import requests
from support import ServerProcess
from support.openai_models import GPT2Reference, build_chat_gpt2

openai = pytest.importorskip("openai")
pytest.importorskip("torch")
pytest.importorskip("transformers")

SYSTEM = "You are a helpful assistant who answers in full sentences and never in lists. " * 12
QUESTIONS = ["Hello world, how are you today?", "What is a fox?", "Tell me about serving models.",
             "Why is the sky blue?", "Name a colour."]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    from transerve.convert.command import convert

    root = tmp_path_factory.mktemp("prefix_cache")
    folder = build_chat_gpt2(root / "gpt2")
    repository = root / "repository"
    for name in ("gpt", "gpt_cold"):
        convert(folder, repository, engine="torch", name=name, max_batch_size=8, decoupled=True)
    with open(repository / "gpt_cold" / "config.pbtxt", "a") as config:
        config.write('parameters {\n  key: "prefix_cache_tokens"\n  value { string_value: "0" }\n}\n')
    return repository, folder


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _counters(server: ServerProcess) -> dict[tuple[str, str], float]:
    """The prefix cache's samples by (name, model), from the metrics port."""
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    found = {}
    for line in text.splitlines():
        if line.startswith(("vllm:prefix_cache_", "transerve_prefix_cache_lookups")):
            sample, value = line.rsplit(" ", 1)
            name, labels = sample.split("{", 1)
            model = labels.split('model_name="' if name.startswith("vllm") else 'model="', 1)[1].split('"', 1)[0]
            key = name + (":" + labels.split('result="', 1)[1].split('"', 1)[0] if "result=" in labels else "")
            found[(key, model)] = float(value)
    return found


def test_a_shared_system_prompt_is_cached_with_generates_answers(server, built):
    reference = GPT2Reference(built[1])
    assert len(reference.chat_ids(_messages(QUESTIONS[0]))) > 200
    expected = [reference.chat(_messages(question), MAX_TOKENS) for question in QUESTIONS]
    before = _counters(server)  # the load's warm-up decode looked up its prompt too
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        for model in ("gpt", "gpt_cold"):
            for question, answer in zip(QUESTIONS, expected, strict=True):
                got = client.chat.completions.create(model=model, messages=_messages(question),
                                                     max_tokens=MAX_TOKENS, temperature=0)
                assert _same(got.choices[0].message.content, answer.text), (model, question)
    after = _counters(server)

    def grew(name: str) -> float:
        return after[(name, "gpt")] - before.get((name, "gpt"), 0)

    assert grew("transerve_prefix_cache_lookups:hit") == len(QUESTIONS) - 1
    assert grew("transerve_prefix_cache_lookups:miss") == 1
    prompt_tokens = sum(len(answer.prompt_ids) for answer in expected)
    assert grew("vllm:prefix_cache_queries_total") == prompt_tokens
    assert 200 * (len(QUESTIONS) - 1) < grew("vllm:prefix_cache_hits_total") < prompt_tokens
    assert not any(model == "gpt_cold" for _, model in after)


def test_concurrent_chats_sharing_a_system_prompt_get_their_own_answers(server, built):
    reference = GPT2Reference(built[1])
    questions = [f"{question} ({index})" for index in range(2) for question in QUESTIONS]
    expected = [reference.chat(_messages(question), MAX_TOKENS) for question in questions]

    async def ask_all(model: str) -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                                      timeout=120) as client:
            answers = await asyncio.gather(*(
                client.chat.completions.create(model=model, messages=_messages(question), max_tokens=MAX_TOKENS,
                                               temperature=0)
                for question in questions
            ))
        return [answer.choices[0].message.content for answer in answers]

    before = _counters(server)[("transerve_prefix_cache_lookups:hit", "gpt")]
    for served, answer in zip(asyncio.run(ask_all("gpt")), expected, strict=True):
        assert _same(served, answer.text)
    assert _counters(server)[("transerve_prefix_cache_lookups:hit", "gpt")] - before >= len(questions) - 1


def _same(served: str, expected: str) -> bool:
    """The served text is transformers' decode of the same ids, less a half character a length cut may leave."""
    return served in (expected, expected.rstrip("\ufffd"))
