"""A model's config as `auto_complete_config` and `initialize` see it: ModelConfig with Triton's rules for what
a model may fill in, lookups in the config's dict, and Triton's datatype names and numbers as numpy types."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np

from transerve.backends.python._pb_utils.tensors import _DATATYPE_OF
from transerve.core.datatypes import BF16, NUMPY_DTYPES, TRITON_ENUM

_DATATYPE_BY_ENUM = {number: name for name, number in TRITON_ENUM.items()}

#: `TYPE_FP32`-style config names -> numpy types, as models pass them to `triton_string_to_numpy`.
_CONFIG_TYPE_TO_NUMPY: dict[str, type] = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
    "TYPE_BF16": BF16.type,
}


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return _find_config(model_config.get("input", ()), name)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return _find_config(model_config.get("output", ()), name)


def _find_config(entries: Iterable[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for entry in entries:
        if entry["name"] == name:
            return entry
    return None


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def triton_to_numpy_type(data_type: int) -> type | None:
    """Triton's numeric datatype enum -> numpy type (None for an unknown number)."""
    name = _DATATYPE_BY_ENUM.get(data_type)
    return None if name is None else NUMPY_DTYPES[name].type


def numpy_to_triton_type(data_type: Any) -> int | None:
    """numpy type -> Triton's numeric datatype enum (None for an unsupported type)."""
    try:
        dtype = np.dtype(data_type)
    except TypeError:
        return None
    if dtype.kind == "S":
        return TRITON_ENUM["BYTES"]
    name = _DATATYPE_OF.get(dtype)
    return None if name is None else TRITON_ENUM[name]


def triton_string_to_numpy(triton_type_string: str) -> type:
    return _CONFIG_TYPE_TO_NUMPY[triton_type_string]


class ModelConfig:
    """The config handed to `auto_complete_config`: a model may fill in only what Triton lets it,
    and each setter refuses to contradict what config.pbtxt already says."""

    def __init__(self, model_config: str | dict[str, Any]) -> None:
        self._model_config = json.loads(model_config) if isinstance(model_config, str) else model_config
        self._model_config.setdefault("input", [])
        self._model_config.setdefault("output", [])
        self._model_config.setdefault("max_batch_size", 0)

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    @property
    def _name(self) -> str:
        return self._model_config.get("name", "")

    def set_max_batch_size(self, max_batch_size: int) -> None:
        configured = self._model_config["max_batch_size"]
        if configured > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {configured}, but in auto-complete-config function "
                f"for model '{self._name}' specified max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but auto-complete-config function "
                    f"for model '{self._name}' tries to set scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict[str, Any]) -> None:
        self._add_tensor("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict[str, Any]) -> None:
        self._add_tensor("output", output, ("name", "data_type", "dims"))

    def _add_tensor(self, kind: str, tensor: dict[str, Any], allowed: tuple[str, ...]) -> None:
        """Add an input/output, or complete the one config.pbtxt declares under the same name."""
        label = f"{kind} '{tensor.get('name', '')}' in auto-complete-config function for model '{self._name}'"
        unknown = [key for key in tensor if key not in allowed]
        if unknown:
            raise ValueError(f"{label} contains property other than {', '.join(repr(a) for a in allowed)}.")
        for required in ("name", "data_type", "dims"):
            if required not in tensor:
                raise ValueError(f"{label} is missing '{required}' property.")
        for current in self._model_config[kind]:
            if current["name"] == tensor["name"]:
                self._merge_tensor(kind, current, tensor)
                return
        self._model_config[kind].append(tensor)

    def _merge_tensor(self, kind: str, current: dict[str, Any], tensor: dict[str, Any]) -> None:
        name = tensor["name"]
        configured_type = current.get("data_type", "TYPE_INVALID")
        if configured_type != "TYPE_INVALID" and configured_type != tensor["data_type"]:
            raise ValueError(
                f"unable to load model '{self._name}', configuration expects datatype {configured_type} "
                f"for {kind} '{name}', model provides {tensor['data_type']}"
            )
        if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
            raise ValueError(
                f"model '{self._name}', tensor '{name}': the model expects dims {tensor['dims']} "
                f"but the model configuration specifies dims {current['dims']}"
            )
        if "optional" in current and "optional" in tensor and current["optional"] != tensor["optional"]:
            raise ValueError(
                f"model '{self._name}', tensor '{name}': the model expects optional {tensor['optional']} "
                f"but the model configuration specifies optional {current['optional']}"
            )
        current["data_type"] = tensor["data_type"]
        current["dims"] = tensor["dims"]
        if "optional" in tensor:
            current["optional"] = tensor["optional"]

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        if any(key != "decoupled" for key in transaction_policy_dict):
            raise ValueError(
                f"model transaction property in auto-complete-config function for model '{self._name}' "
                "contains property other than 'decoupled'."
            )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" not in transaction_policy_dict:
            return
        wanted = transaction_policy_dict["decoupled"]
        if "decoupled" in policy and policy["decoupled"] != wanted:
            raise ValueError(
                f"trying to change decoupled property in auto-complete-config for model '{self._name}', "
                f"which is already set to '{policy['decoupled']}'."
            )
        policy["decoupled"] = wanted
