"""The tensorrt backend: without a GPU and the tensorrt package its models are UNAVAILABLE with one reason,
and the rest of the repository serves."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from support.in_process import outputs, request, states, with_server
from support.tiny_models import write_onnx

from transerve.backends.tensorrt.backend import REASON
from transerve.config.devices import visible_gpus
from transerve.core.errors import ErrorCode, ServerError
from transerve.server import Server

HAS_TENSORRT = bool(visible_gpus()) and importlib.util.find_spec("tensorrt") is not None


@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is usable here")
def test_a_plan_is_unavailable_with_the_reason_and_the_rest_serves(tmp_path: Path):
    assert REASON == "TensorRT needs an NVIDIA GPU and the tensorrt package"
    (tmp_path / "with_config" / "1").mkdir(parents=True)
    (tmp_path / "with_config" / "1" / "model.plan").write_bytes(b"serialized engine")
    (tmp_path / "with_config" / "config.pbtxt").write_text('platform: "tensorrt_plan" max_batch_size: 4')
    (tmp_path / "found_by_file" / "1").mkdir(parents=True)
    (tmp_path / "found_by_file" / "1" / "model.plan").write_bytes(b"serialized engine")
    write_onnx("add_sub", tmp_path / "other" / "1" / "model.onnx")

    async def check(server: Server) -> None:
        index = states(server)
        for name in ("with_config", "found_by_file"):
            assert index[name] == {"name": name, "state": "UNAVAILABLE", "reason": REASON}
        assert index["other"]["state"] == "READY"
        ones = np.ones((1, 4), dtype=np.float32)
        got = outputs(await server.infer(request("other", INPUT0=("FP32", ones), INPUT1=("FP32", ones))))
        assert got["OUTPUT0"].tolist() == [[2, 2, 2, 2]]

    with_server(tmp_path, check)


def test_a_tensorrt_package_without_its_libraries_is_unavailable_naming_what_to_install(tmp_path: Path, monkeypatch):
    """The `tensorrt` Python package can be installed while libnvinfer is not: its import then fails."""
    import sys

    import transerve.backends.tensorrt.backend as backend

    monkeypatch.setattr(backend, "visible_gpus", lambda: [0])
    monkeypatch.setattr(backend.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt raises ImportError
    with pytest.raises(ServerError) as caught:
        backend._engine_modules()
    assert caught.value.code == ErrorCode.UNAVAILABLE
    assert caught.value.message.startswith("the tensorrt package is installed but does not load (")
    assert caught.value.message.endswith(backend.LIBRARIES_INSTALL)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TENSORRT, reason="needs an NVIDIA GPU and the tensorrt package")
def test_a_plan_built_here_serves(tmp_path: Path):
    """Builds a plan from the tiny ONNX model with TensorRT's ONNX parser, then serves it with auto-complete."""
    import tensorrt as trt

    onnx_path = write_onnx("add_sub", tmp_path / "build" / "model.onnx")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(onnx_path.read_bytes())
    profile = builder.create_optimization_profile()
    for name in ("INPUT0", "INPUT1"):
        profile.set_shape(name, (1, 4), (4, 4), (8, 4))
    build = builder.create_builder_config()
    build.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, build)
    (tmp_path / "repo" / "add_sub" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "add_sub" / "1" / "model.plan").write_bytes(bytes(plan))

    async def check(server: Server) -> None:
        assert server.model_config("add_sub")["max_batch_size"] == 8
        ones = np.ones((2, 4), dtype=np.float32)
        got = outputs(await server.infer(request("add_sub", INPUT0=("FP32", ones), INPUT1=("FP32", ones))))
        assert got["OUTPUT0"].tolist() == [[2] * 4] * 2

    with_server(tmp_path / "repo", check)
