"""Optional packages, imported where first needed: a missing one is one line naming the extra that brings it
(`pip install 'transerve[EXTRA]'`), never a traceback. Each layer turns `MissingExtra` into its own error: a
model UNAVAILABLE, a command's exit status 2."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """An optional package is not installed; the message names the extra to install."""


def import_optional(module: str, extra: str) -> ModuleType:
    """`module`, or MissingExtra naming `extra`."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(f"{module} is not installed ({exc}): pip install 'transerve[{extra}]'") from None
