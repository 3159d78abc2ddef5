"""The trace extension's update requests, read as Triton 2.51 reads them, into the changes `Tracer.update` applies.

HTTP sends `{"trace_level": [...], "trace_rate": "N", ...}` with `null` clearing a field; gRPC sends a map of value
lists with an empty list clearing it. Numbers are strings read as C++'s `std::stoi` reads them (`"12abc"` is 12;
rate and log_frequency are then stored unsigned, so `"-1"` is 4294967295), unknown level names are ignored, and the
first bad field fails the whole update. A JSON value of the wrong type is a 400 here; Triton answers 500 to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transerve.core.errors import invalid_arg, unsupported
from transerve.core.tracing.options import OFF, TENSORS, TIMESTAMPS, OutOfRange, Unparsable, stoi
from transerve.core.tracing.tracer import CLEAR

FILE_MESSAGE = "trace file location can not be updated through network protocol"
_NOT_ARRAY = "attempt to access JSON non-array as array"
_NOT_STRING = "attempt to access JSON non-string as string"
#: Each number field: (the request's name, the change's field, the range Triton's message names).
_NUMBERS = (
    ("trace_rate", "rate", "[ 0, 4294967295 ]"),
    ("trace_count", "count", "[ -1, 2147483647 ]"),
    ("log_frequency", "log_frequency", "[ 0, 4294967295 ]"),
)


def changes_from_json(document: Any) -> dict[str, Any]:
    """The changes of an HTTP update body (already parsed; anything but an object changes nothing)."""
    if not isinstance(document, dict):
        return {}
    if "trace_file" in document:
        raise unsupported(FILE_MESSAGE)
    changes: dict[str, Any] = {}
    if "trace_level" in document:
        names = document["trace_level"]
        if names is None:
            changes["level"] = CLEAR
        else:
            if not isinstance(names, list):
                raise invalid_arg(_NOT_ARRAY)
            level = _level(names)
            if level is not None:
                changes["level"] = level
    for key, field, bounds in _NUMBERS:
        if key in document:
            text = document[key]
            if text is None:
                changes[field] = CLEAR
            elif not isinstance(text, str):
                raise invalid_arg(_NOT_STRING)
            else:
                changes[field] = _number(key, text, bounds, grpc=False)
    return changes


def changes_from_grpc(settings: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """The changes of a gRPC TraceSetting request's `settings` (name -> values)."""
    if "trace_file" in settings:
        raise unsupported(FILE_MESSAGE)
    changes: dict[str, Any] = {}
    if "trace_level" in settings:
        names = settings["trace_level"]
        level = _level(names) if names else CLEAR
        if level is not None:
            changes["level"] = level
    for key, field, bounds in _NUMBERS:
        if key in settings:
            values = settings[key]
            if not values:
                changes[field] = CLEAR
            elif len(values) > 1:
                raise invalid_arg(f"expect only 1 value for '{key}'")
            else:
                changes[field] = _number(key, values[0], bounds, grpc=True)
    return changes


def _level(names: Sequence[Any]) -> int | None:
    """The level a list of names sets, or None when it names no known level."""
    level = None
    for name in names:
        if not isinstance(name, str):
            raise invalid_arg(_NOT_STRING)
        if name == "OFF":
            if len(names) != 1:
                raise invalid_arg("Expect only one trace level 'OFF' is specified")
            level = OFF
        elif name == "TIMESTAMPS":
            level = (level or OFF) | TIMESTAMPS
        elif name == "TENSORS":
            level = (level or OFF) | TENSORS
    return level


def _number(key: str, text: str, bounds: str, grpc: bool) -> int:
    try:
        value = stoi(text)
    except Unparsable:
        raise invalid_arg(f"Unable to parse '{key}', got: {text}") from None
    except OutOfRange:
        raise invalid_arg(f"Unable to parse '{key}', value is out of range {bounds}, got: {text}") from None
    if key == "trace_count":
        if value < -1:  # the two frontends word it differently
            raise invalid_arg(f"Unable to parse 'trace_count'. Expecting value >= -1, got:{' ' if grpc else ''}{text}")
        return value
    return value & 0xFFFFFFFF
