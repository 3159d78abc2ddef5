"""LightSeq's exported model files read into one form: flat float32 arrays by LightSeq's path
(`src_embedding/token_embedding`, `encoder_stack/0/ffn_first_kernel`, ...) and the `model_conf` values.

LightSeq writes a model as protobuf (`.pb`, the messages of `schema.py`) or, for larger ones, as HDF5 (`.hdf5`,
the same names as dataset paths, `model_conf/n_encoder_stack` and `n_decoder_stack` added, strings as int8 arrays).
Its loaders pick the format by file extension; so does `read`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from transerve.backends.lightseq.schema import MODEL_TYPES, message_class
from transerve.core.extras import MissingExtra, import_optional

STACKS = ("encoder_stack", "decoder_stack")


class FormatError(ValueError):
    """The file is not a LightSeq model of the expected type (what is wrong is in the message)."""


@dataclass(slots=True)
class LightSeqWeights:
    model_type: str
    #: Flat float32 arrays by LightSeq's path.
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    #: `model_conf` values by name (proto3 defaults where the file leaves one out).
    conf: dict[str, Any] = field(default_factory=dict)
    #: Layers per stack ("encoder_stack", "decoder_stack").
    layers: dict[str, int] = field(default_factory=dict)

    def array(self, path: str, *shape: int) -> np.ndarray:
        """The array at `path` in `shape`, or FormatError naming the path and both sizes."""
        value = self.arrays.get(path)
        if value is None:
            raise FormatError(f"the {self.model_type} model file has no '{path}'")
        if value.size != int(np.prod(shape)):
            raise FormatError(f"'{path}' holds {value.size} values, expected {'x'.join(map(str, shape))}")
        return value.reshape(shape)


def read(path: Path, model_type: str) -> LightSeqWeights:
    """The model file at `path` (`.hdf5`/`.h5`: HDF5; anything else: protobuf), or FormatError."""
    if model_type not in MODEL_TYPES:
        raise FormatError(f"model_type '{model_type}' is not one of {', '.join(MODEL_TYPES)}")
    if path.suffix.lower() in (".hdf5", ".h5"):
        return _read_hdf5(path, model_type)
    return _read_proto(path.read_bytes(), model_type)


def _read_proto(data: bytes, model_type: str) -> LightSeqWeights:
    from google.protobuf.message import DecodeError

    message = message_class(model_type)()
    try:
        message.ParseFromString(data)
    except DecodeError as exc:
        raise FormatError(f"not a LightSeq {model_type} protobuf file: {exc}") from None
    weights = LightSeqWeights(model_type)
    for descriptor, value in message.ListFields():
        if descriptor.name == "model_conf":
            continue
        if descriptor.name in STACKS:
            weights.layers[descriptor.name] = len(value)
            for index, layer in enumerate(value):
                _take_floats(weights, f"{descriptor.name}/{index}", layer)
        else:
            _take_floats(weights, descriptor.name, value)
    conf = message.model_conf
    weights.conf = {name.name: getattr(conf, name.name) for name in conf.DESCRIPTOR.fields}
    for stack in STACKS:
        if stack in message.DESCRIPTOR.fields_by_name:
            weights.layers.setdefault(stack, 0)
    return weights


def _take_floats(weights: LightSeqWeights, prefix: str, layer: Any) -> None:
    for descriptor, value in layer.ListFields():
        weights.arrays[f"{prefix}/{descriptor.name}"] = np.asarray(value, dtype=np.float32)


def _read_hdf5(path: Path, model_type: str) -> LightSeqWeights:
    try:
        h5py = import_optional("h5py", "lightseq")
    except MissingExtra as exc:
        raise FormatError(f"reading LightSeq's HDF5 files: {exc}") from None
    weights = LightSeqWeights(model_type)
    try:
        with h5py.File(path, "r") as file:
            def visit(name: str, node: Any) -> None:
                if isinstance(node, h5py.Dataset):
                    _take_dataset(weights, name, node[()])
            file.visititems(visit)
    except OSError as exc:
        raise FormatError(f"not an HDF5 file: {exc}") from None
    for stack in STACKS:
        count = weights.conf.pop(f"n_{stack}", None)
        if count is not None:
            weights.layers[stack] = int(count)
    defaults = message_class(model_type)().model_conf
    for descriptor in defaults.DESCRIPTOR.fields:
        weights.conf.setdefault(descriptor.name, getattr(defaults, descriptor.name))
    return weights


def _take_dataset(weights: LightSeqWeights, name: str, value: Any) -> None:
    if name.startswith("model_conf/"):
        key = name.removeprefix("model_conf/")
        if key == "sampling_method":  # an array of character codes
            weights.conf[key] = "".join(chr(int(code)) for code in np.ravel(value))
        else:
            weights.conf[key] = np.asarray(value).item() if np.ndim(value) == 0 or np.size(value) == 1 else value
        return
    weights.arrays[name] = np.asarray(value, dtype=np.float32).ravel()
