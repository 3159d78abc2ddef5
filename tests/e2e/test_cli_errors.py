"""The commands' ends as a user meets them: Ctrl-C (a real SIGINT sent while the command works) exits 130 with
one line, never a traceback; a converter's or exporter's error is one line naming the folder and the cause; a
model name no client can call plainly is refused before anything is written. `transerve client`'s Ctrl-C is in
test_fileclient.py, beside the server it needs."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support import start_transerve
from support.generation_models import build_generation_model
from support.hf_models import build_tiny_model

pytest.importorskip("transformers")

SRC = Path(__file__).resolve().parents[2] / "src"
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
#: A line of export's and convert's progress: `[2/4] loading the model from X... 1.2 s` (then maybe failed).
PROGRESS = re.compile(r"\[\d/\d\] .*\.\.\. \d+\.\d s( failed| interrupted)?")


def transerve(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "transerve", *args], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=300)


def interrupted(argv: list[str], working: Callable[[str, str], bool], cwd: Path) -> tuple[int, str, str]:
    """Run `transerve ARGV`, send SIGINT once `working(stdout, stderr)` holds, and return (status, stdout,
    stderr). Fails when the command ends before it could be interrupted."""
    process = subprocess.Popen([sys.executable, "-m", "transerve", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=ENV, cwd=cwd)
    seen: dict[str, list[str]] = {"out": [], "err": []}

    def read(stream, into: list[str]) -> None:
        for char in iter(lambda: stream.read(1), ""):
            into.append(char)

    readers = [threading.Thread(target=read, args=(process.stdout, seen["out"]), daemon=True),
               threading.Thread(target=read, args=(process.stderr, seen["err"]), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 120
        while not working("".join(seen["out"]), "".join(seen["err"])):
            assert process.poll() is None, f"it ended before the signal: {''.join(seen['err'])}"
            assert time.monotonic() < deadline, "".join(seen["err"])
            time.sleep(0.01)
        process.send_signal(signal.SIGINT)
        status = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    for reader in readers:
        reader.join(timeout=10)
    return status, "".join(seen["out"]), "".join(seen["err"])


def assert_one_line(stderr: str, last: str) -> None:
    """stderr ends with `last`, and everything before it is progress: the error is that one line."""
    lines = stderr.splitlines()
    assert "Traceback" not in stderr and lines and lines[-1] == last, stderr
    assert all(PROGRESS.fullmatch(line) for line in lines[:-1]), stderr


def test_ctrl_c_of_export_exits_130_with_one_line(tmp_path):
    model = build_tiny_model("seqcls", tmp_path / "tiny")
    status, _, stderr = interrupted(["export", str(model), "--task", "seqcls", "--format", "onnx", "--output",
                                     "repo"], lambda _, err: "[2/4]" in err, tmp_path)
    assert status == 130, stderr
    assert_one_line(stderr, "transerve export: interrupted")
    assert "interrupted" in stderr.splitlines()[-2]  # the step it stopped in says so
    assert not any((tmp_path / "repo").glob("*")), "the models it began are removed"


def test_ctrl_c_of_convert_exits_130_with_one_line(tmp_path):
    pytest.importorskip("ctranslate2")
    model = build_generation_model("marian", tmp_path / "marian")
    status, _, stderr = interrupted(["convert", str(model), "--output", "repo"], lambda _, err: "[1/4]" in err,
                                    tmp_path)
    assert status == 130, stderr
    assert_one_line(stderr, "transerve convert: interrupted")
    assert not (tmp_path / "repo").exists()


def test_ctrl_c_of_perf_exits_130_with_one_line(tmp_path):
    with start_transerve() as server:
        status, stdout, stderr = interrupted(
            ["perf", "-m", "add_sub", "-u", server.http_url, "-p", "5000", "--concurrency-range", "1:4"],
            lambda out, _: out.strip() != "", tmp_path)
        assert server.alive()
    assert status == 130, stderr
    assert stderr.strip() == "transerve perf: interrupted", stderr


@pytest.mark.parametrize("delay", [0.15, 0.3, 0.6, 1.0])
def test_ctrl_c_while_the_command_is_loading_or_waiting_is_one_line(tmp_path, delay):
    """A SIGINT that comes while Python imports transerve's modules (about half a second; `python -m transerve` and
    the console script import them inside `__main__.main`, Ctrl-C held), or later, while the client waits on a
    server that never answers: status 130 and one line either way."""
    (tmp_path / "in.txt").write_text("hello\n")
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        process = subprocess.Popen([sys.executable, "-m", "transerve", "client", "-m", "m", "-u",
                                    f"127.0.0.1:{silent.getsockname()[1]}", "--input-file", "in.txt",
                                    "--output-file", "out.txt"], cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stderr in ("transerve: interrupted\n", "transerve client: interrupted; rerun the same command to resume\n")


def test_ctrl_c_of_serve_shuts_it_down_cleanly(tmp_path):
    """serve takes Ctrl-C as its signal to drain and stop (as tritonserver does): status 0, as README says, and its
    log, no traceback."""
    with start_transerve() as server:
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=60) == 0
    assert "Traceback" not in server.log and "stopped" in server.log


def test_a_ctranslate2_error_is_one_line_naming_the_folder_and_the_cause(tmp_path):
    """The seed's case: a vocabulary that does not match the embedding table, which CTranslate2 refuses."""
    pytest.importorskip("ctranslate2")
    model = build_generation_model("marian", tmp_path / "marian", config={"vocab_size": 401})
    done = transerve("convert", str(model), "--output", str(tmp_path / "repo"))
    assert done.returncode == 2
    assert_one_line(done.stderr, f"transerve convert: {model}: converting to CTranslate2 (float32) failed: Source "
                                 "vocabulary 0 has size 399 but the model expected a vocabulary of size 400")
    assert not (tmp_path / "repo").exists()


