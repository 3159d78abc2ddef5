"""`transerve client` against a real `transerve serve` of a tiny random-weight Marian model converted by
`transerve convert` (seed 001's file translation, redone): a 50-line file equals the line-by-line /generate answers in
order, over infer (HTTP and gRPC, batched) and /generate; a killed run resumes without duplicates; bad lines fail
alone with their numbers; `--max-input-tokens` truncates as the Hugging Face tokenizer does.

docs/tutorials/translate-a-file.md runs as written (`test_the_tutorial_commands`), the seed's client line
`--server --model-name --model-version --input_file --output_file` in it, and `--model-version` asks for that
version over HTTP and gRPC."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
from support import ServerProcess, free_ports, start_transerve
from support.doc_blocks import code_blocks, commands
from support.generation_models import build_generation_model

from transerve.client.files import one_line

pytest.importorskip("ctranslate2")
transformers = pytest.importorskip("transformers")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src"
#: The tutorial's decoding options: short answers keep the tiny model quick.
PARAMS = ("--param", "max_tokens=12")
#: The truncating conversion's limit, and a line longer than the model's 256 positions.
LIMIT = 8
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"]
LONG_LINE = " ".join(WORDS[i % len(WORDS)] + str(i) for i in range(200))


def sentences(count: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + i % 7)) + "." for i in range(count)]


def read(path: Path) -> str:
    return path.read_bytes().decode()


def transerve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "transerve", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.fixture(scope="module")
def hf_marian(tmp_path_factory) -> Path:
    return build_generation_model("marian", tmp_path_factory.mktemp("fileclient_hf") / "marian")


@pytest.fixture(scope="module")
def server(hf_marian, tmp_path_factory) -> Iterator[ServerProcess]:
    """The tutorial's conversion (`marian`), and one whose tokenizer truncates (`marian_cut`)."""
    repo = tmp_path_factory.mktemp("fileclient_repo")
    for extra in ([], ["--name", "marian_cut", "--max-input-tokens", str(LIMIT)]):
        done = transerve("convert", str(hf_marian), "--output", str(repo), *extra)
        assert done.returncode == 0, done.stderr
    with start_transerve(repo) as process:
        yield process


def client(server: ServerProcess, input_file: Path, output_file: Path, *args: str,
           model: str = "marian_text") -> subprocess.CompletedProcess[str]:
    return transerve("client", "-m", model, "-u", server.http_url, "--input-file", str(input_file),
                     "--output-file", str(output_file), *PARAMS, *args)


def generate(server: ServerProcess, text: str, model: str = "marian_text", **options: int) -> str:
    answer = requests.post(f"{server.base_url}/v2/models/{model}/generate",
                           json={"text_input": text, "max_tokens": 12, **options}, timeout=60)
    assert answer.status_code == 200, answer.text
    return one_line(answer.json()["text_output"])  # as the client writes it: a random model's \r and \n are spaces


@pytest.fixture(scope="module")
def fifty(server, tmp_path_factory) -> tuple[Path, list[str]]:
    """A 50-line file (a blank line among them) and the answers /generate gives its lines one by one."""
    lines = sentences(50)
    lines[20] = ""
    path = tmp_path_factory.mktemp("fileclient_in") / "input.txt"
    path.write_text("\n".join(lines) + "\n")
    with ThreadPoolExecutor(4) as pool:
        expected = list(pool.map(lambda text: generate(server, text) if text else "", lines))
    assert len(set(expected)) > 10  # the model answers lines differently: order is checked
    return path, expected


@pytest.mark.parametrize("how", [
    ("--batch-size", "4", "--concurrency", "4"),
    ("--generate", "--concurrency", "8"),
    ("-i", "grpc", "--batch-size", "3"),
], ids=["infer-batched", "generate", "grpc"])
def test_a_file_is_answered_line_for_line_in_input_order(server, fifty, tmp_path, how):
    path, expected = fifty
    args = list(how)
    if "grpc" in args:
        args += ["-u", server.grpc_url]
    output = tmp_path / "output.txt"
    done = transerve("client", "-m", "marian_text", "-u", server.http_url, "--input_file", str(path),
                     "--output_file", str(output), *PARAMS, *args)
    assert done.returncode == 0, done.stderr
    assert read(output).split("\n") == [*expected, ""]
    assert "50 lines answered" in done.stderr


