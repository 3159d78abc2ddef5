"""A model repository on object storage, mirrored into a local cache folder one model at a time.

The loaders only ever read the local copy, so every path check that guards a local repository applies to it.
A model is downloaded whole, into a staging folder swapped in when complete; it is downloaded again only when
the bucket's listing of it (names, sizes, etags or modification times; never contents) changed."""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
import threading
from pathlib import Path, PurePosixPath
from typing import Any

from transerve.repository.credentials import CredentialError, storage_options
from transerve.repository.storage_url import StorageUrl

log = logging.getLogger("transerve")

#: The packages that read each scheme, and the extra that brings them.
_PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "as": "adlfs"}
EXTRA = "cloud"


class StorageError(Exception):
    """A remote repository or one of its models cannot be read or downloaded."""


class RemoteRepository:
    """One `s3://`, `gs://` or `as://` repository and its local mirror under `cache`."""

    def __init__(self, url: StorageUrl, cache: Path, max_model_bytes: int) -> None:
        self.url = url
        self.local = cache.resolve()
        self.max_model_bytes = max_model_bytes
        #: The model folders the last listing found.
        self.models: set[str] = set()
        #: Each downloaded model's listing digest, to download again only what changed.
        self._downloaded: dict[str, str] = {}
        #: Downloads run one at a time (from worker threads), whoever asks.
        self._lock = threading.Lock()
        self._fs: Any = None

    def _filesystem(self) -> Any:
        if self._fs is None:
            package = _PACKAGES[self.url.scheme]
            try:
                __import__(package)
                import fsspec
            except ImportError:
                raise StorageError(f"model repository {self.url} needs the package '{package}': "
                                   f"pip install 'transerve[{EXTRA}]'") from None
            try:
                self._fs = fsspec.filesystem(self.url.protocol, **storage_options(self.url))
            except CredentialError as exc:
                raise StorageError(str(exc)) from None
        return self._fs

    def list_models(self) -> set[str]:
        """Read which model folders the repository holds (StorageError when it cannot be read: no such bucket,
        credentials refused)."""
        fs = self._filesystem()
        try:
            entries = fs.ls(self.url.root, detail=True, refresh=True)
        except FileNotFoundError:
            raise StorageError(f"model repository {self.url} does not exist (no such bucket or path)") from None
        except Exception as exc:  # each provider raises its own errors: permission, network, bad endpoint
            raise StorageError(f"model repository {self.url} cannot be read: {_reason(exc)}") from None
        names = {PurePosixPath(entry["name"]).name for entry in entries if entry.get("type") == "directory"}
        self.models = {name for name in names if name and not name.startswith(".")}
        with self._lock:
            for gone in set(self._downloaded) - self.models:
                self._remove(gone)
        return self.models

    def download(self, name: str) -> None:
        """Bring the local copy of model `name` up to date with the bucket (nothing to do when unchanged)."""
        with self._lock:
            listing = self._listing(name)
            digest = hashlib.sha1(repr(sorted(listing.items())).encode()).hexdigest()
            if self._downloaded.get(name) == digest and (self.local / name).is_dir():
                return
            total = sum(size for size, _ in listing.values())
            if total > self.max_model_bytes:
                raise StorageError(f"model '{name}' in {self.url} holds {total} bytes, more than the "
                                   f"{self.max_model_bytes} that --model-repository-max-model-bytes allows")
            self._fetch(name, listing)
            self._downloaded[name] = digest
            log.info("downloaded model '%s' from %s (%d files, %d bytes)", name, self.url, len(listing), total)

    def _listing(self, name: str) -> dict[str, tuple[int, str]]:
        """Every object under the model's folder, by its key relative to the folder: (size, etag or mtime)."""
        fs = self._filesystem()
        folder = f"{self.url.root}/{name}"
        try:
            found = fs.find(folder, detail=True, refresh=True)
        except Exception as exc:
            raise StorageError(f"model '{name}' in {self.url} cannot be listed: {_reason(exc)}") from None
        listing = {}
        for key, info in found.items():
            if info.get("type") == "directory":
                continue
            if not key.startswith(folder + "/"):
                continue  # an object named as the folder itself
            relative = key[len(folder) + 1:]
            _check_key(name, relative)
            stamp = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
            listing[relative] = (int(info.get("size") or 0), str(stamp))
        if not listing:
            raise StorageError(f"model '{name}' is not in {self.url}")
        return listing

    def _fetch(self, name: str, listing: dict[str, tuple[int, str]]) -> None:
        """Download into a staging folder, then swap it in for the old copy."""
        fs = self._filesystem()
        staging_root = self.local / ".staging"
        staging_root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=staging_root))
        try:
            written = 0
            for relative in sorted(listing):
                target = staging / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(f"{self.url.root}/{name}/{relative}", str(target))
                written += target.stat().st_size
                if written > self.max_model_bytes:  # an object replaced by a larger one since the listing
                    raise StorageError(f"model '{name}' in {self.url} grew past --model-repository-max-model-bytes "
                                       "while it was downloaded")
        except StorageError:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        except Exception as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise StorageError(f"model '{name}' cannot be downloaded from {self.url}: {_reason(exc)}") from None
        self._remove(name)
        staging.rename(self.local / name)

    def _remove(self, name: str) -> None:
        """Drop the local copy (a loaded model keeps its open files; a reload downloads it anew)."""
        self._downloaded.pop(name, None)
        current = self.local / name
        if current.exists():
            old = Path(tempfile.mkdtemp(prefix=f"{name}-old-", dir=self.local / ".staging"))
            current.rename(old / name)
            shutil.rmtree(old, ignore_errors=True)


def _check_key(model: str, relative: str) -> None:
    """An object's key must name a file inside the model's folder: no absolute name, no `..`, no empty part."""
    parts = relative.split("/")
    if relative.startswith("/") or "\\" in relative or "\0" in relative or any(p in ("", ".", "..") for p in parts):
        raise StorageError(f"model '{model}' holds an object named '{relative}', which would land outside its "
                           "folder: refused")


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
