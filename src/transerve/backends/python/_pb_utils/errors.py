"""What Triton's C++ bindings raise, and the argument checks that raise it as they do."""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterable
from typing import Any


class TritonModelException(Exception):
    """What Triton raises from its C++ classes when a model misuses them."""


class TritonError:
    """An error a model attaches to one response; `code` is one of the class constants."""

    class Code(enum.IntEnum):
        """TRITONSERVER_Error_Code values."""

        UNKNOWN = 0
        INTERNAL = 1
        NOT_FOUND = 2
        INVALID_ARG = 3
        UNAVAILABLE = 4
        UNSUPPORTED = 5
        ALREADY_EXISTS = 6
        CANCELLED = 7

    UNKNOWN = Code.UNKNOWN
    INTERNAL = Code.INTERNAL
    NOT_FOUND = Code.NOT_FOUND
    INVALID_ARG = Code.INVALID_ARG
    UNAVAILABLE = Code.UNAVAILABLE
    UNSUPPORTED = Code.UNSUPPORTED
    ALREADY_EXISTS = Code.ALREADY_EXISTS
    CANCELLED = Code.CANCELLED

    __slots__ = ("_message", "_code")

    def __init__(self, message: str, code: int = Code.INTERNAL) -> None:
        if message is None or code is None:
            raise TypeError("TritonError: message and code must not be None")
        self._message = str(message)
        self._code = TritonError.Code(code)

    def message(self) -> str:
        return self._message

    def code(self) -> TritonError.Code:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {self._code.name})"

    __str__ = message


def _require(value: Any, kind: type, where: str, name: str) -> None:
    """TypeError for an argument of the wrong type, as Triton's C++ bindings raise it."""
    if not isinstance(value, kind):
        raise TypeError(f"{where}(): {name} must be {kind.__name__}, not {type(value).__name__}")


def _integer(value: Any, where: str, name: str) -> int:
    """An integer argument: a Python or NumPy integer, as the C++ bindings convert them."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{where}(): {name} must be an integer, not {type(value).__name__}") from None


def _require_list(values: Any, kind: type, where: str, name: str) -> list[Any]:
    if values is None or isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{where}(): {name} must be a list, not {type(values).__name__}")
    values = list(values)
    for value in values:
        _require(value, kind, where, f"every item of {name}")
    return values


def _check_parameters(parameters: Any) -> dict[str, Any]:
    """Parameters a model attaches to a request or response, with Triton's key and value checks."""
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise TritonModelException(f"Expect parameters to be a dict, found type {type(parameters)}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(f"Expect parameters keys to have type str, found type {type(key)}")
        if not isinstance(value, (bool, int, str, float)):
            raise TritonModelException(f"Expect parameters values to have type bool/int/str, found type {type(value)}")
    return parameters
