"""The response cache's store and keys (scheduling.response_cache), below what the end-to-end tests reach: what a key
depends on, least-recently-used eviction, copies that no later write reaches, `--cache-config` parsing."""

from __future__ import annotations

import numpy as np
import pytest

from transerve.core.errors import ServerError
from transerve.core.types import InferRequest, RequestedOutput, Tensor
from transerve.scheduling.response_cache import ResponseCache, parse_cache_config, request_key


def request(*tensors: Tensor, **fields) -> InferRequest:
    return InferRequest("m", list(tensors), **fields)


def fp32(name: str, values: list[float]) -> Tensor:
    return Tensor(name, "FP32", np.array(values, np.float32))


def test_a_key_is_the_model_and_the_inputs_only() -> None:
    base = request_key("m", "1", request(fp32("A", [1, 2]), fp32("B", [3])))
    assert request_key("m", "1", request(fp32("B", [3]), fp32("A", [1, 2]), id="x", parameters={"p": 1},
                                         outputs=[RequestedOutput("OUT")])) == base
    different = [
        request_key("n", "1", request(fp32("A", [1, 2]), fp32("B", [3]))),
        request_key("m", "2", request(fp32("A", [1, 2]), fp32("B", [3]))),
        request_key("m", "1", request(fp32("A", [1, 2]), fp32("B", [4]))),
        request_key("m", "1", request(Tensor("A", "FP32", np.array([[1, 2]], np.float32)), fp32("B", [3]))),
        request_key("m", "1", request(Tensor("A", "INT32", np.array([1, 2], np.int32)), fp32("B", [3]))),
        request_key("m", "1", request(fp32("C", [1, 2]), fp32("B", [3]))),
    ]
    assert base not in different and len(set(different)) == len(different)
    strings = [request_key("m", "1", request(Tensor("T", "BYTES", np.array(items, dtype=np.object_))))
               for items in ([b"ab", b"c"], [b"a", b"bc"])]
    assert strings[0] != strings[1]


def test_least_recently_used_answers_make_room() -> None:
    cache = ResponseCache(size=16)
    for key in (b"a", b"b"):  # 8 bytes each: both fit
        cache.insert(key, [fp32("OUT", [1.0, 2.0])])
    assert cache.lookup(b"a") is not None  # a is now the most recently used
    cache.insert(b"c", [fp32("OUT", [3.0, 4.0])])  # b makes room
    assert cache.lookup(b"b") is None
    assert cache.lookup(b"a") is not None and cache.lookup(b"c") is not None
    assert (cache.entries, cache.used, cache.stats.evictions) == (2, 16, 1)
    cache.insert(b"e", [fp32("OUT", [0.0] * 7)])  # larger than the whole cache: not kept, nothing evicted
    assert cache.lookup(b"e") is None and cache.entries == 2
    assert (cache.stats.hits, cache.stats.misses) == (3, 2)


def test_kept_answers_are_read_only_copies() -> None:
    cache = ResponseCache(size=1024)
    produced = fp32("OUT", [1.0, 2.0])
    cache.insert(b"k", [produced])
    produced.data[0] = 99.0  # a backend reusing its output memory
    (kept,) = cache.lookup(b"k")
    assert kept.data.tolist() == [1.0, 2.0]
    with pytest.raises(ValueError):
        kept.data[0] = 5.0


@pytest.mark.parametrize(("values", "expected"), [
    ([], None), (["local,size=1048576"], 1048576), (["local,size=1", "local,size=64"], 64),
])
def test_cache_config(values: list[str], expected: int | None) -> None:
    assert parse_cache_config(values) == expected


@pytest.mark.parametrize("value", ["redis,host=localhost", "local,size=-1", "local,bytes=10", "local"])
def test_cache_config_mistakes(value: str) -> None:
    with pytest.raises(ServerError):
        parse_cache_config([value])
