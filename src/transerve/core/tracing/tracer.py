"""The trace manager: the global and per-model settings, sampling, the trace extension's reads and updates, and
where finished traces go (the JSON file, or OpenTelemetry).

The request path asks `active` first: it is False unless some setting traces at all, so a server that does not
trace pays one attribute check per request.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from transerve.core.errors import invalid_arg
from transerve.core.tracing.options import OFF, OPENTELEMETRY, TENSORS, TIMESTAMPS, TRITON, TraceOptions
from transerve.core.tracing.settings import FIELDS, Setting, TraceFile
from transerve.core.tracing.trace import CAPTURE, HEADER, STAMP, RequestTrace, Trace
from transerve.core.types import InferRequest

#: A field whose value an update clears (JSON null, or an empty gRPC value list).
CLEAR = object()


class Tracer:
    """Samples requests and keeps the settings the trace extension shows and changes."""

    def __init__(self, options: TraceOptions, model_ready: Callable[[str], bool] = lambda name: False) -> None:
        self._model_ready = model_ready
        self._writer: ThreadPoolExecutor | None = None
        self._files: dict[str, TraceFile] = {}
        self._ids = itertools.count(1)
        #: Traced requests between their start and end, by trace id: the parents BLS calls may name.
        self._running: dict[int, RequestTrace] = {}
        self._exporter: Any = None
        self._closed = False
        if options.mode == OPENTELEMETRY:
            from transerve.core.tracing.otel import OtelExporter

            self._exporter = OtelExporter(options.mode_config())
        start = (options.level, options.rate, options.count, options.log_frequency)
        file = self._file(options.file)
        #: What clearing a global field returns it to; never samples.
        self._start = Setting(*start, file, options.mode, options.mode_config())
        self._global = Setting(*start, file, options.mode, options.mode_config())
        self._models: dict[str, Setting] = {}
        #: Whether any setting traces: the one check a request pays when none does.
        self.active = options.level != OFF

    @property
    def propagates(self) -> bool:
        """Whether requests' headers may carry a trace context to continue (OpenTelemetry mode)."""
        return self._exporter is not None

    # ---- the request path ------------------------------------------------------------------------

    def start(self, request: InferRequest, headers: Mapping[str, str] | None = None) -> Trace | None:
        """Sample `request` under its model's setting; when it is traced, `request.trace` is set and the caller
        (a frontend) owns the returned Trace until it calls `finish`. `headers` may carry an OpenTelemetry
        context (W3C `traceparent`), which is always traced in OpenTelemetry mode."""
        trace = self.sample(request.model_name, headers)
        if trace is not None:
            request.trace = trace.root
        return trace

    def sample(self, model_name: str, headers: Mapping[str, str] | None = None) -> Trace | None:
        """`start` before the request is read (Triton samples a generate request before it parses the body): the
        caller sets `request.trace = trace.root` once it has the request."""
        setting = self._models.get(model_name, self._global)
        parent = None
        if self._exporter is not None and headers and setting.level != OFF:
            parent = self._exporter.extract(headers)
        if not setting.sample(force=parent is not None):
            return None
        return Trace(setting, self._ids.__next__, self._finished, parent, self._running,
                     None if self._exporter is None else self._exporter.context)

    def bls_child(self, parent_id: int, model_name: str) -> RequestTrace | None:
        """The trace of a BLS request that `model_name`'s code makes under the trace of one of its requests
        (`parent_id`, the id its worker was given): a child of that request, as Triton spawns it. None once that
        request has ended, or when it is not the model's own."""
        parent = self._running.get(parent_id)
        if parent is None or parent.model_name != model_name:
            return None
        return parent.child()

    def _finished(self, trace: Trace) -> None:
        if self._closed:  # its answer was still being sent at exit
            return
        setting = trace.setting
        if setting.mode == TRITON:
            setting.collect(render_json(trace))
        else:
            setting.collect(None)
            self._exporter.export(trace)

    # ---- the trace extension ---------------------------------------------------------------------

    def settings(self, model_name: str = "") -> list[tuple[str, str | list[str]]]:
        """The settings a model's requests are traced under (the global ones for ""), as Triton lists them: a
        setting may appear twice when the command line gave it twice."""
        self.check_model(model_name)
        setting = self._models.get(model_name, self._global)
        shown: list[tuple[str, str | list[str]]] = [
            ("trace_level", level_names(setting.level)),
            ("trace_rate", str(setting.rate)),
            ("trace_count", str(setting.count)),
        ]
        if setting.mode == TRITON:
            shown += [("log_frequency", str(setting.log_frequency)), ("trace_file", setting.file.path)]
        shown.append(("trace_mode", setting.mode))
        shown += [(key, value) for key, value in setting.config if key not in ("file", "log-frequency")]
        return shown

    def update(self, model_name: str, changes: dict[str, Any]) -> list[tuple[str, str | list[str]]]:
        """Apply `changes` (field -> value, or CLEAR) to a model's settings or, for "", to the global ones (and to
        the fields models inherit from them); answer the settings after the update."""
        self.check_model(model_name)
        self._update(model_name, changes)
        if not model_name:
            for name in list(self._models):  # every model inherits the trace file at least
                self._update(name, {})
        self.active = any(setting.level != OFF for setting in (self._global, *self._models.values()))
        return self.settings(model_name)

    def check_model(self, model_name: str) -> None:
        if model_name and not self._model_ready(model_name):
            raise invalid_arg(f"Request for unknown model : {model_name}")

    def _update(self, model_name: str, changes: dict[str, Any]) -> None:
        """Triton's rule: a field cleared or never set takes the value of the setting this one falls back to (the
        global one for a model, the start values for the global one); a model left with no field of its own has
        no setting any more."""
        current = self._models.get(model_name) if model_name else self._global
        fallback = self._global if model_name else self._start
        values = {field: getattr(fallback, field) for field in FIELDS}
        specified = set()
        for field in FIELDS:
            change = changes.get(field)
            if change is CLEAR:
                continue
            if change is not None:
                values[field] = change
            elif current is not None and field in current.specified:
                values[field] = getattr(current, field)
            else:
                continue
            specified.add(field)
        if model_name and not specified:
            if current is not None:
                del self._models[model_name]
                current.retire()
            return
        updated = Setting(values["level"], values["rate"], values["count"], values["log_frequency"], fallback.file,
                          fallback.mode, fallback.config, frozenset(specified))
        if not updated.valid and updated.level != OFF:
            raise invalid_arg(f"Attempting to set invalid trace setting :{updated.reason}")
        if model_name:
            self._models[model_name] = updated
        else:
            self._global = updated
        if current is not None:
            current.retire()

    # ---- lifecycle -------------------------------------------------------------------------------

    def _file(self, path: str) -> TraceFile:
        file = self._files.get(path)
        if file is None:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="transerve-trace")
            file = self._files[path] = TraceFile(path, self._writer)
        return file

    def close(self) -> None:
        """At exit: save every setting's traces, close the files and wait for the writes; flush OpenTelemetry."""
        self._closed = True
        self.active = False
        for setting in (*self._models.values(), self._global):
            setting.flush()
        for file in self._files.values():
            file.close()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        if self._exporter is not None:
            self._exporter.close()


