"""The real NVIDIA Triton (2.51, from the `nvidia-pytriton` wheel) as a reference server for differential tests.

Triton runs from its own virtualenv because pytriton pins numpy<2, which the project's environment does not.
The venv is found at $TRANSERVE_TRITON_VENV or `<repo>/.triton-venv`, and created with pip when it is missing,
so a fresh machine needs nothing but network access to PyPI. When Triton cannot be had, `require_triton()`
skips the test with the reason, except under CI (env var `CI` set), where a missing reference is a failure:
a CI run that silently skipped every differential test would prove nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .servers import DEFAULT_READY_TIMEOUT_S, EXAMPLE_REPOSITORY, REPO_ROOT, ServerProcess, start_server

PYTRITON_REQUIREMENT = "nvidia-pytriton==0.7.0"
"""The last pytriton whose bundled tritonserver (2.51) runs the python backend on a CPU-only machine."""

VENV_ENV_VAR = "TRANSERVE_TRITON_VENV"
PIP_INSTALL_TIMEOUT_S = 1800


class TritonUnavailable(RuntimeError):
    """Triton could not be found or installed; the message says why, for a skip or failure reason."""


@dataclass(frozen=True)
class TritonInstall:
    """Paths of a usable tritonserver inside a virtualenv."""

    venv: Path
    server_dir: Path
    """`pytriton/tritonserver`, holding bin/, backends/ and python_backend_stubs/."""

    @property
    def binary(self) -> Path:
        return self.server_dir / "bin" / "tritonserver"

    @property
    def backends(self) -> Path:
        return self.server_dir / "backends"

    @property
    def libs(self) -> Path:
        """The shared libraries auditwheel vendored next to the package; tritonserver needs them on LD_LIBRARY_PATH."""
        return self.server_dir.parent.parent / "nvidia_pytriton.libs"

    def env(self) -> dict[str, str]:
        """The environment tritonserver runs in: the venv first on PATH is how the python stub finds numpy."""
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(self.venv / "bin"), env.get("PATH", "")])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(self.libs), env.get("LD_LIBRARY_PATH")]))
        env.pop("PYTHONPATH", None)
        env.pop("PYTHONHOME", None)
        return env


def triton_venv_path() -> Path:
    return Path(os.environ.get(VENV_ENV_VAR) or REPO_ROOT / ".triton-venv")


def in_ci() -> bool:
    """True when env var CI is set to anything but an explicit no ("", "0", "false", "no")."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _locate_server_dir(python: Path) -> Path | None:
    """Ask the venv's interpreter where pytriton is, without importing it (importing it is slow)."""
    probe = "import importlib.util as u, os; s = u.find_spec('pytriton'); print(os.path.dirname(s.origin) if s else '')"
    result = _run([str(python), "-c", probe], timeout=60)
    if result.returncode != 0 or not result.stdout.strip():
        return None
    server_dir = Path(result.stdout.strip()) / "tritonserver"
    return server_dir if (server_dir / "bin" / "tritonserver").is_file() else None


