"""Instances added to and retired from running schedulers (an instance-group update in place), in-process over
instances whose executions wait for the test: requests queued and running meanwhile are all answered, a retired
instance gets nothing new and is idle only once its executions are done, and a sequence keeps its instance."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from support.scheduling import HeldInstance, model_config, run, settle

from transerve.backends.base import BackendInstance, ExecutionResult
from transerve.core.protocol_parameters import SEQUENCE_END, SEQUENCE_START
from transerve.core.stats import ModelStats
from transerve.core.types import InferRequest, InferResponse, Tensor
from transerve.scheduling import create_scheduler


class Echo(HeldInstance):
    """Answers each request with its own instance's name, so a test sees where it ran."""

    def __init__(self, name: str, auto: bool = False, max_inflight: int = 1) -> None:
        super().__init__(name, auto)
        self.max_inflight = max_inflight
        self.executed: list[int] = []

    def record(self, requests: list[InferRequest]) -> None:
        self.executed.append(len(requests))

    def answer(self, requests: list[InferRequest]) -> ExecutionResult:
        name = np.array([[self.name.encode()]] * len(requests), dtype=np.object_)
        return ExecutionResult([InferResponse("m", "1", [Tensor("OUT", "BYTES", name[i])]) for i in
                                range(len(requests))])


CONFIGS = {
    "direct": "",
    "dynamic": "dynamic_batching { }",
    "sequence": "sequence_batching { direct { } max_sequence_idle_microseconds: 5000000 }",
    "oldest": "sequence_batching { oldest { max_candidate_sequences: 2 } max_sequence_idle_microseconds: 5000000 }",
}


def config(kind: str) -> object:
    return model_config(f"""
        name: "m" backend: "python" max_batch_size: {0 if kind == "direct" else 2}
        input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        output [ {{ name: "OUT" data_type: TYPE_STRING dims: [ 1 ] }} ]
        {CONFIGS[kind]}""")


def request(kind: str, sequence: int = 0, flags: int = 0) -> InferRequest:
    shape = (1,) if kind == "direct" else (1, 1)
    return InferRequest("m", [Tensor("IN", "INT32", np.ones(shape, np.int32))], correlation_id=sequence, flags=flags,
                        arrival_ns=time.monotonic_ns())


def ran_on(future: asyncio.Future[InferResponse]) -> str:
    return future.result().outputs[0].data.reshape(-1)[0].decode()


class Idle:
    """Records `on_idle` calls."""

    def __init__(self) -> None:
        self.instances: list[BackendInstance] = []

    def __call__(self, instance: BackendInstance) -> None:
        self.instances.append(instance)


@pytest.mark.parametrize("kind", ["direct", "dynamic"])
def test_added_instances_take_queued_requests_and_a_busy_retired_one_finishes_first(kind: str) -> None:
    async def test() -> None:
        first = Echo("m_0")
        scheduler = create_scheduler("m", config(kind), [first], ModelStats())
        running = scheduler.submit(request(kind))
        queued = [scheduler.submit(request(kind)) for _ in range(3)]
        await settle()
        assert first.executed == [1] and scheduler.pending_count == 3
        added = [Echo("m_1", auto=True), Echo("m_2", auto=True)]
        scheduler.add_instances(added)
        await settle()
        # The queued requests went to the new instances while the first still runs its own.
        assert all(future.done() for future in queued) and not running.done()
        assert {ran_on(future) for future in queued} <= {"m_1", "m_2"}
        idle = Idle()
        assert scheduler.retire([first, added[0]], idle) == []
        assert idle.instances == [added[0]]  # idle at once; the first is still executing
        later = [scheduler.submit(request(kind)) for _ in range(2)]
        await settle()
        assert [ran_on(future) for future in later] == ["m_2", "m_2"]
        first.release()
        await settle()
        assert ran_on(running) == "m_0" and idle.instances == [added[0], first]
        assert first.executed == [1]
        await scheduler.drain()

    run(test)


