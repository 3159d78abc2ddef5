"""KServe v2 over HTTP with the standard library: the model's config, `infer` with Triton's binary tensor extension
(texts that are any bytes, no JSON escaping), and `/generate`. One keep-alive connection per thread.

Every answer is read within bounds: at most `max_answer_bytes`, all of it within `--timeout` (not only each read),
and one that is not what the protocol says (not JSON, not a whole number of bytes) stops the run with one line."""

from __future__ import annotations

import http.client
import json
import struct
import threading
import time
from typing import Any
from urllib.parse import quote, urlsplit

import numpy as np

from transerve.client.errors import LineFailed, RunStopped
from transerve.client.target import Target

#: KServe v2 datatypes of outputs read from binary data (BYTES apart).
_DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
           "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
           "FP32": np.float32, "FP64": np.float64}
_HEADER_LENGTH = "Inference-Header-Content-Length"
#: A kept-alive connection the server has closed fails at its next request: that request is sent once more.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class HttpTransport:
    def __init__(self, url: str, timeout: float, max_answer_bytes: int) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise RunStopped(f"cannot read the URL '{url}': expected HOST:PORT or http://HOST:PORT")
        self._url = url
        self._host = parts.hostname
        try:
            self._port = parts.port or 8000
        except ValueError as exc:
            raise RunStopped(f"cannot read the URL '{url}': {exc}") from None
        self._timeout = timeout
        self._max_answer_bytes = max_answer_bytes
        self._local = threading.local()

    def model_config(self, model: str, version: str) -> dict[str, Any]:
        status, _, body = self._request("GET", f"{_model_path(model, version)}/config")
        if status != 200:
            raise RunStopped(f"model '{model}': {_error(status, body)}")
        return _json(body, "the model's config")

    def infer(self, target: Target, texts: list[str]) -> list[str]:
        data = [text.encode("utf-8") for text in texts]
        blob = b"".join(struct.pack("<I", len(item)) + item for item in data)
        header: dict[str, Any] = {
            "inputs": [{"name": target.input_name, "shape": target.shape(len(texts)), "datatype": "BYTES",
                        "parameters": {"binary_data_size": len(blob)}}],
            "outputs": [{"name": target.output_name, "parameters": {"binary_data": True}}],
        }
        if target.parameters:
            header["parameters"] = target.parameters
        head = json.dumps(header).encode()
        status, headers, body = self._request(
            "POST", f"{_model_path(target.model, target.version)}/infer", head + blob,
            {"Content-Type": "application/octet-stream", _HEADER_LENGTH: str(len(head))})
        _check(status, body)
        try:
            array = _output(headers.get(_HEADER_LENGTH), body, target.output_name)
        except (KeyError, TypeError, ValueError, AttributeError, struct.error) as exc:
            raise RunStopped(f"the server's answer is malformed: {exc!r}") from None
        return target.answers(array, len(texts))

    def generate(self, target: Target, text: str) -> str:
        body = json.dumps({**target.parameters, target.input_name: text}).encode()
        status, _, answer = self._request("POST", f"{_model_path(target.model, target.version)}/generate", body,
                                          {"Content-Type": "application/json"})
        _check(status, answer)
        document = _json(answer, "the answer of /generate")
        if not isinstance(document, dict):
            raise RunStopped("the answer of /generate is not a JSON object")
        if target.output_name not in document:
            raise RunStopped(f"the answer of /generate has no '{target.output_name}' (it has "
                             f"{', '.join(document)}): name the output with --output-name")
        value = document[target.output_name]
        return " ".join(map(str, value)) if isinstance(value, list) else str(value)

    def _request(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
                 retry: bool = True) -> tuple[int, http.client.HTTPMessage, bytes]:
        connection, reused = self._connection()
        try:
            connection.request(method, path, body, headers or {})
            deadline = time.monotonic() + self._timeout
            response = connection.getresponse()
            return response.status, response.headers, self._read(response, deadline)
        except (OSError, http.client.HTTPException) as exc:
            self._drop()
            if retry and reused and isinstance(exc, _STALE):
                return self._request(method, path, body, headers, retry=False)
            if isinstance(exc, TimeoutError):
                raise RunStopped(f"no answer from the server at {self._url} within --timeout {self._timeout:g} s") \
                    from None
            raise RunStopped(f"cannot reach the server at {self._url}: {exc}") from None

    def _read(self, response: http.client.HTTPResponse, deadline: float) -> bytes:
        """The answer's body, refused past `max_answer_bytes` (by its Content-Length, or as it comes) or past the
        deadline (a server that trickles it)."""
        limit = self._max_answer_bytes
        length = response.getheader("Content-Length")
        if length and length.isdigit() and int(length) > limit:
            raise RunStopped(f"the server's answer is {length} bytes, more than --max-answer-bytes {limit}")
        chunks, total = [], 0
        while chunk := response.read(1 << 16):
            total += len(chunk)
            if total > limit:
                raise RunStopped(f"the server's answer is more than --max-answer-bytes {limit} bytes")
            if time.monotonic() > deadline:
                raise TimeoutError
            chunks.append(chunk)
        return b"".join(chunks)

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            return connection, True
        self._local.connection = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        return self._local.connection, False

    def _drop(self) -> None:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
            self._local.connection = None


def _model_path(model: str, version: str) -> str:
    path = f"/v2/models/{quote(model, safe='')}"
    return f"{path}/versions/{quote(version, safe='')}" if version else path


def _json(body: bytes, what: str) -> Any:
    try:
        return json.loads(body)
    except ValueError as exc:
        raise RunStopped(f"{what} is not JSON ({exc}): {body[:80]!r}") from None


def _error(status: int, body: bytes) -> str:
    try:
        message = json.loads(body).get("error")
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status}: {message or body[:200].decode('utf-8', errors='replace')}"


def _check(status: int, body: bytes) -> None:
    """A 400 is the line's fault (the server's INVALID_ARG); anything else stops the run."""
    if status == 400:
        raise LineFailed(_error(status, body))
    if status != 200:
        raise RunStopped(_error(status, body))


def _output(header_length: str | None, body: bytes, name: str) -> np.ndarray:
    """The output `name` of an infer response, from its JSON `data` or its binary data."""
    length = int(header_length) if header_length and header_length.isdigit() else len(body)
    document, binary = _json(body[:length], "the answer's JSON header"), body[length:]
    if not isinstance(document, dict) or not isinstance(document.get("outputs", []), list):
        raise RunStopped("the server's answer is not a KServe v2 infer response")
    offset = 0
    for output in document.get("outputs", []):
        size = (output.get("parameters") or {}).get("binary_data_size")
        raw = None
        if size is not None:
            raw, offset = binary[offset:offset + size], offset + size
        if output["name"] != name:
            continue
        if raw is None:
            return np.array(output["data"], dtype=np.object_ if output["datatype"] == "BYTES" else None)
        if output["datatype"] == "BYTES":
            return np.array(_bytes_elements(raw), dtype=np.object_)
        return np.frombuffer(raw, dtype=_DTYPES[output["datatype"]])
    raise RunStopped(f"the server's answer has no output '{name}'")


def _bytes_elements(raw: bytes) -> list[bytes]:
    items, offset = [], 0
    while offset < len(raw):
        (size,) = struct.unpack_from("<I", raw, offset)
        items.append(raw[offset + 4:offset + 4 + size])
        offset += 4 + size
    return items
