"""Prometheus metrics on the metrics port, with Triton's metric families: names, types, help texts and labels.

The collector reads the core's statistics when scraped, so the request path only bumps plain
integers in `ModelStats` and never takes a metrics lock. The text is written here rather than by
prometheus_client, which declares a counter `x` as `x_total` in its `# HELP`/`# TYPE` lines while Triton
declares `x` itself: a strict parser (and Triton's dashboards) would otherwise see untyped samples.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Iterator

import psutil
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from transerve.core.stats import FAILURE_REASONS
from transerve.frontends.http.protocol import Connections, HttpConnection, HttpLimits, HttpRequest, HttpResponse
from transerve.server import ModelVersion, Server

_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: (metric name, help, attribute of ModelStats giving a Duration) for the per-model latency counters.
_DURATIONS = (
    ("nv_inference_request_duration_us",
     "Cumulative inference request duration in microseconds (includes cached requests)", "success"),
    ("nv_inference_queue_duration_us",
     "Cumulative inference queuing duration in microseconds (includes cached requests)", "queue"),
    ("nv_inference_compute_input_duration_us",
     "Cumulative compute input duration in microseconds (does not include cached requests)", "compute_input"),
    ("nv_inference_compute_infer_duration_us",
     "Cumulative compute inference duration in microseconds (does not include cached requests)", "compute_infer"),
    ("nv_inference_compute_output_duration_us",
     "Cumulative inference compute output duration in microseconds (does not include cached requests)",
     "compute_output"),
)

#: The same for `summary_latencies`: (metric name, help, attribute of ModelStats whose Duration has the summary).
_SUMMARIES = (
    ("nv_inference_request_summary_us",
     "Summary of inference request duration in microseconds (includes cached requests)", "success"),
    ("nv_inference_queue_summary_us",
     "Summary of inference queuing duration in microseconds (includes cached requests)", "queue"),
    ("nv_inference_compute_input_summary_us",
     "Cumulative compute input duration in microseconds (does not include cached requests)", "compute_input"),
    ("nv_inference_compute_infer_summary_us",
     "Cumulative compute inference duration in microseconds (does not include cached requests)", "compute_infer"),
    ("nv_inference_compute_output_summary_us",
     "Cumulative inference compute output duration in microseconds (does not include cached requests)",
     "compute_output"),
    ("nv_cache_hit_summary_per_model", "Summary of cache hit counts/durations per model, in microseconds.",
     "cache_hit"),
    ("nv_cache_miss_summary_per_model", "Summary of cache miss counts/durations per model, in microseconds.",
     "cache_miss"),
)


def _family(name: str, documentation: str, kind: str) -> Metric:
    return Metric(name, documentation, kind)


class TritonMetricsCollector:
    """A prometheus_client collector producing Triton's metric families from the server's state."""

    def __init__(self, server: Server, cpu_metrics: bool = True, gpu_metrics: bool = True,
                 interval_ms: float = 2000.0) -> None:
        self._server = server
        self._counter_latencies = server.options.metrics.counter_latencies
        self._cpu = _Polled(_cpu_families, interval_ms) if cpu_metrics else None
        self._gpu = _Polled(_GpuProbe().families, interval_ms) if gpu_metrics else None
        psutil.cpu_percent(interval=None)  # the first reading is meaningless; start the interval now

    def collect(self) -> Iterator[Metric]:
        models = self._server.serving_versions()
        success = _family("nv_inference_request_success", "Number of successful inference requests, all batch sizes",
                          "counter")
        failure = _family("nv_inference_request_failure", "Number of failed inference requests, all batch sizes",
                          "counter")
        count = _family("nv_inference_count", "Number of inferences performed (does not include cached requests)",
                        "counter")
        executions = _family("nv_inference_exec_count",
                             "Number of model executions performed (does not include cached requests)", "counter")
        pending = _family("nv_inference_pending_request_count",
                          "Instantaneous number of pending requests awaiting execution per-model.", "gauge")
        load = _family("nv_model_load_duration_secs", "Model load time in seconds", "gauge")
        durations = [(_family(name, text, "counter"), attribute) for name, text, attribute in _DURATIONS
                     if self._counter_latencies]
        for model in models:
            labels = {"model": model.name, "version": model.version}
            stats = model.stats
            success.add_sample(success.name, labels, stats.success.count)
            for reason in FAILURE_REASONS:
                failure.add_sample(failure.name, {**labels, "reason": reason}, stats.failures[reason])
            count.add_sample(count.name, labels, stats.inference_count)
            executions.add_sample(executions.name, labels, stats.execution_count)
            pending.add_sample(pending.name, labels, model.scheduler.pending_count)
            load.add_sample(load.name, labels, round(stats.load_duration_secs, 6))
            for family, attribute in durations:
                family.add_sample(family.name, labels, getattr(stats, attribute).ns // 1000)
        yield from (success, failure, count, executions)
        yield from (family for family, _ in durations)
        if self._server.response_cache is not None and self._counter_latencies:
            yield from _cache_counters(models)
        yield from (pending, load)
        if self._server.response_cache is not None:
            yield from _cache_gauges(self._server)
        if self._cpu is not None:
            yield from self._cpu.families()
        if self._gpu is not None:
            yield from self._gpu.families()
        # Triton's registry lists counters, then gauges, then summaries, then what backends add.
        yield from _summary_families(models)
        yield from _token_families(models)
        yield from _vllm_families(models)
        yield _restarts(models)
        for name, description, kind, samples in self._server.custom_metrics.families():  # pb_utils.MetricFamily
            family = _family(name, description, kind)
            for sample in samples:
                family.add_sample(*sample)
            yield family


def _restarts(models: list[ModelVersion]) -> Metric:
    """transerve's own counter (Triton has none): python-backend workers restarted, by reason ("crash", "memory":
    past `max_worker_rss_bytes`, "hung": an execute past its request's timeout); left out while there is none."""
    family = _family("transerve_model_instance_restarts", "Number of model instance processes restarted, by reason",
                     "counter")
    for model in models:
        for reason, number in sorted(model.backend_model.restarts.items()):
            family.add_sample(family.name, {"model": model.name, "version": model.version, "reason": reason}, number)
    return family


