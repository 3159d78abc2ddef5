"""Which of torch's attention kernels each `scaled_dot_product_attention` call can take, and why not the fused ones.

On a GPU torch picks, per call, the first kernel whose checks the call passes (flash, memory-efficient, cuDNN where
enabled), else its math kernel, which materialises the whole score matrix in several launches. The profiler shows
that the math kernel ran; only the checks say why. Inside `attention_calls()`, every call made from any thread is
recorded by its signature (shapes, strides, dtypes, mask, causal flag), and for each new signature torch's own
checks are asked (`torch.backends.cuda.can_use_*` with their debug warnings), so one GPU run answers the question.
A diagnostic for `gpu_check`, not for timed rows: the wrapper costs host time per call.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: torch's checks by kernel, in the order it tries them (those this torch has).
KERNELS = ("flash", "efficient", "cudnn")


@dataclass
class Signature:
    """One kind of call: how often it came, and which fused kernels its inputs allow (with torch's reasons)."""

    description: str
    calls: int = 0
    #: Whether torch's checks were asked (not inside a CUDA graph's recording, whose warm-up asked them).
    checked: bool = False
    allowed: dict[str, bool] = field(default_factory=dict)
    reasons: dict[str, list[str]] = field(default_factory=dict)

    def verdict(self) -> str:
        """The kernel torch would pick among the fused ones it allows (cuDNN only where it is enabled), else math."""
        import torch

        if not self.checked:
            return "unchecked"

        enabled = {"flash": torch.backends.cuda.flash_sdp_enabled(),
                   "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                   "cudnn": torch.backends.cuda.cudnn_sdp_enabled()}
        for kernel in KERNELS:
            if self.allowed.get(kernel) and enabled[kernel]:
                return kernel
        return "math"


@dataclass
class AttentionReport:
    signatures: dict[tuple, Signature] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """One line per signature, the most called first: calls, kernel, inputs; then why the fused kernels
        refuse it, once per distinct reason."""
        out = []
        for signature in sorted(self.signatures.values(), key=lambda s: -s.calls):
            out.append(f"{signature.calls:7d} calls  {signature.verdict():9s} {signature.description}")
            for kernel, reasons in signature.reasons.items():
                for reason in dict.fromkeys(reasons):
                    out.append(f"{'':18s}{kernel}: {reason}")
        return out


def _shape(tensor: Any) -> str:
    if tensor is None:
        return "none"
    return f"{tuple(tensor.shape)}/{tuple(tensor.stride())}/{str(tensor.dtype).removeprefix('torch.')}"


def _checks(query: Any, key: Any, value: Any, mask: Any, dropout: float, causal: bool, gqa: bool,
            ) -> tuple[dict[str, bool], dict[str, list[str]]]:
    import torch

    params = torch.backends.cuda.SDPAParams(query, key, value, mask, dropout, causal, gqa)
    allowed, reasons = {}, {}
    for kernel in KERNELS:
        check = getattr(torch.backends.cuda, f"can_use_{kernel}_attention", None)
        if check is None:
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            allowed[kernel] = bool(check(params, True))
        if not allowed[kernel]:
            reasons[kernel] = [str(warning.message).splitlines()[0] for warning in caught] or [
                "refused, no reason given (a torch built without CUDA says nothing)"]
    return allowed, reasons


@contextlib.contextmanager
def attention_calls() -> Iterator[AttentionReport]:
    """Record the `scaled_dot_product_attention` calls made inside the block (see the module docstring)."""
    import torch

    original = torch.nn.functional.scaled_dot_product_attention
    report = AttentionReport()
    lock = threading.Lock()

    def recorded(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, **kwargs: Any) -> Any:
        shapes = (_shape(query), _shape(key), _shape(value), _shape(attn_mask))
        signature_key = (*shapes, dropout_p, is_causal, enable_gqa, str(query.device))
        with lock:
            signature = report.signatures.get(signature_key)
        if signature is None:
            description = (f"q {shapes[0]} k {shapes[1]} v {shapes[2]} mask {shapes[3]}"
                           f"{' causal' if is_causal else ''}{' gqa' if enable_gqa else ''}")
            signature = Signature(description)
            capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
            if not capturing:  # a recording's warm-up run made the same call just before
                signature.checked = True
                signature.allowed, signature.reasons = _checks(query, key, value, attn_mask, dropout_p, is_causal,
                                                               enable_gqa)
            with lock:
                signature = report.signatures.setdefault(signature_key, signature)
        with lock:
            signature.calls += 1
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = recorded
    try:
        yield report
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
