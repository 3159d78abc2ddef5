"""A cheap digest of a model folder, so polling can tell whether anything in it changed."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def fingerprint(model_path: Path) -> str:
    """Names, sizes and modification times of every file under the folder (caches excluded)."""
    digest = hashlib.sha1()
    for root, dirs, files in os.walk(model_path):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for name in sorted(files):
            path = os.path.join(root, name)
            try:
                stat = os.stat(path)
            except OSError:
                continue
            digest.update(f"{os.path.relpath(path, model_path)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()
