"""Triton's trace extension, in its two modes: `triton` (Triton's JSON trace file) and `opentelemetry` (spans over
OTLP/HTTP, with the optional `transerve[trace]` extra).

- `options`: tritonserver's `--trace-config` and deprecated `--trace-*` flags, with its messages.
- `tracer`: the global and per-model settings, sampling, the extension's reads and updates.
- `extension`: an update's HTTP and gRPC forms, read as Triton reads them.
- `trace`: what a traced request stamps as it goes (frontends: receive/send times; the core: REQUEST_START,
  QUEUE_START, REQUEST_END and tensors; schedulers: COMPUTE_*), kept until the trace is done.
- `settings`: one setting's counters and its JSON file; `otel`: the spans.
"""

from transerve.core.tracing.options import TraceConfigError, TraceOptions, parse_trace_options
from transerve.core.tracing.trace import RequestTrace, Trace
from transerve.core.tracing.tracer import Tracer

__all__ = ["RequestTrace", "Trace", "TraceConfigError", "TraceOptions", "Tracer", "parse_trace_options"]
