"""ResponseStream: ordering, final flags, errors and cancellation."""

import asyncio

import numpy as np
import pytest

from transerve.core.errors import ErrorCode, ServerError, internal
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


def test_an_error_response_does_not_end_the_stream_unless_final():
    async def scenario() -> None:
        stream = ResponseStream(asyncio.get_running_loop())
        stream.send(response(1))
        stream.send_error(ServerError(ErrorCode.INVALID_ARG, "mid"))
        stream.send(response(2))
        stream.send_error(internal("last"), final=True)
        stream.send(response(3))  # after final: dropped
        seen: list[object] = []
        while True:
            try:
                async for item in stream:
                    seen.append(int(item.outputs[0].data[0]))
                break
            except ServerError as exc:
                seen.append(exc.message)  # iterating again goes on after the error
        assert seen == [1, "mid", 2, "last"]
        assert stream.final_sent

    asyncio.run(scenario())


def test_receive_tells_which_item_is_the_last():
    async def scenario() -> None:
        flags_alone = ResponseStream(asyncio.get_running_loop())
        flags_alone.send(response(1))
        flags_alone.close()
        assert [(item is None, final) for item, final in [await flags_alone.receive(), await flags_alone.receive()]] \
            == [(False, False), (True, True)]
        with pytest.raises(StopAsyncIteration):
            await flags_alone.receive()
        with_response = ResponseStream(asyncio.get_running_loop())
        with_response.send(response(1), final=True)
        item, final = await with_response.receive()
        assert final and int(item.outputs[0].data[0]) == 1
        failed = ResponseStream(asyncio.get_running_loop())
        failed.fail(internal("gone"))
        item, final = await failed.receive()
        assert isinstance(item, ServerError) and final and not failed.final_sent

    asyncio.run(scenario())


def test_cancel_ends_a_waiting_consumer_and_drops_later_responses():
    async def scenario() -> None:
        stream = ResponseStream(asyncio.get_running_loop())
        consumer = asyncio.ensure_future(collect(stream))
        await asyncio.sleep(0)
        stream.cancel()
        assert await asyncio.wait_for(consumer, 1) == []
        stream.send(response(1))
        with pytest.raises(StopAsyncIteration):
            await stream.receive()

    asyncio.run(scenario())
