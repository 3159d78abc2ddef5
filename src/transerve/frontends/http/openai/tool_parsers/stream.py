"""A choice's text turned into OpenAI's tool-call results: whole (`parse`) and as stream deltas (`ToolStream`).

The stream re-scans the choice's text so far at each delta and sends only what is new: content, a call's opening
(its name, once whole) and its arguments' new characters. Each scan extends the previous one (formats.py), so the
deltas join into what `parse` gives for the whole text. Text outside the calls that is only whitespace is no
content (null) beside calls, so the stream holds such text back until something else comes (or the answer ends
without calls).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transerve.frontends.http.openai.tool_parsers.formats import PARSERS, PartialCall, Scan, held
from transerve.frontends.http.openai.tool_parsers.scan import Memo


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str


@dataclass(slots=True)
class Parsed:
    #: The text outside the calls; None when it is only whitespace (or nothing).
    content: str | None
    calls: list[ParsedCall]


def scanner(name: str) -> Scan:
    return PARSERS[name]


def parse(scan: Scan, text: str, parallel: bool = True, drop: tuple[str, ...] = ()) -> Parsed:
    """The whole answer's content and calls (only the first call when `parallel` is false); the `drop` strings
    (special tokens' text) are taken out first."""
    segments = scan(_dropped(text, drop, True), True, None)
    outside = "".join(segment for segment in segments if isinstance(segment, str))
    calls = [ParsedCall(segment.name, segment.arguments) for segment in segments if isinstance(segment, PartialCall)]
    return Parsed(outside if outside.strip() or not calls else None, calls if parallel else calls[:1])


def _dropped(text: str, drop: tuple[str, ...], final: bool) -> str:
    """The text without the `drop` strings; while not `final`, without a last part that could begin one."""
    if not drop:
        return text
    for piece in drop:
        text = text.replace(piece, "")
    return text if final else text[:len(text) - held(text, drop)]


@dataclass(slots=True)
class Content:
    text: str


@dataclass(slots=True)
class CallOpened:
    index: int
    name: str


@dataclass(slots=True)
class ArgumentsAdded:
    index: int
    text: str


Event = Content | CallOpened | ArgumentsAdded


@dataclass(slots=True)
class ToolStream:
    """One streamed choice's parser state: its text so far and what of it has gone out."""

    scan: Scan
    parallel: bool = True
    drop: tuple[str, ...] = ()
    text: str = ""
    _outside: str = ""
    _content_sent: int = 0
    _memo: Memo = field(default_factory=dict)
    _arguments_sent: list[str] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self._arguments_sent)

    def feed(self, text: str) -> list[Event]:
        self.text += text
        return self._new(self.scan(_dropped(self.text, self.drop, False), False, self._memo))

    def finish(self) -> list[Event]:
        """The last events; an answer without calls gets all its text, whitespace too."""
        events = self._new(self.scan(_dropped(self.text, self.drop, True), True, self._memo))
        if not self.called and len(self._outside) > self._content_sent:
            events.append(Content(self._outside[self._content_sent:]))
            self._content_sent = len(self._outside)
        return events

    def _new(self, segments: list[str | PartialCall]) -> list[Event]:
        events: list[Event] = []
        outside = ""
        number = 0
        for segment in segments:
            if isinstance(segment, str):
                outside += segment
                if outside.strip() and len(outside) > self._content_sent:
                    events.append(Content(outside[self._content_sent:]))
                    self._content_sent = len(outside)
                self._outside = outside
                continue
            index, number = number, number + 1
            if index > 0 and not self.parallel:
                continue
            if index == len(self._arguments_sent):
                events.append(CallOpened(index, segment.name))
                self._arguments_sent.append("")
            sent = self._arguments_sent[index]
            if len(segment.arguments) > len(sent) and segment.arguments.startswith(sent):
                events.append(ArgumentsAdded(index, segment.arguments[len(sent):]))
                self._arguments_sent[index] = segment.arguments
        return events
