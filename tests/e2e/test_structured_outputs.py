"""Structured outputs end to end: a random-weight GPT-2 served by the torch engine still answers schema-valid JSON,
regex, choice and grammar matches under grammar-constrained decoding, through the OpenAI API (chat and completions,
streamed and not, greedy and sampled, with `response_format`, vLLM's `structured_outputs` and `guided_*`) and
through `/v2/models/.../generate` as request parameters; constrained and free requests share the running batch.
Bad schemas and grammars are 400s naming the problem, a CTranslate2 model's a 400 naming the engine, and the server
serves on. Every JSON answer is checked with jsonschema."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from support import start_transerve
from support.openai_models import build_chat_gpt2

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
transformers = pytest.importorskip("transformers")
pytest.importorskip("llguidance")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("ctranslate2")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person."}]
MAX_TOKENS = 96
SAMPLED = {"temperature": 1.0, "seed": 7}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transerve.convert.command import convert

    root = tmp_path_factory.mktemp("structured")
    folder = build_chat_gpt2(root / "gpt2")
    repository = root / "repository"
    for name, engine in (("gpt", "torch"), ("gpt_ct2", "ctranslate2")):
        convert(folder, repository, engine=engine, name=name, max_batch_size=8, decoupled=True)
    with start_transerve(repository, "--strict-readiness=false") as server:
        yield server, transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def client(served):
    server, _ = served
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as opened:
        yield opened


def _chat(client, stream: bool, **fields) -> tuple[str, str]:
    """The answer's text and finish reason."""
    if not stream:
        answer = client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=MAX_TOKENS, **fields)
        return answer.choices[0].message.content, answer.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True,
                                                **fields):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def _completion(client, stream: bool, **fields) -> tuple[str, str]:
    if not stream:
        answer = client.completions.create(model="gpt", prompt="A person:", max_tokens=MAX_TOKENS, **fields)
        return answer.choices[0].text, answer.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.completions.create(model="gpt", prompt="A person:", max_tokens=MAX_TOKENS, stream=True,
                                           **fields):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, SAMPLED])
def test_json_schema_on_both_endpoints(client, stream, sampling):
    text, finish = _chat(client, stream, response_format=FORMAT, **sampling)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert finish == "stop"
    text, finish = _completion(client, stream, extra_body={"response_format": FORMAT}, **sampling)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert finish == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_fields_and_json_object(client, stream):
    text, _ = _chat(client, stream, extra_body={"structured_outputs": {"json": SCHEMA}}, **SAMPLED)
    jsonschema.validate(json.loads(text), SCHEMA)
    text, _ = _completion(client, stream, extra_body={"guided_json": SCHEMA}, temperature=0)
    jsonschema.validate(json.loads(text), SCHEMA)
    text, _ = _completion(client, stream, extra_body={"guided_regex": r"[A-Z][a-z]{2,6} [0-9]{2}"}, **SAMPLED)
    assert re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{2}", text), text
    text, _ = _chat(client, stream, extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert text in ("red", "green", "blue")
    text, _ = _chat(client, stream, extra_body={"guided_choice": ["yes", "no"]}, **SAMPLED)
    assert text in ("yes", "no")
    grammar = 'start: "(" item (", " item)* ")"\nitem: /[a-z]{1,5}/ | NUMBER\nNUMBER: /[0-9]{1,3}/\n'
    text, _ = _completion(client, stream, extra_body={"guided_grammar": grammar}, **SAMPLED)
    assert re.fullmatch(r"\(([a-z]{1,5}|[0-9]{1,3})(, ([a-z]{1,5}|[0-9]{1,3}))*\)", text), text
    text, finish = _chat(client, stream, response_format={"type": "json_object"}, max_completion_tokens=400)
    if finish == "stop":  # any object may outgrow a budget; when it ends, it is a whole object
        assert isinstance(json.loads(text), dict)


def test_constrained_and_free_requests_share_the_batch(client):
    def constrained(seed: int) -> None:
        text, _ = _chat(client, seed % 2 == 0, response_format=FORMAT, temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(text), SCHEMA)

    def free(seed: int) -> None:
        answer = client.completions.create(model="gpt", prompt="Free text", max_tokens=32, temperature=1.0,
                                           seed=seed)
        assert answer.choices[0].finish_reason in ("stop", "length")

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(constrained if index % 2 else free, index) for index in range(16)]
        for future in futures:
            future.result(timeout=180)


