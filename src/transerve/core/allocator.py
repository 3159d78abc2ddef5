"""The server process's malloc settings, tuned for request and response buffers of many megabytes.

glibc serves allocations above a threshold (128 KiB, rising as such blocks are freed, to at most 32 MiB) with a
fresh mmap and returns them to the system when freed, so every large request body, protobuf message or tensor
copy touches new pages, which costs a large tensor's trip through the server much of its time
(benchmarks/README.md, "Large tensors" and "Figures behind the code"). So allocations up to `MMAP_THRESHOLD`
come from the heap, and up to `TRIM_THRESHOLD` of free heap is kept for the next request rather than given back.
A server started with glibc's own MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ in its environment keeps
those instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

#: Allocations up to this size come from the heap (mallopt's M_MMAP_THRESHOLD).
MMAP_THRESHOLD = 64 * 1024 * 1024
#: Free heap memory kept rather than returned to the system (M_TRIM_THRESHOLD).
TRIM_THRESHOLD = 256 * 1024 * 1024
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

log = logging.getLogger("transerve")


def keep_large_buffers() -> bool:
    """Apply the thresholds to this process where glibc is the allocator; whether they were applied."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    applied = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not applied:
        log.warning("could not set malloc's thresholds: large requests will be slower")
    return applied
