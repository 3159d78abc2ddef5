"""The `onnxruntime` backend (`platform: "onnxruntime_onnx"`, `model.onnx`): one InferenceSession per instance.

Settings follow Triton's onnxruntime backend: `parameters` `intra_op_thread_count`, `inter_op_thread_count`
and `execution_mode` (0 sequential, 1 parallel), plus onnxruntime's session config entries as parameters
whose keys start with `session.` (one that names a file or folder is taken relative to the version folder and
must stay inside the model's folder: `repository/paths.py`); `optimization { graph { level } }` (-1 basic, 1 extended,
otherwise all); KIND_GPU instances run on the CUDA execution provider of their GPU, with TensorRT's in front
when `optimization.execution_accelerators` asks for `tensorrt` (both need `onnxruntime-gpu`); KIND_CPU
instances on the CPU provider. Inputs that index an embedding table are checked per request before a run
(`embeddings.py`): an id outside the table is a 400 for that request alone.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from concurrent.futures import Executor
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2

from transerve.backends import autocomplete
from transerve.backends.base import Backend, BackendModel, ModelContext, Placement, instance_placements
from transerve.backends.onnxruntime.embeddings import ORT_BAD_INDEX, embedding_bounds
from transerve.backends.threaded import ThreadedInstance, import_engine, load_failure, open_engines, release
from transerve.config.model_config import ConfigError
from transerve.core.errors import ServerError, invalid_arg, unavailable
from transerve.repository.paths import inside

logger = logging.getLogger(__name__)

_PARAMETERS = ("intra_op_thread_count", "inter_op_thread_count", "execution_mode")
#: onnxruntime session settings whose value is a file or folder, by their last word (e.g.
#: `session.collect_node_memory_stats_to_file`, which onnxruntime writes to): kept inside the model's folder.
_PATH_SETTING = re.compile(r"(file|filepath|file_name|path|dir|folder|directory)$")
#: An error of the CUDA execution provider's own start (its libraries, the driver), not of the model.
_CUDA_FAILURE = re.compile(r"CUDA|cuDNN|cudnn|cublas|lib\w+\.so")
#: What makes the CUDA execution provider start: onnxruntime-gpu with the CUDA and cuDNN it was built for.
CUDA_INSTALL = "pip install 'onnxruntime-gpu[cuda,cudnn]' (CUDA and cuDNN from PyPI, the versions it was built for)"


#: onnxruntime's type names -> config data types.
ONNX_TYPES = {
    "tensor(bool)": "TYPE_BOOL",
    "tensor(uint8)": "TYPE_UINT8",
    "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32",
    "tensor(uint64)": "TYPE_UINT64",
    "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16",
    "tensor(int32)": "TYPE_INT32",
    "tensor(int64)": "TYPE_INT64",
    "tensor(float16)": "TYPE_FP16",
    "tensor(float)": "TYPE_FP32",
    "tensor(double)": "TYPE_FP64",
    "tensor(bfloat16)": "TYPE_BF16",
    "tensor(string)": "TYPE_STRING",
}


def _graph_tensors(nodes: list[Any], kind: str) -> list[autocomplete.ModelTensor]:
    """onnxruntime's NodeArgs; a non-tensor value (a sequence, a map) cannot be served."""
    tensors = []
    for node in nodes:
        data_type = ONNX_TYPES.get(node.type)
        if data_type is None:
            raise ConfigError(f"{kind} '{node.name}' of the ONNX model is {node.type}, which cannot be served")
        shape = tuple(dim if isinstance(dim, int) and dim >= 0 else -1 for dim in (node.shape or ()))
        tensors.append(autocomplete.ModelTensor(node.name, data_type, shape))
    return tensors


