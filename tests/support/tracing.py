"""Reading what a traced server produced, for the trace tests: Triton-mode trace files, and OpenTelemetry spans
caught by an OTLP/HTTP receiver on loopback."""

from __future__ import annotations

import base64
import gzip
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from google.protobuf import json_format


def read_traces(folder: Path, pattern: str = "trace.json*") -> dict[str, list[dict[str, Any]]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(folder.glob(pattern))}


def summary(entries: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per trace id: its header, the multiset of timestamp names and its tensor activities, whatever the order."""
    traces: dict[int, dict[str, Any]] = {}
    for entry in entries:
        trace = traces.setdefault(entry["id"], {"header": None, "stamps": Counter(), "tensors": []})
        if "model_name" in entry:
            trace["header"] = entry
        elif "timestamps" in entry:
            trace["stamps"].update(stamp["name"] for stamp in entry["timestamps"])
        else:
            trace["tensors"].append((entry["activity"], entry["tensor"]))
    for trace in traces.values():
        trace["tensors"].sort(key=lambda item: (item[0], item[1]["name"]))
    return traces


class OtlpReceiver:
    """An OTLP/HTTP trace collector on loopback: keeps every span it is sent, from protobuf bodies (the Python SDK)
    or JSON ones (Triton's C++ exporter)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.requests: list[Any] = []
        received = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                message = ExportTraceServiceRequest()
                if "json" in self.headers.get("Content-Type", ""):
                    json_format.ParseDict(_hex_ids_as_base64(json.loads(body)), message, ignore_unknown_fields=True)
                else:
                    message.ParseFromString(body)
                received.append(message)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def spans(self) -> list[tuple[dict[str, str], str, Any]]:
        """(resource attributes, scope name, span) of every span received."""
        found = []
        for message in self.requests:
            for resource_spans in message.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    found += [(resource, scope_spans.scope.name, span) for span in scope_spans.spans]
        return found

    def wait_for(self, count: int, timeout: float = 60.0) -> None:
        """Until `count` spans arrived (at once when they have: the timeout is for a loaded machine)."""
        deadline = time.monotonic() + timeout
        while len(self.spans()) < count and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _hex_ids_as_base64(document: Any) -> Any:
    """OTLP/JSON writes trace and span ids in hex where protobuf's JSON mapping has base64 for bytes."""
    if isinstance(document, list):
        return [_hex_ids_as_base64(item) for item in document]
    if not isinstance(document, dict):
        return document
    return {key: base64.b64encode(bytes.fromhex(value)).decode()
            if key in ("traceId", "spanId", "parentSpanId") and isinstance(value, str) else _hex_ids_as_base64(value)
            for key, value in document.items()}


def span_tree(spans: list[tuple[dict[str, str], str, Any]], client_span: bytes) -> list[tuple[Any, ...]]:
    """Each span as (its path of names from the top, kind, attributes, sorted event names, event times within the
    span), with the top span's parent named "client" when it is the propagated one."""
    by_id = {span.span_id: span for _, _, span in spans}

    def path(span: Any) -> tuple[str, ...]:
        parent = by_id.get(span.parent_span_id)
        if parent is not None:
            return (*path(parent), span.name)
        return ("client" if span.parent_span_id == client_span else "", span.name)

    tree = []
    for _, _, span in spans:
        attributes = {a.key: json.dumps(json_format.MessageToDict(a.value), sort_keys=True) for a in span.attributes}
        inside = all(span.start_time_unix_nano <= e.time_unix_nano <= span.end_time_unix_nano for e in span.events)
        tree.append((path(span), span.kind, sorted(attributes.items()), sorted(e.name for e in span.events),
                     inside or span.name == "InferRequest"))
    return sorted(tree)
