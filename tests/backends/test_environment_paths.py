"""Where an EXECUTION_ENV_PATH may lead: inside the model's repository or the model's own (maybe linked) folder."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from transerve.backends.python.environments import ExecutionEnvironments
from transerve.core.errors import ErrorCode, ServerError


def environment(folder: Path) -> Path:
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "activate").write_text("")
    (folder / "bin" / "python").symlink_to(sys.executable)
    return folder


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    """repo/plain (a folder), repo/linked -> store/linked (a linked model folder), environments in each, one at the
    top of the repository, and one outside everything."""
    repo = tmp_path / "repo"
    environment(repo / "envs" / "shared")
    environment(repo / "plain" / "env")
    environment(tmp_path / "store" / "linked" / "env")
    (repo / "linked").symlink_to(tmp_path / "store" / "linked", target_is_directory=True)
    environment(tmp_path / "outside")
    (repo / "plain" / "escape").symlink_to(tmp_path / "outside", target_is_directory=True)
    return tmp_path


def interpreter(layout: Path, model: str, setting: str):
    repo = layout / "repo"
    return asyncio.run(ExecutionEnvironments().interpreter(setting, repo / model, repo))


@pytest.mark.parametrize(("model", "setting", "folder"), [
    ("plain", "$$TRITON_MODEL_DIRECTORY/env", "repo/plain/env"),
    ("plain", "$$TRITON_MODEL_DIRECTORY/../envs/shared", "repo/envs/shared"),
    ("linked", "$$TRITON_MODEL_DIRECTORY/env", "store/linked/env"),
    ("linked", "{repo}/envs/shared", "repo/envs/shared"),
])
def test_environments_in_the_repository_or_the_models_folder_are_used(layout, model, setting, folder):
    found = interpreter(layout, model, setting.format(repo=layout / "repo"))
    assert found.command[-1] == str(layout / folder / "bin" / "python")


@pytest.mark.parametrize("setting",
                         ["{root}/outside", "$$TRITON_MODEL_DIRECTORY/escape", "$$TRITON_MODEL_DIRECTORY/../.."])
def test_environments_elsewhere_are_refused(layout, setting):
    with pytest.raises(ServerError) as raised:
        interpreter(layout, "plain", setting.format(root=layout))
    assert raised.value.code is ErrorCode.INVALID_ARG and "is outside the model repository" in raised.value.message
