"""The label files a model's outputs name (`label_filename`), read when the model loads, for Triton's
classification extension (`core/classification.py` prints the labels; this reads them from the model's folder)."""

from __future__ import annotations

from pathlib import Path

from tritonclient.grpc import model_config_pb2

from transerve.core.errors import invalid_arg
from transerve.repository.paths import inside


def load_labels(model_path: Path, config: model_config_pb2.ModelConfig) -> dict[str, list[str]]:
    """Each output's labels (the lines of its `label_filename`, relative to the model's folder); a file that
    cannot be read fails the model's load, as in Triton."""
    labels = {}
    for output in config.output:
        if not output.label_filename:
            continue
        path = inside(model_path, model_path, output.label_filename, f"output '{output.name}' label_filename")
        try:
            labels[output.name] = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise invalid_arg(f"failed to open text file for read {path}: {reason}") from None
    return labels
