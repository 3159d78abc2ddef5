"""Large tensors in the request body against in system shared memory: transerve and the real Triton side by side.

The examples' `identity` model (python backend) echoes an FP32 tensor of 16 KiB to 16 MiB, one request at a time,
with tritonclient's synchronous clients, as an application on the same host would call it:

- `http`: binary tensor data in the body both ways (tritonclient's default);
- `http-shm`: the input written into a registered /dev/shm region before each request, the output written by the
  server into another and read back (copied out) after it;
- `grpc`, `grpc-shm`: the same over gRPC.

Every request's output is checked against its input. The client's work (serializing, writing and reading the
regions) is inside each timed request, since an application pays it too. Servers and transports alternate within
each round so that drift on a shared machine spreads over all of them; the median of each cell's requests counts.

    python -m benchmarks.shared_memory                  # starts both servers: about 2 minutes
    python -m benchmarks.shared_memory --servers transerve --sizes 1048576 --requests 20
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as client_shm

from benchmarks.common.results import add_json_option, write_json

TRANSPORTS = ("http", "http-shm", "grpc", "grpc-shm")
SIZES = (16 * 1024, 1024 * 1024, 16 * 1024 * 1024)


class Caller:
    """One server and transport: `call(array)` sends one request and returns the output."""

    def __init__(self, http_port: int, grpc_port: int, transport: str, byte_size: int) -> None:
        self.transport = transport
        self.grpc = transport.startswith("grpc")
        module = grpcclient if self.grpc else httpclient
        port = grpc_port if self.grpc else http_port
        self.client = module.InferenceServerClient(f"127.0.0.1:{port}", **({} if self.grpc else {
            "network_timeout": 120.0, "connection_timeout": 120.0}))
        self.module = module
        self.regions: list[tuple[str, object]] = []
        if transport.endswith("-shm"):
            for role in ("in", "out"):
                key = f"/transerve_bench_{role}_{uuid.uuid4().hex}"
                handle = client_shm.create_shared_memory_region(key[1:], key, byte_size)
                self.client.register_system_shared_memory(key[1:], key, byte_size)
                self.regions.append((key[1:], handle))

    def call(self, array: np.ndarray) -> np.ndarray:
        given = self.module.InferInput("INPUT_FP32", list(array.shape), "FP32")
        wanted = self.module.InferRequestedOutput("OUTPUT_FP32")
        if not self.regions:
            given.set_data_from_numpy(array)
            return self.client.infer("identity", [given], outputs=[wanted]).as_numpy("OUTPUT_FP32")
        (in_name, in_handle), (out_name, out_handle) = self.regions
        client_shm.set_shared_memory_region(in_handle, [array])
        given.set_shared_memory(in_name, array.nbytes)
        wanted.set_shared_memory(out_name, array.nbytes)
        self.client.infer("identity", [given], outputs=[wanted])
        return client_shm.get_contents_as_numpy(out_handle, np.float32, list(array.shape)).copy()

    def close(self) -> None:
        for name, handle in self.regions:
            self.client.unregister_system_shared_memory(name)
            client_shm.destroy_shared_memory_region(handle)
        self.client.close()


def timed(call: Callable[[np.ndarray], np.ndarray], array: np.ndarray, count: int) -> list[float]:
    """Milliseconds of each of `count` calls, every answer checked."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        answer = call(array)
        times.append((time.perf_counter() - started) * 1000)
        if not np.array_equal(answer, array):
            raise SystemExit("a response differs from its request")
    return times


@contextlib.contextmanager
def servers_under_test(names: list[str]) -> Iterator[dict[str, tuple[int, int]]]:
    """Each server's (HTTP, gRPC) ports, started on the examples and stopped on exit."""
    from benchmarks.common.servers import EXAMPLE_REPOSITORY, start_transerve, start_triton

    with contextlib.ExitStack() as stack:
        ports = {}
        for name in names:
            print(f"starting {name} ...", file=sys.stderr)
            start = start_transerve if name == "transerve" else start_triton
            server = stack.enter_context(start(EXAMPLE_REPOSITORY, "--http-max-input-size=1073741824")
                                         if name == "transerve" else start(EXAMPLE_REPOSITORY))
            ports[name] = (server.http_port, server.grpc_port)
        yield ports


def report(results: dict[tuple[str, str, int], list[float]], names: list[str], sizes: list[int],
           transports: list[str]) -> str:
    lines = ["median ms per request, concurrency 1 (identity model, FP32 in and out)", ""]
    header = ["size", "transport", *names]
    if "triton" in names and "transerve" in names:
        header.append("transerve / triton")
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for size in sizes:
        for transport in transports:
            medians = [statistics.median(results[(name, transport, size)]) for name in names]
            cells = [_size_text(size), transport, *(f"{m:.2f}" for m in medians)]
            if len(header) > len(cells):
                cells.append(f"{medians[names.index('transerve')] / medians[names.index('triton')]:.2f}x")
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "shared memory against the body, per server (time with / time without)", "",
              "| size | server | " + " | ".join(f"{t} / {t[:-4]}" for t in transports if t.endswith("-shm")) + " |",
              "|---|---|" + "---|" * sum(t.endswith("-shm") for t in transports)]
    for size in sizes:
        for name in names:
            ratios = [statistics.median(results[(name, t, size)]) / statistics.median(results[(name, t[:-4], size)])
                      for t in transports if t.endswith("-shm") and t[:-4] in transports]
            lines.append(f"| {_size_text(size)} | {name} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    return "\n".join(lines)


def _size_text(size: int) -> str:
    return f"{size // (1024 * 1024)} MiB" if size >= 1024 * 1024 else f"{size // 1024} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="transerve,triton")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes of the FP32 tensor")
    parser.add_argument("--requests", type=int, default=15, help="timed requests per cell and round")
    parser.add_argument("--rounds", type=int, default=3)
    add_json_option(parser)
    args = parser.parse_args()
    names = args.servers.split(",")
    transports = args.transports.split(",")
    sizes = [int(size) for size in args.sizes.split(",")]
    results: dict[tuple[str, str, int], list[float]] = {}
    rng = np.random.default_rng(0)
    with servers_under_test(names) as ports:
        for round_index in range(args.rounds):
            for size in sizes:
                array = rng.standard_normal((1, size // 4), dtype=np.float32)
                for transport in transports:
                    for name in names if round_index % 2 == 0 else names[::-1]:
                        caller = Caller(*ports[name], transport, size)
                        try:
                            timed(caller.call, array, 2)  # warm-up, not counted
                            results.setdefault((name, transport, size), []).extend(
                                timed(caller.call, array, args.requests))
                        finally:
                            caller.close()
            print(f"round {round_index + 1} of {args.rounds} done", file=sys.stderr)
    print(report(results, names, sizes, transports))
    write_json(args.json, "shared_memory", [
        {"server": name, "transport": transport, "bytes": size, "median_ms": statistics.median(times), "ms": times}
        for (name, transport, size), times in results.items()], args)


if __name__ == "__main__":
    main()
