"""The README's first commands as a newcomer runs them: the install-and-serve line and the test line on top, then
"Try it"'s curl calls and Python example against the served example repository. The Python example must work
after the README's own install (`pip install -e .`): it imports only what the core dependencies bring."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

from support import REPO_ROOT, start_transerve
from support.doc_blocks import code_blocks, commands

README = REPO_ROOT / "README.md"


def test_the_two_top_commands_are_install_and_serve_then_the_tests():
    assert commands(code_blocks(README, "bash")[0]) == [
        "pip install -e . && transerve serve --model-repository examples/model_repository",
        "pip install -e '.[test]' && pytest",
    ]


def test_the_python_example_needs_only_the_core_dependencies():
    (example,) = code_blocks(README, "python")[:1]
    imported = {alias.name for node in ast.walk(ast.parse(example)) if isinstance(node, ast.Import)
                for alias in node.names}
    assert imported == {"numpy", "tritonclient.grpc"}
    block = re.search(r"^dependencies = \[(.*?)^\]", (REPO_ROOT / "pyproject.toml").read_text(), re.M | re.S)
    core = {re.split(r"[<>=;]", requirement)[0].strip() for requirement in re.findall(r'"([^"]+)"', block[1])}
    assert {"numpy", "tritonclient[grpc]"} <= core


def test_try_it_runs_against_the_served_examples():
    curl, example = code_blocks(README, "bash")[1], code_blocks(README, "python")[0]
    with start_transerve(REPO_ROOT / "examples" / "model_repository") as server:
        shell = curl.replace("localhost:8000", server.http_url)
        answers = subprocess.run(["bash", "-e", "-c", shell], capture_output=True, text=True, timeout=60, check=True)
        metadata, end = json.JSONDecoder().raw_decode(answers.stdout)
        inferred = json.loads(answers.stdout[end:])
        assert metadata["name"] == "add_sub"
        assert {o["name"]: o["data"] for o in inferred["outputs"]}["OUTPUT0"] == [2, 3, 4, 5]
        # The HTTP client's extras are not there after `pip install -e .`: the example must not need them.
        blocked = "import sys\nfor m in ('tritonclient.http', 'gevent', 'geventhttpclient', 'aiohttp'): " \
                  "sys.modules[m] = None\n"
        script = blocked + example.replace("localhost:8001", server.grpc_url)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                                env=dict(os.environ), check=True)
    assert result.stdout.split() == ["[[2.", "2.", "2.", "2.]]"]
