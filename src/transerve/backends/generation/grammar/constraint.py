"""A request's output constraint, engine-agnostic: what kind (`json_schema`, `json_object`, `regex`, `choice`,
`grammar`) and its text, checked when the request is parsed so that a bad schema or grammar is a 400 naming the
problem rather than a failure inside a running batch. Checking needs no tokenizer (llguidance validates the grammar
alone); compiling against the model's tokenizer happens in `compiler`, at submit."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from transerve.core.errors import invalid_arg
from transerve.core.extras import MissingExtra, import_optional

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
#: Bounds on what a client may send: the constraint's text (schema JSON, regex, grammar) and a choice list.
MAX_CONSTRAINT_CHARS = 65536
MAX_CHOICES = 1024
#: JSON is generated compact (no free whitespace between tokens): a model, random weights above all, could
#: otherwise spend its whole token budget on spaces and never close the document.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match. `text`: the schema as JSON (json_schema), the regex, the choices as a JSON
    list, or the grammar; empty for json_object. Hashable: the compiler caches by it."""

    kind: str
    text: str = ""

    def grammar(self) -> str:
        """The llguidance grammar this constraint compiles to (not validated: `check` does that)."""
        llguidance = _llguidance()
        matcher = llguidance.LLMatcher
        if self.kind == "json_schema":
            return matcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.text)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", self.text)
        return llguidance.grammar_from("grammar", self.text)  # Lark, or GBNF/EBNF converted to Lark


def constraint(kind: str, value: Any, field: str) -> Constraint:
    """The checked constraint of `kind` from a request's `value` (`field`: the name the client used, for the
    400). A schema may come as an object or as JSON text; choices as a list of strings or its JSON text."""
    if kind not in KINDS:
        raise invalid_arg(f"'{field}': unknown constraint kind {kind!r}; supported: {', '.join(KINDS)}")
    if kind == "json_schema":
        text = _schema_text(value, field)
    elif kind == "json_object":
        text = ""
    elif kind == "choice":
        text = _choices_text(value, field)
    else:
        if not isinstance(value, str) or not value:
            raise invalid_arg(f"'{field}' must be a non-empty string ({'a regex' if kind == 'regex' else 'a grammar'})")
        text = value
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise invalid_arg(f"'{field}' is {len(text)} characters; at most {MAX_CONSTRAINT_CHARS} are taken")
    checked = Constraint(kind, text)
    check(checked, field)
    return checked


def check(constraint: Constraint, field: str) -> None:
    """INVALID_ARG naming `field` and llguidance's message for a constraint it cannot compile: an unsupported
    schema keyword, a bad reference, a regex or grammar syntax error."""
    try:
        grammar = constraint.grammar()
    except ValueError as error:
        raise invalid_arg(f"'{field}': {error}") from None
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise invalid_arg(f"'{field}' is not supported for structured output: {error.strip()}")


def _schema_text(value: Any, field: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise invalid_arg(f"'{field}' is not valid JSON: {error}") from None
    if not isinstance(value, (dict, bool)):
        raise invalid_arg(f"'{field}' must be a JSON schema (an object), got {type(value).__name__}")
    return json.dumps(value)  # key order kept: properties are generated in the schema's order


def _choices_text(value: Any, field: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    if not isinstance(value, list) or not value or not all(isinstance(item, str) and item for item in value):
        raise invalid_arg(f"'{field}' must be a non-empty list of non-empty strings")
    if len(value) > MAX_CHOICES:
        raise invalid_arg(f"'{field}' holds {len(value)} choices; at most {MAX_CHOICES} are taken")
    return json.dumps(value)


def _llguidance():
    try:
        return import_optional("llguidance", "structured")
    except MissingExtra as error:
        raise invalid_arg(f"structured outputs are not installed on this server: {error}") from None
