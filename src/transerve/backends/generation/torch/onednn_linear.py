"""Route a CPU model's linear layers to oneDNN's GEMM, on weights packed ahead, instead of torch's default (MKL).

Decoding multiplies a few rows by every weight matrix. At those shapes torch's CPU `linear` (MKL's sgemm) reaches a
fraction of what the cores can do, and barely gains from a second thread; oneDNN's, which torch ships as
`torch.ops.mkldnn._linear_pointwise`, is faster and gains from a second thread. A GEMM with few rows also spends
much of its time laying the weight matrix out for the kernel; packing each weight once, at load, into oneDNN's own
layout for a few-row product (`torch.ops.mkldnn._reorder_linear_weight`) takes that out of every call.
benchmarks/torch_linear_kernels.py measures the three. Both GEMMs are float32, summing in different orders:
results differ in the last bits, so a near-tie between two tokens may break the other way than in transformers'
own `generate`; `onednn_linear: false` keeps torch's kernels.

Swapped: `torch.nn.Linear` and transformers' `Conv1D` (GPT-2's, whose weight is stored [in, out]: it is transposed
on the way). A packed weight replaces the plain one, so memory does not grow, but for a weight another module
shares: an LM head tied to the embedding table is packed as a copy (the lookup needs the plain table), which costs
that matrix once more (GPT-2 small: 154 MB) and was measured worth it (the head is the largest GEMM of a step).
"""

from __future__ import annotations

import functools
from typing import Any

#: The row count the weights are packed for: the rows of a decoding step (a batch of sequences) or a short prompt.
PACKED_FOR_ROWS = 16
#: Fewer rows than this take a slower path in oneDNN's packed GEMM than this many do (benchmarks/README.md,
#: "Figures behind the code"), so they are padded with zero rows to it.
MIN_PACKED_ROWS = 4


def onednn_available(torch: Any) -> bool:
    """Whether this torch build has the oneDNN linear and packing ops and they compute what `linear` does here."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    op, pack = getattr(mkldnn, "_linear_pointwise", None), getattr(mkldnn, "_reorder_linear_weight", None)
    if op is None or pack is None or not torch.backends.mkldnn.is_available():
        return False
    # Fixed values, not random ones: loading a model must not move torch's global random state.
    x = torch.linspace(-1, 1, 24).reshape(3, 8)
    weight, bias = torch.linspace(-2, 2, 40).reshape(5, 8), torch.linspace(0, 1, 5)
    expected = torch.nn.functional.linear(x, weight, bias)
    try:
        plain = op(x, weight, bias, "none", [], "")
        packed = op(x, pack(weight, PACKED_FOR_ROWS), bias, "none", [], "")
    except RuntimeError:
        return False
    return bool(torch.allclose(plain, expected, atol=1e-5) and torch.allclose(packed, expected, atol=1e-5))


def use_onednn_linears(model: Any, pack: bool = True) -> int:
    """Replace `model`'s float32 Linear and Conv1D modules with oneDNN ones, in place, their weights packed unless
    `pack` is false; returns how many. The model must be on the CPU and `onednn_available` true."""
    import torch
    from transformers.pytorch_utils import Conv1D

    linear = _onednn_linear_class()
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and child.weight.dtype == torch.float32:
                weight = child.weight.detach()
            elif isinstance(child, Conv1D) and child.weight.dtype == torch.float32:
                weight = child.weight.detach().t().contiguous()
            else:
                continue
            setattr(parent, name, linear(weight, child.bias, pack=pack))
            swapped += 1
    return swapped


@functools.cache
def _onednn_linear_class() -> type:
    import torch

    op = torch.ops.mkldnn._linear_pointwise

    class OneDnnLinear(torch.nn.Module):
        """y = x W^T + b on oneDNN; `weight` is [out, in] as `torch.nn.Linear`'s. A packed weight is an opaque
        oneDNN tensor kept outside the module's parameters (only this op reads it)."""

        def __init__(self, weight: torch.Tensor, bias: torch.nn.Parameter | None, pack: bool) -> None:
            super().__init__()
            self.packed = pack
            self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS) if pack
                           else torch.nn.Parameter(weight, requires_grad=False))
            self.bias = bias
            self.in_features, self.out_features = weight.shape[1], weight.shape[0]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = x.reshape(-1, x.shape[-1])
            count = rows.shape[0]
            if self.packed and count < MIN_PACKED_ROWS:
                rows = torch.nn.functional.pad(rows, (0, 0, 0, MIN_PACKED_ROWS - count))
            out = op(rows, self.weight, self.bias, "none", [], "")[:count]
            return out.reshape(*x.shape[:-1], self.out_features)

    return OneDnnLinear
