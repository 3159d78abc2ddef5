"""The `pytorch` backend (`platform: "pytorch_libtorch"`, `model.pt`): TorchScript modules, one per instance.

Inputs reach `forward` as Triton's libtorch backend passes them: by index when every input is named
`<name>__<index>` (`INPUT__0`, `input__1`), by keyword when every input is a `forward` argument name, otherwise
in config order. Outputs are taken by index for `<name>__<index>` names, by key from a dict result, otherwise
in config order. `parameters` as in Triton: `INFERENCE_MODE` (default true: `torch.inference_mode`, else
`no_grad`), `DISABLE_OPTIMIZED_EXECUTION`, `INTRA_OP_THREAD_COUNT` and `INTER_OP_THREAD_COUNT` (torch keeps
one setting of each per process: the last model loaded sets them). A TorchScript file does not record
input and output types, so the config must list them. Inputs that index an embedding table are checked per
request before a run (`embeddings.py`): an id outside the table is a 400 for that request alone.
"""

from __future__ import annotations

import asyncio
import logging
import re
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2

from transerve.backends.base import Backend, BackendModel, ModelContext, Placement, instance_placements
from transerve.backends.index_bounds import IndexBound
from transerve.backends.pytorch.embeddings import TORCH_BAD_INDEX, embedding_bounds
from transerve.backends.threaded import ThreadedInstance, import_engine, load_failure, open_engines
from transerve.backends.torch_attention import use_decoding_attention
from transerve.config.model_config import ConfigError
from transerve.core.errors import ServerError, internal, invalid_arg, unavailable

log = logging.getLogger(__name__)

_INDEXED = re.compile(r"^.+__(\d+)$")
#: Seconds an instance's thread waits without work before it ends, its OpenMP pool with it (`IdleEndingExecutor`).
IDLE_SECONDS = 1.0


