"""The KServe v2 routes: each maps an HTTP request to one core call and its answer back to HTTP."""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import uuid
from typing import Any
from urllib.parse import unquote

import orjson

from transerve import __version__
from transerve.core.errors import ErrorCode, ServerError, invalid_arg, not_found
from transerve.core.signature import ModelSignature
from transerve.core.streams import ResponseStream
from transerve.core.tracing import Trace
from transerve.core.tracing.extension import changes_from_json
from transerve.core.types import InferRequest, InferResponse
from transerve.frontends.access import HeaderForwarding, Restrictions, header_lookup, openai_group
from transerve.frontends.http.codec import (
    decode_infer_request,
    decode_raw_request,
    encode_infer_response,
    is_raw_body,
)
from transerve.frontends.http.encoding import (
    ENCODINGS,
    UnsupportedEncoding,
    compress_body,
    decompress_body_async,
    response_encoding,
)
from transerve.frontends.http.generate import (
    EXACTLY_ONE,
    SSE_CONTENT_TYPE,
    TracedResponses,
    as_answer_error,
    decode_generate_request,
    event_stream,
    first_event,
    refused,
    single_response,
    traced_events,
)
from transerve.frontends.http.generate_tokens import CountedResponses, counted
from transerve.frontends.http.openai.api import OpenAIApi
from transerve.frontends.http.openai.errors import ApiError
from transerve.frontends.http.protocol import Connections, HttpConnection, HttpLimits, HttpRequest, HttpResponse
from transerve.frontends.http.routes import ROUTES, SERVICE_ROUTES, SERVICE_TABLE, TABLE, Route
from transerve.frontends.tls import TlsOptions, listen_kwargs
from transerve.server import ControlMode, Server
from transerve.server.options import InputLimits
from transerve.server.shared_memory import CUDA_IPC_HANDLE_BYTES, CUDA_REGISTER_REFUSAL

log = logging.getLogger("transerve.http")

#: Triton's mapping of error codes to HTTP statuses.
HTTP_STATUS = {
    ErrorCode.INVALID_ARG: 400,
    ErrorCode.UNKNOWN: 400,
    ErrorCode.ALREADY_EXISTS: 400,
    ErrorCode.CANCELLED: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.INTERNAL: 500,
    ErrorCode.UNSUPPORTED: 501,
    ErrorCode.UNAVAILABLE: 503,
}

_EMPTY_OK = HttpResponse(200, b"", "text/plain")
#: The longest `x-request-id` a client's may be to be echoed (a longer or unprintable one is replaced).
MAX_REQUEST_ID = 128
#: Seconds a client is told to wait before retrying a 503 or 429 (`Retry-After`).
RETRY_AFTER_SECONDS = 1


def error_response(status: int, message: str) -> HttpResponse:
    return HttpResponse(status, orjson.dumps({"error": message}))


def _json(document: Any) -> HttpResponse:
    return HttpResponse(200, orjson.dumps(document))


