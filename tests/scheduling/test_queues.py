"""The priority queue and Triton's queue policies (scheduling/queues.py)."""

from __future__ import annotations

import numpy as np
from tritonclient.grpc import model_config_pb2

from transerve.config.model_config import parse_config_text
from transerve.core.errors import ErrorCode
from transerve.core.types import InferRequest, Tensor
from transerve.scheduling.queues import GONE, Pending, QueuePolicy, RequestQueue

MS = 1_000_000


def batching(text: str) -> model_config_pb2.ModelDynamicBatching:
    return parse_config_text(f"dynamic_batching {{ {text} }}").dynamic_batching


def pending(value: int, priority: int = 0, timeout_us: int = 0, request_id: str = "") -> Pending:
    request = InferRequest("m", [Tensor("V", "INT64", np.array([value]))], id=request_id, priority=priority,
                           timeout_us=timeout_us)
    return Pending(request, None, 1)  # type: ignore[arg-type]


def values(queue: RequestQueue) -> list[int]:
    return [int(p.request.inputs[0].data[0]) for p in queue]


def test_timeout_override_only_shortens_a_default():
    policy = model_config_pb2.ModelQueuePolicy(default_timeout_microseconds=100, allow_timeout_override=True)
    allowed = QueuePolicy.from_config(policy)
    assert allowed.timeout_us(pending(0, timeout_us=50).request) == 50
    assert allowed.timeout_us(pending(0, timeout_us=500).request) == 100
    assert allowed.timeout_us(pending(0).request) == 100
    policy.allow_timeout_override = False
    assert QueuePolicy.from_config(policy).timeout_us(pending(0, timeout_us=50).request) == 100


def test_levels_order_and_priority_mapping():
    queue = RequestQueue(batching("priority_levels: 3 default_priority_level: 3"))
    for value, priority in [(1, 3), (2, 0), (3, 2), (4, 1), (5, 7), (6, 1)]:
        assert queue.push(pending(value, priority), 0) is None
    assert values(queue) == [4, 6, 3, 1, 2, 5]
    assert queue.live == 6


def test_without_levels_priority_is_ignored():
    queue = RequestQueue(batching(""))
    for value, priority in [(1, 5), (2, 1), (3, 0)]:
        queue.push(pending(value, priority), 0)
    assert values(queue) == [1, 2, 3]


def test_max_queue_size_counts_per_level_and_names_the_request():
    queue = RequestQueue(batching("default_queue_policy { max_queue_size: 1 }"))
    assert queue.push(pending(1), 0) is None
    refused = queue.push(pending(2, request_id="r2"), 0)
    assert refused is not None and refused.code is ErrorCode.UNAVAILABLE
    assert refused.message == "[request id: r2] Exceeds maximum queue size"
    queue.remove([next(iter(queue))])
    assert queue.push(pending(3), 0) is None  # room again once one left


def test_expire_rejects_or_delays_by_policy():
    text = (
        "priority_levels: 2 default_priority_level: 1 "
        "default_queue_policy { default_timeout_microseconds: 1000 } "
        "priority_queue_policy { key: 2 value: { timeout_action: DELAY default_timeout_microseconds: 1000 } }"
    )
    queue = RequestQueue(batching(text))
    for value, priority in [(1, 1), (2, 2), (3, 2)]:
        queue.push(pending(value, priority), 0)
    assert queue.next_deadline() == 1 * MS
    assert queue.expire(1 * MS) == []  # not past yet
    queue.push(pending(4, 2), 1 * MS)
    rejected = queue.expire(1 * MS + 1)
    assert [int(p.request.inputs[0].data[0]) for p in rejected] == [1]
    assert rejected[0].state == GONE
    assert values(queue) == [4, 2, 3]  # the delayed ones follow the level's requests that did not time out
    assert queue.live == 3 and queue.next_deadline() == 2 * MS


def test_removing_from_the_middle_keeps_order_and_compacts():
    queue = RequestQueue(batching(""))
    items = [pending(v) for v in range(100)]
    for item in items:
        queue.push(item, 0)
    queue.remove(items[1::2])
    assert values(queue) == list(range(0, 100, 2))
    assert queue.live == 50
    queue.remove(items[::2])
    assert values(queue) == [] and queue.live == 0
