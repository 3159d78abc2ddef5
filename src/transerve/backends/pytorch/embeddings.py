"""The forward arguments of a TorchScript module that index an embedding table: `aten::embedding` calls in the
module's inlined graph whose indices are an argument, directly or through steps that keep its values (a dtype
conversion, a reshape), the table a weight reached from the module by
attribute names (`model.bert.embeddings.word_embeddings.weight`), its first dimension the rows. A table
computed, or indices computed from an argument, are not found; an id past such a table is still a 400, for the
whole batch (`TORCH_BAD_INDEX`)."""

from __future__ import annotations

import logging
from typing import Any

from transerve.backends.index_bounds import IndexBound, merge_bounds

log = logging.getLogger(__name__)

#: torch's message for an embedding lookup past the table (`IndexError`).
TORCH_BAD_INDEX = "index out of range"
#: Operators whose first input's values reach their output unchanged (only rearranged, or converted between
#: integer types): an index argument keeps its bounds through them.
_PASS_THROUGH = frozenset({"aten::to", "aten::contiguous", "aten::clone", "aten::view", "aten::reshape",
                           "aten::flatten", "aten::squeeze", "aten::unsqueeze", "aten::long", "aten::int"})


def embedding_bounds(module: Any, arguments: dict[str, str]) -> list[IndexBound]:
    """Bounds by config input name; `arguments` maps forward argument names to the config inputs they carry."""
    try:
        graph = module.inlined_graph
    except Exception as exc:  # noqa: BLE001 - a module torch cannot inline: ids are left unchecked
        log.warning("cannot read the TorchScript graph for its embedding tables (%s): ids are not checked", exc)
        return []
    parameters = list(graph.inputs())
    self_value = parameters[0] if parameters else None
    names = {value: _argument_name(value.debugName()) for value in parameters[1:]}
    bounds = []
    for node in graph.nodes():
        if node.kind() != "aten::embedding":
            continue
        weight, indices = list(node.inputs())[:2]
        argument = names.get(_source(indices, names))
        if argument not in arguments:
            continue
        path = _attribute_path(weight, self_value)
        table = _resolve(module, path) if path else None
        if table is not None and getattr(table, "dim", lambda: 0)() >= 1:
            bounds.append(IndexBound(arguments[argument], int(table.shape[0]), ".".join(path)))
    return merge_bounds(bounds)


def _source(value: Any, parameters: dict[Any, str]) -> Any:
    """The argument `value` is a copy of, following value-preserving operators (at most a few steps)."""
    for _ in range(8):
        if value in parameters:
            return value
        node = value.node()
        if node.kind() not in _PASS_THROUGH:
            return None
        value = next(iter(node.inputs()))
    return None


def _argument_name(debug_name: str) -> str:
    """TorchScript names a parameter `input_ids.1`; the argument is `input_ids`."""
    base, dot, suffix = debug_name.rpartition(".")
    return base if dot and suffix.isdigit() else debug_name


def _attribute_path(value: Any, self_value: Any) -> list[str] | None:
    """The attribute names from `self` to `value` when it is a chain of `prim::GetAttr`, else None."""
    path: list[str] = []
    while value is not self_value:
        node = value.node()
        if node.kind() != "prim::GetAttr":
            return None
        path.append(node.s("name"))
        value = next(iter(node.inputs()))
    return path[::-1]


def _resolve(module: Any, path: list[str]) -> Any:
    target = module
    for name in path:
        target = getattr(target, name, None)
        if target is None:
            return None
    return target
