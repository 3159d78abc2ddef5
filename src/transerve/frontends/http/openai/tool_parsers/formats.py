"""The tool-call formats of the model families, each read from text that may still be growing.

Every format is one function `scan(text, final, memo) -> segments`: the text split, in order, into the text outside the
calls (`str`) and the calls (`PartialCall`). While `final` is false, what the text so far cannot settle is held
back (a possible start of a marker, a call whose name is not whole), and each later scan of a longer text only
extends the earlier one: its outside text grows, its calls keep their names and their arguments grow. That is what
lets one function serve both the whole answer and the stream. Arguments are the model's own text of the arguments
value, so streamed fragments join into exactly the string the whole answer gives.

- `hermes` (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, with text
  between them.
- `llama3_json` (Llama 3.1/3.2/3.3): the answer is the call, `{"name": ..., "parameters": {...}}`, possibly after
  `<|python_tag|>`, several separated by `;`; an answer that does not start so is text.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers), and
  `[TOOL_CALLS]name[ARGS]{...}` repeated (v11 and later).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from transerve.frontends.http.openai.tool_parsers.scan import Memo, object_fields, skip_space, value_end


@dataclass(slots=True)
class PartialCall:
    name: str
    #: The arguments' text so far (the whole of it once `done`); "{}" for a call whose object has none.
    arguments: str
    done: bool


Segment = str | PartialCall
Scan = Callable[[str, bool, Memo | None], list[Segment]]

_CALL, _UNDECIDED, _BROKEN = "call", "undecided", "broken"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def held(tail: str, markers: tuple[str, ...]) -> int:
    """How many of the tail's last characters could begin one of the markers (and so must wait)."""
    for size in range(min(len(tail), max(len(marker) for marker in markers) - 1), 0, -1):
        if any(marker.startswith(tail[-size:]) for marker in markers):
            return size
    return 0


def _settled(tail: str, final: bool, markers: tuple[str, ...]) -> str:
    return tail if final else tail[:len(tail) - held(tail, markers)]


def call_object(text: str, start: int, final: bool, argument_keys: tuple[str, ...], memo: Memo | None = None
                ) -> tuple[str, PartialCall | None, int | None]:
    """The call written as a JSON object at `start`: (state, call, end past its `}`). `undecided` while its name is
    not whole; `broken` when it is not a call object (a key no call has, a name that is not a string)."""
    fields = object_fields(text, start, memo)
    allowed = {"name", "type", "id", *argument_keys}
    if any(key not in allowed for key in fields.spans):
        return _BROKEN, None, None
    name = fields.whole(text, "name")
    if "name" in fields.spans and fields.spans["name"][1] is not None and not (
            isinstance(name, str) and _NAME.fullmatch(name)):
        return _BROKEN, None, None
    if not isinstance(name, str):
        return (_BROKEN if fields.broken or fields.end is not None or final else _UNDECIDED), None, None
    done = fields.end is not None or fields.broken or final
    key = next((key for key in argument_keys if key in fields.spans), None)
    if key is None:
        arguments = "{}" if done else ""
    else:
        begin, end = fields.spans[key]
        if text[begin] == '"':  # arguments written as a JSON string: given out decoded, once whole
            decoded = fields.whole(text, key)
            arguments = decoded if isinstance(decoded, str) else ""
        else:
            arguments = text[begin:end if end is not None else len(text)]
    return _CALL, PartialCall(name, arguments, done), fields.end


# ---- Hermes / Qwen ---------------------------------------------------------------------------------------------

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def hermes(text: str, final: bool, memo: Memo | None = None) -> list[Segment]:
    segments: list[Segment] = []
    pos = 0
    while True:
        at = text.find(_HERMES_OPEN, pos)
        if at < 0:
            segments.append(_settled(text[pos:], final, (_HERMES_OPEN,)))
            return segments
        segments.append(text[pos:at])
        body = at + len(_HERMES_OPEN)
        close = text.find(_HERMES_CLOSE, body)
        region = text if close < 0 else text[:close]
        state, call, _ = call_object(region, body, final or close >= 0, ("arguments", "parameters"),
                                     memo if close < 0 else None)
        if state == _CALL and call is not None:
            segments.append(call)
        elif close >= 0:  # not a call: the marker and what it holds are text
            segments.append(text[at:close + len(_HERMES_CLOSE)])
        elif final:
            segments.append(text[at:])
        if close < 0:
            return segments
        pos = close + len(_HERMES_CLOSE)


