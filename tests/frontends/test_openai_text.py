"""The OpenAI layer's text pieces in process: stop strings found across deltas, streamed text that never splits a
character and concatenates to the whole decode, chat templates rendered as transformers renders them, and the
request fields' checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from transerve.frontends.http.openai import params, tools
from transerve.frontends.http.openai.errors import ApiError
from transerve.frontends.http.openai.generation import _StopFinder
from transerve.frontends.http.openai.text import TextStream, TextTokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tokenizers")
    from support.generation_models import _save_tokenizer, _train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    token = "<|endoftext|>"
    _save_tokenizer(path, _train_tokenizer([token], None, 400), {"bos_token": token, "eos_token": token})
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path


def test_stop_strings_cut_across_deltas_and_hold_back_their_beginning() -> None:
    finder = _StopFinder(["END", "\n\n"])
    assert finder.feed("hello E") == ("hello ", False)  # "E" may begin "END": held back
    assert finder.feed("N") == ("", False)
    assert finder.feed("Dless") == ("", True)
    other = _StopFinder(["END"])
    assert other.feed("hello E") == ("hello ", False)
    assert other.feed("xit") == ("Exit", False)  # settled: not a stop string after all
    assert other.flush() == ""


def test_streamed_text_never_splits_a_character_and_joins_to_the_whole(folder: Path) -> None:
    tokenizer = TextTokenizer(folder)
    text = "안녕하세요 세계, emoji 🙂 and 🚀 here"
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer)
    pieces = [stream.add([token]) for token in ids] + [stream.finish()]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert sum(1 for piece in pieces if not piece) > 0  # some tokens held part of a character


def test_chat_template_renders_as_transformers(folder: Path) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "And?"}]
    tokenizer = TextTokenizer(folder)
    text = tokenizer.render_chat(messages)
    assert text == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert tokenizer.encode(text, special_tokens=False) == list(expected)
    with pytest.raises(ApiError, match="unknown role tool") as raised:
        tokenizer.render_chat([{"role": "tool", "content": "x"}])
    assert raised.value.status == 400


def test_chat_template_kwargs_replace_the_defaults_as_transformers_but_not_the_messages(folder: Path) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "Hi"}]
    tokenizer = TextTokenizer(folder)
    text = tokenizer.render_chat(messages, arguments={"add_generation_prompt": False, "bos_token": "<s>"})
    assert text == reference.apply_chat_template(messages, add_generation_prompt=False, tokenize=False,
                                                 bos_token="<s>")
    assert text.startswith("<s>") and not text.endswith("<|assistant|>")
    with pytest.raises(ApiError, match="may not set messages") as raised:
        tokenizer.render_chat(messages, arguments={"messages": []})
    assert raised.value.status == 400 and raised.value.param == "chat_template_kwargs"


def test_long_texts_encode_on_a_worker_thread_to_the_same_ids(folder: Path) -> None:
    import asyncio

    from transerve.frontends.http.openai.text import INLINE_CHARACTERS

    tokenizer = TextTokenizer(folder)
    short, long = "Hello 🙂 world", "안녕하세요 emoji 🚀 " * (INLINE_CHARACTERS // 8)
    assert len(long) > INLINE_CHARACTERS
    for texts in ([short], [long, short]):
        assert asyncio.run(tokenizer.encode_all(texts)) == [tokenizer.encode(text) for text in texts]
    # No text of more characters than a context times the longest token can fit in that context.
    limit = tokenizer.character_limit(16)
    assert limit == 16 * tokenizer.longest_token
    assert len(tokenizer.encode("x" * (limit + 1))) > 16 or tokenizer.longest_token == 1


def test_token_bytes_are_exact_for_a_byte_level_vocabulary(folder: Path) -> None:
    tokenizer = TextTokenizer(folder)
    ids = tokenizer.encode("🙂")
    assert b"".join(bytes(tokenizer.token_bytes(token)) for token in ids) == "🙂".encode()


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": "4"}, "max_tokens"), ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"n": 1000}, "n"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"), ({"stop": ["a"] * 5}, "stop"), ({"stop": [""]}, "stop"),
    ({"logprobs": 21}, "logprobs"), ({"suffix": "x"}, "suffix"), ({"stream_options": {"include_usage": True}},
                                                                   "stream_options"),
    ({"logit_bias": {"1": 5}}, "logit_bias"), ({"seed": -1}, "seed"), ({"min_tokens": 9, "max_tokens": 3},
                                                                      "min_tokens"),
])
def test_completion_fields_are_checked(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as raised:
        params.sampling(body, chat=False)
    assert raised.value.status == 400 and raised.value.param == param


def test_chat_fields_are_checked() -> None:
    with pytest.raises(ApiError) as raised:
        tools.tool_request({"tools": [{}]})
    assert raised.value.param == "tools[0]"
    for body, param in (({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
                        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
                        ({"structured_outputs": "json"}, "structured_outputs"), ({"guided_regex": 3}, "guided_regex")):
        with pytest.raises(ApiError) as raised:
            params.sampling(body, chat=True)
        assert raised.value.param == param
    for messages, param in (([], "messages"), ([{"role": "wizard", "content": "x"}], "messages[0].role"),
                            ([{"role": "user", "content": 3}], "messages[0].content"),
                            ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content")):
        with pytest.raises(ApiError) as raised:
            params.messages({"messages": messages})
        assert raised.value.param == param
    sampling = params.sampling({"max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3}, chat=True)
    assert (sampling.max_tokens, sampling.logprobs) == (7, 3)
    assert params.sampling({}, chat=False).max_tokens == params.COMPLETIONS_DEFAULT_MAX_TOKENS
