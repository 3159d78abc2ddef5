"""The grammar module (backends/generation/grammar) on a real tokenizer: constraints checked at parse time (400s
naming the problem), compiled once per constraint (bounded cache), and masks that keep decoding from random logits,
greedy and sampled, inside the constraint, with unconstrained rows in the same batch left alone."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")

from transerve.backends.generation.grammar.compiler import GrammarCompiler  # noqa: E402
from transerve.backends.generation.grammar.constraint import Constraint, constraint  # noqa: E402
from transerve.backends.generation.grammar.masks import apply_masks  # noqa: E402
from transerve.core.errors import ServerError  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "unit", "days", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    from support.generation_models import build_generation_model

    path = build_generation_model("gpt2", tmp_path_factory.mktemp("grammar") / "gpt2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    compiler = GrammarCompiler.from_model_dir(path, vocab, [tokenizer.eos_token_id], torch.device("cpu"))
    return compiler, tokenizer, vocab


def _decode(compiler, tokenizer, vocab, constraints, sampled, steps=120, seed=0):
    """Decode one batch row per constraint (None: unconstrained) from random logits; the texts of the rows."""
    generator = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    rows = [compiler.row(c, [eos]) if c is not None else None for c in constraints]
    tokens: list[list[int]] = [[] for _ in constraints]
    ended = [False] * len(constraints)
    for _ in range(steps):
        live = [i for i, done in enumerate(ended) if not done]
        if not live:
            break
        logits = torch.randn(len(live), vocab, generator=generator) * 4
        apply_masks([(place, rows[i]) for place, i in enumerate(live) if rows[i] is not None], logits)
        if sampled:
            chosen = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0].tolist()
        else:
            chosen = logits.argmax(-1).tolist()
        for place, i in enumerate(live):
            token = chosen[place]
            grammar = rows[i]
            ended[i] = grammar.consume(token) if grammar is not None else len(tokens[i]) >= 20
            if token != eos:
                tokens[i].append(token)
    assert all(ended[i] for i, c in enumerate(constraints) if c is not None), [tokenizer.decode(t) for t in tokens]
    return [tokenizer.decode(t) for t in tokens]


@pytest.mark.parametrize("sampled", [False, True])
def test_constrained_rows_match_beside_free_ones(gpt2, sampled):
    compiler, tokenizer, vocab = gpt2
    schema = constraint("json_schema", SCHEMA, "guided_json")
    regex = constraint("regex", r"[0-9]{3}-[a-z]{2,4}", "guided_regex")
    choice = constraint("choice", ["yes", "no", "maybe so"], "guided_choice")
    grammar = constraint("grammar", 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/\n', "guided_grammar")
    for seed in range(3):
        texts = _decode(compiler, tokenizer, vocab, [schema, None, regex, choice, None, grammar], sampled, seed=seed)
        jsonschema.validate(json.loads(texts[0]), SCHEMA)
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", texts[2]), texts[2]
        assert texts[3] in ("yes", "no", "maybe so")
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", texts[5]), texts[5]


def test_any_json_object(gpt2):
    """Random logits rarely close a string (one token of hundreds), hence the long budget."""
    compiler, tokenizer, vocab = gpt2
    for seed in range(2):
        text, = _decode(compiler, tokenizer, vocab, [constraint("json_object", None, "response_format")], True,
                        steps=20000, seed=seed)
        assert isinstance(json.loads(text), dict)


def test_compiled_once_and_bounded(gpt2):
    compiler, _, _ = gpt2
    small = GrammarCompiler(compiler.tokenizer, compiler.vocab_size, compiler.eos_ids, torch.device("cpu"),
                            cache_size=2)
    first = constraint("regex", "a+", "guided_regex")
    for _ in range(3):
        small.row(first, [])
    assert small.compiled == 1
    for pattern in ("b+", "c+", "d+"):
        small.row(constraint("regex", pattern, "guided_regex"), [])
    assert small.compiled == 4 and len(small._cache) == 2
    small.row(first, [])  # evicted: compiled again
    assert small.compiled == 5


@pytest.mark.parametrize(("kind", "value", "named"), [
    ("json_schema", {"type": "object", "if": {"type": "object"}}, "if"),
    ("json_schema", {"$ref": "#/definitions/missing"}, "missing"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", {"type": "string", "pattern": "[a-"}, "unclosed character class"),
    ("regex", "[a-", "unclosed character class"),
    ("grammar", "start: foo\n", 'unknown name: "foo"'),
    ("grammar", "", "non-empty"),
    ("choice", [], "non-empty list"),
    ("choice", ["a", 3], "non-empty list"),
    ("regex", "a" * 70000, "at most"),
])
def test_bad_constraints_are_400s_naming_the_problem(kind, value, named):
    with pytest.raises(ServerError) as raised:
        constraint(kind, value, "the_field")
    assert raised.value.code.name == "INVALID_ARG"
    assert "the_field" in str(raised.value) and named in str(raised.value)


def test_end_token_only_where_the_grammar_accepts(gpt2):
    compiler, tokenizer, vocab = gpt2
    eos = tokenizer.eos_token_id
    row = compiler.row(Constraint("regex", "ab|abab"), [eos, 7])
    logits = torch.zeros(1, vocab)
    apply_masks([(0, row)], logits)
    assert logits[0, eos] == -torch.inf and logits[0, 7] == -torch.inf
    for token in tokenizer.encode("ab"):
        assert not row.consume(token)
    logits = torch.zeros(1, vocab)
    apply_masks([(0, row)], logits)
    assert logits[0, eos] == 0 and logits[0, 7] == 0  # accepting: either end token may close it


def test_request_parameters_name_their_constraint():
    from transerve.backends.generation.grammar.parameters import parameter_constraint

    schema = json.dumps(SCHEMA)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    assert parameter_constraint("guided_json", schema) == Constraint("json_schema", schema)
    assert parameter_constraint("response_format", json.dumps(fmt)) == Constraint("json_schema", schema)
    assert parameter_constraint("response_format", {"type": "text"}) is None
    assert parameter_constraint("response_format", {"type": "json_object"}).kind == "json_object"
    assert parameter_constraint("structured_outputs", {"choice": ["a", "b"]}) == Constraint("choice", '["a", "b"]')
    assert parameter_constraint("structured_outputs", {"json_object": True}).kind == "json_object"
    for key, value, named in (("structured_outputs", {"regex": "a", "grammar": "b"}, "exactly one"),
                              ("structured_outputs", {"xml": "a"}, "structured_outputs.xml"),
                              ("response_format", {"type": "yaml"}, "response_format"),
                              ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
                              ("response_format", "{bad", "not valid JSON"),
                              ("guided_regex", 5, "guided_regex")):
        with pytest.raises(ServerError) as raised:
            parameter_constraint(key, value)
        assert named in str(raised.value)


def test_the_device_unpacking_equals_the_host_one(gpt2):
    """A GPU unpacks the masks with torch (`device_bias`); run here on the CPU, it gives the host's bias exactly."""
    from transerve.backends.generation.grammar.masks import _bias, device_bias

    compiler, tokenizer, vocab = gpt2
    rows = [compiler.row(constraint("json_schema", SCHEMA, "guided_json"), [tokenizer.eos_token_id]),
            compiler.row(Constraint("regex", "[0-9]+"), [])]
    buffer = compiler.masks.buffer(2)
    compiler.masks.executor.unsafe_compute_mask_ptr([(row.matcher, i) for i, row in enumerate(rows)],
                                                    buffer.data_ptr(), compiler.masks.words * 4, 2)
    host = _bias(buffer, compiler.masks, vocab)
    assert torch.equal(host, device_bias(buffer.clone(), compiler.masks.shifts, vocab))
    assert set(host.unique().tolist()) == {0.0, -torch.inf}
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    assert all(host[1, d] == 0 for d in digits) and host[1, tokenizer.convert_tokens_to_ids("a")] == -torch.inf


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_are_masked(gpt2, dtype):
    """Rows apart (a free row between) and in a GPU's compute types."""
    compiler, tokenizer, vocab = gpt2
    rows = [(0, compiler.row(Constraint("regex", "[0-9]+"), [])), (2, compiler.row(Constraint("regex", "x+"), []))]
    logits = torch.zeros(3, vocab, dtype=dtype)
    apply_masks(rows, logits)
    assert logits.dtype == dtype and bool((logits[1] == 0).all())
    seven, x = tokenizer.convert_tokens_to_ids("7"), tokenizer.convert_tokens_to_ids("x")
    assert logits[0, seven] == 0 and logits[0, x] == -torch.inf
    assert logits[2, x] == 0 and logits[2, seven] == -torch.inf
