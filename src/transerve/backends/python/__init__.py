"""Triton's `python` backend: unmodified `model.py` files run in worker processes (see backend.py).

`PythonBackend` is imported lazily so that the worker process, which runs inside this package,
does not pay for the server-side modules.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PythonBackend"]


def __getattr__(name: str) -> Any:
    if name == "PythonBackend":
        from transerve.backends.python.backend import PythonBackend

        return PythonBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
