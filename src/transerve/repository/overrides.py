"""Model files sent inside a load request (`file:<version>/<name>` parameters), written to a private folder."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path, PurePosixPath

from transerve.core.errors import invalid_arg


def write_model_files(model_name: str, files: dict[str, bytes]) -> Path:
    """Write the files under `<new temporary folder>/<model_name>/` and return the temporary folder.

    Every path must stay inside the model's folder: absolute paths and `..` are refused before
    anything is written.
    """
    checked = {_checked_path(model_name, path): content for path, content in files.items()}
    root = Path(tempfile.mkdtemp(prefix=f"transerve-{model_name}-"))
    try:
        for relative, content in checked.items():
            target = root / model_name / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
    except OSError as exc:
        shutil.rmtree(root, ignore_errors=True)
        raise invalid_arg(f"failed to load '{model_name}': cannot write its files: {exc}") from None
    return root


def _checked_path(model_name: str, path: str) -> PurePosixPath:
    relative = PurePosixPath(path)
    if not path or relative.is_absolute() or any(part in ("", ".", "..") for part in path.split("/")):
        raise invalid_arg(f"failed to load '{model_name}': invalid file path 'file:{path}' "
                          "(expected file:<version>/<file name> inside the model folder)")
    return relative
