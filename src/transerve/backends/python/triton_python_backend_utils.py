"""The `triton_python_backend_utils` module that Triton python-backend models import as `pb_utils`.

Real Triton injects Tensor, InferenceRequest, InferenceResponse, TritonError and Logger from C++
into this module; here they are plain Python classes with the same constructors, methods and
errors, so an unmodified `model.py` runs in our worker. The worker installs this module as
`sys.modules["triton_python_backend_utils"]` before it imports the model.

Decoupled responses and BLS requests travel over the worker's channel to the server (`_pb_utils/link.py`,
whose `_channel` the worker sets): a response sender sends each response as it is produced, and a BLS request is
run by the server's core, in-process there, its answers coming back as responses (errors included,
never raised, as in Triton).

This module is one import for models and re-exports the parts in `_pb_utils/`: errors, tensors, requests,
responses, BLS answers, logger, metrics, config, and the worker's link to the server (its model control calls).
"""

# ruff: noqa: F401  (this module re-exports the parts)

import json  # Triton's module imports json and numpy as np, so `from ... import *` gives them too

import numpy as np

from transerve.backends.python._pb_utils.bls import (
    ResponseIterator,
)
from transerve.backends.python._pb_utils.config import (
    ModelConfig,
    get_input_config_by_name,
    get_output_config_by_name,
    numpy_to_triton_type,
    triton_string_to_numpy,
    triton_to_numpy_type,
    using_decoupled_model_transaction_policy,
)
from transerve.backends.python._pb_utils.errors import (
    TritonError,
    TritonModelException,
)
from transerve.backends.python._pb_utils.link import (
    get_model_dir,
    is_model_ready,
    load_model,
    unload_model,
)
from transerve.backends.python._pb_utils.logger import (
    Logger,
    LogLevel,
)
from transerve.backends.python._pb_utils.metrics import (
    COUNTER,
    GAUGE,
    HISTOGRAM,
    Metric,
    MetricFamily,
    MetricKind,
)
from transerve.backends.python._pb_utils.requests import (
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_END,
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
    TRITONSERVER_REQUEST_RELEASE_ALL,
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
    InferenceRequest,
    InferenceTrace,
    get_input_tensor_by_name,
)
from transerve.backends.python._pb_utils.responses import (
    TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    InferenceResponse,
    InferenceResponseSender,
    get_output_tensor_by_name,
)
from transerve.backends.python._pb_utils.tensors import (
    Tensor,
    deserialize_bytes_tensor,
    serialize_byte_tensor,
)
