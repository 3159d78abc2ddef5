"""The python backend driven directly (no server): real worker processes running Triton-style models."""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from transerve.backends.base import BackendModel, ExecutionResult, ModelContext
from transerve.backends.python import ipc, shm
from transerve.backends.python import triton_python_backend_utils as pb_utils
from transerve.backends.python.backend import PythonBackend, PythonInstance
from transerve.config import model_config
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.types import InferRequest, InferResponse, RequestedOutput, Tensor

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model_repository"

SIMPLE_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def context(repository: Path, name: str, **options: Any) -> ModelContext:
    model_path = repository / name
    config = model_config.load_config_file(model_path)
    model_config.normalize(config, name)
    model_config.validate(config, name)
    return ModelContext(name, "1", model_path, model_path / "1", repository, config, **options)


def write_model(repository: Path, name: str, model_py: str, config: str | None = SIMPLE_CONFIG) -> Path:
    version = repository / name / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(textwrap.dedent(model_py))
    if config is not None:
        (repository / name / "config.pbtxt").write_text(f'name: "{name}"\n{config}')
    return repository / name


def with_model(ctx: ModelContext, test: Callable[[BackendModel], Awaitable[None]]) -> None:
    """Load the model, run `test` against it and always unload, all on one event loop."""

    async def run() -> None:
        model = await PythonBackend().load(ctx)
        try:
            await test(model)
        finally:
            await model.unload()

    asyncio.run(run())


def fp32_request(values: list[float], name: str = "INPUT0", **fields: Any) -> InferRequest:
    return InferRequest("m", [Tensor(name, "FP32", np.array(values, dtype=np.float32))], **fields)


async def execute(instance: Any, *requests: InferRequest) -> ExecutionResult:
    return await instance.execute(list(requests))


def only_response(result: ExecutionResult) -> InferResponse:
    (response,) = result.results
    assert isinstance(response, InferResponse), response
    return response


def outputs(response: InferResponse) -> dict[str, np.ndarray]:
    return {tensor.name: tensor.data for tensor in response.outputs}


