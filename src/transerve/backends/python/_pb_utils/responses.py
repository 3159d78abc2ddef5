"""pb_utils.InferenceResponse, and the sender of a request's responses (Triton's rules for decoupled and
non-decoupled models); what a response becomes on its way to the server (`Outcome`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from transerve.backends.python._pb_utils.errors import TritonError, TritonModelException, _check_parameters
from transerve.backends.python._pb_utils.link import _require_channel
from transerve.backends.python._pb_utils.tensors import Tensor, _find_tensor, _tensor_list
from transerve.backends.python.ipc import OP_LATE_RESPONSE
from transerve.backends.python.shm import Entry

if TYPE_CHECKING:
    from transerve.backends.python._pb_utils.requests import InferenceRequest

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class InferenceResponse:
    """A model's response to one request: output tensors, or an error for that request alone."""

    __slots__ = ("_output_tensors", "_error", "_parameters")

    def __init__(
        self,
        output_tensors: Iterable[Tensor] = (),
        error: TritonError | None = None,
        parameters: dict[str, Any] | None = None,
    ) -> None:
        if error is not None and not isinstance(error, TritonError):
            raise TypeError(f"InferenceResponse: error must be a pb_utils.TritonError, got {type(error)}")
        self._output_tensors = _tensor_list(output_tensors, "InferenceResponse", "output_tensors")
        self._error = error
        self._parameters = _check_parameters(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._output_tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return json.dumps(self._parameters)


#: A response as the server gets it: (error code name and message, or None; parameters or None; output tensors).
Outcome = tuple[tuple[str, str] | None, dict[str, Any] | None, list[Entry]]


def _outcome(response: InferenceResponse, wanted: list[str]) -> Outcome:
    if response._error is not None:
        return (response._error.code().name, response._error.message()), None, []
    return None, response._parameters or None, _response_entries(response, wanted)


def _response_entries(response: InferenceResponse, wanted: list[str]) -> list[Entry]:
    """A response's output tensors, pruned to the requested outputs as Triton does."""
    entries = []
    for tensor in response._output_tensors:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"output_tensors must hold pb_utils.Tensor objects, found type '{type(tensor)}'")
        if not wanted or tensor._name in wanted:
            entries.append((tensor._name, tensor._datatype, tensor._array))
    return entries


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    return _find_tensor(inference_response.output_tensors(), name)


class InferenceResponseSender:
    """Sends one request's responses to the server, from any thread, with Triton's rules.

    A decoupled model's responses go out as they are sent. A non-decoupled model sends one response and
    nothing after it: sent before `execute` returns, it is held and travels in the execute's reply; sent later,
    it goes out at once under the id the reply gave the request (`_late`).
    """

    __slots__ = ("_request", "_lock", "_sent", "_closed", "_held", "_late")

    def __init__(self, request: InferenceRequest) -> None:
        self._request = request
        self._lock = threading.Lock()
        self._sent = 0
        self._closed = False
        #: A non-decoupled request's response sent before the reply: (error, parameters, tensors).
        self._held: Outcome | None = None
        #: The id its response is sent under once the reply has gone without it.
        self._late: int | None = None

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        """Send a response; `flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL` marks the last one (with or
        without a response). Sending after that raises, as in Triton."""
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if response is None and flags == 0:
            raise TritonModelException(
                "Inference Response object must be provided when the response flags is set to zero."
            )
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(f"Expected an 'InferenceResponse' object, found type '{type(response)}'.")
        request = self._request
        if not request._served:
            raise TritonModelException(
                "Unable to send response. Response sender has no reference to the decoupled state of the model."
            )
        final = flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL
        outcome = None if response is None else _outcome(response, request._requested_output_names)
        if not request._decoupled:
            self._send_single(outcome, final)
            return
        error, parameters, entries = outcome or (None, None, [])
        body = (final, response is not None, error, parameters)
        if not _require_channel().send_response(request._token, final, body, entries):
            raise TritonModelException("Unable to send response. Response sender has been closed.")

    def _send_single(self, outcome: Outcome | None, final: bool) -> None:
        with self._lock:
            self._count(outcome is not None, final)
            if outcome is None:
                return
            if self._late is None:
                self._held = outcome
                return
            error, parameters, entries = outcome
            channel = _require_channel()
            channel.send(OP_LATE_RESPONSE, self._late, (error, parameters), [entries])
            if self._request._token is not None:
                channel.close_tokens([self._request._token])  # the request is done: no cancellation to hear of

    def _count(self, has_response: bool, final: bool) -> None:
        """Triton's checks of a non-decoupled request's sends (a response returned from `execute` counts too)."""
        if has_response and self._sent > 0:
            raise TritonModelException(
                "Unable to send response. Non-decoupled model cannot send more than one response."
            )
        if not has_response and final and self._sent == 0:
            raise TritonModelException(
                "Unable to send response. Non-decoupled model cannot send complete final before sending a response."
            )
        if self._closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        self._closed = final
        self._sent += 1

    def _returned(self) -> None:
        """`execute` returned a response for this request: it is its final one."""
        with self._lock:
            self._count(True, True)

    def _reply(self, late_id: int) -> Outcome | int:
        """At the execute's reply: the held response, else the id a later one will be sent under (a sender
        closes only after a response, so one that sent nothing is open)."""
        with self._lock:
            if self._held is not None:
                held, self._held = self._held, None
                return held
            self._late = late_id
            return late_id

    def _close(self) -> Outcome | None:
        """The execute failed: no more sends; a response sent before the failure still stands (Triton's first
        response reaches the client)."""
        with self._lock:
            self._closed = True
            held, self._held = self._held, None
            return held

    def is_cancelled(self) -> bool:
        return self._request.is_cancelled()
