"""docs/tutorials/lightseq.md, run: the page's commands on LightSeq's example repository (files written from
random-weight models by tests/support/lightseq_files.py), its client code against the server the page starts."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
import tomllib
from support.lightseq_files import example_repository, tiny_bart, tiny_bert, tiny_gpt2
from support.servers import REPO_ROOT, start_server

from transerve.config.devices import visible_gpus

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("h5py")
pytest.importorskip("tritonclient.http")

PAGE = REPO_ROOT / "docs" / "tutorials" / "lightseq.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), re.S)


def _command(prefix: str) -> str:
    return next(line for block in _blocks("sh") for line in block.splitlines() if line.startswith(prefix))


def test_the_extras_the_page_installs_exist():
    extras = re.search(r"transerve\[([^\]]+)\]", _command("pip install")).group(1).split(",")
    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras) <= set(declared)


def test_the_tutorial(tmp_path):
    example_repository(tmp_path / "model_repo", {"bart": tiny_bart(), "gpt2": tiny_gpt2(), "bert": tiny_bert()})
    if not visible_gpus():  # the page's edit for a host without a GPU
        subprocess.run(["bash", "-c", _command("sed -i")], cwd=tmp_path, check=True)
    serve = shlex.split(_command("transerve serve"))[1:]

    def argv(http: int, grpc: int, metrics: int) -> list[str]:
        ports = {"--http-port": http, "--grpc-port": grpc}
        args = [str(ports[serve[i - 1]]) if serve[i - 1] in ports else arg for i, arg in enumerate(serve)]
        return [sys.executable, "-m", "transerve", *args, "--metrics-port", str(metrics),
                "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1"]

    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH")])))
    server = start_server("transerve", argv, log_dir=tmp_path, env=env, cwd=tmp_path)
    try:
        (client,) = _blocks("python")
        run = subprocess.run([sys.executable, "-c", client], cwd=tmp_path, capture_output=True, text=True,
                             env=dict(env, HTTP_PORT=str(server.http_port)), timeout=120)
        assert run.returncode == 0, run.stderr + server.log_tail()
    finally:
        server.stop()
    lines = run.stdout.splitlines()
    assert lines.count("target_ids: (2, 1, 14)") == 4  # min(max_step 40, 5 + extra_decode_length 10) - 1
    assert lines.count("target_scores: (2, 1)") == 4
    assert "result: (1, 11)" in lines, run.stdout  # 4 prompt tokens, 7 new ones ending with the end token
    assert "encoder_output: (1, 4, 32)" in lines
