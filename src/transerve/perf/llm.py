"""`transerve perf --llm`: streaming generation measured as genai-perf measures it. Each request streams its
answer (HTTP `generate_stream` server-sent events, or a gRPC `ModelStreamInfer` stream); the client stamps every
response, and reports per concurrency level time to first token, inter-token latency ((last token - first token)
/ (output tokens - 1)), request latency, sequence lengths, output tokens/s and requests/s.

Two kinds of model: a text model (`text_input` in, `text_output` out: `transerve convert`'s text ensemble),
whose prompts are text and whose output tokens are counted with `--tokenizer` (else each streamed piece counts
as one token); or a generator (`input_ids`/`INPUT_ID` in), whose prompts are token ids and whose responses say
how many ids are new (`sequence_length` - `prefix_length`)."""

from __future__ import annotations

import argparse
import csv
import http.client
import json
import math
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from transerve.perf import plot
from transerve.perf.options import Options, PerfError
from transerve.perf.transport import connect, error_text, read_answer, split_url

MAX_PROMPTS = 100_000
MAX_TOKENS = 65_536
MAX_PROMPT_FILE_BYTES = 256 * 1024 * 1024
#: Words synthetic text prompts are made of (one or two tokens each in common vocabularies).
WORDS = ("the", "house", "is", "small", "and", "garden", "green", "while", "people", "walk", "to", "work", "in",
         "morning", "with", "coffee", "after", "rain", "comes", "sun", "over", "hills", "rivers", "old", "towns")
