"""Triton's system shared memory extension end to end, against the real Triton 2.51: tritonclient's shared memory
utilities make the regions, both servers read inputs from and write outputs into them, over HTTP and gRPC.

The servers are the session's (examples/model_repository), so every test registers regions under names of its
own and unregisters them. Deliberate divergences from Triton 2.51, tested against transerve alone: a key that does
not open (over HTTP; gRPC keeps Triton's INTERNAL), a region larger than its object and an output region too small are
400s (Triton: 500), and an offset needs no page alignment (Triton refuses one that has none). CUDA shared memory fails
to register as on a Triton without a GPU.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as client_shm
from support import ServerProcess
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

TIMEOUT_S = 30.0
A = np.arange(1, 5, dtype=np.float32).reshape(1, 4)
B = np.full((1, 4), 0.5, np.float32)


@pytest.fixture(scope="module")
def servers(triton_server: ServerProcess, transerve_server: ServerProcess) -> dict[str, ServerProcess]:
    """Both servers by name; Triton's fixture runs first so that a machine without Triton skips first."""
    return {"triton": triton_server, "transerve": transerve_server}


@contextmanager
def region(byte_size: int, contents: list[np.ndarray] | None = None) -> Iterator[tuple[str, Any]]:
    """A shared memory object of `byte_size` bytes (its key and tritonclient's handle), removed afterwards."""
    key = f"/transerve_e2e_{uuid.uuid4().hex}"
    handle = client_shm.create_shared_memory_region(key[1:], key, byte_size)
    try:
        if contents:
            client_shm.set_shared_memory_region(handle, contents)
        yield key, handle
    finally:
        client_shm.destroy_shared_memory_region(handle)


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def test_add_sub_through_shared_memory_over_http(servers: dict[str, ServerProcess]) -> None:
    answers = {}
    for name, server in servers.items():
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=TIMEOUT_S)
        inputs_name, outputs_name = unique("in"), unique("out")
        with region(32, [A, B]) as (in_key, _), region(32) as (out_key, out_handle):
            client.register_system_shared_memory(inputs_name, in_key, 32)
            client.register_system_shared_memory(outputs_name, out_key, 32)
            try:
                status = client.get_system_shared_memory_status(inputs_name)
                given = [httpclient.InferInput(n, [1, 4], "FP32") for n in ("INPUT0", "INPUT1")]
                given[0].set_shared_memory(inputs_name, 16)
                given[1].set_shared_memory(inputs_name, 16, offset=16)
                wanted = [httpclient.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
                wanted[0].set_shared_memory(outputs_name, 16)
                wanted[1].set_shared_memory(outputs_name, 16, offset=16)
                result = client.infer("add_sub", given, outputs=wanted)
                written = client_shm.get_contents_as_numpy(out_handle, np.float32, [2, 4])
                answers[name] = (result.get_response(), written.tolist(), status)
            finally:
                client.unregister_system_shared_memory(inputs_name)
                client.unregister_system_shared_memory(outputs_name)
        assert client.get_system_shared_memory_status() == []
    response, written, status = answers["transerve"]
    assert written == [(A + B)[0].tolist(), (A - B)[0].tolist()]
    assert [output.get("data") for output in response["outputs"]] == [None, None]
    assert status[0]["byte_size"] == 32 and status[0]["offset"] == 0
    for answer in answers.values():
        answer[2][0].pop("name"), answer[2][0].pop("key")  # names and keys are per server
        answer[0].pop("id", None)
    assert answers["transerve"] == answers["triton"]


def test_strings_and_mixed_placement_over_grpc(servers: dict[str, ServerProcess]) -> None:
    """BYTES through shared memory both ways (as serialized on the wire), beside an output sent in the response."""
    text = np.array(["héllo", "", "shared"], dtype=np.object_)
    serialized = serialize_byte_tensor(text)  # a 0-d object array holding the wire bytes, as tritonclient wants
    size = len(serialized.item())
    answers = {}
    for name, server in servers.items():
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        inputs_name, outputs_name = unique("text"), unique("upper")
        with region(size) as (in_key, in_handle), region(64) as (out_key, out_handle):
            client_shm.set_shared_memory_region(in_handle, [serialized])
            client.register_system_shared_memory(inputs_name, in_key, size)
            client.register_system_shared_memory(outputs_name, out_key, 64)
            try:
                given = grpcclient.InferInput("TEXT", [3], "BYTES")
                given.set_shared_memory(inputs_name, size)
                upper = grpcclient.InferRequestedOutput("UPPER")
                upper.set_shared_memory(outputs_name, 64)
                result = client.infer("strings", [given], outputs=[upper, grpcclient.InferRequestedOutput("LENGTH")],
                                      client_timeout=TIMEOUT_S)
                response = result.get_response()
                written = client_shm.get_contents_as_numpy(out_handle, np.object_, [3])
                status = client.get_system_shared_memory_status(as_json=True)
                answers[name] = (list(response.outputs), result.as_numpy("LENGTH").tolist(), written.tolist(),
                                 sorted(region["byte_size"] for region in status["regions"].values()))
            finally:
                client.unregister_system_shared_memory()
                client.close()
    assert answers["transerve"] == answers["triton"]
    assert answers["transerve"][1:3] == ([5, 0, 6], ["HÉLLO".encode(), b"", b"SHARED"])


def test_a_region_is_read_at_each_request(servers: dict[str, ServerProcess]) -> None:
    """Inputs come from the region as it is when the request arrives, not as it was when it was registered."""
    server = servers["transerve"]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=TIMEOUT_S)
    name = unique("changing")
    with region(32, [A, B]) as (key, handle):
        client.register_system_shared_memory(name, key, 32)
        try:
            given = [httpclient.InferInput(n, [1, 4], "FP32") for n in ("INPUT0", "INPUT1")]
            given[0].set_shared_memory(name, 16)
            given[1].set_shared_memory(name, 16, offset=16)
            first = client.infer("add_sub", given).as_numpy("OUTPUT0")
            client_shm.set_shared_memory_region(handle, [A * 10])
            second = client.infer("add_sub", given).as_numpy("OUTPUT0")
        finally:
            client.unregister_system_shared_memory(name)
    np.testing.assert_array_equal(first, A + B)
    np.testing.assert_array_equal(second, A * 10 + B)


