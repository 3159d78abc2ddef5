"""Which GPUs a model instance may be placed on, found without loading CUDA.

Triton asks the CUDA runtime; transerve must not depend on it, so it counts the NVIDIA device nodes
(`/dev/nvidia0`, `/dev/nvidia1`, ...) the driver creates for the GPUs this process can open, and then applies
`CUDA_VISIBLE_DEVICES` the way CUDA does: device ids are ordinals 0..n-1 over the visible GPUs.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

_DEVICE_NODE = re.compile(r"nvidia(\d+)")


@functools.cache
def visible_gpus() -> tuple[int, ...]:
    """CUDA device ids usable by model instances; empty on a machine without NVIDIA GPUs."""
    try:
        present = sum(1 for entry in Path("/dev").iterdir() if _DEVICE_NODE.fullmatch(entry.name))
    except OSError:
        present = 0
    return tuple(range(_visible_count(present, os.environ.get("CUDA_VISIBLE_DEVICES"))))


def _visible_count(present: int, visible: str | None) -> int:
    """How many of `present` GPUs CUDA exposes under CUDA_VISIBLE_DEVICES (None: all of them).

    CUDA stops at the first entry it cannot resolve; a UUID (`GPU-...`, `MIG-...`) is taken as resolvable.
    """
    if visible is None:
        return present
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if (entry.isdigit() and int(entry) < present) or entry.startswith(("GPU-", "MIG-")):
            count += 1
        else:
            break
    return min(count, present)
