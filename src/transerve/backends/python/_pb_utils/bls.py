"""The answers of a BLS call as the model sees them: one response, or a ResponseIterator over a decoupled
model's responses, waited for on the worker's channel (blocking, or awaited in `async def execute`)."""

from __future__ import annotations

import asyncio
from typing import Any

from transerve.backends.python._pb_utils import link
from transerve.backends.python._pb_utils.errors import TritonError
from transerve.backends.python._pb_utils.link import _require_channel
from transerve.backends.python._pb_utils.responses import InferenceResponse
from transerve.backends.python._pb_utils.tensors import Tensor
from transerve.backends.python.channel import BlsCall
from transerve.backends.python.ipc import OP_CANCEL
from transerve.backends.python.shm import Entry


class ResponseIterator:
    """The responses of a BLS request to a decoupled model, as they arrive; ends after the final one.

    Iterate it with `for` (blocking) or `async for`; as in Triton, iterating it again once it has
    ended starts over from the first response.
    """

    __slots__ = ("_call_id", "_call", "_responses", "_index", "_finished")

    def __init__(self, call_id: int, call: BlsCall) -> None:
        self._call_id = call_id
        self._call = call
        self._responses: list[InferenceResponse] = []
        self._index = 0
        self._finished = False

    def __iter__(self) -> ResponseIterator:
        if self._finished and self._index >= len(self._responses):
            self._index = 0
        return self

    def __next__(self) -> InferenceResponse:
        if self._index < len(self._responses):
            self._index += 1
            return self._responses[self._index - 1]
        if self._finished:
            raise StopIteration
        call = self._call
        _require_channel().wait_until(lambda: bool(call.items))
        return self._take()

    def __aiter__(self) -> ResponseIterator:
        return self.__iter__()

    async def __anext__(self) -> InferenceResponse:
        if self._index < len(self._responses):
            self._index += 1
            return self._responses[self._index - 1]
        if self._finished:
            raise StopAsyncIteration
        await _arrival(self._call)
        return self._take()

    def _take(self) -> InferenceResponse:
        body, tensors = self._call.items.popleft()
        response = _bls_response(body, tensors)
        self._responses.append(response)
        self._index += 1
        if body[0]:
            self._finished = True
            _require_channel().finish_bls(self._call_id)
        return response

    def cancel(self) -> None:
        """Cancel the request (as later Triton python backends do; 2.51's has no `cancel`): the called model
        sees `is_cancelled()`, and the iterator ends with a final response carrying a CANCELLED error, after
        any responses already received."""
        if not self._finished:
            _require_channel().cancel_bls(self._call_id)

    def __del__(self) -> None:
        if not self._finished:
            # No lock here (a finalizer may run while this thread holds one): the flag, deque.clear() and
            # deque.append() are atomic; dropping the answers frees the shared memory their tensors hold, and
            # the cancellation goes out with the next message the worker sends.
            self._call.abandoned = True
            self._call.items.clear()
            if link._channel is not None:
                link._channel.later.append((OP_CANCEL, self._call_id, None))


async def _arrival(call: BlsCall) -> None:
    """Wait for a BLS call's next answer: on the loop that reads the worker's socket, await it; on any
    other loop, let a thread wait (and read the socket itself if nobody is)."""
    if call.items:
        return
    channel = _require_channel()
    loop = asyncio.get_running_loop()
    if channel.loop is loop:
        await call.wait()
    else:
        await loop.run_in_executor(None, channel.wait_until, lambda: bool(call.items))


def _finish_single(call_id: int, call: BlsCall) -> InferenceResponse:
    _require_channel().finish_bls(call_id)
    return _bls_response(*call.items.popleft())


def _bls_response(body: tuple[bool, tuple[str, str] | None, dict[str, Any] | None], tensors: list[Entry]
                  ) -> InferenceResponse:
    """A BLS answer as the model sees it: outputs, or an error with its code."""
    _, error, parameters = body
    response = InferenceResponse.__new__(InferenceResponse)
    response._output_tensors = [Tensor._wrap(name, datatype, data) for name, datatype, data in tensors]
    response._error = None if error is None else TritonError(error[1], TritonError.Code[error[0]])
    response._parameters = parameters or {}
    return response
