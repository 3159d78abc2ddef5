"""Which attention kernels torch may pick where transerve runs torch models on a GPU.

On Hopper GPUs PyTorch 2.11's `scaled_dot_product_attention` picks cuDNN's kernel, which builds an execution plan
for each new shape, at a CPU cost per call far above the kernel's GPU time. Decoding changes the key length every
step, and TorchScript encoders see a new length with each batch, so the plan is built on almost every call and
the GPU idles. Without cuDNN's kernel torch falls back to its flash or memory-efficient kernels, which take any
shape without a plan (the engine's speed either way: benchmarks/README.md, "Figures behind the code";
docs/generation.md, "On a GPU"). The switch is process-wide, and only ever turned off here.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)


def use_decoding_attention(torch: ModuleType, device: Any) -> None:
    """Before a model runs on `device` (a torch.device): on a CUDA device, turn cuDNN's attention kernel off."""
    if device.type != "cuda":
        return
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        logger.info("cuDNN's scaled_dot_product_attention turned off: it builds a plan per shape (docs/generation.md)")