class TorchEngine:
    """A TorchScript module on one device, its inputs and outputs mapped once at load."""

    def __init__(self, torch: ModuleType, module: Any, device: Any, call: _CallSpec, settings: _Settings) -> None:
        self._torch = torch
        self._module = module
        self._device = device
        self._call = call
        self._settings = settings
        #: The config inputs that index an embedding table, found at load.
        self.bounds: list[IndexBound] = []

    def run(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        torch = self._torch
        mode = torch.inference_mode() if self._settings.inference_mode else torch.no_grad()
        with mode, torch.jit.optimized_execution(self._settings.optimized_execution):
            tensors = {name: torch.from_numpy(_writable(array)).to(self._device) for name, array in inputs.items()}
            try:
                if self._call.keyword:
                    result = self._module(**tensors)
                else:
                    result = self._module(*(tensors[name] for name in self._call.positional))
            except (IndexError, RuntimeError) as exc:
                message = " ".join(str(exc).split())
                if TORCH_BAD_INDEX not in message:
                    raise
                # an id past a table `embeddings` did not find: the client's input, not the model's failure
                raise invalid_arg(f"an input holds an id outside its embedding table: {message[-300:]}") from None
            produced = self._call.pick(result, outputs)
        return {name: tensor.detach().cpu().numpy() for name, tensor in produced.items()}


def _writable(array: np.ndarray) -> np.ndarray:
    """torch.from_numpy warns on read-only arrays (request bodies are), so those are copied."""
    return array if array.flags.writeable else array.copy()


class _Settings:
    def __init__(self, config: model_config_pb2.ModelConfig) -> None:
        self.inference_mode = _flag(config, "INFERENCE_MODE", True)
        self.optimized_execution = not _flag(config, "DISABLE_OPTIMIZED_EXECUTION", False)
        self.intra_op_threads = _count(config, "INTRA_OP_THREAD_COUNT")
        self.inter_op_threads = _count(config, "INTER_OP_THREAD_COUNT")


class _CallSpec:
    """How config inputs become `forward` arguments and `forward`'s result becomes config outputs."""

    def __init__(self, config: model_config_pb2.ModelConfig, arguments: list[str]) -> None:
        inputs = [tensor.name for tensor in config.input]
        indexed = [_INDEXED.match(name) for name in inputs]
        self.keyword = False
        if inputs and all(indexed):
            order = sorted(zip((int(m.group(1)) for m in indexed if m), inputs, strict=True))
            if [index for index, _ in order] != list(range(len(inputs))):
                raise ConfigError(f"input indices of {inputs} must run from 0 to {len(inputs) - 1}")
            self.positional = [name for _, name in order]
        elif inputs and set(inputs) <= set(arguments):
            self.keyword = True
            self.positional = inputs
        else:
            self.positional = inputs
        outputs = [tensor.name for tensor in config.output]
        matches = [_INDEXED.match(name) for name in outputs]
        if outputs and all(matches):
            self.output_index = {name: int(m.group(1)) for name, m in zip(outputs, matches, strict=True) if m}
        else:
            self.output_index = {name: index for index, name in enumerate(outputs)}

    def carriers(self, arguments: list[str]) -> dict[str, str]:
        """Forward argument name -> the config input passed as it."""
        if self.keyword:
            return {name: name for name in self.positional}
        return dict(zip(arguments, self.positional, strict=False))

    def pick(self, result: Any, wanted: list[str]) -> dict[str, Any]:
        if isinstance(result, dict):
            missing = [name for name in wanted if name not in result]
            if missing:
                raise internal(f"the model's forward returned no {missing} (it returned {sorted(result)})")
            return {name: result[name] for name in wanted}
        values = list(result) if isinstance(result, (tuple, list)) else [result]
        picked = {}
        for name in wanted:
            index = self.output_index[name]
            if index >= len(values):
                raise internal(f"output '{name}' is result {index} of forward, which returned {len(values)}")
            picked[name] = values[index]
        return picked


def _flag(config: model_config_pb2.ModelConfig, key: str, default: bool) -> bool:
    if key not in config.parameters:
        return default
    text = config.parameters[key].string_value.strip().lower()
    if text not in ("true", "false"):
        raise invalid_arg(f"parameter {key} must be 'true' or 'false', got '{text}'")
    return text == "true"


def _count(config: model_config_pb2.ModelConfig, key: str) -> int:
    if key not in config.parameters:
        return 0
    text = config.parameters[key].string_value
    if not text.strip().isdigit():
        raise invalid_arg(f"parameter {key} must be a non-negative integer, got '{text}'")
    return int(text)


class PyTorchBackend(Backend):
    name = "pytorch"

    async def load(self, context: ModelContext) -> BackendModel:
        torch = import_engine("torch", "torch")
        where = f"failed to load '{context.name}' version {context.version}"
        config = context.config
        try:
            path = context.model_file("model.pt")
        except ServerError as exc:
            raise ServerError(exc.code, f"{where}: {exc.message}") from None
        if not path.is_file():
            raise invalid_arg(f"{where}: model file '{path}' not found")
        if not config.input or not config.output:
            raise invalid_arg(f"{where}: a TorchScript model does not record its inputs and outputs: list them "
                              "(name, data_type, dims) in config.pbtxt")
        strings = [t.name for t in [*config.input, *config.output] if t.data_type == model_config_pb2.TYPE_STRING]
        if strings:
            raise invalid_arg(f"{where}: TYPE_STRING tensors {strings} are not supported by the pytorch backend")
        loop = asyncio.get_running_loop()
        placements = instance_placements(config)
        try:
            settings = _Settings(config)
            opened = await open_engines(
                loop, placements, lambda placement: _open(torch, path, placement, config, settings), "torch",
                idle_seconds=IDLE_SECONDS, thread_setup=lambda placement: _set_threads(torch, settings),
            )
        except Exception as exc:  # a config the model does not match, or torch's own errors (not TorchScript, ...)
            raise load_failure(exc, where, "torch", path.name) from None
        instances = [
            ThreadedInstance(context.name, context.version, placement.name, config, executor, engine, loop,
                             engine.bounds)
            for placement, (executor, engine) in zip(placements, opened, strict=True)
        ]
        return BackendModel(config, instances)


def _set_threads(torch: ModuleType, settings: _Settings) -> None:
    """Run first on each of an instance's threads: torch's (OpenMP's) thread count belongs to the thread."""
    torch.get_num_threads()  # torch's lazy per-thread setup first, so that it cannot undo what is set here
    if settings.intra_op_threads:
        torch.set_num_threads(settings.intra_op_threads)


def _open(
    torch: ModuleType, path: Path, placement: Placement, config: model_config_pb2.ModelConfig, settings: _Settings
) -> TorchEngine:
    """Load the module in its instance's thread (whose thread count `_set_threads` set)."""
    if placement.kind == "GPU":
        if not torch.cuda.is_available():
            raise unavailable(f"instance '{placement.name}' is KIND_GPU but this torch has no CUDA support")
        device = torch.device("cuda", placement.device_id)
        use_decoding_attention(torch, device)  # lengths vary by batch: no attention kernel that plans per shape
    else:
        device = torch.device("cpu")
    if settings.inter_op_threads and torch.get_num_interop_threads() != settings.inter_op_threads:
        try:
            torch.set_num_interop_threads(settings.inter_op_threads)
        except RuntimeError:  # torch allows it only once, before its first parallel work
            log.warning("INTER_OP_THREAD_COUNT of '%s' ignored: torch's inter-op threads were already set to %d",
                        config.name, torch.get_num_interop_threads())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is what Triton's backend serves
        module = torch.jit.load(str(path), map_location=device).eval()
    arguments = [argument.name for argument in module.forward.schema.arguments][1:]  # without `self`
    call = _CallSpec(config, arguments)
    engine = TorchEngine(torch, module, device, call, settings)
    engine.bounds = embedding_bounds(module, call.carriers(arguments))
    return engine
