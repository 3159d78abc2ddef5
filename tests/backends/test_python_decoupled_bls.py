"""The python backend's decoupled models, cancellation and BLS, driven directly (no server).

BLS calls go to `FakeCore`, which answers them as the core would: `get_version` and `infer_stream`,
with models that are coroutines feeding a ResponseStream.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from test_python_backend import context, fp32_request, outputs, with_model, write_model

from transerve.backends.base import BackendModel
from transerve.core.errors import ErrorCode, ServerError, invalid_arg, not_found
from transerve.core.streams import ResponseStream
from transerve.core.tracing import TraceOptions, Tracer
from transerve.core.tracing.options import TIMESTAMPS
from transerve.core.types import InferRequest, InferResponse, Tensor

DECOUPLED_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

FakeModel = Callable[[InferRequest, ResponseStream], Awaitable[None]]


class FakeCore:
    """The core as a BLS call sees it. Models named `stream*` are decoupled."""

    def __init__(self, **models: FakeModel) -> None:
        self.models = models
        self.calls: list[InferRequest] = []
        self.tracing: Tracer | None = None

    def get_version(self, name: str, version: str = "") -> Any:
        if name not in self.models:
            raise not_found(f"Request for unknown model: '{name}' is not found")
        policy = SimpleNamespace(decoupled=name.startswith("stream"))
        return SimpleNamespace(config=SimpleNamespace(model_transaction_policy=policy))

    def infer_stream(self, request: InferRequest) -> ResponseStream:
        if any(tensor.datatype != "FP32" for tensor in request.inputs):
            raise invalid_arg("inference input 'INPUT0' data-type is 'INT32', but model expects 'FP32'")
        self.calls.append(request)
        stream = ResponseStream(asyncio.get_running_loop())
        task = asyncio.ensure_future(self.models[request.model_name](request, stream))
        stream.on_cancel(task.cancel)
        return stream


def response(values: np.ndarray) -> InferResponse:
    return InferResponse("fake", "1", [Tensor("OUTPUT0", "FP32", values)])


async def double(request: InferRequest, stream: ResponseStream) -> None:
    await asyncio.sleep(float(request.parameters.get("delay", 0.0)))
    stream.send(response(request.inputs[0].data * 2), final=True)


async def failing(request: InferRequest, stream: ResponseStream) -> None:
    stream.fail(ServerError(ErrorCode.NOT_FOUND, "no such thing"))


async def stream_three(request: InferRequest, stream: ResponseStream) -> None:
    for index in range(3):
        await asyncio.sleep(0.01)
        stream.send(response(request.inputs[0].data + index))
    stream.close()


def stream_request(values: list[float]) -> tuple[InferRequest, ResponseStream]:
    request = fp32_request(values)
    request.response_stream = ResponseStream(asyncio.get_running_loop())
    return request, request.response_stream


async def drain(stream: ResponseStream) -> list[tuple[Any, bool]]:
    items = []
    while True:
        try:
            items.append(await asyncio.wait_for(stream.receive(), 10))
        except StopAsyncIteration:
            return items


def values(item: Any) -> list[float]:
    return outputs(item)["OUTPUT0"].tolist()


# --- decoupled models -------------------------------------------------------------------------------

STREAMING_MODEL = """
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            data = request.inputs()[0].as_numpy()
            sender = request.get_response_sender()
            assert sender is request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data)], parameters={"n": 0}))
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("odd", pb_utils.TritonError.INVALID_ARG)))
            threading.Thread(target=self.later, args=(sender, data)).start()
        return None

    def later(self, sender, data):
        time.sleep(0.05)  # execute has returned by now
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data + 1)]))
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data + 2)]), flags=FINAL)
"""


def test_decoupled_responses_come_from_execute_and_from_threads_in_order(tmp_path: Path):
    write_model(tmp_path, "streaming", STREAMING_MODEL, DECOUPLED_CONFIG)

    async def check(model: BackendModel) -> None:
        (first, first_stream), (second, second_stream) = stream_request([1.0]), stream_request([10.0, 20.0])
        first.id = "a"
        result = await model.instances[0].execute([first, second])
        assert result.results == [None, None]  # the responses went through the streams
        for stream, data in ((first_stream, [1.0]), (second_stream, [10.0, 20.0])):
            items = await drain(stream)
            assert [final for _, final in items] == [False, False, False, True]
            head, error, middle, last = (item for item, _ in items)
            assert values(head) == data and head.parameters == {"n": 0}
            assert isinstance(error, ServerError) and (error.code, error.message) == (ErrorCode.INVALID_ARG, "odd")
            assert values(middle) == [v + 1 for v in data] and values(last) == [v + 2 for v in data]
            assert (head.model_name, head.model_version) == ("streaming", "1")
        assert first_stream.final_sent and head.id == "" and (await drain(first_stream)) == []

    with_model(context(tmp_path, "streaming"), check)


MISUSE_MODEL = """
import os
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        value = float(requests[0].inputs()[0].as_numpy()[0])
        sender = requests[0].get_response_sender()
        if value == 1:
            return [pb_utils.InferenceResponse([]) for _ in requests]
        if value == 2:
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.array([2.0], np.float32))]))
            raise RuntimeError("half way")
        if value == 3:
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.array([3.0], np.float32))]))
            threading.Thread(target=lambda: (time.sleep(0.05), os._exit(5))).start()
        return None
