"""Ids that index an embedding table, checked per request before the engine gathers with them.

onnxruntime fails a whole run on one id past a table's end (`indices element out of data bounds`, a 500 for
every request batched with it), torch raises `index out of range in self`; both are a client's bad input. A
backend finds at load which inputs feed a table's rows straight from the request (`IndexBound`), and its
instances refuse a request holding an id outside `0..rows-1` with a 400 naming the input and the range, alone,
before its batch is merged (`ThreadedInstance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from transerve.core.errors import ServerError, invalid_arg
from transerve.core.types import InferRequest


@dataclass(frozen=True, slots=True)
class IndexBound:
    """A request input whose values are row indices of an embedding table of `rows` rows."""

    input: str
    rows: int
    #: The table's name in the model file (an initializer, a module's weight), for the error message.
    table: str


def merge_bounds(bounds: Sequence[IndexBound]) -> list[IndexBound]:
    """One bound per input, the smallest table's, when an input indexes several tables."""
    smallest: dict[str, IndexBound] = {}
    for bound in bounds:
        if bound.rows > 0 and (bound.input not in smallest or bound.rows < smallest[bound.input].rows):
            smallest[bound.input] = bound
    return list(smallest.values())


def out_of_bounds(bounds: Sequence[IndexBound], request: InferRequest) -> ServerError | None:
    """The 400 for the first input of `request` holding an id outside its table, or None."""
    tensors = {tensor.name: tensor.data for tensor in request.inputs}
    for bound in bounds:
        data = tensors.get(bound.input)
        if data is None or not data.size or data.dtype.kind not in "iu":
            continue
        low, high = int(np.min(data)), int(np.max(data))
        if low < 0 or high >= bound.rows:
            bad = low if low < 0 else high
            return invalid_arg(f"input '{bound.input}' holds id {bad}, outside the vocabulary (0..{bound.rows - 1}) "
                               f"of the embedding table '{bound.table}'")
    return None
