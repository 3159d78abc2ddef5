"""The one request/response type shared by every frontend, the scheduler and every backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class Tensor:
    """A named tensor. `data` carries the shape; BYTES data is an object array of `bytes`."""

    name: str
    datatype: str
    data: np.ndarray
    parameters: dict[str, Any] = field(default_factory=dict)
    #: An output written into the client's shared memory region: the frontends send its shape, not its data.
    in_shared_memory: bool = False

    @property
    def shape(self) -> list[int]:
        return list(self.data.shape)


@dataclass(slots=True)
class RequestedOutput:
    """An output the client asked for, with its per-output parameters (e.g. `binary_data`)."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InferRequest:
    """An inference request as every frontend decodes it, before and after validation.

    `model_version` is "" when the client named no version (the version policy's latest).
    `outputs` is None when the client asked for all outputs.
    """

    model_name: str
    inputs: list[Tensor]
    model_version: str = ""
    id: str = ""
    outputs: list[RequestedOutput] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    #: Sequence id (`sequence_id`): 0 when the request belongs to no sequence.
    correlation_id: int | str = 0
    #: TRITONSERVER_REQUEST_FLAG_SEQUENCE_START (1) / _END (2), from `sequence_start` / `sequence_end`.
    flags: int = 0
    #: Scheduling priority (`priority`): 0 is the model's default level, 1 the highest.
    priority: int = 0
    #: Queue timeout in microseconds (`timeout`): 0 is the model's default.
    timeout_us: int = 0
    #: Monotonic nanoseconds at which the core accepted the request (set by the core).
    arrival_ns: int = 0
    #: Where a decoupled model sends its responses (set by the core; a `core.streams.ResponseStream`).
    response_stream: Any = None
    #: The request's trace when it is traced (a `core.tracing.RequestTrace`, set by the frontend that sampled it
    #: or by the ensemble step or BLS call that spawned it); None otherwise, the one thing an untraced request checks.
    trace: Any = None

    def batch_size(self, max_batch_size: int) -> int:
        """The request's own batch size: its first dimension for batching models, else 1."""
        if max_batch_size > 0 and self.inputs:
            return int(self.inputs[0].data.shape[0])
        return 1


@dataclass(slots=True)
class InferResponse:
    """A model's answer to one request."""

    model_name: str
    model_version: str
    outputs: list[Tensor]
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