"""


def test_decoupled_execute_errors_and_a_dying_worker_end_the_streams(tmp_path: Path):
    write_model(tmp_path, "misuse", MISUSE_MODEL, DECOUPLED_CONFIG)

    async def check(model: BackendModel) -> None:
        instance = model.instances[0]
        request, stream = stream_request([1.0])
        (error,) = (await instance.execute([request])).results
        assert isinstance(error, ServerError) and error.code is ErrorCode.INTERNAL
        assert error.message.endswith(
            "Python model 'misuse_0' is using the decoupled mode and the execute function must return None.")
        request, stream = stream_request([2.0])
        (error,) = (await instance.execute([request])).results
        assert error.message.endswith("message: RuntimeError: half way")
        stream.fail(error)  # what the core does with an execute's error (core/server.py)
        sent, ended = await drain(stream)
        assert values(sent[0]) == [2.0] and ended == (error, True)
        # A worker that dies fails its open streams itself: this one's execute had returned.
        request, stream = stream_request([3.0])
        assert (await instance.execute([request])).results == [None]
        sent, (failure, final) = await drain(stream)
        assert values(sent[0]) == [3.0] and final and not stream.final_sent
        assert isinstance(failure, ServerError) and "process exited unexpectedly (code 5)" in failure.message

    with_model(context(tmp_path, "misuse"), check)


CANCELLABLE_MODEL = """
import json
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            marker = json.loads(request.parameters())["marker"]
            open(marker + ".started", "w").close()
            sender = request.get_response_sender()
            sent = 0
            while not request.is_cancelled() and sent < 1000:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.array([sent], np.float32))]))
                sent += 1
                time.sleep(0.01)
            open(marker, "w").write(f"{sender.is_cancelled()} {sent}")
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def test_cancelling_a_stream_reaches_the_running_model_and_skips_waiting_requests(tmp_path: Path):
    write_model(tmp_path, "cancellable", CANCELLABLE_MODEL, DECOUPLED_CONFIG)
    running, waiting = tmp_path / "running", tmp_path / "waiting"

    async def check(model: BackendModel) -> None:
        instance = model.instances[0]
        first, first_stream = stream_request([0.0])
        first.parameters = {"marker": str(running)}
        second, second_stream = stream_request([0.0])
        second.parameters = {"marker": str(waiting)}
        executions = [asyncio.ensure_future(instance.execute([request])) for request in (first, second)]
        await asyncio.wait_for(first_stream.receive(), 10)
        second_stream.cancel()  # queued in the worker behind the first: never computed
        await asyncio.sleep(0.1)
        first_stream.cancel()
        first_result, second_result = await asyncio.wait_for(asyncio.gather(*executions), 10)
        assert first_result.results == [None]
        assert running.read_text().split()[0] == "True" and int(running.read_text().split()[1]) < 100
        (skipped,) = second_result.results
        assert isinstance(skipped, ServerError) and skipped.code is ErrorCode.CANCELLED
        assert not waiting.exists() and not (tmp_path / "waiting.started").exists()

    with_model(context(tmp_path, "cancellable"), check)


