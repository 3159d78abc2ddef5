"""The sequence batcher in-process, over fake instances that run a stateful accumulator: slots, backlog,
control inputs, null requests, the idle reaper and both strategies, observed batch by batch."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import numpy as np
import pytest
from support.scheduling import HeldInstance, model_config, run, settle

from transerve.backends.base import ExecutionResult
from transerve.config.model_config import ConfigError, to_json_dict
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.protocol_parameters import SEQUENCE_END, SEQUENCE_START
from transerve.core.stats import ModelStats
from transerve.core.types import InferRequest, InferResponse, Tensor
from transerve.scheduling import create_scheduler
from transerve.scheduling.sequence_batcher import SequenceBatcher

CONTROLS = """
control_input [
  { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
  { name: "END" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] },
  { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
  { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: %s } ] }
]
"""


class Accumulator(HeldInstance):
    """A stateful model as a test double: sums INPUT per CORRID, restarting at START, reading the control
    inputs the batcher added. Executions are answered at once (`auto`) or when the test calls `release`."""

    def __init__(self, name: str = "m_0", auto: bool = True) -> None:
        super().__init__(name, auto)
        #: Per execution, per request: every input as a plain value (the first element), by name.
        self.batches: list[list[dict[str, Any]]] = []
        self.requests: list[list[InferRequest]] = []
        self.sums: dict[Any, int] = {}

    def record(self, requests: list[InferRequest]) -> None:
        self.batches.append([_seen(request) for request in requests])
        self.requests.append(requests)

    def answer(self, requests: list[InferRequest]) -> ExecutionResult:
        responses = []
        for request in requests:
            seen = _seen(request)
            if not seen.get("READY", True):
                responses.append(ServerError(ErrorCode.INTERNAL, "a null request's result must be dropped"))
                continue
            key = seen.get("CORRID", request.correlation_id)
            if seen.get("START"):
                self.sums[key] = 0
            self.sums[key] = self.sums.get(key, 0) + seen["INPUT"]
            responses.append(InferResponse("m", "1", [Tensor("OUTPUT", "INT32", np.array([[self.sums[key]]]))]))
        return ExecutionResult(responses)


def _seen(request: InferRequest) -> dict[str, Any]:
    """Each input's first element as a plain Python value (bytes stay bytes)."""
    seen = {}
    for tensor in request.inputs:
        value = tensor.data.reshape(-1)[0]
        seen[tensor.name] = value if isinstance(value, bytes) else value.item()
    return seen


def config(body: str = "direct { }", corrid: str = "TYPE_UINT64", max_batch_size: int = 2, extra: str = "") -> Any:
    text = f"""
    name: "m" backend: "python" max_batch_size: {max_batch_size}
    input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
    output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
    sequence_batching {{ {body} {CONTROLS % corrid if corrid else ""} }}
    {extra}
    """
    return model_config(text)


def request(sequence: int | str, value: int, flags: int = 0, batching: bool = True, batch: int = 1) -> InferRequest:
    data = np.full((batch, 1) if batching else (1,), value, np.int32)
    return InferRequest(
        "m", [Tensor("INPUT", "INT32", data)], correlation_id=sequence, flags=flags, arrival_ns=time.monotonic_ns()
    )


def make(cfg: Any, *instances: Accumulator) -> tuple[SequenceBatcher, ModelStats]:
    stats = ModelStats()
    batcher = create_scheduler("m", cfg, list(instances), stats)
    assert isinstance(batcher, SequenceBatcher)
    return batcher, stats


async def output(future: asyncio.Future[InferResponse]) -> int:
    return int((await future).outputs[0].data.reshape(-1)[0])


# --- control inputs ---------------------------------------------------------------------------------------


