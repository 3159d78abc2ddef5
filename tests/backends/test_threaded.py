"""ThreadedInstance with a stand-in engine: merging, trimming, requested outputs, and engine failures."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from transerve.backends.threaded import ThreadedInstance, import_engine
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.types import InferRequest, InferResponse, RequestedOutput, Tensor

CONFIG = """
name: "m" max_batch_size: {batch}
input [ {{ name: "ids" data_type: TYPE_INT64 dims: [ -1 ] }} ]
output [ {{ name: "states" data_type: TYPE_FP32 dims: [ -1, 2 ] }},
         {{ name: "fixed" data_type: TYPE_FP32 dims: [ 3 ] }},
         {{ name: "count" data_type: TYPE_INT64 dims: [ 1 ] }} ]
"""


class Engine:
    """states: each id twice, as floats; fixed: three values (its axis happens to equal some lengths);
    count: the number of non-zero ids."""

    def __init__(self, fail: Exception | None = None, count_dtype: type = np.int64) -> None:
        self.calls: list[tuple[tuple[int, ...], list[str]]] = []
        self.fail = fail
        self.count_dtype = count_dtype

    def run(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        ids = inputs["ids"]
        self.calls.append((ids.shape, list(outputs)))
        if self.fail:
            raise self.fail
        produced = {
            "states": np.repeat(ids[:, :, None], 2, axis=2).astype(np.float32),
            "fixed": np.ones((ids.shape[0], 3), dtype=np.float32),
            "count": (ids != 0).sum(axis=1, keepdims=True).astype(self.count_dtype),
        }
        return {name: produced[name] for name in outputs}


def run(engine: Engine, requests: list[InferRequest], batch: int = 8) -> list[InferResponse | ServerError]:
    config = text_format.Parse(CONFIG.format(batch=batch), model_config_pb2.ModelConfig())

    async def go() -> list[InferResponse | ServerError]:
        executor = ThreadPoolExecutor(1)
        instance = ThreadedInstance("m", "1", "m_0", config, executor, engine, asyncio.get_running_loop())
        try:
            return (await instance.execute(requests)).results
        finally:
            await instance.close()

    return asyncio.run(go())


def ids(*rows: list[int], outputs: list[str] | None = None) -> InferRequest:
    wanted = None if outputs is None else [RequestedOutput(name) for name in outputs]
    return InferRequest("m", [Tensor("ids", "INT64", np.array(rows, dtype=np.int64))], outputs=wanted)


def by_name(response: InferResponse | ServerError) -> dict[str, np.ndarray]:
    assert isinstance(response, InferResponse), response
    return {tensor.name: tensor.data for tensor in response.outputs}


def test_a_batch_runs_once_padded_and_each_request_gets_its_own_length_back():
    engine = Engine()
    first, second, third = run(engine, [ids([1, 2, 3]), ids([4], [5]), ids([6, 7, 8])])
    assert engine.calls == [((4, 3), ["states", "fixed", "count"])]
    assert by_name(first)["states"].shape == (1, 3, 2)
    assert by_name(second)["states"].tolist() == [[[4, 4]], [[5, 5]]]  # trimmed from 3 back to 1
    assert by_name(second)["count"].tolist() == [[1], [1]]  # padding is zeros, which the engine saw
    assert by_name(second)["fixed"].shape == (2, 3)  # a fixed axis is never trimmed, even one as long as the padding
    assert by_name(third)["states"][0, :, 0].tolist() == [6, 7, 8]


def test_only_the_outputs_asked_for_are_computed_and_returned():
    engine = Engine()
    first, second = run(engine, [ids([1], outputs=["count"]), ids([2], outputs=["fixed", "count"])])
    assert engine.calls == [((2, 1), ["fixed", "count"])]
    assert list(by_name(first)) == ["count"] and list(by_name(second)) == ["fixed", "count"]


def test_a_model_that_does_not_batch_runs_each_request_alone():
    engine = Engine()
    results = run(engine, [ids([1, 2]), ids([3])], batch=0)
    assert [shape for shape, _ in engine.calls] == [(1, 2), (1, 1)]
    assert [by_name(r)["count"].tolist() for r in results] == [[[2]], [[1]]]


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        (Engine(fail=RuntimeError("kernel exploded")), "model 'm' instance 'm_0': RuntimeError: kernel exploded"),
        (Engine(count_dtype=np.int32), "produced output 'count' as int32, but its config declares INT64"),
    ],
)
def test_an_engine_failure_fails_every_request_of_the_batch_as_internal(engine: Engine, message: str):
    results = run(engine, [ids([1]), ids([2])])
    assert all(isinstance(r, ServerError) and r.code is ErrorCode.INTERNAL and message in r.message for r in results)


def test_a_missing_engine_names_the_extra_to_install():
    with pytest.raises(ServerError) as caught:
        import_engine("transerve_no_such_engine", "onnx")
    assert caught.value.code is ErrorCode.UNAVAILABLE
    assert caught.value.message.endswith("pip install 'transerve[onnx]'")
