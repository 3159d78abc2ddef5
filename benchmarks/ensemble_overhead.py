"""Ensemble overhead: a three-step ensemble of trivial python models against one call of one of them.

transerve and the real Triton serve the same repository; runs alternate between them. The added latency per
step, (p50 of the ensemble - p50 of the single model) / 3, is what each server charges to move a request
from one step to the next; the issue's goal is transerve's being at most Triton's.

    python -m benchmarks.ensemble_overhead [--duration 5] [--rounds 2] [--concurrency 1,16] [--baseline REF]

`--baseline REF` also serves the repository with transerve as of git commit REF (`transerve@REF`), so a change
is measured before and after in one run, under the same load.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common.load import RunResult, percentile, run_once
from benchmarks.common.models import STEPS, request_bytes, write_chain_repository
from benchmarks.common.results import add_json_option, comma_list, write_json


@contextlib.contextmanager
def servers(names: list[str]) -> Iterator[dict[str, tuple[str, int]]]:
    """Start each named server: `transerve`, `triton`, or `transerve@REF` (the source of git commit REF)."""
    from benchmarks.common.servers import start_transerve, start_triton, transerve_source_at

    with tempfile.TemporaryDirectory(prefix="ensemble-bench-") as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp) / "repo"
        write_chain_repository(root)
        addresses = {}
        for name in names:
            print(f"starting {name} ...", file=sys.stderr)
            if name == "triton":
                server = stack.enter_context(start_triton(root))
            elif name.startswith("transerve@"):
                source = transerve_source_at(name.partition("@")[2], Path(tmp) / name)
                server = stack.enter_context(start_transerve(root, source=source))
            else:
                server = stack.enter_context(start_transerve(root))
            addresses[name] = ("127.0.0.1", server.http_port)
        yield addresses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=comma_list, default=["1", "16"])
    parser.add_argument("--servers", type=comma_list, default=["transerve", "triton"])
    parser.add_argument("--baseline", metavar="REF", help="also run transerve as of this git commit")
    add_json_option(parser)
    args = parser.parse_args(argv)
    if args.baseline:
        args.servers.insert(0, f"transerve@{args.baseline}")
    results: dict[tuple[str, str, int], list[RunResult]] = {}
    with servers(args.servers) as addresses:
        for concurrency in (int(c) for c in args.concurrency):
            for round_index in range(args.rounds):
                for model in ("pass_1", "chain"):
                    for name in args.servers:
                        host, port = addresses[name]
                        run = run_once(name, (host, port), "json", concurrency, 1, args.warmup,
                                                args.duration, request_bytes(f"{host}:{port}", model))
                        results.setdefault((name, model, concurrency), []).append(run)
                        print(f"round {round_index + 1} {name:9} {model:7} c={concurrency:<3} "
                              f"{len(run.latencies) / run.duration:8.0f} req/s errors {run.errors}", file=sys.stderr)
    print(report(results, args.servers))
    write_json(args.json, "ensemble_overhead", [{"model": model, **run.summary()}
                                                for (_, model, _), runs in results.items() for run in runs], args)


def report(results: dict[tuple[str, str, int], list[RunResult]], names: list[str]) -> str:
    lines = ["| server | concurrency | single req/s | single p50 ms | chain req/s | chain p50 ms | chain p99 ms "
             "| added per step ms |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    per_step: dict[tuple[str, int], float] = {}
    for name, concurrency in sorted({(n, c) for n, _, c in results}):
        row = {}
        for kind in ("pass_1", "chain"):
            runs = results[(name, kind, concurrency)]
            latencies = sorted(latency for run in runs for latency in run.latencies)
            row[kind] = (len(latencies) / sum(run.duration for run in runs),
                         percentile(latencies, 0.5) * 1000, percentile(latencies, 0.99) * 1000,
                         sum(run.errors for run in runs))
        added = (row["chain"][1] - row["pass_1"][1]) / STEPS
        per_step[(name, concurrency)] = added
        lines.append(f"| {name} | {concurrency} | {row['pass_1'][0]:.0f} | {row['pass_1'][1]:.2f} | "
                     f"{row['chain'][0]:.0f} | {row['chain'][1]:.2f} | {row['chain'][2]:.2f} | {added:.3f} |")
    if "triton" in names:
        for concurrency in sorted({c for _, c in per_step}):
            theirs = per_step[("triton", concurrency)]
            for name in (n for n in names if n != "triton"):
                ours = per_step[(name, concurrency)]
                lines.append(f"\nconcurrency {concurrency}: {name} adds {ours:.3f} ms per step, Triton {theirs:.3f} "
                             f"ms (ratio {ours / theirs:.2f})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
