"""Every call of tritonclient's HTTP clients, the asyncio one (`tritonclient.http.aio`) and the sync one, made to
transerve and to the real Triton 2.51: each must succeed or fail on both, with the same answer where the answer
is the servers' to agree on.

The aio client reads bodies as they come (`auto_decompress=False`) while aiohttp asks for gzip and deflate, so a
server that compressed anything but inference answers broke every call here; Triton compresses only those.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
import tritonclient.utils.shared_memory as shm
from support import ServerProcess
from tritonclient.utils import InferenceServerException

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def servers(triton_server: ServerProcess, transerve_server: ServerProcess) -> dict[str, ServerProcess]:
    return {"triton": triton_server, "transerve": transerve_server}


@pytest.fixture(scope="module")
def region() -> Iterator[tuple[str, int]]:
    """A system shared memory region both servers can register: its key and size."""
    key, size = f"/transerve-clients-{uuid.uuid4().hex[:8]}", 64
    handle = shm.create_shared_memory_region("clients", key, size)
    try:
        yield key, size
    finally:
        shm.destroy_shared_memory_region(handle)


def add_sub_inputs(module: Any, binary: bool = True) -> list[Any]:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = module.InferInput(name, [2, 4], "FP32")
        tensor.set_data_from_numpy(np.arange(8, dtype=np.float32).reshape(2, 4), binary_data=binary)
        inputs.append(tensor)
    return inputs


def normalized(label: str, answer: Any) -> Any:
    """What the two servers must agree on in an answer: not who they are, nor their own settings and counters."""
    if label == "server_metadata":
        return {"name": answer["name"], "has_version": bool(answer["version"])}
    if label == "model_config":
        return {key: answer[key] for key in ("name", "backend", "max_batch_size", "input", "output")}
    if label in ("statistics", "model_statistics"):
        return sorted(stats["name"] for stats in answer["model_stats"])
    if label in ("log_settings", "update_log_settings"):
        return {"log_info": answer["log_info"], "keys": sorted(answer)}
    if label.startswith("infer"):
        return {name: answer.as_numpy(name).tolist() for name in ("OUTPUT0", "OUTPUT1")}
    return answer


def outcome(label: str, call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", normalized(label, call())
    except InferenceServerException as exc:
        return "error", exc.message()


def calls(client: Any, module: Any, region: tuple[str, int]) -> dict[str, Callable[[], Any]]:
    """Every client method, by label; the aio client's return coroutines."""
    key, size = region
    infers = {
        f"infer_{algorithm or 'plain'}_{'binary' if binary else 'json'}": (
            lambda algorithm=algorithm, binary=binary: client.infer(
                "add_sub", add_sub_inputs(module, binary),
                outputs=[module.InferRequestedOutput(name, binary_data=binary) for name in ("OUTPUT0", "OUTPUT1")],
                request_compression_algorithm=algorithm, response_compression_algorithm=algorithm))
        for algorithm in (None, "gzip", "deflate") for binary in (True, False)
    }
    return {
        "server_live": client.is_server_live,
        "server_ready": client.is_server_ready,
        "model_ready": lambda: client.is_model_ready("add_sub"),
        "model_ready_unknown": lambda: client.is_model_ready("no_such_model"),
        "server_metadata": client.get_server_metadata,
        "model_metadata": lambda: client.get_model_metadata("add_sub"),
        "model_metadata_version": lambda: client.get_model_metadata("add_sub", "1"),
        "model_metadata_unknown": lambda: client.get_model_metadata("no_such_model"),
        "model_config": lambda: client.get_model_config("add_sub"),
        "repository_index": client.get_model_repository_index,
        "load": lambda: client.load_model("add_sub"),
        "unload": lambda: client.unload_model("add_sub"),
        "statistics": client.get_inference_statistics,
        "model_statistics": lambda: client.get_inference_statistics("add_sub"),
        "log_settings": client.get_log_settings,
        "update_log_settings": lambda: client.update_log_settings({"log_info": True}),
        # Trace settings: changed, then cleared back to the start values (both servers trace to `trace.json`).
        "trace_settings": client.get_trace_settings,
        "model_trace_settings": lambda: client.get_trace_settings("add_sub"),
        "unknown_model_trace_settings": lambda: client.get_trace_settings("no_such_model"),
        "update_trace_settings": lambda: client.update_trace_settings(
            settings={"trace_rate": "5", "trace_level": ["TIMESTAMPS"]}),
        "update_model_trace_settings": lambda: client.update_trace_settings(
            "add_sub", {"trace_count": "3", "log_frequency": "2"}),
        "model_trace_settings_after": lambda: client.get_trace_settings("add_sub"),
        "update_trace_file": lambda: client.update_trace_settings(settings={"trace_file": "elsewhere.json"}),
        "clear_model_trace_settings": lambda: client.update_trace_settings(
            "add_sub", {"trace_count": None, "log_frequency": None}),
        "clear_trace_settings": lambda: client.update_trace_settings(
            settings={"trace_rate": None, "trace_level": None}),
        "system_shm_register": lambda: client.register_system_shared_memory("clients", key, size),
        "system_shm_status": client.get_system_shared_memory_status,
        "system_shm_region_status": lambda: client.get_system_shared_memory_status("clients"),
        "system_shm_unregister": lambda: client.unregister_system_shared_memory("clients"),
        "system_shm_status_after": client.get_system_shared_memory_status,
        "system_shm_register_bad_key": lambda: client.register_system_shared_memory("bad", "/no-such-key", 8),
        "system_shm_unregister_all": client.unregister_system_shared_memory,
        "cuda_shm_status": client.get_cuda_shared_memory_status,
        "cuda_shm_register": lambda: client.register_cuda_shared_memory("cuda", b"", 0, 8),
        "cuda_shm_unregister": client.unregister_cuda_shared_memory,
        **infers,
    }


