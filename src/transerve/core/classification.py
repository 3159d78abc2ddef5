"""Triton's classification extension: an output requested with `classification: k` comes back as its top k
entries, each a string "value:index" or "value:index:label", in place of the tensor.

The rules are Triton 2.51's, as its server answers (tests/e2e/test_classification.py compares the two):
- a batching model ranks each batch item's values (all of the item's dimensions flattened), giving [batch, k];
  a model without batching ranks the whole tensor flattened, giving [k]; k larger than the values counts them all;
- higher values first, equal values by lower index; values printed as C's "%f" (floats) or as integers;
- a label is the line of the output's `label_filename` (read once, when the model loads) at the value's index,
  left out where the file has no such line or the line is empty;
- `classification: 0` asks for the tensor itself; BOOL, FP16, BF16 and BYTES outputs cannot be classified.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2

from transerve.core.errors import invalid_arg
from transerve.core.types import InferRequest, InferResponse, Tensor
from transerve.repository.paths import inside

#: The request output parameter that asks for classification.
PARAMETER = "classification"

#: Datatypes whose values can be ranked and printed.
CLASSIFIABLE = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64"})


def load_labels(model_path: Path, config: model_config_pb2.ModelConfig) -> dict[str, list[str]]:
    """Each output's labels (the lines of its `label_filename`, relative to the model's folder); a file that
    cannot be read fails the model's load, as in Triton."""
    labels = {}
    for output in config.output:
        if not output.label_filename:
            continue
        path = inside(model_path, model_path, output.label_filename, f"output '{output.name}' label_filename")
        try:
            labels[output.name] = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise invalid_arg(f"failed to open text file for read {path}: {reason}") from None
    return labels


def class_count(request: InferRequest) -> dict[str, int]:
    """The outputs `request` wants classified, with their k (0s left out: they ask for the tensor)."""
    if request.outputs is None:
        return {}
    return {
        output.name: output.parameters[PARAMETER]
        for output in request.outputs
        if output.parameters.get(PARAMETER)
    }


def check_classifiable(datatype: str) -> None:
    """Refuse classification of an output whose values cannot be ranked (checked before the model runs)."""
    if datatype not in CLASSIFIABLE:
        raise invalid_arg(f"class result not available for output due to unsupported type '{datatype}'")


def classify_response(
    response: InferResponse, counts: Mapping[str, int], labels: Mapping[str, list[str]], batching: bool
) -> InferResponse:
    """`response` with each output named in `counts` replaced by its top-k strings."""
    response.outputs = [
        classify(tensor, counts[tensor.name], labels.get(tensor.name, ()), batching) if tensor.name in counts
        else tensor
        for tensor in response.outputs
    ]
    return response


def classify(tensor: Tensor, k: int, labels: list[str] | tuple[()], batching: bool) -> Tensor:
    """The top `k` entries of `tensor` as a BYTES tensor: per batch item when `batching`, else of all of it."""
    check_classifiable(tensor.datatype)
    data = tensor.data
    rows = data.reshape(data.shape[0], -1) if batching else data.reshape(1, -1)
    count = min(k, rows.shape[1])
    # Descending and stable (ties by lower index): a stable ascending sort of keys that reverse the order
    # exactly; `~` does so for integers of any width without overflow, negation for floats.
    keys = -rows if rows.dtype.kind == "f" else ~rows
    order = np.argsort(keys, axis=1, kind="stable")[:, :count]
    floats = rows.dtype.kind == "f"
    entries = np.empty((rows.shape[0], count), dtype=np.object_)
    for row, indices in enumerate(order):
        for column, index in enumerate(indices.tolist()):
            value = rows[row, index]
            text = f"{float(value):f}:{index}" if floats else f"{int(value)}:{index}"
            label = labels[index] if index < len(labels) else ""
            entries[row, column] = (f"{text}:{label}" if label else text).encode()
    shaped = entries if batching else entries.reshape(count)
    return Tensor(tensor.name, "BYTES", shaped)
