"""Hostile shared memory clients against a real transerve (issue 35, part 1): an object truncated after its region
was registered is refused with a 400 naming the region (the server used to die of SIGBUS), over HTTP and gRPC, for
inputs and outputs, while a bystander's requests go on; the region caps refuse registrations past them with a 400
naming the cap; descriptors are held once per object, however many regions are registered on it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from support import EXAMPLE_REPOSITORY, ServerProcess, start_transerve
from tritonclient.utils import InferenceServerException

TIMEOUT_S = 30.0
BYTES = 64
MAX_REGIONS = 8
MAX_PER_OBJECT = 4
HTTP = requests.Session()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with start_transerve(EXAMPLE_REPOSITORY, f"--max-shared-memory-regions={MAX_REGIONS}",
                         f"--max-shared-memory-regions-per-object={MAX_PER_OBJECT}") as process:
        yield process


class ShmObject:
    """A POSIX shared memory object of BYTES bytes holding float32 1..16, made as clients make them."""

    def __init__(self) -> None:
        self.key = f"/transerve_hostile_{uuid.uuid4().hex[:12]}"
        self.path = Path("/dev/shm") / self.key.lstrip("/")
        self.path.write_bytes(np.arange(1, 17, dtype=np.float32).tobytes())

    def truncate(self, size: int) -> None:
        with open(self.path, "r+b") as file:
            os.ftruncate(file.fileno(), size)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


@pytest.fixture
def shm() -> Iterator[ShmObject]:
    made = ShmObject()
    yield made
    made.remove()


def register(server: ServerProcess, name: str, key: str, byte_size: int = BYTES) -> requests.Response:
    return HTTP.post(f"{server.base_url}/v2/systemsharedmemory/region/{name}/register",
                         json={"key": key, "offset": 0, "byte_size": byte_size}, timeout=TIMEOUT_S)


def unregister_all(server: ServerProcess) -> None:
    assert HTTP.post(f"{server.base_url}/v2/systemsharedmemory/unregister", timeout=TIMEOUT_S).status_code == 200


def infer(server: ServerProcess, input_region: str | None = None,
          output_region: str | None = None) -> requests.Response:
    first: dict = {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32"}
    if input_region is None:
        first["data"] = [1, 2, 3, 4]
    else:
        first["parameters"] = {"shared_memory_region": input_region, "shared_memory_byte_size": 16}
    body: dict = {"inputs": [first, {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]}]}
    if output_region is not None:
        body["outputs"] = [{"name": "OUTPUT0", "parameters": {"shared_memory_region": output_region,
                                                              "shared_memory_byte_size": 16}}]
    return HTTP.post(f"{server.base_url}/v2/models/add_sub/infer", json=body, timeout=TIMEOUT_S)


def bystander_ok(server: ServerProcess) -> None:
    answer = infer(server)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [2, 3, 4, 5]


def shm_descriptors(server: ServerProcess) -> int:
    """The server's open descriptors of this test's shared memory objects."""
    folder = f"/proc/{server.process.pid}/fd"
    targets = []
    for entry in os.listdir(folder):
        try:
            targets.append(os.readlink(f"{folder}/{entry}"))
        except OSError:  # closed meanwhile
            continue
    return sum(1 for target in targets if target.startswith("/dev/shm/transerve_hostile_"))


def test_a_truncated_object_is_refused_and_the_server_lives(server: ServerProcess, shm: ShmObject) -> None:
    region = f"r_{uuid.uuid4().hex[:8]}"
    assert register(server, region, shm.key).status_code == 200
    try:
        assert infer(server, input_region=region).json()["outputs"][0]["data"] == [2, 3, 4, 5]
        shm.truncate(0)
        expected = f"shared memory region '{region}' is no longer usable: its object '{shm.key}' is now 0 bytes"
        for answer in (infer(server, input_region=region), infer(server, output_region=region)):
            assert answer.status_code == 400
            assert answer.json()["error"].startswith(expected), answer.text
        client = grpcclient.InferenceServerClient(server.grpc_url)
        given = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        given.set_shared_memory(region, 16)
        other = grpcclient.InferInput("INPUT1", [1, 4], "FP32")
        other.set_data_from_numpy(np.ones((1, 4), np.float32))
        with pytest.raises(InferenceServerException) as refused:
            client.infer("add_sub", [given, other], client_timeout=TIMEOUT_S)
        client.close()
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert expected in refused.value.message()
        assert server.alive()
        bystander_ok(server)
        shm.truncate(BYTES // 2)  # half of it: still smaller than registered
        assert infer(server, input_region=region).status_code == 400
        shm.truncate(BYTES)  # its size again (zeros): usable again
        answer = infer(server, input_region=region, output_region=region)
        assert answer.status_code == 200, answer.text
        assert np.frombuffer(shm.path.read_bytes()[:16], np.float32).tolist() == [1.0, 1.0, 1.0, 1.0]
    finally:
        unregister_all(server)


def test_region_caps_and_one_descriptor_per_object(server: ServerProcess) -> None:
    objects = [ShmObject() for _ in range(3)]
    try:
        assert shm_descriptors(server) == 0
        for index in range(MAX_PER_OBJECT):
            assert register(server, f"same_{index}", objects[0].key).status_code == 200
        assert shm_descriptors(server) == 1
        past_object = register(server, "same_past", objects[0].key)
        assert past_object.status_code == 400
        assert past_object.json()["error"] == (
            f"failed to register shared memory region 'same_past': '{objects[0].key}' has {MAX_PER_OBJECT} regions "
            "registered, the limit per object (--max-shared-memory-regions-per-object)")
        for index in range(MAX_REGIONS - MAX_PER_OBJECT):
            assert register(server, f"other_{index}", objects[1 + index % 2].key).status_code == 200
        past_server = register(server, "past", objects[2].key)
        assert past_server.status_code == 400
        assert past_server.json()["error"] == (
            f"failed to register shared memory region 'past': the server has {MAX_REGIONS} regions registered, its "
            "limit (--max-shared-memory-regions)")
        assert shm_descriptors(server) == 3
        bystander_ok(server)
        unregister_all(server)
        assert shm_descriptors(server) == 0
        assert register(server, "again", objects[0].key).status_code == 200
        unregister_all(server)
        assert server.alive()
    finally:
        for made in objects:
            made.remove()
