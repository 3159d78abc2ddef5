"""Chat's tool fields: `tools`, `tool_choice` and `parallel_tool_calls` checked and bounded, the history's tool
messages and assistant tool calls put as chat templates read them, and what the answer's tool calls are made of.

Tools reach the template as transformers' `apply_chat_template(tools=...)` gives them: the request's JSON-schema
dicts as they are. An assistant message's `tool_calls` keep OpenAI's shape, their `arguments` decoded to an object
(templates write them with `tojson`, as transformers' documentation has it). With `tool_choice: "auto"` the model's
text is read by the model's parser (config parameter `openai_tool_call_parser`); `required` and a named function
have the answer decoded under a JSON schema (`output_schema`) by the engine's structured outputs, and the decoded
JSON is the calls (`calls_from_output`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from transerve.frontends.http.openai.catalog import GENERATE, OpenAIModel
from transerve.frontends.http.openai.errors import bad_request
from transerve.frontends.http.openai.tool_parsers import SPECIAL_MARKERS, scanner
from transerve.frontends.http.openai.tool_parsers.formats import Scan
from transerve.frontends.http.openai.tool_parsers.stream import ParsedCall

#: Bounds: tools per request (OpenAI's own), tool calls per history message, a parameters schema's nesting.
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128
MAX_SCHEMA_DEPTH = 32
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
CHOICES = ("none", "auto", "required")


@dataclass(slots=True)
class ToolRequest:
    """The request's tools (for the template) and how the answer may use them."""

    tools: list[dict[str, Any]]
    #: "none", "auto", "required", or the name of the one function to call.
    choice: str
    named: bool = False
    parallel: bool = True


@dataclass(slots=True)
class ToolReader:
    """How a choice's text becomes tool calls: the model's parser, and the special tokens' text to drop when the
    parser needed them decoded; or, for `required` and a named function, the request whose schema the answer was
    decoded under (`forced`, with the generator's structured-output parameter)."""

    scan: Scan | None
    parallel: bool
    drop: tuple[str, ...] = ()
    forced: ToolRequest | None = None
    structured: dict[str, str] | None = None


def tool_request(body: dict[str, Any]) -> ToolRequest | None:
    """The checked tool fields; None when the request has no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if body.get("functions") is not None or body.get("function_call") is not None:
        name = "functions" if body.get("functions") is not None else "function_call"
        raise bad_request(f"'{name}' is OpenAI's deprecated form: send 'tools' and 'tool_choice'", param=name)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
        if parallel is not None:
            raise bad_request("'parallel_tool_calls' needs 'tools'", param="parallel_tool_calls")
        return None
    checked = _tools(tools)
    names = [tool["function"]["name"] for tool in checked]
    request = ToolRequest(checked, *_choice(choice, names), parallel=True if parallel is None else parallel)
    if request.choice == "auto":
        for index, tool in enumerate(checked):
            if tool["function"].get("strict"):
                raise bad_request(f"'tools[{index}].function.strict': true is honoured with 'tool_choice' "
                                  "'required' or a named function (the arguments decoded under their schema); "
                                  "under 'auto' the model writes its calls freely",
                                  param=f"tools[{index}].function.strict")
    return request


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", param="tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' may hold at most {MAX_TOOLS} tools", param="tools")
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}: only function "
                              "tools are supported", param=where)
        _known(tool, _TOOL_KEYS, where)
        function = tool["function"]
        _known(function, _FUNCTION_KEYS, f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_request(f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-'",
                              param=f"{where}.function.name")
        if name in seen:
            raise bad_request(f"'{where}.function.name': two tools are named '{name}'", param=f"{where}.function.name")
        seen.add(name)
        if not isinstance(function.get("description", ""), str):
            raise bad_request(f"'{where}.function.description' must be a string",
                              param=f"{where}.function.description")
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict):
            raise bad_request(f"'{where}.function.parameters' must be a JSON schema object",
                              param=f"{where}.function.parameters")
        if _depth(parameters) > MAX_SCHEMA_DEPTH:
            raise bad_request(f"'{where}.function.parameters' nests deeper than {MAX_SCHEMA_DEPTH} levels",
                              param=f"{where}.function.parameters")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"'{where}.function.strict' must be a boolean", param=f"{where}.function.strict")
    return tools


def _known(given: dict[str, Any], known: frozenset[str], where: str) -> None:
    for key in given:
        if key not in known:
            raise bad_request(f"'{where}.{key}' is not supported", param=f"{where}.{key}")


def _depth(value: Any) -> int:
    """How deep the JSON value nests, without recursion (a hostile schema cannot exhaust the stack)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_SCHEMA_DEPTH:
            break
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        pending.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _choice(choice: Any, names: list[str]) -> tuple[str, bool]:
    if choice is None:
        return "auto", False
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise bad_request(f"'tool_choice' must be one of {', '.join(CHOICES)} or a named function, got "
                              f"{choice!r}", param="tool_choice")
        return choice, False
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request("'tool_choice' must be a string or {\"type\": \"function\", \"function\": {\"name\": "
                          "...}}", param="tool_choice")
    if name not in names:
        raise bad_request(f"'tool_choice' names function '{name}', which is not among the request's tools",
                          param="tool_choice")
    return name, True