TOKEN_INPUTS = ("input_ids", "INPUT_ID")
LENGTH_INPUTS = {"input_ids": "sequence_length", "INPUT_ID": "REQUEST_INPUT_LEN"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LLM mode (--llm), as genai-perf")
    add = group.add_argument
    add("--llm", action="store_true", help="stream generations; report time to first token, inter-token latency")
    add("--input-file", type=Path, metavar="FILE.jsonl",
        help='prompts, one JSON object a line: {"text": "..."} or {"input_ids": [...]} (default: synthetic)')
    add("--num-prompts", type=int, default=100, metavar="N", help="synthetic prompts made (default 100)")
    add("--synthetic-input-tokens-mean", type=int, default=32, metavar="N",
        help="synthetic prompt length in tokens (words for a text model; default 32)")
    add("--synthetic-input-tokens-stddev", type=float, default=0.0, metavar="N", help="its spread (default 0)")
    add("--token-id-range", default="3:256", metavar="LOW:HIGH",
        help="synthetic token ids are drawn from LOW to HIGH-1 (default 3:256)")
    add("--output-tokens-mean", type=int, default=32, metavar="N",
        help="max_tokens of every request (default 32)")
    add("--random-seed", type=int, default=0, metavar="N")
    add("--tokenizer", type=Path, metavar="tokenizer.json",
        help="count a text model's output tokens with this tokenizer (the `tokenizers` package)")


@dataclass(frozen=True)
class Prompt:
    text: str | None
    ids: list[int] | None

    @property
    def length(self) -> int:
        return len(self.ids) if self.ids is not None else len(self.text.split())


@dataclass(frozen=True)
class Stream:
    """One request's stamps (perf_counter_ns) and counts."""

    start: int
    first: int  # the first response carrying output
    last: int  # the last response carrying output
    end: int
    output_tokens: int
    input_tokens: int


class Target:
    """What the model takes (text or ids) and how one streamed request is sent and read."""

    def __init__(self, options: Options, metadata: dict[str, Any], config: dict[str, Any], max_tokens: int,
                 counter: Callable[[str], int] | None) -> None:
        names = {entry["name"]: entry for entry in metadata.get("inputs", [])}
        self.options = options
        self.max_tokens = max_tokens
        self.count_text = counter
        self.token_input = next((name for name in TOKEN_INPUTS if name in names), None)
        if self.token_input is None and "text_input" not in names:
            raise PerfError(f"--llm needs a model with a text_input input (a text ensemble) or input_ids/INPUT_ID "
                            f"(a generator); '{options.model}' takes {', '.join(sorted(names)) or 'nothing'}")
        self.batching = int(config.get("max_batch_size", 0) or 0) > 0
        self.id_type = names[self.token_input]["datatype"] if self.token_input else "BYTES"

    @property
    def takes_text(self) -> bool:
        return self.token_input is None

    def tensors(self, prompt: Prompt) -> dict[str, tuple[str, np.ndarray]]:
        """The request's inputs, with the batch dimension of 1 when the model batches."""
        lead = [1] if self.batching else []
        if self.takes_text:
            return {"text_input": ("BYTES", np.array(prompt.text.encode(), dtype=np.object_).reshape(lead + [1]))}
        ids = np.array(prompt.ids, dtype=np.uint32 if self.id_type == "UINT32" else np.int32)
        return {self.token_input: (self.id_type, ids.reshape(lead + [len(prompt.ids)])),
                LENGTH_INPUTS[self.token_input]: (self.id_type, np.array([len(prompt.ids)],
                                                                          ids.dtype).reshape(lead + [1]))}

    def tally(self, prompt: Prompt, start: int) -> Tally:
        return Tally(self, prompt, start)


class Tally:
    """One stream's responses as they come: a generator's new ids are its `sequence_length` past its
    `prefix_length` (or past the ids of earlier responses, for the first names); a text model's pieces are joined
    and counted by the tokenizer at the end, or else every response counts as one token (a piece may be empty:
    a token that ends inside a character)."""

    def __init__(self, target: Target, prompt: Prompt, start: int) -> None:
        self.target, self.prompt, self.start = target, prompt, start
        self.first = self.last = 0
        self.tokens = 0
        self.pieces: list[str] = []

    def add(self, outputs: dict[str, Any], now: int) -> None:
        target = self.target
        if target.takes_text:
            if "text_output" not in outputs:
                return
            piece = _text(outputs["text_output"])
            self.pieces.append(piece)
            if target.count_text is not None and not piece:
                return
            self.tokens += 1
        else:
            length = outputs.get("sequence_length", outputs.get("OUTPUT1"))
            if length is None:
                return
            total = int(np.asarray(length).reshape(-1)[0])
            prefix = outputs.get("prefix_length")
            seen = int(np.asarray(prefix).reshape(-1)[0]) if prefix is not None else self.tokens
            added = max(0, total - seen)
            if not added:
                return
            self.tokens += added
        self.first = self.first or now
        self.last = now

    def done(self, end: int) -> Stream:
        tokens = self.tokens
        if self.target.takes_text and self.target.count_text is not None:
            tokens = self.target.count_text("".join(self.pieces))
        return Stream(self.start, self.first, self.last, end, tokens, self.prompt.length)


def _text(piece: Any) -> str:
    value = np.asarray(piece, dtype=object).reshape(-1)
    item = value[0] if value.size else ""
    return item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)


def read_prompts(args: argparse.Namespace, target: Target) -> list[Prompt]:
    if args.input_file:
        return _prompt_file(args.input_file, target)
    if not 1 <= args.num_prompts <= MAX_PROMPTS:
        raise PerfError(f"--num-prompts must be between 1 and {MAX_PROMPTS}")
    if not 1 <= args.synthetic_input_tokens_mean <= MAX_TOKENS or args.synthetic_input_tokens_stddev < 0:
        raise PerfError(f"--synthetic-input-tokens-mean must be between 1 and {MAX_TOKENS}, its stddev not negative")
    low, high = _id_range(args.token_id_range)
    generator = random.Random(args.random_seed)
    prompts = []
    for _ in range(args.num_prompts):
        length = max(1, min(MAX_TOKENS, round(generator.gauss(args.synthetic_input_tokens_mean,
                                                              args.synthetic_input_tokens_stddev))))
        if target.takes_text:
            prompts.append(Prompt(" ".join(generator.choice(WORDS) for _ in range(length)), None))
        else:
            prompts.append(Prompt(None, [generator.randrange(low, high) for _ in range(length)]))
    return prompts


