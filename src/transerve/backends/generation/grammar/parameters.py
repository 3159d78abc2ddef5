"""The request parameters that ask for a structured output, as vLLM and OpenAI name them, each to a `Constraint`:

- `guided_json` (a JSON schema, as an object or JSON text), `guided_regex`, `guided_choice` (a list of strings or
  its JSON text), `guided_grammar` (Lark, or GBNF/EBNF), vLLM's older names;
- `structured_outputs`, vLLM's object: exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` (true);
- `response_format`, OpenAI's: `{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"name": ...,
  "schema": {...}, "strict": ...}}` or `{"type": "text"}` (no constraint).

A request names at most one of them (the decoding options refuse a second). KServe parameters are scalars, so the
objects may come as JSON text."""

from __future__ import annotations

import json
from typing import Any

from transerve.backends.generation.grammar.constraint import Constraint, constraint
from transerve.core.errors import invalid_arg

GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
#: `structured_outputs`' keys and the constraint kind of each.
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}
PARAMETERS = (*GUIDED, "structured_outputs", "response_format")


def parameter_constraint(key: str, value: Any) -> Constraint | None:
    """The constraint request parameter `key` (one of `PARAMETERS`) asks for; None for `response_format` text."""
    if key in GUIDED:
        return constraint(GUIDED[key], value, key)
    given = _object(key, value)
    if key == "structured_outputs":
        return _structured_outputs(given)
    return response_format(given)


def response_format(given: dict[str, Any], field: str = "response_format") -> Constraint | None:
    """OpenAI's `response_format` object's constraint (None for `{"type": "text"}`)."""
    kind = given.get("type")
    if kind == "text" and len(given) == 1:
        return None
    if kind == "json_object" and len(given) == 1:
        return constraint("json_object", None, field)
    if kind == "json_schema":
        spec = given.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid_arg(f"'{field}.json_schema' must be an object with a 'schema'")
        unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
        if unknown or set(given) != {"type", "json_schema"}:
            raise invalid_arg(f"'{field}' holds fields not supported here: "
                              f"{', '.join(unknown or sorted(set(given) - {'type', 'json_schema'}))}")
        if not isinstance(spec.get("strict", False), bool) and spec.get("strict") is not None:
            raise invalid_arg(f"'{field}.json_schema.strict' must be a boolean")
        return constraint("json_schema", spec["schema"], f"{field}.json_schema.schema")
    raise invalid_arg(f"'{field}' must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or "
                      "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}")


def _structured_outputs(given: dict[str, Any]) -> Constraint:
    named = [(key, value) for key, value in given.items() if value is not None and value is not False]
    unknown = sorted(key for key, _ in named if key not in STRUCTURED_KEYS)
    if unknown:
        raise invalid_arg(f"'structured_outputs.{unknown[0]}' is not supported; supported: "
                          f"{', '.join(STRUCTURED_KEYS)}")
    if len(named) != 1:
        raise invalid_arg("'structured_outputs' must name exactly one of " + ", ".join(STRUCTURED_KEYS))
    key, value = named[0]
    if key == "json_object" and value is not True:
        raise invalid_arg("'structured_outputs.json_object' must be true")
    return constraint(STRUCTURED_KEYS[key], value, f"structured_outputs.{key}")


def _object(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise invalid_arg(f"'{key}' is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise invalid_arg(f"'{key}' must be an object")
    return value
