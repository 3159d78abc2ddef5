"""A tolerant scanner for the JSON a model writes inside a tool call, read while it is still being written.

The parsers need, on a text that may stop anywhere, where a JSON value ends (or that it has not ended yet) and the
spans of an object's top-level fields; they never need the values decoded until a field is whole. Strings and
escapes are tracked so that a brace inside a string is not counted; nothing else is validated here: the arguments
go out as the model wrote them, and a client parses them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_WHITESPACE = " \t\r\n"
#: What changes the scan's state: runs of other characters are skipped by the regex engine, not in Python (the
#: stream scans a growing call again at each delta).
_STRUCTURE = re.compile(r'["{}\[\]]')
_STRING_STOP = re.compile(r'["\\]')


def skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    return at


#: Where a stream's scan of an open value stopped, by the value's start: (depth, position, inside a string). The
#: stream's text only grows, so the next scan of the same value goes on from there instead of from its start.
Memo = dict[int, tuple[int, int, bool]]


def value_end(text: str, start: int, memo: Memo | None = None) -> int | None:
    """The index just past the JSON value starting at `start`, or None when the text ends first. A scalar
    (number, true, null) ends at the first character that cannot continue it, so at the text's end it is open."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start + 1)[0]
    if first in "{[":
        depth, at, in_string = memo.get(start, (0, start, False)) if memo is not None else (0, start, False)
        while True:
            if in_string:
                end, at = _string_end(text, at)
                if end is None:
                    break
                at, in_string = end, False
            found = _STRUCTURE.search(text, at)
            if found is None:
                at = len(text)
                break
            at, char = found.start(), found.group()
            if char == '"':
                at, in_string = at + 1, True
                continue
            depth += 1 if char in "{[" else -1
            at += 1
            if depth == 0:
                return at
        if memo is not None:
            memo[start] = (depth, at, in_string)
        return None
    at = start
    while at < len(text) and text[at] not in _WHITESPACE + ",}]":
        at += 1
    return at if at < len(text) else None


def _string_end(text: str, at: int) -> tuple[int | None, int]:
    """(just past the closing quote of the string whose characters go on at `at`, or None; where to go on)."""
    while (found := _STRING_STOP.search(text, at)) is not None:
        if found.group() == '"':
            return found.start() + 1, found.start() + 1
        if found.start() + 1 >= len(text):  # an escape cut at the text's end: read it again next time
            return None, found.start()
        at = found.start() + 2  # an escape: the next character is part of the string
    return None, len(text)


@dataclass(slots=True)
class Fields:
    """An object's top-level fields as far as the text goes: each key's value span (its end None while open)."""

    spans: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    #: Just past the closing brace; None while the object is open (or it broke off).
    end: int | None = None
    #: The object is not one a call can be: it does not start with `{`, a key is not a string, a field repeats.
    broken: bool = False

    def whole(self, text: str, key: str) -> object | None:
        """The field's value decoded, once it is whole and valid JSON; None otherwise."""
        span = self.spans.get(key)
        if span is None or span[1] is None:
            return None
        try:
            return json.loads(text[span[0]:span[1]])
        except ValueError:
            return None


def object_fields(text: str, start: int, memo: Memo | None = None) -> Fields:
    """The fields of the object at `start` (after any whitespace). Scanning stops at the first thing that is not
    `"key": value` followed by `,` or `}`: then the object is `broken`, with the fields read so far."""
    result = Fields()
    at = skip_space(text, start)
    if at >= len(text):
        return result
    if text[at] != "{":
        result.broken = True
        return result
    at += 1
    while True:
        at = skip_space(text, at)
        if at >= len(text):
            return result
        if text[at] == "}" and not result.spans:
            result.end = at + 1
            return result
        if text[at] != '"':
            result.broken = True
            return result
        key_end = _string_end(text, at + 1)[0]
        if key_end is None:
            return result
        try:
            key = json.loads(text[at:key_end])
        except ValueError:
            result.broken = True
            return result
        at = skip_space(text, key_end)
        if at >= len(text):
            return result
        if text[at] != ":" or key in result.spans:
            result.broken = True
            return result
        value_start = skip_space(text, at + 1)
        if value_start >= len(text):
            return result
        end = value_end(text, value_start, memo)
        result.spans[key] = (value_start, end)
        if end is None:
            return result
        at = skip_space(text, end)
        if at >= len(text):
            return result
        if text[at] == "}":
            result.end = at + 1
            return result
        if text[at] != ",":
            result.broken = True
            return result
        at += 1