def test_control_inputs_have_the_configured_types_values_and_shapes():
    async def test() -> None:
        instance = Accumulator()
        batcher, _ = make(config(), instance)
        assert await output(batcher.submit(request(7, 5, SEQUENCE_START))) == 5
        assert await output(batcher.submit(request(7, 6))) == 11
        assert await output(batcher.submit(request(7, 1, SEQUENCE_END))) == 12
        start, middle, end = (batch[0] for batch in instance.batches)
        assert start == {"INPUT": 5, "START": 1, "END": 0.0, "READY": True, "CORRID": 7}
        assert middle == {"INPUT": 6, "START": 0, "END": 0.0, "READY": True, "CORRID": 7}
        assert end == {"INPUT": 1, "START": 0, "END": 1.0, "READY": True, "CORRID": 7}
        assert await output(batcher.submit(request(8, 3, SEQUENCE_START | SEQUENCE_END))) == 3
        assert instance.batches[-1][0] == {"INPUT": 3, "START": 1, "END": 1.0, "READY": True, "CORRID": 8}

    run(test)


def test_control_tensors_are_batch_shaped_only_for_batching_models():
    async def test() -> None:
        for max_batch_size, shape in ((4, (1, 1)), (0, (1,))):
            instance = Accumulator()
            batcher, _ = make(config(max_batch_size=max_batch_size), instance)
            await batcher.submit(request(1, 1, SEQUENCE_START, batching=max_batch_size > 0))
            sent = instance.requests[0][0].inputs[1:]
            controls = {t.name: (t.datatype, t.data.shape, t.data.dtype.name) for t in sent}
            assert controls == {
                "START": ("INT32", shape, "int32"),
                "END": ("FP32", shape, "float32"),
                "READY": ("BOOL", shape, "bool"),
                "CORRID": ("UINT64", shape, "uint64"),
            }

    run(test)


@pytest.mark.parametrize(
    ("corrid", "sequence", "expected"),
    [
        ("TYPE_STRING", "user-42", b"user-42"),
        ("TYPE_STRING", 42, b"42"),
        ("TYPE_INT64", 2**64 - 1, -1),
        ("TYPE_INT32", 2**32 + 5, 5),
        ("TYPE_UINT32", 7, 7),
        ("TYPE_UINT64", "no-number", 0),
    ],
)
def test_corrid_follows_its_datatype(corrid: str, sequence: int | str, expected: Any):
    async def test() -> None:
        instance = Accumulator()
        batcher, _ = make(config(corrid=corrid), instance)
        await batcher.submit(request(sequence, 1, SEQUENCE_START))
        assert instance.batches[0][0]["CORRID"] == expected

    run(test)


def test_a_control_also_declared_as_an_input_replaces_what_the_client_sent():
    cfg = config()
    extra = cfg.input.add()
    extra.CopyFrom(cfg.input[0])
    extra.name = "START"

    async def test() -> None:
        instance = Accumulator()
        batcher, _ = make(cfg, instance)
        sent = request(3, 4, SEQUENCE_START)
        sent.inputs.append(Tensor("START", "INT32", np.array([[99]], np.int32)))
        await batcher.submit(sent)
        assert [tensor.name for tensor in sent.inputs].count("START") == 1
        assert instance.batches[0][0]["START"] == 1

    run(test)


# --- refusals, with Triton's wording -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent", "message"),
    [
        (request(0, 1, SEQUENCE_START), "inference request to model 'm' must specify a non-zero or non-empty "
         "correlation ID"),
        (request("", 1), "inference request to model 'm' must specify a non-zero or non-empty correlation ID"),
        (request(1234, 1), "inference request for sequence 1234 to model 'm' must specify the START flag on the "
         "first request of the sequence"),
        (request("abc", 1, SEQUENCE_END), "inference request for sequence abc to model 'm' must specify the START "
         "flag on the first request of the sequence"),
        (request(5, 1, SEQUENCE_START, batch=2), "inference request to model 'm' must specify batch-size 1 due to "
         "requirements of sequence batcher"),
    ],
)
def test_refusals(sent: InferRequest, message: str):
    async def test() -> None:
        instance = Accumulator()
        batcher, _ = make(config(), instance)
        with pytest.raises(ServerError) as raised:
            await batcher.submit(sent)
        assert (raised.value.code, raised.value.message) == (ErrorCode.INVALID_ARG, message)
        assert instance.batches == [] and batcher.pending_count == 0

    run(test)


