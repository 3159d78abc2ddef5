"""Tool calls in OpenAI's answer documents: a whole message's `tool_calls`, and the stream's tool-call deltas.

A streamed call goes out as OpenAI streams one: a first delta with its `index`, `id`, `type` and `function.name`
(and `arguments` ""), then deltas with its `index` and the next piece of `function.arguments`; text outside the
calls goes as `content` deltas, in order. Ids are `call_` and 24 random hex digits, unique per call. An answer
decoded under `required`'s or a named function's schema is read as that JSON instead of by a parser.
"""

from __future__ import annotations

from typing import Any

from transerve.frontends.http.openai.tool_parsers import ToolStream, parse
from transerve.frontends.http.openai.tool_parsers.stream import ArgumentsAdded, CallOpened, Content, Event
from transerve.frontends.http.openai.tools import ToolReader, call_id, calls_from_output


def tool_message(reader: ToolReader, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message for a whole answer, and whether it calls tools."""
    if reader.forced is not None:
        calls = calls_from_output(reader.forced, text)
        content = None if calls else text
    else:
        assert reader.scan is not None
        parsed = parse(reader.scan, text, reader.parallel, reader.drop)
        calls, content = parsed.calls, parsed.content
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": call_id(), "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}} for call in calls]
    return message, bool(calls)


class StreamedCalls:
    """Each streamed choice's parser, by choice index."""

    def __init__(self, reader: ToolReader) -> None:
        self._reader = reader
        self._streams: dict[int, ToolStream] = {}
        #: `required`: each choice's JSON so far, read once whole.
        self._decoded: dict[int, str] = {}
        self._called: set[int] = set()

    def deltas(self, index: int, text: str, finished: bool) -> list[dict[str, Any]]:
        """The chat deltas the choice's new text makes (none while it is held back)."""
        events = self._forced(index, text, finished) if self._reader.forced is not None else \
            self._parsed(index, text, finished)
        deltas: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, Content):
                deltas.append({"content": event.text})
            elif isinstance(event, CallOpened):
                deltas.append({"tool_calls": [{"index": event.index, "id": call_id(), "type": "function",
                                               "function": {"name": event.name, "arguments": ""}}]})
            elif isinstance(event, ArgumentsAdded):
                deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
        return deltas

    def _parsed(self, index: int, text: str, finished: bool) -> list[Event]:
        stream = self._streams.get(index)
        if stream is None:
            assert self._reader.scan is not None
            stream = self._streams[index] = ToolStream(self._reader.scan, self._reader.parallel, self._reader.drop)
        events = stream.feed(text) if text else []
        if finished:
            events += stream.finish()
        if stream.called:
            self._called.add(index)
        return events

    def _forced(self, index: int, text: str, finished: bool) -> list[Event]:
        """A named function's arguments stream as they are decoded; `required`'s calls go once the JSON is whole."""
        request = self._reader.forced
        assert request is not None
        events: list[Event] = []
        if request.named:
            if index not in self._called:
                self._called.add(index)
                events.append(CallOpened(0, request.choice))
            return events + ([ArgumentsAdded(0, text)] if text else [])
        self._decoded[index] = self._decoded.get(index, "") + text
        if not finished:
            return events
        whole = self._decoded.pop(index)
        calls = calls_from_output(request, whole)
        if not calls:  # cut before the JSON ended: the text stays content
            return [Content(whole)] if whole else []
        self._called.add(index)
        for number, call in enumerate(calls):
            events += [CallOpened(number, call.name), ArgumentsAdded(number, call.arguments)]
        return events

    def called(self, index: int) -> bool:
        return index in self._called