def sync_outcomes(server: ServerProcess, region: tuple[str, int]) -> dict[str, tuple[str, Any]]:
    with httpclient.InferenceServerClient(server.http_url, network_timeout=TIMEOUT_S) as client:
        return {label: outcome(label, call) for label, call in calls(client, httpclient, region).items()}


async def _aio_outcomes(server: ServerProcess, region: tuple[str, int]) -> dict[str, tuple[str, Any]]:
    results = {}
    async with aioclient.InferenceServerClient(server.http_url, conn_timeout=TIMEOUT_S) as client:
        for label, call in calls(client, aioclient, region).items():
            coroutine: Callable[[], Awaitable[Any]] = call
            try:
                results[label] = "ok", normalized(label, await coroutine())
            except InferenceServerException as exc:
                results[label] = "error", exc.message()
    return results


def aio_outcomes(server: ServerProcess, region: tuple[str, int]) -> dict[str, tuple[str, Any]]:
    return asyncio.run(_aio_outcomes(server, region))


#: Calls both servers refuse, each in its own words.
REFUSED_IN_OWN_WORDS = {"model_metadata_unknown", "system_shm_register_bad_key", "cuda_shm_register"}


@pytest.mark.parametrize("run", [aio_outcomes, sync_outcomes], ids=["aio", "sync"])
def test_every_client_call_agrees(servers: dict[str, ServerProcess], region: tuple[str, int],
                                  run: Callable[[ServerProcess, tuple[str, int]], dict[str, tuple[str, Any]]]) -> None:
    outcomes = {name: run(server, region) for name, server in servers.items()}
    ours, theirs = outcomes["transerve"], outcomes["triton"]
    assert ours.keys() == theirs.keys()
    for label, (status, answer) in theirs.items():
        assert ours[label][0] == status, f"{label}: transerve {ours[label]}, triton {(status, answer)}"
        if label not in REFUSED_IN_OWN_WORDS:
            assert ours[label][1] == answer, f"{label}: transerve {ours[label][1]!r}, triton {answer!r}"
    # the calls did what they say
    assert ours["server_metadata"] == ("ok", {"name": "triton", "has_version": True})
    assert ours["load"][0] == "error" and "explicit model load / unload is not allowed" in ours["load"][1]
    assert ours["system_shm_region_status"][1][0]["key"] == region[0]
    assert ours["system_shm_status_after"] == ("ok", [])
    assert ours["model_trace_settings_after"][1]["trace_count"] == "3"
    assert ours["model_trace_settings_after"][1]["trace_level"] == ["TIMESTAMPS"]
    assert ours["clear_trace_settings"] == ours["trace_settings"] == ("ok", {
        "trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1", "log_frequency": "0",
        "trace_file": "trace.json", "trace_mode": "triton"})
    assert ours["update_trace_file"][0] == "error" and "can not be updated" in ours["update_trace_file"][1]
    expected = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert ours["infer_gzip_binary"][1] == {"OUTPUT0": (expected * 2).tolist(), "OUTPUT1": (expected * 0).tolist()}
