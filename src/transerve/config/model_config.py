"""Parse, normalise and validate `config.pbtxt` as Triton's `ModelConfig` protobuf.

The schema is Triton's own, from the generated `model_config_pb2` that tritonclient ships,
so every field Triton accepts parses here, and the JSON we print is shaped like Triton's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from google.protobuf import descriptor, json_format, text_format
from tritonclient.grpc import model_config_pb2

from transerve.config.devices import visible_gpus
from transerve.config.sequence_batching import check_sequence_batching, normalize_sequence_batching
from transerve.core.datatypes import NUMPY_DTYPES, config_to_protocol

ModelConfig = model_config_pb2.ModelConfig

#: The file each backend loads when the config names none.
DEFAULT_MODEL_FILENAMES = {
    "python": "model.py",
    "onnxruntime": "model.onnx",
    "pytorch": "model.pt",
    "tensorrt": "model.plan",
    # A folder: the CTranslate2 model or Hugging Face checkpoint (the `model_dir` parameter names another).
    "generation": "model",
}

#: Triton's platform names and the backend that serves each.
PLATFORM_BACKENDS = {
    "onnxruntime_onnx": "onnxruntime",
    "pytorch_libtorch": "pytorch",
    "tensorrt_plan": "tensorrt",
    "ensemble": "ensemble",
}

#: The backends whose platform a model file implies, and that platform.
_FILE_PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "pytorch": "pytorch_libtorch", "tensorrt": "tensorrt_plan"}
#: The backends a model file reveals, in the order Triton looks for their files.
_DETECTED = ("tensorrt", "onnxruntime", "pytorch", "python")


#: `--model-config-max-bytes`: the longest config a load request or a `config.pbtxt` may hold. Real configs are a
#: few KB (an ensemble of 1024 steps, the most allowed, some hundreds); protobuf's pure-Python parsers take seconds
#: on megabytes.
MAX_CONFIG_BYTES = 1 << 20


class ConfigError(ValueError):
    """The configuration cannot be served; the message says why in one line."""


def parse_config_text(text: str, source: str = "config.pbtxt") -> ModelConfig:
    """Parse protobuf text format into a ModelConfig, with the parser's position in the error."""
    config = ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ConfigError(f"failed to parse {source}: {exc}") from None
    return config


def parse_config_json(text: str | bytes, max_bytes: int | None = None) -> ModelConfig:
    """Parse a JSON ModelConfig, as sent in a load request's `config` parameter (with `max_bytes`, refused past
    that length before it is parsed)."""
    if max_bytes is not None and len(text) > max_bytes:
        raise ConfigError(f"the 'config' parameter is {len(text)} bytes long, more than the {max_bytes} allowed "
                          "(--model-config-max-bytes)")
    config = ModelConfig()
    try:
        json_format.Parse(text, config)
    except (json_format.ParseError, ValueError) as exc:
        raise ConfigError(f"failed to parse the JSON model config: {exc}") from None
    return config


def load_config_file(model_path: Path, max_bytes: int = MAX_CONFIG_BYTES) -> ModelConfig:
    """Read `<model_path>/config.pbtxt`; a missing file gives an empty config for auto-completion. A file longer
    than `max_bytes` is refused unread: parsing it would take seconds."""
    path = model_path / "config.pbtxt"
    if not path.is_file():
        return ModelConfig()
    try:
        with path.open("rb") as file:
            data = file.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise ConfigError(f"{path} is more than {max_bytes} bytes long, the limit (--model-config-max-bytes)")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    return parse_config_text(text, str(path))


def backend_name(config: ModelConfig) -> str:
    """The backend that serves this config: `backend`, else the one `platform` implies."""
    if config.backend:
        return config.backend
    if config.platform in PLATFORM_BACKENDS:
        return PLATFORM_BACKENDS[config.platform]
    return config.platform


def complete_backend_fields(config: ModelConfig, model_path: Path) -> None:
    """Fill `backend` and `platform` as Triton does for its file-based backends: each from the other, or, when
    the config names neither, from its `default_model_filename` or else from the model file found in a version
    folder (`model.plan`, `model.onnx`, `model.pt`, `model.py`, looked for in Triton's order), so that a model
    folder without config.pbtxt can be served. The python backend has no platform."""
    if not config.backend and not config.platform:
        found = _backend_of_file(config.default_model_filename, model_path)
        if found in _FILE_PLATFORMS:
            config.platform = _FILE_PLATFORMS[found]
        elif found is not None:
            config.backend = found
    if not config.backend and config.platform in _FILE_PLATFORMS.values():
        config.backend = PLATFORM_BACKENDS[config.platform]
    elif not config.platform and config.backend in _FILE_PLATFORMS:
        config.platform = _FILE_PLATFORMS[config.backend]