def test_a_killed_run_resumes_after_the_lines_written_without_duplicates(server, tmp_path):
    lines = sentences(300)
    path, output = tmp_path / "input.txt", tmp_path / "output.txt"
    path.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, PYTHONPATH=str(SRC))
    process = subprocess.Popen(
        [sys.executable, "-m", "transerve", "client", "-m", "marian_text", "-u", server.http_url, "--input-file",
         str(path), "--output-file", str(output), "--concurrency", "1", *PARAMS],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (output.exists() and output.read_bytes().count(b"\n") >= 20) and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    written = output.read_bytes().count(b"\n")
    assert 20 <= written < len(lines), "the run ended before it could be killed"
    with output.open("ab") as file:
        file.write(b"half a li")  # as if killed in the middle of a write
    done = client(server, path, output, "--concurrency", "4")
    assert done.returncode == 0, done.stderr
    assert f"resuming at line {written + 1}" in done.stderr
    assert f"{len(lines) - written} lines answered" in done.stderr
    answers = read(output).split("\n")
    assert len(answers) == len(lines) + 1 and answers[-1] == ""
    for number in (0, written - 1, written, len(lines) - 1):  # both sides of the restart, spot-checked
        assert answers[number] == generate(server, lines[number])
    assert client(server, path, output).stderr.count("0 lines answered") == 1  # done: nothing more to do


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_lines_fail_alone_with_their_line_numbers(server, tmp_path, protocol):
    lines = sentences(12)
    path, output, errors = tmp_path / "input.txt", tmp_path / "output.txt", tmp_path / "errors.tsv"
    path.write_bytes(b"\n".join(line.encode() for line in lines[:6]) + b"\n" + LONG_LINE.encode() + b"\n"
                     + b"\n".join(line.encode() for line in lines[7:11]) + b"\nnot \xff UTF-8\n")
    url = server.grpc_url if protocol == "grpc" else server.http_url
    done = client(server, path, output, "--batch-size", "4", "--errors-file", str(errors), "-i", protocol, "-u", url)
    assert done.returncode == 1, done.stderr
    assert ("line 7: INVALID_ARGUMENT: " if protocol == "grpc" else "line 7: HTTP 400: ") in done.stderr
    assert "tokens, more than the 256 this model takes" in done.stderr
    assert "line 12: the line is not UTF-8" in done.stderr
    assert [row.split("\t")[0] for row in errors.read_text().splitlines()] == ["7", "12"]
    answers = read(output).split("\n")
    assert answers[6] == answers[11] == ""
    assert [answers[i] for i in (0, 5, 7, 10)] == [generate(server, lines[i]) for i in (0, 5, 7, 10)]
    assert "2 failed" in done.stderr


def test_one_bad_request_in_a_dynamic_batch_fails_alone(server):
    """Requests sent together share the tokenizer's dynamic batches: a line too long, or not UTF-8, fails alone."""
    good = sentences(8)
    texts = [line.encode() for line in good] + [LONG_LINE.encode(), b"bad \xff"]

    def infer(text: bytes):
        inputs = httpclient.InferInput("text_input", [1, 1], "BYTES")
        inputs.set_data_from_numpy(np.array([[text]], dtype=np.object_))
        try:
            result = httpclient.InferenceServerClient(server.http_url).infer(
                "marian_text", [inputs], parameters={"max_tokens": 12})
        except InferenceServerException as exc:
            return exc
        return result.as_numpy("text_output")[0, 0].decode()

    with ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(infer, texts))
    assert answers[:8] == [generate(server, line) for line in good]
    assert "more than the 256 this model takes" in str(answers[8]) and answers[8].status() == "400"
    assert "text_input is not UTF-8" in str(answers[9]) and answers[9].status() == "400"


def test_max_input_tokens_truncates_as_the_hugging_face_tokenizer_does(server, hf_marian, tmp_path):
    reference = transformers.AutoTokenizer.from_pretrained(hf_marian)
    tokenizer = httpclient.InferenceServerClient(server.http_url)
    for text in (LONG_LINE, "short one", WORDS[0] * 40):
        inputs = httpclient.InferInput("text_input", [1, 1], "BYTES")
        inputs.set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
        result = tokenizer.infer("marian_cut_tokenizer", [inputs])
        ids = result.as_numpy("input_ids")[0, : int(result.as_numpy("sequence_length")[0, 0])].tolist()
        assert ids == reference(text, truncation=True, max_length=LIMIT).input_ids
    path, output = tmp_path / "input.txt", tmp_path / "output.txt"
    path.write_text(f"{LONG_LINE}\nshort one\n")
    done = client(server, path, output, model="marian_cut_text")
    assert done.returncode == 0, done.stderr
    assert read(output).split("\n")[:-1] == [generate(server, LONG_LINE, "marian_cut_text"),
                                                generate(server, "short one", "marian_cut_text")]


