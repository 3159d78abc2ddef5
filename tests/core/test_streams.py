"""ResponseStream: ordering, final flags, errors and cancellation."""

import asyncio

import numpy as np
import pytest

from transerve.core.errors import ServerError, internal
from transerve.core.streams import ResponseStream
from transerve.core.types import InferResponse, Tensor


def response(value: int) -> InferResponse:
    return InferResponse("m", "1", [Tensor("OUT", "INT32", np.array([value], np.int32))])


async def collect(stream: ResponseStream) -> list[int]:
    return [int(r.outputs[0].data[0]) async for r in stream]


def test_responses_arrive_in_order_and_final_ends_the_stream():
    async def scenario() -> list[int]:
        stream = ResponseStream(asyncio.get_running_loop())
        consumer = asyncio.ensure_future(collect(stream))
        for value in range(3):
            await asyncio.sleep(0)
            stream.send(response(value))
        stream.send(response(3), final=True)
        stream.send(response(4))  # after final: dropped
        assert stream.final_sent
        return await consumer

    assert asyncio.run(scenario()) == [0, 1, 2, 3]


def test_close_alone_and_errors_after_responses():
    async def scenario() -> None:
        stream = ResponseStream(asyncio.get_running_loop())
        stream.close()
        assert await collect(stream) == []
        failing = ResponseStream(asyncio.get_running_loop())
        failing.send(response(1))
        failing.fail(internal("boom"))
        seen = []
        with pytest.raises(ServerError, match="boom"):
            async for item in failing:
                seen.append(item)
        assert len(seen) == 1

    asyncio.run(scenario())


def test_cancel_runs_callbacks_once_and_late_registrations_at_once():
    async def scenario() -> list[str]:
        stream = ResponseStream(asyncio.get_running_loop())
        calls: list[str] = []
        stream.on_cancel(lambda: calls.append("early"))
        stream.send(response(1))
        stream.cancel()
        stream.cancel()
        stream.on_cancel(lambda: calls.append("late"))
        assert stream.cancelled
        return calls

    assert asyncio.run(scenario()) == ["early", "late"]
