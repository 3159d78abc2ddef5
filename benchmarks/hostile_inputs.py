"""Hostile inputs against a real transerve (issue 35, second round): what each costs the server, and a bystander.

    python -m benchmarks.hostile_inputs
    python -m benchmarks.hostile_inputs --probes shm_truncate,deep_ensemble --against b33e595

Each probe runs against a server of its own (explicit model control, add_sub loaded, a scratch repository with the
models the probes load), started fresh so that one probe that kills or bloats the server cannot colour the next.
Meanwhile a bystander process calls add_sub over one keep-alive HTTP connection every 20 ms. A row says what the
server answered the probe, the bystander's p99 latency and errors while it ran, the growth of the server's resident
memory (its peak during the probe, and 2 s after), its open file descriptors before, at their peak and after, whether
it still serves, and the issue's bounds (bystander p99 < 100 ms, 0 bystander errors, RSS growth < 200 MB, server
alive), met or not; the exit status is 1 when one is not. `--against COMMIT` runs the same probes on that commit's
`src` (the "before" of a fix).

A probe is a function taking the `Target` (the server, the scratch folder, the arguments) and returning an
`Outcome`; `PROBES` lists them in the order they run, and a new one is a function and a line there.
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import requests

from benchmarks.common.results import add_json_option, commit, write_json
from benchmarks.http_hostile import RssSampler, _bystander_main, p99_ms

TIMEOUT_S = 120.0
#: The issue's bounds, for every probe.
P99_BOUND_MS = 100.0
RSS_BOUND_MB = 200.0
MIN_WINDOW_S = 1.0


@dataclass
class Target:
    """What a probe works against."""

    base_url: str
    http_port: int
    pid: int
    scratch: Path
    args: argparse.Namespace


@dataclass
class Outcome:
    """What the server answered (a short phrase: statuses and counts) and any numbers worth keeping."""

    answer: str
    measures: dict[str, float] = field(default_factory=dict)


@dataclass
class Probe:
    name: str
    what: str
    run: Callable[[Target], Outcome]
    #: Models loaded with the server besides add_sub (the OpenAI probes' generator and embedding model).
    models: tuple[str, ...] = ()


@dataclass
class Row:
    probe: str
    what: str
    answer: str = ""
    rss_peak_mb: float = 0.0
    rss_after_mb: float = 0.0
    #: When the probe ran (monotonic), which the sampler sets with the RSS figures.
    window: tuple[float, float] = (0.0, 0.0)
    fds: tuple[int, int, int] = (0, 0, 0)
    p99_ms: float = float("nan")
    errors: int = 0
    calls: int = 0
    alive: bool = False
    measures: dict[str, float] = field(default_factory=dict)
    bounds: str = ""


# ------------------------------------------------------------------------------------------------ helpers


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def statuses(answers: list[int]) -> str:
    """'3 x 400, 1 x 200' for a list of statuses, most frequent first."""
    counts: dict[int, int] = {}
    for status in answers:
        counts[status] = counts.get(status, 0) + 1
    return ", ".join(f"{count} x {status}" for status, count in sorted(counts.items(), key=lambda item: -item[1]))


def post(target: Target, path: str, body: object = None, session: requests.Session | None = None) -> int:
    """The status of a POST (599: no answer, the server is gone or the connection was cut)."""
    try:
        return (session or requests).post(f"{target.base_url}{path}", json=body, timeout=TIMEOUT_S).status_code
    except requests.RequestException:
        return 599


def described(status: int, started: float) -> str:
    return f"{status} after {time.monotonic() - started:.2f} s" if status != 599 else "no answer (connection cut)"


def add_sub_body(input0: dict | None = None) -> dict:
    first = input0 or {"data": [1, 2, 3, 4]}
    return {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", **first},
                       {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]}]}


def pipelined(port: int, requests_: list[bytes], batch: int = 50) -> list[int]:
    """Send the requests over one connection, `batch` at a time without waiting, and read each batch's answers
    (each with Content-Length): a client that makes many requests quickly, at the cost of one socket."""
    found: list[int] = []
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        for start in range(0, len(requests_), batch):
            chunk = requests_[start:start + batch]
            sock.sendall(b"".join(chunk))
            buffer = b""
            answered = 0
            while answered < len(chunk):
                data = sock.recv(1 << 20)
                if not data:
                    return found + [599] * (len(requests_) - len(found))
                buffer += data
                while True:
                    head_end = buffer.find(b"\r\n\r\n")
                    if head_end < 0:
                        break
                    head = buffer[:head_end].decode("latin-1")
                    length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                                   if line.lower().startswith("content-length:")), 0)
                    if len(buffer) < head_end + 4 + length:
                        break
                    found.append(int(head.split(" ", 2)[1]))
                    buffer = buffer[head_end + 4 + length:]
                    answered += 1
    return found


def http_request(method: str, path: str, body: bytes = b"") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
            "Content-Type: application/json\r\n\r\n").encode() + body


# ------------------------------------------------------------------------------------------------ probes


def probe_shm_truncate(target: Target) -> Outcome:
    """Register a region, truncate its object to 0 bytes, and infer from it (and into it)."""
    key = f"/transerve_hostile_{uuid.uuid4().hex[:12]}"
    path = Path("/dev/shm") / key.lstrip("/")
    path.write_bytes(b"\0" * 64)
    try:
        registered = post(target, "/v2/systemsharedmemory/region/victim/register",
                          {"key": key, "offset": 0, "byte_size": 64})
        with open(path, "r+b") as file:
            os.ftruncate(file.fileno(), 0)
        place = {"parameters": {"shared_memory_region": "victim", "shared_memory_byte_size": 16}}
        started = time.monotonic()
        read = post(target, "/v2/models/add_sub/infer", add_sub_body(place))
        written = post(target, "/v2/models/add_sub/infer",
                       {**add_sub_body(), "outputs": [{"name": "OUTPUT0", **place}]})
        answer = (f"register {registered}; infer from it {described(read, started)}; into it "
                  f"{described(written, started)}")
        post(target, "/v2/systemsharedmemory/unregister")
        return Outcome(answer)
    finally:
        path.unlink(missing_ok=True)


def probe_shm_registrations(target: Target) -> Outcome:
    """Register many regions of one object, then unregister them: what the registry holds (descriptors)."""
    key = f"/transerve_hostile_{uuid.uuid4().hex[:12]}"
    path = Path("/dev/shm") / key.lstrip("/")
    path.write_bytes(b"\0" * 4096)
    try:
        count = target.args.shm_registrations
        body = json.dumps({"key": key, "offset": 0, "byte_size": 64}).encode()
        answers = pipelined(target.http_port, [http_request("POST", f"/v2/systemsharedmemory/region/r{index}/register",
                                                            body) for index in range(count)])
        peak = open_fds(target.pid)
        unregistered = post(target, "/v2/systemsharedmemory/unregister")
        return Outcome(f"{count:,} registrations: {statuses(answers)}; unregister {unregistered}",
                       {"fds_registered": peak})
    finally:
        path.unlink(missing_ok=True)


CONFIG = json.dumps({"name": "uploaded", "backend": "python", "max_batch_size": 0,
                     "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [1]}],
                     "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [1]}]})
ONE_BYTE = base64.b64encode(b"x").decode()


def _load(target: Target, name: str, parameters: dict | None = None) -> str:
    started = time.monotonic()
    return described(post(target, f"/v2/repository/models/{name}/load",
                          {"parameters": parameters} if parameters is not None else {}), started)


def probe_load_many_files(target: Target) -> Outcome:
    files = {f"file:1/f{index}": ONE_BYTE for index in range(target.args.load_files)}
    return Outcome(_load(target, "uploaded", {"config": CONFIG, **files}))


def probe_load_big_config(target: Target) -> Outcome:
    """A reload of add_sub whose config override lists three million dims (6 MB of JSON)."""
    config = json.dumps({"name": "add_sub", "backend": "python", "max_batch_size": 8,
                         "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [1] * 3_000_000}]})
    return Outcome(_load(target, "add_sub", {"config": config}))


def probe_load_nul_path(target: Target) -> Outcome:
    return Outcome(_load(target, "uploaded", {"config": CONFIG, "file:1/model\u0000.py": ONE_BYTE}))


def probe_long_model_name(target: Target) -> Outcome:
    return Outcome(_load(target, "m" * 300, {"config": CONFIG, "file:1/model.py": ONE_BYTE}))


def probe_huge_pbtxt(target: Target) -> Outcome:
    return Outcome(_load(target, "huge_config"))


def probe_pbtxt_at_bound(target: Target) -> Outcome:
    return Outcome(_load(target, "bound_config"))


def probe_deep_ensemble(target: Target) -> Outcome:
    return Outcome(_load(target, "deep0"))


def probe_unknown_names(target: Target) -> Outcome:
    """Unloads and statistics of distinct model names that do not exist."""
    count = target.args.unknown_names
    batch = [http_request("POST", f"/v2/repository/models/unknown_{uuid.uuid4().hex}_{index}/unload")
             if index % 5 else http_request("GET", f"/v2/models/unknown_{uuid.uuid4().hex}_{index}/stats")
             for index in range(count)]
    answers = pipelined(target.http_port, batch)
    return Outcome(f"{count:,} unloads and stats of unknown names: {statuses(answers)}")


# Python-backend workers that misbehave (issue 35, part 4): their models are written by `write_worker_models`.

_ECHO = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.ones(int(pb_utils.get_input_tensor_by_name(
            r, "X").as_numpy()[0]), np.uint8))]) for r in requests]
"""
WORKER_MODELS = {
    "flood": _ECHO.replace("class TritonPythonModel:", '''import sys, threading

def flood():
    while True:
        sys.stdout.write(("flood " + "x" * 200 + "\\n") * 50)

class TritonPythonModel:
    def initialize(self, args):
        threading.Thread(target=flood, daemon=True).start()
'''),
    "exiting": _ECHO.replace("class TritonPythonModel:", '''import os, threading

class TritonPythonModel:
    def initialize(self, args):
        threading.Timer(0.3, os._exit, (3,)).start()
'''),
    "big": _ECHO,
}


