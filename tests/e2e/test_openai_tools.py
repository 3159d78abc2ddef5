"""Tool calling through /v1/chat/completions against a real server, with the `openai` client and LangChain.

A random-weight model would never write a tool call, so the model here is scripted: a python-backend text model
(`openai_api: completions`, `openai_tool_call_parser: hermes`) whose answer depends on its prompt: a Hermes tool
call for a question, a sentence once the prompt holds a tool result, and the prompt itself when asked to echo, which
shows what the chat template made of the tools and the history; that is compared with transformers'
`apply_chat_template(messages, tools=...)` on the same tokenizer folder.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from support import ServerProcess, start_transerve

openai = pytest.importorskip("openai")
pytest.importorskip("tokenizers")

#: Qwen 2.5's layout, shortened: the tools as JSON lines in the system block, calls and results in the history.
TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>tool
{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
#: What each scripted model answers a question with, in its parser's format: (parser, answer, content expected).
SCRIPTS = {
    "scripted": ("hermes", f'Let me look that up.<tool_call>\n{{"name": "get_weather", "arguments": {ARGUMENTS}}}\n'
                 "</tool_call>", "Let me look that up."),
    "scripted_llama": ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGUMENTS}}}', None),
    "scripted_mistral": ("mistral", f"Let me look that up.[TOOL_CALLS]get_weather[ARGS]{ARGUMENTS}",
                         "Let me look that up."),
    "unparsed": ("", "Let me look that up.<tool_call>{}</tool_call>", None),
}
ANSWER = "It is 21 degrees in Paris."
MODEL = '''import numpy as np
import triton_python_backend_utils as pb_utils

CALL = {call!r}


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy().reshape(-1)[0].decode()
            if "ECHO" in prompt:
                text = prompt
            elif "<|im_start|>tool" in prompt:
                text = {answer!r}
            else:
                text = CALL
            out = pb_utils.Tensor("TEXT", np.array([text.encode()], dtype=object))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
'''
CONFIG = """backend: "python"
max_batch_size: 0
input [ { name: "PROMPT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
parameters { key: "openai_api" value: { string_value: "completions" } }
parameters { key: "openai_text_input" value: { string_value: "PROMPT" } }
parameters { key: "openai_text_output" value: { string_value: "TEXT" } }
parameters { key: "openai_tokenizer" value: { string_value: "tokenizer" } }
"""
PARSER = 'parameters {{ key: "openai_tool_call_parser" value: {{ string_value: "{}" }} }}\n'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
DEEP = json.loads('{"a": ' + "[" * 40 + "]" * 40 + "}")
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def _write_repository(root: Path) -> Path:
    from support.generation_models import _save_tokenizer, _train_tokenizer

    repository = root / "repository"
    for name, (parser, call, _) in SCRIPTS.items():
        folder = repository / name / "1"
        (folder / "tokenizer").mkdir(parents=True)
        _save_tokenizer(folder / "tokenizer", _train_tokenizer(["<|endoftext|>"], None, 300),
                        {"eos_token": "<|endoftext|>"})
        (folder / "tokenizer" / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
        (folder / "model.py").write_text(MODEL.format(call=call, answer=ANSWER), encoding="utf-8")
        (repository / name / "config.pbtxt").write_text(CONFIG + (PARSER.format(parser) if parser else ""),
                                                        encoding="utf-8")
    return repository


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    return _write_repository(tmp_path_factory.mktemp("openai_tools"))


@pytest.fixture(scope="module")
def server(repository) -> Iterator[ServerProcess]:
    with start_transerve(repository) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as opened:
        yield opened


def _post(server: ServerProcess, body: dict) -> requests.Response:
    return requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)


PARSED = ["scripted", "scripted_llama", "scripted_mistral"]


@pytest.mark.parametrize("model", PARSED)
def test_auto_answer_has_the_parsed_tool_call(client, model):
    answer = client.chat.completions.create(model=model, messages=QUESTION, tools=[WEATHER, TIME])
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == SCRIPTS[model][2]
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


@pytest.mark.parametrize("model", PARSED)
def test_streamed_tool_call_deltas(server, client, model):
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, tools=[WEATHER],
                                                 stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    content = "".join(delta.content or "" for delta in deltas)
    calls = [call for delta in deltas for call in delta.tool_calls or []]
    assert content == (SCRIPTS[model][2] or "")
    first, rest = calls[0], calls[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert rest and all(call.index == 0 and call.id is None and call.function.name is None for call in rest)
    arguments = "".join(call.function.arguments for call in rest)
    assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    if content:  # the content came before the call, as the model wrote it
        assert deltas.index(next(d for d in deltas if d.content)) < deltas.index(next(d for d in deltas
                                                                                     if d.tool_calls))


def test_tools_and_history_reach_the_template_as_transformers_gives_them(server, repository):
    transformers = pytest.importorskip("transformers")
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}, {"role": "user", "content": "ECHO"}]
    answer = _post(server, {"model": "scripted", "messages": history, "tools": [WEATHER, TIME],
                            "tool_choice": "none"})
    assert answer.status_code == 200, answer.text
    message = answer.json()["choices"][0]["message"]
    assert "tool_calls" not in message and answer.json()["choices"][0]["finish_reason"] == "stop"
    tokenizer = transformers.AutoTokenizer.from_pretrained(repository / "scripted" / "1" / "tokenizer")
    as_documented = [*history[:1], {**history[1], "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, *history[2:]]
    expected = tokenizer.apply_chat_template(as_documented, tools=[WEATHER, TIME], add_generation_prompt=True,
                                             tokenize=False)
    assert message["content"] == expected
    assert '"name": "get_weather"' in expected and '{"city": "Paris"}' in expected
    tokenized = requests.post(f"{server.base_url}/tokenize", json={"model": "scripted", "messages": history,
                                                                    "tools": [WEATHER, TIME]}, timeout=60)
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == tokenizer.encode(expected, add_special_tokens=False)


@pytest.mark.parametrize(("body", "param", "mentions"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be one of"),
    ({"tool_choice": "auto"}, "tool_choice", "needs 'tools'"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "only function tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name", "1 to 64"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "two tools are named"),
    ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters",
     "JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]},
     "tools[0].function.parameters", "deeper than 32"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "tools[0].function.strict",
     "honoured with 'tool_choice' 'required'"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "is a text model"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
     "is a text model"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"functions": [WEATHER["function"]]}, "functions", "deprecated"),
    ({"messages": [{"role": "tool", "content": "21 C"}]}, "messages[0].tool_call_id", "must be a string"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0]", "JSON string"),
])
def test_bad_tool_fields_are_400s_naming_them(server, client, body, param, mentions):
    answer = _post(server, {"model": "scripted", "messages": QUESTION, **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and mentions in error["message"], error
    assert client.chat.completions.create(model="scripted", messages=QUESTION).choices[0].finish_reason == "stop"


def test_a_model_without_parser_refuses_auto(server):
    answer = _post(server, {"model": "unparsed", "messages": QUESTION, "tools": [WEATHER]})
    assert answer.status_code == 400 and "openai_tool_call_parser" in answer.json()["error"]["message"]
    answer = _post(server, {"model": "unparsed", "messages": QUESTION, "tools": [WEATHER], "tool_choice": "none"})
    assert answer.status_code == 200 and "<tool_call>" in answer.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def generator(tmp_path_factory) -> Iterator[tuple[ServerProcess, Path]]:
    """A random-weight GPT-2 generator (torch, decoupled) with the tools template and the hermes parser."""
    pytest.importorskip("torch")
    from support.openai_models import build_chat_gpt2

    from transerve.convert.command import convert

    root = tmp_path_factory.mktemp("openai_tools_gpt")
    repository = root / "repository"
    convert(build_chat_gpt2(root / "gpt2"), repository, engine="torch", name="gpt", max_batch_size=4,
            decoupled=True)
    (repository / "gpt" / "1" / "model" / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    with (repository / "gpt" / "config.pbtxt").open("a", encoding="utf-8") as config:
        config.write(PARSER.format("hermes"))
    with start_transerve(repository) as running:
        yield running, repository / "gpt" / "1" / "model"


def test_generator_with_tools_streams_the_same_answer(generator):
    """A generator's answer, read by the parser token by token: the stream's content is the whole answer's, with
    the same finish reason; the tools reached the template (the prompt's tokens are transformers' count)."""
    transformers = pytest.importorskip("transformers")
    server, folder = generator
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        asked = {"model": "gpt", "messages": QUESTION, "tools": [WEATHER, TIME], "max_tokens": 24, "temperature": 0}
        whole = client.chat.completions.create(**asked)
        chunks = list(client.chat.completions.create(**asked, stream=True))
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    deltas = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert "".join(part.delta.content or "" for part in deltas) == choice.message.content
    assert deltas[-1].finish_reason == choice.finish_reason
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(QUESTION, tools=[WEATHER, TIME], add_generation_prompt=True,
                                           tokenize=False)
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


#: Bounded so that a random-weight model's JSON under the schema ends within the tokens asked.
FORECAST = {"type": "function", "function": {"name": "forecast", "strict": True, "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["unit", "days"], "additionalProperties": False}}}
ALARM = {"type": "function", "function": {"name": "alarm", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}}}


def test_generator_named_and_required_choices_are_decoded_under_the_schemas(generator):
    """`required` and a named function on a random-weight generator: the calls' arguments are valid against their
    tools' schemas (jsonschema), whole and streamed; asking for another structured output beside them is a 400."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    server, _ = generator
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (FORECAST, ALARM)}
    named = {"type": "function", "function": {"name": "forecast"}}
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        # one call each: a random-weight model would go on adding calls to the array until max_tokens
        for choice, sampled in (("required", {"temperature": 0}), (named, {"temperature": 0}),
                                ("required", {"temperature": 1.0, "seed": 3})):
            answer = client.chat.completions.create(model="gpt", messages=QUESTION, tools=[FORECAST, ALARM],
                                                    tool_choice=choice, max_tokens=160, parallel_tool_calls=False,
                                                    **sampled)
            result = answer.choices[0]
            assert result.finish_reason == "tool_calls" and result.message.content is None, result
            assert result.message.tool_calls and len({call.id for call in result.message.tool_calls}) == len(
                result.message.tool_calls)
            for call in result.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            if choice == named:
                assert [call.function.name for call in result.message.tool_calls] == ["forecast"]
        chunks = list(client.chat.completions.create(model="gpt", messages=QUESTION, tools=[FORECAST, ALARM],
                                                     tool_choice=named, max_tokens=160, temperature=0, stream=True))
    calls = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "forecast"
    assert all(call.index == 0 and call.id is None for call in calls[1:])
    jsonschema.validate(json.loads("".join(call.function.arguments for call in calls)), schemas["forecast"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    both = requests.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": "gpt", "messages": QUESTION, "tools": [FORECAST], "tool_choice": "required",
        "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "tool_choice", both.text


def test_langchain_bind_tools_agent_loop(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: str = "celsius") -> str:
        """The weather in a city."""
        return f"21 degrees in {city}"

    model = langchain_openai.ChatOpenAI(model="scripted", base_url=f"{server.base_url}/v1", api_key="x",
                                        max_retries=0, timeout=60).bind_tools([get_weather])
    messages = [HumanMessage("What is the weather in Paris?")]
    reply = model.invoke(messages)
    assert [(call["name"], call["args"]) for call in reply.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    messages += [reply, ToolMessage(get_weather.invoke(reply.tool_calls[0]["args"]),
                                    tool_call_id=reply.tool_calls[0]["id"])]
    final = model.invoke(messages)
    assert final.content == ANSWER and not final.tool_calls
    streamed = None
    for piece in model.stream([HumanMessage("What is the weather in Paris?")]):
        streamed = piece if streamed is None else streamed + piece
    assert streamed is not None and [(call["name"], call["args"]) for call in streamed.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_langchain_forced_tool_agent_loop_on_a_generator(generator):
    """LangChain's `bind_tools` with a forced tool on the random-weight generator: the call's arguments follow the
    tool's schema, the tool's result goes back as a tool message, and the model answers with text."""
    langchain_openai = pytest.importorskip("langchain_openai")
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    from langchain_core.messages import HumanMessage, ToolMessage

    server, _ = generator
    model = langchain_openai.ChatOpenAI(model="gpt", base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                                        timeout=120, temperature=0, max_tokens=160)
    messages = [HumanMessage("What is the forecast?")]
    reply = model.bind_tools([FORECAST], tool_choice="forecast", parallel_tool_calls=False).invoke(messages)
    [call] = reply.tool_calls
    assert call["name"] == "forecast"
    jsonschema.validate(call["args"], FORECAST["function"]["parameters"])
    messages += [reply, ToolMessage("sunny", tool_call_id=call["id"])]
    final = model.bind_tools([FORECAST], tool_choice="none").invoke(messages)
    assert isinstance(final.content, str) and not final.tool_calls
