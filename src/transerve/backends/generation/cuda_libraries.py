"""CUDA 12's cuBLAS for CTranslate2 on hosts whose CUDA is another version, loaded from its PyPI package.

The ctranslate2 4.8.5 wheel links the CUDA runtime statically and opens `libcublas.so.12` by name (`dlopen`) at the
first decode on a GPU; nothing else of CUDA (the driver's libcuda.so.1 aside: `readelf -d` and the library's
strings name no other). A host with only CUDA 13 has no such file, and every decode failed (issue 22). The `gpu`
extra installs `nvidia-cublas-cu12`, whose `nvidia/cublas/lib/` holds `libcublasLt.so.12` and `libcublas.so.12`
outside the loader's search path. Loading them by their full path first (RTLD_GLOBAL) makes CTranslate2's later
`dlopen("libcublas.so.12")` find the library already loaded under that name.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: The package `nvidia-cublas-cu12` installs.
CUBLAS_PACKAGE = "nvidia.cublas"
#: In load order: libcublas.so.12 needs libcublasLt.so.12.
CUBLAS_LIBRARIES = ("libcublasLt.so.12", "libcublas.so.12")

_lock = threading.Lock()
_done = False


def load_global(name: str) -> Any:
    """`name` (a file name or a path) loaded with its symbols visible to libraries loaded later."""
    return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)


def package_libraries(package: str) -> Path | None:
    """The `lib` folder of the installed `package` (found through importlib, wherever it is installed), or None."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a missing parent package (`nvidia`) raises rather than answering None
        return None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        folder = Path(location) / "lib"
        if folder.is_dir():
            return folder
    return None


def preload(
    package: str = CUBLAS_PACKAGE,
    libraries: tuple[str, ...] = CUBLAS_LIBRARIES,
    load: Callable[[str], Any] = load_global,
) -> list[Path]:
    """Load `libraries` from `package`'s lib folder unless they already load by name; the paths loaded. Does
    nothing when they load already (a system CUDA 12, LD_LIBRARY_PATH) or the package is absent; a file that
    fails to load is logged with the reason and the rest skipped: the engine's warm-up decode then reports it."""
    try:
        load(libraries[-1])
        return []
    except OSError:
        pass
    folder = package_libraries(package)
    if folder is None:
        logger.debug("%s cannot be loaded and the %s package is not installed", libraries[-1], package)
        return []
    loaded = []
    for name in libraries:
        path = folder / name
        try:
            load(str(path))
        except OSError as exc:
            logger.warning("could not load %s from the %s package (%s); CTranslate2 on a GPU needs it",
                           path, package, exc)
            return loaded
        loaded.append(path)
    logger.info("loaded %s from %s for CTranslate2", ", ".join(libraries), folder)
    return loaded


def preload_cublas_once() -> None:
    """`preload()` once per process, before the first CTranslate2 model on a GPU."""
    global _done
    with _lock:
        if not _done:
            preload()
            _done = True
