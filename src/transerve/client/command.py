"""`transerve client -m MODEL --input-file IN --output-file OUT`: each line of IN through a served text model, its
answer on the same line of OUT. Seed 001's client line runs as it is written (`--server=HOST:PORT
--model-name=NAME --model-version=N --input_file=IN --output_file=OUT`): those are other spellings of `-u`, `-m`,
`-x` and the file options.

OUT is the checkpoint: a rerun of the same command skips the lines OUT already holds. A line the server refuses
(or that cannot be sent: not UTF-8, too long) is reported with its number on stderr and in `--errors-file`, its
output line left empty, and the run goes on; the exit status is then 1. A run that cannot go on (server gone,
unknown model) stops with status 2, and what it wrote stays to resume from.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

from transerve.client.errors import RunStopped
from transerve.client.files import Output, count_lines, read_lines
from transerve.client.grpc import GrpcTransport
from transerve.client.http import HttpTransport
from transerve.client.progress import ProgressBar
from transerve.client.runner import Send, answer_lines
from transerve.client.sink import Sink
from transerve.client.target import Parameter, Target, tensor_target

MAX_BATCH_SIZE = 256
MAX_CONCURRENCY = 64
MAX_LINE_BYTES = 16 << 20
#: The largest answer read by default: a batch of long answers fits, a runaway server does not grow the client.
MAX_ANSWER_BYTES = 64 << 20
DEFAULT_URLS = {"http": "localhost:8000", "grpc": "localhost:8001"}
#: Exit statuses: every line answered; some lines failed (the output is complete, their lines empty); the run
#: stopped (bad options, the server) or was interrupted, and a rerun resumes.
DONE, LINES_FAILED, STOPPED, INTERRUPTED = 0, 1, 2, 130


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "client", help="translate a file: each input line through a served text model", allow_abbrev=False,
        description="Send each line of an input file to a served text model (a text ensemble, or /generate with "
                    "--generate) and write its answer on the same line of the output file. The output file is the "
                    "checkpoint: rerun the command to resume after the lines it already holds.",
    )
    add = parser.add_argument
    add("-m", "--model", "--model-name", dest="model", required=True, metavar="NAME",
        help="the model's name (e.g. marian_text from transerve convert)")
    add("-x", "--model-version", default="", metavar="VERSION",
        help="the version asked for, in the request's URL or gRPC field (default: the one the server picks)")
    add("-u", "--url", "--server", dest="url", metavar="HOST:PORT",
        help="the server (default localhost:8000 for http, localhost:8001 for grpc)")
    add("-i", "--protocol", choices=sorted(DEFAULT_URLS), default="http", help="http (default) or grpc")
    add("--input-file", "--input_file", dest="input_file", type=Path, required=True, metavar="PATH",
        help="the text to send, one request per line (UTF-8)")
    add("--output-file", "--output_file", dest="output_file", type=Path, required=True, metavar="PATH",
        help="answers, one per input line; lines it already holds are skipped")
    add("--errors-file", type=Path, metavar="PATH", help="append 'LINE<TAB>error' for each line that failed")
    add("--generate", action="store_true",
        help="call /v2/models/MODEL/generate (JSON text_input -> text_output) instead of infer")
    add("--input-name", help="the text input (default: the model's one BYTES input; text_input with --generate)")
    add("--output-name", help="the output written (default: the model's one BYTES output, else its one output; "
                              "text_output with --generate)")
    add("--param", action="append", default=[], metavar="KEY=VALUE",
        help="a request parameter, e.g. max_tokens=64 or beam_width=4 (repeatable; numbers and true/false typed)")
    add("--batch-size", type=int, default=1, metavar="N",
        help=f"lines per request, for models with max_batch_size > 0 (default 1, at most {MAX_BATCH_SIZE})")
    add("--concurrency", type=int, default=4, metavar="N",
        help=f"requests in flight (default 4, at most {MAX_CONCURRENCY})")
    add("--max-line-bytes", type=int, default=65536, metavar="N",
        help="longer lines fail without being sent (default 65536)")
    add("--timeout", type=float, default=300.0, metavar="SECONDS",
        help="per request, the whole answer included (default 300)")
    add("--max-answer-bytes", type=int, default=MAX_ANSWER_BYTES, metavar="N",
        help=f"a larger answer stops the run (default {MAX_ANSWER_BYTES})")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args, sys.stderr)
    except (RunStopped, OSError) as exc:  # OSError: a file that cannot be read or written
        print(f"transerve client: {exc}", file=sys.stderr)
        return STOPPED
    except KeyboardInterrupt:
        print("transerve client: interrupted; rerun the same command to resume", file=sys.stderr)
        return INTERRUPTED


def _run(args: argparse.Namespace, stderr: TextIO) -> int:
    _check_bounds(args)
    if args.input_file.resolve() == args.output_file.resolve():
        raise RunStopped("the output file must not be the input file")
    if not args.input_file.is_file():
        raise RunStopped(f"no input file {args.input_file}")
    parameters = dict(parse_parameter(text) for text in args.param)
    url = args.url or DEFAULT_URLS[args.protocol]
    transport = (GrpcTransport if args.protocol == "grpc" else HttpTransport)(url, args.timeout, args.max_answer_bytes)
    target = _target(args, transport, parameters)
    total = count_lines(args.input_file)
    output = Output(args.output_file, total)
    errors = args.errors_file.open("a", encoding="utf-8") if args.errors_file else None
    progress = ProgressBar(stderr, total, output.done)
    if output.done:
        progress.interrupt(f"transerve client: {args.output_file} holds {output.done} lines: resuming at line "
                           f"{output.done + 1}")
    sink = Sink(output, errors, progress)
    started = time.monotonic()
    try:
        answer_lines(read_lines(args.input_file, output.done, args.max_line_bytes), args.batch_size, args.concurrency,
                     _sender(transport, target), sink.take)
        sink.flush()
    finally:
        progress.close()
        output.close()
        if errors is not None:
            errors.close()
    new = total - output.done
    report = f", {sink.failed} failed (their lines are empty)" if sink.failed else ""
    print(f"transerve client: {new} lines answered into {args.output_file}{report} in "
          f"{time.monotonic() - started:.1f} s", file=stderr)
    return LINES_FAILED if sink.failed else DONE


def _check_bounds(args: argparse.Namespace) -> None:
    for option, value, low, high in (("--batch-size", args.batch_size, 1, MAX_BATCH_SIZE),
                                     ("--concurrency", args.concurrency, 1, MAX_CONCURRENCY),
                                     ("--max-line-bytes", args.max_line_bytes, 1, MAX_LINE_BYTES),
                                     ("--max-answer-bytes", args.max_answer_bytes, 1, 2**31 - 1)):
        if not low <= value <= high:
            raise RunStopped(f"{option} must be between {low} and {high}, got {value}")
    if not args.timeout > 0:
        raise RunStopped(f"--timeout must be positive, got {args.timeout}")
    if args.generate and args.batch_size != 1:
        raise RunStopped("--generate sends one line per request: --batch-size must be 1")


def _target(args: argparse.Namespace, transport: HttpTransport | GrpcTransport,
            parameters: dict[str, Parameter]) -> Target:
    if args.generate:
        if args.protocol == "grpc":
            raise RunStopped("--generate calls /generate, an HTTP endpoint: use -i http")
        return Target(args.model, args.model_version, args.input_name or "text_input",
                      args.output_name or "text_output", generate=True, parameters=parameters)
    config = transport.model_config(args.model, args.model_version)
    target = tensor_target(config, args.model, args.model_version, args.input_name, args.output_name, parameters)
    if args.batch_size > max(1, target.max_batch_size):
        raise RunStopped(f"--batch-size {args.batch_size} is more than model '{args.model}' takes in a request "
                         f"(max_batch_size {target.max_batch_size})")
    return target


def _sender(transport: HttpTransport | GrpcTransport, target: Target) -> Send:
    if isinstance(transport, HttpTransport) and target.generate:
        return lambda texts: [transport.generate(target, text) for text in texts]
    return lambda texts: transport.infer(target, texts)


def parse_parameter(text: str) -> tuple[str, Parameter]:
    """`KEY=VALUE`, the value an int, a float, true/false, or else a string."""
    key, equals, value = text.partition("=")
    if not key or not equals:
        raise RunStopped(f"--param expects KEY=VALUE, got '{text}'")
    if value in ("true", "false"):
        return key, value == "true"
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    return key, value
