"""`transerve convert`: every tiny architecture for both engines, the repository served by a real `transerve
serve`, outputs equal to transformers' `generate` on the same weights, and what it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
from support import ServerProcess, start_transerve
from support.generation_models import ARCHITECTURES, build_generation_model
from support.hf_models import build_tiny_model
from support.openai_models import CHAT_TEMPLATE, build_chat_gpt2

from transerve.config.model_config import load_config_file, validate
from transerve.convert.command import convert
from transerve.export.hf import ExportError

ctranslate2 = pytest.importorskip("ctranslate2")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
httpclient = pytest.importorskip("tritonclient.http")

SRC = Path(__file__).resolve().parents[2] / "src"
TEXT = "translate English to German: The house is wonderful."
MAX_TOKENS = 12
#: Converted models: name -> (architecture, engine, quantization).
CONVERSIONS = {
    "fastertransformer": ("t5", "ctranslate2", "float32"),
    "t5_torch": ("t5", "torch", "float32"),
    "bart": ("bart", "ctranslate2", "int8"),
    "bart_torch": ("bart", "torch", "float32"),
    "marian": ("marian", "ctranslate2", "float32"),
    "marian_torch": ("marian", "torch", "float32"),
    "gpt2": ("gpt2", "ctranslate2", "float32"),
    "gpt2_torch": ("gpt2", "torch", "float32"),
}
#: A decoupled generator (torch engine), whose text ensemble streams.
STREAMING = "t5_stream"


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("convert_hf")
    return {arch: build_generation_model(arch, root / arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def repository(hf_folders, tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("converted")
    for name, (arch, engine, quantization) in CONVERSIONS.items():
        convert(hf_folders[arch], repo, engine=engine, quantization=quantization, name=name, max_batch_size=4)
    convert(hf_folders["t5"], repo, engine="torch", name=STREAMING, max_batch_size=4, decoupled=True)
    return repo


@pytest.fixture(scope="session")
def server(repository) -> Iterator[ServerProcess]:
    """The text ensembles loaded one after the other (each loads its generator, tokenizer and detokenizer):
    transformers' from_pretrained is not safe to run in several threads at once."""
    with start_transerve(repository, "--model-control-mode=explicit") as process:
        for name in [*CONVERSIONS, STREAMING]:
            answer = requests.post(f"{process.base_url}/v2/repository/models/{name}_text/load", timeout=300)
            assert answer.status_code == 200, f"{name}_text: {answer.text}\n{process.log_tail()}"
        yield process


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "transerve", "convert", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def reference(folder: Path, arch: str, max_new_tokens: int = MAX_TOKENS) -> tuple[list[int], list[int], str]:
    """The prompt's ids, transformers' greedy new tokens (cut after the end token) and their text."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    kind = transformers.AutoModelForCausalLM if arch == "gpt2" else transformers.AutoModelForSeq2SeqLM
    model = kind.from_pretrained(folder).eval()
    ids = tokenizer(TEXT).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens)[0].tolist()
    new = out[len(ids):] if arch == "gpt2" else out[1:]
    eos = model.generation_config.eos_token_id
    if eos in new:
        new = new[: new.index(eos) + 1]
    return ids, new, tokenizer.decode(new, skip_special_tokens=True)


def test_every_model_is_written_with_a_config_that_parses(repository):
    for name, (_, engine, _) in CONVERSIONS.items():
        for model in (name, f"{name}_tokenizer", f"{name}_detokenizer", f"{name}_text"):
            validate(load_config_file(repository / model), model)
        generator = load_config_file(repository / name)
        assert generator.backend == "generation"
        assert generator.parameters["engine"].string_value == engine
        model_dir = repository / name / "1" / "model"
        assert (model_dir / ("model.bin" if engine == "ctranslate2" else "model.safetensors")).is_file()
        assert (model_dir / "tokenizer.json").is_file()
        for python in (f"{name}_tokenizer", f"{name}_detokenizer"):
            assert (repository / python / "1" / "model.py").is_file()
            assert (repository / python / "1" / "tokenizer.json").is_file()
    first = load_config_file(repository / "fastertransformer")
    assert [t.name for t in first.input] == ["INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN"]
    assert [t.name for t in first.output] == ["OUTPUT0", "OUTPUT1"]
    later = load_config_file(repository / "gpt2")
    assert [t.name for t in later.output] == [
        "output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "prefix_length", "output_top_ids",
        "output_top_log_probs", "prompt_log_probs", "prompt_top_ids", "prompt_top_log_probs",
        "prompt_ranks",
    ]
    # an encoder-decoder model scores no prompt: no prompt outputs declared
    assert not any(t.name.startswith("prompt_") for t in load_config_file(repository / "t5_torch").output)
    assert {t.name for t in later.input if t.optional} >= {"beam_width", "runtime_top_k", "random_seed", "stream"}


def test_every_model_loads_in_a_real_server(server):
    for name in CONVERSIONS:
        for model in (name, f"{name}_tokenizer", f"{name}_detokenizer", f"{name}_text"):
            answer = requests.get(f"{server.base_url}/v2/models/{model}/ready", timeout=10)
            assert answer.status_code == 200, f"{model} is not ready:\n{server.log_tail()}"


def test_the_seed_clients_interface_gives_transformers_tokens(server, hf_folders):
    ids, expected, _ = reference(hf_folders["t5"], "t5")
    client = httpclient.InferenceServerClient(server.http_url)
    inputs = [
        httpclient.InferInput("INPUT_ID", [1, len(ids)], "UINT32"),
        httpclient.InferInput("REQUEST_INPUT_LEN", [1, 1], "UINT32"),
        httpclient.InferInput("REQUEST_OUTPUT_LEN", [1, 1], "UINT32"),
    ]
    inputs[0].set_data_from_numpy(np.array([ids], np.uint32))
    inputs[1].set_data_from_numpy(np.array([[len(ids)]], np.uint32))
    inputs[2].set_data_from_numpy(np.array([[MAX_TOKENS]], np.uint32))
    result = client.infer("fastertransformer", inputs)
    length = int(result.as_numpy("OUTPUT1")[0, 0])
    assert result.as_numpy("OUTPUT0")[0, 0, :length].tolist() == expected


@pytest.mark.parametrize("name", [n for n, (_, _, q) in CONVERSIONS.items() if q == "float32"])
def test_the_text_ensemble_gives_transformers_text(server, hf_folders, name):
    """/generate: `max_tokens` is not an ensemble input, so it becomes a request parameter the generator reads."""
    arch = CONVERSIONS[name][0]
    _, _, expected = reference(hf_folders[arch], arch)
    body = {"text_input": TEXT, "max_tokens": MAX_TOKENS}
    answer = requests.post(f"{server.base_url}/v2/models/{name}_text/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    # Decoder-only models' output ids start with the prompt; the detokenizer leaves it out.
    assert answer.json()["text_output"] == expected.rstrip("\ufffd")


def test_tritonclient_text_requests(server, hf_folders):
    """Text alone decodes the config's default max_new_tokens (64); options go as request parameters."""
    client = httpclient.InferenceServerClient(server.http_url)
    text = httpclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[TEXT.encode()]], dtype=np.object_))
    plain = client.infer("fastertransformer_text", [text]).as_numpy("text_output")[0, 0].decode()
    assert plain == reference(hf_folders["t5"], "t5", max_new_tokens=64)[2].rstrip("\ufffd")
    short = client.infer("gpt2_text", [text], parameters={"max_tokens": 3}).as_numpy("text_output")[0, 0].decode()
    assert short == reference(hf_folders["gpt2"], "gpt2", max_new_tokens=3)[2].rstrip("\ufffd")
    bad = requests.post(f"{server.base_url}/v2/models/gpt2_text/generate",
                        json={"text_input": TEXT, "beam_width": 0}, timeout=60)
    assert bad.status_code == 400
    assert "beam_width" in bad.json()["error"]


