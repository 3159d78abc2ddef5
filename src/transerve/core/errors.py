"""Errors as values with Triton's codes; each frontend maps a code to its own status."""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Triton's TRITONSERVER_Error_Code values, by name."""

    UNKNOWN = "UNKNOWN"
    INTERNAL = "INTERNAL"
    NOT_FOUND = "NOT_FOUND"
    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    UNSUPPORTED = "UNSUPPORTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"


class ServerError(Exception):
    """An error that reaches the client: a code plus a message worded for the user."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"ServerError({self.code.name}, {self.message!r})"


def invalid_arg(message: str) -> ServerError:
    return ServerError(ErrorCode.INVALID_ARG, message)


def not_found(message: str) -> ServerError:
    return ServerError(ErrorCode.NOT_FOUND, message)


def unavailable(message: str) -> ServerError:
    return ServerError(ErrorCode.UNAVAILABLE, message)


def internal(message: str) -> ServerError:
    return ServerError(ErrorCode.INTERNAL, message)


def unsupported(message: str) -> ServerError:
    return ServerError(ErrorCode.UNSUPPORTED, message)
