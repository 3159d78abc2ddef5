"""OpenTelemetry mode: a finished trace becomes Triton 2.51's spans, exported over OTLP/HTTP by the SDK's batch span
processor (its own thread), from the optional `transerve[trace]` extra.

The spans are Triton's: "InferRequest" for the whole request with the frontend's timestamps as events (its parent
is the client's span when a W3C `traceparent` came with the request), under it one span per request of the trace
named after its model (attributes `triton.model_name`, `triton.model_version`, `triton.trace_id`,
`triton.trace_parent_id`, `triton.request_id`; events REQUEST_START, QUEUE_START, REQUEST_END), an ensemble step's
under its ensemble's, and a "compute" span with the COMPUTE_* events under each request that executed. Times are
the monotonic stamps moved onto the wall clock by the offset between the two clocks when the trace began. Tensor
activities are not exported (Triton neither).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import orjson
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from transerve.core.tracing.trace import CAPTURE, HEADER, STAMP, RequestTrace, Trace

SERVICE_NAME = "triton-inference-server"
TRACER_NAME = "triton-server"
_COMPUTE = ("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END")


class OtelExporter:
    """Turns finished traces into spans and hands them to the SDK's exporter."""

    def __init__(self, config: list[tuple[str, str]]) -> None:
        url = None
        attributes = {"service.name": SERVICE_NAME}
        batching = {}
        for setting, value in config:  # the last of a setting given twice wins, as in Triton
            if setting == "url":
                url = value
            elif setting == "resource":
                key, equals, text = value.partition("=")
                attributes[key] = text if equals else value
            elif setting == "bsp_max_queue_size":
                batching["max_queue_size"] = int(value)
            elif setting == "bsp_schedule_delay":
                batching["schedule_delay_millis"] = int(value)
            elif setting == "bsp_max_export_batch_size":
                batching["max_export_batch_size"] = int(value)
        self._ids = _PromisedIds()
        self._provider = TracerProvider(resource=Resource.create(attributes), id_generator=self._ids)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url), **batching))
        self._tracer = self._provider.get_tracer(TRACER_NAME)
        self._propagator = TraceContextTextMapPropagator()

    def extract(self, headers: Mapping[str, str]) -> otel_context.Context | None:
        """The client's span context from W3C trace context headers, when valid."""
        if "traceparent" not in headers:
            return None
        context = self._propagator.extract(headers)
        return context if otel_trace.get_current_span(context).get_span_context().is_valid else None

    def context(self, request: RequestTrace) -> str:
        """The propagation context of `request`'s span, as Triton gives it to a python model (`get_context()`): its
        ids are chosen now and kept for when the spans are built."""
        trace = request.trace
        state = ""
        if trace.parent is not None:
            client = otel_trace.get_current_span(trace.parent).get_span_context()
            trace.otel_trace_id, state = client.trace_id, client.trace_state.to_header()
        elif not trace.otel_trace_id:
            trace.otel_trace_id = self._ids.random_trace_id()
        if not request.span_id:
            request.span_id = self._ids.random_span_id()
        context = {"traceparent": f"00-{trace.otel_trace_id:032x}-{request.span_id:016x}-01"}
        if state:
            context["tracestate"] = state
        return orjson.dumps(context).decode()

    def export(self, trace: Trace) -> None:
        offset = time.time_ns() - time.monotonic_ns()
        kind = otel_trace.SpanKind.SERVER
        if trace.parent is None:
            self._ids.trace_id = trace.otel_trace_id
        root = self._tracer.start_span("InferRequest", context=trace.parent or otel_context.Context(), kind=kind,
                                       start_time=offset + trace.started_ns)
        for _, name, ns in (entry for entry in trace.root.entries if entry[0] == CAPTURE):
            root.add_event(name, timestamp=offset + ns)
        spans = {}
        for request in trace.requests:
            if not any(entry[0] == HEADER for entry in request.entries):
                continue  # never started (refused before it ran)
            parent = spans.get(request.parent_id, root)
            stamps = [(name, ns) for kind_, name, ns in request.entries if kind_ == STAMP]
            start = next((ns for name, ns in stamps if name == "REQUEST_START"), trace.started_ns)
            attributes = {"triton.model_name": request.model_name,
                          "triton.model_version": int(request.model_version or -1),
                          "triton.trace_id": request.id, "triton.trace_parent_id": request.parent_id}
            if request.request_id:
                attributes["triton.request_id"] = request.request_id
            self._ids.span_id = request.span_id
            span = self._tracer.start_span(request.model_name, context=otel_trace.set_span_in_context(parent),
                                           kind=kind, attributes=attributes, start_time=offset + start)
            spans[request.id] = span
            computes = [(name, ns) for name, ns in stamps if name in _COMPUTE]
            if computes:
                compute = self._tracer.start_span("compute", context=otel_trace.set_span_in_context(span),
                                                  kind=kind, start_time=offset + computes[0][1])
                for name, ns in computes:
                    compute.add_event(name, timestamp=offset + ns)
                compute.end(end_time=offset + computes[-1][1])
            end = trace.finished_ns
            for name, ns in stamps:
                if name not in _COMPUTE:
                    span.add_event(name, timestamp=offset + ns)
                    end = ns if name == "REQUEST_END" else end
            span.end(end_time=offset + end)
        root.end(end_time=offset + trace.finished_ns)

    def close(self) -> None:
        """Export what is still batched, then stop the exporter."""
        self._provider.shutdown()


class _PromisedIds(RandomIdGenerator):
    """Random ids, except those given out before the spans existed (a model's `get_context()`): set just before the
    span they belong to is started, used once."""

    def __init__(self) -> None:
        self.trace_id = 0
        self.span_id = 0

    def generate_trace_id(self) -> int:
        promised, self.trace_id = self.trace_id, 0
        return promised or super().generate_trace_id()

    def generate_span_id(self) -> int:
        promised, self.span_id = self.span_id, 0
        return promised or super().generate_span_id()

    def random_trace_id(self) -> int:
        return super().generate_trace_id()

    def random_span_id(self) -> int:
        return super().generate_span_id()
