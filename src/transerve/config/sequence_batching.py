"""`sequence_batching` as Triton reads it: the defaults it fills, the checks it makes at load, and the
control tensors it declares.

Control inputs (START, END, READY, CORRID) are declared here, not under `input`: the sequence batcher
adds them to every request, so clients do not send them and model metadata does not list them. A config
that also lists one under `input` makes it a client input as well, which Triton then demands from clients
and overrides with the control value; the core and the batcher behave the same way.

Checks raise ValueError with Triton's wording; `model_config` turns them into ConfigError.
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2

from transerve.core.datatypes import config_to_protocol

#: Triton's default `max_sequence_idle_microseconds`.
DEFAULT_IDLE_US = 1_000_000

Control = model_config_pb2.ModelSequenceBatching.Control
_CORRID_TYPES = ("TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32", "TYPE_STRING")


@dataclass(frozen=True, slots=True)
class BooleanControl:
    """A START, END or READY input: its name, protocol datatype and the values meaning false and true."""

    name: str
    datatype: str
    false_value: int | float | bool
    true_value: int | float | bool


@dataclass(frozen=True, slots=True)
class SequenceControls:
    """The control inputs a model asked for; None (or "" for CORRID) where it asked for none."""

    start: BooleanControl | None
    end: BooleanControl | None
    ready: BooleanControl | None
    corrid_name: str
    #: Protocol datatype of CORRID (UINT64, INT64, UINT32, INT32 or BYTES).
    corrid_datatype: str

    @property
    def names(self) -> set[str]:
        booleans = {control.name for control in (self.start, self.end, self.ready) if control is not None}
        return booleans | ({self.corrid_name} if self.corrid_name else set())


def normalize_sequence_batching(config: model_config_pb2.ModelConfig) -> None:
    """Fill what Triton fills: the idle timeout, and oldest's preferred batch size (max_batch_size)."""
    batching = config.sequence_batching
    if batching.max_sequence_idle_microseconds == 0:
        batching.max_sequence_idle_microseconds = DEFAULT_IDLE_US
    if batching.HasField("oldest") and not batching.oldest.preferred_batch_size and config.max_batch_size > 0:
        batching.oldest.preferred_batch_size.append(config.max_batch_size)


def check_sequence_batching(config: model_config_pb2.ModelConfig) -> None:
    """Reject what Triton rejects at load, and what transerve does not implement."""
    batching, name = config.sequence_batching, config.name
    sequence_controls(config)
    if batching.HasField("oldest"):
        for size in batching.oldest.preferred_batch_size:
            if size <= 0:
                raise ValueError(f"sequence batching preferred batch size must be positive for {name}")
            if size > config.max_batch_size:
                raise ValueError(f"sequence batching preferred batch size must be <= max batch size for {name}")
    if batching.HasField("direct") and not 0.0 <= batching.direct.minimum_slot_utilization <= 1.0:
        raise ValueError(f"sequence batching minimum slot utilization must be in range (0.0, 1.0] for {name}")


def sequence_controls(config: model_config_pb2.ModelConfig) -> SequenceControls:
    """The control inputs of a config, checked as Triton checks them."""
    start, end, ready = (
        _boolean_control(config, kind)
        for kind in (Control.CONTROL_SEQUENCE_START, Control.CONTROL_SEQUENCE_END, Control.CONTROL_SEQUENCE_READY)
    )
    corrid = _find_control(config, Control.CONTROL_SEQUENCE_CORRID)
    if corrid is None:
        return SequenceControls(start, end, ready, "", "")
    tensor, control = corrid
    kind = Control.Kind.Name(control.kind)
    if control.int32_false_true or control.fp32_false_true or control.bool_false_true:
        raise ValueError(
            "sequence batching must not specify either 'int32_false_true', 'fp32_false_true' or "
            f"'bool_false_true' for {kind} for {config.name}"
        )
    type_name = model_config_pb2.DataType.Name(control.data_type)
    if type_name not in _CORRID_TYPES:
        raise ValueError(
            f"unexpected data type for control {kind} for {config.name}. Allowed data types are TYPE_UINT64, "
            "TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"
        )
    return SequenceControls(start, end, ready, tensor, config_to_protocol(type_name))


def _find_control(config: model_config_pb2.ModelConfig, kind: int) -> tuple[str, Control] | None:
    """The one (tensor name, control) of `kind`, after Triton's checks of names and duplicates."""
    found = None
    seen: set[str] = set()
    for control_input in config.sequence_batching.control_input:
        if not control_input.name:
            raise ValueError(f"sequence batching control tensor must have a name for {config.name}")
        if control_input.name in seen:
            raise ValueError(
                f"sequence batching control tensor '{control_input.name}' is specified for multiple control "
                f"kinds for {config.name}"
            )
        seen.add(control_input.name)
        for control in control_input.control:
            if control.kind != kind:
                continue
            if found is not None:
                raise ValueError(
                    f"sequence batching specifies multiple {Control.Kind.Name(kind)} tensors for {config.name}"
                )
            found = (control_input.name, control)
    return found


def _boolean_control(config: model_config_pb2.ModelConfig, kind: int) -> BooleanControl | None:
    found = _find_control(config, kind)
    if found is None:
        return None
    tensor, control = found
    where = f"{Control.Kind.Name(kind)} for {config.name}"
    given = [
        (field, datatype, list(values))
        for field, datatype, values in (
            ("int32_false_true", "INT32", control.int32_false_true),
            ("fp32_false_true", "FP32", control.fp32_false_true),
            ("bool_false_true", "BOOL", control.bool_false_true),
        )
        if values
    ]
    if not given:
        raise ValueError(
            f"sequence batching must specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' "
            f"for {where}"
        )
    if len(given) > 1:
        raise ValueError(
            "sequence batching specifies more than one from 'int32_false_true', 'fp32_false_true' and "
            f"'bool_false_true' for {where}"
        )
    field, datatype, values = given[0]
    if len(values) != 2:
        raise ValueError(f"sequence batching control '{field}' must have exactly 2 entries for {where}")
    return BooleanControl(tensor, datatype, values[0], values[1])
