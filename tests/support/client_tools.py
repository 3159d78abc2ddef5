"""The benchmark and evaluation clients people point at an OpenAI-compatible server (lm-eval, aiperf, guidellm),
run as subprocesses from a virtualenv of their own.

They pin packages the project's environment has newer, so they live apart: at $TRANSERVE_TOOLS_VENV or
`<repo>/.tools-venv`, created with one pip call when missing or when its versions differ from the pins below.
torch is pinned in the same call (guidellm needs it) to the CPU build the project runs on, so the tools never
bring a CUDA torch along. As for the reference Triton, `require_tools()` skips a test when the venv cannot be
had, except under CI (env var `CI` set), where that is a failure.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .servers import REPO_ROOT
from .triton_reference import in_ci

#: distribution name -> the exact version the tests were written against.
PINS = {"lm_eval": "0.4.13", "aiperf": "0.13.0", "guidellm": "0.8.1", "torch": "2.13.0"}
#: One pip call: lm-eval's `api` extra holds what local-completions needs (aiohttp, tenacity, tiktoken).
REQUIREMENTS = ("lm-eval[api]==0.4.13", "aiperf==0.13.0", "guidellm==0.8.1", "torch==2.13.0")

VENV_ENV_VAR = "TRANSERVE_TOOLS_VENV"
_OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
PIP_INSTALL_TIMEOUT_S = 1200

#: Prints each pinned distribution's installed version (or "-"), and whether torch was built for CUDA.
_PROBE = (
    "import importlib.metadata as m, json, sys\n"
    "found = {}\n"
    "for name in sys.argv[1:]:\n"
    "    try: found[name] = m.version(name)\n"
    "    except m.PackageNotFoundError: found[name] = '-'\n"
    "found['cuda'] = sorted(d.metadata['Name'] for d in m.distributions()\n"
    "                       if (d.metadata['Name'] or '').lower().startswith(('nvidia-cu', 'nvidia-cudnn')))\n"
    "print(json.dumps(found))\n"
)


class ToolsUnavailable(RuntimeError):
    """The tools venv could not be found or built; the message says why, for a skip or failure reason."""


@dataclass(frozen=True)
class ClientTools:
    """A virtualenv holding the pinned client tools."""

    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def command(self, name: str) -> Path:
        """A program of the venv's bin/ (`lm_eval`, `aiperf`, `guidellm`, `python`)."""
        return self.venv / "bin" / name

    def env(self, offline: bool = True) -> dict[str, str]:
        """The environment the tools run in: the venv first on PATH, nothing of the project's interpreter leaking
        in, and (`offline`) Hugging Face's offline switches, since every tokenizer is a local folder."""
        env = {key: value for key, value in os.environ.items()
               if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", *_OFFLINE)}
        env.update(PATH=os.pathsep.join([str(self.venv / "bin"), env.get("PATH", "")]), PYTHONUNBUFFERED="1",
                   TOKENIZERS_PARALLELISM="false", NO_COLOR="1")
        if offline:
            env.update(dict.fromkeys(_OFFLINE, "1"))
        return env

    def run(self, argv: list[str], cwd: Path, timeout: float, offline: bool = True) -> subprocess.CompletedProcess[str]:
        """Run `argv` (its first item a program of the venv's bin/) to its end under `timeout`.

        In a process group of its own, killed whole past the timeout: aiperf runs its services as child
        processes, which would outlive a killed parent."""
        process = subprocess.Popen([str(self.command(argv[0])), *argv[1:]], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=cwd,
                                   env=self.env(offline), start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
        return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def tools_venv_path() -> Path:
    return Path(os.environ.get(VENV_ENV_VAR) or REPO_ROOT / ".tools-venv")


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _installed(python: Path) -> dict[str, object] | None:
    import json

    result = subprocess.run([str(python), "-c", _PROBE, *PINS], capture_output=True, text=True, timeout=120,
                            check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def _matches(found: dict[str, object] | None) -> bool:
    """Every pin installed at its version; torch's local label (`+cpu`) is not part of the pin."""
    return found is not None and all(str(found[name]).split("+")[0] == version for name, version in PINS.items())


def _install(venv: Path) -> None:
    python = venv / "bin" / "python"
    if not python.exists():
        result = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True,
                                timeout=300, check=False)
        if result.returncode != 0:
            raise ToolsUnavailable(f"cannot create a virtualenv at {venv}:\n{_tail(result.stderr)}")
    argv = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--timeout", "60",
            *REQUIREMENTS]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_INSTALL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ToolsUnavailable(f"pip install {' '.join(REQUIREMENTS)} took more than {exc.timeout:.0f} s") from exc
    if result.returncode != 0:
        raise ToolsUnavailable(f"pip install {' '.join(REQUIREMENTS)} into {venv} failed (no network to PyPI?):\n"
                               f"{_tail(result.stdout + result.stderr)}")


_outcome: ClientTools | ToolsUnavailable | None = None
"""find_tools's result or failure, kept for the process: building is tried at most once per session."""


def find_tools() -> ClientTools:
    """The tools venv, built when missing or stale; raise ToolsUnavailable otherwise (remembered, so a session
    without network does not retry a slow install in every test)."""
    global _outcome
    if _outcome is None:
        try:
            _outcome = _find_or_install()
        except ToolsUnavailable as exc:
            _outcome = exc
    if isinstance(_outcome, ToolsUnavailable):
        raise _outcome
    return _outcome


def _find_or_install() -> ClientTools:
    """A file lock inside the venv folder serialises building, so concurrent sessions never pip install into it at
    once."""
    venv = tools_venv_path()
    try:
        venv.mkdir(parents=True, exist_ok=True)
        lock = open(venv / ".transerve-install.lock", "w")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:
        raise ToolsUnavailable(f"cannot create {venv}: {exc}") from exc
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        python = venv / "bin" / "python"
        found = _installed(python) if python.exists() else None
        if not _matches(found):
            _install(venv)
            found = _installed(python)
            if not _matches(found):
                raise ToolsUnavailable(f"{venv} holds {found} after installing {' '.join(REQUIREMENTS)}")
        if found and found["cuda"]:
            raise ToolsUnavailable(f"{venv} holds CUDA packages {found['cuda']}: torch must be the CPU build")
    return ClientTools(venv)


def require_tools() -> ClientTools:
    """`find_tools()` for tests: skip when the tools are unavailable, fail instead under CI."""
    import pytest

    try:
        return find_tools()
    except ToolsUnavailable as exc:
        reason = f"client tools unavailable: {exc}"
        if in_ci():
            pytest.fail(f"{reason}\n(CI is set, so missing client tools are a failure, not a skip)")
        pytest.skip(reason)
