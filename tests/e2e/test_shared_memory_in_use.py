"""Shared memory regions an inference is using, against the real Triton 2.51, over HTTP and gRPC: unregistering
one fails at once with Triton's words and it stays registered until the inference is done (Triton's
TestSharedMemoryUnregister); an offset past a region has Triton's "Invalid offset" text. transerve answers the
refusal with 400 / INVALID_ARGUMENT where Triton answers 500 / INTERNAL: the client's mistake, not the server's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as client_shm
from support import ServerProcess, start_transerve
from support.triton_reference import require_triton, start_triton
from tritonclient.utils import InferenceServerException

SLOW_MODEL = '''
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(3)
        return [pb_utils.InferenceResponse([
            pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() + 1)])
            for r in requests]
'''

SLOW_CONFIG = '''name: "slow"
backend: "python"
max_batch_size: 0
input [{ name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }]
output [{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }]
'''

BYTES = 64


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("slow") / "models"
    (root / "slow" / "1").mkdir(parents=True)
    (root / "slow" / "1" / "model.py").write_text(SLOW_MODEL)
    (root / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)
    return root


@pytest.fixture(scope="module", params=["triton", "transerve"])
def server(request: pytest.FixtureRequest, repository: Path) -> Iterator[tuple[str, ServerProcess]]:
    if request.param == "triton":
        with start_triton(repository, install=require_triton()) as triton:
            yield "triton", triton
    else:
        with start_transerve(repository) as transerve:
            yield "transerve", transerve


def client(protocol: str, server: ServerProcess) -> Any:
    if protocol == "http":
        return httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=30)
    return grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")


class Regions:
    """An input and an output region of 64 bytes each, registered under names of their own."""

    def __init__(self, triton: Any) -> None:
        self.triton = triton
        tag = uuid.uuid4().hex[:8]
        self.input, self.output = f"in_{tag}", f"out_{tag}"
        self.handles = []
        for name in (self.input, self.output):
            handle = client_shm.create_shared_memory_region(name, f"/{name}", BYTES)
            self.handles.append(handle)
            triton.register_system_shared_memory(name, f"/{name}", BYTES)
        client_shm.set_shared_memory_region(self.handles[0], [np.arange(16, dtype=np.int32)])

    def close(self) -> None:
        for name in (self.input, self.output):
            deadline = time.monotonic() + 10  # an inference still using it (a failed test) ends within seconds
            while True:
                try:
                    self.triton.unregister_system_shared_memory(name)
                    break
                except InferenceServerException:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        for handle in self.handles:
            client_shm.destroy_shared_memory_region(handle)

    def _tensors(self, module: Any, output_offset: int) -> dict[str, Any]:
        given = module.InferInput("INPUT0", [16], "INT32")
        given.set_shared_memory(self.input, BYTES)
        wanted = module.InferRequestedOutput("OUTPUT0")
        wanted.set_shared_memory(self.output, BYTES, offset=output_offset)
        return {"inputs": [given], "outputs": [wanted]}

    def infer(self, module: Any, output_offset: int = 0) -> Callable[[], Any]:
        return lambda: self.triton.infer("slow", **self._tensors(module, output_offset))

    def start(self, module: Any) -> Callable[[], Any]:
        """Start an inference the client's own way of not waiting; the result is what the returned call gives."""
        if module is httpclient:
            return self.triton.async_infer("slow", **self._tensors(module, 0)).get_result
        done: list[Any] = []
        self.triton.async_infer("slow", callback=lambda result, error: done.append(error or result),
                                **self._tensors(module, 0))

        def result() -> Any:
            deadline = time.monotonic() + 30
            while not done and time.monotonic() < deadline:
                time.sleep(0.05)
            return done[0] if done else None

        return result

    def names(self) -> list[str]:
        status = self.triton.get_system_shared_memory_status()
        if isinstance(status, list):
            return sorted(region["name"] for region in status)
        return sorted(status.regions)


def refusal(call: Callable[[], Any], server: str = "") -> str:
    """The message of the error `call` raises; with `server`, its status is checked to be that server's for a
    region in use."""
    with pytest.raises(InferenceServerException) as raised:
        call()
    if server:
        expected = {"triton": ("500", "StatusCode.INTERNAL"), "transerve": ("400", "StatusCode.INVALID_ARGUMENT")}
        assert str(raised.value.status()) in expected[server]
    return raised.value.message()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_region_in_use_cannot_be_unregistered(server: tuple[str, ServerProcess], protocol: str) -> None:
    name, process = server
    module = httpclient if protocol == "http" else grpcclient
    regions = Regions(client(protocol, process))
    try:
        result = regions.start(module)
        time.sleep(1)
        other = client(protocol, process)
        started = time.monotonic()
        everything = refusal(other.unregister_system_shared_memory, name)
        one = refusal(lambda: other.unregister_system_shared_memory(regions.output), name)
        assert time.monotonic() - started < 1.5  # refused at once, not after the inference
        listed = sorted([regions.input, regions.output])
        assert everything == ("Failed to unregister the following system shared memory regions: "
                              + "".join(f"{region} ," for region in listed))
        assert one == f"Cannot unregister shared memory region '{regions.output}', it is currently in use."
        assert regions.names() == listed
        answer = result()
        assert answer is not None and not isinstance(answer, Exception)
        time.sleep(0.5)  # the server settles the request just after sending its answer
        written = client_shm.get_contents_as_numpy(regions.handles[1], np.int32, [16])
        np.testing.assert_array_equal(written, np.arange(16, dtype=np.int32) + 1)
        other.unregister_system_shared_memory()
        assert regions.names() == []
    finally:
        regions.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_output_offset_past_its_region(server: tuple[str, ServerProcess], protocol: str) -> None:
    _, process = server
    module = httpclient if protocol == "http" else grpcclient
    regions = Regions(client(protocol, process))
    try:
        message = refusal(regions.infer(module, output_offset=BYTES))
        assert message == f"Invalid offset for shared memory region: '{regions.output}'"
    finally:
        regions.close()