def test_an_int8_model_generates(server):
    body = {"text_input": "안녕하세요 세계 🙂", "max_tokens": MAX_TOKENS}
    answer = requests.post(f"{server.base_url}/v2/models/bart_text/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert isinstance(answer.json()["text_output"], str)


def test_conversion_on_the_command_line_shows_each_stage(hf_folders, tmp_path):
    done = cli(str(hf_folders["gpt2"]), "--output", str(tmp_path), "--quantization", "int8", "--decoupled")
    assert done.returncode == 0, done.stderr
    stages = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert [line[:5] for line in stages] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert "converting to CTranslate2 (int8)" in stages[2]
    config = load_config_file(tmp_path / "gpt2")
    assert config.model_transaction_policy.decoupled
    assert json.loads((tmp_path / "gpt2" / "1" / "model" / "config.json").read_text())["eos_token"]
    again = cli(str(hf_folders["gpt2"]), "--output", str(tmp_path))
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1] == (
        f"transerve convert: '{tmp_path / 'gpt2'}' already exists: choose another --output or --name"
    )


@pytest.mark.parametrize("engine", ["ctranslate2", "torch"])
def test_the_chat_template_and_the_tokenizer_files_travel_with_the_model(tmp_path, engine):
    """transformers 5's chat_template.jinja, or the older tokenizer_config.json key, and the tokenizer's other files
    land beside the model, where the OpenAI API reads them; CTranslate2's own config.json stays its own."""
    folder = build_chat_gpt2(tmp_path / "hf")
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}))
    (folder / "added_tokens.json").write_text(json.dumps({"<|endoftext|>": 0}))
    older = tmp_path / "older"
    build_chat_gpt2(older).joinpath("chat_template.jinja").unlink()
    tokenizer_config = json.loads((older / "tokenizer_config.json").read_text())
    (older / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": CHAT_TEMPLATE}))
    convert(folder, tmp_path / "repo", engine=engine, name="chat")
    convert(older, tmp_path / "repo", engine=engine, name="older")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    expected = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    assert expected.startswith("<|endoftext|><|im_start|>system\nBe brief.<|im_end|>\n")
    for name in ("chat", "older"):
        model_dir = tmp_path / "repo" / name / "1" / "model"
        served = transformers.AutoTokenizer.from_pretrained(model_dir)
        assert served.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == expected
    model_dir = tmp_path / "repo" / "chat" / "1" / "model"
    for file in ("chat_template.jinja", "special_tokens_map.json", "added_tokens.json", "tokenizer_config.json"):
        assert (model_dir / file).read_bytes() == (folder / file).read_bytes()
    hf_config = json.loads((folder / "config.json").read_text())
    config = json.loads((model_dir / "config.json").read_text())
    assert (config == hf_config) == (engine == "torch")


def test_what_cannot_be_converted_is_refused_in_one_line(hf_folders, tmp_path):
    bert = build_tiny_model("seqcls", tmp_path / "bert")
    refused = cli(str(bert), "--output", str(tmp_path / "out"))
    assert refused.returncode == 2
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("transerve convert: the ctranslate2 engine cannot convert a 'bert' model; it converts ")
    assert all(arch in line for arch in ARCHITECTURES)
    torch_refused = cli(str(bert), "--output", str(tmp_path / "out"), "--engine", "torch")
    assert torch_refused.returncode == 2
    assert "AutoModelForCausalLM or AutoModelForSeq2SeqLM" in torch_refused.stderr.strip().splitlines()[-1]
    (tmp_path / "not_a_model").mkdir()
    not_hf = cli(str(tmp_path / "not_a_model"), "--output", str(tmp_path / "out"))
    assert not_hf.returncode == 2
    assert not_hf.stderr.strip() == (f"transerve convert: '{tmp_path / 'not_a_model'}' is not a Hugging Face model "
                                     "folder: it has no config.json with a model_type")
    unknown = cli(str(hf_folders["t5"]), "--output", str(tmp_path / "out"), "--quantization", "int4")
    assert unknown.returncode == 2
    assert "invalid choice: 'int4'" in unknown.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(ExportError, match="quantization 'int8' needs --engine ctranslate2"):
        convert(hf_folders["t5"], tmp_path / "out", engine="torch", quantization="int8")
    with pytest.raises(ExportError, match="unknown quantization 'int3'"):
        convert(hf_folders["t5"], tmp_path / "out", quantization="int3")


def test_streamed_pieces_never_split_a_character(server, hf_folders):
    """The detokenizer as a stream calls it: all ids so far, and how many of them earlier pieces covered."""
    from tokenizers import Tokenizer

    text = "안녕하세요 세계 🙂🚀"
    ids = Tokenizer.from_file(str(hf_folders["gpt2"] / "tokenizer.json")).encode(text).ids
    client = httpclient.InferenceServerClient(server.http_url)
    pieces = []
    for end in range(1, len(ids) + 1):
        inputs = [
            httpclient.InferInput("output_ids", [1, 1, end], "UINT32"),
            httpclient.InferInput("sequence_length", [1, 1], "UINT32"),
            httpclient.InferInput("prefix_length", [1, 1], "UINT32"),
        ]
        inputs[0].set_data_from_numpy(np.array([[ids[:end]]], np.uint32))
        inputs[1].set_data_from_numpy(np.array([[end]], np.uint32))
        inputs[2].set_data_from_numpy(np.array([[end - 1]], np.uint32))
        pieces.append(client.infer("gpt2_detokenizer", inputs).as_numpy("text_output")[0, 0].decode("utf-8"))
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces  # some token held only part of a character: its piece waited for the rest


def test_a_decoder_only_model_with_the_first_names_leaves_the_prompt_out_of_its_text(hf_folders, tmp_path):
    """The first names have no prefix_length: the text ensemble tells the detokenizer the prompt's length."""
    convert(hf_folders["gpt2"], tmp_path, name="fastertransformer", max_batch_size=2)
    ids, expected_ids, expected = reference(hf_folders["gpt2"], "gpt2")
    with start_transerve(tmp_path, "--model-control-mode=explicit") as process:
        loaded = requests.post(f"{process.base_url}/v2/repository/models/fastertransformer_text/load", timeout=300)
        assert loaded.status_code == 200, loaded.text
        body = {"text_input": TEXT, "max_tokens": MAX_TOKENS}
        answer = requests.post(f"{process.base_url}/v2/models/fastertransformer_text/generate", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["text_output"] == expected.rstrip("\ufffd")
        client = httpclient.InferenceServerClient(process.http_url)
        inputs = [httpclient.InferInput("INPUT_ID", [1, len(ids)], "UINT32"),
                  httpclient.InferInput("REQUEST_INPUT_LEN", [1, 1], "UINT32")]
        inputs[0].set_data_from_numpy(np.array([ids], np.uint32))
        inputs[1].set_data_from_numpy(np.array([[len(ids)]], np.uint32))
        result = client.infer("fastertransformer", inputs, parameters={"max_tokens": MAX_TOKENS})
        length = int(result.as_numpy("OUTPUT1")[0, 0])
        assert result.as_numpy("OUTPUT0")[0, 0, :length].tolist() == ids + expected_ids


def test_the_text_ensemble_of_a_decoupled_generator_streams_its_text(server, hf_folders):
    """generate_stream with `stream: true`: pieces as tokens come, joined equal to the whole text, which /generate
    (one response: `stream` false) and transformers give."""
    _, _, text = reference(hf_folders["t5"], "t5", max_new_tokens=40)
    url = f"{server.base_url}/v2/models/{STREAMING}_text"
    whole = requests.post(f"{url}/generate", json={"text_input": TEXT, "max_tokens": 40}, timeout=60)
    assert whole.status_code == 200, whole.text
    assert whole.json()["text_output"] == text
    streamed = requests.post(f"{url}/generate_stream", json={"text_input": TEXT, "max_tokens": 40, "stream": True},
                             timeout=60)
    assert streamed.status_code == 200, streamed.text
    pieces = [json.loads(line[len(b"data: "):])["text_output"] for line in streamed.content.split(b"\n")
              if line.startswith(b"data: ")]
    assert len(pieces) > 1
    assert "".join(pieces) == text
