"""Which requests may share a batch, read once from the model config.

Triton's rule: inputs with a variable dimension (`-1`) that are not `allow_ragged_batch` must have the same
shape in every request of a batch, and when the model has optional inputs every request must carry the
same ones; the batcher stops a batch at the first request that differs.

transerve's opt-in addition, for variable-length inputs such as token ids or text, is length buckets
(config `parameters`, all string values):

- `batching_strategy: "bucketed"`: requests batch only with requests of the same length bucket, so a
  batch holds similar lengths and pads little. The oldest waiting request's bucket goes first.
- `bucket_input`: the input whose length decides (default: the first input with a `-1` dimension, else
  the first TYPE_STRING input). Its length is its size along its first `-1` dimension; for a TYPE_STRING
  input without one, the longest string in bytes.
- `bucket_boundaries`: increasing upper bounds, e.g. `"16,32,64,128"` (default: powers of two 8..1024);
  longer requests share one last bucket.

and padding, with or without buckets (these keys are read only when `pad_inputs` is set, so a model that
uses the same names for its own purposes is not disturbed):

- `pad_inputs: "true"`: before a batch executes, every numeric input with a `-1` dimension is padded at
  the end of each such axis to the batch's longest, so the model receives equal shapes.
- `padding_value`: what the padding holds (default 0).
- `attention_mask_input`: an input the batcher fills with 1 over each request's real positions of the
  bucket input and 0 over its padding (a request's own mask, if it sends one, is padded with 0 instead).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2

from transerve.core.batching import MaskSpec, pad_requests
from transerve.core.datatypes import config_to_protocol
from transerve.core.errors import invalid_arg
from transerve.core.types import InferRequest

DEFAULT_BOUNDARIES = (8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True, slots=True)
class LengthSource:
    """Where a request's length is read: an axis of an input, or (axis None) its longest string."""

    name: str
    axis: int | None

    def length(self, request: InferRequest) -> int:
        for tensor in request.inputs:
            if tensor.name == self.name:
                if self.axis is not None:
                    return int(tensor.data.shape[self.axis])
                return max((len(item) for item in tensor.data.flat), default=0)
        return 0


@dataclass(frozen=True, slots=True)
class Bucketing:
    source: LengthSource
    boundaries: tuple[int, ...]

    def bucket(self, request: InferRequest) -> int:
        """0 for lengths up to the first boundary, ..., len(boundaries) beyond the last."""
        return bisect.bisect_left(self.boundaries, self.source.length(request))


@dataclass(frozen=True, slots=True)
class Padding:
    inputs: tuple[str, ...]
    value: int | float
    mask: MaskSpec | None

    def apply(self, requests: list[InferRequest]) -> None:
        pad_requests(requests, self.inputs, self.value, self.mask)


@dataclass(frozen=True, slots=True)
class BatchingStrategy:
    bucketing: Bucketing | None
    padding: Padding | None
    #: Requests batch together only when this gives equal keys (Triton's equal-shape rule); None: always.
    shape_key: Callable[[InferRequest], object] | None


def _dims(tensor: model_config_pb2.ModelInput) -> list[int]:
    return list(tensor.reshape.shape) if tensor.HasField("reshape") else list(tensor.dims)


def _parameter(config: model_config_pb2.ModelConfig, key: str) -> str | None:
    return config.parameters[key].string_value.strip() if key in config.parameters else None


def batching_strategy(config: model_config_pb2.ModelConfig) -> BatchingStrategy:
    """The strategy a dynamic-batching config asks for; ServerError (INVALID_ARG) saying what is wrong."""
    name = config.name
    strategy = _parameter(config, "batching_strategy") or "default"
    if strategy not in ("default", "bucketed"):
        raise invalid_arg(f"model '{name}': batching_strategy must be 'bucketed' or 'default', got '{strategy}'")
    if config.max_batch_size <= 0 and (strategy == "bucketed" or _parameter(config, "pad_inputs")):
        raise invalid_arg(f"model '{name}': bucketed batching and pad_inputs need max_batch_size > 0")
    inputs = {tensor.name: tensor for tensor in config.input}
    source = _length_source(config, inputs) if strategy == "bucketed" or _parameter(config, "pad_inputs") else None
    bucketing = Bucketing(source, _boundaries(config)) if strategy == "bucketed" and source else None
    padding = _padding(config, inputs, source)
    shape_key = None if bucketing or padding else _shape_key(config)
    return BatchingStrategy(bucketing, padding, shape_key)


