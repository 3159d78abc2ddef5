"""docs/tutorials/hf-onnx-ensembles.md, run as the page shows it, step by step as seed tutorial 002 takes them:
each of step 1's three exports in a folder of its own (the seed says to choose one), served, called with the
page's `send_request.py` by the seed's flags; for choice I, the manual test's three perf lines and two client
lines; then the clean-up. Commands run as the page writes them (transerve as `python -m transerve`, python3 as
this interpreter), with only `localhost:8000` replaced by the test server's address, on small random-weight
models in place of the page's checkpoints."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from support import REPO_ROOT, start_transerve
from support.doc_blocks import captioned_files, code_blocks, commands
from support.hf_models import minilm_path
from tritonclient.utils import InferenceServerException

PAGE = REPO_ROOT / "docs" / "tutorials" / "hf-onnx-ensembles.md"
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH")])))
VOCABULARY = 30522  # MiniLM's tokenizer, which the small models share
HIDDEN = 32


def run(command: str, cwd: Path, address: str = "", timeout: float = 300) -> subprocess.CompletedProcess[str]:
    argv = shlex.split(command.replace("localhost:8000", address) if address else command, comments=True)
    if argv[0] == "transerve":
        argv = [sys.executable, "-m", "transerve", *argv[1:]]
    elif argv[0] == "python3":
        argv = [sys.executable, *argv[1:]]
    return subprocess.run(argv, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def checkpoints(root: Path) -> None:
    """Small stand-ins for facebook/opt-125m (a base model: no classification head) and
    deepset/roberta-base-squad2 (a question answerer), with MiniLM's tokenizer."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.OPTModel(transformers.OPTConfig(
        vocab_size=VOCABULARY, hidden_size=HIDDEN, word_embed_proj_dim=HIDDEN, num_hidden_layers=2, ffn_dim=64,
        num_attention_heads=2, max_position_embeddings=256, pad_token_id=0)).save_pretrained(root / "opt-125m")
    # Two token types: MiniLM's tokenizer gives a pair's second text type 1 (RoBERTa's own gives 0).
    transformers.RobertaForQuestionAnswering(transformers.RobertaConfig(
        vocab_size=VOCABULARY, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=258, type_vocab_size=2)).save_pretrained(root / "roberta-base-squad2")
    for folder in ("opt-125m", "roberta-base-squad2"):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(minilm_path() / name, root / folder / name)


def check_perf(result: subprocess.CompletedProcess[str]) -> None:
    """A seed perf line's run: every level of -t1 -c5 measured (none reaches -l3000 here), no request failed."""
    assert "inference failed" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0 or "were not stable" in result.stderr, result.stderr  # a busy machine
    out = result.stdout
    assert "  Latency limit: 3000 msec\n  Concurrency limit: 5 concurrent requests\n" in out, out
    assert re.findall(r"^Request concurrency: (\d+)$", out, re.MULTILINE) == ["1", "2", "3", "4", "5"], out
    assert re.findall(r"  Pass \[1\] throughput: [\d.]+ infer/sec", out), out  # -v
    throughputs = [float(value) for value in re.findall(r"Throughput: ([\d.]+) infer/sec", out)]
    assert len(throughputs) == 5 and min(throughputs) > 0, out
    served = [int(count) for count in re.findall(r"Successful request count: (\d+)", out)]
    assert len(served) == 5 and min(served) > 0, out


