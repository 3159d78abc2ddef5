"""The inputs of an ONNX model that index an embedding table: a `Gather` along axis 0 whose data is an
initializer (the table, its first dimension the rows) and whose indices are a graph input, directly or through
steps that keep its values (`Cast`, `Identity`, reshapes an exporter inserts). Read with the `onnx` package from
the file's graph only (external weights are not loaded); without `onnx` installed no bound is found, and an id
past a table is still a 400, for the whole run (`ORT_BAD_INDEX`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transerve.backends.index_bounds import IndexBound, merge_bounds

log = logging.getLogger(__name__)

#: onnxruntime's message for a Gather past its data's end (a run that checks nothing first reports this).
ORT_BAD_INDEX = "out of data bounds"
#: Operators whose first input's values reach their output unchanged (only rearranged): an index input keeps its
#: bounds through them. A Cast of integers to wider integers keeps values; exporters cast int32 ids to int64.
_PASS_THROUGH = ("Cast", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten")


def embedding_bounds(path: Path) -> list[IndexBound]:
    """The model's embedding inputs and their tables' row counts; [] when `onnx` is missing or cannot read it."""
    try:
        import onnx
    except ImportError:
        return []
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - onnxruntime loaded it: the check is only left out
        log.warning("cannot read %s's graph for its embedding tables (%s): ids are not checked before runs", path, exc)
        return []
    return graph_bounds(model.graph)


def graph_bounds(graph: Any) -> list[IndexBound]:
    tables = {tensor.name: tensor for tensor in graph.initializer if len(tensor.dims) >= 1}
    inputs = {value.name for value in graph.input} - set(tables)
    producer = {output: node for node in graph.node for output in node.output}

    def source(name: str) -> str | None:
        """The graph input `name` is a copy of, following value-preserving nodes; None when computed."""
        for _ in range(8):
            if name in inputs:
                return name
            node = producer.get(name)
            if node is None or node.op_type not in _PASS_THROUGH or not node.input:
                return None
            name = node.input[0]
        return None

    bounds = []
    for node in graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[0] not in tables:
            continue
        axis = next((attribute.i for attribute in node.attribute if attribute.name == "axis"), 0)
        origin = source(node.input[1])
        if axis == 0 and origin is not None:
            bounds.append(IndexBound(origin, int(tables[node.input[0]].dims[0]), node.input[0]))
    return merge_bounds(bounds)
