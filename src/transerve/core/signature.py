"""A model's inputs and outputs as clients see them, and the one place requests are checked against them."""

from __future__ import annotations

from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2

from transerve.core.classification import PARAMETER as CLASSIFICATION
from transerve.core.classification import check_classifiable
from transerve.core.datatypes import config_to_protocol
from transerve.core.errors import invalid_arg
from transerve.core.types import InferRequest

_BATCH_NOTE = (
    " NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be prepended to "
    "each input shape. If you want to specify the full shape including the batch dim in your input dims config, "
    "try setting max_batch_size to zero. See the model configuration docs for more info on max_batch_size."
)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One configured input or output."""

    name: str
    datatype: str
    #: `dims` from the config (no batch dimension).
    dims: tuple[int, ...]
    #: The shape clients see: dims with a leading -1 when the model batches.
    shape: tuple[int, ...]
    optional: bool
    #: The shape the model works with instead of `dims`, if the config reshapes.
    reshape: tuple[int, ...] | None


def _spec(tensor: model_config_pb2.ModelInput | model_config_pb2.ModelOutput, batching: bool) -> TensorSpec:
    dims = tuple(int(d) for d in tensor.dims)
    reshape = tuple(int(d) for d in tensor.reshape.shape) if tensor.HasField("reshape") else None
    return TensorSpec(
        name=tensor.name,
        datatype=config_to_protocol(model_config_pb2.DataType.Name(tensor.data_type)),
        dims=dims,
        shape=((-1,) + dims) if batching else dims,
        optional=bool(getattr(tensor, "optional", False)),
        reshape=reshape,
    )


def _matches(expected: tuple[int, ...], got: tuple[int, ...]) -> bool:
    return len(expected) == len(got) and all(e == -1 or e == g for e, g in zip(expected, got, strict=True))


def _names_text(names: list[str]) -> str:
    return "[" + ",".join(f"'{name}'" for name in names) + "]"


def _shape_text(shape: tuple[int, ...] | list[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


class ModelSignature:
    """Inputs, outputs and batching of one model version, precomputed once at load."""

    def __init__(self, model_name: str, config: model_config_pb2.ModelConfig) -> None:
        self.model_name = model_name
        self.max_batch_size = int(config.max_batch_size)
        batching = self.max_batch_size > 0
        self.inputs = {t.name: _spec(t, batching) for t in config.input}
        self.outputs = {t.name: _spec(t, batching) for t in config.output}
        self.required = [name for name, spec in self.inputs.items() if not spec.optional]
        self._required_set = frozenset(self.required)
        self._reshaped_inputs = any(spec.reshape is not None for spec in self.inputs.values())

    def validate(self, request: InferRequest) -> None:
        """Check a request against the model, with Triton's wording; reshape inputs the config reshapes."""
        if not self._plainly_valid(request):
            self._check(request)
        if self._reshaped_inputs:
            self._apply_reshape(request)

    def _plainly_valid(self, request: InferRequest) -> bool:
        """One quick pass that accepts what `_check` would (every request, on the hot path); anything else
        goes to `_check`, which finds the first problem and words it as Triton does."""
        specs = self.inputs
        inputs = request.inputs
        if len(inputs) > len(specs):
            return False
        max_batch_size = self.max_batch_size
        batch_size = -1
        names = set()
        for tensor in inputs:
            spec = specs.get(tensor.name)
            if spec is None or tensor.datatype != spec.datatype:
                return False
            shape = tensor.data.shape
            expected = spec.shape
            if len(shape) != len(expected):
                return False
            for want, got in zip(expected, shape, strict=True):
                if want != got and want != -1:
                    return False
            if max_batch_size > 0:
                if batch_size < 0:
                    batch_size = shape[0]
                    if batch_size > max_batch_size:
                        return False
                elif shape[0] != batch_size:
                    return False
            names.add(tensor.name)
        if len(names) != len(inputs) or not self._required_set <= names:
            return False
        if request.outputs is not None:
            for output in request.outputs:
                if output.name not in self.outputs or output.parameters.get(CLASSIFICATION):
                    return False
        return True

    def _check(self, request: InferRequest) -> None:
        prefix = f"[request id: {request.id or '<id_unknown>'}] "
        names = [tensor.name for tensor in request.inputs]
        if len(set(names)) != len(names):
            duplicate = next(name for name in names if names.count(name) > 1)
            raise invalid_arg(f"{prefix}input '{duplicate}' already exists in request")
        missing = [name for name in self.required if name not in names]
        if missing or len(names) > len(self.inputs):
            if len(self.required) == len(self.inputs):
                counted = f"expected {len(self.inputs)} inputs"
            else:  # Triton's words when the model has optional inputs
                counted = f"expected number of inputs between {len(self.required)} and {len(self.inputs)}"
            raise invalid_arg(
                f"{prefix}{counted} but got {len(names)} inputs for model "
                f"'{self.model_name}'. Got input(s) {_names_text(names)}, but missing required input(s) "
                f"{_names_text(missing)}. "
                "Please provide all required input(s)."
            )
        batch_size = None
        for tensor in request.inputs:
            spec = self.inputs.get(tensor.name)
            if spec is None:
                raise invalid_arg(f"{prefix}unexpected inference input '{tensor.name}' for model '{self.model_name}'")
            if tensor.datatype != spec.datatype:
                raise invalid_arg(
                    f"{prefix}inference input '{tensor.name}' data-type is '{tensor.datatype}', but model "
                    f"'{self.model_name}' expects '{spec.datatype}'"
                )
            shape = tensor.data.shape
            if not _matches(spec.shape, shape):
                note = _BATCH_NOTE if self.max_batch_size > 0 else ""
                raise invalid_arg(
                    f"{prefix}unexpected shape for input '{tensor.name}' for model '{self.model_name}'. "
                    f"Expected {_shape_text(spec.shape)}, got {_shape_text(shape)}.{note}"
                )
            if self.max_batch_size > 0:
                if batch_size is None:
                    batch_size = shape[0]
                    if batch_size > self.max_batch_size:
                        raise invalid_arg(
                            f"{prefix}inference request batch-size must be <= {self.max_batch_size} for "
                            f"'{self.model_name}'"
                        )
                elif shape[0] != batch_size:
                    raise invalid_arg(
                        f"{prefix}input '{tensor.name}' batch size does not match other inputs for "
                        f"'{self.model_name}'"
                    )
        if request.outputs is not None:
            for output in request.outputs:
                if output.name not in self.outputs:
                    raise invalid_arg(f"unexpected inference output '{output.name}' for model '{self.model_name}'")
                if output.parameters.get(CLASSIFICATION):
                    check_classifiable(self.outputs[output.name].datatype)

    def _apply_reshape(self, request: InferRequest) -> None:
        for tensor in request.inputs:
            spec = self.inputs[tensor.name]
            if spec.reshape is None:
                continue
            lead = tensor.data.shape[:1] if self.max_batch_size > 0 else ()
            try:
                tensor.data = tensor.data.reshape(lead + tuple(d if d != -1 else -1 for d in spec.reshape))
            except ValueError:
                raise invalid_arg(
                    f"input '{tensor.name}' of shape {list(tensor.data.shape)} cannot be reshaped to "
                    f"{list(spec.reshape)} for model '{self.model_name}'"
                ) from None

    def metadata_tensors(self, kind: str) -> list[dict]:
        specs = self.inputs if kind == "inputs" else self.outputs
        return [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in specs.values()]