def test_a_new_start_on_a_live_sequence_restarts_it_in_the_same_slot():
    async def test() -> None:
        instance = Accumulator()
        batcher, _ = make(config(), instance)
        assert await output(batcher.submit(request(1, 5, SEQUENCE_START))) == 5
        assert await output(batcher.submit(request(2, 1, SEQUENCE_START))) == 1
        assert await output(batcher.submit(request(2, 10, SEQUENCE_START))) == 10
        assert await output(batcher.submit(request(2, 1, SEQUENCE_END))) == 11
        # Sequence 2 stayed in slot 1 throughout (slot 0 padded with a null request).
        assert [len(batch) for batch in instance.batches] == [1, 2, 2, 2]
        assert [batch[1]["START"] for batch in instance.batches[1:]] == [1, 1, 0]

    run(test)


# --- direct strategy ---------------------------------------------------------------------------------------


def test_direct_keeps_each_sequence_at_its_slot_index_and_pads_with_null_requests():
    async def test() -> None:
        instance = Accumulator(auto=False)
        batcher, stats = make(config(), instance)
        first = batcher.submit(request(100, 1, SEQUENCE_START))  # slot 0, executes alone
        a = batcher.submit(request(200, 10, SEQUENCE_START))  # slot 1
        b = batcher.submit(request(100, 2))  # slot 0 again
        instance.release()
        assert await output(first) == 1
        await settle()
        assert [entry["CORRID"] for entry in instance.batches[1]] == [100, 200]
        instance.release()
        assert (await output(b), await output(a)) == (3, 10)

        alone = batcher.submit(request(200, 5, SEQUENCE_END))  # only slot 1 has work
        instance.release()
        assert await output(alone) == 15
        null, real = instance.batches[2]
        assert null == {"INPUT": 0, "START": 0, "END": 0.0, "READY": False, "CORRID": 0}
        assert real["CORRID"] == 200 and real["END"] == 1.0
        # Triton's statistics: null requests count in the batch size, not as inferences.
        assert (stats.execution_count, stats.inference_count) == (3, 4)
        assert {size: batch.compute_infer.count for size, batch in stats.batches.items()} == {1: 1, 2: 2}
        assert stats.compute_infer.count == 4

    run(test)


def test_sequences_beyond_the_slots_wait_in_the_backlog_in_arrival_order():
    async def test() -> None:
        instance = Accumulator()
        batcher, _ = make(config(max_batch_size=1), instance)
        assert await output(batcher.submit(request(1, 1, SEQUENCE_START))) == 1
        waiting = [batcher.submit(request(2, 5, SEQUENCE_START)), batcher.submit(request(2, 5))]
        later = batcher.submit(request(3, 7, SEQUENCE_START | SEQUENCE_END))
        await settle()
        assert batcher.pending_count == 3 and not any(f.done() for f in [*waiting, later])
        assert await output(batcher.submit(request(1, 1, SEQUENCE_END))) == 2
        assert [await output(future) for future in waiting] == [5, 10]
        # Sequence 2 now owns the slot: its next requests go straight there, sequence 3 still waits.
        assert await output(batcher.submit(request(2, 1, SEQUENCE_END))) == 11
        assert await output(later) == 7
        assert [[entry["CORRID"] for entry in batch] for batch in instance.batches] == [[1], [1], [2], [2], [2], [3]]
        await batcher.drain()

    run(test)


def test_sequences_spread_over_instances_before_filling_their_slots():
    async def test() -> None:
        instances = [Accumulator("m_0"), Accumulator("m_1")]
        batcher, _ = make(config(), *instances)
        for sequence in (1, 2, 3):
            await batcher.submit(request(sequence, sequence, SEQUENCE_START))
        # Sequence 3 is in slot 1 of the first instance; slot 0 (sequence 1, idle) holds a null request.
        assert [[e["CORRID"] for e in b] for b in instances[0].batches] == [[1], [0, 3]]
        assert [[e["CORRID"] for e in b] for b in instances[1].batches] == [[2]]

    run(test)


