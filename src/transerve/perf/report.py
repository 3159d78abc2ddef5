"""What a run prints and writes, laid out as perf_analyzer's: the settings, a block per load level (client and
server side), the closing throughput-vs-latency table, and its CSV columns."""

from __future__ import annotations

import csv
from collections.abc import Callable
from functools import partial
from pathlib import Path

from transerve.perf.measure import PERCENTILES, LevelResult
from transerve.perf.options import Options

LEVEL_NAMES = {"concurrency": "Concurrency", "request_rate": "Request Rate"}


def _level_text(level: float) -> str:
    return f"{level:g}"


def settings(options: Options) -> str:
    lines = ["*** Measurement Settings ***", f"  Batch size: {options.batch_size}", "  Service Kind: Triton",
             f"  Protocol: {options.protocol.upper()}"]
    if options.measurement_mode == "count_windows":
        lines.append(f'  Using "count_windows" mode for stabilization ({options.request_count} requests a window)')
    else:
        lines.append('  Using "time_windows" mode for stabilization')
        lines.append(f"  Measurement window: {options.window_ms} msec")
    if len(options.levels) > 1 or options.latency_threshold_ms:
        lines.append(f"  Latency limit: {options.latency_threshold_ms} msec")
        unit = "concurrent requests" if options.mode == "concurrency" else "requests per second"
        limit = "Concurrency" if options.mode == "concurrency" else "Request Rate"
        lines.append(f"  {limit} limit: {max(options.levels):g} {unit}")
    if options.mode == "request_rate":
        lines.append(f"  Using {options.distribution} request distribution, up to {options.max_threads} threads")
    lines.append(f"  Using {'synchronous' if options.sync else 'asynchronous'} calls for inference")
    lines.append(f"  Stabilizing using {_latency_name(options.percentile)} latency "
                 f"(within {options.stability:g}% over 3 windows, at most {options.max_trials} windows)")
    return "\n".join(lines)


def _latency_name(percentile: int | None) -> str:
    return "average" if percentile is None else f"p{percentile}"


def level_header(options: Options, level: float) -> str:
    """The level's first line, printed as its measurement starts (its -v passes follow, then `level_block`)."""
    name = "Request concurrency" if options.mode == "concurrency" else "Request Rate"
    return f"{name}: {_level_text(level)}"


def level_block(options: Options, result: LevelResult) -> str:
    server = result.server
    send_recv = result.send_us + result.recv_us
    protocol = options.protocol.upper()
    lines = [
        "  Client: ",
        f"    Request count: {result.request_count}",
        f"    Throughput: {result.throughput:.2f} infer/sec",
        f"    Avg latency: {result.avg_us:.0f} usec (standard deviation {result.std_us:.0f} usec)",
        *[f"    p{p} latency: {result.percentiles_us[p]:.0f} usec" for p in sorted(result.percentiles_us)],
        f"    Avg {protocol} time: {result.avg_us:.0f} usec (send {result.send_us:.0f} usec + response wait "
        f"{result.wait_us:.0f} usec + receive {result.recv_us:.0f} usec; send/recv {send_recv:.0f} usec)",
    ]
    if options.mode == "request_rate" and result.delayed:
        lines.append(f"    Delayed requests: {result.delayed} (sent over 5 ms late: the client limits the rate)")
    parts = sum(result.server_us(part) for part in ("queue", "compute_input", "compute_infer", "compute_output"))
    overhead = max(0.0, result.server_request_us - parts)
    lines += [
        "  Server: ",
        f"    Inference count: {server.inference_count}",
        f"    Execution count: {server.execution_count}",
        f"    Successful request count: {server.success_count}",
        f"    Avg request latency: {result.server_request_us:.0f} usec (overhead {overhead:.0f} usec + queue "
        f"{result.server_us('queue'):.0f} usec + compute input {result.server_us('compute_input'):.0f} usec + "
        f"compute infer {result.server_us('compute_infer'):.0f} usec + compute output "
        f"{result.server_us('compute_output'):.0f} usec)",
    ]
    if not result.stable:
        lines.append(f"  Warning: not stable within {options.max_trials} windows; these are the last three")
    return "\n".join(lines)


def final_table(options: Options, results: list[LevelResult]) -> str:
    kind = "Average" if options.percentile is None else f"p{options.percentile}"
    name = LEVEL_NAMES[options.mode]
    lines = [f"Inferences/Second vs. Client {kind} Batch Latency"]
    lines += [f"{name}: {_level_text(r.level)}, throughput: {r.throughput:.2f} infer/sec, latency "
              f"{r.latency_us(options.percentile):.0f} usec" for r in results]
    return "\n".join(lines)


def _percentile(percentile: int, result: LevelResult) -> float:
    return result.percentiles_us[percentile]


#: perf_analyzer's CSV columns after the level (microseconds, but Inferences/Second), and how each is computed.
CSV_COLUMNS: list[tuple[str, Callable[[LevelResult], float]]] = [
    ("Inferences/Second", lambda r: r.throughput),
    ("Client Send", lambda r: r.send_us),
    ("Network+Server Send/Recv", lambda r: max(0.0, r.wait_us - sum(
        r.server_us(part) for part in ("queue", "compute_input", "compute_infer", "compute_output")))),
    ("Server Queue", lambda r: r.server_us("queue")),
    ("Server Compute Input", lambda r: r.server_us("compute_input")),
    ("Server Compute Infer", lambda r: r.server_us("compute_infer")),
    ("Server Compute Output", lambda r: r.server_us("compute_output")),
    ("Client Recv", lambda r: r.recv_us),
    *[(f"p{p} latency", partial(_percentile, p)) for p in PERCENTILES],
    ("Avg latency", lambda r: r.avg_us),
    ("request/response", lambda r: r.send_us + r.recv_us),
    ("response wait", lambda r: r.wait_us),
]


def write_csv(path: Path, options: Options, results: list[LevelResult]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([LEVEL_NAMES[options.mode], *(name for name, _ in CSV_COLUMNS)])
        for result in results:
            writer.writerow([_level_text(result.level),
                             *(f"{value(result):.2f}" if name == "Inferences/Second" else f"{value(result):.0f}"
                               for name, value in CSV_COLUMNS)])
