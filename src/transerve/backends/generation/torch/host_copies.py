"""Host values copied to the device without waiting for it.

torch copies pageable host memory to a GPU and then waits for the stream (`cudaStreamSynchronize`), so every
`torch.tensor(values, device="cuda")` and every list used as an index (which torch turns into such a copy) is a
synchronisation: the host stops until the device has run everything queued before. From pinned memory, with
`non_blocking`, the copy is queued like a kernel and the host goes on; torch's caching host allocator keeps the
pinned buffer until the copy has run. A decoding step's per-step copies to the device (the next tokens, the rows
that stay, the token rules' indices) go through here, so that a step waits for the device once: when its one
read comes back (`selection.choose`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def to_device(values: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (nested lists of numbers) as a tensor on `device`: on the CPU made there; elsewhere copied
    without waiting for the device (from pinned memory on a GPU)."""
    import torch

    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)