def test_weights_that_cannot_be_read_are_one_line_naming_the_folder(tmp_path):
    model = build_tiny_model("seqcls", tmp_path / "tiny")
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    done = transerve("export", str(model), "--task", "seqcls", "--format", "onnx", "--output", str(tmp_path / "r"))
    assert done.returncode == 2
    last = done.stderr.splitlines()[-1]
    assert last.startswith(f"transerve export: loading the model from {model} failed: "), done.stderr
    assert_one_line(done.stderr, last)


def test_an_output_that_cannot_be_written_is_one_line_naming_it(tmp_path):
    pytest.importorskip("ctranslate2")
    model = build_generation_model("marian", tmp_path / "marian")
    (tmp_path / "repo").write_text("a file where the repository should go")
    done = transerve("convert", str(model), "--output", str(tmp_path / "repo"))
    assert done.returncode == 2
    assert_one_line(done.stderr, f"transerve convert: [Errno 17] File exists: '{tmp_path / 'repo'}'")


@pytest.mark.parametrize(("command", "flags"), [
    ("convert", ["--name", "bad name"]),
    ("convert", ["--name", "en_de", "--text-name", "../up"]),
    ("export", ["--name", "bad name", "--task", "seqcls", "--format", "onnx"]),
])
def test_a_name_no_client_can_call_is_refused_before_anything_is_written(tmp_path, command, flags):
    folder = tmp_path / "model"  # never read: the name is refused first
    done = transerve(command, str(folder), "--output", "repo", *flags, cwd=tmp_path)
    assert done.returncode == 2
    value = flags[flags.index("--text-name" if "--text-name" in flags else "--name") + 1]
    assert done.stderr.startswith(f"transerve {command}: ")
    assert f"{value!r} is not a model name" in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_text_name_taken_by_another_model_of_the_conversion_is_refused(tmp_path):
    pytest.importorskip("ctranslate2")
    model = build_generation_model("marian", tmp_path / "marian")
    done = transerve("convert", str(model), "--output", str(tmp_path / "repo"), "--name", "x", "--text-name",
                     "x_tokenizer")
    assert done.returncode == 2 and not (tmp_path / "repo").exists()
    assert "--text-name 'x_tokenizer' is the name of another model of the conversion" in done.stderr
