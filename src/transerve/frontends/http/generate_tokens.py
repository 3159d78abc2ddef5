"""Token counts of `/v2/models/<generator>/generate[_stream]` requests, into the model's token statistics (vLLM's
`vllm:*` metrics), as the OpenAI layer counts its own.

Only a generation-backend model's responses say which of their ids are new: `sequence_length` (the ids so far) and
`prefix_length` (those the client already has, the prompt included), FasterTransformer's later names that
`transerve convert` writes. A request to any other model, or one whose responses lack these outputs, is not
counted. The prompt's tokens are the request's length input (`sequence_length`, `input_lengths` or
`REQUEST_INPUT_LEN`), else its ids' width.
"""

from __future__ import annotations

import time

import numpy as np

from transerve.core.streams import ResponseStream, StreamItem
from transerve.core.token_timing import TokenTimings
from transerve.core.types import InferRequest, InferResponse
from transerve.frontends.http.generate import TracedResponses
from transerve.server import ModelVersion

_LENGTH_INPUTS = ("sequence_length", "input_lengths", "REQUEST_INPUT_LEN")
_ID_INPUTS = ("input_ids", "INPUT_ID")


class CountedResponses:
    """A generate request's stream that counts the new ids of each response as it is taken, and records the
    request (its prompt and generated tokens, its time) when its final response is taken; a request cancelled or
    failed is not recorded. While it runs it counts among the model's running sequences."""

    __slots__ = ("_stream", "_timings", "_prompt", "_generated", "_started", "_last", "_countable", "_open")

    def __init__(self, stream: ResponseStream | TracedResponses, timings: TokenTimings, prompt_tokens: int) -> None:
        self._stream = stream
        self._timings = timings
        self._prompt = prompt_tokens
        self._generated = 0
        self._started = time.perf_counter()
        self._last: float | None = None
        self._countable = True
        self._open = True
        timings.active += 1

    @property
    def closed(self) -> bool:
        return self._stream.closed

    def cancel(self) -> None:
        self._end(finished=False)
        self._stream.cancel()

    async def receive(self) -> tuple[StreamItem, bool]:
        try:
            item, final = await self._stream.receive()
        except BaseException:  # the stream was cancelled, or the client went away while it waited
            self._end(finished=False)
            raise
        if isinstance(item, InferResponse):
            self._count(item)
        elif item is not None:  # an error response: the request failed
            self._countable = False
        if final:
            self._end(finished=True)
        return item, final

    def _count(self, response: InferResponse) -> None:
        outputs = {tensor.name: tensor.data for tensor in response.outputs}
        lengths, prefix = outputs.get("sequence_length"), outputs.get("prefix_length")
        if lengths is None or prefix is None:
            self._countable = False
            return
        lengths = np.asarray(lengths).reshape(len(lengths), -1)[:, 0]
        prefix = np.asarray(prefix).reshape(len(prefix), -1)[:, 0]
        new = int(np.maximum(lengths.astype(np.int64) - prefix.astype(np.int64), 0).sum())
        if not new:
            return
        now = time.perf_counter()
        if self._last is None:
            self._timings.first_token.observe(now - self._started)
        else:
            self._timings.inter_token.observe(now - self._last)
        self._last = now
        self._generated += new

    def _end(self, finished: bool) -> None:
        """Once: the request leaves the running count; one that ended with its final response is recorded."""
        if not self._open:
            return
        self._open = False
        self._timings.active -= 1
        if finished and self._countable and self._last is not None:
            self._timings.record_request(self._prompt, self._generated, time.perf_counter() - self._started)


def counted(model: ModelVersion, request: InferRequest,
            stream: ResponseStream | TracedResponses) -> ResponseStream | TracedResponses | CountedResponses:
    """The stream, counted when the model is a generator."""
    if model.config.backend != "generation":
        return stream
    return CountedResponses(stream, model.stats.tokens, _prompt_tokens(request))


def _prompt_tokens(request: InferRequest) -> int:
    inputs = {tensor.name: tensor.data for tensor in request.inputs}
    for name in _LENGTH_INPUTS:
        if name in inputs:
            return int(np.asarray(inputs[name]).astype(np.int64).sum())
    for name in _ID_INPUTS:
        if name in inputs:
            ids = np.asarray(inputs[name])
            return int(ids.size)
    return 0
