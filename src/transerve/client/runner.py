"""Lines in, answers out in input order: batches of lines sent by `concurrency` threads, written as the batch at the
head of the queue is answered.

A request of several lines that the server refuses (400) is sent again line by line, so one bad line fails alone.
Blank lines (empty or spaces) are answered empty without a request. At most twice `concurrency` batches wait to
be written, so memory stays bounded however long the file is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice

from transerve.client.errors import LineFailed
from transerve.client.files import Line

#: Sends texts in one request; returns one answer per text, or raises LineFailed (the request's fault) or
#: RunStopped (the run's).
Send = Callable[[list[str]], list[str]]


@dataclass(slots=True)
class Outcome:
    """What became of a batch's lines: answers in line order, a failed line's answer empty."""

    answers: list[str] = field(default_factory=list)
    failures: list[tuple[int, str]] = field(default_factory=list)  # (line number, why)


def answer_batch(lines: list[Line], send: Send) -> Outcome:
    outcome = Outcome([""] * len(lines))
    asked = [index for index, line in enumerate(lines) if line.text and not line.text.isspace()]
    outcome.failures += [(line.number, line.problem) for line in lines if line.text is None]
    if not asked:
        return outcome
    try:
        answers = send([lines[index].text or "" for index in asked])
    except LineFailed as exc:
        if len(asked) == 1:
            outcome.failures.append((lines[asked[0]].number, str(exc)))
            answers = [""]
        else:
            answers = []
            for index in asked:  # find the bad lines: each alone
                one = answer_batch([lines[index]], send)
                answers += one.answers
                outcome.failures += one.failures
    for index, answer in zip(asked, answers, strict=True):
        outcome.answers[index] = answer
    outcome.failures.sort()
    return outcome


def answer_lines(lines: Iterator[Line], batch_size: int, concurrency: int, send: Send,
                 on_outcome: Callable[[list[Line], Outcome], None]) -> None:
    """Answer every line; `on_outcome` gets each batch in input order. A RunStopped from `send` ends the run once
    the batches before it are handed over (later ones are dropped: a rerun redoes them)."""
    window: deque[tuple[list[Line], Future[Outcome]]] = deque()
    executor = ThreadPoolExecutor(concurrency, thread_name_prefix="transerve-client")
    try:
        while True:
            while len(window) < 2 * concurrency and (batch := list(islice(lines, batch_size))):
                window.append((batch, executor.submit(answer_batch, batch, send)))
            if not window:
                return
            batch, future = window.popleft()
            on_outcome(batch, future.result())
    finally:
        for _, future in window:
            future.cancel()
        executor.shutdown(wait=True, cancel_futures=True)
