"""Scan `<repository>/<model>/<version>/` folders and apply each model's version policy."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2

from transerve.config.model_config import ConfigError
from transerve.repository.remote import RemoteRepository, StorageError

log = logging.getLogger("transerve")


@dataclass(frozen=True, slots=True)
class ModelLocation:
    """Where a model lives: its folder and the repository that holds it."""

    name: str
    path: Path
    repository: Path


class DuplicateModelError(ConfigError):
    """Two repositories hold a model of the same name."""


#: The longest model name: a folder name (Linux's NAME_MAX), in bytes.
MAX_MODEL_NAME_BYTES = 255


def is_plain_model_name(name: str) -> bool:
    """A model name must be one plain path component, so it can never point outside the repository, and short
    enough to be a folder's name."""
    return (bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name
            and len(name.encode("utf-8", "surrogatepass")) <= MAX_MODEL_NAME_BYTES)


class ModelRepository:
    """One or more repository folders, read on demand (never cached, so polling sees changes), and repositories on
    object storage, whose models are read from their local mirrors (`refresh` and `fetch` bring them up to date)."""

    def __init__(self, paths: list[Path], remotes: list[RemoteRepository] | None = None) -> None:
        self.paths = [path.resolve() for path in paths]
        self.remotes = list(remotes or [])

    def refresh(self, download: bool) -> None:
        """List each remote repository's models (StorageError when one cannot be read); with `download`, bring
        every local copy up to date, a model that fails to download keeping the copy it has."""
        for remote in self.remotes:
            for name in sorted(remote.list_models()):
                if download:
                    try:
                        remote.download(name)
                    except StorageError as exc:
                        log.error("%s", exc)

    def fetch(self, name: str) -> None:
        """Bring one model's local copy up to date, if a remote repository holds it (StorageError if it fails)."""
        for remote in self.remotes:
            if name in remote.list_models():
                remote.download(name)

    def _folders(self) -> list[tuple[Path, list[str]]]:
        """Each repository's local folder, with the model names it holds."""
        folders = []
        for repository in self.paths:
            if repository.is_dir():
                names = [entry.name for entry in sorted(repository.iterdir())
                         if entry.is_dir() and not entry.name.startswith(".")]
                folders.append((repository, names))
        folders.extend((remote.local, sorted(remote.models)) for remote in self.remotes)
        return folders

    def scan(self) -> tuple[dict[str, ModelLocation], dict[str, str]]:
        """All model folders by name, plus errors for names found in more than one repository."""
        found: dict[str, ModelLocation] = {}
        duplicates: dict[str, str] = {}
        for repository, names in self._folders():
            for name in names:
                entry = repository / name
                if entry.name in found:
                    duplicates[entry.name] = (
                        f"model '{entry.name}' appears in two repositories: {found[entry.name].repository} "
                        f"and {repository}"
                    )
                    continue
                found[entry.name] = ModelLocation(entry.name, entry, repository)
        for name in duplicates:
            found.pop(name, None)
        return found, duplicates

    def locate(self, name: str) -> ModelLocation | None:
        """The folder of one model, or None."""
        if not is_plain_model_name(name):
            return None
        matches = [repo / name for repo, names in self._folders() if name in names]
        if len(matches) > 1:
            raise DuplicateModelError(f"model '{name}' appears in more than one repository: {matches}")
        if not matches:
            return None
        return ModelLocation(name, matches[0], matches[0].parent)


def available_versions(model_path: Path) -> list[int]:
    """Numeric sub-folders of a model folder, ascending."""
    versions = []
    for entry in model_path.iterdir():
        if entry.is_dir() and entry.name.isdigit() and not (len(entry.name) > 1 and entry.name[0] == "0"):
            versions.append(int(entry.name))
    return sorted(versions)


def select_versions(policy: model_config_pb2.ModelVersionPolicy, available: list[int]) -> list[int]:
    """The versions a policy serves, ascending; an empty list means nothing to serve."""
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return list(available)
    if which == "specific":
        wanted = set(policy.specific.versions)
        missing = sorted(wanted - set(available))
        if missing:
            raise ConfigError(f"version policy names versions {missing} that have no folder")
        return sorted(wanted)
    count = policy.latest.num_versions if which == "latest" and policy.latest.num_versions > 0 else 1
    return available[-count:] if available else []