class HttpFrontend:
    """Routes requests to the core and serves them on one listening socket."""

    def __init__(self, server: Server, max_input_size: int = 64 * 1024 * 1024,
                 restrictions: Restrictions | None = None, forwarding: HeaderForwarding | None = None,
                 tls: TlsOptions | None = None, limits: HttpLimits | None = None,
                 trust_request_chat_template: bool = False) -> None:
        self.server = server
        self.max_input_size = max_input_size
        #: `--http-use-ssl`: HTTPS instead of HTTP.
        self.tls = tls
        #: The --http-* limits on what a client may hold (sizes, timeouts, connections).
        self.limits = limits or HttpLimits()
        self._connections: Connections | None = None
        #: `--http-restricted-api`: groups answered only to requests with their header (403 otherwise, as Triton).
        self.restrictions = restrictions if restrictions is not None and restrictions.required else None
        #: `--http-header-forward-pattern`: matching headers become parameters of inference requests.
        self.forwarding = forwarding
        self._listener: asyncio.base_events.Server | None = None
        #: The OpenAI-compatible routes under /v1 (`--trust-request-chat-template`: chat requests' own templates).
        self._openai = OpenAIApi(server, trust_request_chat_template)
        #: Requests being handled, for `close` to let their answers out.
        self._handling = 0
        #: Each route's handler by the name the table gives it: `_on_<name>`.
        self._handlers = {route.handler: getattr(self, f"_on_{route.handler}") for route in (*ROUTES, *SERVICE_ROUTES)}

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        keep_names = self.forwarding is not None
        connections = self._connections = Connections(self.limits)
        self._listener = await loop.create_server(
            lambda: HttpConnection(self.handle, self.max_input_size, error_response, keep_names, self.server.tracing,
                                   connections=connections),
            host, port,
            reuse_address=True,
            **listen_kwargs(self.tls, "http/1.1"),
        )

    def stop_accepting(self, grace: float) -> None:
        """Stop accepting connections; requests already read still get their answers."""
        if self._listener is not None:
            self._listener.close()

    async def close(self, linger: float = 1.0) -> None:
        """Let answers the core has settled (those of requests stopped at shutdown included) be written, for up to
        `linger` seconds, then stop the connections' timer; open connections end with the process. A handler's
        answer is written in the step its handler returns in, so none handling means none left to write."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + linger
        while self._handling and loop.time() < deadline:
            await asyncio.sleep(0.01)
        if self._connections is not None:
            self._connections.close()

    async def handle(self, request: HttpRequest) -> HttpResponse:
        self._handling += 1
        try:
            response = await self._route(request)
        except ServerError as exc:
            response = error_response(HTTP_STATUS[exc.code], exc.message)
        finally:
            self._handling -= 1
        if response.status in (429, 503):  # a full queue or a model not ready yet: say when to come back
            response.headers.append(("Retry-After", str(RETRY_AFTER_SECONDS)))
        return response

    async def _route(self, request: HttpRequest) -> HttpResponse:
        parts = request.path.strip("/").split("/")
        # The row a busy server answers most, `POST /v2/models/<model>/infer`, straight to its handler: the table
        # would choose the same one (a capture may be empty; no restriction to check; nothing to unquote).
        if len(parts) == 4 and parts[3] == "infer" and parts[1] == "models" and parts[0] == "v2" \
                and request.method == "POST" and self.restrictions is None and "%" not in request.path:
            return await self._infer(request, parts[2], "")
        if parts and parts[0] == "v1":
            openai_parts = [unquote(part) for part in parts[1:]]
            if self.restrictions is not None:
                refusal = self.restrictions.refusal(openai_group(openai_parts), header_lookup(request.headers))
                if refusal is not None:
                    return _with_request_id(ApiError(403, refusal).response(), request)
            return _with_request_id(await self._openai.handle(request, openai_parts), request)
        if not parts or parts[0] != "v2":
            service = SERVICE_TABLE.match(parts) if len(parts) == 1 else None
            if service is None:
                return error_response(404, "Not Found")
            return _with_request_id(await self._service(request, service[0]), request)
        matched = TABLE.match([unquote(part) for part in parts[1:]] if "%" in request.path else parts[1:])
        if self.restrictions is not None:  # before anything else, the method included, as Triton checks it
            group = None if matched is None else matched[0].group
            refusal = self.restrictions.refusal(group, header_lookup(request.headers))
            if refusal is not None:
                return error_response(403, refusal)
        if matched is None:
            return error_response(404, "Not Found")
        route, captured = matched
        if not route.allows(request.method):
            return error_response(405, "Method Not Allowed")
        return await self._handlers[route.handler](request, *captured)

    async def _service(self, request: HttpRequest, route: Route) -> HttpResponse:
        """vLLM's root routes, guarded by their groups as /v1 is; errors in OpenAI's shape."""
        if self.restrictions is not None:
            refusal = self.restrictions.refusal(route.group, header_lookup(request.headers))
            if refusal is not None:
                return ApiError(403, refusal).response()
        if not route.allows(request.method):
            return ApiError(405, f"Method {request.method} is not allowed here").response()
        return await self._handlers[route.handler](request)

    # ---- the routes' handlers (routes.py names them) ---------------------------------------------------------

    async def _on_service_health(self, request: HttpRequest) -> HttpResponse:
        """vLLM's `/health`: 200 with an empty body while the server serves, 503 while it is not ready."""
        return _EMPTY_OK if self.server.ready else ApiError(503, "the server is not ready").response()

    async def _on_service_version(self, request: HttpRequest) -> HttpResponse:
        return _json({"version": __version__})

    async def _on_tokenize(self, request: HttpRequest) -> HttpResponse:
        return await self._openai.service(request, "tokenize")

    async def _on_detokenize(self, request: HttpRequest) -> HttpResponse:
        return await self._openai.service(request, "detokenize")

    async def _on_not_found(self, request: HttpRequest, *_: str) -> HttpResponse:
        return error_response(404, "Not Found")

    async def _on_server_metadata(self, request: HttpRequest) -> HttpResponse:
        return _json(self.server.metadata())

    async def _on_live(self, request: HttpRequest) -> HttpResponse:
        return _EMPTY_OK if self.server.live else error_response(400, "server is not live")

    async def _on_ready(self, request: HttpRequest) -> HttpResponse:
        return _EMPTY_OK if self.server.ready else error_response(400, "server is not ready")

    async def _on_all_statistics(self, request: HttpRequest) -> HttpResponse:
        return _json(self.server.statistics())

    async def _on_model_metadata(self, request: HttpRequest, model: str, version: str = "") -> HttpResponse:
        return _json(self.server.model_metadata(model, version))

    async def _on_model_ready(self, request: HttpRequest, model: str, version: str = "") -> HttpResponse:
        return _EMPTY_OK if self.server.model_ready(model, version) else error_response(400, "Model version not ready")

    async def _on_model_config(self, request: HttpRequest, model: str, version: str = "") -> HttpResponse:
        return _json(self.server.model_config(model, version))

    async def _on_model_statistics(self, request: HttpRequest, model: str, version: str = "") -> HttpResponse:
        return _json(self.server.statistics(model, version))

    async def _on_model_trace_setting(self, request: HttpRequest, model: str) -> HttpResponse:
        return self._trace_setting(request, model)

    async def _on_trace_setting(self, request: HttpRequest) -> HttpResponse:
        return self._trace_setting(request, "")

    async def _on_logging(self, request: HttpRequest) -> HttpResponse:
        if request.method == "GET":
            return _json(self.server.log.as_dict())
        return _json(self.server.log.update(_json_body(request.body)))

    async def _on_infer(self, request: HttpRequest, model: str, version: str = "") -> HttpResponse:
        return await self._infer(request, model, version)

    async def _on_generate(self, request: HttpRequest, model: str, version: str = "") -> HttpResponse:
        return await self._generate(request, model, version, streaming=False)

    async def _on_generate_stream(self, request: HttpRequest, model: str, version: str = "") -> HttpResponse:
        return await self._generate(request, model, version, streaming=True)

    async def _infer(self, request: HttpRequest, name: str, version: str) -> HttpResponse:
        encoding = request.headers.get("content-encoding")
        try:
            body = await decompress_body_async(request.body, encoding, self.max_input_size) if encoding else \
                request.body
        except UnsupportedEncoding as exc:  # Triton's answer: 501, naming the encodings it takes
            return HttpResponse(501, orjson.dumps({"error": str(exc)}), headers=[("Accept-Encoding", ENCODINGS)])
        except ValueError as exc:
            raise invalid_arg(str(exc)) from None
        header_length = request.headers.get("inference-header-content-length")
        if is_raw_body(body, header_length):
            signature = self.server.get_version(name, version).signature
            infer_request, binary_default = decode_raw_request(name, version, signature, body), True
        else:
            infer_request, binary_default = decode_infer_request(name, version, body, header_length,
                                                                 self.server.shared_memory)
        if self.forwarding is not None and request.raw_headers:
            infer_request.parameters.update(self.forwarding.parameters(request.raw_headers))
        accept = request.headers.get("accept-encoding")
        tracing = self.server.tracing
        if tracing.active and (trace := tracing.start(infer_request, request.headers)) is not None:
            return await self._infer_traced(trace, request, infer_request, binary_default, accept)
        return _infer_response(await self.server.infer(infer_request), infer_request, binary_default, accept)

    async def _infer_traced(self, trace: Trace, request: HttpRequest, infer_request: InferRequest,
                            binary_default: bool, accept: str | None) -> HttpResponse:
        """`_infer` for a traced request: Triton's HTTP timestamps around the core's; the trace is done once the
        answer is sent (or the request failed)."""
        if request.received_ns is not None:
            trace.capture("HTTP_RECV_START", request.received_ns[0])
            trace.capture("HTTP_RECV_END", request.received_ns[1])
        try:
            response = await self.server.infer(infer_request)
            trace.capture("INFER_RESPONSE_COMPLETE")
            answer = _infer_response(response, infer_request, binary_default, accept)
        except BaseException:
            trace.finish()
            raise
        return _finished_when_sent(answer, trace)

    async def _generate(self, request: HttpRequest, name: str, version: str, streaming: bool) -> HttpResponse:
        model = self.server.get_version(name, version)
        if len(request.body) > self.limits.max_generate_size:
            return error_response(413, f"a generate request body of {len(request.body)} bytes exceeds the limit of "
                                       f"{self.limits.max_generate_size} bytes (--http-max-generate-size)")
        if request.headers.get("content-encoding", "identity") not in ("", "identity"):
            raise invalid_arg("Unsupported content-encoding, only 'identity' is supported.")
        tracing = self.server.tracing
        if tracing.active and (trace := tracing.sample(name, request.headers)) is not None:
            return await self._generate_traced(trace, request, name, version, model.signature, streaming)
        infer_request = decode_generate_request(name, version, model.signature, request.body)
        return await _generate_answer(counted(model, infer_request, self.server.infer_stream(infer_request)),
                                      streaming)

    async def _generate_traced(self, trace: Trace, request: HttpRequest, name: str, version: str,
                               signature: ModelSignature, streaming: bool) -> HttpResponse:
        """`_generate` for a traced request, sampled before its body is read, as Triton samples it (a body it
        cannot read leaves a trace of the HTTP_RECV stamps). An error response of the model is an answer
        written (HTTP_SEND stamps); other errors are not."""
        if request.received_ns is not None:
            trace.capture("HTTP_RECV_START", request.received_ns[0])
            trace.capture("HTTP_RECV_END", request.received_ns[1])
        try:
            infer_request = decode_generate_request(name, version, signature, request.body)
            infer_request.trace = trace.root
            stream = counted(self.server.get_version(name, version), infer_request,
                             TracedResponses(self.server.infer_stream(infer_request), trace))
            try:
                answer = await _generate_answer(stream, streaming)
            except ServerError as exc:
                if exc.message == EXACTLY_ONE:
                    raise
                answer = error_response(HTTP_STATUS[exc.code], exc.message)
        except BaseException:
            trace.finish()
            raise
        if answer.stream is not None:
            answer.stream = traced_events(answer.stream, trace)
            return answer
        return _finished_when_sent(answer, trace)

    def _trace_setting(self, request: HttpRequest, model_name: str) -> HttpResponse:
        """The trace extension: GET reads the settings of a model ("" for the global ones), POST changes them."""
        tracing = self.server.tracing
        tracing.check_model(model_name)
        if request.method == "GET":
            settings = tracing.settings(model_name)
        else:
            settings = tracing.update(model_name, changes_from_json(_trace_body(request.body)))
        # Built by hand: a setting given twice on the command line is listed twice, as Triton lists it.
        members = b",".join(orjson.dumps(key) + b":" + orjson.dumps(value) for key, value in settings)
        return HttpResponse(200, b"{" + members + b"}")

    async def _on_system_shm_status(self, request: HttpRequest, region: str | None = None) -> HttpResponse:
        return _json(self.server.shared_memory.status(region))

    async def _on_system_shm_register(self, request: HttpRequest, region: str) -> HttpResponse:
        options = _json_body(request.body)
        key = options.get("key")
        if not isinstance(key, str):
            raise invalid_arg("Shared memory register request has no 'key' field")
        offset, byte_size = options.get("offset", 0), options.get("byte_size")
        _check_sizes(offset=offset, byte_size=byte_size)
        self.server.shared_memory.register(region, key, offset, byte_size)
        return _EMPTY_OK

    async def _on_system_shm_unregister(self, request: HttpRequest, region: str | None = None) -> HttpResponse:
        self.server.shared_memory.unregister(region)
        return _EMPTY_OK

    async def _on_cuda_shm_status(self, request: HttpRequest, region: str | None = None) -> HttpResponse:
        """The CUDA extension has no regions here (no GPU memory is shared) and refuses to register any."""
        if region is not None:
            raise not_found(f"Unable to find cuda shared memory region: '{region}'")
        return _json([])

    async def _on_cuda_shm_register(self, request: HttpRequest, region: str) -> HttpResponse:
        _check_cuda_registration(_json_body(request.body))
        raise invalid_arg(CUDA_REGISTER_REFUSAL)

    async def _on_cuda_shm_unregister(self, request: HttpRequest, region: str | None = None) -> HttpResponse:
        return _EMPTY_OK

    async def _on_repository_index(self, request: HttpRequest) -> HttpResponse:
        options = _json_body(request.body)
        return _json(self.server.repository_index(ready_only=bool(options.get("ready", False))))

    async def _on_load(self, request: HttpRequest, model: str) -> HttpResponse:
        limits = self.server.options.limits
        # Parsed, bounded and decoded in a thread: a load request may carry tens of megabytes.
        config, files = await asyncio.to_thread(
            lambda: _load_parameters(self._control_parameters(request), model, limits))
        await self.server.load_model(model, config, files)
        return HttpResponse(200, b"", "application/json")

    async def _on_unload(self, request: HttpRequest, model: str) -> HttpResponse:
        parameters = self._control_parameters(request)
        await self.server.unload_model(model, bool(parameters.get("unload_dependents", False)))
        return HttpResponse(200, b"", "application/json")

    def _control_parameters(self, request: HttpRequest) -> dict[str, Any]:
        """A load or unload request's parameters, once explicit model control allows it."""
        if self.server.options.control_mode is not ControlMode.EXPLICIT:
            raise ServerError(ErrorCode.UNAVAILABLE, "explicit model load / unload is not allowed if polling is "
                              "enabled")
        parameters = _json_body(request.body).get("parameters") or {}
        if not isinstance(parameters, dict):
            raise invalid_arg("'parameters' must be a JSON object")
        return parameters


