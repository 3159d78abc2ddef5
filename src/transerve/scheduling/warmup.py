"""`model_warmup`: sample requests every instance executes before the model is READY.

As in Triton, each sample runs on every instance directly (not through the scheduler, which would warm only
the instance a batch happened to reach): `batch_size` requests of batch 1 executed together, `count` times
(0 means once), the samples in config order. A sample that fails makes the load fail with Triton's wording.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2

from transerve.backends.base import BackendInstance
from transerve.core.datatypes import NUMPY_DTYPES, config_to_protocol, deserialize_bytes
from transerve.core.errors import ServerError, invalid_arg
from transerve.core.types import InferRequest, Tensor
from transerve.repository.paths import inside

#: The folder under the model's directory that holds `input_data_file`s (Triton's kWarmupDataFolder).
WARMUP_FOLDER = "warmup"


async def warm_up(
    model_name: str, config: model_config_pb2.ModelConfig, model_path: Path, instances: list[BackendInstance]
) -> None:
    """Run every warmup sample on every instance; raise ServerError (INVALID_ARG) at the first failure."""
    samples = [
        (setting.name, _requests(model_name, config, model_path, setting), max(int(setting.count), 1))
        for setting in config.model_warmup
        if setting.batch_size > 0
    ]
    if samples:
        await asyncio.gather(*(_run(instance, samples) for instance in instances))


async def _run(instance: BackendInstance, samples: list[tuple[str, list[InferRequest], int]]) -> None:
    for name, requests, count in samples:
        for _ in range(count):
            result = await instance.execute(requests)
            errors = [outcome.message for outcome in result.results if isinstance(outcome, ServerError)]
            if errors:
                raise invalid_arg(f"failed to run warmup sample '{name}': " + "".join(f"{e}; " for e in errors))


def _requests(
    model_name: str, config: model_config_pb2.ModelConfig, model_path: Path, setting: model_config_pb2.ModelWarmup
) -> list[InferRequest]:
    """`batch_size` requests sharing the sample's tensors; a batching model's inputs get a batch dimension of 1
    (inputs the config does not declare, such as sequence controls, keep the shape given)."""
    declared = {tensor.name for tensor in config.input}
    tensors = []
    for name, spec in sorted(setting.inputs.items()):
        dims = [int(d) for d in spec.dims]
        if any(d < 0 for d in dims):
            raise invalid_arg(f"warmup setting expects all variable-size dimensions are specified for input '{name}'")
        shape = [1, *dims] if config.max_batch_size > 0 and name in declared else dims
        if spec.data_type == model_config_pb2.TYPE_INVALID:
            raise invalid_arg(f"warmup setting expects input '{name}' to have data_type set")
        datatype = config_to_protocol(model_config_pb2.DataType.Name(spec.data_type))
        tensors.append(Tensor(name, datatype, _data(spec, datatype, shape, model_path, name)))
    return [
        InferRequest(model_name=model_name, inputs=list(tensors), id=f"warmup-{setting.name}")
        for _ in range(setting.batch_size)
    ]


def _data(
    spec: model_config_pb2.ModelWarmup.Input, datatype: str, shape: list[int], model_path: Path, name: str
) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    kind = spec.WhichOneof("input_data_type")
    if datatype == "BYTES":
        if kind == "input_data_file":
            values = deserialize_bytes(_read(model_path, spec.input_data_file), None)
            if values.size != count:
                raise invalid_arg(
                    f"warmup data file {spec.input_data_file} holds {values.size} strings, input '{name}' needs {count}"
                )
            return values.reshape(shape)
        if kind is None:
            raise invalid_arg(f"warmup setting expects input '{name}' to have input_data_type set")
        return np.full(shape, b"", dtype=np.object_)  # zero or random: empty strings, as in Triton
    dtype = NUMPY_DTYPES[datatype]
    nbytes = count * dtype.itemsize
    if kind == "zero_data":
        return np.zeros(shape, dtype)
    if kind == "random_data":
        if datatype == "BOOL":
            return np.random.default_rng().integers(0, 2, shape).astype(np.bool_)
        return np.random.default_rng().integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(shape)
    if kind == "input_data_file":
        raw = _read(model_path, spec.input_data_file)
        if len(raw) < nbytes:
            raise invalid_arg(
                f"warmup setting expects {nbytes} bytes, but the data provided from {spec.input_data_file} "
                f"only has {len(raw)} bytes"
            )
        return np.frombuffer(raw[:nbytes], dtype=dtype).reshape(shape).copy()
    raise invalid_arg(f"warmup setting expects input '{name}' to have input_data_type set")


def _read(model_path: Path, file_name: str) -> bytes:
    path = inside(model_path / WARMUP_FOLDER, model_path / WARMUP_FOLDER, file_name, "warmup input_data_file")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise invalid_arg(f"failed to read warmup data file {path}: {exc.strerror}") from None
