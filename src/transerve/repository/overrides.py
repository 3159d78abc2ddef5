"""Model files sent inside a load request (`file:<version>/<name>` parameters), written to a private folder."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path, PurePosixPath

from transerve.core.errors import invalid_arg

#: `--model-load-max-files`, `--model-load-max-bytes`: a model's folder sent in one load request. Room for any real
#: model folder (a handful of files; one large weights file), not for a request that costs seconds to write.
MAX_LOAD_FILES = 1024
MAX_LOAD_BYTES = 1 << 30
#: Longest file or folder name, and whole path, a `file:` parameter may give (Linux's NAME_MAX and PATH_MAX).
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4096


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
    parts = path.split("/")
    if not path or relative.is_absolute() or any(part in ("", ".", "..") for part in parts):
        raise invalid_arg(f"failed to load '{model_name}': invalid file path 'file:{_shown(path)}' "
                          "(expected file:<version>/<file name> inside the model folder)")
    if "\0" in path:
        raise invalid_arg(f"failed to load '{model_name}': the file path 'file:{_shown(path)}' holds a NUL byte")
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES or any(
            len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES for part in parts):
        raise invalid_arg(f"failed to load '{model_name}': the file path 'file:{_shown(path)}' is too long (at most "
                          f"{MAX_NAME_BYTES} bytes a name, {MAX_PATH_BYTES} in all)")
    return relative


def _shown(path: str) -> str:
    """A client's path as a message shows it: printable, and short."""
    shown = path.encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= 80 else shown[:77] + "..."
