"""Hostile input that the real Triton 2.51 cannot be trusted with, sent to transerve alone.

Triton crashes on some of these (a declared shape of [100000000000, 4] brings it down), so they cannot be
differential tests against the shared reference server. transerve must answer each with 400, without trying
to allocate what the request declares, and keep serving: every test ends by checking a normal request still
gets the right answer.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import requests
from support import ServerProcess

TIMEOUT_S = 30.0
"""A server that starts allocating a declared 400 GB tensor times out here instead of hanging the run."""

HUGE = 100_000_000_000


def binary_kwargs(header: dict[str, Any], payload: bytes, header_length: int | str | None = None) -> dict[str, Any]:
    encoded = json.dumps(header).encode()
    return {
        "data": encoded + payload,
        "headers": {
            "Inference-Header-Content-Length": str(len(encoded) if header_length is None else header_length),
            "Content-Type": "application/octet-stream",
        },
    }


def fp32(name: str, shape: list[Any], data: list[Any]) -> dict[str, Any]:
    return {"name": name, "shape": shape, "datatype": "FP32", "data": data}


GOOD_INPUT1 = fp32("INPUT1", [1, 4], [1, 1, 1, 1])
SIXTEEN_BYTES = np.arange(4, dtype=np.float32).tobytes()

CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("huge_batch_dim", "add_sub", {"json": {"inputs": [fp32("INPUT0", [HUGE, 4], [1, 2, 3, 4]), GOOD_INPUT1]}}),
    ("huge_variable_dim", "identity", {"json": {"inputs": [
        {"name": "INPUT_FP32", "shape": [1, HUGE], "datatype": "FP32", "data": [1, 2, 3, 4]}]}}),
    ("huge_bytes_tensor", "identity", {"json": {"inputs": [
        {"name": "INPUT_STRING", "shape": [1, HUGE], "datatype": "BYTES", "data": ["a", "b"]}]}}),
    ("huge_rank_one", "params", {"json": {"inputs": [fp32("INPUT0", [HUGE], [1, 2])]}}),
    ("element_count_overflows_int64", "identity", {"json": {"inputs": [
        {"name": "INPUT_FP64", "shape": [16, 2**62], "datatype": "FP64", "data": [1.0]}]}}),
    ("dim_beyond_int64", "params", {"json": {"inputs": [fp32("INPUT0", [2**64], [1.0])]}}),
    ("fractional_dim", "params", {"json": {"inputs": [fp32("INPUT0", [1.5], [1.0])]}}),
    ("string_dim", "params", {"json": {"inputs": [fp32("INPUT0", ["2"], [1.0, 2.0])]}}),
    ("huge_shape_binary", "identity", binary_kwargs(
        {"inputs": [{"name": "INPUT_FP32", "shape": [1, HUGE], "datatype": "FP32",
                     "parameters": {"binary_data_size": 16}}]}, SIXTEEN_BYTES)),
    ("huge_binary_data_size", "identity", binary_kwargs(
        {"inputs": [{"name": "INPUT_FP32", "shape": [1, 4], "datatype": "FP32",
                     "parameters": {"binary_data_size": 2**63}}]}, SIXTEEN_BYTES)),
    ("huge_bytes_element_length", "identity", binary_kwargs(
        {"inputs": [{"name": "INPUT_STRING", "shape": [1, 1], "datatype": "BYTES",
                     "parameters": {"binary_data_size": 8}}]}, (2**32 - 1).to_bytes(4, "little") + b"abcd")),
    ("non_numeric_header_length", "add_sub", binary_kwargs(
        {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}},
                    {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}}]},
        SIXTEEN_BYTES * 2, header_length="abc")),
    ("deeply_nested_data", "add_sub", {"data": b'{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", '
                                               b'"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}"}),
]


def assert_still_serving(server: ServerProcess) -> None:
    """Alive is not enough: the server must still compute the right answer for a well-formed request."""
    assert server.alive(), f"transerve died\n--- log tail ---\n{server.log_tail()}"
    body = {"inputs": [fp32("INPUT0", [1, 4], [1, 2, 3, 4]), GOOD_INPUT1]}
    response = requests.post(f"{server.base_url}/v2/models/add_sub/infer", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize(("case", "model", "kwargs"), CASES, ids=[c[0] for c in CASES])
def test_hostile_input_is_rejected(transerve_server: ServerProcess, case: str, model: str, kwargs: dict) -> None:
    response = requests.post(
        f"{transerve_server.base_url}/v2/models/{model}/infer", timeout=TIMEOUT_S, **kwargs
    )
    assert response.status_code == 400, f"{case}: {response.status_code} {response.text[:500]}"
    error = json.loads(response.content)
    assert isinstance(error, dict) and isinstance(error.get("error"), str) and error["error"], error
    assert_still_serving(transerve_server)
