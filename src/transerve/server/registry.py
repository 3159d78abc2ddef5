"""The registry of models: what is loaded, in which state, and the read-only questions frontends ask of it
(readiness, metadata, config, the repository index, statistics)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2

from transerve.backends.base import BackendInstance, BackendModel
from transerve.config.model_config import backend_name
from transerve.core.engine_load import EngineLoad
from transerve.core.errors import ServerError, invalid_arg, not_found, unavailable
from transerve.core.signature import ModelSignature
from transerve.core.stats import ModelStats
from transerve.repository.remote import RemoteRepository
from transerve.repository.repository import ModelRepository
from transerve.scheduling import Scheduler


class ModelState(enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(slots=True)
class ModelVersion:
    """One loaded, servable version of a model."""

    name: str
    version: str
    config: model_config_pb2.ModelConfig
    config_dict: dict[str, Any]
    signature: ModelSignature
    backend_model: BackendModel
    scheduler: Scheduler
    stats: ModelStats
    #: The config's `model_transaction_policy.decoupled`, read once: a protobuf lookup per request costs more.
    decoupled: bool = False
    #: Each output's labels from its `label_filename`, for the classification extension.
    labels: dict[str, list[str]] = field(default_factory=dict)
    #: The version's folder (`<model>/<version>`), where frontends find files beside the model (a tokenizer).
    path: Path | None = None
    #: Each instance and its group's signature (`instance_update`); None where the instances cannot be updated in
    #: place (a backend that cannot add them).
    instance_groups: list[tuple[BackendInstance, bytes]] | None = None

    def engine_load(self) -> EngineLoad | None:
        """The instances' engines' load, where they schedule their own sequences (None where none does)."""
        loads = [load for instance in self.backend_model.instances if (load := instance.engine_load()) is not None]
        return EngineLoad.total(loads) if loads else None


@dataclass(slots=True)
class ModelRecord:
    """A model name: its serving versions, and the state and reason shown in the repository index."""

    name: str
    state: ModelState
    reason: str = ""
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    #: Versions that failed to load, with why.
    failed: dict[int, str] = field(default_factory=dict)
    fingerprint: str = ""
    #: The folder a load request's `file:` contents were written to; removed with the record.
    override_path: Path | None = None
    #: The config the versions were loaded from (normalized, before the backend completed it) and the fingerprint
    #: of the model's files but its config: what a later load compares to update the instances in place.
    source_config: model_config_pb2.ModelConfig | None = None
    files_fingerprint: str = ""

    def latest(self) -> ModelVersion | None:
        return self.versions[max(self.versions)] if self.versions else None


def _servable(model: ModelVersion) -> ModelVersion:
    """A loaded version, unless its backend gave it up (`BackendModel.unavailable`)."""
    if model.backend_model.unavailable:
        raise unavailable(f"model '{model.name}' is not ready (UNAVAILABLE): {model.backend_model.unavailable}")
    return model


class ModelRegistry:
    """The models by name and the questions asked of them; `Server` adds loading and the request path."""

    def __init__(self, repositories: list[Path], remotes: list[RemoteRepository] | None = None) -> None:
        self.repository = ModelRepository(repositories, remotes)
        self._models: dict[str, ModelRecord] = {}

    def get_version(self, name: str, version: str = "") -> ModelVersion:
        """The serving version a request names, or the error Triton gives."""
        record = self._models.get(name)
        if record is None:
            raise not_found(f"Request for unknown model: '{name}' is not found")
        if version:
            serving = record.versions.get(int(version)) if version.isdigit() else None
            if serving is None:
                raise not_found(f"Request for unknown model: '{name}' version {version} is not found")
            return _servable(serving)
        latest = record.latest()
        if latest is None:
            reason = f": {record.reason}" if record.reason else ""
            raise unavailable(f"model '{name}' is not ready ({record.state.value}){reason}")
        return _servable(latest)

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            self.get_version(name, version)
        except ServerError:
            return False
        return True

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        """As Triton: a request naming a version lists that version, one naming none every ready version."""
        model = self.get_version(name, version)
        versions = sorted(self._models[name].versions) if not version else [int(model.version)]
        return {
            "name": name,
            "versions": [str(v) for v in versions],
            "platform": model.config.platform or backend_name(model.config),
            "inputs": model.signature.metadata_tensors("inputs"),
            "outputs": model.signature.metadata_tensors("outputs"),
        }

    def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        return self.get_version(name, version).config_dict

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Every model in the repositories, loaded or not, with its state and reason."""
        found, _ = self.repository.scan()
        entries: list[dict[str, str]] = []
        for name in sorted(set(found) | set(self._models)):
            record = self._models.get(name)
            if record is None:
                if not ready_only:
                    entries.append({"name": name})
                continue
            if record.versions or record.failed:
                for version in sorted(set(record.versions) | set(record.failed)):
                    given_up = version in record.versions and record.versions[version].backend_model.unavailable
                    if version in record.versions and not given_up:
                        entries.append({"name": name, "version": str(version), "state": "READY"})
                    elif not ready_only:
                        entries.append({"name": name, "version": str(version), "state": "UNAVAILABLE",
                                        "reason": given_up or record.failed[version]})
            elif not ready_only or record.state is ModelState.READY:
                entry = {"name": name, "state": record.state.value}
                if record.reason:
                    entry["reason"] = record.reason
                entries.append(entry)
        return entries

    def serving_versions(self) -> list[ModelVersion]:
        """Every loaded version, for metrics."""
        return [model for record in self._models.values() for _, model in sorted(record.versions.items())]

    def statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        if name:
            record = self._models.get(name)
            if record is None or not record.versions:
                raise invalid_arg(f"requested model '{name}' is not available")
            if version:
                model = record.versions.get(int(version)) if version.isdigit() else None
                if model is None:
                    raise invalid_arg(f"requested model version is not available for model '{name}'")
                models = [model]
            else:
                models = [record.versions[v] for v in sorted(record.versions)]
        else:
            models = self.serving_versions()
        return {"model_stats": [m.stats.as_dict(m.name, m.version) for m in models]}
