"""Tiny ONNX and TorchScript models for backend tests, built with torch in a fraction of a second.

- `add_sub`: INPUT0, INPUT1 (FP32 [batch, 4]) -> their sum and difference.
- `token_states`: input_ids, attention_mask (INT64 [batch, sequence]) -> `hidden` (FP32 [batch, sequence, 3]),
  each token's embedding times its mask, and `length` (INT64 [batch, 1]), the mask's sum. Its outputs follow
  the sequence axis, so batches of requests of different lengths show whether padding is trimmed back.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch


class AddSub(torch.nn.Module):
    def forward(self, INPUT0: torch.Tensor, INPUT1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: N803
        return INPUT0 + INPUT1, INPUT0 - INPUT1


class TokenStates(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(100, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embedding(input_ids) * attention_mask.unsqueeze(-1).to(torch.float32)
        return hidden, attention_mask.sum(dim=1, keepdim=True)


def token_states_reference(input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """What `token_states` computes for `hidden`, from numpy."""
    with torch.no_grad():
        hidden, _ = TokenStates()(torch.from_numpy(input_ids), torch.from_numpy(attention_mask))
    return hidden.numpy()


def write_onnx(model: str, path: Path) -> Path:
    """`model` ("add_sub" or "token_states") as an ONNX file with dynamic batch (and sequence) axes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if model == "add_sub":
        module, args = AddSub(), (torch.ones(2, 4), torch.ones(2, 4))
        names, outputs = ["INPUT0", "INPUT1"], ["OUTPUT0", "OUTPUT1"]
        axes = {name: {0: "batch"} for name in [*names, *outputs]}
    else:
        ids, mask = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
        module, args = TokenStates().eval(), (ids, mask)
        names, outputs = ["input_ids", "attention_mask"], ["hidden", "length"]
        axes = {name: {0: "batch", 1: "sequence"} for name in [*names, "hidden"]} | {"length": {0: "batch"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=names, output_names=outputs, dynamic_axes=axes,
                          dynamo=False)
    return path


def write_torchscript(model: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(AddSub() if model == "add_sub" else TokenStates().eval()).save(str(path))
    return path
