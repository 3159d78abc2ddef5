"""docs/tutorials/fastertransformer-t5.md, run as the page shows it, with the seed tutorial's own client.

The page's shell blocks run in order in one bash, in a temporary workspace, with a random-weight T5 and a T5
tokenizer standing in for `t5-base`. Commands that need the network are replaced, each named here: `pip install`
(the suite's environment has the packages), the two `git clone`s of NVIDIA's repositories (the page's next block
copies the config from examples/fastertransformer/), `git lfs install` and the `t5-base` clone (the stand-in is
copied in); the converter command, which needs FasterTransformer's checkout, is carried out with its own arguments
by tests/support/ft_checkpoints.py's `t5_ckpt_convert`, a step-by-step redo of dev/v5.0_beta's script. The page's
`model_checkpoint_path` stanza is appended to the config with the workspace's path. The server runs on free ports;
the client is seed 000's `client.py`, taken from the seed text (`../shared/seeds/000_*.txt`) unchanged but for its
address (and, over gRPC, the client module: tritonclient's gRPC client takes no `concurrency`, so that argument goes
too), fed its prompt on stdin. Its tokens must be transformers' greedy `generate` on the same weights.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO_ROOT, start_transerve
from support.doc_blocks import code_blocks, commands
from support.seed_t5 import build_seed_t5

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("tritonclient.grpc")

PAGE = REPO_ROOT / "docs" / "tutorials" / "fastertransformer-t5.md"
SEEDS = REPO_ROOT.parent / "shared" / "seeds"
PROMPT = "Translate EnglishTo German: I want to rest a bit!"
CONVERTER = re.compile(r"^python \./FasterTransformer/examples/pytorch/t5/utils/t5_ckpt_convert\.py +-o (\S+) -i (\S+) "
                       r"-infer_gpu_num (\d+)$")
#: The tutorial's stanza names the workspace by this placeholder.
PLACEHOLDER = "/path/to/ft_workspace"
#: dev/v1.1_beta's config: `max_decoding_seq_len`; `transerve convert`'s generator: the default max_new_tokens.
NEW_TOKENS = {"ft": 528, "convert": 64}


def seed_client() -> str:
    """The seed tutorial's client.py, from its text."""
    seeds = sorted(SEEDS.glob("000_*.txt"))
    if not seeds:
        pytest.skip(f"seed 000's text is not at {SEEDS} (the tutorial's client.py is taken from it)")
    (client,) = [block for block in re.findall(r"^```python\n(.*?)^```", seeds[0].read_text(), re.M | re.S)
                 if "def translate" in block]
    assert 'url = "localhost:8000"' in client and "client_util = httpclient" in client
    return client


def replaced(command: str, workspace: Path) -> str:
    """A page command as the test runs it: network steps replaced, the converter by the step-by-step redo."""
    if command.startswith(("pip install", "git lfs install")) or command.startswith("git clone https://github.com/") \
            or command.startswith("git clone -b dev/v5.0_beta https://github.com/NVIDIA/"):
        return ":"
    if command == "git clone https://huggingface.co/t5-base":
        return f"cp -r {shlex.quote(str(workspace.parent / 'stand-in' / 't5-base'))} t5-base"
    converter = CONVERTER.match(command)
    if converter:
        saved_dir, in_file, gpus = converter.groups()
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from support.ft_checkpoints import t5_ckpt_convert; "
                "t5_ckpt_convert(sys.argv[2], sys.argv[3], int(sys.argv[4]))")
        return shlex.join([sys.executable, "-c", code, str(REPO_ROOT / "tests"), in_file, saved_dir, gpus])
    return command


