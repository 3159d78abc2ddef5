"""Protocol overhead: add_sub over KServe v2 HTTP (JSON, binary) and gRPC, transerve against the real Triton.

    python -m benchmarks.protocol                        # starts both servers, 5 s per run, concurrency 1,16,64
    python -m benchmarks.protocol --duration 10 --rounds 3 --protocols binary,grpc
    python -m benchmarks.protocol --transerve-url 127.0.0.1:8000 --triton-url 127.0.0.1:18000 \
        --transerve-grpc-url 127.0.0.1:8001 --triton-grpc-url 127.0.0.1:18001
    python -m benchmarks.protocol --servers transerve,transerve-tls,triton,triton-tls   # the cost of TLS

add_sub does almost no work, so what is measured is the server's request path: HTTP or HTTP/2 parsing,
decoding, validation, scheduling, the trip to the python-backend worker and back, encoding.

The load generator (benchmarks/common/load.py) must not be the bottleneck: raw HTTP/1.1 and HTTP/2 clients with
request bytes built once, in client processes (--client-processes); the table reports the busiest client process's
CPU use so a reader can see when the client, not the server, was saturated. For servers started here, "server
us/req" is the CPU time of the server's main process per answer (warm-up included; python-backend workers are other
processes), and "with workers us/req" adds the CPU time of its child processes (transerve's python-backend workers,
Triton's python backend stub) over the same run: the whole of each server's work per answer.

TLS: the servers named `<server>-tls` are started here with certificates made for the run (tests/support/certs.py):
transerve with `--grpc-use-ssl` and `--http-use-ssl`, Triton with `--grpc-use-ssl` (it has no HTTPS, so its HTTP
rows are left out), and the clients speak TLS 1.3 through the event loop's SSL transport (ALPN h2 for gRPC). The
"vs plain" column divides a TLS row's throughput by the same server's plaintext row.

Fairness: both servers serve the same repository on the same machine, and runs alternate (A/B/A/B...) so
that drift in the machine's load spreads over both. Every run has a warm-up that is not counted, and every
response's status is checked (non-200 answers are counted as errors, never as throughput).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common.load import PROTOCOLS, RunResult, check_answer, client_context, percentile, run_once
from benchmarks.common.results import add_json_option, comma_list, int_list, write_json

# ---------------------------------------------------------------------------------------------- report


def server_us(group: list[RunResult]) -> str:
    """The server's CPU microseconds per answer over a row's runs, when measured."""
    measured = [r.server_cpu for r in group if r.server_cpu is not None]
    return f"{sum(measured) / len(measured) * 1e6:.0f}" if measured else ""


def family_cpu(pid: int) -> float:
    """CPU seconds of a server process and of its children (python-backend workers or stubs) so far."""
    root = psutil.Process(pid)
    total = 0.0
    for process in (root, *root.children(recursive=True)):
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def family_us(group: list[RunResult], family: dict[int, float]) -> str:
    """The CPU microseconds per answer of a server and its children over a row's runs, when measured."""
    measured = [family[id(r)] for r in group if id(r) in family]
    return f"{sum(measured) / len(measured) * 1e6:.0f}" if measured else ""


