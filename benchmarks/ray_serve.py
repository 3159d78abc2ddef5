"""Ray Serve: add_sub through `transerve serve-ray` (Serve's HTTP proxy, then a replica's loopback hop to its
transerve server) against transerve alone, and the Serve path's throughput with 1 and 2 replicas. `serve-echo`
is Serve alone: one replica that answers every request with add_sub's answer, made once, so that what Serve's
proxy and routing cost is told apart from what the replica's hop to its server costs.

    python -m benchmarks.ray_serve [--duration 5] [--rounds 2] [--concurrency 1,16] [--replicas 1,2]

Needs the `ray` extra. The cluster is local: a head and a second node (tests/support/ray_cluster.py), one replica
per node, the head's proxy spreading requests across both (RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING=0).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common.load import RunResult, percentile, run_once
from benchmarks.common.results import add_json_option, comma_list, write_json
from benchmarks.common.servers import EXAMPLE_REPOSITORY, ServerProcess, start_transerve
from tests.support.ray_cluster import ray_cluster
from tests.support.servers import free_ports

ECHO_ANSWER = (b'{"model_name":"add_sub","model_version":"1","outputs":[{"name":"OUTPUT0","datatype":"FP32",'
               b'"shape":[1,4],"data":[1.5,2.5,3.5,4.5]},{"name":"OUTPUT1","datatype":"FP32","shape":[1,4],'
               b'"data":[0.5,1.5,2.5,3.5]}]}')


class Echo:
    """Serve's floor: the body is read (as the replica reads it) and a constant answer returned."""

    async def __call__(self, request):  # a starlette Request
        from starlette.responses import Response

        await request.body()
        return Response(ECHO_ANSWER, media_type="application/json")


@contextlib.contextmanager
def serve_echo(address: str) -> Iterator[int]:
    """Serve alone, on the same cluster: the Echo deployment behind a proxy on a free port."""
    import ray
    from ray import serve

    (port,) = free_ports(1)
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(serve.deployment(Echo, name="echo", max_ongoing_requests=256,
                                   ray_actor_options={"num_cpus": 0.5, "resources": {"transerve": 1}}).bind(),
                  name="echo", route_prefix="/")
        yield port
        serve.shutdown()
    finally:
        ray.shutdown()


@contextlib.contextmanager
def serve_ray(repository: Path, address: str, replicas: int, logs: Path) -> Iterator[ServerProcess]:
    (port,) = free_ports(1)
    server = ServerProcess(
        f"serve-ray x{replicas}",
        [sys.executable, "-m", "transerve", "serve-ray", f"--model-repository={repository}", f"--replicas={replicas}",
         f"--ray-address={address}", f"--http-port={port}", "--proxy-location=HeadOnly", "--num-cpus-per-replica=0.5",
         '--replica-resources={"transerve": 1}', f"--log-dir={logs}"],
        http_port=port, grpc_port=0, metrics_port=0, log_path=logs / f"serve-ray-{replicas}.log")
    try:
        server.wait_ready(timeout=240)
        yield server
    finally:
        server.stop(timeout=60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=comma_list, default=["1", "16"])
    parser.add_argument("--replicas", type=comma_list, default=["1", "2"])
    add_json_option(parser)
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency]
    results: dict[tuple[str, int], list[RunResult]] = {}

    def measure(name: str, port: int) -> None:
        for _ in range(args.rounds):
            for concurrency in concurrencies:
                run = run_once(name, ("127.0.0.1", port), "json", concurrency, 1, args.warmup, args.duration)
                results.setdefault((name, concurrency), []).append(run)
                print(f"{name:14} c={concurrency:<3} {len(run.latencies) / run.duration:7.0f} req/s "
                      f"errors {run.errors}", file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="ray-bench-") as tmp:
        repository = Path(tmp) / "repo"
        shutil.copytree(EXAMPLE_REPOSITORY / "add_sub", repository / "add_sub")
        with start_transerve(repository) as alone:
            measure("transerve", alone.http_port)
        with ray_cluster(env={"RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0"}) \
                as address:
            with serve_echo(address) as port:
                measure("serve-echo", port)
            for replicas in (int(r) for r in args.replicas):
                with serve_ray(repository, address, replicas, Path(tmp)) as server:
                    measure(f"serve-ray x{replicas}", server.http_port)
    print(report(results))
    write_json(args.json, "ray_serve", [run.summary() for runs in results.values() for run in runs], args)


def report(results: dict[tuple[str, int], list[RunResult]]) -> str:
    lines = ["| server | concurrency | req/s | p50 ms | p99 ms | errors | p50 added by Serve ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    alone = {c: _p50(runs) for (name, c), runs in results.items() if name == "transerve"}
    for (name, concurrency), runs in results.items():
        latencies = sorted(latency for run in runs for latency in run.latencies)
        rate = len(latencies) / sum(run.duration for run in runs)
        added = "" if name == "transerve" else f"{_p50(runs) - alone[concurrency]:.2f}"
        lines.append(f"| {name} | {concurrency} | {rate:.0f} | {percentile(latencies, 0.5) * 1e3:.2f} | "
                     f"{percentile(latencies, 0.99) * 1e3:.2f} | {sum(run.errors for run in runs)} | {added} |")
    return "\n".join(lines)


def _p50(runs: list[RunResult]) -> float:
    return percentile(sorted(latency for run in runs for latency in run.latencies), 0.5) * 1e3


if __name__ == "__main__":
    main()
