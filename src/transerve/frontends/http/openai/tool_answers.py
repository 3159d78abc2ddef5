"""Tool calls in OpenAI's answer documents: a whole message's `tool_calls`, and the stream's tool-call deltas.

A streamed call goes out as OpenAI streams one: a first delta with its `index`, `id`, `type` and `function.name`
(and `arguments` ""), then deltas with its `index` and the next piece of `function.arguments`; text outside the
calls goes as `content` deltas, in order. Ids are `call_` and 24 random hex digits, unique per call.
"""

from __future__ import annotations

from typing import Any

from transerve.frontends.http.openai.tool_parsers import ToolStream, parse
from transerve.frontends.http.openai.tool_parsers.stream import ArgumentsAdded, CallOpened, Content
from transerve.frontends.http.openai.tools import ToolReader, call_id


def tool_message(reader: ToolReader, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message for a whole answer, and whether it calls tools."""
    parsed = parse(reader.scan, text, reader.parallel, reader.drop)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [{"id": call_id(), "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}}
                                 for call in parsed.calls]
    return message, bool(parsed.calls)


class StreamedCalls:
    """Each streamed choice's parser, by choice index."""

    def __init__(self, reader: ToolReader) -> None:
        self._reader = reader
        self._streams: dict[int, ToolStream] = {}

    def deltas(self, index: int, text: str, finished: bool) -> list[dict[str, Any]]:
        """The chat deltas the choice's new text makes (none while it is held back)."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = ToolStream(self._reader.scan, self._reader.parallel, self._reader.drop)
        events = stream.feed(text) if text else []
        if finished:
            events += stream.finish()
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

    def called(self, index: int) -> bool:
        stream = self._streams.get(index)
        return stream is not None and stream.called
