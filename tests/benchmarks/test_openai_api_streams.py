"""benchmarks/openai_api.py: how a stream's events become one request's numbers, and which answers count as errors.

Measuring starts vLLM and transerve and takes minutes; these tests feed the readers the events the two endpoints
send, so a changed event format or check shows here first.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT))  # benchmarks run as modules from the repository root
    from benchmarks.common import streams

    return streams


def read(streams, reader, events: list[object]) -> None:
    async def lines():
        for event in events:
            yield b"data: " + (event if isinstance(event, bytes) else json.dumps(event).encode()) + b"\n"
            yield b"\n"

    asyncio.run(streams.read_stream(lines(), reader))


def completion(text: str, finish: str | None = None) -> dict[str, object]:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def usage(tokens: int) -> dict[str, object]:
    return {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}}


def test_an_openai_stream_counts_its_usage_and_its_first_text(streams) -> None:
    result = streams.Streamed(asked=3, sent=0.0)
    read(streams, streams.OpenAIStream(result),
         [completion(""), completion("a"), completion("bc", "length"), usage(3), b"[DONE]", completion("late")])
    assert result.error == ""
    assert result.tokens == 3
    assert result.first is not None and result.first > 0


@pytest.mark.parametrize(("events", "error"), [
    ([completion("a", "length")], "no usage chunk"),
    ([completion("a", "length"), usage(2)], "usage says 2 completion tokens, 3 asked"),
    ([completion("a", "stop"), usage(3)], "finish_reason 'stop'"),
    ([{"error": {"message": "boom"}}], "boom"),
    ([b"{not json"], "bad event"),
])
def test_an_openai_stream_that_is_short_or_broken_is_an_error(streams, events, error) -> None:
    result = streams.Streamed(asked=3, sent=0.0)
    read(streams, streams.OpenAIStream(result), events)
    assert error in result.error


def test_a_generate_stream_sums_each_responses_new_ids(streams) -> None:
    def response(length: int, prefix: int) -> dict[str, object]:
        return {"model_name": "gpt2s", "output_ids": list(range(length)), "sequence_length": [length],
                "prefix_length": [prefix]}

    result = streams.Streamed(asked=3, sent=0.0)
    read(streams, streams.GenerateStream(result), [response(5, 5), response(6, 5), response(8, 6), response(8, 8)])
    assert (result.error, result.tokens) == ("", 3)
    short = streams.Streamed(asked=4, sent=0.0)
    read(streams, streams.GenerateStream(short), [response(6, 5)])
    assert short.error == "1 tokens streamed, 4 asked"


def test_a_run_counts_only_tokens_of_requests_without_errors(streams) -> None:
    run = streams.Run("v1", "v1", seconds=2.0, finished=[
        streams.Streamed(4, 0.0, first=0.1, done=1.0, tokens=4),
        streams.Streamed(4, 0.0, first=0.3, done=1.0, tokens=2, error="short"),
    ])
    assert run.rate == 2.0
    assert run.ttft_ms(50) == pytest.approx(100.0)
    assert len(run.errors) == 1
