"""Streamed generation requests as a client sees them: the server-sent events of OpenAI's `/v1/completions` and of
Triton's `/v2/models/X/generate_stream`, read into one `Streamed` per request (time to first token, tokens,
errors), and a closed-loop load of such requests.

Both endpoints answer `data: {json}` events; OpenAI's end with `data: [DONE]`. The first token is the first event
that carries one: OpenAI's first chunk with non-empty text, generate_stream's first response whose
`sequence_length` is past its `prefix_length`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

_DATA = b"data:"
_DONE = b"[DONE]"


@dataclass
class Streamed:
    """One request's stream: what was asked, when its first token and its end came (perf_counter seconds)."""

    asked: int
    sent: float
    first: float | None = None
    done: float = 0.0
    tokens: int = 0
    error: str = ""


class OpenAIStream:
    """Reads a `/v1/completions` stream: tokens from the final `usage` (include_usage), which must equal `max_tokens`,
    and every choice must finish with `length` (the benchmark's end token is never picked)."""

    def __init__(self, result: Streamed) -> None:
        self.result = result
        self.finish: str | None = None
        self.usage = False

    def event(self, chunk: dict[str, Any], now: float) -> None:
        if "error" in chunk:
            self.result.error = str(chunk["error"])[:300]
            return
        for choice in chunk.get("choices") or ():
            if self.result.first is None and choice.get("text"):
                self.result.first = now
            self.finish = choice.get("finish_reason") or self.finish
        usage = chunk.get("usage")
        if usage:
            self.result.tokens = int(usage["completion_tokens"])
            self.usage = True

    def end(self) -> None:
        result = self.result
        if result.error:
            return
        if not self.usage:
            result.error = "no usage chunk"
        elif result.tokens != result.asked:
            result.error = f"usage says {result.tokens} completion tokens, {result.asked} asked"
        elif self.finish != "length":
            result.error = f"finish_reason {self.finish!r}, 'length' expected"


class GenerateStream:
    """Reads a `/generate_stream` stream: each response's new tokens are its `sequence_length` less its
    `prefix_length`; their sum must equal what was asked."""

    def __init__(self, result: Streamed) -> None:
        self.result = result

    def event(self, response: dict[str, Any], now: float) -> None:
        if "error" in response:
            self.result.error = str(response["error"])[:300]
            return
        new = int(np.ravel(response["sequence_length"])[0]) - int(np.ravel(response["prefix_length"])[0])
        if new > 0 and self.result.first is None:
            self.result.first = now
        self.result.tokens += new

    def end(self) -> None:
        result = self.result
        if not result.error and result.tokens != result.asked:
            result.error = f"{result.tokens} tokens streamed, {result.asked} asked"


Reader = Callable[[Streamed], "OpenAIStream | GenerateStream"]


async def read_stream(lines: AsyncIterable[bytes], reader: OpenAIStream | GenerateStream) -> None:
    """Feed every `data:` event of `lines` to `reader`, stamped with its arrival, until `[DONE]` or the end."""
    async for line in lines:
        if not line.startswith(_DATA):
            continue
        payload = line[len(_DATA):].strip()
        if payload == _DONE:
            break
        try:
            reader.event(orjson.loads(payload), time.perf_counter())
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            reader.result.error = f"bad event {payload[:200]!r}: {exc!r}"
            break
    reader.end()


@dataclass
class Run:
    """One endpoint under the closed-loop load: the requests that ended inside the measured window."""

    key: str
    label: str
    seconds: float = 0.0
    finished: list[Streamed] = field(default_factory=list)
    #: The client process's CPU time over the window's wall time (near 1.0: the client limited the rate).
    client_cpu: float = 0.0
    #: Cores' worth of CPU other processes used during the run.
    background: float = 0.0
    #: Cores' worth of CPU the server (its children included) used over the run, warm-up included.
    server_cores: float = 0.0
    note: str = ""

    @property
    def errors(self) -> list[Streamed]:
        return [r for r in self.finished if r.error]

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.finished if not r.error)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def ttft_ms(self, q: float) -> float:
        values = [(r.first - r.sent) * 1000 for r in self.finished if not r.error and r.first is not None]
        return float(np.percentile(values, q)) if values else float("nan")

    def latency_ms(self, q: float) -> float:
        values = [(r.done - r.sent) * 1000 for r in self.finished if not r.error]
        return float(np.percentile(values, q)) if values else float("nan")

    def summary(self) -> dict[str, Any]:
        """The numbers for JSON output, not every request."""
        return {"key": self.key, "label": self.label, "seconds": self.seconds, "requests": len(self.finished),
                "tokens": self.tokens, "tokens_per_s": self.rate, "ttft_p50_ms": self.ttft_ms(50),
                "ttft_p90_ms": self.ttft_ms(90), "latency_p50_ms": self.latency_ms(50),
                "errors": len(self.errors), "client_cpu": self.client_cpu, "server_cores": self.server_cores,
                "other_work_cores": self.background,
                "note": self.note}


async def closed_loop(url: str, bodies: list[tuple[bytes, int]], reader: Reader, concurrency: int, warmup: float,
                      duration: float, run: Run) -> None:
    """`concurrency` clients, each sending its next request when its last one ended; requests that end inside
    the window after `warmup` count. `bodies`: each request's JSON and the tokens it asks for."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=900)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    start = time.perf_counter() + warmup
    end = start + duration
    cpu: list[float] = []

    async def sample_cpu() -> None:
        await asyncio.sleep(start - time.perf_counter())
        cpu.append(time.process_time())
        await asyncio.sleep(end - time.perf_counter())
        cpu.append(time.process_time())

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client(index: int) -> None:
            while (sent := time.perf_counter()) < end:
                body, asked = bodies[index % len(bodies)]
                index += concurrency
                result = Streamed(asked, sent)
                async with session.post(url, data=body, headers=headers) as response:
                    if response.status != 200:
                        result.error = f"HTTP {response.status}: {(await response.read())[:300]!r}"
                    else:
                        await read_stream(response.content, reader(result))
                result.done = time.perf_counter()
                if start <= result.done <= end:
                    if result.error and not run.errors:
                        print(f"  {run.key}: {result.error}", file=sys.stderr)
                    run.finished.append(result)

        await asyncio.gather(sample_cpu(), *(client(i * 7919 % len(bodies)) for i in range(concurrency)))
    run.seconds = duration
    run.client_cpu = (cpu[1] - cpu[0]) / duration