def post(server: ServerProcess, path: str, body: Any = None) -> tuple[int, str]:
    answer = requests.post(f"http://127.0.0.1:{server.http_port}{path}", json=body, timeout=TIMEOUT_S)
    return answer.status_code, answer.text


def shm_input(name: str, region_name: str, byte_size: int = 16, offset: int = 0, **extra: Any) -> dict[str, Any]:
    parameters = {"shared_memory_region": region_name, "shared_memory_byte_size": byte_size,
                  "shared_memory_offset": offset}
    return {"name": name, "shape": [1, 4], "datatype": "FP32", "parameters": parameters, **extra}


@pytest.mark.parametrize("case", ["duplicate", "unknown_region", "past_the_end", "unknown_status",
                                  "shared_and_binary_output", "data_and_region"])
def test_mistakes_match_triton(servers: dict[str, ServerProcess], case: str) -> None:
    answers = {}
    for name, server in servers.items():
        region_name = unique("mistake")
        with region(32, [A, B]) as (key, _):
            assert post(server, f"/v2/systemsharedmemory/region/{region_name}/register",
                        {"key": key, "offset": 0, "byte_size": 32})[0] == 200
            try:
                infer_inputs = [shm_input("INPUT0", region_name), shm_input("INPUT1", region_name, offset=16)]
                if case == "duplicate":
                    answer = post(server, f"/v2/systemsharedmemory/region/{region_name}/register",
                                  {"key": key, "offset": 0, "byte_size": 32})
                elif case == "unknown_status":
                    answer = requests.get(f"http://127.0.0.1:{server.http_port}/v2/systemsharedmemory/region/"
                                          "never_registered/status", timeout=TIMEOUT_S)
                    answer = (answer.status_code, answer.text)
                else:
                    outputs = None
                    if case == "unknown_region":
                        infer_inputs[0]["parameters"]["shared_memory_region"] = "never_registered"
                    elif case == "past_the_end":
                        infer_inputs[1]["parameters"]["shared_memory_offset"] = 24
                    elif case == "shared_and_binary_output":
                        outputs = [{"name": "OUTPUT0", "parameters": {"shared_memory_region": region_name,
                                                                      "shared_memory_byte_size": 16,
                                                                      "binary_data": True}}]
                    else:
                        infer_inputs[0]["data"] = [1, 2, 3, 4]
                    body = {"inputs": infer_inputs, **({"outputs": outputs} if outputs else {})}
                    answer = post(server, "/v2/models/add_sub/infer", body)
            finally:
                post(server, f"/v2/systemsharedmemory/region/{region_name}/unregister")
        answers[name] = (answer[0], answer[1].replace(region_name, "<region>"))
    assert answers["transerve"][0] == answers["triton"][0] != 200
    triton_message = answers["triton"][1]
    if case == "data_and_region":  # the same rule; Triton's message ends "But set ...", ours names the input
        triton_message = triton_message.split(". But set")[0]
    assert triton_message.rstrip('"}') in answers["transerve"][1]


