"""One connection to the server per load worker, over HTTP (KServe v2 with Triton's binary tensor extension, on
`http.client`) or gRPC (tritonclient's generated messages on a grpcio channel), plus the calls the tool makes
around the load: metadata, config and the statistics extension.

A request is encoded once per data step (as perf_analyzer prepares its inputs once); each call then times its
three parts as perf_analyzer reports them: sending, waiting for the answer, and receiving it.

Every wait is bounded (`--request-timeout` for an inference, its answer read whole; `CONNECT_TIMEOUT_S` for the
calls around the load), every answer too (`--max-answer-bytes`), and an answer that is not what the protocol says
stops the run with one line (PerfError).
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import numpy as np

from transerve.perf.options import Options, PerfError

#: How long a call around the load (metadata, config, statistics) may take, connecting included.
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Timing:
    """One answered request, in nanoseconds of `time.perf_counter_ns`."""

    start: int
    end: int
    send: int
    wait: int
    recv: int


class Connection(Protocol):
    def infer(self, encoded: Any) -> Timing: ...

    def close(self) -> None: ...


def split_url(url: str, protocol: str) -> tuple[str, int]:
    """`host:port` (perf_analyzer's -u), an `http://` prefix tolerated; the protocol's default port when absent."""
    text = url.split("://", 1)[-1].rstrip("/")
    host, _, port = text.rpartition(":")
    if not host:
        return text, 8000 if protocol == "http" else 8001
    try:
        number = int(port)
    except ValueError:
        raise PerfError(f"-u takes host:port, got '{url}'") from None
    if not 0 < number < 65536:
        raise PerfError(f"-u: port {number} is out of range")
    return host.strip("[]"), number


def _model_path(model: str, version: str) -> str:
    path = f"/v2/models/{quote(model, safe='')}"
    return f"{path}/versions/{quote(version, safe='')}" if version else path


def _tensor_bytes(array: np.ndarray) -> bytes:
    if array.dtype == np.object_:
        from tritonclient.utils import serialize_byte_tensor

        serialized = serialize_byte_tensor(array)
        return serialized.item() if serialized.size else b""
    return np.ascontiguousarray(array).tobytes()


class HttpApi:
    """KServe v2 over HTTP/1.1 keep-alive; one instance per thread (http.client is not thread-safe)."""

    def __init__(self, options: Options) -> None:
        self.host, self.port = split_url(options.url, "http")
        self.path = _model_path(options.model, options.version)
        self.timeout_s, self.max_bytes = options.request_timeout_s, options.max_answer_bytes
        self.connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)

    def get_json(self, path: str) -> dict[str, Any]:
        status, body = self._call("GET", path, None, {})
        if status != 200:
            raise PerfError(f"GET {path}: {error_text(status, body)}")
        try:
            document = json.loads(body)
        except ValueError as exc:
            raise PerfError(f"GET {path}: the answer is not JSON ({exc})") from None
        if not isinstance(document, dict):
            raise PerfError(f"GET {path}: the answer is not a JSON object")
        return document

    def _call(self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]) -> tuple[int, bytes]:
        """A call around the load: CONNECT_TIMEOUT_S for all of it."""
        connection = self.connection
        try:
            connection.timeout = min(CONNECT_TIMEOUT_S, self.timeout_s)
            if connection.sock is not None:
                connection.sock.settimeout(connection.timeout)
            connection.request(method, path, body, dict(headers))
            response = connection.getresponse()
            return response.status, read_answer(response, self.max_bytes, time.monotonic() + connection.timeout)
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise PerfError(f"cannot reach the server at {self.host}:{self.port} over HTTP: {_why(exc)}") from None
        finally:
            connection.timeout = self.timeout_s
            if connection.sock is not None:
                connection.sock.settimeout(self.timeout_s)

    def metadata(self) -> dict[str, Any]:
        return self.get_json(self.path)

    def config(self) -> dict[str, Any]:
        return self.get_json(f"{self.path}/config")

    def statistics(self) -> dict[str, Any]:
        return self.get_json(f"{self.path}/stats")

    @staticmethod
    def encode(inputs: Mapping[str, tuple[str, np.ndarray]], outputs: list[str]) -> tuple[bytes, dict[str, str]]:
        """A request body with every tensor in Triton's binary extension, outputs asked for in binary too."""
        header: dict[str, Any] = {"inputs": [], "outputs": [{"name": name, "parameters": {"binary_data": True}}
                                                          for name in outputs]}
        blobs = []
        for name, (datatype, array) in inputs.items():
            blob = _tensor_bytes(array)
            header["inputs"].append({"name": name, "shape": list(array.shape), "datatype": datatype,
                                     "parameters": {"binary_data_size": len(blob)}})
            blobs.append(blob)
        head = json.dumps(header).encode()
        return head + b"".join(blobs), {"Content-Type": "application/octet-stream",
                                         "Inference-Header-Content-Length": str(len(head))}

    def infer(self, encoded: tuple[bytes, dict[str, str]]) -> Timing:
        body, headers = encoded
        connection = self.connection
        try:
            start = time.perf_counter_ns()
            connection.request("POST", f"{self.path}/infer", body, headers)
            sent = time.perf_counter_ns()
            response = connection.getresponse()
            waited = time.perf_counter_ns()
            data = read_answer(response, self.max_bytes, time.monotonic() + self.timeout_s)
            header_length = response.getheader("Inference-Header-Content-Length")
            json.loads(data[: int(header_length)] if header_length else data)  # parsing is part of receiving
            end = time.perf_counter_ns()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            connection.close()
            raise PerfError(f"inference over HTTP failed: {_why(exc)}") from None
        if response.status != 200:
            raise PerfError(f"inference failed: {error_text(response.status, data)}")
        return Timing(start, end, sent - start, waited - sent, end - waited)

    def close(self) -> None:
        self.connection.close()


def read_answer(response: http.client.HTTPResponse, limit: int, deadline: float) -> bytes:
    """An answer's body, refused past `limit` bytes (its Content-Length, or as it comes) or past `deadline` (a
    server that trickles it: the socket's timeout bounds each read only)."""
    length = response.getheader("Content-Length")
    if length and length.isdigit() and int(length) > limit:
        raise PerfError(f"the server's answer is {length} bytes, more than --max-answer-bytes {limit}")
    chunks, total = [], 0
    while chunk := response.read(1 << 16):
        total += len(chunk)
        if total > limit:
            raise PerfError(f"the server's answer is more than --max-answer-bytes {limit} bytes")
        if time.monotonic() > deadline:
            raise TimeoutError("the answer took longer than its timeout")
        chunks.append(chunk)
    return b"".join(chunks)


def _why(exc: BaseException) -> str:
    return "no answer within the timeout" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__


def error_text(status: int, body: bytes) -> str:
    """A refusal's status and message in one line (generate_stream's refusals are server-sent events)."""
    text = body.strip()
    text = text[len(b"data:"):] if text.startswith(b"data:") else text
    try:
        return f"{status} {json.loads(text)['error']}"
    except (ValueError, KeyError, TypeError):
        return f"{status} {' '.join(text[:200].decode(errors='replace').split())}"


class GrpcApi:
    """inference.GRPCInferenceService on a grpcio channel; ModelInfer takes pre-built messages, serialized per call
    (the send part) and parsed per answer (the receive part)."""

    def __init__(self, options: Options) -> None:
        import grpc
        from tritonclient.grpc import service_pb2

        self.grpc = grpc
        self.messages = service_pb2
        self.model, self.version = options.model, options.version
        self.timeout_s = options.request_timeout_s
        host, port = split_url(options.url, "grpc")
        self.target = f"{host}:{port}"
        self.channel = grpc.insecure_channel(self.target, options=[
            ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", options.max_answer_bytes)])
        prefix = "/inference.GRPCInferenceService/"
        identity = lambda data: data
        self._infer = self.channel.unary_unary(prefix + "ModelInfer", request_serializer=identity,
                                               response_deserializer=identity)
        self._rpcs = {name: self.channel.unary_unary(prefix + name, request_serializer=identity,
                                                     response_deserializer=identity)
                      for name in ("ModelMetadata", "ModelConfig", "ModelStatistics")}

    def _unary(self, name: str, request: Any, answer_type: Any) -> dict[str, Any]:
        from google.protobuf.json_format import MessageToDict

        try:
            data = self._rpcs[name](request.SerializeToString(), timeout=CONNECT_TIMEOUT_S)
        except self.grpc.RpcError as exc:
            raise PerfError(f"{name}: {_grpc_text(exc, self.target)}") from None
        return MessageToDict(answer_type.FromString(data), preserving_proto_field_name=True)

    def metadata(self) -> dict[str, Any]:
        request = self.messages.ModelMetadataRequest(name=self.model, version=self.version)
        return self._unary("ModelMetadata", request, self.messages.ModelMetadataResponse)

    def config(self) -> dict[str, Any]:
        request = self.messages.ModelConfigRequest(name=self.model, version=self.version)
        return self._unary("ModelConfig", request, self.messages.ModelConfigResponse)["config"]

    def statistics(self) -> dict[str, Any]:
        request = self.messages.ModelStatisticsRequest(name=self.model, version=self.version)
        return self._unary("ModelStatistics", request, self.messages.ModelStatisticsResponse)

    def encode(self, inputs: Mapping[str, tuple[str, np.ndarray]], outputs: list[str]) -> Any:
        request = self.messages.ModelInferRequest(model_name=self.model, model_version=self.version)
        for name, (datatype, array) in inputs.items():
            tensor = request.inputs.add(name=name, datatype=datatype)
            tensor.shape.extend(array.shape)
            request.raw_input_contents.append(_tensor_bytes(array))
        for name in outputs:
            request.outputs.add(name=name)
        return request

    def infer(self, encoded: Any) -> Timing:
        start = time.perf_counter_ns()
        data = encoded.SerializeToString()
        sent = time.perf_counter_ns()
        try:
            answer = self._infer(data, timeout=self.timeout_s)
        except self.grpc.RpcError as exc:
            raise PerfError(f"inference failed: {_grpc_text(exc, self.target)}") from None
        waited = time.perf_counter_ns()
        try:
            self.messages.ModelInferResponse.FromString(answer)
        except Exception as exc:  # protobuf's DecodeError
            raise PerfError(f"inference failed: the answer is not a ModelInferResponse ({exc})") from None
        end = time.perf_counter_ns()
        return Timing(start, end, sent - start, waited - sent, end - waited)

    def close(self) -> None:
        self.channel.close()


def _grpc_text(exc: Any, target: str) -> str:
    code, details = exc.code(), exc.details()
    if code is not None and code.name == "UNAVAILABLE" and "connect" in (details or "").lower():
        return f"cannot reach the server at {target} over gRPC: {details}"
    return f"{code.name if code else 'UNKNOWN'} {details}"


def connect(options: Options) -> HttpApi | GrpcApi:
    return HttpApi(options) if options.protocol == "http" else GrpcApi(options)
