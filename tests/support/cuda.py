"""Whether CTranslate2 can decode on a CUDA GPU here, and why not: its wheel opens CUDA 12's cuBLAS by name at
the first decode, which a CUDA 13 host has only through the `gpu` extra (issue 22). GPU tests ask this instead
of counting devices, so that on such a host they check the reason a served model reports rather than fail."""

from __future__ import annotations

import ctypes
from functools import cache


@cache
def ctranslate2_cuda_problem() -> str | None:
    """None when CTranslate2 sees a CUDA device and can load `libcublas.so.12` (after transerve's preloading from
    the `gpu` extra, as the engine does); else why not."""
    import ctranslate2

    from transerve.backends.generation.cuda_libraries import preload_cublas_once

    if ctranslate2.get_cuda_device_count() < 1:
        return "no CUDA GPU"
    preload_cublas_once()
    try:
        ctypes.CDLL("libcublas.so.12")
    except OSError as exc:
        return f"CUDA 12's cuBLAS cannot be loaded ({exc}): pip install 'transerve[gpu]'"
    return None
