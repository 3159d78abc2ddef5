"""The generation tests' shared fixture: the torch engine's test models, built once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from support.generation_models import ARCHITECTURES, build_generation_model
    from support.torch_engine import Model

    root = tmp_path_factory.mktemp("torch_engine")
    built = {arch: Model(arch, build_generation_model(arch, root / arch)) for arch in ARCHITECTURES}
    yield built
    for model in built.values():
        model.engine.close()
