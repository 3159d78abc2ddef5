"""A model file's own inputs and outputs against its config: Triton's auto-complete and load checks, for
backends whose files describe their tensors (ONNX graphs, TensorRT engines).

Auto-complete (unless `--disable-auto-complete-config`) fills what the config leaves out: inputs and outputs
(name, data type, dims); for a model whose every input and output has a dynamic first axis, `max_batch_size`
(the backend's default: Triton's 4 for onnxruntime); and `dynamic_batching` for a model that batches more
than one request and names no scheduler. Then the config is checked against the model, with or without
auto-complete, so that a mismatch is a load failure with a reason rather than a failure of every request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2

from transerve.config.model_config import ConfigError

#: Triton's default for auto-completed batching models.
DEFAULT_MAX_BATCH_SIZE = 4

@dataclass(frozen=True, slots=True)
class ModelTensor:
    """An input or output of the model file: its config data type and full shape, -1 where an axis is dynamic."""

    name: str
    data_type: str
    shape: tuple[int, ...]


def supports_batching(inputs: list[ModelTensor], outputs: list[ModelTensor]) -> bool:
    return all(tensor.shape and tensor.shape[0] == -1 for tensor in [*inputs, *outputs])


def auto_complete(
    config: model_config_pb2.ModelConfig,
    inputs: list[ModelTensor],
    outputs: list[ModelTensor],
    default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
) -> None:
    """Fill, in place, what the config leaves out and the model file says."""
    if config.max_batch_size == 0 and default_max_batch_size > 0 and supports_batching(inputs, outputs):
        configured = [*config.input, *config.output]
        found = {tensor.name: tensor for tensor in [*inputs, *outputs]}
        # Dims already written without a batch axis mean the author wants batching; with it, they do not.
        if all(not t.dims or (t.name in found and len(t.dims) == len(found[t.name].shape) - 1) for t in configured):
            config.max_batch_size = default_max_batch_size
    scheduled = config.HasField("dynamic_batching") or config.HasField("sequence_batching")
    if config.max_batch_size > 1 and not scheduled:
        config.dynamic_batching.SetInParent()
    skip = 1 if config.max_batch_size > 0 else 0
    _complete(config.input, inputs, skip)
    _complete(config.output, outputs, skip)


def _complete(configured: Sequence, found: list[ModelTensor], skip: int) -> None:
    by_name = {tensor.name: tensor for tensor in configured}
    for tensor in found:
        entry = by_name.get(tensor.name)
        if entry is None:
            entry = configured.add()  # type: ignore[attr-defined]
            entry.name = tensor.name
        if entry.data_type == model_config_pb2.TYPE_INVALID:
            entry.data_type = model_config_pb2.DataType.Value(tensor.data_type)
        if not entry.dims and not entry.HasField("reshape"):
            entry.dims.extend(tensor.shape[skip:] or ())


def check(config: model_config_pb2.ModelConfig, inputs: list[ModelTensor], outputs: list[ModelTensor]) -> None:
    """Raise ConfigError, with Triton's wording where it has one, unless the config fits the model."""
    batching = config.max_batch_size > 0
    model_inputs = {tensor.name: tensor for tensor in inputs}
    model_outputs = {tensor.name: tensor for tensor in outputs}
    for kind, configured, found in (("input", config.input, model_inputs), ("output", config.output, model_outputs)):
        for entry in configured:
            tensor = found.get(entry.name)
            if tensor is None:
                raise ConfigError(f"unexpected inference {kind} '{entry.name}', allowed {kind}s are: "
                                  f"{', '.join(found)}")
            declared = model_config_pb2.DataType.Name(entry.data_type)
            if declared != tensor.data_type:
                raise ConfigError(f"unexpected datatype {declared} for {kind} '{entry.name}', model provides "
                                  f"{tensor.data_type}")
            _check_shape(config.name, entry, tensor, batching)
    if len(config.input) != len(model_inputs):
        raise ConfigError(f"unable to load model '{config.name}', configuration expects {len(config.input)} "
                          f"inputs, model provides {len(model_inputs)}")


def _check_shape(model: str, entry: model_config_pb2.ModelInput, tensor: ModelTensor, batching: bool) -> None:
    dims = list(entry.reshape.shape) if entry.HasField("reshape") else list(entry.dims)
    shape = list(tensor.shape)
    if batching:
        if not shape or shape[0] != -1:
            raise ConfigError(f"model '{model}', tensor '{entry.name}': for the model to support batching the "
                              "shape should have at least 1 dimension and the first dimension must be -1; but "
                              f"shape expected by the model is {shape}")
        shape = shape[1:]
    fits = len(dims) == len(shape) and all(want == -1 or have == want for have, want in zip(dims, shape, strict=True))
    if not fits:
        full = ([-1] if batching else []) + dims
        raise ConfigError(f"model '{model}', tensor '{entry.name}': the model expects shape "
                          f"{list(tensor.shape)} but the model configuration specifies {full}")
