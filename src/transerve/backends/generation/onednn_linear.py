"""Route a CPU model's linear layers to oneDNN's GEMM instead of torch's default (MKL) one.

Decoding multiplies a few rows by every weight matrix. At those shapes torch's CPU `linear` (MKL's sgemm) reaches a
fraction of what the cores can do, and barely gains from a second thread; oneDNN's, which torch ships as
`torch.ops.mkldnn._linear_pointwise`, is faster and gains from a second thread (benchmarks/torch_linear_kernels.py,
2 threads, float32: a 16-row decoding step of the GPT-2 small shape 116 -> 85 ms, of the t5-small shape 45 -> 36
ms). Both are float32 GEMMs, summing in different orders: results differ in the last bits, so a near-tie between
two tokens may break the other way than in transformers' own `generate`; `onednn_linear: false` keeps torch's.

Swapped: `torch.nn.Linear` and transformers' `Conv1D` (GPT-2's, whose weight is stored [in, out]: it gets a
transposed copy in place of the original, so memory does not grow). Tied weights (an LM head sharing the embedding
table) stay shared: a Linear's weight is used as it is.
"""

from __future__ import annotations

import functools
from typing import Any


def onednn_available(torch: Any) -> bool:
    """Whether this torch build has the oneDNN linear op and it computes what `linear` does on this CPU."""
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    # Fixed values, not random ones: loading a model must not move torch's global random state.
    x = torch.linspace(-1, 1, 24).reshape(3, 8)
    weight, bias = torch.linspace(-2, 2, 40).reshape(5, 8), torch.linspace(0, 1, 5)
    try:
        got = op(x, weight, bias, "none", [], "")
    except RuntimeError:
        return False
    return bool(torch.allclose(got, torch.nn.functional.linear(x, weight, bias), atol=1e-5))


def use_onednn_linears(model: Any) -> int:
    """Replace `model`'s float32 Linear and Conv1D modules with oneDNN ones, in place; returns how many. The model
    must be on the CPU and `onednn_available` true."""
    import torch
    from transformers.pytorch_utils import Conv1D

    linear = _onednn_linear_class()
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and child.weight.dtype == torch.float32:
                setattr(parent, name, linear(child.weight, child.bias))
            elif isinstance(child, Conv1D) and child.weight.dtype == torch.float32:
                weight = torch.nn.Parameter(child.weight.detach().t().contiguous(), requires_grad=False)
                setattr(parent, name, linear(weight, child.bias))
            else:
                continue
            swapped += 1
    return swapped


@functools.cache
def _onednn_linear_class() -> type:
    import torch

    op = torch.ops.mkldnn._linear_pointwise

    class OneDnnLinear(torch.nn.Module):
        """y = x W^T + b on oneDNN; `weight` is [out, in] as `torch.nn.Linear`'s."""

        def __init__(self, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None) -> None:
            super().__init__()
            self.weight = weight
            self.bias = bias
            self.in_features, self.out_features = weight.shape[1], weight.shape[0]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = x.reshape(-1, x.shape[-1])
            return op(rows, self.weight, self.bias, "none", [], "").reshape(*x.shape[:-1], self.out_features)

    return OneDnnLinear
