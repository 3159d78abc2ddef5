"""`transerve perf`: perf_analyzer's flags (those that make sense for a Python client of a KServe v2 server) and
the run they describe: for each load level, windows until stable, then the summary, a CSV and a plot; with
`--llm`, genai-perf's streaming measurements instead (`llm.py`)."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from transerve.perf import inputs, llm, plot, report
from transerve.perf.load import ClosedLoop, Load, OpenLoop, Recorder
from transerve.perf.measure import measure, over_limit, server_stats
from transerve.perf.options import (
    MAX_ANSWER_BYTES,
    MAX_THREADS,
    REQUEST_TIMEOUT_S,
    Options,
    PerfError,
    check_bounds,
    concurrency_levels,
    parse_range,
    parse_shape,
)
from transerve.perf.transport import CONNECT_TIMEOUT_S, connect

PROG = "transerve perf"


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "perf", help="measure a served model's throughput and latency (perf_analyzer's flags)", allow_abbrev=False,
        description="Load a model with concurrent or rate-paced requests and report throughput, client and "
                    "server latency per load level, as perf_analyzer does; --llm measures streaming generation "
                    "(time to first token, inter-token latency) as genai-perf does. See docs/perf.md.")
    _own_errors(parser)
    add = parser.add_argument
    add("-m", dest="model", required=True, metavar="MODEL", help="the model to load")
    add("-x", dest="version", default="", metavar="VERSION", help="its version (default: the server's choice)")
    add("-u", dest="url", metavar="HOST:PORT", help="server address (default localhost:8000, gRPC localhost:8001)")
    add("-i", dest="protocol", type=str.lower, choices=["http", "grpc"], default="http", help="protocol")
    add("-b", dest="batch_size", type=int, default=1, metavar="N", help="batch size of each request (default 1)")
    add("--concurrency-range", metavar="START:END:STEP",
        help="closed loop: requests outstanding (default 1); END 0 is no limit, with -l")
    add("-t", dest="concurrency", type=int, metavar="N",
        help="perf_analyzer's deprecated concurrency flags: -t the first level, -c the last (0: no limit, with -l), "
             "in steps of 1")
    add("-c", dest="max_concurrency", type=int, metavar="N", help="the last concurrency level of -t's search")
    add("-d", dest="dynamic", action="store_true",
        help="accepted for perf_analyzer's command lines: -t and -c always search (see docs/perf.md)")
    add("-l", "--latency-threshold", dest="latency_threshold", type=int, default=0, metavar="MS",
        help="end the search at the first level whose latency reaches MS milliseconds (default 0: no limit)")
    add("--request-rate-range", metavar="START:END:STEP", help="open loop: requests sent per second")
    add("--request-distribution", choices=["constant", "poisson"], default="constant",
        help="time between requests of --request-rate-range (default constant)")
    add("--request-timeout", type=float, default=REQUEST_TIMEOUT_S, metavar="SECONDS",
        help=f"the most one request may take, its whole answer included (default {REQUEST_TIMEOUT_S:g}); the "
             f"calls around the load (metadata, config, statistics) take at most {CONNECT_TIMEOUT_S:g}")
    add("--max-answer-bytes", type=int, default=MAX_ANSWER_BYTES, metavar="N",
        help=f"a larger answer stops the run (default {MAX_ANSWER_BYTES})")
    add("--max-threads", type=int, default=16, metavar="N",
        help=f"open loop: requests in flight at most (default 16, up to {MAX_THREADS})")
    add("--shape", action="append", default=[], metavar="NAME:D1,D2", help="a variable input's shape (repeatable)")
    add("--string-data", metavar="TEXT", help="the value of every BYTES input element")
    add("--string-length", type=int, default=inputs.STRING_LENGTH, metavar="N",
        help=f"length of random BYTES elements (default {inputs.STRING_LENGTH})")
    add("--input-data", default="random", metavar="random|zero|FILE.json",
        help="input values: random (default), zero, or perf_analyzer's JSON data file")
    add("-z", dest="zero_input", action="store_true", help="--input-data zero")
    add("-p", "--measurement-interval", dest="window_ms", type=int, default=5000, metavar="MS",
        help="measurement window in milliseconds (default 5000)")
    add("--measurement-mode", choices=["time_windows", "count_windows"], default="time_windows")
    add("--measurement-request-count", dest="request_count", type=int, default=50, metavar="N",
        help="requests a window holds in count_windows mode; requests per level with --llm (default 50)")
    add("--percentile", type=int, metavar="P", help="stabilize on and report the P-th percentile latency")
    add("-r", "--max-trials", dest="max_trials", type=int, default=10, metavar="N",
        help="windows per level at most (default 10)")
    add("-s", "--stability-percentage", dest="stability", type=float, default=10.0, metavar="PERCENT",
        help="allowed spread of the last three windows around their mean (default 10)")
    add("-v", dest="verbose", action="count", default=0, help="print each measurement window (perf_analyzer's passes)")
    add("-f", "--latency-report-file", dest="csv_file", type=Path, metavar="FILE.csv", help="write the results as CSV")
    add("--shared-memory", choices=["none", "system", "cuda"], type=str.lower, default="none",
        help="none (default): tensors travel in the requests; system and cuda are refused")
    add("--plot", dest="plot_file", type=Path, metavar="FILE.png", help="draw throughput and latency against load")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sync", dest="sync", action="store_true", default=True, help="synchronous calls (default)")
    mode.add_argument("-a", "--async", dest="sync", action="store_false",
                      help="accepted for perf_analyzer's command lines: the load is the same (see docs/perf.md)")
    llm.add_arguments(parser)


def _own_errors(parser: argparse.ArgumentParser) -> None:
    """Errors in perf's flags, unknown ones included, with perf's usage: argparse leaves a subcommand's unknown
    flags to the top-level parser, which would show the top-level usage instead."""

    def error(message: str) -> NoReturn:
        print(parser.format_usage().rstrip(), file=sys.stderr)
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(2)

    parse_known = parser.parse_known_args

    def parse_known_args(args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extra = parse_known(args, namespace)
        if extra:
            error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed, extra

    parser.error = error  # type: ignore[method-assign]
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def _levels(args: argparse.Namespace) -> tuple[str, tuple[float, ...]]:
    """The load mode and its levels, from --concurrency-range, --request-rate-range, or -t/-c."""
    deprecated = args.concurrency is not None or args.max_concurrency is not None
    given = [flag for flag, value in (("--concurrency-range", args.concurrency_range),
                                      ("--request-rate-range", args.request_rate_range), ("-t/-c", deprecated))
             if value]
    if len(given) > 1:
        raise PerfError(f"give {given[0]} or {given[1]}, not both")
    open_end = args.latency_threshold > 0
    if args.request_rate_range:
        return "request_rate", parse_range(args.request_rate_range, "--request-rate-range", False, open_end)
    if deprecated:
        start = args.concurrency if args.concurrency is not None else 1
        end = args.max_concurrency if args.max_concurrency is not None else 1
        if end == 0 and not open_end:
            raise PerfError("-c 0 (no maximum concurrency) needs a latency limit: give -l")
        return "concurrency", concurrency_levels(start, end)
    text = args.concurrency_range or "1"
    if not open_end and text.split(":")[1:2] == ["0"]:
        raise PerfError("--concurrency-range with END 0 (no limit) needs a latency limit: give -l")
    return "concurrency", parse_range(text, "--concurrency-range", True, open_end)


def options_from_args(args: argparse.Namespace) -> Options:
    if args.zero_input and args.input_data not in ("random", "zero"):
        raise PerfError("give -z or an --input-data file, not both")
    if args.shared_memory != "none":
        raise PerfError(f"--shared-memory {args.shared_memory}: transerve perf sends every tensor in the request "
                        "itself; only --shared-memory none is supported")
    mode, levels = _levels(args)
    shapes = dict(parse_shape(text) for text in args.shape)
    url = args.url or ("localhost:8000" if args.protocol == "http" else "localhost:8001")
    options = Options(
        model=args.model, version=args.version, url=url, protocol=args.protocol, batch_size=args.batch_size,
        mode=mode, levels=levels, distribution=args.request_distribution, shapes=shapes,
        string_data=args.string_data, string_length=args.string_length,
        input_data="zero" if args.zero_input else args.input_data, window_ms=args.window_ms,
        measurement_mode=args.measurement_mode, request_count=args.request_count, percentile=args.percentile,
        max_trials=args.max_trials, stability=args.stability, csv_file=args.csv_file, plot_file=args.plot_file,
        max_threads=args.max_threads, sync=args.sync, verbose=args.verbose > 0,
        latency_threshold_ms=args.latency_threshold, request_timeout_s=args.request_timeout,
        max_answer_bytes=args.max_answer_bytes,
    )
    check_bounds(options)
    return options


def run(args: argparse.Namespace) -> int:
    # SIGTERM ends a run as Ctrl-C does: loads stop, nothing is written.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        options = options_from_args(args)
        if options.plot_file:
            plot.check_available()
        if args.llm:
            return llm.run(args, options)
        return run_load(options)
    except PerfError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _warn(message: str) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def prepare_requests(options: Options, api: Any) -> list[Any]:
    """The encoded requests, one per data step."""
    spec = inputs.model_spec(api.metadata(), api.config())
    inputs.check_batch(spec, options.batch_size)
    unknown = sorted(set(options.shapes) - {entry.name for entry in spec.inputs})
    if unknown:
        raise PerfError(f"--shape names '{unknown[0]}', which is not an input of model '{options.model}'")
    if options.input_data in ("random", "zero"):
        steps = [inputs.synthetic_step(spec, options.shapes, options.input_data, options.string_data,
                                       options.string_length)]
    else:
        steps = inputs.read_data_file(Path(options.input_data), spec, options.shapes)
    if spec.inputs and not steps[0]:
        raise PerfError(f"every input of '{options.model}' is optional: name those to send with --shape or "
                        "--input-data")
    return [api.encode(request, spec.outputs) for request in inputs.batches(steps, spec, options.batch_size)]


def run_load(options: Options) -> int:
    api = connect(options)
    try:
        requests = prepare_requests(options, api)
        print(report.settings(options), end="\n\n", flush=True)
        read_stats = lambda: server_stats(api.statistics(), options.model)
        results = []
        for level in options.levels:
            print(report.level_header(options, level), flush=True)
            load = _start(options, level, requests)
            try:
                result = measure(load, level, options, read_stats, _warn)
            finally:
                load.stop()
            if over_limit(options, result):  # perf_analyzer's search: the level is left out, and the search ends
                print(f"Measured latency went over the set limit of {options.latency_threshold_ms} msec. ",
                      file=sys.stderr, flush=True)
                break
            results.append(result)
            print(report.level_block(options, result), end="\n\n", flush=True)
        print(report.final_table(options, results))
        if options.csv_file:
            _write(lambda: report.write_csv(options.csv_file, options, results), options.csv_file)
        if options.plot_file and not results:
            _warn(f"no level met the latency limit: {options.plot_file} is not drawn")
        elif options.plot_file:
            plot.plot(options.plot_file, report.LEVEL_NAMES[options.mode], [r.level for r in results],
                      {"throughput (infer/sec)": [r.throughput for r in results],
                       "avg latency": [r.avg_us / 1000 for r in results],
                       **{f"p{p} latency": [r.percentiles_us[p] / 1000 for r in results] for p in (50, 99)}},
                      f"{options.model} over {options.protocol.upper()}, batch {options.batch_size}")
    finally:
        api.close()
    unstable = [result.level for result in results if not result.stable]
    if unstable:
        _warn(f"levels {', '.join(f'{level:g}' for level in unstable)} were not stable within "
              f"{options.max_trials} windows: raise -p or -s")
        return 1
    return 0


def _start(options: Options, level: float, requests: list[Any]) -> Load:
    connect_one = lambda: connect(options)
    if options.mode == "concurrency":
        return ClosedLoop(connect_one, requests, Recorder()).start(int(level))
    return OpenLoop(connect_one, requests, Recorder()).start(level, options.distribution, options.max_threads)


def _write(write: Callable[[], None], path: Path) -> None:
    try:
        write()
    except OSError as exc:
        raise PerfError(f"cannot write {path}: {exc.strerror or exc}") from None