async def _generate_answer(stream: ResponseStream | TracedResponses | CountedResponses,
                           streaming: bool) -> HttpResponse:
    """A generate request's answer: its one response, or its responses as server-sent events."""
    try:
        if not streaming:
            return _json(await single_response(stream))
        first = await first_event(stream)
        if refused(first):
            raise first
    except BaseException:  # the client went away, or the answer is an error: stop the model
        if not stream.closed:
            stream.cancel()
        raise
    # As in Triton, the first response sets the status: an error there is the request's error.
    status = HTTP_STATUS[as_answer_error(first).code] if isinstance(first, ServerError) else 200
    return HttpResponse(status, content_type=SSE_CONTENT_TYPE, stream=event_stream(stream, first))


def _with_request_id(response: HttpResponse, request: HttpRequest) -> HttpResponse:
    """vLLM's `x-request-id` on the answer: the client's own when it sent a usable one, else a new one."""
    given = request.headers.get("x-request-id", "")
    usable = 0 < len(given) <= MAX_REQUEST_ID and given.isascii() and given.isprintable()
    response.headers.append(("x-request-id", given if usable else uuid.uuid4().hex))
    return response


def _finished_when_sent(answer: HttpResponse, trace: Trace) -> HttpResponse:
    """A traced answer: Triton's send stamps around its write, the trace done once it is written."""
    trace.capture("HTTP_SEND_START")

    def sent() -> None:
        trace.capture("HTTP_SEND_END")
        trace.finish()

    answer.on_sent = sent
    return answer