def _install(venv: Path) -> None:
    """Create the venv (if needed) and pip install pytriton into it; raise TritonUnavailable with pip's words."""
    python = venv / "bin" / "python"
    if not python.exists():
        result = _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
        if result.returncode != 0:
            raise TritonUnavailable(f"cannot create a virtualenv at {venv}:\n{_tail(result.stderr)}")
    try:
        result = _run(
            [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--timeout", "60",
             PYTRITON_REQUIREMENT],
            timeout=PIP_INSTALL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise TritonUnavailable(f"pip install {PYTRITON_REQUIREMENT} took more than {exc.timeout:.0f} s") from exc
    if result.returncode != 0:
        raise TritonUnavailable(
            f"pip install {PYTRITON_REQUIREMENT} into {venv} failed (no network to PyPI, or no wheel for this "
            f"platform):\n{_tail(result.stdout + result.stderr)}"
        )


def _install_stub(python: Path, server_dir: Path) -> None:
    """Put the python-backend stub built for the venv's Python where the backend looks for it.

    The wheel ships one stub per Python version under python_backend_stubs/; the backend only runs the one in
    backends/python/, and the wheel leaves that empty.
    """
    result = _run([str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], timeout=60)
    version = result.stdout.strip()
    source = server_dir / "python_backend_stubs" / version / "triton_python_backend_stub"
    target = server_dir / "backends" / "python" / "triton_python_backend_stub"
    if not source.is_file():
        raise TritonUnavailable(f"{PYTRITON_REQUIREMENT} has no python backend stub for Python {version!r}")
    if not target.is_file() or target.stat().st_size != source.stat().st_size:
        shutil.copy2(source, target)


_outcome: TritonInstall | TritonUnavailable | None = None
"""find_triton's result or failure, kept for the process: installing is tried at most once per session."""


def find_triton() -> TritonInstall:
    """Return a usable Triton install, creating the venv when missing; raise TritonUnavailable otherwise.

    The failure is remembered as well as the success, so a session without network does not retry a slow
    pip install in every test that wants Triton.
    """
    global _outcome
    if _outcome is None:
        try:
            _outcome = _find_or_install()
        except TritonUnavailable as exc:
            _outcome = exc
    if isinstance(_outcome, TritonUnavailable):
        raise _outcome
    return _outcome


def _find_or_install() -> TritonInstall:
    """A file lock serialises creation, so concurrent test sessions never pip install into the same venv at once."""
    if not sys.platform.startswith("linux"):
        raise TritonUnavailable(f"tritonserver from {PYTRITON_REQUIREMENT} only runs on Linux, not {sys.platform}")
    venv = triton_venv_path()
    # The lock lives inside the venv folder (created empty first, which `python -m venv` accepts), so that
    # nothing is left beside it in the checkout.
    venv.mkdir(parents=True, exist_ok=True)
    with open(venv / ".transerve-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        python = venv / "bin" / "python"
        server_dir = _locate_server_dir(python) if python.exists() else None
        if server_dir is None:
            _install(venv)
            server_dir = _locate_server_dir(python)
            if server_dir is None:
                raise TritonUnavailable(f"{PYTRITON_REQUIREMENT} installed into {venv} but has no tritonserver binary")
        _install_stub(python, server_dir)
    return TritonInstall(venv=venv, server_dir=server_dir)


def require_triton() -> TritonInstall:
    """`find_triton()` for tests: skip when Triton is unavailable, fail instead under CI."""
    import pytest  # imported here so that benchmarks can use this module without pytest installed

    try:
        return find_triton()
    except TritonUnavailable as exc:
        reason = f"reference Triton unavailable: {exc}"
        if in_ci():
            pytest.fail(f"{reason}\n(CI is set, so a missing reference server is a failure, not a skip)")
        pytest.skip(reason)


def triton_argv(install: TritonInstall, repository: Path, http_port: int, grpc_port: int, metrics_port: int,
                *extra: str) -> list[str]:
    """tritonserver's command line, every service bound to loopback."""
    return [
        str(install.binary),
        f"--model-repository={repository}",
        f"--backend-directory={install.backends}",
        "--http-address=127.0.0.1",
        "--grpc-address=127.0.0.1",
        "--metrics-address=127.0.0.1",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        *extra,
    ]


@contextlib.contextmanager
def start_triton(
    repository: str | os.PathLike[str] = EXAMPLE_REPOSITORY,
    *extra_args: str,
    install: TritonInstall | None = None,
    ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
) -> Iterator[ServerProcess]:
    """Run the real tritonserver on a copy of `repository` until the block exits.

    It serves a copy because Triton writes `__pycache__` into the repository it loads. Raises TritonUnavailable
    when Triton cannot be had and `install` is not given; tests should call `require_triton()` first.
    """
    install = install or find_triton()
    with tempfile.TemporaryDirectory(prefix="triton-test-") as tmp:
        copy = Path(tmp) / "model_repository"
        shutil.copytree(repository, copy, ignore=shutil.ignore_patterns("__pycache__"))
        server = start_server(
            "tritonserver",
            lambda http, grpc, metrics: triton_argv(install, copy, http, grpc, metrics, *extra_args),
            log_dir=Path(tmp),
            env=install.env(),
            cwd=Path(tmp),
            ready_timeout=ready_timeout,
        )
        try:
            yield server
        finally:
            server.stop()
