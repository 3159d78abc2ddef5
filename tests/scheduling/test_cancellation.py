"""What every scheduler does when a request's client goes away, in-process over a fake instance that can act on it:
a request still queued is dropped and counted as a CANCELED failure, a running one's instance is told and the
request is counted by how it ended. Also how the sequence batcher counts the runs of rescheduled requests."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
from support.scheduling import HeldInstance, model_config, run, settle

from transerve.backends.base import ExecutionResult, Rerun
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.stats import ModelStats
from transerve.core.types import InferRequest, InferResponse, Tensor
from transerve.scheduling import create_scheduler


class Cancellable(HeldInstance):
    """Answers each execution when the test says so (with `outcome` per request) and records what it was told."""

    cancellable = True
    max_inflight = 1

    def __init__(self) -> None:
        super().__init__("m_0")
        self.executed: list[list[int]] = []
        self.cancelled: list[int] = []

    def record(self, requests: list[InferRequest]) -> None:
        self.executed.append([value(request) for request in requests])

    def cancel(self, request: InferRequest) -> None:
        self.cancelled.append(value(request))

    def release(self, outcome: Callable[[InferRequest], InferResponse | ServerError] | None = None,
                reruns: list[Rerun] | None = None) -> None:
        future, requests = self._open.pop(0)
        answer = outcome or (lambda request: InferResponse("m", "1", [Tensor("OUT", "INT32", request.inputs[0].data)]))
        future.set_result(ExecutionResult([answer(request) for request in requests], 10, 20, 30, reruns))


def value(request: InferRequest) -> int:
    return int(request.inputs[0].data.reshape(-1)[0])


def config(scheduling: str) -> object:
    text = f"""
    name: "m" backend: "python" max_batch_size: 1
    input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
    output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
    {scheduling}
    """
    return model_config(text)


def request(number: int) -> InferRequest:
    return InferRequest("m", [Tensor("IN", "INT32", np.full((1, 1), number, np.int32))],
                        arrival_ns=time.monotonic_ns())


SCHEDULERS = {"direct": "", "dynamic": "dynamic_batching { }"}


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_a_request_cancelled_while_queued_is_dropped_and_counted_as_canceled(scheduler: str):
    async def test() -> None:
        instance, stats = Cancellable(), ModelStats()
        scheduling = create_scheduler("m", config(SCHEDULERS[scheduler]), [instance], stats)
        futures = [scheduling.submit(request(number)) for number in (1, 2, 3)]
        await settle()
        futures[1].cancel()
        await settle()
        assert stats.fail.count == 0  # found when the scheduler reaches it, as Triton's batcher finds it
        instance.release()
        await settle()
        instance.release()
        assert (await futures[0]).outputs[0].data.tolist() == [[1]]
        assert (await futures[2]).outputs[0].data.tolist() == [[3]]
        assert instance.executed == [[1], [3]] and instance.cancelled == []
        assert stats.fail.count == 1 and stats.failures["CANCELED"] == 1
        assert stats.execution_count == 2 and scheduling.pending_count == 0

    run(test)


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("ending", ["success", "error"])
def test_a_running_request_whose_client_goes_away_is_told_and_counted_by_its_outcome(scheduler: str, ending: str):
    async def test() -> None:
        instance, stats = Cancellable(), ModelStats()
        scheduling = create_scheduler("m", config(SCHEDULERS[scheduler]), [instance], stats)
        running = scheduling.submit(request(1))
        await settle()
        running.cancel()
        await settle()
        assert instance.cancelled == [1]
        if ending == "success":
            instance.release()
        else:
            instance.release(lambda _: ServerError(ErrorCode.CANCELLED, "stopped early"))
        await settle()
        # Nobody awaits the future any more, so the scheduler counts it, as Triton counts what its backend reports.
        assert (stats.success.count, stats.fail.count) == ((1, 0) if ending == "success" else (0, 1))
        assert stats.failures["CANCELED"] == (ending == "error")
        # A request answered before its client could go away leaves nothing behind to tell the instance.
        answered = scheduling.submit(request(2))
        await settle()
        instance.release()
        await answered
        answered.cancel()
        await settle()
        assert instance.cancelled == [1] and stats.success.count == (ending == "success")

    run(test)


def test_the_sequence_batcher_counts_each_run_of_a_rescheduled_request_as_an_execution():
    async def test() -> None:
        instance, stats = Cancellable(), ModelStats()
        scheduling = create_scheduler("m", config("sequence_batching { iterative_sequence: true }"), [instance], stats)
        future = scheduling.submit(request(7))
        await settle()
        # The instance ran it three times: the first run and two more after the model rescheduled it.
        rescheduled = time.monotonic_ns()
        instance.release(reruns=[Rerun([0], rescheduled, 1, 2, 3), Rerun([0], rescheduled, 4, 5, 6)])
        await future
        assert stats.execution_count == 3 and stats.inference_count == 3
        assert stats.queue.count == 3 and stats.compute_infer.count == 3
        assert stats.compute_infer.ns == 20 + 2 + 5 and stats.batches[1].compute_infer.count == 3
        # The two runs that rescheduled it are successes here; the last is counted by the core as it answers.
        assert stats.success.count == 2

    run(test)