def test_direct_spreads_over_a_new_instance_before_deepening_pipelines() -> None:
    async def test() -> None:
        first = Echo("m_0", max_inflight=4)
        scheduler = create_scheduler("m", config("direct"), [first], ModelStats())
        scheduler.add_instances([Echo("m_1", max_inflight=4)])
        futures = [scheduler.submit(request("direct")) for _ in range(2)]
        await settle()
        assert first.executed == [1]  # one each, not both pipelined on the first
        first.release()
        await settle()
        assert ran_on(futures[0]) == "m_0"

    run(test)


def test_a_retired_pipelined_instance_is_idle_after_its_last_execution() -> None:
    async def test() -> None:
        only = Echo("m_0", max_inflight=2)
        scheduler = create_scheduler("m", config("direct"), [only], ModelStats())
        futures = [scheduler.submit(request("direct")) for _ in range(2)]
        await settle()
        other = Echo("m_1", auto=True)
        scheduler.add_instances([other])
        idle = Idle()
        scheduler.retire([only], idle)
        only.release()
        await settle()
        assert idle.instances == []
        only.release()
        await settle()
        assert idle.instances == [only] and [ran_on(future) for future in futures] == ["m_0", "m_0"]

    run(test)


@pytest.mark.parametrize("kind", ["sequence", "oldest"])
def test_a_retired_instance_serves_its_sequences_to_their_end(kind: str) -> None:
    async def test() -> None:
        instances = [Echo("m_0", auto=True), Echo("m_1", auto=True)]
        scheduler = create_scheduler("m", config(kind), instances, ModelStats())
        one = scheduler.submit(request(kind, 1, SEQUENCE_START))
        await settle()
        holder = ran_on(one)
        kept = next(instance for instance in instances if instance.name != holder)
        retired = next(instance for instance in instances if instance.name == holder)
        idle = Idle()
        assert scheduler.retire([retired], idle) == [retired]
        assert idle.instances == []
        # New sequences go to the kept instance, the running one stays on its instance.
        two = scheduler.submit(request(kind, 2, SEQUENCE_START))
        again = scheduler.submit(request(kind, 1))
        await settle()
        assert ran_on(two) == kept.name and ran_on(again) == holder
        added = Echo("m_2", auto=True)
        scheduler.add_instances([added])
        three = scheduler.submit(request(kind, 3, SEQUENCE_START | SEQUENCE_END))
        end = scheduler.submit(request(kind, 1, SEQUENCE_END))
        await settle()
        assert ran_on(three) in (kept.name, added.name) and ran_on(end) == holder
        assert idle.instances == [retired]
        await scheduler.drain()

    run(test)


@pytest.mark.parametrize("strategy", ["direct { }", "oldest { max_candidate_sequences: 1 }"])
def test_a_sequence_backlogged_for_a_slot_takes_one_of_an_added_instance(strategy: str) -> None:
    async def test() -> None:
        first = Echo("m_0", auto=True)
        scheduler = create_scheduler("m", model_config(f"""
            name: "m" backend: "python" max_batch_size: 1
            input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
            output [ {{ name: "OUT" data_type: TYPE_STRING dims: [ 1 ] }} ]
            sequence_batching {{ {strategy} max_sequence_idle_microseconds: 5000000 }}"""), [first], ModelStats())
        started = scheduler.submit(request("sequence", 1, SEQUENCE_START))
        await settle()
        assert ran_on(started) == "m_0"
        waiting = scheduler.submit(request("sequence", 2, SEQUENCE_START))
        await settle()
        assert not waiting.done()
        scheduler.add_instances([Echo("m_1", auto=True)])
        await settle()
        assert ran_on(waiting) == "m_1"

    run(test)


def test_drain_lets_go_of_a_retired_instance_a_sequence_still_holds() -> None:
    async def test() -> None:
        instances = [Echo("m_0", auto=True)]
        scheduler = create_scheduler("m", config("sequence"), instances, ModelStats())
        await scheduler.submit(request("sequence", 1, SEQUENCE_START))
        idle = Idle()
        assert scheduler.retire(instances, idle) == instances
        await scheduler.drain()
        assert idle.instances == instances

    run(test)
