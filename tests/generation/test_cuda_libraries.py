"""Preloading CUDA 12's cuBLAS from its PyPI package for CTranslate2 (`cuda_libraries`), on fake package folders:
found through importlib wherever the package is installed, loaded in order, skipped when the libraries load
already or the package is absent, and a file that is no library logged with the reason, never raised."""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path

import pytest

from transerve.backends.generation.cuda_libraries import CUBLAS_LIBRARIES, load_global, package_libraries, preload


@pytest.fixture
def fake_package(tmp_path: Path, monkeypatch) -> Path:
    """An installed `nvidia.cublas` (a namespace package, as nvidia-cublas-cu12's) whose lib folder holds files of
    the libraries' names that are no libraries; returns that folder."""
    folder = tmp_path / "site" / "nvidia" / "cublas" / "lib"
    folder.mkdir(parents=True)
    for name in CUBLAS_LIBRARIES:
        (folder / name).write_text("not a shared library\n")
    for module in ("nvidia", "nvidia.cublas"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    return folder


class Loader:
    """Records what it is asked to load; names without a folder (the loader's search path) do not load."""

    def __init__(self, by_name: bool = False, real: bool = False) -> None:
        self.by_name = by_name
        #: Paths go to the real loader (`load_global`).
        self.real = real
        self.asked: list[str] = []

    def __call__(self, name: str) -> object:
        self.asked.append(name)
        if "/" not in name and not self.by_name:
            raise OSError(f"{name}: cannot open shared object file: No such file or directory")
        return load_global(name) if self.real else object()


def test_the_package_folder_is_found_through_importlib(fake_package):
    assert package_libraries("nvidia.cublas") == fake_package


def test_the_libraries_load_from_the_package_by_path_lt_first(fake_package):
    loader = Loader()
    loaded = preload(load=loader)
    assert loaded == [fake_package / "libcublasLt.so.12", fake_package / "libcublas.so.12"]
    assert loader.asked == ["libcublas.so.12", *map(str, loaded)]


def test_nothing_is_loaded_from_the_package_when_the_libraries_load_already(fake_package):
    loader = Loader(by_name=True)
    assert preload(load=loader) == []
    assert loader.asked == ["libcublas.so.12"]


def test_without_the_package_nothing_happens():
    loader = Loader()
    assert preload(package="transerve_no_such_package.cublas", load=loader) == []
    assert package_libraries("transerve_no_such_package.cublas") is None
    assert loader.asked == ["libcublas.so.12"]


def test_a_file_that_is_no_library_is_logged_with_the_reason_not_raised(fake_package, caplog):
    with caplog.at_level(logging.WARNING, logger="transerve.backends.generation.cuda_libraries"):
        assert preload(load=Loader(real=True)) == []
    (record,) = caplog.records
    assert str(fake_package / "libcublasLt.so.12") in record.getMessage()
    assert "CTranslate2 on a GPU needs it" in record.getMessage()
    assert "invalid ELF header" in record.getMessage() or "file too short" in record.getMessage()
