"""Names a config gives to files stay inside the model's folder, as written and with symbolic links resolved."""

from __future__ import annotations

from pathlib import Path

import pytest

from transerve.core.errors import ErrorCode, ServerError
from transerve.repository.paths import inside


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "repo" / "m" / "1" / "sub").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "shared.onnx").write_bytes(b"")
    (tmp_path / "secret").write_text("x")
    return tmp_path / "repo" / "m"


def refused(model: Path, name: str, folder: Path | None = None) -> str:
    with pytest.raises(ServerError) as raised:
        inside(model, folder or model / "1", name, "default_model_filename")
    assert raised.value.code is ErrorCode.INVALID_ARG
    assert "default_model_filename" in raised.value.message
    return raised.value.message


def test_names_inside_the_model_folder_are_returned_as_written(model: Path) -> None:
    version = model / "1"
    assert inside(model, version, "model.py", "s") == version / "model.py"
    assert inside(model, version, "sub/../model.py", "s") == version / "sub/../model.py"
    assert inside(model, version, "../shared.onnx", "s") == version / "../shared.onnx"  # a file of the model
    assert inside(model, version, "missing/model.py", "s") == version / "missing/model.py"  # existence is the caller's


@pytest.mark.parametrize("name", ["/etc/passwd", "../../secret", "../../../secret", "sub/../../../x", "a\0b"])
def test_absolute_and_climbing_names_are_refused(model: Path, name: str) -> None:
    refused(model, name)


def test_a_link_below_the_model_folder_may_not_lead_out(model: Path, tmp_path: Path) -> None:
    (model / "1" / "escape.py").symlink_to(tmp_path / "secret")
    (model / "1" / "out").symlink_to(tmp_path, target_is_directory=True)
    (model / "1" / "back").symlink_to(model / "shared.onnx")
    assert "symbolic link" in refused(model, "escape.py")
    assert "symbolic link" in refused(model, "out/secret")
    assert inside(model, model / "1", "back", "s") == model / "1" / "back"  # a link that stays inside


def test_linked_model_and_version_folders_are_the_operators_and_bound_what_they_hold(tmp_path: Path) -> None:
    store = tmp_path / "store"
    (store / "m" / "1").mkdir(parents=True)
    (store / "v2").mkdir()
    (tmp_path / "repo").mkdir()
    model = tmp_path / "repo" / "m"
    model.symlink_to(store / "m", target_is_directory=True)
    (store / "m" / "2").symlink_to(store / "v2", target_is_directory=True)
    assert inside(model, model / "1", "model.onnx", "s") == model / "1" / "model.onnx"
    assert inside(model, model / "2", "model.onnx", "s") == model / "2" / "model.onnx"
    (store / "v2" / "escape").symlink_to(tmp_path / "repo")
    assert "symbolic link" in refused(model, "escape", model / "2")


def test_a_loop_of_links_is_refused_or_left_to_fail_when_opened(model: Path) -> None:
    (model / "1" / "a").symlink_to(model / "1" / "b")
    (model / "1" / "b").symlink_to(model / "1" / "a")
    try:  # Python before 3.13 reports the loop while resolving; later ones resolve as far as they can
        assert inside(model, model / "1", "a", "s") == model / "1" / "a"
    except ServerError as exc:
        assert exc.code is ErrorCode.INVALID_ARG