def _id_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError:
        raise PerfError(f"--token-id-range takes LOW:HIGH, got '{text}'") from None
    if not 0 <= low < high <= 2**31:
        raise PerfError(f"--token-id-range: need 0 <= LOW < HIGH, got '{text}'")
    return low, high


def _prompt_file(path: Path, target: Target) -> list[Prompt]:
    try:
        if path.stat().st_size > MAX_PROMPT_FILE_BYTES:
            raise PerfError(f"--input-file {path}: larger than {MAX_PROMPT_FILE_BYTES} bytes")
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise PerfError(f"--input-file {path}: {exc.strerror or exc}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            raise PerfError(f"--input-file {path}, line {number}: not JSON") from None
        text = entry.get("text", entry.get("text_input")) if isinstance(entry, dict) else None
        ids = entry.get("input_ids") if isinstance(entry, dict) else None
        if target.takes_text and isinstance(text, str) and text:
            prompts.append(Prompt(text, None))
        elif not target.takes_text and isinstance(ids, list) and ids and all(
                isinstance(i, int) and 0 <= i < 2**31 for i in ids):
            prompts.append(Prompt(None, ids))
        else:
            wanted = '{"text": "..."}' if target.takes_text else '{"input_ids": [non-negative integers]}'
            raise PerfError(f"--input-file {path}, line {number}: expected {wanted} for model "
                            f"'{target.options.model}'")
        if len(prompts) > MAX_PROMPTS:
            raise PerfError(f"--input-file {path}: more than {MAX_PROMPTS} prompts")
    if not prompts:
        raise PerfError(f"--input-file {path}: no prompts")
    return prompts


class HttpStreams:
    """POST generate_stream and read its server-sent events, stamping each."""

    def __init__(self, target: Target) -> None:
        options = target.options
        self.target = target
        host, port = split_url(options.url, "http")
        self.connection = http.client.HTTPConnection(host, port, timeout=options.request_timeout_s)
        self.timeout_s, self.max_bytes = options.request_timeout_s, options.max_answer_bytes
        self.path = f"/v2/models/{options.model}" + (f"/versions/{options.version}" if options.version else "")
        self.path += "/generate_stream"

    def send(self, prompt: Prompt) -> Stream:
        target = self.target
        body: dict[str, Any] = {"max_tokens": target.max_tokens, "stream": True}
        if target.takes_text:
            body["text_input"] = prompt.text
        else:
            body[target.token_input] = prompt.ids
            body[LENGTH_INPUTS[target.token_input]] = [len(prompt.ids)]
        tally = target.tally(prompt, time.perf_counter_ns())
        try:
            self.connection.request("POST", self.path, json.dumps(body), {"Content-Type": "application/json"})
            deadline = time.monotonic() + self.timeout_s
            response = self.connection.getresponse()
            if response.status != 200:
                answer = read_answer(response, self.max_bytes, deadline)
                raise PerfError(f"generate_stream: {error_text(response.status, answer)}")
            received = 0
            while line := response.readline(self.max_bytes - received + 1):
                received += len(line)
                if received > self.max_bytes:
                    raise PerfError(f"generate_stream: the answer is more than --max-answer-bytes {self.max_bytes}")
                if time.monotonic() > deadline:
                    raise TimeoutError
                if not line.startswith(b"data:"):
                    continue
                now = time.perf_counter_ns()
                event = json.loads(line[5:])
                if "error" in event:
                    raise PerfError(f"generate_stream: {event['error']}")
                tally.add(event, now)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.connection.close()
            why = "no answer within --request-timeout" if isinstance(exc, TimeoutError) else exc
            raise PerfError(f"generate_stream failed: {why}") from None
        return tally.done(time.perf_counter_ns())

    def close(self) -> None:
        self.connection.close()


class GrpcStreams:
    """One ModelStreamInfer stream per worker (tritonclient), one request at a time on it."""

    def __init__(self, target: Target) -> None:
        import tritonclient.grpc as grpcclient

        self.client_module = grpcclient
        self.target = target
        options = target.options
        host, port = split_url(options.url, "grpc")
        self.client = grpcclient.InferenceServerClient(f"{host}:{port}")
        self.answers: queue.SimpleQueue[tuple[Any, Any, int]] = queue.SimpleQueue()
        self.client.start_stream(lambda result, error: self.answers.put((result, error, time.perf_counter_ns())))

    def send(self, prompt: Prompt) -> Stream:
        target = self.target
        tensors = []
        for name, (datatype, array) in target.tensors(prompt).items():
            tensor = self.client_module.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        tally = target.tally(prompt, time.perf_counter_ns())
        self.client.async_stream_infer(target.options.model, tensors, model_version=target.options.version,
                                       parameters={"max_tokens": target.max_tokens, "stream": True},
                                       enable_empty_final_response=True)
        while True:
            try:
                result, error, now = self.answers.get(timeout=target.options.request_timeout_s)
            except queue.Empty:
                raise PerfError(f"no response on the gRPC stream in {target.options.request_timeout_s:g} s") from None
            if error is not None:
                raise PerfError(f"ModelStreamInfer: {error.message() if hasattr(error, 'message') else error}")
            response = result.get_response()
            outputs = {tensor.name: result.as_numpy(tensor.name) for tensor in response.outputs}
            tally.add(outputs, now)
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return tally.done(now)

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def drive(target: Target, prompts: list[Prompt], concurrency: int, count: int) -> tuple[list[Stream], float]:
    """`count` requests from `concurrency` workers (closed loop); the streams and the seconds they took."""
    streams: list[Stream] = []
    errors: list[PerfError] = []
    lock = threading.Lock()
    issued = iter(range(count))

    def worker() -> None:
        try:
            sender = HttpStreams(target) if target.options.protocol == "http" else GrpcStreams(target)
        except PerfError as exc:
            errors.append(exc)
            return
        try:
            while not errors:
                with lock:
                    index = next(issued, None)
                if index is None:
                    return
                stream = sender.send(prompts[index % len(prompts)])
                with lock:
                    streams.append(stream)
        except PerfError as exc:
            errors.append(exc)
        finally:
            sender.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return streams, time.perf_counter() - started


@dataclass(frozen=True)
class LlmResult:
    concurrency: int
    metrics: dict[str, list[float]]  # the per-request values of each statistic
    output_token_throughput: float
    request_throughput: float


STATISTICS = ("Time to first token (ms)", "Inter token latency (ms)", "Request latency (ms)",
              "Output sequence length", "Input sequence length")
COLUMNS = ("avg", "min", "max", "p50", "p90", "p99")


def summarize(concurrency: int, streams: list[Stream], seconds: float) -> LlmResult:
    answered = [stream for stream in streams if stream.output_tokens]
    if not answered:
        raise PerfError("no request produced output tokens: check --output-tokens-mean and the model")
    metrics = {
        STATISTICS[0]: [(s.first - s.start) / 1e6 for s in answered],
        STATISTICS[1]: [(s.last - s.first) / 1e6 / (s.output_tokens - 1) for s in answered if s.output_tokens > 1],
        STATISTICS[2]: [(s.end - s.start) / 1e6 for s in answered],
        STATISTICS[3]: [float(s.output_tokens) for s in answered],
        STATISTICS[4]: [float(s.input_tokens) for s in answered],
    }
    tokens = sum(s.output_tokens for s in streams)
    return LlmResult(concurrency, metrics, tokens / seconds, len(streams) / seconds)


def statistics_row(values: list[float]) -> dict[str, float]:
    if not values:
        return {column: math.nan for column in COLUMNS}
    ordered = sorted(values)
    rank = lambda p: ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]
    return {"avg": sum(ordered) / len(ordered), "min": ordered[0], "max": ordered[-1], "p50": rank(50),
            "p90": rank(90), "p99": rank(99)}