def _backend_of_file(filename: str, model_path: Path) -> str | None:
    if filename:
        return next((backend for backend in _DETECTED if DEFAULT_MODEL_FILENAMES[backend] == filename), None)
    versions = [entry for entry in _folders(model_path) if entry.name.isdigit()]
    return next((backend for backend in _DETECTED
                 if any((version / DEFAULT_MODEL_FILENAMES[backend]).exists() for version in versions)), None)


def _folders(path: Path) -> list[Path]:
    try:
        return [entry for entry in path.iterdir() if entry.is_dir()]
    except OSError:
        return []


def normalize(config: ModelConfig, model_name: str) -> None:
    """Fill the defaults Triton fills, in place, so our config JSON matches Triton's."""
    if not config.name:
        config.name = model_name
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    backend = backend_name(config)
    if not config.default_model_filename and backend in DEFAULT_MODEL_FILENAMES:
        config.default_model_filename = DEFAULT_MODEL_FILENAMES[backend]
    if backend == "ensemble":
        config.model_transaction_policy.SetInParent()  # Triton prints it for ensembles
        return
    if not config.HasField("optimization"):
        config.optimization.input_pinned_memory.enable = True
        config.optimization.output_pinned_memory.enable = True
    batching = config.dynamic_batching if config.HasField("dynamic_batching") else None
    if batching is not None and not batching.preferred_batch_size and config.max_batch_size > 0:
        batching.preferred_batch_size.append(config.max_batch_size)  # as Triton fills it
    if config.HasField("sequence_batching"):
        normalize_sequence_batching(config)
    if not config.instance_group:
        group = config.instance_group.add()
        group.name = config.name
    gpus = visible_gpus()
    kinds = model_config_pb2.ModelInstanceGroup
    for index, group in enumerate(config.instance_group):
        if not group.name:
            group.name = f"{config.name}_{index}"
        if group.count < 1:
            group.count = 1
        if group.kind == kinds.KIND_AUTO:
            # Triton: GPU when GPUs exist and every listed one is among them, else CPU.
            on_gpu = bool(gpus) and all(gpu in gpus for gpu in group.gpus)
            group.kind = kinds.KIND_GPU if on_gpu else kinds.KIND_CPU
        if group.kind == kinds.KIND_GPU and not group.gpus:
            group.gpus.extend(gpus)


def validate(config: ModelConfig, model_name: str, partial_io: bool = False) -> None:
    """Reject what Triton rejects at load time, with a one-line reason.

    `partial_io`: inputs and outputs may lack their data type, for a backend's auto-complete to fill in
    (the completed config is validated again).
    """
    if config.name != model_name:
        raise ConfigError(
            f"unexpected model name '{config.name}' in config.pbtxt: it must match the folder name '{model_name}'"
        )
    if not backend_name(config):
        raise ConfigError(f"model '{model_name}' names neither a backend nor a platform")
    if config.max_batch_size < 0:
        raise ConfigError(f"model '{model_name}': max_batch_size must be >= 0, got {config.max_batch_size}")
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen: set[str] = set()
        for tensor in tensors:
            where = f"model '{model_name}', {kind} '{tensor.name}'"
            if not tensor.name:
                raise ConfigError(f"model '{model_name}': an {kind} has no name")
            if tensor.name in seen:
                raise ConfigError(f"{where} is declared twice")
            seen.add(tensor.name)
            type_name = model_config_pb2.DataType.Name(tensor.data_type)
            if tensor.data_type == model_config_pb2.TYPE_INVALID:
                if partial_io:
                    continue
                raise ConfigError(f"{where} has no data_type")
            if config_to_protocol(type_name) not in NUMPY_DTYPES:
                raise ConfigError(f"{where} has unsupported data_type {type_name}")
            for dim in tensor.dims:
                if dim < -1:
                    raise ConfigError(f"{where} has invalid dimension {dim} in dims {list(tensor.dims)}")
            if tensor.HasField("reshape"):
                _check_reshape(where, list(tensor.dims), list(tensor.reshape.shape))
    if config.HasField("dynamic_batching"):
        _check_dynamic_batching(config)
    if config.HasField("sequence_batching"):
        try:
            check_sequence_batching(config)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    for group in config.instance_group:
        _check_instance_group(config.name, group)