def write_worker_models(repo: Path) -> None:
    for name, code in WORKER_MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(code)
        (repo / name / "config.pbtxt").write_text(
            f'name: "{name}" backend: "python" input [{{name: "X" data_type: TYPE_INT32 dims: [1]}}] '
            'output [{name: "Y" data_type: TYPE_UINT8 dims: [-1]}]')


def log_bytes(target: Target) -> int:
    """The size of the file the server logs to (its stderr)."""
    try:
        return os.stat(f"/proc/{target.pid}/fd/2").st_size
    except OSError:
        return 0


def probe_stdout_flood(target: Target) -> Outcome:
    """A model printing as fast as it can from `initialize` on, for 3 s."""
    before = log_bytes(target)
    loaded = _load(target, "flood")
    time.sleep(3.0)
    grown = (log_bytes(target) - before) / 1e6
    return Outcome(f"load {loaded}; the log grew {grown:.2f} MB in 3 s", {"log_growth_mb": grown})


def probe_huge_response(target: Target) -> Outcome:
    """A python model answering 2 GiB (under the default --max-response-bytes of 1 GiB)."""
    loaded = _load(target, "big")
    started = time.monotonic()
    body = {"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [(2 << 30) - 1]}]}
    return Outcome(f"load {loaded}; infer of 2 GiB {described(post(target, '/v2/models/big/infer', body), started)}")


def probe_restart_loop(target: Target) -> Outcome:
    """A worker that exits 0.3 s after each start: how long until the model is given up, and its state."""
    loaded = _load(target, "exiting")
    started = time.monotonic()
    while time.monotonic() - started < 60:
        if requests.get(f"{target.base_url}/v2/models/exiting/ready", timeout=TIMEOUT_S).status_code != 200:
            break
        time.sleep(0.1)
    index = requests.post(f"{target.base_url}/v2/repository/index", json={}, timeout=TIMEOUT_S).json()
    state = next((entry.get("state") for entry in index if entry["name"] == "exiting"), "?")
    return Outcome(f"load {loaded}; not ready {time.monotonic() - started:.1f} s later, index state {state}")


# The OpenAI layer and the generation engine (issue 35, parts 2 and 3): a tiny random-weight GPT-2 converted to a
# torch generator ("gpt") and the real all-MiniLM-L6-v2 exported as an embedding ensemble ("minilm").

GPT, MINILM = "gpt", "minilm"


def probe_openai_huge_prompt(target: Target) -> Outcome:
    """A 4 MB text prompt to /v1/completions."""
    started = time.monotonic()
    status = post(target, "/v1/completions", {"model": GPT, "prompt": "hello world " * 350_000, "max_tokens": 1})
    return Outcome(described(status, started))


def probe_openai_token_prompt(target: Target) -> Outcome:
    """A prompt of a million token ids."""
    started = time.monotonic()
    return Outcome(described(post(target, "/v1/completions", {"model": GPT, "prompt": [5] * 1_000_000,
                                                              "max_tokens": 1}), started))


def probe_chat_many_messages(target: Target) -> Outcome:
    """10,000 chat messages, then 4,000 (under the message bound: rendered)."""
    answers = []
    started = time.monotonic()
    for count in (10_000, 4_000):
        messages = [{"role": "user", "content": f"hi {index}"} for index in range(count)]
        status = post(target, "/v1/chat/completions", {"model": GPT, "messages": messages, "max_tokens": 1})
        answers.append(f"{count:,}: {described(status, started)}")
    return Outcome("; ".join(answers))


def probe_chat_template_kwargs(target: Target) -> Outcome:
    """`chat_template_kwargs` naming the variables the server passes the template itself."""
    answers = [post(target, "/v1/chat/completions", {"model": GPT, "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 1, "chat_template_kwargs": {name: value}})
               for name, value in (("messages", []), ("add_generation_prompt", 3), ("bos_token", "x"),
                                   ("eos_token", "y"))]
    return Outcome(statuses(answers))


def probe_embeddings_big_input(target: Target) -> Outcome:
    """A 2.7 MB embeddings input."""
    started = time.monotonic()
    return Outcome(described(post(target, "/v1/embeddings", {"model": MINILM, "input": "word " * 540_000}), started))


def probe_generate_big_body(target: Target) -> Outcome:
    """An 11 MB /v2 generate body (a long list of ids)."""
    body = {"input_ids": [5] * 2_500_000, "sequence_length": 2_500_000, "max_tokens": 1}
    started = time.monotonic()
    return Outcome(described(post(target, f"/v2/models/{GPT}/generate", body), started))


def probe_bad_words_flood(target: Target) -> Outcome:
    """500,000 two-token bad words (4 MB), and one outside the vocabulary, beside a greedy stream."""
    stream = {"input_ids": [5, 6, 7], "sequence_length": 3, "max_tokens": 200, "min_length": 200, "stream": True}
    with requests.post(f"{target.base_url}/v2/models/{GPT}/generate_stream", json=stream, stream=True,
                       timeout=TIMEOUT_S) as running:
        answers = [post(target, f"/v2/models/{GPT}/generate",
                        {"input_ids": [5, 6, 7], "sequence_length": 3, "max_tokens": 4, "bad_words": words})
                   for words in (json.dumps([[7, 9]] * 500_000), "[[99999999]]")]
        events = [line for line in running.iter_lines() if line.startswith(b"data: ")]
    failed = sum(b'"error"' in event for event in events)
    return Outcome(f"{statuses(answers)}; the stream beside them: {len(events)} events, {failed} failed",
                   {"stream_failures": failed})


def probe_abandoned_n128(target: Target) -> Outcome:
    """A streamed `n: 128` completion whose client reads nothing and leaves after 1 s; then an 8-token one."""
    body = json.dumps({"model": GPT, "prompt": "hello", "n": 128, "max_tokens": 200, "min_tokens": 200,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", target.http_port), timeout=TIMEOUT_S) as sock:
        sock.sendall(http_request("POST", "/v1/completions", body))
        time.sleep(1.0)
    started = time.monotonic()
    status = post(target, "/v1/completions", {"model": GPT, "prompt": "hello", "max_tokens": 8})
    waited = time.monotonic() - started
    return Outcome(f"the 8-token completion after it: {described(status, started)}", {"after_s": waited})


def write_openai_models(repo: Path, root: Path) -> None:
    """`gpt` (torch, decoupled) and `minilm` into `repo`, built under `root`."""
    from tests.support.generation_models import build_generation_model
    from tests.support.hf_models import minilm_path
    from tests.support.openai_models import CHAT_TEMPLATE
    from transerve.convert.command import convert
    from transerve.export.command import export

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = build_generation_model("gpt2", root / "gpt2", config={"n_positions": 1024})
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    convert(folder, repo, engine="torch", name=GPT, max_batch_size=8, decoupled=True)
    export(minilm_path(), "embedding", "onnx", repo, MINILM, max_batch_size=8, dynamic_batching=True)


PROBES: list[Probe] = [
    Probe("shm_truncate", "a registered shared memory object truncated to 0 bytes, then inferred from",
          probe_shm_truncate),
    Probe("shm_registrations", "many registrations of one shared memory object (--shm-registrations)",
          probe_shm_registrations),
    Probe("load_many_files", "a load request with 50,000 'file:' entries (--load-files)", probe_load_many_files),
    Probe("load_big_config", "a reload with a 6 MB config override (3 million dims)", probe_load_big_config),
    Probe("load_nul_path", "a 'file:' path holding a NUL byte", probe_load_nul_path),
    Probe("long_model_name", "a load of a 300-character model name", probe_long_model_name),
    Probe("huge_pbtxt", "a config.pbtxt of a million dims (3 MB)", probe_huge_pbtxt),
    Probe("pbtxt_at_bound", "a config.pbtxt just under --model-config-max-bytes (340,000 dims), parsed",
          probe_pbtxt_at_bound),
    Probe("deep_ensemble", "an ensemble chain 1000 deep, loaded by its head", probe_deep_ensemble),
    Probe("unknown_names", "100,000 unloads and stats of distinct unknown names (--unknown-names)",
          probe_unknown_names),
    Probe("stdout_flood", "a python model writing to stdout in a loop", probe_stdout_flood),
    Probe("huge_response", "a python model answering 2 GiB", probe_huge_response),
    Probe("restart_loop", "a python worker exiting 0.3 s after each start", probe_restart_loop),
    Probe("openai_huge_prompt", "a 4 MB text prompt to /v1/completions", probe_openai_huge_prompt, (GPT,)),
    Probe("openai_token_prompt", "a prompt of a million token ids", probe_openai_token_prompt, (GPT,)),
    Probe("chat_many_messages", "10,000 chat messages, then 4,000", probe_chat_many_messages, (GPT,)),
    Probe("chat_template_kwargs", "chat_template_kwargs naming messages, add_generation_prompt, bos/eos_token",
          probe_chat_template_kwargs, (GPT,)),
    Probe("embeddings_big_input", "a 2.7 MB /v1/embeddings input", probe_embeddings_big_input, (MINILM,)),
    Probe("generate_big_body", "an 11 MB /v2 generate body", probe_generate_big_body, (GPT,)),
    Probe("bad_words_flood", "500,000 bad words and one outside the vocabulary, beside a 200-token stream",
          probe_bad_words_flood, (GPT,)),
    Probe("abandoned_n128", "an n=128 stream its client never reads and leaves, then an 8-token completion",
          probe_abandoned_n128, (GPT,)),
]


# ------------------------------------------------------------------------------------------------ the repository




def make_repository(root: Path, openai_models: bool) -> Path:
    """add_sub, an ensemble chain deep0 -> ... -> deep999 -> add_sub, huge_config (a million dims),
    bound_config (just under the config bound), the misbehaving workers, and the OpenAI probes' models when
    `openai_models`."""
    from benchmarks.common.servers import EXAMPLE_REPOSITORY
    from tests.support.repositories import add_sub_ensemble

    repo = root / "models"
    repo.mkdir()
    (repo / "add_sub" / "1").mkdir(parents=True)
    (repo / "add_sub" / "config.pbtxt").write_bytes((EXAMPLE_REPOSITORY / "add_sub" / "config.pbtxt").read_bytes())
    (repo / "add_sub" / "1" / "model.py").write_bytes((EXAMPLE_REPOSITORY / "add_sub" / "1" / "model.py").read_bytes())
    for index in range(1000):
        folder = repo / f"deep{index}"
        (folder / "1").mkdir(parents=True)
        step = f"deep{index + 1}" if index < 999 else "add_sub"
        (folder / "config.pbtxt").write_text(add_sub_ensemble(folder.name, step))
    for name, count in (("huge_config", 1_000_000), ("bound_config", 340_000)):
        folder = repo / name
        (folder / "1").mkdir(parents=True)
        dims = ", ".join(["1"] * count)
        (folder / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\ninput [{{ name: "X" data_type: '
                                             f'TYPE_FP32 dims: [ {dims} ] }}]\n')
    write_worker_models(repo)
    if openai_models:
        write_openai_models(repo, root)
    return repo


# ------------------------------------------------------------------------------------------------ running


def judge(row: Row) -> str:
    checks = [(f"bystander p99 < {P99_BOUND_MS:g} ms", row.p99_ms < P99_BOUND_MS),
              ("0 bystander errors", row.errors == 0 and row.calls > 0),
              (f"RSS growth < {RSS_BOUND_MB:g} MB", max(row.rss_peak_mb, row.rss_after_mb) < RSS_BOUND_MB),
              ("server alive", row.alive)]
    return "; ".join(f"{name}: {'met' if ok else 'NOT MET'}" for name, ok in checks)


def run_probe(probe: Probe, repo: Path, scratch: Path, args: argparse.Namespace, source: Path | None) -> Row:
    from benchmarks.common.servers import start_transerve

    row = Row(probe.name, probe.what)
    context = multiprocessing.get_context("spawn")
    extra = {"source": source} if source is not None else {}
    loads = [f"--load-model={name}" for name in ("add_sub", *probe.models)]
    with start_transerve(repo, "--model-control-mode=explicit", *loads, **extra) as server:
        pid = server.process.pid
        target = Target(server.base_url, server.http_port, pid, scratch, args)
        stop, out = context.Event(), context.Queue()
        bystander = context.Process(target=_bystander_main, args=("http", server.http_port, stop, out))
        bystander.start()
        time.sleep(2.0)
        sampler = RssSampler(pid)
        before = open_fds(pid)
        peak_fds = before
        try:
            with sampler.probe(row):
                started = time.monotonic()
                try:
                    outcome = probe.run(target)
                except Exception as exc:  # noqa: BLE001 - a probe the server broke is a result, not a crash
                    outcome = Outcome(f"probe failed: {type(exc).__name__}: {exc}"[:200])
                # The bystander's window is at least MIN_WINDOW_S: a probe answered at once still gets its calls.
                time.sleep(max(0.0, MIN_WINDOW_S - (time.monotonic() - started)))
                peak_fds = max(peak_fds, open_fds(pid), int(outcome.measures.get("fds_registered", 0)))
        finally:
            sampler.stop()
            stop.set()
            records = out.get(timeout=60)[1]
            bystander.join(timeout=30)
        row.alive = server.alive()
        after = open_fds(pid) if row.alive else 0
        start, end = row.window
        window = [(latency, ok) for began, latency, ok in records if start <= began <= end]
        row.answer, row.measures = outcome.answer, outcome.measures
        row.fds = (before, peak_fds, after)
        row.p99_ms = p99_ms([latency for latency, ok in window if ok]) if window else float("nan")
        row.errors = sum(1 for _, ok in window if not ok)
        row.calls = len(window)
    row.bounds = judge(row)
    return row


def main() -> int:
    names = [probe.name for probe in PROBES]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", default=",".join(names), help="comma-separated, from: " + ", ".join(names))
    parser.add_argument("--against", metavar="COMMIT", help="run the probes on this commit's src instead")
    parser.add_argument("--shm-registrations", type=int, default=5_000)
    parser.add_argument("--load-files", type=int, default=50_000)
    parser.add_argument("--unknown-names", type=int, default=100_000)
    add_json_option(parser)
    args = parser.parse_args()
    chosen = [name.strip() for name in args.probes.split(",") if name.strip()]
    unknown = set(chosen) - set(names)
    if unknown:
        parser.error(f"unknown probes: {', '.join(sorted(unknown))}")
    from benchmarks.common.servers import transerve_source_at

    rows = []
    with tempfile.TemporaryDirectory(prefix="transerve-hostile-") as tmp:
        scratch = Path(tmp)
        repo = make_repository(scratch, any(probe.models for probe in PROBES if probe.name in chosen))
        source = transerve_source_at(args.against, scratch / "source") if args.against else None
        for probe in PROBES:
            if probe.name in chosen:
                print(f"probe {probe.name}", file=sys.stderr)
                rows.append(run_probe(probe, repo, scratch, args, source))
    setting = (f"{'commit ' + args.against if args.against else 'commit ' + commit()}, {time.strftime('%Y-%m-%d')}, "
               f"{os.cpu_count()} CPUs")
    print(setting)
    print("| probe | server's answer | bystander p99 ms (errors / calls) | server RSS growth, peak / after (MB) | "
          "server fds before / peak / after | server alive | issue's bounds |")
    print("|---|---|---:|---:|---|---|---|")
    for row in rows:
        print(f"| {row.probe} | {row.answer} | {row.p99_ms:.1f} ({row.errors} / {row.calls}) | "
              f"{row.rss_peak_mb:+.1f} / {row.rss_after_mb:+.1f} | {row.fds[0]} / {row.fds[1]} / {row.fds[2]} | "
              f"{'yes' if row.alive else 'NO'} | {row.bounds} |")
    if args.json:
        write_json(args.json, "hostile_inputs", {"setting": setting, "rows": [vars(row) for row in rows]}, args)
    return 0 if all("NOT MET" not in row.bounds for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
