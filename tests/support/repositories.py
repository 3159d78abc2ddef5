"""Model repositories for end-to-end tests, assembled in a test's temporary folder from the examples and from
model folders kept beside the tests.

Models that differ only in their config share one model.py: their folders beside the tests hold the config
(and labels), and the test names the code file when it copies them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .servers import EXAMPLE_REPOSITORY

_IGNORE = shutil.ignore_patterns("__pycache__")


def copy_example(tmp_path: Path, *names: str) -> Path:
    """A repository `tmp_path/repo` with the named models of examples/model_repository."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in names:
        shutil.copytree(EXAMPLE_REPOSITORY / name, repo / name)
    return repo


def copy_model(source: Path, destination: Path, code: Path | None = None) -> Path:
    """Copy the model folder `source` to `destination`; `code`, when given, becomes its version 1's model.py."""
    shutil.copytree(source, destination, ignore=_IGNORE)
    if code is not None:
        (destination / "1").mkdir(exist_ok=True)
        shutil.copyfile(code, destination / "1" / "model.py")
    return destination