def run_client(workspace: Path, client: str, http_url: str, grpc_url: str, protocol: str, command: str) -> str:
    if protocol == "grpc":
        client = client.replace("client_util = httpclient", "client_util = grpcclient")
        client = client.replace("concurrency=request_parallelism, ", "")
        client = client.replace('url = "localhost:8000"', f'url = "{grpc_url}"')
    else:
        client = client.replace('url = "localhost:8000"', f'url = "{http_url}"')
    (workspace / "client.py").write_text(client)
    # `python` as the page writes it, found first where the suite's interpreter is (its venv, activated or not).
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    run = subprocess.run(shlex.split(command), cwd=workspace, input=PROMPT + "\n", capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PATH": path})
    assert run.returncode == 0, run.stderr
    return run.stdout


def expected(workspace: Path, new_tokens: int) -> tuple[list[int], str]:
    """transformers' greedy tokens for the prompt, as FasterTransformer returns them, and their text."""
    folder = workspace / "t5-base"
    tokenizer = transformers.T5Tokenizer.from_pretrained(folder)
    model = transformers.T5ForConditionalGeneration.from_pretrained(folder).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(ids, do_sample=False, max_new_tokens=new_tokens)[0].tolist()[1:]
    generated = generated[: generated.index(1) + 1] if 1 in generated else generated
    text = transformers.PreTrainedTokenizerFast.from_pretrained(folder).decode(generated, skip_special_tokens=True)
    return generated, text


def printed_tokens(stdout: str) -> tuple[list[int], str]:
    """The client's printed OUTPUT0 row cut to OUTPUT1's length, and its last line (the translation)."""
    arrays = stdout[stdout.index("[[["):]
    output0, _, rest = arrays.partition("]]]")
    length = int(re.match(r"\s*\[\[(\d+)\]\]", rest).group(1))
    return [int(token) for token in output0.replace("[", " ").split()][:length], stdout.rstrip("\n").split("\n")[-1]


def test_the_tutorial_runs_as_written(tmp_path: Path):
    client = seed_client()
    blocks = [commands(block) for block in code_blocks(PAGE, "bash")]
    setup, config, dump, move, serve, test, convert_route = blocks
    assert setup[:4] == ["pip install 'transerve[generation]' 'tritonclient[all]' sentencepiece", "mkdir ft_workspace",
                         "cd ft_workspace", "export WORKSPACE=$(pwd)"]
    assert any(CONVERTER.match(command) for command in dump)
    assert CONVERTER.match(dump[-1]).groups() == ("fastertransformer_backend/all_models/t5/fastertransformer/1/",
                                                  "t5-base/", "1")
    assert test == ["python client.py --model t5-base"]
    build_seed_t5(tmp_path / "stand-in" / "t5-base")
    workspace = tmp_path / "ft_workspace"
    script = "\n".join(["set -e", *(replaced(command, workspace) for command in [*setup, *config, *dump, *move])])
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"TRANSERVE": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stdout + run.stderr
    version = workspace / "fastertransformer_backend" / "all_models" / "t5" / "fastertransformer" / "1"
    assert (version / "config.ini").is_file() and (version / "shared.weight_T.bin").is_file()
    assert not (version / "1-gpu").exists()
    (stanza,) = code_blocks(PAGE, "text")
    config_file = version.parent / "config.pbtxt"
    config_file.write_text(config_file.read_text() + stanza.replace(PLACEHOLDER, str(workspace)))

    # the server: `cd $WORKSPACE`, then the page's serve command (ports free ones)
    assert serve[0] == "cd $WORKSPACE"
    repository = serve[1].replace("$WORKSPACE", str(workspace))
    assert repository.startswith("transerve serve --model-repository=")
    tokens, text = expected(workspace, NEW_TOKENS["ft"])
    assert len(tokens) > 1 and text
    with start_transerve(repository.split("=", 1)[1]) as server:
        for protocol in ("http", "grpc"):
            stdout = run_client(workspace, client, server.http_url, f"127.0.0.1:{server.grpc_port}", protocol,
                                test[0])
            assert "set request" in stdout and "get request" in stdout
            assert printed_tokens(stdout) == (tokens, text), protocol

    # without FasterTransformer: transerve convert, then the same client
    assert convert_route[0] == "cd $WORKSPACE" and convert_route[-1] == test[0]
    program, *arguments = shlex.split(convert_route[1].replace("$WORKSPACE", str(workspace)))
    assert program == "transerve" and arguments[:2] == ["convert", "t5-base"]
    subprocess.run([sys.executable, "-m", "transerve", *arguments], cwd=workspace, check=True, capture_output=True,
                   timeout=600, env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")})
    converted = convert_route[2].replace("$WORKSPACE", str(workspace)).split("=", 1)[1]
    tokens, text = expected(workspace, NEW_TOKENS["convert"])
    with start_transerve(converted) as server:
        stdout = run_client(workspace, client, server.http_url, f"127.0.0.1:{server.grpc_port}", "http", test[0])
        assert printed_tokens(stdout) == (tokens, text)