def test_direct_waits_for_slot_utilization_up_to_the_queue_delay():
    async def test() -> None:
        instance = Accumulator()
        cfg = config("direct { max_queue_delay_microseconds: 300000 minimum_slot_utilization: 1.0 }")
        batcher, _ = make(cfg, instance)
        started = time.monotonic()
        one = batcher.submit(request(1, 1, SEQUENCE_START))
        await asyncio.sleep(0.05)
        two = batcher.submit(request(2, 2, SEQUENCE_START))
        assert (await output(one), await output(two)) == (1, 2)
        assert len(instance.batches) == 1 and time.monotonic() - started < 0.25  # full slots: no more waiting
        alone = batcher.submit(request(1, 1))
        assert await output(alone) == 2
        assert time.monotonic() - started >= 0.3  # half the slots: waited out the delay

    run(test)


def test_requests_whose_variable_shapes_differ_do_not_share_a_batch():
    cfg = config()
    cfg.input[0].dims[0] = -1

    def sized(sequence: int, length: int, flags: int = 0) -> InferRequest:
        data = np.ones((1, length), np.int32)
        return InferRequest("m", [Tensor("INPUT", "INT32", data)], correlation_id=sequence, flags=flags,
                            arrival_ns=time.monotonic_ns())

    async def test() -> None:
        instance = Accumulator(auto=False)
        batcher, _ = make(cfg, instance)
        futures = [batcher.submit(sized(1, 1, SEQUENCE_START)), batcher.submit(sized(2, 3, SEQUENCE_START)),
                   batcher.submit(sized(1, 1))]
        for _ in range(3):
            await settle()
            instance.release()
        await asyncio.gather(*futures)
        # Slot 1's longer request waits out a batch, its place taken by a null request shaped like slot 0's.
        assert [[entry["READY"] for entry in batch] for batch in instance.batches] == [
            [True], [True, False], [False, True]
        ]
        assert [request.inputs[0].data.shape for request in instance.requests[1]] == [(1, 1), (1, 1)]

    run(test)


# --- the idle reaper ---------------------------------------------------------------------------------------


def test_an_idle_sequence_loses_its_slot_to_the_backlog_and_cannot_continue_without_start():
    async def test() -> None:
        instance = Accumulator()
        batcher, _ = make(config("max_sequence_idle_microseconds: 200000", max_batch_size=1), instance)
        assert await output(batcher.submit(request(1, 1, SEQUENCE_START))) == 1
        waiting = batcher.submit(request(2, 5, SEQUENCE_START))
        started = time.monotonic()
        assert await output(waiting) == 5  # the slot freed when sequence 1 idled out
        assert 0.15 <= time.monotonic() - started < 2
        with pytest.raises(ServerError, match="sequence 1 to model 'm' must specify the START flag"):
            await batcher.submit(request(1, 1))
        assert await output(batcher.submit(request(1, 3, SEQUENCE_START))) == 3  # a new sequence 1, backlogged
        # ... which got sequence 2's slot when 2 idled out in turn.

    run(test)


# --- cancellation --------------------------------------------------------------------------------------------


def cancelled(future: asyncio.Future[InferResponse]) -> bool:
    return isinstance(future.exception(), ServerError) and future.exception().code is ErrorCode.CANCELLED


@pytest.mark.parametrize("strategy", ["direct { }", "oldest { max_candidate_sequences: 1 }"])
def test_a_cancelled_queued_request_ends_its_sequence(strategy: str):
    """As Triton's scheduler_test checks: the requests queued behind a running one, one of them cancelled by its
    client, are all answered CANCELLED once the batcher reaches them; the slot goes to the backlog."""
    async def test() -> None:
        instance = Accumulator(auto=False)
        batcher, stats = make(config(strategy, max_batch_size=1), instance)
        running = batcher.submit(request(1, 1, SEQUENCE_START))
        queued = [batcher.submit(request(1, v)) for v in (2, 3)]
        backlogged = batcher.submit(request(2, 5, SEQUENCE_START))
        await settle()
        queued[0].cancel()
        await settle()
        assert not queued[1].done()  # found when the batcher reaches it, as in Triton
        instance.release()
        await settle()
        assert await output(running) == 1 and cancelled(queued[1])
        assert stats.failures["CANCELED"] == 1  # the cancelled one; the core counts the error it gets
        instance.release()
        assert await output(backlogged) == 5  # sequence 2 took the slot
        with pytest.raises(ServerError, match="sequence 1 to model 'm' must specify the START flag"):
            await batcher.submit(request(1, 4))
        assert batcher.pending_count == 0
        assert [[entry["CORRID"] for entry in batch] for batch in instance.batches] == [[1], [2]]

    run(test)