ECHO_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", r.inputs()[0].as_numpy())]) for r in requests]
"""


# --- the example models ---------------------------------------------------------------------------


def test_add_sub_adds_and_subtracts_with_timings():
    async def check(model: BackendModel) -> None:
        in0 = np.array([[1, 2, 3, 4]], dtype=np.float32)
        in1 = np.array([[10, 20, 30, 40]], dtype=np.float32)
        request = InferRequest("add_sub", [Tensor("INPUT0", "FP32", in0), Tensor("INPUT1", "FP32", in1)], id="abc")
        result = await execute(model.instances[0], request)
        response = only_response(result)
        assert (response.model_name, response.model_version, response.id) == ("add_sub", "1", "abc")
        got = outputs(response)
        np.testing.assert_array_equal(got["OUTPUT0"], in0 + in1)
        np.testing.assert_array_equal(got["OUTPUT1"], in0 - in1)
        assert [t.datatype for t in response.outputs] == ["FP32", "FP32"]
        assert result.compute_input_ns > 0 and result.compute_infer_ns > 0 and result.compute_output_ns > 0

    with_model(context(EXAMPLES, "add_sub"), check)


def test_identity_round_trips_every_datatype():
    arrays = {
        "BOOL": np.array([[True, False, True]]),
        "UINT8": np.array([[0, 7, 255]], dtype=np.uint8),
        "UINT16": np.array([[0, 7, 65535]], dtype=np.uint16),
        "UINT32": np.array([[0, 7, 2**32 - 1]], dtype=np.uint32),
        "UINT64": np.array([[0, 7, np.iinfo(np.uint64).max]], dtype=np.uint64),
        "INT8": np.array([[-128, 0, 127]], dtype=np.int8),
        "INT16": np.array([[-32768, 0, 32767]], dtype=np.int16),
        "INT32": np.array([[-(2**31), 0, 2**31 - 1]], dtype=np.int32),
        "INT64": np.array([[np.iinfo(np.int64).min, 0, np.iinfo(np.int64).max]], dtype=np.int64),
        "FP16": np.array([[-1.5, 0.0, 65504.0]], dtype=np.float16),
        "FP32": np.array([[-1.5, np.inf, 3.25]], dtype=np.float32),
        "FP64": np.array([[-1e300, np.nan, 1e-300]], dtype=np.float64),
        "STRING": np.array([["안녕 😀".encode(), b"", b"\x00\xff"]], dtype=np.object_),
    }

    async def check(model: BackendModel) -> None:
        request = InferRequest(
            "identity",
            [Tensor(f"INPUT_{name}", "BYTES" if name == "STRING" else name, data) for name, data in arrays.items()],
        )
        response = only_response(await execute(model.instances[0], request))
        assert [t.name for t in response.outputs] == [f"OUTPUT_{name}" for name in arrays]
        for tensor in response.outputs:
            name = tensor.name[len("OUTPUT_") :]
            assert tensor.datatype == ("BYTES" if name == "STRING" else name)
            assert tensor.data.dtype == arrays[name].dtype and tensor.data.shape == arrays[name].shape
            np.testing.assert_array_equal(tensor.data, arrays[name])
        assert list(outputs(response)["OUTPUT_STRING"][0]) == ["안녕 😀".encode(), b"", b"\x00\xff"]

    with_model(context(EXAMPLES, "identity"), check)


def test_strings_model_sees_utf8_and_returns_str_objects_as_bytes():
    async def check(model: BackendModel) -> None:
        text = np.array(["héllo".encode(), b"", "straße".encode()], dtype=np.object_)
        request = InferRequest("strings", [Tensor("TEXT", "BYTES", text)])
        response = only_response(await execute(model.instances[0], request))
        got = outputs(response)
        assert list(got["UPPER"]) == ["HÉLLO".encode(), b"", b"STRASSE"]
        np.testing.assert_array_equal(got["LENGTH"], [5, 0, 6])

    with_model(context(EXAMPLES, "strings"), check)


def test_request_parameters_reach_the_model_as_json():
    async def check(model: BackendModel) -> None:
        request = fp32_request([1.0, 2.0], parameters={"scale": 3, "note": "héllo", "flag": True})
        got = outputs(only_response(await execute(model.instances[0], request)))
        np.testing.assert_array_equal(got["OUTPUT0"], [3.0, 6.0])
        echo = json.loads(got["PARAMETERS"][0])
        assert echo == {
            "config": {"greeting": "hello", "scale": "2.0"},
            "request": {"scale": 3, "note": "héllo", "flag": True},
        }
        default = outputs(only_response(await execute(model.instances[0], fp32_request([1.0]))))
        np.testing.assert_array_equal(default["OUTPUT0"], [2.0])

    with_model(context(EXAMPLES, "params"), check)


def test_requested_outputs_are_the_only_ones_returned():
    async def check(model: BackendModel) -> None:
        in0 = np.ones((1, 4), np.float32)
        request = InferRequest(
            "add_sub",
            [Tensor("INPUT0", "FP32", in0), Tensor("INPUT1", "FP32", in0)],
            outputs=[RequestedOutput("OUTPUT1")],
        )
        response = only_response(await execute(model.instances[0], request))
        assert [t.name for t in response.outputs] == ["OUTPUT1"]

    with_model(context(EXAMPLES, "add_sub"), check)


# --- the lifecycle ----------------------------------------------------------------------------------


def test_initialize_receives_every_argument_triton_passes(tmp_path: Path):
    model_path = write_model(
        tmp_path,
        "args",
        """
        import json
        import numpy as np
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def initialize(self, args):
                self.args = args

            def execute(self, requests):
                seen = json.dumps({"args": self.args, "model_dir": pb_utils.get_model_dir()})
                return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.array([seen], dtype=object))])
                        for _ in requests]
        """,
        """
        backend: "python"
        input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 1 ] } ]
        instance_group [ { name: "grp" count: 2 kind: KIND_CPU } ]
        """,
    )

    async def check(model: BackendModel) -> None:
        assert [instance.name for instance in model.instances] == ["grp_0", "grp_1"]
        seen = [
            json.loads(outputs(only_response(await execute(instance, fp32_request([1.0]))))["OUTPUT0"][0])
            for instance in model.instances
        ]
        for index, entry in enumerate(seen):
            args = entry["args"]
            assert set(args) == {
                "model_config",
                "model_instance_kind",
                "model_instance_name",
                "model_instance_device_id",
                "model_repository",
                "model_version",
                "model_name",
            }
            assert all(isinstance(value, str) for value in args.values())
            assert args["model_instance_kind"] == "CPU"
            assert args["model_instance_name"] == f"grp_{index}"
            assert args["model_instance_device_id"] == "0"
            assert args["model_repository"] == str(model_path)
            assert (args["model_version"], args["model_name"]) == ("1", "args")
            config = json.loads(args["model_config"])
            assert config["name"] == "args" and config["output"][0]["data_type"] == "TYPE_STRING"
            assert entry["model_dir"] == str(model_path / "1")

    with_model(context(tmp_path, "args"), check)


AUTO_COMPLETE_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]})
        auto_complete_model_config.add_output({"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]})
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", r.inputs()[0].as_numpy() * 2)])
                for r in requests]
"""