def _json_body(body: bytes) -> dict[str, Any]:
    if not body:
        return {}
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid_arg(f"failed to parse the request JSON: {exc}") from None
    if not isinstance(document, dict):
        raise invalid_arg("the request body must be a JSON object")
    return document


def _trace_body(body: bytes) -> Any:
    """A trace update's JSON; Triton reads any JSON document (anything but an object changes nothing) and
    refuses an empty or malformed one with a 500, which is a 400 here."""
    if not body:
        raise invalid_arg("failed to parse the request JSON buffer: The document is empty. at 0")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid_arg(f"failed to parse the request JSON buffer: {exc}") from None


def _infer_response(response: InferResponse, infer_request: InferRequest, binary_default: bool,
                    accept: str | None) -> HttpResponse:
    """An inference answer, compressed as Triton compresses: inference answers only, as the client's
    Accept-Encoding ranks gzip and deflate."""
    payload, header_length = encode_infer_response(response, infer_request, binary_default)
    content_type, headers = "application/json", []
    if header_length is not None:
        content_type = "application/octet-stream"
        headers.append(("Inference-Header-Content-Length", str(header_length)))
    coding = response_encoding(accept) if accept else None
    if coding is not None:
        payload = compress_body(payload, coding)
        headers.append(("Content-Encoding", coding))
    return HttpResponse(200, payload, content_type, headers)


