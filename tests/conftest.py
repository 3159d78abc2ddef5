"""Session-wide fixtures: one real transerve and one real Triton, each serving examples/model_repository.

Starting a server costs seconds (one python worker per model), so end-to-end tests share these two for the
whole session; a test that needs another repository or other flags starts its own with
`support.start_transerve(repo, *args)` / `support.start_triton(repo, *args)`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# `support` is imported as a top-level package from tests/, whatever pytest's import mode.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import support.fuzzing  # noqa: E402, F401  (registers the hypothesis profiles: ci by default, release)
from support import EXAMPLE_REPOSITORY, ServerProcess, require_triton, start_transerve, start_triton  # noqa: E402
from support.markers import mark  # noqa: E402

#: Both servers name a trace file (in their own working folder), so that a test may turn tracing on; it is off.
TRACE_FILE = ("--trace-config", "triton,file=trace.json")


@pytest.fixture(scope="session")
def transerve_server() -> Iterator[ServerProcess]:
    """transerve serving examples/model_repository in place."""
    with start_transerve(EXAMPLE_REPOSITORY, *TRACE_FILE) as server:
        yield server


@pytest.fixture(scope="session")
def triton_server() -> Iterator[ServerProcess]:
    """The real tritonserver 2.51 serving a copy of examples/model_repository; skipped (failed under CI) without it."""
    install = require_triton()
    with start_triton(EXAMPLE_REPOSITORY, *TRACE_FILE, install=install) as server:
        yield server


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark(items)