ASYNC_DECOUPLED_MODEL = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        for request in requests:
            await asyncio.sleep(0.3)
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", request.inputs()[0].as_numpy())]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    async def is_ready(self):
        return True
"""


ASYNC_SERIAL_MODEL = """
import asyncio
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        await asyncio.sleep(0.3)
        return [pb_utils.InferenceResponse([]) for _ in requests]
"""


def test_async_decoupled_executes_overlap_and_others_run_one_at_a_time(tmp_path: Path):
    write_model(tmp_path, "overlap", ASYNC_DECOUPLED_MODEL, DECOUPLED_CONFIG)
    write_model(tmp_path, "serial", ASYNC_SERIAL_MODEL)

    async def overlapping(model: BackendModel) -> None:
        streams = [stream_request([float(i)]) for i in range(3)]
        started = time.monotonic()
        results = await asyncio.gather(*(model.instances[0].execute([request]) for request, _ in streams))
        assert time.monotonic() - started < 0.8  # three 0.3 s executes, concurrently (Triton 24.04+)
        assert [result.results for result in results] == [[None]] * 3
        for index, (_, stream) in enumerate(streams):
            assert [values(item) for item, _ in await drain(stream)] == [[float(index)]]
        assert await model.instances[0].is_ready()

    async def serial(model: BackendModel) -> None:
        started = time.monotonic()
        await asyncio.gather(*(model.instances[0].execute([fp32_request([1.0])]) for _ in range(2)))
        assert time.monotonic() - started >= 0.6

    with_model(context(tmp_path, "overlap"), overlapping)
    with_model(context(tmp_path, "serial"), serial)


# --- BLS --------------------------------------------------------------------------------------------

BLS_MODEL = """
import json
from concurrent.futures import ThreadPoolExecutor
import numpy as np
import triton_python_backend_utils as pb_utils

def call(model, data, delay=0.0, **kwargs):
    return pb_utils.InferenceRequest(model_name=model, inputs=[pb_utils.Tensor("INPUT0", data)],
                                     requested_output_names=["OUTPUT0"], parameters={"delay": str(delay)}, **kwargs)

def describe(response):
    if response.has_error():
        return [int(response.error().code()), response.error().message()]
    return [value for tensor in response.output_tensors() for value in tensor.as_numpy().tolist()]

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = request.inputs()[0].as_numpy()
            mode = json.loads(request.parameters()).get("mode", "double")
            if mode == "double":
                seen = describe(call("double", data, 0.05, request_id="r1", timeout=7).exec())
            elif mode == "errors":
                seen = [describe(call(name, data).exec()) for name in ("nope", "failing", "stream_three")]
                seen.append(describe(pb_utils.InferenceRequest(
                    model_name="double", inputs=[pb_utils.Tensor("INPUT0", data.astype(np.int32))],
                    requested_output_names=["OUTPUT0"]).exec()))
            elif mode == "stream":
                seen = [describe(r) for r in call("stream_three", data).exec(decoupled=True)]
            elif mode == "threads":  # BLS from threads the model starts, while this thread waits on them
                with ThreadPoolExecutor(4) as pool:
                    seen = list(pool.map(lambda i: describe(call("double", data + i, 0.05).exec()), range(4)))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.array([json.dumps(seen)],
                                                                                            dtype=object))]))
        return responses