def report(runs: list[RunResult], servers: list[str], protocols: list[str],
           family: dict[int, float] | None = None) -> str:
    """A Markdown table, one row per server, protocol and concurrency, with every round of a row merged; `family`
    holds, by run, the CPU seconds per answer of the server and its children."""
    family = family or {}
    rows: dict[tuple[str, int, str], list[RunResult]] = {}
    for run in runs:
        rows.setdefault((run.protocol, run.concurrency, run.server), []).append(run)
    throughput = {
        key: sum(len(r.latencies) for r in group) / sum(r.duration for r in group) for key, group in rows.items()
    }
    tls = any(server.endswith("-tls") for server in servers)
    lines = [
        "| server | protocol | concurrency | req/s | p50 ms | p99 ms | transerve/Triton | errors | client CPU "
        "| server us/req | with workers us/req |" + (" vs plain |" if tls else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if tls else ""),
    ]
    for protocol, concurrency, server in sorted(rows, key=lambda k: (protocols.index(k[0]), k[1], servers.index(k[2]))):
        group = rows[(protocol, concurrency, server)]
        latencies = sorted(latency for r in group for latency in r.latencies)
        mine = throughput[(protocol, concurrency, server)]
        triton = throughput.get((protocol, concurrency, server.replace("transerve", "triton")))
        ratio = f"{mine / triton:.2f}" if server.startswith("transerve") and triton else ""
        plain = throughput.get((protocol, concurrency, server.removesuffix("-tls")))
        versus = (f" {mine / plain:.2f} |" if server.endswith("-tls") and plain else " |") if tls else ""
        lines.append(
            f"| {server} | {protocol} | {concurrency} | {mine:.0f} "
            f"| {percentile(latencies, 0.50) * 1e3:.2f} | {percentile(latencies, 0.99) * 1e3:.2f} | {ratio} "
            f"| {sum(r.errors for r in group)} | {max(r.client_cpu for r in group) * 100:.0f}% | {server_us(group)} "
            f"| {family_us(group, family)} |"
            + versus
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- main


def parse_address(url: str) -> tuple[str, int]:
    """Accept host:port or http://host:port."""
    host_port = url.split("://", 1)[-1].rstrip("/")
    host, _, port = host_port.rpartition(":")
    return host or "127.0.0.1", int(port)


SERVERS = ("transerve", "triton", "transerve-tls", "triton-tls")


@contextlib.contextmanager
def servers_under_test(args: argparse.Namespace) -> Iterator[dict[str, dict[str, Any]]]:
    """The servers' HTTP and gRPC addresses: given by URL, or started here (and stopped on exit) with tests/support.

    A `-tls` server's addresses also name, under "ca", the CA its clients trust; Triton's lacks "http" (no HTTPS).
    """
    from benchmarks.common.servers import EXAMPLE_REPOSITORY, TritonUnavailable, start_transerve, start_triton

    urls = {"transerve": (args.transerve_url, args.transerve_grpc_url),
            "triton": (args.triton_url, args.triton_grpc_url)}
    with contextlib.ExitStack() as stack:
        addresses = {}
        certs = None
        for name in args.servers:
            http_url, grpc_url = urls.get(name, (None, None))
            if http_url or grpc_url:
                addresses[name] = {kind: parse_address(url) for kind, url in (("http", http_url), ("grpc", grpc_url))
                                   if url}
                continue
            flags: list[str] = []
            https = None
            if name.endswith("-tls"):
                if certs is None:
                    from benchmarks.common.servers import make_certificates

                    certs = make_certificates(Path(stack.enter_context(tempfile.TemporaryDirectory())))
                flags = ["--grpc-use-ssl=true", f"--grpc-server-cert={certs.server_cert}",
                         f"--grpc-server-key={certs.server_key}"]
                if name.startswith("transerve"):
                    flags += ["--http-use-ssl=true", f"--http-server-cert={certs.server_cert}",
                              f"--http-server-key={certs.server_key}"]
                    https = client_context(str(certs.ca), "http/1.1")
            print(f"starting {name} on {EXAMPLE_REPOSITORY} ...", file=sys.stderr)
            try:
                server = stack.enter_context(
                    start_transerve(EXAMPLE_REPOSITORY, *flags, https=https) if name.startswith("transerve")
                    else start_triton(EXAMPLE_REPOSITORY, *flags)
                )
            except TritonUnavailable as exc:
                raise SystemExit(f"cannot start Triton: {exc}\n(use --servers transerve, or --triton-url)") from exc
            addresses[name] = {"http": ("127.0.0.1", server.http_port), "grpc": ("127.0.0.1", server.grpc_port),
                               "pid": server.process.pid}
            if certs is not None and name.endswith("-tls"):
                addresses[name]["ca"] = str(certs.ca)
                if name == "triton-tls":
                    del addresses[name]["http"]
        yield addresses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per run (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="uncounted seconds before each run (default 1)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per server and row, alternating (default 2)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 16, 64],
                        help="comma-separated connection counts (default 1,16,64)")
    parser.add_argument("--protocols", type=comma_list, default=["json", "binary", "grpc"], help="json,binary,grpc")
    parser.add_argument("--servers", type=comma_list, default=["transerve", "triton"],
                        help="transerve,triton; transerve-tls and triton-tls are started here with gRPC over TLS "
                             "(and HTTPS for transerve)")
    parser.add_argument("--transerve-url", help="use this running transerve (host:port) instead of starting one")
    parser.add_argument("--triton-url", help="use this running Triton (host:port) instead of starting one")
    parser.add_argument("--transerve-grpc-url", help="the running transerve's gRPC address (host:port)")
    parser.add_argument("--triton-grpc-url", help="the running Triton's gRPC address (host:port)")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="client processes to spread connections over (default 1; on a 2-core machine a second "
                             "client process takes CPU from the server)")
    add_json_option(parser)
    args = parser.parse_args(argv)
    for name in args.servers:
        if name not in SERVERS:
            parser.error(f"unknown server {name!r}")
    for protocol in args.protocols:
        if protocol not in PROTOCOLS:
            parser.error(f"unknown protocol {protocol!r}")

    runs: list[RunResult] = []
    family: dict[int, float] = {}
    with servers_under_test(args) as addresses:
        for name, server_addresses in addresses.items():
            for protocol in args.protocols:
                kind = "grpc" if protocol == "grpc" else "http"
                if name == "triton-tls" and kind == "http":
                    continue  # Triton has no HTTPS
                if kind not in server_addresses:
                    flag = f"--{name}-grpc-url" if kind == "grpc" else f"--{name}-url"
                    parser.error(f"{name}: protocol {protocol} needs {flag}")
                check_answer(*server_addresses[kind], protocol, server_addresses.get("ca"))
        for protocol in args.protocols:
            for concurrency in args.concurrency:
                for round_index in range(args.rounds):
                    # One run of each server per round, so the runs go A/B/A/B and machine drift hits both.
                    for name in args.servers:
                        address = addresses[name].get("grpc" if protocol == "grpc" else "http")
                        if address is None:  # triton-tls over HTTP
                            continue
                        pid = addresses[name].get("pid")
                        before = family_cpu(pid) if pid is not None else 0.0
                        run = run_once(name, address, protocol, concurrency, args.client_processes, args.warmup,
                                       args.duration, ca=addresses[name].get("ca"), server_pid=pid)
                        runs.append(run)
                        if pid is not None and run.answered:
                            family[id(run)] = (family_cpu(pid) - before) / run.answered
                        print(f"round {round_index + 1}/{args.rounds} {name:9s} {protocol:6s} c={concurrency:<3d} "
                              f"{len(run.latencies) / run.duration:8.0f} req/s  errors {run.errors}", file=sys.stderr)
    print(report(runs, args.servers, args.protocols, family))
    write_json(args.json, "protocol", [{**run.summary(), "with_workers_us_per_req": family[id(run)] * 1e6
                                        if id(run) in family else None} for run in runs], args)


if __name__ == "__main__":
    main()