@pytest.mark.slow  # three exports and servers, three perf searches of five 3-second levels: minutes on 2 cores
def test_the_tutorial_runs_as_written(tmp_path: Path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("transformers")
    checkpoints(tmp_path)
    blocks = [commands(block) for block in code_blocks(PAGE, "bash")]
    install, seqcls, encode, qa, serve, quick, manual, cleanup = blocks
    assert install == ["pip install -e '.[export]' 'tritonclient[http]'"]  # the suite's environment has both
    assert serve == ["transerve serve --model-repository models"]
    assert len(quick) == 3 and all(line.startswith("python3 send_request.py -u localhost:8000") for line in quick)
    client = captioned_files(PAGE)["send_request.py"]

    for choice, (export, quick_test) in {"seqcls": (seqcls, quick[0]), "encode": (encode, quick[1]),
                                         "qa": (qa, quick[2])}.items():
        folder = tmp_path / choice
        folder.mkdir()
        for checkpoint in ("opt-125m", "roberta-base-squad2"):
            (folder / checkpoint).symlink_to(tmp_path / checkpoint)
        (folder / "send_request.py").write_text(client)
        (command,) = export
        result = run(command, folder)
        assert result.returncode == 0, result.stderr
        assert sorted(path.name for path in (folder / "models").iterdir()) == sorted(
            ["llm", "model", "tokenizer"] + (["llm_postprocess"] if choice != "encode" else []))

        with start_transerve(folder / "models") as server:
            answer = run(quick_test, folder, server.http_url)
            assert answer.returncode == 0, answer.stderr
            printed = answer.stdout.splitlines()
            if choice == "seqcls":
                assert printed[0] == "LOGITS (1, 2)"  # OPT's default two labels, a random head
                assert re.fullmatch(r"inference_count \d+ execution_count \d+", printed[1]), printed
            elif choice == "encode":
                assert re.fullmatch(rf"HIDDEN_STATE \(8, \d+, {HIDDEN}\)", printed[0]), printed
            else:
                tokens = re.fullmatch(r"START_LOGITS \(8, (\d+)\)", printed[0])
                assert tokens and printed[1] == f"END_LOGITS (8, {tokens[1]})", printed
                check_refusal(server.http_url, "model.roberta.embeddings.word_embeddings.weight")
            if choice == "seqcls":
                manual_test(manual, folder, server.http_url)

        for command in cleanup:
            assert run(command, folder).returncode == 0
        assert not (folder / "models").exists()


def manual_test(lines: list[str], folder: Path, address: str) -> None:
    perf_lines = [line for line in lines if line.startswith("transerve perf")]
    clients = [line for line in lines if line.startswith("python3 send_request.py")]
    assert [shlex.split(line)[3] for line in perf_lines] == ["tokenizer", "model", "llm"]
    assert len(clients) == 2 and len(lines) == 5
    for line in perf_lines:
        check_perf(run(line, folder, address, timeout=900))
    tokenizer, ensemble = (run(line, folder, address) for line in clients)
    assert tokenizer.returncode == 0 and ensemble.returncode == 0, tokenizer.stderr + ensemble.stderr
    tokens = re.fullmatch(r"input_ids \(1, (\d+)\)", tokenizer.stdout.splitlines()[0])
    assert tokens and tokenizer.stdout.splitlines()[1] == f"attention_mask (1, {tokens[1]})", tokenizer.stdout
    assert ensemble.stdout.splitlines()[0] == "LOGITS (1, 2)"
    stats = httpclient.InferenceServerClient(address).get_inference_statistics("model")["model_stats"][0]
    assert stats["inference_stats"].get("fail", {}).get("count", 0) == 0 and stats["inference_count"] > 0


def check_refusal(address: str, table: str) -> None:
    """What the page says of ids outside the vocabulary: a 400 naming the input, the range and the table."""
    client = httpclient.InferenceServerClient(address)
    ids = np.array([[0, VOCABULARY, 2]], dtype=np.int64)
    inputs = []
    for name, array in (("input_ids", ids), ("attention_mask", np.ones_like(ids)),
                        ("token_type_ids", np.zeros_like(ids))):
        tensor = httpclient.InferInput(name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("model", inputs)
    assert caught.value.status() == "400"
    assert caught.value.message() == (f"input 'input_ids' holds id {VOCABULARY}, outside the vocabulary "
                                      f"(0..{VOCABULARY - 1}) of the embedding table '{table}'")