def test_convert_refuses_a_limit_beyond_the_models_positions(hf_marian, tmp_path):
    done = transerve("convert", str(hf_marian), "--output", str(tmp_path / "repo"), "--max-input-tokens", "300")
    assert done.returncode == 2
    assert "--max-input-tokens 300 is more than the 256 positions this model has" in done.stderr


@pytest.mark.parametrize(("args", "message"), [
    (("-m", "nope"), "model 'nope': HTTP 404: Request for unknown model"),
    (("-m", "marian_text", "--batch-size", "9"), "--batch-size 9 is more than model 'marian_text' takes"),
    (("-m", "marian_text", "--batch-size", "1000"), "--batch-size must be between 1 and 256"),
    (("-m", "marian_text", "--generate", "--batch-size", "2"), "--generate sends one line per request"),
    (("-m", "marian_text", "--generate", "-i", "grpc"), "an HTTP endpoint: use -i http"),
    (("-m", "marian_text", "--input-name", "x"), "has no input 'x'; its inputs: text_input"),
    (("-m", "nope", "-i", "grpc"), "model 'nope': NOT_FOUND: Request for unknown model"),
])
def test_what_the_client_refuses_stops_it_with_status_2_and_a_clear_line(server, tmp_path, args, message):
    path = tmp_path / "input.txt"
    path.write_text("hello\n")
    url = server.grpc_url if "grpc" in args else server.http_url
    done = transerve("client", "-u", url, "--input-file", str(path), "--output-file", str(tmp_path / "out.txt"),
                     *args)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_a_misspelt_option_stops_the_run_before_writing_empty_lines(server, tmp_path):
    path, output = tmp_path / "input.txt", tmp_path / "output.txt"
    path.write_text("\n".join(sentences(30)) + "\n")
    done = client(server, path, output, "--param", "max_tokenz=3")
    assert done.returncode == 2
    assert "the first 10 lines sent all failed, the last with: line 10: HTTP 400: " in done.stderr
    assert "max_tokenz" in done.stderr and "nothing was written" in done.stderr
    assert read(output) == ""


def test_an_output_that_cannot_be_written_stops_the_client(server, tmp_path):
    path = tmp_path / "input.txt"
    path.write_text("hello\n")
    done = client(server, path, tmp_path / "missing" / "out.txt")
    assert done.returncode == 2 and "No such file or directory" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(("protocol", "message"), [("http", "cannot reach the server at 127.0.0.1:1"),
                                                   ("grpc", "model 'm': UNAVAILABLE")])
def test_a_server_that_is_not_there_stops_the_client(tmp_path, protocol, message):
    path = tmp_path / "input.txt"
    path.write_text("hello\n")
    done = transerve("client", "-m", "m", "-u", "127.0.0.1:1", "-i", protocol, "--input-file", str(path),
                     "--output-file", str(tmp_path / "out.txt"))
    assert done.returncode == 2 and message in done.stderr, done.stderr


TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "translate-a-file.md"
#: The page's setup: the only lines the test does not run (they need the network); it checks them as written and
#: puts a tiny T5 where the download would put t5-small.
SETUP = ["pip install 'transerve[generation]'",
         "hf download google-t5/t5-small config.json generation_config.json model.safetensors tokenizer.json "
         "tokenizer_config.json --local-dir t5-small"]
SERVE = "transerve serve --model-repository=model_repository &"
SEED_CLIENT = ("transerve client --server=localhost:8000 --model-name=transformer --model-version=1 "
               "--input_file=${TRITON_INPUT_FILE} --output_file=${TRITON_OUTPUT_FILE}")