def test_auto_complete_config_fills_in_the_config(tmp_path: Path):
    write_model(tmp_path, "auto", AUTO_COMPLETE_MODEL, config='backend: "python"\n')

    async def check(model: BackendModel) -> None:
        assert model.config.max_batch_size == 4
        assert model.config.HasField("dynamic_batching")
        assert [t.name for t in model.config.input] == ["INPUT0"]
        assert [(t.name, list(t.dims)) for t in model.config.output] == [("OUTPUT0", [-1])]
        request = InferRequest("auto", [Tensor("INPUT0", "FP32", np.array([[1.5]], np.float32))])
        got = outputs(only_response(await execute(model.instances[0], request)))
        np.testing.assert_array_equal(got["OUTPUT0"], [[3.0]])

    with_model(context(tmp_path, "auto"), check)

    async def unchanged(model: BackendModel) -> None:
        assert model.config.max_batch_size == 0 and not model.config.input

    with_model(context(tmp_path, "auto", auto_complete=False), unchanged)


def test_auto_complete_contradicting_the_config_fails_the_load(tmp_path: Path):
    write_model(tmp_path, "contra", AUTO_COMPLETE_MODEL, config='backend: "python"\nmax_batch_size: 8\n')
    with pytest.raises(ServerError) as info:
        with_model(context(tmp_path, "contra"), lambda model: asyncio.sleep(0))
    assert info.value.message.startswith("failed to load 'contra' version 1: ValueError: ")
    assert "max_batch_size 8" in info.value.message


def test_async_execute_runs_on_the_workers_event_loop(tmp_path: Path):
    write_model(
        tmp_path,
        "asyncm",
        """
        import asyncio
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            async def initialize(self, args):
                await asyncio.sleep(0)
                self.offset = 1.0

            async def execute(self, requests):
                await asyncio.sleep(0.001)
                return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", r.inputs()[0].as_numpy() + self.offset)])
                        for r in requests]
        """,
    )

    async def check(model: BackendModel) -> None:
        got = outputs(only_response(await execute(model.instances[0], fp32_request([1.0, 2.0]))))
        np.testing.assert_array_equal(got["OUTPUT0"], [2.0, 3.0])

    with_model(context(tmp_path, "asyncm"), check)


def test_is_ready_asks_the_model_when_it_defines_it(tmp_path: Path):
    write_model(tmp_path, "ready", ECHO_MODEL + "\n    def is_ready(self):\n        return False\n")

    async def check(model: BackendModel) -> None:
        instance = model.instances[0]
        assert isinstance(instance, PythonInstance)
        assert await instance.is_ready() is False

    with_model(context(tmp_path, "ready"), check)


