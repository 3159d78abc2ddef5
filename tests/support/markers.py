"""The suite's markers (registered in pyproject), put on each test by what it needs rather than by hand, so none
is forgotten.

- `e2e`: a real server process (the test, or a fixture it uses, starts one; or it lives in tests/e2e).
- `triton`: the real tritonserver 2.51 as well (differential tests): skipped without it, failed under CI.
- `gpu` and `slow` are put by hand (`@pytest.mark.gpu` beside the skip that checks the device; `slow` on tests
  that take over ~15 s on the 2-core machine).

`pytest -m "not e2e"` runs the in-process tests in seconds; `-m "not triton"` needs no reference server.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from functools import cache

import pytest

_SERVER_FIXTURES = {"transerve_server": ("e2e",), "triton_server": ("e2e", "triton")}
_CALLS = {"start_transerve(": ("e2e",), "start_server(": ("e2e",), "require_triton(": ("e2e", "triton")}


@cache
def _needs(function: Callable[..., object]) -> frozenset[str]:
    """The markers a function's own code calls for (the server starters it calls)."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return frozenset()
    return frozenset(marker for call, markers in _CALLS.items() if call in source for marker in markers)


def _fixture_functions(item: pytest.Item) -> Iterable[Callable[..., object]]:
    info = getattr(item, "_fixtureinfo", None)
    for definitions in getattr(info, "name2fixturedefs", {}).values():
        for definition in definitions:
            yield definition.func


def mark(items: list[pytest.Item]) -> None:
    """Add `e2e` and `triton` to the items that need them."""
    for item in items:
        needed: set[str] = set()
        if "e2e" in item.path.parts:
            needed.add("e2e")
        for name in getattr(item, "fixturenames", ()):
            needed.update(_SERVER_FIXTURES.get(name, ()))
        function = getattr(item, "function", None)
        if function is not None:
            needed |= _needs(function)
        for fixture in _fixture_functions(item):
            needed |= _needs(fixture)
        for marker in sorted(needed - {m.name for m in item.iter_markers()}):
            item.add_marker(marker)