"""

BLS_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


def seen(result: Any) -> Any:
    """What the BLS model reported (JSON in its one output)."""
    (answer,) = result.results
    assert isinstance(answer, InferResponse), answer
    return json.loads(outputs(answer)["OUTPUT0"][0])


def test_sync_bls_answers_errors_and_streams(tmp_path: Path):
    write_model(tmp_path, "bls", BLS_MODEL, BLS_CONFIG)
    core = FakeCore(double=double, failing=failing, stream_three=stream_three)

    async def check(model: BackendModel) -> None:
        instance = model.instances[0]
        assert seen(await instance.execute([fp32_request([1.5, 2.0])])) == [3.0, 4.0]
        (call,) = core.calls
        assert (call.model_name, call.id, call.timeout_us, [o.name for o in call.outputs]) == (
            "double", "r1", 7, ["OUTPUT0"])
        unknown, failed, decoupled, invalid = seen(await instance.execute([fp32_request([1.0], parameters={
            "mode": "errors"})]))
        assert unknown == [1, "Model nope - Error when running inference: Failed for execute the inference "
                              "request. Model 'nope' is not ready."]
        assert failed == [2, "no such thing"]  # the called model's own code
        assert decoupled[0] == 1 and "Model stream_three is using the decoupled." in decoupled[1]
        assert invalid == [1, "Model double - Error when running inference: inference input 'INPUT0' data-type is "
                              "'INT32', but model expects 'FP32'"]
        streamed = seen(await instance.execute([fp32_request([1.0], parameters={"mode": "stream"})]))
        assert streamed == [[1.0], [2.0], [3.0], []]  # the final flag alone is an empty response, as in Triton

    with_model(context(tmp_path, "bls", runtime=core), check)


def test_sync_bls_while_more_executes_and_threads_arrive(tmp_path: Path):
    write_model(tmp_path, "bls", BLS_MODEL, BLS_CONFIG)

    async def check(model: BackendModel) -> None:
        instance = model.instances[0]
        # Eight executes for a pipeline four deep: the worker receives executes while `exec()` waits.
        results = await asyncio.gather(*(instance.execute([fp32_request([float(i)])]) for i in range(8)))
        assert [seen(result) for result in results] == [[2.0 * i] for i in range(8)]
        threaded = seen(await instance.execute([fp32_request([1.0], parameters={"mode": "threads"})]))
        assert threaded == [[2.0], [4.0], [6.0], [8.0]]
        assert instance._worker.connection.live_blocks == 0

    with_model(context(tmp_path, "bls", runtime=FakeCore(double=double)), check)


ASYNC_BLS_MODEL = """
import asyncio
import time
import numpy as np
import triton_python_backend_utils as pb_utils

def call(model, data):
    return pb_utils.InferenceRequest(model_name=model, inputs=[pb_utils.Tensor("INPUT0", data)],
                                     requested_output_names=["OUTPUT0"], parameters={"delay": "0.3"})

class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            data = request.inputs()[0].as_numpy()
            started = time.monotonic()
            answers = await asyncio.gather(*(call("double", data + i).async_exec() for i in range(4)))
            elapsed = time.monotonic() - started
            totals = [float(a.output_tensors()[0].as_numpy()[0]) for a in answers]
            async for streamed in await call("stream_three", data).async_exec(decoupled=True):
                if streamed.output_tensors():
                    totals.append(float(streamed.output_tensors()[0].as_numpy()[0]))
            totals.append(elapsed)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.array(totals, np.float32))]))
        return responses
"""


def test_async_bls_calls_run_concurrently(tmp_path: Path):
    write_model(tmp_path, "async_bls", ASYNC_BLS_MODEL)

    async def check(model: BackendModel) -> None:
        result = await model.instances[0].execute([fp32_request([1.0])])
        *totals, elapsed = outputs(result.results[0])["OUTPUT0"].tolist()
        assert totals == [2.0, 4.0, 6.0, 8.0, 1.0, 2.0, 3.0]
        assert elapsed < 0.75, elapsed  # four 0.3 s calls at once

    with_model(context(tmp_path, "async_bls", runtime=FakeCore(double=double, stream_three=stream_three)), check)


DYING_BLS_MODEL = """
import os
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        threading.Timer(0.2, os._exit, (9,)).start()
        pb_utils.InferenceRequest(model_name="endless", inputs=[pb_utils.Tensor("INPUT0", np.zeros(1, np.float32))],
                                  requested_output_names=["OUTPUT0"]).exec()