def test_finalize_is_called_on_close(tmp_path: Path):
    marker = tmp_path / "finalized"
    write_model(
        tmp_path,
        "fin",
        ECHO_MODEL
        + f"""
    def initialize(self, args):
        self.marker = {str(marker)!r} + "." + args["model_instance_name"]

    def finalize(self):
        open(self.marker, "w").write("done")
""",
        SIMPLE_CONFIG + "instance_group [ { count: 2 } ]\n",
    )
    with_model(context(tmp_path, "fin"), lambda model: asyncio.sleep(0))
    assert sorted(path.name for path in tmp_path.glob("finalized.*")) == ["finalized.fin_0_0", "finalized.fin_0_1"]


def test_import_error_fails_the_load_with_one_line(tmp_path: Path):
    write_model(tmp_path, "broken", "import no_such_module_for_transerve_tests\n")
    with pytest.raises(ServerError) as info:
        with_model(context(tmp_path, "broken"), lambda model: asyncio.sleep(0))
    assert info.value.code is ErrorCode.INTERNAL
    assert info.value.message == (
        "failed to load 'broken' version 1: ModuleNotFoundError: No module named 'no_such_module_for_transerve_tests'"
    )


def test_initialize_error_and_missing_class_fail_the_load(tmp_path: Path):
    failing_initialize = "\n    def initialize(self, args):\n        raise RuntimeError('nope')\n"
    write_model(tmp_path, "badinit", ECHO_MODEL + failing_initialize)
    write_model(tmp_path, "noclass", "x = 1\n")
    with pytest.raises(ServerError, match=r"^failed to load 'badinit' version 1: RuntimeError: nope$"):
        with_model(context(tmp_path, "badinit"), lambda model: asyncio.sleep(0))
    with pytest.raises(ServerError, match=r"^failed to load 'noclass' version 1: .*does not define class Triton"):
        with_model(context(tmp_path, "noclass"), lambda model: asyncio.sleep(0))


def test_model_folder_helpers_import_like_triton(tmp_path: Path):
    model_path = write_model(
        tmp_path,
        "helpers",
        """
        import helper_module
        from . import relative_helper
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                factor = helper_module.FACTOR * relative_helper.FACTOR
                return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", r.inputs()[0].as_numpy() * factor)])
                        for r in requests]
        """,
    )
    (model_path / "1" / "helper_module.py").write_text("FACTOR = 2\n")
    (model_path / "1" / "relative_helper.py").write_text("FACTOR = 5\n")

    async def check(model: BackendModel) -> None:
        got = outputs(only_response(await execute(model.instances[0], fp32_request([1.0]))))
        np.testing.assert_array_equal(got["OUTPUT0"], [10.0])

    with_model(context(tmp_path, "helpers"), check)


# --- errors while executing -------------------------------------------------------------------------

ERRORS_MODEL = """
import ctypes
import os
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = float(request.inputs()[0].as_numpy()[0])
            if value == -1:
                error = pb_utils.TritonError("negative input", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
            elif value == -2:
                raise ValueError("boom")
            elif value == -3:
                return responses
            elif value == -4:
                os._exit(3)
            elif value == -5:
                return "not a list"
            elif value == -6:
                ctypes.string_at(0)  # a segfault
            else:
                tensor = pb_utils.Tensor("OUTPUT0", np.array([value * 10], dtype=np.float32))
                responses.append(pb_utils.InferenceResponse([tensor], parameters={"seen": int(value)}))
        return responses
"""