def level_names(level: int) -> list[str]:
    if level == OFF:
        return ["OFF"]
    return [name for bit, name in ((TIMESTAMPS, "TIMESTAMPS"), (TENSORS, "TENSORS")) if level & bit]


def render_json(trace: Trace) -> str:
    """A finished trace as entries of Triton's JSON trace file, each request's together, the sampled one first."""
    return ",".join(_render_request(request) for request in trace.requests if request.entries)


def _render_request(request: RequestTrace) -> str:
    trace_id = request.id
    parts = []
    for kind, name, value in request.entries:
        if kind in (STAMP, CAPTURE):  # names are this package's constants: no escaping needed, and far faster
            parts.append(f'{{"id":{trace_id},"timestamps":[{{"name":"{name}","ns":{value}}}]}}')
            continue
        if kind == HEADER:
            entry: dict[str, Any] = {"id": trace_id, "model_name": request.model_name,
                                     "model_version": _version(request)}
            if request.request_id:
                entry["request_id"] = request.request_id
            if request.parent_id:
                entry["parent_id"] = request.parent_id
        else:
            entry = {"id": trace_id, "activity": name, "tensor": value}
        parts.append(orjson.dumps(entry).decode())
    return ",".join(parts)


def _version(request: RequestTrace) -> int:
    return int(request.model_version) if request.model_version.isdigit() else -1