def _summary_families(models: list[ModelVersion]) -> Iterator[Metric]:
    """`summary_latencies`: per model, the quantiles of the window and the cumulative sum and count."""
    for name, text, attribute in _SUMMARIES:
        family = _family(name, text, "summary")
        for model in models:
            summary = getattr(model.stats, attribute).summary
            if summary is None:
                continue
            labels = {"model": model.name, "version": model.version}
            family.add_sample(f"{name}_count", labels, summary.count)
            family.add_sample(f"{name}_sum", labels, summary.sum)
            for quantile, value in summary.values():
                family.add_sample(name, {**labels, "quantile": _number(quantile)}, value)
        yield family


def _token_families(models: list[ModelVersion]) -> Iterator[Metric]:
    """transerve's own histograms (Triton has none): time to first token and per output token, for the models whose
    tokens a frontend timed (the OpenAI API); left out for the others."""
    for name, text, attribute in (
        ("transerve_time_to_first_token_seconds", "Histogram of time to first token in seconds", "first_token"),
        ("transerve_time_per_output_token_seconds",
         "Histogram of time per output token after the first, in seconds", "per_output_token"),
    ):
        family = _family(name, text, "histogram")
        for model in models:
            histogram = getattr(model.stats.tokens, attribute)
            count = histogram.count
            if count == 0:
                continue
            labels = {"model": model.name, "version": model.version}
            for bound, number in histogram.cumulative():
                family.add_sample(f"{name}_bucket", {**labels, "le": bound}, number)
            family.add_sample(f"{name}_count", labels, count)
            family.add_sample(f"{name}_sum", labels, histogram.total)
        yield family


#: vLLM's histograms: (name, help, attribute of TokenTimings). vLLM 0.x names the per-gap histogram
#: `time_per_output_token` and later `inter_token_latency`; both are served, and the per-request mean under its
#: later name.
_VLLM_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "first_token"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "inter_token"),
    ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds (the inter-token "
     "latency, under vLLM's earlier name).", "inter_token"),
    ("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
     "per_output_token"),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "end_to_end"),
)


