"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the status OpenAI gives.

A server error (a model's INVALID_ARG, a full queue's UNAVAILABLE) keeps its status as Triton maps it; its type is
OpenAI's name for that status class, so clients that branch on `type` see what OpenAI would send.
"""

from __future__ import annotations

import orjson

from transerve.core.errors import ErrorCode, ServerError
from transerve.frontends.http.protocol import HttpResponse

#: Triton's statuses for the server's codes (as frontends/http/app.py maps them), but a cancelled request, which
#: only its own client sees, and an unknown error, which is the server's.
_STATUS = {
    ErrorCode.INVALID_ARG: 400, ErrorCode.ALREADY_EXISTS: 400, ErrorCode.CANCELLED: 400, ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNKNOWN: 500, ErrorCode.INTERNAL: 500, ErrorCode.UNSUPPORTED: 501, ErrorCode.UNAVAILABLE: 503,
}
_TYPE = {400: "invalid_request_error", 403: "permission_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
         501: "invalid_request_error", 503: "service_unavailable_error"}


class ApiError(Exception):
    """An answer that is an error, with the request field it is about (`param`) when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def document(self) -> dict:
        kind = _TYPE.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> HttpResponse:
        return HttpResponse(self.status, orjson.dumps(self.document()))


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def from_server_error(error: ServerError) -> ApiError:
    status = _STATUS.get(error.code, 500)
    return ApiError(status, error.message, code="model_not_found" if status == 404 else None)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")