"""


def test_a_dying_worker_cancels_its_bls_calls(tmp_path: Path):
    write_model(tmp_path, "dying", DYING_BLS_MODEL)
    stopped: list[bool] = []

    async def endless(request: InferRequest, stream: ResponseStream) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            stopped.append(True)
            raise

    async def check(model: BackendModel) -> None:
        (error,) = (await asyncio.wait_for(model.instances[0].execute([fp32_request([1.0])]), 10)).results
        assert isinstance(error, ServerError) and "process exited unexpectedly (code 9)" in error.message
        await asyncio.sleep(0.05)
        assert stopped == [True]  # the model it called was told

    with_model(context(tmp_path, "dying", runtime=FakeCore(endless=endless)), check)


@pytest.mark.parametrize("decoupled", [False, True])
def test_bls_outside_a_worker_is_refused(decoupled: bool):
    from transerve.backends.python import triton_python_backend_utils as pb_utils

    request = pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[])
    with pytest.raises(pb_utils.TritonModelException, match="only inside a model served by transerve"):
        request.exec(decoupled=decoupled)


ABANDONING_MODEL = """
import gc
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        data = requests[0].inputs()[0].as_numpy()
        stream = pb_utils.InferenceRequest(model_name="stream_three", inputs=[pb_utils.Tensor("INPUT0", data)],
                                           requested_output_names=["OUTPUT0"]).exec(decoupled=True)
        first = next(stream).output_tensors()[0].as_numpy()
        del stream  # the rest of its answers are dropped as they come
        gc.collect()
        again = pb_utils.InferenceRequest(model_name="double", inputs=[pb_utils.Tensor("INPUT0", first)],
                                          requested_output_names=["OUTPUT0"]).exec()
        return [pb_utils.InferenceResponse(again.output_tensors())]
"""


def test_a_bls_iterator_dropped_early_does_not_disturb_later_calls(tmp_path: Path):
    write_model(tmp_path, "abandoning", ABANDONING_MODEL)

    async def check(model: BackendModel) -> None:
        for _ in range(20):
            result = await model.instances[0].execute([fp32_request([5.0])])
            assert values(result.results[0]) == [10.0]
        # Answers that came after the last reply are released with the worker's next message: no growth.
        assert model.instances[0]._worker.connection.live_blocks <= 2

    with_model(context(tmp_path, "abandoning", runtime=FakeCore(double=double, stream_three=stream_three)), check)


TRACED_BLS_MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = request.inputs()[0].as_numpy()
            trace = request.trace()
            for traced in (True, False):
                pb_utils.InferenceRequest(model_name="double", inputs=[pb_utils.Tensor("INPUT0", data)],
                                          requested_output_names=["OUTPUT0"], **({"trace": trace} if traced else {})
                                          ).exec()
            try:
                pb_utils.InferenceRequest(model_name="double", inputs=[], requested_output_names=[], trace=None)
            except TypeError as exc:
                refused = str(exc)
            seen = {"context": trace.get_context(), "refused": refused}
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.array([json.dumps(seen)],
                                                                                            dtype=object))]))
        return responses
"""


def test_bls_calls_with_the_requests_trace_are_its_children(tmp_path: Path):
    """`trace=request.trace()` names the request's trace id to the server, which traces the call as a child of the
    running request (only of the calling model's own); without it, or with None (as Triton), the call is not."""
    write_model(tmp_path, "bls", TRACED_BLS_MODEL, BLS_CONFIG)
    core = FakeCore(double=double)
    core.tracing = Tracer(TraceOptions(level=TIMESTAMPS, rate=1, file=str(tmp_path / "trace.json")))

    async def check(model: BackendModel) -> None:
        for owner in ("bls", "another_model"):
            request = fp32_request([1.0])
            trace = core.tracing.start(request)
            assert trace is not None
            request.trace.started(owner, "1", "", request.inputs)
            answer = seen(await model.instances[0].execute([request]))
            assert answer == {"context": None,
                              "refused": "InferenceRequest(): trace must be InferenceTrace, not NoneType"}
            traced, untraced = core.calls[-2:]
            assert untraced.trace is None
            if owner == "bls":
                assert (traced.trace.parent_id, traced.trace.id) == (request.trace.id, request.trace.id + 1)
            else:  # a trace id of another model's request names nothing here
                assert traced.trace is None
            request.trace.ended(None)
            trace.finish()

    with_model(context(tmp_path, "bls", runtime=core), check)
