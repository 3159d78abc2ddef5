"""The dynamic batcher in-process, over fake instances whose executions the test releases: every batching
decision is observed exactly, with no worker processes and no sleeping beyond the delays under test."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from support.scheduling import HeldInstance, model_config, run, settle

from transerve.backends.base import ExecutionResult
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.stats import ModelStats
from transerve.core.types import InferRequest, InferResponse, Tensor
from transerve.scheduling import create_scheduler
from transerve.scheduling.dynamic_batcher import DynamicBatcher


class FakeInstance(HeldInstance):
    """Records each batch (the VALUE of every request) and answers when the test says so, or at once."""

    def __init__(self, name: str, auto: bool = False) -> None:
        super().__init__(name, auto)
        self.batches: list[list[int]] = []
        self.sizes: list[list[int]] = []
        self.inputs: list[list[dict[str, np.ndarray]]] = []

    def record(self, requests: list[InferRequest]) -> None:
        self.batches.append([int(_value(r)[0]) for r in requests])
        self.sizes.append([r.inputs[0].data.shape[0] for r in requests])
        self.inputs.append([{t.name: t.data for t in r.inputs} for r in requests])

    def answer(self, requests: list[InferRequest]) -> ExecutionResult:
        """Each request gets back its own VALUE."""
        return ExecutionResult([InferResponse("m", "1", [Tensor("OUT", "INT64", _value(r))]) for r in requests])

    @property
    def busy(self) -> bool:
        return bool(self._open)


def _value(request: InferRequest) -> np.ndarray:
    return next(t.data for t in request.inputs if t.name == "VALUE").reshape(-1)


def config(batching: str = "", max_batch_size: int = 8, extra: str = "", dims: str = "1") -> object:
    text = f"""
    name: "m" backend: "python" max_batch_size: {max_batch_size}
    input [ {{ name: "VALUE" data_type: TYPE_INT64 dims: [ {dims} ] }} ]
    output [ {{ name: "OUT" data_type: TYPE_INT64 dims: [ 1 ] }} ]
    dynamic_batching {{ {batching} }}
    {extra}
    """
    return model_config(text)


def request(value: int, batch: int = 1, length: int = 1, priority: int = 0, timeout_us: int = 0) -> InferRequest:
    data = np.full((batch, length), value, np.int64)
    return InferRequest("m", [Tensor("VALUE", "INT64", data)], priority=priority, timeout_us=timeout_us,
                        arrival_ns=time.monotonic_ns())


def make(cfg: object, *instances: FakeInstance) -> tuple[DynamicBatcher, ModelStats]:
    stats = ModelStats()
    batcher = create_scheduler("m", cfg, list(instances), stats)
    assert isinstance(batcher, DynamicBatcher)
    return batcher, stats


async def occupied(batcher: DynamicBatcher, instance: FakeInstance, batch: int = 1) -> asyncio.Future:
    """Keep the only instance busy so that what is submitted next waits in the queue."""
    future = batcher.submit(request(-1, batch=batch))
    assert instance.busy
    return future


def test_batches_form_up_to_max_batch_size_and_each_request_gets_its_own_value():
    async def test() -> None:
        instance = FakeInstance("i0")
        batcher, stats = make(config(), instance)
        first = await occupied(batcher, instance)
        futures = [batcher.submit(request(v)) for v in range(20)]
        assert batcher.pending_count == 20
        while instance.busy:
            instance.release()
            await settle()
        assert instance.batches == [[-1], list(range(8)), list(range(8, 16)), list(range(16, 20))]
        assert (await first).outputs[0].data.tolist() == [-1]
        for value, future in enumerate(futures):
            assert (await future).outputs[0].data.tolist() == [value]
        assert (stats.inference_count, stats.execution_count) == (21, 4)
        assert sorted(stats.batches) == [1, 4, 8]

    run(test)


def test_preferred_sizes_take_the_largest_reachable_prefix():
    async def test() -> None:
        instance = FakeInstance("i0")
        batcher, _ = make(config("preferred_batch_size: [ 2, 4 ]"), instance)
        await occupied(batcher, instance)
        for value in range(7):
            batcher.submit(request(value))
        while instance.busy:
            instance.release()
            await settle()
        assert [len(batch) for batch in instance.batches] == [1, 4, 2, 1]

    run(test)


def test_requests_with_their_own_batch_dimension_combine_in_samples():
    async def test() -> None:
        instance = FakeInstance("i0")
        batcher, stats = make(config(), instance)
        await occupied(batcher, instance)
        sizes = [3, 5, 2, 6, 1]
        futures = [batcher.submit(request(v, batch=b)) for v, b in enumerate(sizes)]
        while instance.busy:
            instance.release()
            await settle()
        # 3+5 fill 8; 2+6 fill 8; 1 alone.
        assert instance.sizes[1:] == [[3, 5], [2, 6], [1]]
        for value, (size, future) in enumerate(zip(sizes, futures, strict=True)):
            assert (await future).outputs[0].data.tolist() == [value] * size
        assert stats.inference_count == 1 + sum(sizes) and stats.execution_count == 4

    run(test)


def test_the_next_request_overshooting_the_preferred_size_sends_what_is_taken():
    async def test() -> None:
        instance = FakeInstance("i0")
        batcher, _ = make(config("preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 5000000"), instance)
        await occupied(batcher, instance, batch=4)
        batcher.submit(request(0, batch=3))
        batcher.submit(request(1, batch=3))
        instance.release()
        await settle()
        assert instance.sizes[1] == [3]  # 3+3 would pass 4: the 3 goes without waiting for the delay

    run(test)


def test_queue_delay_holds_a_partial_batch_until_its_oldest_request_waited_the_delay():
    async def test() -> None:
        instance = FakeInstance("i0", auto=True)
        batcher, _ = make(config("max_queue_delay_microseconds: 100000"), instance)
        started = time.monotonic()
        futures = [batcher.submit(request(v)) for v in range(3)]
        await asyncio.sleep(0.02)
        assert instance.batches == [] and batcher.pending_count == 3
        await asyncio.gather(*futures)
        waited = time.monotonic() - started
        assert instance.batches == [[0, 1, 2]]
        assert 0.095 <= waited < 1.0

    run(test)


def test_a_full_batch_goes_before_the_delay():
    async def test() -> None:
        instance = FakeInstance("i0", auto=True)
        batcher, _ = make(config("max_queue_delay_microseconds: 5000000"), instance)
        futures = [batcher.submit(request(v)) for v in range(8)]
        await asyncio.wait_for(asyncio.gather(*futures), 1.0)
        assert instance.batches == [list(range(8))]

    run(test)


def test_higher_priority_requests_overtake():
    async def test() -> None:
        instance = FakeInstance("i0")
        batching = "priority_levels: 3 default_priority_level: 2"
        batcher, _ = make(config(batching, max_batch_size=2), instance)
        await occupied(batcher, instance)
        batcher.submit(request(30, priority=3))
        batcher.submit(request(20))  # no priority: the default level 2
        batcher.submit(request(10, priority=1))
        batcher.submit(request(21, priority=9))  # beyond the levels: the default level
        batcher.submit(request(11, priority=1))
        while instance.busy:
            instance.release()
            await settle()
        assert instance.batches[1:] == [[10, 11], [20, 21], [30]]

    run(test)


def test_timed_out_requests_are_rejected_without_waiting_for_an_instance():
    async def test() -> None:
        instance = FakeInstance("i0")
        policy = "default_queue_policy { default_timeout_microseconds: 30000 allow_timeout_override: true }"
        batcher, stats = make(config(policy), instance)
        await occupied(batcher, instance)
        started = time.monotonic()
        doomed = batcher.submit(request(1))
        quick = batcher.submit(request(2, timeout_us=10000))  # shorter than the default: honoured
        longer = batcher.submit(request(3, timeout_us=10_000_000))  # longer: the default applies
        with pytest.raises(ServerError) as caught:
            await quick
        assert caught.value.code is ErrorCode.UNAVAILABLE and caught.value.message == "Request timeout expired"
        assert time.monotonic() - started < 0.03
        for future in (doomed, longer):
            with pytest.raises(ServerError, match="Request timeout expired"):
                await future
        assert time.monotonic() - started < 0.5
        survivor = batcher.submit(request(4))
        instance.release()
        await settle()
        instance.release()
        assert (await survivor).outputs[0].data.tolist() == [4]

    run(test)


def test_without_a_default_timeout_a_request_timeout_does_not_apply():
    """Triton only lets a request shorten the default; a default of 0 (none) leaves nothing to shorten."""

    async def test() -> None:
        instance = FakeInstance("i0")
        batcher, _ = make(config("default_queue_policy { allow_timeout_override: true }"), instance)
        await occupied(batcher, instance)
        waiting = batcher.submit(request(1, timeout_us=1000))
        await asyncio.sleep(0.02)
        instance.release()
        await settle()
        instance.release()
        assert (await waiting).outputs[0].data.tolist() == [1]

    run(test)


def test_delay_action_moves_timed_out_requests_behind_the_others():
    async def test() -> None:
        instance = FakeInstance("i0")
        policy = "default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 10000 }"
        batcher, _ = make(config(policy, max_batch_size=1), instance)
        await occupied(batcher, instance)
        batcher.submit(request(1))
        batcher.submit(request(2))
        await asyncio.sleep(0.02)  # both have timed out
        policy_free = batcher.submit(request(3))
        while instance.busy:
            instance.release()
            await settle()
        assert instance.batches[1:] == [[3], [1], [2]]
        assert (await policy_free).outputs[0].data.tolist() == [3]

    run(test)


def test_a_full_queue_refuses_at_once_and_the_others_still_run():
    async def test() -> None:
        instance = FakeInstance("i0")
        batcher, _ = make(config("default_queue_policy { max_queue_size: 2 }"), instance)
        await occupied(batcher, instance)
        kept = [batcher.submit(request(v)) for v in range(2)]
        refused = batcher.submit(request(9))
        assert refused.done()
        with pytest.raises(ServerError) as caught:
            refused.result()
        assert caught.value.code is ErrorCode.UNAVAILABLE
        assert caught.value.message == "[request id: <id_unknown>] Exceeds maximum queue size"
        instance.release()
        await settle()
        instance.release()
        assert [(await f).outputs[0].data.tolist() for f in kept] == [[0], [1]]

    run(test)


def test_per_level_queue_policies():
    async def test() -> None:
        instance = FakeInstance("i0")
        batching = (
            "priority_levels: 2 default_priority_level: 2 "
            "priority_queue_policy { key: 1 value: { max_queue_size: 1 } }"
        )
        batcher, _ = make(config(batching), instance)
        await occupied(batcher, instance)
        batcher.submit(request(1, priority=1))
        assert batcher.submit(request(2, priority=1)).done()  # level 1 holds one
        assert not batcher.submit(request(3, priority=2)).done()  # level 2 has no limit

    run(test)


def test_every_idle_instance_gets_a_batch():
    async def test() -> None:
        instances = [FakeInstance("i0"), FakeInstance("i1")]
        batcher, _ = make(config(max_batch_size=2), *instances)
        for value in range(6):
            batcher.submit(request(value))
        assert [i.batches for i in instances] == [[[0]], [[1]]]
        instances[1].release()
        await settle()
        assert instances[1].batches == [[1], [2, 3]]  # the instance that finished first takes the next batch
        instances[0].release()
        await settle()
        assert instances[0].batches == [[0], [4, 5]]

    run(test)


def test_preserve_ordering_holds_later_batches_until_earlier_ones_answered():
    async def test() -> None:
        instances = [FakeInstance("i0"), FakeInstance("i1")]
        batcher, _ = make(config("preserve_ordering: true", max_batch_size=1), *instances)
        first, second = batcher.submit(request(1)), batcher.submit(request(2))
        instances[1].release()
        await settle()
        assert not second.done()
        instances[0].release()
        await settle()
        assert first.done() and second.done()

    run(test)


def test_unequal_shapes_end_a_batch_unless_ragged_batching_is_allowed():
    async def test() -> None:
        instance = FakeInstance("i0")
        batcher, _ = make(config(dims="-1"), instance)
        await occupied(batcher, instance)
        for value, length in enumerate([2, 2, 3, 2]):
            batcher.submit(request(value, length=length))
        while instance.busy:
            instance.release()
            await settle()
        assert instance.batches[1:] == [[0, 1], [2], [3]]

    run(test)

    async def ragged() -> None:
        instance = FakeInstance("i0")
        cfg = config(dims="-1")
        cfg.input[0].allow_ragged_batch = True
        batcher, _ = make(cfg, instance)
        await occupied(batcher, instance)
        for value, length in enumerate([2, 2, 3, 2]):
            batcher.submit(request(value, length=length))
        instance.release()
        await settle()
        assert instance.batches[1:] == [[0, 1, 2, 3]]

    run(ragged)


BUCKETED = """
parameters { key: "batching_strategy" value: { string_value: "bucketed" } }
parameters { key: "bucket_boundaries" value: { string_value: "4,16" } }
"""


def test_bucketed_batches_group_similar_lengths_oldest_bucket_first():
    async def test() -> None:
        instance = FakeInstance("i0")
        batcher, _ = make(config(dims="-1", extra=BUCKETED), instance)
        await occupied(batcher, instance)
        lengths = [10, 2, 12, 3, 40, 4, 16, 50]
        futures = [batcher.submit(request(v, length=n)) for v, n in enumerate(lengths)]
        while instance.busy:
            instance.release()
            await settle()
        # Buckets: <=4 {1,3,5}, <=16 {0,2,6}, beyond {4,7}; the bucket of the oldest request goes first.
        assert instance.batches[1:] == [[0, 2, 6], [1, 3, 5], [4, 7]]
        for value, (length, future) in enumerate(zip(lengths, futures, strict=True)):
            assert (await future).outputs[0].data.tolist() == [value] * length

    run(test)


def test_bucketed_a_full_bucket_goes_while_the_oldest_bucket_waits_for_its_delay():
    async def test() -> None:
        instance = FakeInstance("i0", auto=True)
        cfg = config("max_queue_delay_microseconds: 5000000", max_batch_size=2, dims="-1", extra=BUCKETED)
        batcher, _ = make(cfg, instance)
        waiting = batcher.submit(request(0, length=10))
        batcher.submit(request(1, length=2))
        batcher.submit(request(2, length=3))
        await settle()
        assert instance.batches == [[1, 2]] and not waiting.done()

    run(test)


def test_padding_and_attention_mask_make_a_batch_rectangular():
    async def test() -> None:
        instance = FakeInstance("i0")
        extra = """
        parameters { key: "pad_inputs" value: { string_value: "true" } }
        parameters { key: "padding_value" value: { string_value: "-7" } }
        parameters { key: "attention_mask_input" value: { string_value: "MASK" } }
        """
        batcher, _ = make(config(dims="-1", extra=extra), instance)
        await occupied(batcher, instance)
        batcher.submit(request(1, batch=2, length=2))
        batcher.submit(request(2, length=3))
        instance.release()
        await settle()
        first, second = instance.inputs[1]
        assert first["VALUE"].tolist() == [[1, 1, -7], [1, 1, -7]]
        assert first["MASK"].tolist() == [[1, 1, 0], [1, 1, 0]] and first["MASK"].dtype == np.int64
        assert second["VALUE"].tolist() == [[2, 2, 2]] and second["MASK"].tolist() == [[1, 1, 1]]

    run(test)


def test_abandoned_requests_are_dropped_from_the_queue():
    async def test() -> None:
        instance = FakeInstance("i0")
        batcher, _ = make(config(), instance)
        await occupied(batcher, instance)
        gone = batcher.submit(request(1))
        kept = batcher.submit(request(2))
        gone.cancel()
        instance.release()
        await settle()
        instance.release()
        assert instance.batches[1:] == [[2]] and (await kept).outputs[0].data.tolist() == [2]
        await batcher.drain()

    run(test)


@pytest.mark.parametrize(
    ("batching", "extra", "fragment"),
    [
        ("", 'parameters { key: "batching_strategy" value: { string_value: "sorted" } }', "must be 'bucketed'"),
        ("", BUCKETED.replace("4,16", "16,4"), "increasing positive integers"),
        ("", BUCKETED + 'parameters { key: "bucket_input" value: { string_value: "NOPE" } }', "not an input"),
    ],
)
def test_bad_strategy_parameters_fail_the_load(batching, extra, fragment):
    async def test() -> None:
        with pytest.raises(ServerError, match=fragment) as caught:
            make(config(batching, dims="-1", extra=extra), FakeInstance("i0"))
        assert caught.value.code is ErrorCode.INVALID_ARG

    run(test)