def _length_source(config: model_config_pb2.ModelConfig, inputs: dict) -> LengthSource:
    chosen = _parameter(config, "bucket_input")
    if chosen is None:
        chosen = next((n for n, t in inputs.items() if -1 in _dims(t)), None) or next(
            (n for n, t in inputs.items() if t.data_type == model_config_pb2.TYPE_STRING), None
        )
        if chosen is None:
            raise invalid_arg(f"model '{config.name}': bucketed batching needs an input with a -1 dimension or text")
    tensor = inputs.get(chosen)
    if tensor is None:
        raise invalid_arg(f"model '{config.name}': bucket_input '{chosen}' is not an input of the model")
    dims = _dims(tensor)
    if -1 in dims:
        return LengthSource(chosen, dims.index(-1) + 1)
    if tensor.data_type == model_config_pb2.TYPE_STRING:
        return LengthSource(chosen, None)
    raise invalid_arg(f"model '{config.name}': bucket_input '{chosen}' has no -1 dimension and is not TYPE_STRING")


def _boundaries(config: model_config_pb2.ModelConfig) -> tuple[int, ...]:
    text = _parameter(config, "bucket_boundaries")
    if text is None:
        return DEFAULT_BOUNDARIES
    try:
        boundaries = tuple(int(part) for part in text.split(","))
    except ValueError:
        boundaries = ()
    if not boundaries or boundaries[0] < 1 or boundaries != tuple(sorted(set(boundaries))):
        raise invalid_arg(
            f"model '{config.name}': bucket_boundaries must be increasing positive integers such as "
            f"'16,32,64', got '{text}'"
        )
    return boundaries


def _padding(config: model_config_pb2.ModelConfig, inputs: dict, source: LengthSource | None) -> Padding | None:
    enabled = (_parameter(config, "pad_inputs") or "false").lower()
    if enabled not in ("true", "false"):
        raise invalid_arg(f"model '{config.name}': pad_inputs must be 'true' or 'false', got '{enabled}'")
    if enabled == "false":
        return None
    mask_name = _parameter(config, "attention_mask_input")
    text = _parameter(config, "padding_value") or "0"
    try:
        value: int | float = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise invalid_arg(f"model '{config.name}': padding_value must be a number, got '{text}'") from None
    mask = None
    if mask_name:
        if source is None or source.axis is None:
            raise invalid_arg(f"model '{config.name}': attention_mask_input needs a numeric input with a -1 dimension")
        declared = inputs.get(mask_name)
        datatype = "INT64"
        if declared is not None:
            datatype = config_to_protocol(model_config_pb2.DataType.Name(declared.data_type))
        mask = MaskSpec(mask_name, datatype, source.name, source.axis)
    padded = tuple(
        n for n, t in inputs.items()
        if -1 in _dims(t) and t.data_type != model_config_pb2.TYPE_STRING and n != mask_name
    )
    return Padding(padded, value, mask)


def _shape_key(config: model_config_pb2.ModelConfig) -> Callable[[InferRequest], object] | None:
    """Triton's equal-inputs rule as a key function, or None when every request may join any batch."""
    ragged = {t.name for t in config.input if -1 not in _dims(t) or t.allow_ragged_batch}
    has_optional = any(t.optional for t in config.input)
    if len(ragged) == len(config.input) and not has_optional:
        return None

    def key(request: InferRequest) -> object:
        shapes = tuple(sorted((t.name, t.data.shape[1:]) for t in request.inputs if t.name not in ragged))
        if has_optional:
            return shapes, frozenset(t.name for t in request.inputs)
        return shapes

    return key
