"""Files and folders a model config names stay inside the model's folder.

A config can come from a client (the load API's `config` parameter), so a name such as `/tmp/x.py` or
`../../x.py` in `default_model_filename` must never reach a file the model's folder does not hold: the python
backend would run it. Each name is taken relative to its folder (the version folder for model files, the model
folder for label files, `warmup/` for warmup data) and is refused unless

- as written, it stays inside its boundary (the model's folder; `warmup/` for warmup data): no absolute path,
  no `..` that climbs out, and
- with symbolic links resolved, it lies inside that boundary or the folder it is relative to.

The folders of Triton's layout may themselves be links the operator made: a model folder linked into the
repository, a version folder linked to a model store. Their targets are the boundary then; only a link *below*
them that leads elsewhere is refused, since a config could otherwise name it to reach any file.
"""

from __future__ import annotations

import os
from pathlib import Path

from transerve.core.errors import invalid_arg


def inside(boundary: Path, folder: Path, name: str, setting: str) -> Path:
    """`folder / name` (`folder` is `boundary` or below it), or INVALID_ARG naming `setting` (e.g.
    "default_model_filename") when it leaves `boundary`. The path is returned as written, not resolved, so a model
    sees the layout it was given."""
    if "\0" in name or Path(name).is_absolute():
        raise invalid_arg(f"{setting} '{name}' must be a relative path inside the folder '{boundary.name}'")
    path = folder / name
    if not Path(os.path.normpath(path)).is_relative_to(os.path.normpath(boundary)):
        raise invalid_arg(f"{setting} '{name}' points outside the folder '{boundary.name}'")
    try:
        real = path.resolve()
        roots = (boundary.resolve(), folder.resolve())
    except (OSError, RuntimeError) as exc:  # RuntimeError: a loop of symbolic links
        raise invalid_arg(f"{setting} '{name}' cannot be resolved: {exc}") from None
    if not any(real.is_relative_to(root) for root in roots):
        raise invalid_arg(f"{setting} '{name}' leads outside the folder '{boundary.name}' through a symbolic link")
    return path
