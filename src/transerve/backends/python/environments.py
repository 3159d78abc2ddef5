"""Execution environments: the python backend's `EXECUTION_ENV_PATH` model parameter.

A model may name a Python environment of its own (say with NumPy 1 where the server has NumPy 2): a folder, or an
archive of one as conda-pack makes it (`.tar.gz`), holding `bin/activate` and a `bin/python`. As in Triton, the
model's worker starts after `source bin/activate`, with the environment's `lib` first on LD_LIBRARY_PATH, and runs
on the environment's interpreter. transerve's worker needs nothing of the server's environment but NumPy (which the
environment must have, with a Python of 3.10 or later): it gets transerve's own package on its path, alone, so
that none of the server's other packages leaks into the model's environment.

`$$TRITON_MODEL_DIRECTORY` in the path is the model's folder (its first occurrence, as Triton replaces it). The
path, symbolic links resolved, must lie inside the model's repository or inside the model's folder (which may be
a link from the repository to elsewhere): a model cannot run an interpreter found elsewhere on the server,
whoever wrote its config. The bound is the repository rather than the model's folder because models share
environments, as Triton's own QA does with one at the top of the repository; for a model loaded with `file:`
contents, the repository is the private folder those files were written to. An archive is extracted once per
server into a private cache folder (again if the archive changes), with tarfile's `data` filter (no absolute
paths, no escaping links, no devices) and a bound on the bytes it unpacks; the cache is removed when the server
exits.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shlex
import shutil
import tarfile
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

from transerve.core.errors import ErrorCode, ServerError

#: The config parameter, and the placeholder Triton replaces in it.
PARAMETER = "EXECUTION_ENV_PATH"
MODEL_DIRECTORY = "$$TRITON_MODEL_DIRECTORY"
#: Bytes an archive may unpack to unless `--backend-config=python,execution-env-max-bytes=N` says otherwise.
DEFAULT_MAX_BYTES = 8 * 1024**3


@dataclass(frozen=True, slots=True)
class Interpreter:
    """How a worker starts: the command before `-m transerve.backends.python.worker`, and its environment."""

    command: tuple[str, ...]
    environment: dict[str, str]


class ExecutionEnvironments:
    """The execution environments of one server's python models, archives extracted once."""

    def __init__(self) -> None:
        self._root: Path | None = None
        #: Archive (canonical path) -> ((mtime ns, size) it was extracted at, its folder).
        self._extracted: dict[Path, tuple[tuple[int, int], Path]] = {}
        self._locks: dict[Path, asyncio.Lock] = {}

    async def interpreter(
        self, setting: str, model_path: Path, repository_path: Path, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> Interpreter:
        """The interpreter of the environment an `EXECUTION_ENV_PATH` value names (ServerError if unusable)."""
        location = self._locate(setting, model_path, repository_path)
        folder = location if location.is_dir() else await self._extract(location, max_bytes)
        activate = folder / "bin" / "activate"
        if not activate.is_file():
            raise _error(
                f"Path {activate} does not exist. The Python environment should contain an 'activate' script."
            )
        python = next((path for path in (folder / "bin" / "python3", folder / "bin" / "python") if path.exists()), None)
        if python is None:
            raise _error(f"the Python environment {folder} has no bin/python3 or bin/python")
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self._worker_path()), os.environ.get(
            "PYTHONPATH")]))
        script = (
            f'source {shlex.quote(str(activate))} && exec env LD_LIBRARY_PATH={shlex.quote(str(folder / "lib"))}'
            '${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$@"'
        )
        return Interpreter(("bash", "-c", script, "bash", str(python)), environment)

    @staticmethod
    def _locate(setting: str, model_path: Path, repository_path: Path) -> Path:
        path = setting.replace(MODEL_DIRECTORY, str(model_path), 1)
        try:
            location = Path(path).resolve(strict=True)
        except (OSError, RuntimeError):
            raise _error(f"Failed to get the canonical path for {path}.") from None
        if not any(location.is_relative_to(root.resolve()) for root in (repository_path, model_path)):
            raise ServerError(
                ErrorCode.INVALID_ARG,
                f"{PARAMETER} '{setting}' is outside the model repository: an execution environment must lie in it",
            )
        return location

    async def _extract(self, archive: Path, max_bytes: int) -> Path:
        lock = self._locks.setdefault(archive, asyncio.Lock())
        async with lock:
            stat = archive.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            known = self._extracted.get(archive)
            if known is not None and known[0] == stamp and known[1].is_dir():
                return known[1]
            root = self._cache_root()
            folder = root / hashlib.sha256(f"{archive}:{stamp}".encode()).hexdigest()[:16]
            await asyncio.to_thread(_unpack, archive, folder, max_bytes)
            if known is not None and known[1] != folder:
                shutil.rmtree(known[1], ignore_errors=True)
            self._extracted[archive] = (stamp, folder)
            return folder

    def _cache_root(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="transerve-python-envs-"))
            weakref.finalize(self, shutil.rmtree, self._root, True)
        return self._root

    def _worker_path(self) -> Path:
        """A folder holding only transerve's package (a link to it), for the environment's PYTHONPATH."""
        folder = self._cache_root() / "worker-path"
        link = folder / "transerve"
        if not link.exists():
            folder.mkdir(exist_ok=True)
            link.symlink_to(Path(__file__).resolve().parents[2], target_is_directory=True)
        return folder


def _unpack(archive: Path, folder: Path, max_bytes: int) -> None:
    """Extract `archive` into `folder` (created here), refusing unsafe members and more than `max_bytes`."""
    if not hasattr(tarfile, "data_filter"):
        raise _error("extracting an execution environment safely needs Python 3.10.12, 3.11.4 or later")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    total = 0
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                total += max(member.size, 0)
                if total > max_bytes:
                    raise _error(f"the execution environment {archive} unpacks to more than {max_bytes} bytes")
                tar.extract(member, partial, filter="data")
    except (tarfile.TarError, OSError) as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise _error(f"cannot extract the execution environment {archive}: {exc}") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def _error(message: str) -> ServerError:
    return ServerError(ErrorCode.INTERNAL, message)