class OrtEngine:
    """An InferenceSession; BYTES tensors cross as the str arrays onnxruntime wants."""

    def __init__(self, session: Any) -> None:
        self.session = session
        #: BYTES inputs, set once the config is final.
        self.string_inputs: set[str] = set()

    def run(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        feed = {name: _to_str(array) if name in self.string_inputs else array for name, array in inputs.items()}
        try:
            values = self.session.run(outputs, feed)
        except Exception as exc:
            message = " ".join(str(exc).split())
            if ORT_BAD_INDEX in message:  # an id past a table that `embeddings` did not find: still the client's
                raise invalid_arg(f"an input holds an id outside its embedding table: {message[:300]}") from None
            raise
        pairs = zip(outputs, values, strict=True)
        return {name: _to_bytes(value) if value.dtype == object else value for name, value in pairs}


def _to_str(array: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda item: item.decode("utf-8") if isinstance(item, bytes) else item, otypes=[object])(array)


def _to_bytes(array: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda item: item.encode("utf-8") if isinstance(item, str) else item, otypes=[object])(array)


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    async def load(self, context: ModelContext) -> BackendModel:
        ort = import_engine("onnxruntime", "onnx")
        where = f"failed to load '{context.name}' version {context.version}"
        path = _model_file(context)
        config = context.config
        loop = asyncio.get_running_loop()
        opened: list[tuple[Executor, OrtEngine]] = []
        try:
            options = _session_options(ort, context)
            opened = await open_engines(
                loop, instance_placements(config),
                lambda placement: OrtEngine(_open_session(ort, path, options, placement, config)), "ort",
            )
            session = opened[0][1].session
            inputs = _graph_tensors(session.get_inputs(), "input")
            outputs = _graph_tensors(session.get_outputs(), "output")
            if context.auto_complete:
                default = context.backend_config.get("default-max-batch-size", str(autocomplete.DEFAULT_MAX_BATCH_SIZE))
                autocomplete.auto_complete(config, inputs, outputs, _int(default, "default-max-batch-size"))
            autocomplete.check(config, inputs, outputs)
            served = {tensor.name for tensor in config.input}
            bounds = [b for b in await loop.run_in_executor(None, embedding_bounds, path) if b.input in served]
        except Exception as exc:  # a config the model does not match, or onnxruntime's own errors
            release([executor for executor, _ in opened])
            raise load_failure(exc, where, "onnxruntime", path.name) from None
        strings = {t.name for t in config.input if t.data_type == model_config_pb2.TYPE_STRING}
        for _, engine in opened:
            engine.string_inputs = strings
        instances = [
            ThreadedInstance(context.name, context.version, placement.name, config, executor, engine, loop, bounds)
            for placement, (executor, engine) in zip(instance_placements(config), opened, strict=True)
        ]
        return BackendModel(config, instances)


def _model_file(context: ModelContext) -> Path:
    """`model.onnx`, or the `model.onnx/model.onnx` of a folder holding external weights (as Triton allows)."""
    where = f"failed to load '{context.name}' version {context.version}"
    try:
        path = context.model_file("model.onnx")
        if path.is_dir():
            path = inside(context.model_path, path, "model.onnx", "default_model_filename")
    except ServerError as exc:
        raise ServerError(exc.code, f"{where}: {exc.message}") from None
    if not path.is_file():
        raise invalid_arg(f"{where}: model file '{path}' not found")
    return path


def _session_options(ort: ModuleType, context: ModelContext) -> Any:
    config = context.config
    options = ort.SessionOptions()
    values = {key: _int(config.parameters[key].string_value, key) for key in _PARAMETERS if key in config.parameters}
    if values.get("intra_op_thread_count", 0) > 0:
        options.intra_op_num_threads = values["intra_op_thread_count"]
    if values.get("inter_op_thread_count", 0) > 0:
        options.inter_op_num_threads = values["inter_op_thread_count"]
    if values.get("execution_mode") == 1:
        options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    for key, value in config.parameters.items():
        if key.startswith("session."):  # onnxruntime's own session settings, e.g. session.intra_op.allow_spinning
            setting = value.string_value
            if _PATH_SETTING.search(key):
                setting = str(inside(context.model_path, context.version_path, setting, f"parameter {key}"))
            options.add_session_config_entry(key, setting)
    level = config.optimization.graph.level
    levels = ort.GraphOptimizationLevel
    options.graph_optimization_level = {-1: levels.ORT_ENABLE_BASIC, 1: levels.ORT_ENABLE_EXTENDED}.get(
        level, levels.ORT_ENABLE_ALL
    )
    return options


def _providers(ort: ModuleType, config: model_config_pb2.ModelConfig, placement: Placement) -> list[Any]:
    if placement.kind != "GPU":
        return ["CPUExecutionProvider"]
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise unavailable(f"instance '{placement.name}' is KIND_GPU but this onnxruntime has no CUDA execution "
                          f"provider: {CUDA_INSTALL}")
    device = {"device_id": placement.device_id}
    providers: list[Any] = [("CUDAExecutionProvider", device), "CPUExecutionProvider"]
    accelerators = config.optimization.execution_accelerators.gpu_execution_accelerator
    if any(accelerator.name == "tensorrt" for accelerator in accelerators):
        if "TensorrtExecutionProvider" not in available:
            raise unavailable("the config asks for the tensorrt execution accelerator, which this onnxruntime lacks")
        providers.insert(0, ("TensorrtExecutionProvider", device))
    return providers


@functools.cache
def _preload_cuda_libraries(ort: ModuleType) -> None:
    """The CUDA and cuDNN libraries of onnxruntime-gpu's `[cuda,cudnn]` extras, loaded before its first GPU session
    (once per process). Their PyPI packages put them outside the loader's search path, and beside a torch built for
    another CUDA (cu130 brings CUDA 13, onnxruntime-gpu wants 12) nothing else loads them; `preload_dlls`
    (onnxruntime 1.21 on) finds them. Older versions lack it, and a failure here is only logged: the session's own
    start then says what is missing (`_open_session`)."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    try:
        preload()
    except Exception as exc:  # noqa: BLE001 - onnxruntime reports the missing library when the session starts
        logger.warning("onnxruntime could not preload its CUDA libraries: %s", exc)


def _open_session(
    ort: ModuleType, path: Path, options: Any, placement: Placement, config: model_config_pb2.ModelConfig
) -> Any:
    """The instance's session. On a GPU, a CUDA execution provider that cannot start is UNAVAILABLE naming what to
    install: onnxruntime either raises or, when its CUDA or cuDNN libraries do not load, logs the failure and runs
    the session on the CPU, which would serve a KIND_GPU instance from the CPU without a word."""
    providers = _providers(ort, config, placement)
    if placement.kind == "GPU":
        _preload_cuda_libraries(ort)
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
    except Exception as exc:
        if placement.kind == "GPU" and _CUDA_FAILURE.search(str(exc)):
            raise unavailable(f"instance '{placement.name}': onnxruntime's CUDA execution provider failed to start "
                              f"({' '.join(str(exc).split())[:300]}): {CUDA_INSTALL}") from None
        raise
    if placement.kind == "GPU" and "CUDAExecutionProvider" not in session.get_providers():
        raise unavailable(f"instance '{placement.name}' is KIND_GPU but onnxruntime's CUDA execution provider failed "
                          f"to start (its CUDA or cuDNN libraries did not load; onnxruntime's log says which): "
                          f"{CUDA_INSTALL}")
    return session


def _int(text: str, key: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise invalid_arg(f"parameter {key} must be an integer, got '{text}'") from None