def test_the_tutorial_commands(tmp_path):
    """docs/tutorials/translate-a-file.md, seed 001's steps in order, run as written in one bash, as a user's
    terminal runs them: setup's data, convert, serve in the background, wait until ready, the seed's client line,
    the page's other client lines, head, kill and wait, ls. Only the address changes: the server gets free ports
    (`localhost:8000` becomes them), and `transerve` is this checkout's. The translations are checked against
    /generate of a second server on the same repository."""
    blocks = code_blocks(TUTORIAL, "bash")
    assert commands(blocks[0]) == SETUP
    script = "\n".join(blocks[1:])
    assert script.count(SERVE) == 1 and "localhost:8000" in script
    assert SEED_CLIENT in " ".join(commands(script)), "the seed's client line, as the seed spells it"
    build_generation_model("t5", tmp_path / "t5-small")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "transerve").write_text(f'#!/bin/sh\nexec {sys.executable} -m transerve "$@"\n')
    (bin_dir / "transerve").chmod(0o755)
    http, grpc, metrics = free_ports(3)
    script = script.replace("localhost:8000", f"127.0.0.1:{http}").replace(SERVE, SERVE.replace(" &", (
        f" --http-port={http} --grpc-port={grpc} --metrics-port={metrics} --http-address=127.0.0.1 "
        "--grpc-address=127.0.0.1 --metrics-address=127.0.0.1 &")))
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(SRC))
    shell = subprocess.Popen(["bash", "-e", "-u", "-o", "pipefail", "-c", script], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = shell.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)  # the server too, should the script have stopped before its kill
    assert shell.returncode == 0, stderr  # `wait` on the killed server included: it exited 0
    data = tmp_path / "data"
    output = data / "triton_infer_output.txt"
    assert f"4 lines answered into {output}" in stderr
    assert "resuming at line 5" in stderr and f"0 lines answered into {output}" in stderr
    assert read(output) in stdout  # head -n 20 of a 4-line file: all of it
    assert stdout.rstrip("\n").endswith(f" {output}")  # ls -l
    lines = read(data / "triton_infer_input.txt").split("\n")[:-1]
    assert len(lines) == 4 and lines[2] == ""
    with start_transerve(tmp_path / "model_repository") as server:
        def answers(**options: int) -> str:
            return "".join(f"{generate(server, line, 'transformer', **options) if line else ''}\n" for line in lines)

        assert read(output) == answers(max_tokens=64)  # the generator's max_new_tokens
        assert read(data / "batched.txt") == answers(max_tokens=128)
        assert read(data / "generated.txt") == answers(max_tokens=128, beam_width=4)
    assert read(data / "errors.tsv") == ""


VERSIONED_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.version = args["model_version"]

    def execute(self, requests):
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            answers = [f"version {self.version}: {text.decode()}".encode() for text in texts.reshape(-1)]
            output = pb_utils.Tensor("text_output", np.array(answers, dtype=np.object_).reshape(texts.shape))
            responses.append(pb_utils.InferenceResponse([output]))
        return responses
"""


@pytest.fixture(scope="module")
def versioned(tmp_path_factory) -> Iterator[ServerProcess]:
    """A text model served in versions 1 and 2, each answering with its version."""
    repo = tmp_path_factory.mktemp("fileclient_versions")
    (repo / "translate").mkdir()
    (repo / "translate" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 4\nversion_policy: { all {} }\n'
        'input [{ name: "text_input" data_type: TYPE_STRING dims: [1] }]\n'
        'output [{ name: "text_output" data_type: TYPE_STRING dims: [1] }]\n')
    for version in ("1", "2"):
        (repo / "translate" / version).mkdir()
        (repo / "translate" / version / "model.py").write_text(VERSIONED_MODEL)
    with start_transerve(repo) as process:
        yield process


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("version", ["1", "2", None])
def test_model_version_addresses_that_version(versioned, tmp_path, protocol, version):
    """The seed's `--model-version=N` goes into the request (HTTP's URL, gRPC's model_version): each version
    answers; without it the server picks its latest."""
    path, output = tmp_path / "input.txt", tmp_path / "output.txt"
    path.write_text("hello\nworld\n")
    url = versioned.grpc_url if protocol == "grpc" else versioned.http_url
    flags = [] if version is None else [f"--model-version={version}"]
    done = transerve("client", f"--server={url}", "-i", protocol, "--model-name=translate", *flags,
                     f"--input_file={path}", f"--output_file={output}")
    assert done.returncode == 0, done.stderr
    assert read(output) == f"version {version or 2}: hello\nversion {version or 2}: world\n"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_version_that_is_not_served_stops_the_client_in_one_line(versioned, tmp_path, protocol):
    path = tmp_path / "input.txt"
    path.write_text("hello\n")
    url = versioned.grpc_url if protocol == "grpc" else versioned.http_url
    done = transerve("client", f"--server={url}", "-i", protocol, "--model-name=translate", "--model-version=3",
                     f"--input_file={path}", f"--output_file={tmp_path / 'out.txt'}")
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("transerve client: model 'translate': ") and "3" in done.stderr


def test_ctrl_c_stops_the_client_with_whole_lines_written(server, tmp_path):
    path, output = tmp_path / "input.txt", tmp_path / "output.txt"
    # Far more lines than it answers before the signal can reach it (of 300, all were once answered first, on a
    # busy machine): the signal must find it running.
    path.write_text("\n".join(sentences(5000)) + "\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "transerve", "client", "-m", "marian_text", "-u", server.http_url, "--input-file",
         str(path), "--output-file", str(output), "--concurrency", "1", *PARAMS],
        env=dict(os.environ, PYTHONPATH=str(SRC)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (output.exists() and output.read_bytes().count(b"\n") >= 5) and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stderr == "transerve client: interrupted; rerun the same command to resume\n"
    assert output.read_bytes().endswith(b"\n") and output.read_bytes().count(b"\n") < 5000
