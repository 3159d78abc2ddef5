"""The tool-call parsers on their families' recorded output formats: the whole answer's content and calls, and
the stream's deltas under random chunkings, which must join into the whole answer's result."""

from __future__ import annotations

import json
import random

import pytest

from transerve.frontends.http.openai.tool_parsers import ToolStream, parse, scanner
from transerve.frontends.http.openai.tool_parsers.stream import ArgumentsAdded, CallOpened, Content

WEATHER = {"city": "Paris", "unit": "celsius"}
# Texts as the families write them (Qwen2.5-Instruct, Hermes-2-Pro, Llama-3.1/3.2-Instruct, Mistral-7B-Instruct-v0.3,
# Mistral-Small-3.1/Magistral with the v11 tokenizer), and what the whole answer must give: (content, calls).
CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
         None, [("get_weather", WEATHER)]),
        ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
         "Let me check both.\n\n", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
        ('<tool_call>{"arguments": {"q": "a } \\" { brace"}, "name": "search"}</tool_call> done',
         " done", [("search", {"q": 'a } " { brace'})]),
        ('<tool_call>\n{"name": "ping", "arguments": "{\\"host\\": \\"a\\"}"}\n</tool_call>', None,
         [("ping", {"host": "a"})]),
        ("I use <tool_call> tags but this is prose, not JSON.</tool_call> Bye.",
         "I use <tool_call> tags but this is prose, not JSON.</tool_call> Bye.", []),
        ("Plain answer with a < sign and <tool", "Plain answer with a < sign and <tool", []),
        ('<tool_call>\n{"name": "now"}\n</tool_call>', None, [("now", {})]),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
         [("get_weather", WEATHER)]),
        ('<|python_tag|>{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_time", "parameters": {"zone": "CET"}}', None,
         [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
        ("The weather in Paris is mild.", "The weather in Paris is mild.", []),
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', None,
         [("get_weather", WEATHER)]),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}, '
         '{"name": "get_time", "arguments": {"zone": "CET"}}]', None,
         [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', None, [("get_weather", WEATHER)]),
        ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
         "Checking.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
        ("No tools needed [TOOL here.", "No tools needed [TOOL here.", []),
    ],
}
PARAMS = [(family, *case) for family, cases in CASES.items() for case in cases]


def _calls(parsed) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


@pytest.mark.parametrize(("family", "text", "content", "calls"), PARAMS)
def test_whole_answer(family, text, content, calls):
    parsed = parse(scanner(family), text)
    assert parsed.content == content
    assert _calls(parsed) == calls


def _streamed(family: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The stream's events joined: the content, and each call's name and arguments; checks OpenAI's order (a
    call opened once, with the next index, before its arguments)."""
    stream = ToolStream(scanner(family))
    events = [event for piece in pieces for event in stream.feed(piece)] + stream.finish()
    content, calls = "", []
    for event in events:
        if isinstance(event, Content):
            assert event.text
            content += event.text
        elif isinstance(event, CallOpened):
            assert event.index == len(calls)
            calls.append([event.name, ""])
        else:
            assert isinstance(event, ArgumentsAdded) and event.index == len(calls) - 1 and event.text
            calls[event.index][1] += event.text
    return content, [(name, arguments) for name, arguments in calls]


@pytest.mark.parametrize(("family", "text", "content", "calls"), PARAMS)
def test_streamed_deltas_join_into_the_whole_answer(family, text, content, calls):
    whole = parse(scanner(family), text)
    expected = (whole.content or "", [(call.name, call.arguments) for call in whole.calls])
    generator = random.Random(len(text))
    chunkings = [[text], list(text)]
    for _ in range(30):
        cuts = sorted(generator.sample(range(1, len(text)), min(len(text) - 1, generator.randint(1, 12))))
        chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for pieces in chunkings:
        assert _streamed(family, pieces) == expected, pieces


def test_no_marker_part_is_sent_as_content():
    stream = ToolStream(scanner("hermes"))
    sent = [event for piece in ["Hi ", "<tool", "_ca"] for event in stream.feed(piece)]
    assert sent == [Content("Hi ")]
    events = stream.feed('ll>{"name": "f", "arguments": {"a": 1')
    assert events == [CallOpened(0, "f"), ArgumentsAdded(0, '{"a": 1')]
    assert stream.feed("}}</tool_call>") == [ArgumentsAdded(0, "}")]


def test_arguments_stream_as_they_are_written():
    stream = ToolStream(scanner("mistral"))
    assert stream.feed("[TOOL_CALLS]get_wea") == []
    assert stream.feed("ther[ARGS]") == [CallOpened(0, "get_weather")]
    assert stream.feed('{"city": "Pa') == [ArgumentsAdded(0, '{"city": "Pa')]
    assert stream.feed('ris"}') == [ArgumentsAdded(0, 'ris"}')]


def test_parallel_false_keeps_the_first_call():
    text = CASES["hermes"][1][0]
    assert [call.name for call in parse(scanner("hermes"), text, parallel=False).calls] == ["get_weather"]
    stream = ToolStream(scanner("hermes"), parallel=False)
    events = stream.feed(text) + stream.finish()
    assert [event.name for event in events if isinstance(event, CallOpened)] == ["get_weather"]


@pytest.mark.parametrize("family", list(CASES))
def test_a_long_call_cut_inside_strings_and_escapes(family):
    """The stream goes on scanning a growing call where it stopped (inside a string, after an escape): pieces of
    3 characters cut everywhere, and the arguments still join into the whole answer's."""
    arguments = json.dumps({"code": 'print("a\\tb")\n' * 200, "items": [{"k": [i, {"v": "}{"}]} for i in range(50)]})
    text = {"hermes": f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>',
            "llama3_json": f'{{"name": "f", "parameters": {arguments}}}',
            "mistral": f"[TOOL_CALLS]f[ARGS]{arguments}"}[family]
    assert parse(scanner(family), text).calls[0].arguments == arguments
    assert _streamed(family, [text[at:at + 3] for at in range(0, len(text), 3)]) == ("", [("f", arguments)])