# ---- Llama 3 JSON ----------------------------------------------------------------------------------------------

_PYTHON_TAG = "<|python_tag|>"


def llama3_json(text: str, final: bool, memo: Memo | None = None) -> list[Segment]:
    start = skip_space(text, 0)
    rest = text[start:]
    if rest.startswith(_PYTHON_TAG):
        at = start + len(_PYTHON_TAG)
    elif rest.startswith("{"):
        at = start
    elif not final and _PYTHON_TAG.startswith(rest):  # nothing yet, or the tag's first part
        return []
    else:
        return [text]
    segments: list[Segment] = []
    while True:
        state, call, end = call_object(text, at, final, ("parameters", "arguments"), memo)
        if state == _BROKEN or (state == _UNDECIDED and final):
            segments.append(text if not segments else text[at:])
            return segments
        if call is None:
            return segments
        segments.append(call)
        if end is None:
            return segments
        after = skip_space(text, end)
        if after >= len(text):
            if final:
                segments.append(text[end:])
            return segments
        if text[after] != ";":
            segments.append(text[end:])
            return segments
        at = after + 1


# ---- Mistral ---------------------------------------------------------------------------------------------------

_MISTRAL_CALLS, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def mistral(text: str, final: bool, memo: Memo | None = None) -> list[Segment]:
    segments: list[Segment] = []
    pos = 0
    while True:
        at = text.find(_MISTRAL_CALLS, pos)
        if at < 0:
            segments.append(_settled(text[pos:], final, (_MISTRAL_CALLS,)))
            return segments
        segments.append(text[pos:at])
        first = skip_space(text, at + len(_MISTRAL_CALLS))
        if first >= len(text):
            if final:
                segments.append(text[at:])
            return segments
        parsed = (_mistral_list if text[first] == "[" else _mistral_named)(text, first, final, memo)
        if parsed is None:  # held: the calls are not settled yet
            return segments
        calls, after = parsed
        if not calls:  # not calls after all: the marker is text
            segments.append(text[at:after] if after is not None else text[at:])
        segments.extend(calls)
        if after is None:
            return segments
        pos = after


def _mistral_list(text: str, start: int, final: bool, memo: Memo | None) -> tuple[list[Segment], int | None] | None:
    """`[{...}, {...}]`: the calls and where the text after the list starts (None: the list is still open)."""
    calls: list[Segment] = []
    at = start + 1
    while True:
        state, call, end = call_object(text, skip_space(text, at), final, ("arguments",), memo)
        if state == _BROKEN or (state == _UNDECIDED and final):
            return ([], None) if not calls else (calls, None)
        if call is None:
            return (calls, None) if calls else None
        calls.append(call)
        if end is None:
            return calls, None
        after = skip_space(text, end)
        if after >= len(text):
            return calls, None
        if text[after] == ",":
            at = after + 1
        elif text[after] == "]":
            return calls, after + 1
        else:
            return calls, after


def _mistral_named(text: str, start: int, final: bool, memo: Memo | None) -> tuple[list[Segment], int | None] | None:
    """`name[ARGS]{...}`: one call and where the text after it starts (None: it is still open)."""
    marker = text.find(_MISTRAL_ARGS, start)
    name = text[start:marker if marker >= 0 else len(text)]
    name = name[:len(name) - (0 if marker >= 0 else held(name, (_MISTRAL_ARGS,)))].strip()
    if marker < 0:
        if final or (name and not _NAME.fullmatch(name[:64])) or len(name) > 64:
            return [], None
        return None
    if not _NAME.fullmatch(name):
        return [], marker
    begin = skip_space(text, marker + len(_MISTRAL_ARGS))
    if begin >= len(text):
        return [PartialCall(name, "{}" if final else "", final)], None
    if text[begin] != "{":
        return [], begin
    end = value_end(text, begin, memo)
    return [PartialCall(name, text[begin:end if end is not None else len(text)], end is not None or final)], end


PARSERS: dict[str, Scan] = {"hermes": hermes, "llama3_json": llama3_json, "mistral": mistral}
#: Formats whose markers are special tokens, which decoding must keep (`skip_special_tokens` off) to see them.
SPECIAL_MARKERS = frozenset({"mistral"})