def test_generate_endpoint_takes_the_constraint_as_parameters(served):
    server, tokenizer = served
    ids = tokenizer.encode("A person:")
    for parameters in ({"guided_json": json.dumps(SCHEMA)}, {"response_format": json.dumps(FORMAT)},
                       {"structured_outputs": json.dumps({"json": SCHEMA}), "runtime_top_k": 8, "random_seed": 3}):
        body = {"input_ids": ids, "sequence_length": len(ids), "max_tokens": MAX_TOKENS, **parameters}
        answer = requests.post(f"{server.base_url}/v2/models/gpt/generate", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        document = answer.json()
        output = document["output_ids"]
        length = document["sequence_length"][0] if isinstance(document["sequence_length"], list) \
            else document["sequence_length"]
        flat = output[0] if isinstance(output[0], list) else output
        new = [token for token in flat[len(ids):length] if token != tokenizer.eos_token_id]
        jsonschema.validate(json.loads(tokenizer.decode(new)), SCHEMA)


@pytest.mark.parametrize(("fields", "named"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}}, "if"),
    ({"guided_json": {"$ref": "#/nowhere"}}, "nowhere"),
    ({"guided_regex": "[a-"}, "unclosed character class"),
    ({"guided_grammar": "start: missing_rule\n"}, "missing_rule"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_bad_constraints_are_400s_naming_the_problem(client, fields, named):
    for call in (lambda: client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=4,
                                                        extra_body=fields),
                 lambda: client.completions.create(model="gpt", prompt="x", max_tokens=4, extra_body=fields)):
        with pytest.raises(openai.BadRequestError) as raised:
            call()
        assert named in json.dumps(raised.value.body), raised.value.body
    answer = client.completions.create(model="gpt", prompt="still serving", max_tokens=2)
    assert answer.choices[0].text is not None


def test_ctranslate2_refuses_structured_outputs(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="gpt_ct2", messages=MESSAGES, max_tokens=4, response_format=FORMAT)
    assert "torch engine" in json.dumps(raised.value.body)


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_under_a_grammar(served, width):
    """Each beam keeps its own grammar state, branched with the beam: every hypothesis a beam search returns
    matches (a JSON schema, a choice), however few tokens the grammar leaves the beams."""
    server, tokenizer = served
    ids = tokenizer.encode("A person:")
    cases = (({"guided_json": json.dumps(SCHEMA)}, 160), ({"guided_choice": json.dumps(["yes", "no", "maybe"])}, 8))
    for constraint, max_tokens in cases:
        body = {"input_ids": ids, "sequence_length": len(ids), "max_tokens": max_tokens, "beam_width": width,
                "num_return_sequences": width, **constraint}
        answer = requests.post(f"{server.base_url}/v2/models/gpt/generate", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        document = answer.json()
        lengths = document["sequence_length"]  # [width]; output_ids [width, longest] comes flat, as JSON gives it
        assert len(lengths) == width, document
        longest = len(document["output_ids"]) // width
        outputs = [document["output_ids"][beam * longest:(beam + 1) * longest] for beam in range(width)]
        for output, length in zip(outputs, lengths, strict=True):
            text = tokenizer.decode(output[len(ids):length], skip_special_tokens=True)
            if "guided_json" in constraint:
                jsonschema.validate(json.loads(text), SCHEMA)
            else:
                assert text in ("yes", "no", "maybe"), text


class Person(pydantic.BaseModel):
    """LangChain's structured output target: the same fields as SCHEMA, bounded so a random model ends them."""

    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)
    ok: bool


@pytest.mark.parametrize("method", ["json_schema", "json_mode"])
def test_langchain_with_structured_output(served, method):
    """`ChatOpenAI.with_structured_output` as LangChain apps call it: json_schema sends a strict `response_format`
    schema and gets a Person back; json_mode sends `{"type": "json_object"}` and gets a dict parsed from the answer."""
    langchain_openai = pytest.importorskip("langchain_openai")
    server, _ = served
    # Any JSON object may go on past the budget, and greedily this random model's does: json_mode samples with a
    # seed whose object ends (in 25 tokens, with this model and prompt).
    fields = {"temperature": 0} if method == "json_schema" else {"temperature": 1.0, "seed": 3}
    model = langchain_openai.ChatOpenAI(model="gpt", base_url=f"{server.base_url}/v1", api_key="x", max_tokens=300,
                                        max_retries=0, timeout=120, **fields)
    if method == "json_schema":
        person = model.with_structured_output(Person, method="json_schema").invoke("Describe a person.")
        assert isinstance(person, Person)
        jsonschema.validate(person.model_dump(), Person.model_json_schema())
    else:
        answer = model.with_structured_output(None, method="json_mode").invoke("Describe a person as JSON.")
        assert isinstance(answer, dict)
