"""The system shared memory registry (server.shared_memory) on real POSIX shared memory objects, made as clients make
them (tritonclient.utils.shared_memory): registration, reads, output writes, and what it refuses."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.utils.shared_memory as client_shm

from transerve.core.errors import ErrorCode, ServerError
from transerve.core.types import InferRequest, InferResponse, RequestedOutput, Tensor
from transerve.server.shared_memory import BYTE_SIZE, REGION, SHM_DIR, SharedMemoryRegistry, placement


@pytest.fixture
def key() -> Iterator[str]:
    """A 64-byte shared memory object holding float32 0..15, removed afterwards."""
    name = f"/transerve_test_{uuid.uuid4().hex}"
    handle = client_shm.create_shared_memory_region("test", name, 64)
    client_shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.float32)])
    yield name
    client_shm.destroy_shared_memory_region(handle)


def error(call, *args) -> ServerError:
    with pytest.raises(ServerError) as raised:
        call(*args)
    return raised.value


def test_register_read_and_status(key: str) -> None:
    registry = SharedMemoryRegistry()
    registry.register("whole", key, 0, 64)
    registry.register("tail", key, 16, 48)  # no page alignment needed
    assert np.frombuffer(registry.read("whole", 4, 8), np.float32).tolist() == [1.0, 2.0]
    assert np.frombuffer(registry.read("tail", 0, 8), np.float32).tolist() == [4.0, 5.0]
    assert registry.status() == [
        {"name": "whole", "key": key, "offset": 0, "byte_size": 64},
        {"name": "tail", "key": key, "offset": 16, "byte_size": 48},
    ]
    assert registry.status("tail") == [{"name": "tail", "key": key, "offset": 16, "byte_size": 48}]
    duplicate = error(registry.register, "whole", key, 0, 8)
    assert duplicate.code is ErrorCode.ALREADY_EXISTS
    assert duplicate.message == "shared memory region 'whole' already in manager"
    out_of_range = error(registry.read, "tail", 40, 16)
    assert out_of_range.message == "Invalid offset + byte size for shared memory region: 'tail'"
    registry.unregister("whole")
    registry.unregister("whole")  # unknown: no error
    assert error(registry.read, "whole", 0, 4).code is ErrorCode.NOT_FOUND
    assert error(registry.status, "whole").message == "Unable to find system shared memory region: 'whole'"
    registry.unregister()
    assert registry.status() == []


@pytest.mark.parametrize(("bad_key", "fragment"), [
    ("/transerve_test_missing", "No such file or directory"),
    ("/../etc/passwd", "not a shared memory object name"),
    ("/a/b", "not a shared memory object name"),
    ("/..", "not a shared memory object name"),
])
def test_keys_that_name_no_shared_memory_object_are_refused(bad_key: str, fragment: str) -> None:
    refused = error(SharedMemoryRegistry().register, "r", bad_key, 0, 8)
    assert refused.code is ErrorCode.INVALID_ARG
    assert refused.message.startswith(f"Unable to open shared memory region: '{bad_key}'") and fragment in (
        refused.message)


def test_a_symbolic_link_in_dev_shm_is_not_followed(tmp_path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"not for clients")
    link = SHM_DIR / f"transerve_test_{uuid.uuid4().hex}"
    os.symlink(secret, link)
    try:
        refused = error(SharedMemoryRegistry().register, "r", "/" + link.name, 0, 4)
        assert refused.code is ErrorCode.INVALID_ARG
    finally:
        link.unlink()


def test_a_region_larger_than_its_object_is_refused(key: str) -> None:
    refused = error(SharedMemoryRegistry().register, "r", key, 8, 64)
    assert refused.code is ErrorCode.INVALID_ARG
    assert refused.message.startswith("failed to register shared memory region 'r': invalid args")


def test_outputs_are_written_where_the_request_places_them(key: str) -> None:
    registry = SharedMemoryRegistry()
    registry.register("r", key, 0, 64)
    request = InferRequest("m", [], outputs=[
        RequestedOutput("A", {"shared_memory_region": "r", "shared_memory_byte_size": 8, "shared_memory_offset": 32}),
        RequestedOutput("B", {}),
        RequestedOutput("S", {"shared_memory_region": "r", "shared_memory_byte_size": 16}),
    ])
    strings = np.array([b"hi", b""], dtype=np.object_)
    response = InferResponse("m", "1", [Tensor("A", "FP32", np.array([7.5, -1.0], np.float32)),
                                        Tensor("B", "FP32", np.zeros(1, np.float32)),
                                        Tensor("S", "BYTES", strings)])
    registry.write_outputs(request, response)
    assert [t.in_shared_memory for t in response.outputs] == [True, False, True]
    assert np.frombuffer(registry.read("r", 32, 8), np.float32).tolist() == [7.5, -1.0]
    assert registry.read("r", 0, 10) == b"\x02\x00\x00\x00hi\x00\x00\x00\x00"  # BYTES as on the wire

    small = InferRequest("m", [], outputs=[RequestedOutput("A", {"shared_memory_region": "r",
                                                                 "shared_memory_byte_size": 4})])
    refused = error(registry.write_outputs, small, InferResponse("m", "1", [Tensor("A", "FP32", np.ones(2,
                                                                                                    np.float32))]))
    assert refused.message == ("shared memory size specified with the request for output 'A' (4 bytes) should be "
                               "at least 8 bytes to hold the results")


@pytest.mark.parametrize(("parameters", "expected"), [
    ({}, None),
    ({"shared_memory_region": "r"}, ("r", 0, 0)),
    ({"shared_memory_region": "r", "shared_memory_offset": 4, "shared_memory_byte_size": 8}, ("r", 4, 8)),
    ({"shared_memory_region": 3}, "'shared_memory_region' must be a string"),
    ({"shared_memory_region": "r", "shared_memory_byte_size": -1}, "'shared_memory_byte_size' must be"),
    ({"shared_memory_region": "r", "shared_memory_offset": True}, "'shared_memory_offset' must be"),
])
def test_placement_parameters(parameters: dict, expected: object) -> None:
    if isinstance(expected, str):
        refused = error(placement, "X", parameters, "input")
        assert refused.code is ErrorCode.INVALID_ARG and expected in refused.message
    else:
        assert placement("X", parameters, "input") == expected


def test_a_region_an_input_still_reads_stays_registered(key: str) -> None:
    """Inputs are read-only copies of the region (never a mapping of it, which a truncation would turn into
    SIGBUS); while one is alive the region is in use, as in Triton: unregistering it fails at once with Triton's
    words and it stays registered, until the copy is gone."""
    registry = SharedMemoryRegistry()
    registry.register("r", key, 0, 64)
    view = np.frombuffer(registry.read("r", 8, 8), np.float32)
    assert not view.flags.writeable
    with pytest.raises(ServerError) as refused:
        registry.unregister("r")
    assert refused.value.code is ErrorCode.INVALID_ARG
    assert refused.value.message == "Cannot unregister shared memory region 'r', it is currently in use."
    with pytest.raises(ServerError) as refused_all:
        registry.unregister()
    assert refused_all.value.message == "Failed to unregister the following system shared memory regions: r ,"
    assert view.tolist() == [2.0, 3.0]
    assert [region["name"] for region in registry.status()] == ["r"]
    del view
    registry.unregister("r")
    assert registry.status() == []


def test_a_region_an_output_will_be_written_to_stays_registered(key: str) -> None:
    """An output region is in use from the request's start (pinned) until it settles; unregistering every region
    forgets those not in use and names the others, sorted, as Triton does."""
    registry = SharedMemoryRegistry()
    for name in ("out", "b", "a"):
        registry.register(name, key, 0, 64)
    request = InferRequest("m", [], outputs=[RequestedOutput("Y", {REGION: "out", BYTE_SIZE: 8}),
                                             RequestedOutput("Z", {REGION: "a", BYTE_SIZE: 8})])
    pinned = registry.pin_outputs(request)
    assert pinned is not None and [region.name for region in pinned] == ["out", "a"]
    with pytest.raises(ServerError) as refused:
        registry.unregister()
    assert refused.value.message == "Failed to unregister the following system shared memory regions: a ,out ,"
    assert sorted(region["name"] for region in registry.status()) == ["a", "out"]
    registry.unpin(pinned)
    registry.unregister()
    assert registry.status() == []


def test_an_offset_past_the_region_has_tritons_words(key: str) -> None:
    registry = SharedMemoryRegistry()
    registry.register("r", key, 0, 64)
    with pytest.raises(ServerError) as past:
        registry.read("r", 64, 4)
    assert past.value.message == "Invalid offset for shared memory region: 'r'"
    with pytest.raises(ServerError) as over:
        registry.read("r", 60, 8)
    assert over.value.message == "Invalid offset + byte size for shared memory region: 'r'"
