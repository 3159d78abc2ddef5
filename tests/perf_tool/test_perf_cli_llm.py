"""`transerve perf --llm` against a tiny converted generator (`transerve convert --engine torch --decoupled`):
streams over HTTP generate_stream and gRPC ModelStreamInfer, to the generator (token ids) and to its text
ensemble (text), reported as genai-perf reports them (docs/perf.md, "LLM mode")."""

from __future__ import annotations

import csv
import json
import re

import pytest
from support import perf_docs, start_transerve
from support.generation_models import build_generation_model

from transerve.cli import main

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

STATISTICS = ("Time to first token (ms)", "Inter token latency (ms)", "Request latency (ms)",
              "Output sequence length", "Input sequence length")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return build_generation_model("gpt2", tmp_path_factory.mktemp("perf_llm") / "gpt2")


@pytest.fixture(scope="module")
def llm_repo(hf_folder, tmp_path_factory):
    """docs/perf.md's `transerve convert gpt2-folder --output llm_repo --engine torch --decoupled --name gpt2`."""
    from transerve.convert.command import convert

    repo = tmp_path_factory.mktemp("perf_llm_repo")
    convert(hf_folder, repo, engine="torch", name="gpt2", max_batch_size=4, decoupled=True)
    return repo


@pytest.fixture(scope="module")
def server(llm_repo):
    with start_transerve(llm_repo) as process:
        yield process


def perf(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["perf", "--llm", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def rows(out: str) -> dict[str, list[float]]:
    """Each statistic's avg, min, max, p50, p90, p99 from the printed table (the last level's)."""
    found = {}
    for name in STATISTICS:
        line = [line for line in out.splitlines() if line.startswith(name)][-1]
        found[name] = [float(value) for value in line[len(name):].split()]
    return found


def throughput(out: str, label: str) -> float:
    return float(re.findall(rf"{re.escape(label)} \(per sec\): ([\d.]+)", out)[-1])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_generator_streams_token_ids(server, capsys, tmp_path, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    csv_file, png = tmp_path / "llm.csv", tmp_path / "llm.png"
    code, out, err = perf(capsys, "-m", "gpt2", "-i", protocol, "-u", url, "--concurrency-range", "1:2",
                          "--measurement-request-count", "6", "--output-tokens-mean", "8",
                          "--synthetic-input-tokens-mean", "5", "-f", str(csv_file), "--plot", str(png))
    assert code == 0, err
    assert f"LLM Metrics: gpt2 over {protocol.upper()}, concurrency 1" in out
    assert f"LLM Metrics: gpt2 over {protocol.upper()}, concurrency 2" in out
    table = rows(out)
    assert table["Input sequence length"][:3] == [5.0, 5.0, 5.0]
    assert 1 <= table["Output sequence length"][1] <= table["Output sequence length"][2] <= 8
    ttft, itl, latency = (table[name][0] for name in STATISTICS[:3])
    assert 0 < ttft < latency and itl > 0
    assert throughput(out, "Output token throughput") > throughput(out, "Request throughput") > 0
    lines = list(csv.reader(csv_file.open()))
    assert lines[0] == ["Concurrency", "Metric", "avg", "min", "max", "p50", "p90", "p99"]
    assert [line[1] for line in lines[1:6]] == list(STATISTICS)
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_text_ensemble_streams_text(server, capsys, hf_folder, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    code, out, err = perf(capsys, "-m", "gpt2_text", "-i", protocol, "-u", url, "--measurement-request-count", "4",
                          "--output-tokens-mean", "6", "--synthetic-input-tokens-mean", "4")
    assert code == 0, err
    # Without a tokenizer every streamed response counts as one token: the generator sends one a token here.
    assert rows(out)["Output sequence length"][2] <= 6
    code, out, err = perf(capsys, "-m", "gpt2_text", "-i", protocol, "-u", url, "--measurement-request-count", "4",
                          "--output-tokens-mean", "6", "--tokenizer", str(hf_folder / "tokenizer.json"))
    assert code == 0, err
    assert rows(out)["Output sequence length"][1] >= 1


def test_prompts_from_a_jsonl_file(server, capsys, tmp_path):
    texts = tmp_path / "prompts.jsonl"
    texts.write_text(json.dumps({"text": "Hello world, how are you today?"}) + "\n\n"
                     + json.dumps({"text": "The quick brown fox"}) + "\n")
    code, out, err = perf(capsys, "-m", "gpt2_text", "-u", server.http_url, "--input-file", str(texts),
                          "--measurement-request-count", "4", "--output-tokens-mean", "4")
    assert code == 0, err
    assert sorted(set(rows(out)["Input sequence length"][1:3])) == [4.0, 6.0]  # words of the two prompts
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    code, out, err = perf(capsys, "-m", "gpt2", "-u", server.http_url, "--input-file", str(ids),
                          "--measurement-request-count", "2", "--output-tokens-mean", "4")
    assert code == 0, err
    assert rows(out)["Input sequence length"][0] == 3.0


BAD = [
    (["-m", "gpt2", "--request-rate-range", "5"], "use --concurrency-range"),
    (["-m", "gpt2", "-b", "2"], "-b must be 1"),
    (["-m", "gpt2", "-t", "1", "-c", "0", "-l", "100"], "leave out -l"),
    (["-m", "gpt2", "--output-tokens-mean", "0"], "--output-tokens-mean must be between"),
    (["-m", "gpt2", "--num-prompts", "0"], "--num-prompts must be between"),
    (["-m", "gpt2", "--token-id-range", "9:3"], "--token-id-range"),
    (["-m", "gpt2_detokenizer"], "needs a model with a text_input input"),
    (["-m", "gpt2", "--token-id-range", "100000:100001"], "generate_stream: 400"),
]


@pytest.mark.parametrize(("flags", "message"), BAD, ids=[" ".join(flags) for flags, _ in BAD])
def test_bad_llm_runs_are_one_line_errors(server, capsys, flags, message):
    code, _, err = perf(capsys, "-u", server.http_url, "--measurement-request-count", "1", *flags)
    assert code == 1
    assert err.count("\n") == 1 and message in err, err


def test_a_bad_prompt_file_line_is_named(server, capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"input_ids": [1]}) + "\n")
    code, _, err = perf(capsys, "-m", "gpt2_text", "-u", server.http_url, "--input-file", str(path))
    assert code == 1
    assert err == (f'transerve perf: --input-file {path}, line 2: expected {{"text": "..."}} for model '
                   "'gpt2_text'\n")


@pytest.mark.slow  # three runs of 10 to 20 streamed requests of 16 tokens on the torch engine
def test_the_docs_commands(server, llm_repo, capsys, tmp_path, monkeypatch):
    """docs/perf.md's LLM commands, as written but for the server's ports and where llm_repo is, beside its
    prompts.jsonl."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.jsonl").write_text(perf_docs.blocks("json")[1])
    commands = perf_docs.perf_commands(llm=True)
    assert len(commands) == 3
    for argv in commands:
        argv = [arg.replace("llm_repo/", f"{llm_repo}/") for arg in argv]
        code = main(perf_docs.aimed(argv, server.http_url, server.grpc_url))
        out, err = capsys.readouterr()
        assert code == 0, (argv, err)
        assert "Output token throughput (per sec)" in out
    assert (tmp_path / "llm.csv").read_text().startswith("Concurrency,Metric,")