def test_client_mistakes_are_400s_and_offsets_need_no_alignment(transerve_server: ServerProcess) -> None:
    region_name = unique("divergent")
    with region(32, [A, B]) as (key, _):
        missing = post(transerve_server, f"/v2/systemsharedmemory/region/{region_name}/register",
                       {"key": key + "_missing", "offset": 0, "byte_size": 8})
        assert missing[0] == 400 and "Unable to open shared memory region" in missing[1]
        too_large = post(transerve_server, f"/v2/systemsharedmemory/region/{region_name}/register",
                         {"key": key, "offset": 0, "byte_size": 64})
        assert too_large[0] == 400
        assert f"failed to register shared memory region '{region_name}': invalid args" in too_large[1]
        assert post(transerve_server, f"/v2/systemsharedmemory/region/{region_name}/register",
                    {"key": key, "offset": 16, "byte_size": 16})[0] == 200
        try:
            body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": A.tolist()},
                               shm_input("INPUT1", region_name)],  # the region starts at B
                    "outputs": [{"name": "OUTPUT0", "parameters": {"shared_memory_region": region_name,
                                                                   "shared_memory_byte_size": 8}}]}
            too_small = post(transerve_server, "/v2/models/add_sub/infer", body)
            assert too_small[0] == 400 and "should be at least 16 bytes to hold the results" in too_small[1]
            body["outputs"] = [{"name": "OUTPUT1"}]
            status, text = post(transerve_server, "/v2/models/add_sub/infer", body)
            assert status == 200 and requests.models.complexjson.loads(text)["outputs"][0]["data"] == (
                (A - B)[0].tolist())
        finally:
            post(transerve_server, f"/v2/systemsharedmemory/region/{region_name}/unregister")


HANDLE = base64.b64encode(bytes(64)).decode()


@pytest.mark.parametrize("body", [
    {"raw_handle": {"b64": HANDLE}, "device_id": 0, "byte_size": 8},  # well formed: no GPU opens it
    {"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 8},  # not a handle's 64 bytes
    {"raw_handle": {"b64": "!!"}, "device_id": 0, "byte_size": 8},  # not base64
    {"device_id": 0, "byte_size": 8},
])
def test_cuda_registration_fails_as_on_a_triton_without_gpu_over_http(
    servers: dict[str, ServerProcess], body: dict[str, Any]
) -> None:
    answers = {name: post(server, "/v2/cudasharedmemory/region/gpu/register", body)
               for name, server in servers.items()}
    assert answers["transerve"][0] == answers["triton"][0] == 400
    assert answers["triton"][1].rstrip('"}') in answers["transerve"][1]
    for name, server in servers.items():
        assert requests.get(f"http://127.0.0.1:{server.http_port}/v2/cudasharedmemory/status",
                            timeout=TIMEOUT_S).json() == [], name


def grpc_error(call: Any) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as raised:
        call()
    return str(raised.value.status()), raised.value.message()


def aio_grpc_error(url: str, method: str, *args: Any) -> tuple[str, str]:
    async def call() -> None:
        client = grpcaio.InferenceServerClient(url)
        try:
            await getattr(client, method)(*args)
        finally:
            await client.close()

    return grpc_error(lambda: asyncio.run(call()))


@pytest.mark.parametrize("method, args", [
    ("register_cuda_shared_memory", ("", b"", 0, 0)),
    ("register_cuda_shared_memory", ("gpu", bytes(64), 0, 8)),
    ("register_system_shared_memory", ("", "", 0)),  # tritonclient's aio test: INTERNAL, "Unable to open ..."
    ("register_system_shared_memory", ("cpu", "/transerve_e2e_never_created", 8)),
])
def test_registration_errors_match_triton_over_grpc_sync_and_aio(
    servers: dict[str, ServerProcess], method: str, args: tuple[Any, ...]
) -> None:
    answers = {}
    for name, server in servers.items():
        url = f"127.0.0.1:{server.grpc_port}"
        client = grpcclient.InferenceServerClient(url)
        answers[name] = grpc_error(lambda: getattr(client, method)(*args))  # noqa: B023 (called at once)
        assert aio_grpc_error(url, method, *args) == answers[name]
    assert answers["transerve"][0] == answers["triton"][0]
    assert answers["transerve"][1].startswith(answers["triton"][1])


def test_system_registration_errors_are_400s_over_http(servers: dict[str, ServerProcess]) -> None:
    """Triton answers a key that does not open with a 500; here it is the client's mistake, worded as Triton words
    it. A region without a name is no route, in both."""
    answers = {name: post(server, "/v2/systemsharedmemory/region/cpu/register", {"key": "", "byte_size": 8})
               for name, server in servers.items()}
    assert answers["triton"][0] == 500 and answers["transerve"][0] == 400
    assert answers["triton"][1].rstrip('"}') in answers["transerve"][1]
    for name, server in servers.items():
        assert post(server, "/v2/systemsharedmemory/region//register", {"key": "k", "byte_size": 8})[0] == 404, name
        assert post(server, "/v2/cudasharedmemory/region//register", {})[0] == 404, name