def test_a_triton_error_fails_only_its_own_request(tmp_path: Path):
    write_model(tmp_path, "errs", ERRORS_MODEL)

    async def check(model: BackendModel) -> None:
        result = await execute(model.instances[0], fp32_request([1.0]), fp32_request([-1.0]), fp32_request([2.0]))
        first, failed, last = result.results
        assert isinstance(first, InferResponse) and isinstance(last, InferResponse)
        np.testing.assert_array_equal(outputs(last)["OUTPUT0"], [20.0])
        assert first.parameters == {"seen": 1}
        assert isinstance(failed, ServerError)
        assert (failed.code, failed.message) == (ErrorCode.INVALID_ARG, "negative input")

    with_model(context(tmp_path, "errs"), check)


def test_an_exception_or_a_bad_return_fails_the_whole_call(tmp_path: Path):
    write_model(tmp_path, "errs", ERRORS_MODEL)

    async def check(model: BackendModel) -> None:
        instance = model.instances[0]
        raised = await execute(instance, fp32_request([1.0]), fp32_request([-2.0]))
        assert all(isinstance(error, ServerError) for error in raised.results)
        error = raised.results[0]
        assert error.code is ErrorCode.INTERNAL
        assert "model 'errs'" in error.message and error.message.endswith("message: ValueError: boom")
        short = await execute(instance, fp32_request([1.0]), fp32_request([-3.0]))
        assert all(isinstance(error, ServerError) and error.code is ErrorCode.INTERNAL for error in short.results)
        assert "InferenceRequest(s) size is:2, and InferenceResponse(s) size is:1" in short.results[0].message
        not_a_list = await execute(instance, fp32_request([-5.0]))
        assert "Expected a list in the execute return" in not_a_list.results[0].message
        assert isinstance(only_response(await execute(instance, fp32_request([3.0]))), InferResponse)

    with_model(context(tmp_path, "errs"), check)


def test_a_crashed_worker_fails_its_requests_and_is_restarted(tmp_path: Path):
    write_model(tmp_path, "crashy", ERRORS_MODEL)

    async def check(model: BackendModel) -> None:
        instance = model.instances[0]
        crashed, queued_behind = await asyncio.gather(
            execute(instance, fp32_request([-4.0])), execute(instance, fp32_request([1.0]))
        )
        for result in (crashed, queued_behind):
            (error,) = result.results
            assert isinstance(error, ServerError) and error.code is ErrorCode.INTERNAL
            assert "model 'crashy'" in error.message and "instance 'crashy_0'" in error.message
            assert "process exited unexpectedly (code 3)" in error.message
        for value in (5.0, 6.0):
            np.testing.assert_array_equal(
                outputs(only_response(await execute(instance, fp32_request([value]))))["OUTPUT0"], [value * 10]
            )
        assert await instance.is_ready()
        (segfault,) = (await execute(instance, fp32_request([-6.0]))).results
        assert isinstance(segfault, ServerError) and "(code -11, signal SIGSEGV)" in segfault.message
        assert isinstance(only_response(await execute(instance, fp32_request([7.0]))), InferResponse)

    with_model(context(tmp_path, "crashy"), check)


# --- the transport ----------------------------------------------------------------------------------


def test_large_tensors_in_and_out(tmp_path: Path):
    write_model(tmp_path, "echo", ECHO_MODEL)
    big = np.random.default_rng(0).random(16 * 1024 * 1024, dtype=np.float32)  # 64 MiB

    async def check(model: BackendModel) -> None:
        got = outputs(only_response(await execute(model.instances[0], fp32_request(big))))
        np.testing.assert_array_equal(got["OUTPUT0"], big)
        medium = big[: 1024 * 1024]  # 4 MiB: fits the arena, travels as a zero-copy view
        got = outputs(only_response(await execute(model.instances[0], fp32_request(medium))))
        np.testing.assert_array_equal(got["OUTPUT0"], medium)

    with_model(context(tmp_path, "echo"), check)