def table(result: LlmResult, options: Options) -> str:
    width = max(len(name) for name in STATISTICS) + 2
    lines = [f"LLM Metrics: {options.model} over {options.protocol.upper()}, concurrency {result.concurrency}",
             "Statistic".ljust(width) + "".join(column.rjust(10) for column in COLUMNS)]
    for name in STATISTICS:
        row = statistics_row(result.metrics[name])
        lines.append(name.ljust(width) + "".join(f"{row[column]:10.2f}" for column in COLUMNS))
    lines.append(f"Output token throughput (per sec): {result.output_token_throughput:.2f}")
    lines.append(f"Request throughput (per sec): {result.request_throughput:.2f}")
    return "\n".join(lines)


def write_csv(path: Path, results: list[LlmResult]) -> None:
    try:
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["Concurrency", "Metric", *COLUMNS])
            for result in results:
                for name in STATISTICS:
                    row = statistics_row(result.metrics[name])
                    writer.writerow([result.concurrency, name, *(f"{row[column]:.2f}" for column in COLUMNS)])
            writer.writerow([])
            writer.writerow(["Concurrency", "Output token throughput (per sec)", "Request throughput (per sec)"])
            for result in results:
                writer.writerow([result.concurrency, f"{result.output_token_throughput:.2f}",
                                 f"{result.request_throughput:.2f}"])
    except OSError as exc:
        raise PerfError(f"cannot write {path}: {exc.strerror or exc}") from None