def _vllm_families(models: list[ModelVersion]) -> Iterator[Metric]:
    """vLLM's metric names and meanings (labelled `model_name`, as vLLM labels them) beside Triton's, for the
    generators and the models whose tokens a frontend counted (the OpenAI API): dashboards and benchmarks written
    for vLLM (aiperf's server token counts) read them. Requests waiting are those in the model's scheduler queue;
    running, the sequences a frontend has in the model, less those waiting."""
    served = [model for model in models if model.config.backend == "generation" or _counted(model)]
    running = _family("vllm:num_requests_running", "Number of requests in model execution batches.", "gauge")
    waiting = _family("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "gauge")
    kv_usage = _family("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "gauge")
    prompt = _family("vllm:prompt_tokens_total", "Number of prefill tokens processed.", "counter")
    generation = _family("vllm:generation_tokens_total", "Number of generation tokens processed.", "counter")
    success = _family("vllm:request_success_total", "Count of successfully processed requests.", "counter")
    for model in served:
        labels = {"model_name": model.name}
        timings = model.stats.tokens
        queued = model.scheduler.pending_count
        load = model.engine_load()
        if load is None:
            running.add_sample(running.name, labels, max(timings.active - queued, 0))
            waiting.add_sample(waiting.name, labels, queued)
        else:  # a generator's engine schedules its sequences itself: it knows who runs and who waits
            running.add_sample(running.name, labels, load.running)
            waiting.add_sample(waiting.name, labels, queued + load.waiting)
            if load.kv_cache_usage is not None:
                kv_usage.add_sample(kv_usage.name, labels, load.kv_cache_usage)
        prompt.add_sample(prompt.name, labels, timings.prompt_tokens)
        generation.add_sample(generation.name, labels, timings.generation_tokens)
        for reason, number in timings.finished.items():
            success.add_sample(success.name, {**labels, "finished_reason": reason}, number)
    yield from (running, waiting, kv_usage, prompt, generation, success)
    yield from _prefix_cache_families(served)
    for name, text, attribute in _VLLM_HISTOGRAMS:
        family = _family(name, text, "histogram")
        for model in served:
            histogram = getattr(model.stats.tokens, attribute)
            labels = {"model_name": model.name}
            for bound, number in histogram.cumulative():
                family.add_sample(f"{name}_bucket", {**labels, "le": bound}, number)
            family.add_sample(f"{name}_count", labels, histogram.count)
            family.add_sample(f"{name}_sum", labels, histogram.total)
        yield family


def _prefix_cache_families(models: list[ModelVersion]) -> Iterator[Metric]:
    """The torch engine's prefix cache, summed over a model's instances: vLLM's token counters (`model_name`) and
    transerve's lookups by result; models without one are left out."""
    queries = _family("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried "
                      "tokens.", "counter")
    hits = _family("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
                   "counter")
    lookups = _family("transerve_prefix_cache_lookups", "Number of prompt prefix (encoder-decoder: source) "
                      "lookups in the generation engine's prefix cache, by result", "counter")
    for model in models:
        load = model.engine_load()
        counts = load.prefix_cache if load is not None else None
        if counts is None:
            continue
        queries.add_sample(queries.name, {"model_name": model.name}, counts.queried_tokens)
        hits.add_sample(hits.name, {"model_name": model.name}, counts.hit_tokens)
        labels = {"model": model.name, "version": model.version}
        lookups.add_sample(lookups.name, {**labels, "result": "hit"}, counts.hits)
        lookups.add_sample(lookups.name, {**labels, "result": "miss"}, counts.misses)
    yield from (queries, hits, lookups)


def _counted(model: ModelVersion) -> bool:
    timings = model.stats.tokens
    return bool(timings.active or timings.prompt_tokens or timings.generation_tokens or any(timings.finished.values()))


def _cache_counters(models: list[ModelVersion]) -> Iterator[Metric]:
    """Triton's per-model response cache counters, for the models that cache."""
    per_model = [
        (_family("nv_cache_num_hits_per_model", "Number of cache hits per model", "counter"),
         lambda stats: stats.cache_hit.count),
        (_family("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds", "counter"),
         lambda stats: stats.cache_hit.ns // 1000),
        (_family("nv_cache_num_misses_per_model", "Number of cache misses per model", "counter"),
         lambda stats: stats.cache_miss.count),
        (_family("nv_cache_miss_duration_per_model",
                 "Total cache miss (insert+lookup) duration per model, in microseconds", "counter"),
         lambda stats: stats.cache_miss.ns // 1000),
    ]
    for model in models:
        if model.config.response_cache.enable:
            labels = {"model": model.name, "version": model.version}
            for family, value in per_model:
                family.add_sample(family.name, labels, value(model.stats))
    yield from (family for family, _ in per_model)


def _cache_gauges(server: Server) -> Iterator[Metric]:
    """Triton's gauges of the whole response cache."""
    cache = server.response_cache
    assert cache is not None
    counters = cache.stats
    for name, text, kind, value in (
        ("nv_cache_util", "Cache utilization [0.0 - 1.0]", "gauge", cache.used / cache.size if cache.size else 0.0),
        ("nv_cache_num_entries", "Number of responses stored in response cache", "gauge", cache.entries),
        ("nv_cache_num_hits", "Number of cache hits in response cache", "gauge", counters.hits),
        ("nv_cache_num_misses", "Number of cache misses in response cache", "gauge", counters.misses),
        ("nv_cache_num_lookups", "Number of cache lookups in response cache", "gauge",
         counters.hits + counters.misses),
        ("nv_cache_num_evictions", "Number of cache evictions in response cache", "gauge", counters.evictions),
        ("nv_cache_lookup_duration", "Total cache lookup duration (hit and miss), in microseconds", "gauge",
         counters.lookup_ns // 1000),
        ("nv_cache_insertion_duration", "Total cache insertion duration, in microseconds", "gauge",
         counters.insertion_ns // 1000),
    ):
        family = _family(name, text, kind)
        family.add_sample(name, {}, value)
        yield family


class _Polled:
    """Families read at most once per `--metrics-interval-ms`, as Triton polls CPU and GPU metrics: a reading (the
    CPU utilization is that since the previous one) holds for the interval however often /metrics is scraped."""

    def __init__(self, read: Callable[[], Iterable[Metric]], interval_ms: float) -> None:
        self._read = read
        self._interval_s = interval_ms / 1000.0
        self._read_at = -math.inf
        self._families: list[Metric] = []

    def families(self) -> list[Metric]:
        now = time.monotonic()
        if now - self._read_at >= self._interval_s:
            self._families = list(self._read())
            self._read_at = now
        return self._families


def _cpu_families() -> Iterator[Metric]:
    memory = psutil.virtual_memory()
    for name, text, value in (
        ("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", psutil.cpu_percent(interval=None) / 100.0),
        ("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", memory.total),
        ("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", memory.total - memory.available),
    ):
        family = _family(name, text, "gauge")
        family.add_sample(name, {}, value)
        yield family


class _GpuProbe:
    """NVIDIA GPU gauges through NVML, when the `nvidia-ml-py` package and a GPU are present."""

    def __init__(self) -> None:
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml
        except Exception:  # no package, no driver or no GPU: no GPU metrics, as in Triton
            self._handles = []

    def families(self) -> Iterator[Metric]:
        if self._nvml is None or not self._handles:
            return
        nvml = self._nvml
        utilization = _family("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", "gauge")
        total = _family("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", "gauge")
        used = _family("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", "gauge")
        power = _family("nv_gpu_power_usage", "GPU power usage in watts", "gauge")
        for index, handle in enumerate(self._handles):
            labels = {"gpu_uuid": nvml.nvmlDeviceGetUUID(handle), "gpu": str(index)}
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            utilization.add_sample(utilization.name, labels, nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
            total.add_sample(total.name, labels, memory.total)
            used.add_sample(used.name, labels, memory.used)
            power.add_sample(power.name, labels, nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
        yield from (utilization, total, used, power)


class MetricsFrontend:
    """`GET /metrics` in the Prometheus text format on its own port."""

    def __init__(self, server: Server, cpu_metrics: bool = True, gpu_metrics: bool = True,
                 interval_ms: float = 2000.0) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(TritonMetricsCollector(server, cpu_metrics, gpu_metrics, interval_ms))
        self._listener: asyncio.base_events.Server | None = None
        self._connections: Connections | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        connections = self._connections = Connections(HttpLimits())  # the HTTP defaults, whatever the flags say
        self._listener = await loop.create_server(
            lambda: HttpConnection(self.handle, 1024 * 1024, _plain_error, connections=connections), host, port,
            reuse_address=True,
        )

    def stop_accepting(self, grace: float) -> None:
        """Stop accepting connections; requests already read still get their answers."""
        if self._listener is not None:
            self._listener.close()

    async def close(self) -> None:
        """Stop the connections' timer; open connections end with the process."""
        if self._connections is not None:
            self._connections.close()

    async def handle(self, request: HttpRequest) -> HttpResponse:
        if request.path.rstrip("/") != "/metrics":
            return _plain_error(404, "Not Found")
        if request.method != "GET":
            return _plain_error(405, "Method Not Allowed")
        return HttpResponse(200, exposition(self.registry.collect()), _CONTENT_TYPE)


def _plain_error(status: int, message: str) -> HttpResponse:
    return HttpResponse(status, message.encode(), "text/plain")


def exposition(families: Iterable[Metric]) -> bytes:
    """The Prometheus text format as Triton (prometheus-cpp) writes it: each family declared under its own name,
    whatever its type, with its samples under theirs (`x`, `x_sum`, `x_count`, `x_bucket`); labels sorted, with
    `quantile` and `le` last; numbers with up to 16 significant digits. A family without samples is left out,
    as prometheus-cpp leaves it out."""
    lines = []
    for family in families:
        if not family.samples:
            continue
        lines.append(f"# HELP {family.name} {_escape_help(family.documentation)}")
        lines.append(f"# TYPE {family.name} {family.type}")
        for sample in family.samples:
            labels = sorted(sample.labels.items(), key=lambda item: (item[0] in ("quantile", "le"), item[0]))
            text = ",".join(f'{key}="{_escape_label(value)}"' for key, value in labels)
            lines.append(f"{sample.name}{{{text}}} {_number(sample.value)}" if text else
                         f"{sample.name} {_number(sample.value)}")
    lines.append("")
    return "\n".join(lines).encode()


def _number(value: float) -> str:
    if math.isnan(value):
        return "Nan"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return f"{value:.16g}"


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
