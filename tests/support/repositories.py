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


def write_model(repo: Path, name: str, config: str, code: str | None = None, version: str = "1") -> Path:
    """Write the model `name` into `repo`: its config.pbtxt and, for a python model, `version`'s model.py."""
    (repo / name / version).mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(config)
    if code is not None:
        (repo / name / version / "model.py").write_text(code)
    return repo / name


def int32_in_out(name: str, dims: int = 1) -> str:
    """A python model's config without batching: INT32 IN to INT32 OUT, both of `dims` elements."""
    return (f'name: "{name}" backend: "python" input [{{name: "IN" data_type: TYPE_INT32 dims: [{dims}]}}] '
            f'output [{{name: "OUT" data_type: TYPE_INT32 dims: [{dims}]}}]')


def add_sub_ensemble(name: str, step: str) -> str:
    """An ensemble with add_sub's signature whose one step is `step`."""
    return f'''name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [{{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }}, {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }}]
output [{{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }}, {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }}]
ensemble_scheduling {{ step [{{ model_name: "{step}" model_version: -1
  input_map {{ key: "INPUT0" value: "INPUT0" }} input_map {{ key: "INPUT1" value: "INPUT1" }}
  output_map {{ key: "OUTPUT0" value: "OUTPUT0" }} output_map {{ key: "OUTPUT1" value: "OUTPUT1" }} }}] }}
'''
