"""What each request carries: the model's inputs (names, types and shapes from its metadata and config, variable
dimensions from `--shape`) filled with random data, zeros, or perf_analyzer's JSON data file.

The JSON file is perf_analyzer's: `{"data": [STEP, ...]}`, each STEP mapping input names to a flat or nested
list, to `{"content": LIST, "shape": [...]}`, or to `{"b64": "..."}` (raw little-endian bytes; for a BYTES input,
one string). Each step is one batch-1 request; a batch of b takes b consecutive steps.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from transerve.perf.options import PerfError

#: KServe datatypes and their NumPy types (BF16 is not generated: NumPy has none without ml_dtypes).
DTYPES: dict[str, Any] = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_,
}
#: Most elements one input of one step may have: a typo in --shape must not allocate gigabytes.
MAX_ELEMENTS = 64 * 1024 * 1024
MAX_DATA_FILE_BYTES = 512 * 1024 * 1024
STRING_LENGTH = 128
#: Random integers are drawn from 0..RANDOM_INTEGERS-1. perf_analyzer fills every integer input with random bytes
#: (one buffer for all of them), which as token ids lie outside any vocabulary and are refused; 0 and 1 are ids of
#: every embedding table, and valid attention masks and token types, so a model that embeds ids is measured
#: doing its work. Real ids come from --input-data FILE.json.
RANDOM_INTEGERS = 2


@dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str
    dims: list[int]  # without the batch dimension
    optional: bool


@dataclass(frozen=True)
class ModelSpec:
    inputs: list[InputSpec]
    outputs: list[str]
    max_batch_size: int


def model_spec(metadata: Mapping[str, Any], config: Mapping[str, Any]) -> ModelSpec:
    """Inputs and outputs from the metadata (over gRPC its integers are strings), batching and optionality from
    the config."""
    max_batch = int(config.get("max_batch_size", 0) or 0)
    optional = {entry.get("name") for entry in config.get("input", []) if entry.get("optional")}
    inputs = []
    for entry in metadata.get("inputs", []):
        shape = [int(dim) for dim in entry.get("shape", [])]
        dims = shape[1:] if max_batch > 0 else shape
        inputs.append(InputSpec(entry["name"], entry["datatype"], dims, entry["name"] in optional))
    outputs = [entry["name"] for entry in metadata.get("outputs", [])]
    return ModelSpec(inputs, outputs, max_batch)


def check_batch(spec: ModelSpec, batch_size: int) -> None:
    if spec.max_batch_size == 0 and batch_size > 1:
        raise PerfError(f"-b {batch_size}: the model does not batch (max_batch_size 0); use -b 1")
    if spec.max_batch_size and batch_size > spec.max_batch_size:
        raise PerfError(f"-b {batch_size} is above the model's max_batch_size {spec.max_batch_size}")


def _shape_of(spec: InputSpec, shapes: Mapping[str, list[int]]) -> list[int]:
    if spec.name in shapes:
        given = shapes[spec.name]
        if len(given) != len(spec.dims) or any(d >= 0 and d != g for d, g in zip(spec.dims, given, strict=True)):
            raise PerfError(f"--shape {spec.name}:{','.join(map(str, given))} does not fit the input's dims "
                            f"{spec.dims}")
        return given
    if any(dim < 0 for dim in spec.dims):
        raise PerfError(f"input '{spec.name}' has a variable shape {spec.dims}: give it with --shape "
                        f"{spec.name}:{','.join('N' if d < 0 else str(d) for d in spec.dims)}")
    return spec.dims


def _bounded(name: str, shape: list[int]) -> None:
    if int(np.prod(shape, dtype=np.int64)) > MAX_ELEMENTS:
        raise PerfError(f"input '{name}' of shape {shape} has more than {MAX_ELEMENTS} elements")


def _dtype(spec: InputSpec) -> Any:
    if spec.datatype not in DTYPES:
        raise PerfError(f"input '{spec.name}' has datatype {spec.datatype}, which transerve perf cannot generate")
    return DTYPES[spec.datatype]


def synthetic_step(spec: ModelSpec, shapes: Mapping[str, list[int]], kind: str, string_data: str | None,
                   string_length: int = STRING_LENGTH, seed: int = 0) -> dict[str, np.ndarray]:
    """One batch-1 step of random data or zeros, made once and reused by every request (as perf_analyzer does);
    optional inputs only when `--shape` names them."""
    generator = np.random.default_rng(seed)
    step = {}
    for entry in spec.inputs:
        if entry.optional and entry.name not in shapes:
            continue
        shape = _shape_of(entry, shapes)
        _bounded(entry.name, shape)
        dtype = _dtype(entry)
        if dtype is np.object_:
            text = (string_data if string_data is not None
                    else "" if kind == "zero" else "".join(generator.choice(list("abcdefghij"), string_length)))
            step[entry.name] = np.full(shape, text.encode(), dtype=np.object_)
        elif kind == "zero":
            step[entry.name] = np.zeros(shape, dtype)
        elif dtype is np.bool_:
            step[entry.name] = generator.integers(0, 2, shape).astype(np.bool_)
        elif np.issubdtype(dtype, np.integer):
            step[entry.name] = generator.integers(0, RANDOM_INTEGERS, shape).astype(dtype)
        else:
            step[entry.name] = generator.random(shape).astype(dtype)
    return step


def read_data_file(path: Path, spec: ModelSpec, shapes: Mapping[str, list[int]]) -> list[dict[str, np.ndarray]]:
    """perf_analyzer's JSON input data: its steps as arrays, checked against the model's inputs."""
    try:
        if path.stat().st_size > MAX_DATA_FILE_BYTES:
            raise PerfError(f"--input-data {path}: larger than {MAX_DATA_FILE_BYTES} bytes")
        document = json.loads(path.read_text())
    except OSError as exc:
        raise PerfError(f"--input-data {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise PerfError(f"--input-data {path}: not JSON ({exc})") from None
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list) or not data or not all(isinstance(step, dict) for step in data):
        raise PerfError(f'--input-data {path}: expected {{"data": [{{"INPUT": [...], ...}}, ...]}} with at least '
                        "one step")
    by_name = {entry.name: entry for entry in spec.inputs}
    steps = []
    for index, raw in enumerate(data):
        unknown = sorted(set(raw) - by_name.keys())
        if unknown:
            raise PerfError(f"--input-data {path}: step {index} names {unknown[0]!r}, which is not an input of the "
                            "model")
        missing = [entry.name for entry in spec.inputs if not entry.optional and entry.name not in raw]
        if missing:
            raise PerfError(f"--input-data {path}: step {index} lacks input '{missing[0]}'")
        steps.append({name: _step_tensor(by_name[name], value, shapes, f"--input-data {path}: step {index}")
                      for name, value in raw.items()})
    return steps


def _step_tensor(spec: InputSpec, value: Any, shapes: Mapping[str, list[int]], where: str) -> np.ndarray:
    dtype = _dtype(spec)
    shape = None
    if isinstance(value, dict) and "content" in value:
        shape, value = value.get("shape"), value["content"]
    try:
        if isinstance(value, dict) and "b64" in value:
            raw = base64.b64decode(value["b64"], validate=True)
            array = (np.array([raw], dtype=np.object_) if dtype is np.object_
                     else np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype))
        elif dtype is np.object_:
            array = np.vectorize(lambda item: str(item).encode(), otypes=[np.object_])(np.array(value, np.object_))
        else:
            array = np.array(value, dtype=dtype)
    except (ValueError, TypeError) as exc:
        raise PerfError(f"{where}, input '{spec.name}': {exc}") from None
    target = shape if shape is not None else shapes.get(spec.name)
    if target is None and all(dim >= 0 for dim in spec.dims):
        target = spec.dims
    if target is None:
        if array.ndim != len(spec.dims):
            raise PerfError(f"{where}, input '{spec.name}' has variable dims {spec.dims}: give its \"shape\" in the "
                            "file or --shape")
        target = list(array.shape)
    try:
        array = array.reshape([int(dim) for dim in target])
    except (ValueError, TypeError):
        raise PerfError(f"{where}, input '{spec.name}': {array.size} values do not fill shape {target}") from None
    if array.ndim != len(spec.dims) or any(d >= 0 and d != g for d, g in zip(spec.dims, array.shape, strict=True)):
        raise PerfError(f"{where}, input '{spec.name}': shape {list(array.shape)} does not fit dims {spec.dims}")
    _bounded(spec.name, list(array.shape))
    return array


def batches(steps: list[dict[str, np.ndarray]], spec: ModelSpec,
            batch_size: int) -> list[dict[str, tuple[str, np.ndarray]]]:
    """Requests from steps: for a batching model, b consecutive steps stacked (wrapping around), one request per
    step; for a model that does not batch, each step as it is."""
    types = {entry.name: entry.datatype for entry in spec.inputs}
    requests = []
    for first in range(len(steps)):
        if spec.max_batch_size == 0:
            requests.append({name: (types[name], array) for name, array in steps[first].items()})
            continue
        group = [steps[(first + offset) % len(steps)] for offset in range(batch_size)]
        names = group[0].keys()
        if any(member.keys() != names for member in group):
            raise PerfError("-b: steps batched together must name the same inputs")
        try:
            requests.append({name: (types[name], np.stack([member[name] for member in group])) for name in names})
        except ValueError:
            raise PerfError("-b: steps batched together must have the same shapes") from None
    return requests