def test_a_backlogged_sequence_with_a_cancelled_request_is_cancelled_when_a_slot_frees():
    async def test() -> None:
        instance = Accumulator(auto=False)
        batcher, stats = make(config(max_batch_size=1), instance)
        running = batcher.submit(request(1, 1, SEQUENCE_START))
        backlog = [batcher.submit(request(2, 5, SEQUENCE_START)), batcher.submit(request(2, 6))]
        after = batcher.submit(request(3, 7, SEQUENCE_START | SEQUENCE_END))
        ending = batcher.submit(request(1, 1, SEQUENCE_END))
        await settle()
        backlog[1].cancel()  # any request of a backlog cancels it, the first included
        instance.release()
        await settle()  # sequence 1's END is batched: its slot frees
        assert await output(running) == 1 and cancelled(backlog[0]) and backlog[1].cancelled()
        assert stats.failures["CANCELED"] == 1
        instance.release()
        assert await output(ending) == 2
        instance.release()
        assert await output(after) == 7  # the next backlog got the slot
        assert batcher.pending_count == 0
        # A later request of the cancelled sequence must start it again.
        with pytest.raises(ServerError, match="sequence 2 to model 'm' must specify the START flag"):
            await batcher.submit(request(2, 1))

    run(test)


# --- oldest strategy ---------------------------------------------------------------------------------------


def test_oldest_batches_one_request_per_sequence_and_runs_a_sequence_in_order():
    async def test() -> None:
        instance = Accumulator(auto=False)
        cfg = config("oldest { max_candidate_sequences: 3 }", corrid="TYPE_STRING", max_batch_size=4)
        batcher, _ = make(cfg, instance)
        first = batcher.submit(request("a", 1, SEQUENCE_START))
        queued = [batcher.submit(request("a", v)) for v in (2, 3)]
        others = [batcher.submit(request(s, 10, SEQUENCE_START)) for s in ("b", "c")]
        backlogged = batcher.submit(request("d", 100, SEQUENCE_START | SEQUENCE_END))
        await settle()
        assert [[e["CORRID"] for e in b] for b in instance.batches] == [[b"a"]]
        instance.release()
        await settle()
        # a's next request became ready only once its first had run; the batch takes one per sequence.
        assert [e["CORRID"] for e in instance.batches[1]] == [b"b", b"c", b"a"]
        instance.release()
        await settle()
        assert [e["CORRID"] for e in instance.batches[2]] == [b"a"]
        ends = [batcher.submit(request(s, 0, SEQUENCE_END)) for s in ("b", "c")]
        instance.release()
        await settle()
        assert [e["CORRID"] for e in instance.batches[3]] == [b"b", b"c"]
        instance.release()
        await settle()
        assert [e["CORRID"] for e in instance.batches[4]] == [b"d"]  # took b's slot once b ended
        instance.release()
        assert [await output(f) for f in (first, *queued)] == [1, 3, 6]
        assert [await output(f) for f in (*others, *ends, backlogged)] == [10, 10, 10, 10, 100]

    run(test)


def test_oldest_waits_for_a_preferred_batch_up_to_the_queue_delay():
    async def test() -> None:
        instance = Accumulator()
        cfg = config("oldest { max_candidate_sequences: 4 preferred_batch_size: [ 2 ] max_queue_delay_microseconds: "
                     "200000 }", max_batch_size=4)
        batcher, _ = make(cfg, instance)
        started = time.monotonic()
        pair = [batcher.submit(request(s, 1, SEQUENCE_START)) for s in (1, 2)]
        await asyncio.gather(*pair)
        assert time.monotonic() - started < 0.15 and [len(b) for b in instance.batches] == [2]
        await batcher.submit(request(3, 1, SEQUENCE_START))
        assert time.monotonic() - started >= 0.2 and [len(b) for b in instance.batches] == [2, 1]

    run(test)


