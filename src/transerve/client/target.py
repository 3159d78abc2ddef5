"""What the client sends and reads, found in the served model's config: its text input and the output it writes.

A text ensemble (`N_text` from `transerve convert`) takes `text_input` and returns `text_output`; an exported
ensemble names its tensors otherwise (`input_text` -> `label`, ...). The input is the model's one BYTES input
(or `--input-name`); the output its one BYTES output, else its one output (or `--output-name`). Any other input
must be optional: the client sends one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transerve.client.errors import RunStopped

#: Request parameters: what KServe v2 parameters and /generate's JSON members may hold.
Parameter = bool | int | float | str


@dataclass(frozen=True, slots=True)
class Target:
    model: str
    version: str  # "" for the version the server picks
    input_name: str
    output_name: str
    #: Generate mode: one JSON request per line to /generate, no model config needed.
    generate: bool = False
    #: The model batches (max_batch_size > 0): requests carry a batch dimension, up to max_batch_size rows.
    max_batch_size: int = 0
    #: The input's dims after the batch dimension, each 1 or -1: one text per row.
    input_rank: int = 1
    parameters: dict[str, Parameter] = field(default_factory=dict)

    def shape(self, rows: int) -> list[int]:
        return ([rows] if self.max_batch_size > 0 else []) + [1] * self.input_rank

    def answers(self, output: np.ndarray, rows: int) -> list[str]:
        """One answer per row: the row's values, text decoded, joined by spaces (an embedding is one line)."""
        values = output.reshape(rows, -1) if output.size else np.empty((rows, 0), dtype=output.dtype)
        return [" ".join(_text(value) for value in row) for row in values]


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value.item() if isinstance(value, np.generic) else value)


def tensor_target(config: dict[str, Any], model: str, version: str, input_name: str | None,
                  output_name: str | None, parameters: dict[str, Parameter]) -> Target:
    """The target from the model's config (as /v2/models/M/config or gRPC's ModelConfig as JSON gives it);
    RunStopped naming the choices when the tensors cannot be told."""
    if (config.get("model_transaction_policy") or {}).get("decoupled"):
        raise RunStopped(f"model '{model}' is decoupled (it streams), which infer does not call: use --generate")
    inputs, outputs = config.get("input") or [], config.get("output") or []
    text_input = _pick("input", inputs, input_name, model)
    others = [spec["name"] for spec in inputs if spec is not text_input and not spec.get("optional", False)]
    if others:
        raise RunStopped(f"model '{model}' also needs {', '.join(others)}; transerve client sends one text input "
                         f"('{text_input['name']}')")
    if text_input.get("data_type") != "TYPE_STRING":
        raise RunStopped(f"input '{text_input['name']}' of model '{model}' is {text_input.get('data_type')}; "
                         "transerve client sends text (TYPE_STRING)")
    dims = [int(dim) for dim in text_input.get("dims", [])]
    if any(dim not in (1, -1) for dim in dims):
        raise RunStopped(f"input '{text_input['name']}' of model '{model}' has dims {dims}; transerve client sends "
                         "one text per row (dims [1] or [-1])")
    output = _pick("output", outputs, output_name, model)
    return Target(model, version, text_input["name"], output["name"], max_batch_size=int(
        config.get("max_batch_size", 0)), input_rank=len(dims), parameters=parameters)


def _pick(kind: str, specs: list[dict[str, Any]], name: str | None, model: str) -> dict[str, Any]:
    names = ", ".join(spec["name"] for spec in specs) or "none"
    if name is not None:
        for spec in specs:
            if spec["name"] == name:
                return spec
        raise RunStopped(f"model '{model}' has no {kind} '{name}'; its {kind}s: {names}")
    texts = [spec for spec in specs if spec.get("data_type") == "TYPE_STRING"]
    candidates = texts or (specs if kind == "output" else [])
    if len(candidates) == 1:
        return candidates[0]
    raise RunStopped(f"cannot tell which {kind} of model '{model}' to use (its {kind}s: {names}): "
                     f"name one with --{kind}-name")