def _check_dynamic_batching(config: ModelConfig) -> None:
    """Triton's checks of `dynamic_batching`, with its wording."""
    batching, name = config.dynamic_batching, config.name
    for size in batching.preferred_batch_size:
        if size <= 0:
            raise ConfigError(f"dynamic batching preferred size must be positive for {name}")
        if size > config.max_batch_size:
            raise ConfigError(f"dynamic batching preferred size must be <= max batch size for {name}")
    levels = batching.priority_levels
    if levels:
        if not 1 <= batching.default_priority_level <= levels:
            raise ConfigError(f"default priority level must be in range [1, {levels}] for {name}")
        for level in batching.priority_queue_policy:
            if not 1 <= level <= levels:
                raise ConfigError(f"priority queue policy must have priority level in range [1, {levels}] for {name}")
    if batching.preserve_ordering:
        if levels > 1:
            raise ConfigError(f"Only one priority level is allowed when 'preserve_ordering' is true for {name}")
        delay = model_config_pb2.ModelQueuePolicy.DELAY
        for policy in [batching.default_queue_policy, *batching.priority_queue_policy.values()]:
            if policy.default_timeout_microseconds and policy.timeout_action == delay:
                raise ConfigError(
                    f"Queue policy can not have DELAY as timeout action when 'preserve_ordering' is true for {name}"
                )


def _check_instance_group(model_name: str, group: model_config_pb2.ModelInstanceGroup) -> None:
    """Triton's placement checks: GPUs only for KIND_GPU, and only GPUs that exist."""
    where = f"instance group {group.name} of model {model_name}"
    kind = model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind)
    if group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU:
        gpus = visible_gpus()
        if not group.gpus:
            raise ConfigError(f"{where} has kind KIND_GPU but no GPUs are available")
        for gpu in group.gpus:
            if gpu not in gpus:
                listed = ", ".join(str(g) for g in gpus)
                raise ConfigError(f"{where} specifies invalid or unsupported gpu id {gpu}. Visible GPUs are: {listed}")
    elif group.gpus:
        raise ConfigError(f"{where} has kind {kind} but specifies one or more GPUs")


def _check_reshape(where: str, dims: list[int], reshape: list[int]) -> None:
    if -1 in dims or -1 in reshape:
        if dims.count(-1) != reshape.count(-1):
            raise ConfigError(f"{where}: reshape {reshape} and dims {dims} differ in variable dimensions")
        return
    product = 1
    for dim in dims:
        product *= dim
    reshaped = 1
    for dim in reshape:
        reshaped *= dim
    if product != reshaped:
        raise ConfigError(f"{where}: reshape {reshape} has a different element count than dims {dims}")


def to_json_dict(config: ModelConfig) -> dict[str, Any]:
    """The config as Triton prints it: every scalar and list shown, int64 as numbers."""
    data = json_format.MessageToDict(
        config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _int64_to_int(config.DESCRIPTOR, data)
    order = [field.name for field in config.DESCRIPTOR.fields]
    return {name: data[name] for name in order if name in data}


def to_json(config: ModelConfig) -> str:
    """The JSON string the python backend passes to `initialize` as `args['model_config']`."""
    return json.dumps(to_json_dict(config))


_INT64_TYPES = {
    descriptor.FieldDescriptor.TYPE_INT64,
    descriptor.FieldDescriptor.TYPE_UINT64,
    descriptor.FieldDescriptor.TYPE_SINT64,
    descriptor.FieldDescriptor.TYPE_FIXED64,
    descriptor.FieldDescriptor.TYPE_SFIXED64,
}


def _int64_to_int(message_descriptor: descriptor.Descriptor, data: dict[str, Any]) -> None:
    """protobuf's JSON writes 64-bit integers as strings; Triton writes numbers."""
    for field in message_descriptor.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            for key, item in value.items():
                if value_field.message_type is not None:
                    _int64_to_int(value_field.message_type, item)
                elif value_field.type in _INT64_TYPES:
                    value[key] = int(item)
        elif field.message_type is not None:
            for item in value if isinstance(value, list) else [value]:
                _int64_to_int(field.message_type, item)
        elif field.type in _INT64_TYPES:
            data[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