def test_bf16_travels_both_ways(tmp_path: Path):
    write_model(tmp_path, "echo", ECHO_MODEL)
    bf16 = np.dtype(ml_dtypes.bfloat16)

    async def check(model: BackendModel) -> None:
        for size in (3, 100_000):  # copied, then a zero-copy view
            data = np.arange(size).astype(bf16)
            request = InferRequest("echo", [Tensor("INPUT0", "BF16", data)])
            (tensor,) = only_response(await execute(model.instances[0], request)).outputs
            assert (tensor.datatype, tensor.data.dtype) == ("BF16", bf16)
            np.testing.assert_array_equal(tensor.data, data)

    with_model(context(tmp_path, "echo"), check)


def test_a_small_arena_overflows_into_one_off_regions(tmp_path: Path):
    write_model(tmp_path, "echo", ECHO_MODEL)
    data = np.arange(100_000, dtype=np.float32)

    async def check(model: BackendModel) -> None:
        results = await asyncio.gather(*(execute(model.instances[0], fp32_request(data + i)) for i in range(8)))
        for index, result in enumerate(results):
            np.testing.assert_array_equal(outputs(only_response(result))["OUTPUT0"], data + index)

    with_model(context(tmp_path, "echo", backend_config={"shm-default-byte-size": "65536"}), check)


def test_inputs_kept_by_the_model_after_execute_stay_intact(tmp_path: Path):
    write_model(
        tmp_path,
        "keeper",
        """
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def initialize(self, args):
                self.kept = []

            def execute(self, requests):
                responses = []
                for request in requests:
                    self.kept.append(request.inputs()[0].as_numpy()[1:])  # a view of the input
                    previous = self.kept[-2] if len(self.kept) > 1 else self.kept[-1]
                    responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", previous)]))
                return responses
        """,
    )

    async def check(model: BackendModel) -> None:
        instance = model.instances[0]
        for size in (4, 300_000):  # copied on arrival, then a zero-copy view into the arena
            first = np.full(size, 1.0, np.float32)
            await execute(instance, fp32_request(first))
            for round_ in range(2, 6):
                got = outputs(only_response(await execute(instance, fp32_request(first * round_))))
                np.testing.assert_array_equal(got["OUTPUT0"], first[1:] * (round_ - 1))

    with_model(context(tmp_path, "keeper"), check)


def test_concurrent_executes_each_get_their_own_answer():
    async def check(model: BackendModel) -> None:
        async def one(index: int) -> None:
            instance = model.instances[index % len(model.instances)]
            in0 = np.full((1, 4), index, np.float32)
            in1 = np.arange(4, dtype=np.float32).reshape(1, 4)
            inputs = [Tensor("INPUT0", "FP32", in0), Tensor("INPUT1", "FP32", in1)]
            request = InferRequest("add_sub", inputs, id=str(index))
            response = only_response(await instance.execute([request]))
            assert response.id == str(index)
            np.testing.assert_array_equal(outputs(response)["OUTPUT0"], in0 + in1)

        await asyncio.gather(*(one(index) for index in range(500)))
        for instance in model.instances:
            assert instance._worker.connection.live_blocks == 0

    with_model(context(EXAMPLES, "add_sub"), check)


def test_endpoint_spills_large_messages_and_frees_every_block():
    to_worker = shm.Region.create(1 << 20, "test-a")
    to_server = shm.Region.create(1 << 20, "test-b")
    server = ipc.Endpoint(outgoing=to_worker, incoming=to_server)
    worker = ipc.Endpoint(outgoing=to_server, incoming=to_worker)
    tensors = [
        ("A", "FP32", np.arange(600, dtype=np.float32).reshape(2, 300)),  # copied through the arena
        ("B", "BYTES", np.array([b"x" * 10, b""], dtype=object)),  # tiny: in the message
        ("C", "INT64", np.arange(50_000, dtype=np.int64)),  # a zero-copy view
        ("D", "UINT8", np.zeros((0, 3), np.uint8)),
        ("E", "INT32", np.array([[1, 2]], np.int32)),
    ]
    body = {"padding": "y" * 200_000}  # over one datagram: spilled into shared memory
    data, fds = server.encode(ipc.OP_EXECUTE, 7, body, server.place([tensors, tensors[:1]]))
    assert len(data) < ipc.INLINE_LIMIT
    op, call_id, got_body, groups = worker.decode(memoryview(data), fds)
    assert (op, call_id, got_body) == (ipc.OP_EXECUTE, 7, body)
    for (name, datatype, array), (got_name, got_type, got) in zip(tensors, groups[0], strict=True):
        assert (got_name, got_type, got.shape, got.dtype) == (name, datatype, array.shape, array.dtype)
        np.testing.assert_array_equal(got, array)
        assert got.flags.writeable  # a model may change its inputs in place
    assert server.live_blocks == 3  # the copied block, C's block and the spilled message
    del groups, got
    reply, fds = worker.encode(ipc.OP_REPLY, 7, None)
    worker_live = worker.live_blocks
    server.decode(memoryview(reply), fds)
    assert server.live_blocks == 0 and worker_live == 0


