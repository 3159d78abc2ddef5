"""The `tensorrt` backend (`platform: "tensorrt_plan"`, `model.plan`): a serialized TensorRT engine per instance.

It needs an NVIDIA GPU and the `tensorrt` package (TensorRT 10's named-tensor API); device buffers are torch
CUDA tensors. Where either is missing the model is UNAVAILABLE with one reason, and the rest of the
repository serves. Inputs and outputs are the engine's own tensors: auto-complete fills them from the
engine, and `max_batch_size` from an engine whose every tensor has a dynamic first axis (the largest batch
of its first optimization profile).
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from transerve.backends import autocomplete
from transerve.backends.base import Backend, BackendModel, ModelContext, Placement, instance_placements
from transerve.backends.threaded import ThreadedInstance, load_failure, open_engines, release
from transerve.config.devices import visible_gpus
from transerve.core.datatypes import numpy_to_protocol, protocol_to_config
from transerve.core.errors import ServerError, invalid_arg, unavailable

REASON = "TensorRT needs an NVIDIA GPU and the tensorrt package"
#: TensorRT's libraries come in wheels of their own, for one CUDA major version.
LIBRARIES_INSTALL = ("pip install tensorrt-cu12 (or tensorrt-cu13: the CUDA major version of the driver and of "
                     "torch), which brings libnvinfer")


class TensorRTEngine:
    """An execution context of a deserialized engine on one GPU, run synchronously on its own stream."""

    def __init__(self, trt: ModuleType, torch: ModuleType, engine: Any, device: Any) -> None:
        self._trt = trt
        self._torch = torch
        self.engine = engine
        self._context = engine.create_execution_context()
        self._device = device
        self._stream = torch.cuda.Stream(device=device)

    def tensors(self, mode: Any) -> list[autocomplete.ModelTensor]:
        found = []
        for index in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(index)
            if self.engine.get_tensor_mode(name) == mode:
                dtype = np.dtype(self._trt.nptype(self.engine.get_tensor_dtype(name)))
                datatype = protocol_to_config(numpy_to_protocol(dtype) or "")
                shape = tuple(int(d) if d >= 0 else -1 for d in self.engine.get_tensor_shape(name))
                found.append(autocomplete.ModelTensor(name, datatype, shape))
        return found

    def max_batch(self) -> int:
        inputs = self.tensors(self._trt.TensorIOMode.INPUT)
        return min(int(self.engine.get_tensor_profile_shape(t.name, 0)[2][0]) for t in inputs) if inputs else 0

    def run(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        torch = self._torch
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            keep = []
            for name, array in inputs.items():
                tensor = torch.from_numpy(np.ascontiguousarray(array)).to(self._device, non_blocking=False)
                keep.append(tensor)
                self._context.set_input_shape(name, tuple(array.shape))
                self._context.set_tensor_address(name, tensor.data_ptr())
            results = {}
            for index in range(self.engine.num_io_tensors):
                name = self.engine.get_tensor_name(index)
                if self.engine.get_tensor_mode(name) != self._trt.TensorIOMode.OUTPUT:
                    continue
                dtype = torch.from_numpy(np.zeros(0, self._trt.nptype(self.engine.get_tensor_dtype(name)))).dtype
                buffer = torch.empty(tuple(self._context.get_tensor_shape(name)), dtype=dtype, device=self._device)
                self._context.set_tensor_address(name, buffer.data_ptr())
                results[name] = buffer
            if not self._context.execute_async_v3(self._stream.cuda_stream):
                raise RuntimeError("TensorRT failed to execute the engine")
            self._stream.synchronize()
        return {name: results[name].cpu().numpy() for name in outputs}


def _engine_modules() -> tuple[ModuleType, ModuleType]:
    """tensorrt and torch (for CUDA buffers), or UNAVAILABLE with the one reason."""
    if not visible_gpus() or importlib.util.find_spec("tensorrt") is None:
        raise unavailable(REASON)
    try:
        import tensorrt
    except (ImportError, OSError) as exc:  # the Python package without the libraries it loads (libnvinfer)
        raise unavailable(f"the tensorrt package is installed but does not load ({' '.join(str(exc).split())[:300]}): "
                          f"{LIBRARIES_INSTALL}") from None
    import torch

    if not torch.cuda.is_available():
        raise unavailable(f"{REASON}, and a CUDA build of torch for its buffers")
    return tensorrt, torch


class TensorRTBackend(Backend):
    name = "tensorrt"

    async def load(self, context: ModelContext) -> BackendModel:
        trt, torch = _engine_modules()
        where = f"failed to load '{context.name}' version {context.version}"
        try:
            path = context.model_file("model.plan")
        except ServerError as exc:
            raise ServerError(exc.code, f"{where}: {exc.message}") from None
        if not path.is_file():
            raise invalid_arg(f"{where}: model file '{path}' not found")
        config = context.config
        loop = asyncio.get_running_loop()
        placements = instance_placements(config)
        opened: list[tuple[Any, TensorRTEngine]] = []
        try:
            opened = await open_engines(loop, placements, lambda p: _open(trt, torch, path, p), "trt")
            engine = opened[0][1]
            inputs = engine.tensors(trt.TensorIOMode.INPUT)
            outputs = engine.tensors(trt.TensorIOMode.OUTPUT)
            if context.auto_complete:
                autocomplete.auto_complete(config, inputs, outputs, engine.max_batch())
            autocomplete.check(config, inputs, outputs)
        except Exception as exc:  # a config the model does not match, or TensorRT's own errors
            release([executor for executor, _ in opened])
            raise load_failure(exc, where, "TensorRT", path.name) from None
        instances = [
            ThreadedInstance(context.name, context.version, placement.name, config, executor, engine, loop)
            for placement, (executor, engine) in zip(placements, opened, strict=True)
        ]
        return BackendModel(config, instances)


def _open(trt: ModuleType, torch: ModuleType, path: Path, placement: Placement) -> TensorRTEngine:
    if placement.kind != "GPU":
        raise unavailable(f"instance '{placement.name}' is {placement.kind}: TensorRT engines run on a GPU only")
    device = torch.device("cuda", placement.device_id)
    with torch.cuda.device(device):
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise RuntimeError("the plan is corrupt or was built by another TensorRT version or for another GPU")
    return TensorRTEngine(trt, torch, engine, device)