def _counter(path: Path | None) -> Callable[[str], int] | None:
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise PerfError("--tokenizer needs the tokenizers package: pip install 'transerve[generation]'") from None
    try:
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    except Exception as exc:  # the tokenizers library raises its own exception types
        raise PerfError(f"--tokenizer {path}: {exc}") from None
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def run(args: argparse.Namespace, options: Options) -> int:
    if options.mode != "concurrency":
        raise PerfError("--llm measures closed loops: use --concurrency-range")
    if options.batch_size != 1:
        raise PerfError("--llm sends one prompt a request: -b must be 1")
    if options.latency_threshold_ms:
        raise PerfError("--llm measures every level it is given: leave out -l (perf_analyzer's latency limit)")
    if not 1 <= args.output_tokens_mean <= MAX_TOKENS:
        raise PerfError(f"--output-tokens-mean must be between 1 and {MAX_TOKENS}")
    api = connect(options)
    try:
        target = Target(options, api.metadata(), api.config(), args.output_tokens_mean, _counter(args.tokenizer))
    finally:
        api.close()
    prompts = read_prompts(args, target)
    results = []
    for level in options.levels:
        streams, seconds = drive(target, prompts, int(level), options.request_count)
        results.append(summarize(int(level), streams, seconds))
        print(table(results[-1], options), end="\n\n", flush=True)
    if options.csv_file:
        write_csv(options.csv_file, results)
    if options.plot_file:
        rows = [{name: statistics_row(r.metrics[name])["avg"] for name in STATISTICS[:3]} for r in results]
        plot.plot(options.plot_file, "Concurrency", [r.concurrency for r in results],
                  {"output tokens/sec": [r.output_token_throughput for r in results],
                   "time to first token": [row[STATISTICS[0]] for row in rows],
                   "inter-token latency": [row[STATISTICS[1]] for row in rows],
                   "request latency": [row[STATISTICS[2]] for row in rows]},
                  f"{options.model} streaming over {options.protocol.upper()}")
    return 0