def test_free_list_merges_blocks_released_in_any_order():
    free = shm.FreeList(64 * 10)
    blocks = [free.allocate(64) for _ in range(10)]
    assert blocks == [64 * i for i in range(10)] and free.allocate(1) is None
    for index in (3, 1, 2, 9, 0, 5, 4, 8, 6, 7):
        free.release(blocks[index])
    assert free.live_blocks == 0 and free.allocate(64 * 10) == 0


# --- triton_python_backend_utils --------------------------------------------------------------------


def test_tensor_rejects_str_arrays_and_takes_str_objects_as_bytes():
    with pytest.raises(pb_utils.TritonModelException, match="NumPy dtype is not supported"):
        pb_utils.Tensor("x", np.array(["a", "b"]))
    with pytest.raises(pb_utils.TritonModelException, match="Tensor name cannot be an empty string"):
        pb_utils.Tensor("", np.zeros(1))
    tensor = pb_utils.Tensor("x", np.array(["é", b"b"], dtype=object))
    assert tensor.triton_dtype() == 13 and tensor.shape() == [2] and tensor.is_cpu()
    assert pb_utils.serialize_byte_tensor(tensor.as_numpy()) == b"\x02\x00\x00\x00\xc3\xa9\x01\x00\x00\x00b"
    assert list(pb_utils.deserialize_bytes_tensor(b"\x02\x00\x00\x00\xc3\xa9\x00\x00\x00\x00")) == ["é".encode(), b""]
    assert pb_utils.Tensor("y", np.array([b"ab"])).triton_dtype() == 13


def test_tensor_dlpack_round_trips_share_memory():
    source = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = pb_utils.Tensor.from_dlpack("x", source)  # any object with __dlpack__, as torch tensors have
    assert tensor.triton_dtype() == 11 and tensor.shape() == [2, 3]
    from_capsule = pb_utils.Tensor.from_dlpack("y", tensor.to_dlpack())
    source[0, 0] = 42
    assert from_capsule.as_numpy()[0, 0] == 42
    np.testing.assert_array_equal(np.from_dlpack(tensor), source)
    with pytest.raises(pb_utils.TritonModelException, match="DLPack does not have support for string tensors"):
        pb_utils.Tensor("s", np.array([b"a"], dtype=object)).to_dlpack()


def test_errors_responses_and_requests_behave_as_in_triton():
    error = pb_utils.TritonError("bad")
    assert (error.message(), error.code()) == ("bad", pb_utils.TritonError.INTERNAL)
    assert [pb_utils.TritonError.UNKNOWN, pb_utils.TritonError.CANCELLED] == [0, 7]
    response = pb_utils.InferenceResponse(error=pb_utils.TritonError("no", pb_utils.TritonError.NOT_FOUND))
    assert response.has_error() and response.error().code() == pb_utils.TritonError.NOT_FOUND
    assert response.output_tensors() == [] and response.parameters() == "{}"
    with pytest.raises(pb_utils.TritonModelException, match="keys to have type str"):
        pb_utils.InferenceResponse(parameters={1: "x"})
    request = pb_utils.InferenceRequest(
        model_name="other", inputs=[pb_utils.Tensor("x", np.zeros(1))], requested_output_names=["y"]
    )
    with pytest.raises(pb_utils.TritonModelException, match="only inside a model served by transerve"):
        request.exec()
    with pytest.raises(pb_utils.TritonModelException, match="has no reference to the decoupled state of the model"):
        request.get_response_sender().send(pb_utils.InferenceResponse())
    assert request.parameters() == "{}" and not request.is_cancelled()
    assert pb_utils.Logger.LogLevel.WARNING is pb_utils.LogLevel.WARNING