def _check_sizes(**fields: Any) -> None:
    for field, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise invalid_arg(f"Shared memory register request needs '{field}' as a non-negative integer")


def _check_cuda_registration(options: dict[str, Any]) -> None:
    """What Triton checks of a CUDA registration before it fails to open the handle, with its wording."""
    if "raw_handle" not in options:
        raise invalid_arg("Shared memory register request has no 'raw_handle' field")
    handle = options["raw_handle"]
    encoded = handle.get("b64") if isinstance(handle, dict) else None
    try:
        decoded = base64.b64decode(encoded, validate=True) if isinstance(encoded, str) else b""
    except binascii.Error:
        decoded = b""
    if len(decoded) != CUDA_IPC_HANDLE_BYTES:
        raise invalid_arg("'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t")
    _check_sizes(device_id=options.get("device_id"), byte_size=options.get("byte_size"))


def _load_parameters(parameters: dict[str, Any], model: str, limits: InputLimits) -> tuple[str | None,
                                                                                         dict[str, bytes]]:
    """The `config` override and the base64 `file:<path>` contents of a load request, within `limits` (checked
    before anything is decoded)."""
    config = parameters.get("config")
    if config is not None and not isinstance(config, str):
        raise invalid_arg("load parameter 'config' must be a string holding the JSON model configuration")
    encoded = [value for key, value in parameters.items() if key.startswith("file:")]
    limits.check_load(model, len(config or ""), len(encoded),
                      sum(len(value) * 3 // 4 for value in encoded if isinstance(value, str)))
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        if key.startswith("file:"):
            if not isinstance(value, str):
                raise invalid_arg(f"load parameter '{key}' must be a base64 string")
            try:
                files[key[len("file:"):]] = base64.b64decode(value, validate=True)
            except binascii.Error:
                raise invalid_arg(f"load parameter '{key}' is not valid base64") from None
    return config, files
