"""A cheap digest of a model folder, so polling can tell whether anything in it changed."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def fingerprint(model_path: Path, leave_out: str = "") -> str:
    """Names, sizes and modification times of every file under the folder (caches excluded, and the file
    `leave_out` of the folder itself: the config, for a digest of everything else)."""
    digest = hashlib.sha1()
    for root, dirs, files in os.walk(model_path):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for name in sorted(files):
            path = os.path.join(root, name)
            if leave_out and name == leave_out and root == str(model_path):
                continue
            try:
                stat = os.stat(path)
            except OSError:
                continue
            digest.update(f"{os.path.relpath(path, model_path)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()