def test_type_helpers_and_config_lookups():
    assert pb_utils.triton_string_to_numpy("TYPE_FP16") is np.float16
    assert pb_utils.triton_to_numpy_type(13) is np.object_ and pb_utils.triton_to_numpy_type(99) is None
    assert pb_utils.numpy_to_triton_type(np.uint64) == 5 and pb_utils.numpy_to_triton_type(np.bytes_) == 13
    config = {"input": [{"name": "A"}], "output": [{"name": "B"}], "model_transaction_policy": {"decoupled": True}}
    assert pb_utils.get_input_config_by_name(config, "A") == {"name": "A"}
    assert pb_utils.get_output_config_by_name(config, "A") is None
    assert pb_utils.using_decoupled_model_transaction_policy(config)
    assert pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE == 2


def test_model_config_helper_validates_like_triton():
    config = pb_utils.ModelConfig(
        json.dumps(
            {
                "name": "m",
                "max_batch_size": 0,
                "input": [{"name": "A", "data_type": "TYPE_FP32", "dims": [2]}],
                "output": [],
                "sequence_batching": {},
            }
        )
    )
    with pytest.raises(ValueError, match="expects datatype TYPE_FP32 for input 'A', model provides TYPE_INT32"):
        config.add_input({"name": "A", "data_type": "TYPE_INT32", "dims": [2]})
    with pytest.raises(ValueError, match="the model expects dims \\[3\\]"):
        config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [3]})
    with pytest.raises(ValueError, match="contains property other than"):
        config.add_output({"name": "B", "data_type": "TYPE_FP32", "dims": [1], "optional": True})
    with pytest.raises(ValueError, match="missing 'dims' property"):
        config.add_output({"name": "B", "data_type": "TYPE_FP32"})
    with pytest.raises(ValueError, match="tries to set scheduling_choice as 'dynamic_batching'"):
        config.set_dynamic_batching()
    config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [2], "optional": True})
    config.set_model_transaction_policy({"decoupled": True})
    with pytest.raises(ValueError, match="trying to change decoupled property"):
        config.set_model_transaction_policy({"decoupled": False})
    assert config.as_dict()["input"] == [{"name": "A", "data_type": "TYPE_FP32", "dims": [2], "optional": True}]


def test_logger_writes_to_stderr(capfd: pytest.CaptureFixture[str]):
    pb_utils.Logger.log_warn("careful")
    pb_utils.Logger.log("plain")
    pb_utils.Logger.log_verbose("hidden unless verbose")
    err = capfd.readouterr().err
    assert "careful" in err and "plain" in err and "hidden" not in err
    assert err.splitlines()[0].startswith("W") and f" {os.getpid()} test_python_backend.py:" in err


def test_backend_config_values_are_checked_and_applied(tmp_path: Path):
    write_model(tmp_path, "echo", ECHO_MODEL)
    with pytest.raises(ServerError, match="backend config shm-default-byte-size must be an integer >= 4096, got 'x'"):
        with_model(context(tmp_path, "echo", backend_config={"shm-default-byte-size": "x"}), lambda m: asyncio.sleep(0))

    async def check(model: BackendModel) -> None:
        assert model.instances[0].max_inflight == 7

    with_model(context(tmp_path, "echo", backend_config={"max-inflight": "7"}), check)
