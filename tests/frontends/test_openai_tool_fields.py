"""tools.py without a server: the structured-output seam for `required` and named choices, and the history's
tool fields as templates get them; the Mistral parser's special-token text taken out of the answer."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from transerve.frontends.http.openai import tools
from transerve.frontends.http.openai.catalog import GENERATE, TEXT
from transerve.frontends.http.openai.errors import ApiError
from transerve.frontends.http.openai.tool_parsers import ToolStream, parse, scanner
from transerve.frontends.http.openai.tool_parsers.stream import ArgumentsAdded, CallOpened, Content

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_named_choice_schema_is_the_functions_parameters():
    request = tools.ToolRequest([WEATHER, TIME], "get_weather", named=True)
    assert tools.output_schema(request) == WEATHER["function"]["parameters"]
    [call] = tools.calls_from_output(request, '{"city": "Paris"}')
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})


def test_required_schema_takes_calls_of_the_tools_only():
    request = tools.ToolRequest([WEATHER, TIME], "required")
    schema = tools.output_schema(request)
    answer = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(answer, schema)
    wrongs = ([], [{"name": "get_weather", "parameters": {"town": "Paris"}}], [{"name": "other", "parameters": {}}])
    for wrong in wrongs:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    calls = tools.calls_from_output(request, json.dumps(answer))
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [("get_weather", {"city": "Paris"}),
                                                                          ("get_time", {})]
    single = tools.output_schema(tools.ToolRequest([WEATHER, TIME], "required", parallel=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(answer, single)


def test_required_and_named_are_decoded_under_the_schema_by_generators_only():
    generator = SimpleNamespace(id="gpt", kind=GENERATE, tool_parser=None)
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        request = tools.tool_request({"tools": [WEATHER, TIME], "tool_choice": choice})
        assert request is not None
        reader = tools.reader(request, generator, {})  # no parser needed: the schema decides the calls
        assert reader is not None and reader.forced is request
        assert reader.structured == {"guided_json": json.dumps(tools.output_schema(request))}
        with pytest.raises(ApiError) as raised:
            tools.reader(request, SimpleNamespace(id="t", kind=TEXT, tool_parser="hermes"), {})
        assert raised.value.param == "tool_choice" and "text model" in raised.value.message
    assert tools.calls_from_output(tools.ToolRequest([WEATHER], "required"), '[{"name": "get_weather", "par') == []
    request = tools.tool_request({"tools": [WEATHER], "parallel_tool_calls": False})
    assert request is not None and request.choice == "auto" and not request.parallel


def test_history_tool_calls_reach_the_template_with_object_arguments():
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]}
    fields = tools.history_fields(message, "assistant", "messages[1]")
    assert [call["function"]["arguments"] for call in fields["tool_calls"]] == [{"city": "Paris"}, "not json"]
    assert tools.history_fields({"role": "tool", "tool_call_id": "call_1", "content": "21"}, "tool", "m") == {
        "tool_call_id": "call_1"}
    with pytest.raises(ApiError) as raised:
        tools.history_fields({"tool_calls": []}, "user", "messages[0]")
    assert raised.value.param == "messages[0].tool_calls"


def test_mistral_special_token_text_is_taken_out():
    text = '<s>[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>'
    parsed = parse(scanner("mistral"), text, drop=("<s>", "</s>"))
    assert parsed.content is None and [(call.name, call.arguments) for call in parsed.calls] == [
        ("get_weather", '{"city": "Paris"}')]
    stream = ToolStream(scanner("mistral"), drop=("<s>", "</s>"))
    events = [event for piece in ("Sure.", "</", "s>") for event in stream.feed(piece)] + stream.finish()
    assert events == [Content("Sure.")]
    stream = ToolStream(scanner("mistral"), drop=("</s>",))
    events = [event for piece in ('[TOOL_CALLS]f[ARGS]{"a": 1}', "</", "s>") for event in stream.feed(piece)]
    assert events + stream.finish() == [CallOpened(0, "f"), ArgumentsAdded(0, '{"a": 1}')]