def output_schema(request: ToolRequest) -> dict[str, Any]:
    """The JSON schema the answer must follow for `required` or a named function: a named function's arguments
    are its parameters; `required` answers an array of `{"name", "parameters"}` objects, one schema per tool (the
    shape vLLM decodes under), of one item when calls may not be parallel."""
    functions = {tool["function"]["name"]: tool["function"] for tool in request.tools}
    if request.named:
        return functions[request.choice].get("parameters") or {"type": "object"}
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                               "parameters": function.get("parameters") or {"type": "object"}},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, function in functions.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not request.parallel:
        schema["maxItems"] = 1
    return schema


def calls_from_output(request: ToolRequest, text: str) -> list[ParsedCall]:
    """The tool calls an answer decoded under `output_schema` stands for; none for an answer cut before its JSON
    ended (`max_tokens`), which then stays content."""
    if request.named:
        return [ParsedCall(request.choice, text)]
    try:
        items = json.loads(text)
        return [ParsedCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
    except (ValueError, TypeError, KeyError):
        return []


def reader(request: ToolRequest | None, entry: OpenAIModel, special_tokens: dict[str, str]) -> ToolReader | None:
    """How the answers are read: `auto` by the model's parser (a 400 when it has none); `required` and a named
    function decoded under `output_schema` (a generator's structured outputs: a 400 for a text model)."""
    if request is None or request.choice == "none":
        return None
    if request.choice != "auto":
        if entry.kind != GENERATE:
            raise bad_request(f"'tool_choice' {request.choice!r} decodes the answer under the tools' schemas, which "
                              f"a generator model does; model '{entry.id}' is a text model: use 'auto'",
                              param="tool_choice")
        return ToolReader(None, request.parallel, forced=request,
                          structured={"guided_json": json.dumps(output_schema(request))})
    if entry.tool_parser is None:
        raise bad_request(f"model '{entry.id}' names no tool-call parser (config parameter openai_tool_call_parser),"
                          " so its tool calls cannot be read: 'tool_choice' must be 'none'", param="tool_choice")
    drop = tuple(text for text in special_tokens.values()) if entry.tool_parser in SPECIAL_MARKERS else ()
    return ToolReader(scanner(entry.tool_parser), request.parallel, drop)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def history_fields(message: dict[str, Any], role: str, where: str) -> dict[str, Any]:
    """A history message's tool fields as templates read them: a tool message's `tool_call_id` (and `name`), an
    assistant message's `tool_calls` with their arguments as objects."""
    fields: dict[str, Any] = {}
    if role == "tool":
        call = message.get("tool_call_id")
        if not isinstance(call, str):
            raise bad_request(f"'{where}.tool_call_id' must be a string for role 'tool'", param=f"{where}.tool_call_id")
        fields["tool_call_id"] = call
    calls = message.get("tool_calls")
    if calls is None:
        return fields
    if role != "assistant":
        raise bad_request(f"'{where}.tool_calls' goes with role 'assistant' only", param=f"{where}.tool_calls")
    if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS:
        raise bad_request(f"'{where}.tool_calls' must be a list of at most {MAX_TOOL_CALLS} calls",
                          param=f"{where}.tool_calls")
    fields["tool_calls"] = [_history_call(call, f"{where}.tool_calls[{index}]") for index, call in enumerate(calls)]
    return fields


def _history_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not isinstance(function.get("arguments"), str) or not isinstance(call.get("id", ""), str):
        raise bad_request(f"'{where}' must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                          "\"arguments\": a JSON string}}}}", param=where)
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        arguments = function["arguments"]  # a model's malformed arguments, sent back as they were
    return {"id": call.get("id", ""), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}