@pytest.mark.parametrize("strategy", ["direct { }", "oldest { }"])
def test_iterative_sequences_make_each_request_without_sequence_a_sequence_of_its_own(strategy: str):
    async def test() -> None:
        instance = Accumulator()
        batcher, _ = make(config(f"iterative_sequence: true {strategy}", max_batch_size=1), instance)
        # One slot: each request holds it only while it runs, so the three run one after the other.
        assert [await output(f) for f in [batcher.submit(request(0, value)) for value in (1, 2, 3)]] == [1, 2, 3]
        assert [batch[0]["CORRID"] for batch in instance.batches] == [1, 2, 3]
        assert {(batch[0]["START"], batch[0]["END"]) for batch in instance.batches} == {(1, 0.0)}
        assert [request.flags for (request,) in instance.requests] == [SEQUENCE_START] * 3
        # A request that names its sequence is an ordinary sequence request, START needed.
        with pytest.raises(ServerError, match="must specify the START flag"):
            await batcher.submit(request(9, 4))
        with pytest.raises(ServerError, match="must specify batch-size 1"):
            await batcher.submit(request(0, 1, batch=2))
        assert not batcher._single and not batcher._assigned

    run(test)


def test_max_batch_size_zero_runs_one_request_at_a_time():
    async def test() -> None:
        instance = Accumulator()
        batcher, _ = make(config("oldest { max_candidate_sequences: 2 }", max_batch_size=0), instance)
        futures = [batcher.submit(request(s, s, SEQUENCE_START, batching=False)) for s in (1, 2)]
        assert [await output(f) for f in futures] == [1, 2]
        assert [len(batch) for batch in instance.batches] == [1, 1]

    run(test)


# --- configuration -----------------------------------------------------------------------------------------


def test_triton_defaults_are_filled():
    cfg = to_json_dict(config("oldest { }", max_batch_size=4))["sequence_batching"]
    assert cfg["max_sequence_idle_microseconds"] == 1000000
    assert cfg["oldest"]["preferred_batch_size"] == [4]


@pytest.mark.parametrize(
    ("controls", "message"),
    [
        ('{ control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }',
         "sequence batching control tensor must have a name for m"),
        ('{ name: "S" control [ { kind: CONTROL_SEQUENCE_START } ] }',
         "sequence batching must specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' for "
         "CONTROL_SEQUENCE_START for m"),
        ('{ name: "S" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] fp32_false_true: [ 0, 1 ] '
         '} ] }', "sequence batching specifies more than one from 'int32_false_true', 'fp32_false_true' and "
         "'bool_false_true' for CONTROL_SEQUENCE_END for m"),
        ('{ name: "S" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ true ] } ] }',
         "sequence batching control 'bool_false_true' must have exactly 2 entries for CONTROL_SEQUENCE_READY for m"),
        ('{ name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }, '
         '{ name: "S" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] }',
         "sequence batching control tensor 'S' is specified for multiple control kinds for m"),
        ('{ name: "A" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }, '
         '{ name: "B" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }',
         "sequence batching specifies multiple CONTROL_SEQUENCE_START tensors for m"),
        ('{ name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 } ] }',
         "unexpected data type for control CONTROL_SEQUENCE_CORRID for m. Allowed data types are TYPE_UINT64, "
         "TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"),
        ('{ name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 int32_false_true: [ 0, 1 ] '
         '} ] }', "sequence batching must not specify either 'int32_false_true', 'fp32_false_true' or "
         "'bool_false_true' for CONTROL_SEQUENCE_CORRID for m"),
    ],
)
def test_control_input_mistakes_fail_the_load_with_tritons_words(controls: str, message: str):
    with pytest.raises(ConfigError) as raised:
        config(f"control_input [ {controls} ]", corrid="")
    assert str(raised.value) == message


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("oldest { preferred_batch_size: [ 0 ] }", "sequence batching preferred batch size must be positive for m"),
        ("oldest { preferred_batch_size: [ 3 ] }", "sequence batching preferred batch size must be <= max batch "
         "size for m"),
        ("direct { minimum_slot_utilization: 1.5 }", "sequence batching minimum slot utilization must be in range "
         "(0.0, 1.0] for m"),
    ],
)
def test_strategy_mistakes_fail_the_load(body: str, message: str):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config(body)
