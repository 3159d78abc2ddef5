"""FasterTransformer repositories served unchanged by a real `transerve serve`, called with tritonclient.

The FasterTransformer backend's own example configs (tests/e2e/ft_repository_models/) are served over checkpoint
folders written in FasterTransformer's converter layout from random-weight Hugging Face T5 and GPT-2 models
(tests/support/ft_checkpoints.py); the tokens served equal transformers' `generate` on the same weights. The T5
config is served byte for byte, its relative `model_checkpoint_path` found from the server's working directory as
in FasterTransformer's T5 guide; this is also docs/tutorials/fastertransformer-t5.md's walk-through, its commands
spelled here: the checkpoint writer, `transerve serve --model-repository all_models/t5` and the page's client.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests
from support.ft_checkpoints import write_gpt_checkpoint, write_t5_checkpoint
from support.generation_models import build_generation_model
from support.servers import REPO_ROOT, start_server, transerve_argv

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

CONFIGS = Path(__file__).parent / "ft_repository_models"
T5_CHECKPOINT = "./all_models/t5/fastertransformer/1/1-gpu/"  # as the FasterTransformer config says
TEXTS = ["The house is wonderful.", "Hello world"]
MAX_OUTPUT_LEN = 12


def _renamed(text: str, name: str, **parameters: str) -> str:
    """The T5 config under another model name, with some parameters' values replaced."""
    text = text.replace('name: "fastertransformer"', f'name: "{name}"', 1)
    for key, value in parameters.items():
        before = {"model_checkpoint_path": T5_CHECKPOINT, "model_type": "T5"}[key]
        text = text.replace(f'string_value: "{before}"', f'string_value: "{value}"')
    return text


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The FasterTransformer T5 guide's workspace: `t5-small/` (a random-weight stand-in), `all_models/t5/` with
    the unchanged config and the converted `1/1-gpu/`, and broken models beside it."""
    ws = tmp_path_factory.mktemp("ft_workspace")
    build_generation_model("t5", ws / "t5-small")
    build_generation_model("gpt2", ws / "gpt2")
    repository = ws / "all_models" / "t5"
    (repository / "fastertransformer").mkdir(parents=True)
    shutil.copy(CONFIGS / "t5.pbtxt", repository / "fastertransformer" / "config.pbtxt")
    # The page's conversion step, as docs/tutorials/fastertransformer-t5.md spells it (run from the workspace).
    subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "support" / "ft_checkpoints.py"), "t5", "t5-small",
                    "all_models/t5/fastertransformer/1/"], cwd=ws, check=True, capture_output=True)
    t5 = transformers.T5ForConditionalGeneration.from_pretrained(ws / "t5-small")
    # FasterTransformer's GPT example (name and checkpoint path changed), over a two-rank checkpoint.
    gpt2 = transformers.GPT2LMHeadModel.from_pretrained(ws / "gpt2")
    (repository / "gpt").mkdir()
    write_gpt_checkpoint(gpt2, repository / "gpt" / "1", tensor_para_size=2)
    gpt_config = (CONFIGS / "gpt.pbtxt").read_text().replace('name: "fastertransformer"', 'name: "gpt"')
    gpt_config = gpt_config.replace("/data/models/GPT/Megatron/c-model/345m/1-gpu/", "1/2-gpu")
    (repository / "gpt" / "config.pbtxt").write_text(gpt_config)
    # Broken ones: each must be UNAVAILABLE with its reason while the rest serves.
    t5_config = (CONFIGS / "t5.pbtxt").read_text()
    broken = {
        "missing_folder": {"model_checkpoint_path": "1/nowhere"},
        "missing_tensor": {"model_checkpoint_path": "1/1-gpu"},
        "wrong_size": {"model_checkpoint_path": "1/1-gpu"},
        "escaping": {"model_checkpoint_path": "../../../outside/1-gpu"},
        "bert": {"model_type": "bert", "model_checkpoint_path": "1/1-gpu"},
    }
    for name, parameters in broken.items():
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(_renamed(t5_config, name, **parameters))
        if name != "missing_folder":
            write_t5_checkpoint(t5, repository / name / "1")
    (repository / "missing_tensor" / "1" / "1-gpu" / "decoder.block.1.layer.2.DenseReluDense.wo.weight.0.bin").unlink()
    truncated = repository / "wrong_size" / "1" / "1-gpu" / "encoder.final_layer_norm.weight.bin"
    truncated.write_bytes(truncated.read_bytes()[:-8])
    write_t5_checkpoint(t5, ws / "outside")
    return ws


@pytest.fixture(scope="module")
def server(workspace, tmp_path_factory):
    """`transerve serve --model-repository all_models/t5`, run from the workspace, its temporary files in a folder of
    their own."""
    scratch = tmp_path_factory.mktemp("server_tmp")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(scratch),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH")])))
    running = start_server(
        "transerve",
        lambda http, grpc, metrics: transerve_argv(Path("all_models/t5"), http, grpc, metrics,
                                                    "--strict-readiness=false"),
        log_dir=tmp_path_factory.mktemp("server_log"), env=env, cwd=workspace,
    )
    running.scratch = scratch
    try:
        yield running
    finally:
        running.stop()


def _generate(model, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens)[0].tolist()
    return out


def _tensor(module, name: str, array: np.ndarray):
    tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def test_the_tutorial_client_gets_transformers_translations(server, workspace):
    """docs/tutorials/fastertransformer-t5.md's client against the unchanged T5 config."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(workspace / "t5-small")
    model = transformers.T5ForConditionalGeneration.from_pretrained(workspace / "t5-small").eval()
    expected = []
    for text in TEXTS:
        ids = tokenizer(f"translate English to German: {text}").input_ids
        expected.append(tokenizer.decode(_generate(model, ids, MAX_OUTPUT_LEN), skip_special_tokens=True))
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "fastertransformer" / "t5_client.py"), *TEXTS,
         "--url", f"127.0.0.1:{server.http_port}", "--tokenizer", "t5-small", "--max-output-len", str(MAX_OUTPUT_LEN)],
        cwd=workspace, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == expected


@pytest.mark.parametrize("protocol", [httpclient, grpcclient])
def test_t5_tokens_equal_transformers_generate(server, workspace, protocol):
    """The FasterTransformer T5 client's tensors; the ids as FasterTransformer returns them, in the config's INT32."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(workspace / "t5-small")
    model = transformers.T5ForConditionalGeneration.from_pretrained(workspace / "t5-small").eval()
    encoded = tokenizer([f"translate English to German: {text}" for text in TEXTS], return_tensors="np",
                        padding=True)
    batch = len(TEXTS)
    inputs = [
        _tensor(protocol, "input_ids", encoded.input_ids.astype(np.uint32)),
        _tensor(protocol, "sequence_length", encoded.attention_mask.sum(1, keepdims=True).astype(np.uint32)),
        _tensor(protocol, "max_output_len", np.full([batch, 1], MAX_OUTPUT_LEN, np.uint32)),
        _tensor(protocol, "start_id", np.zeros([batch, 1], np.uint32)),
        _tensor(protocol, "end_id", np.ones([batch, 1], np.uint32)),
        _tensor(protocol, "beam_search_diversity_rate", np.zeros([batch, 1], np.float32)),
    ]
    url = f"127.0.0.1:{server.http_port if protocol is httpclient else server.grpc_port}"
    with protocol.InferenceServerClient(url) as client:
        result = client.infer("fastertransformer", inputs)
    output_ids, lengths = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
    assert output_ids.dtype == np.int32 and lengths.dtype == np.int32 and lengths.shape == (batch, 1)
    for row in range(batch):
        ids = encoded.input_ids[row, : encoded.attention_mask[row].sum()].tolist()
        generated = _generate(model, ids, MAX_OUTPUT_LEN)[1:]  # without the decoder's start token
        generated = generated[: generated.index(1) + 1] if 1 in generated else generated
        assert output_ids[row, 0, : lengths[row, 0]].tolist() == generated


def test_gpt_example_config_over_two_ranks_gives_transformers_tokens(server, workspace):
    """FasterTransformer's GPT example: `input_lengths`, `request_output_len` in; the prompt and its continuation,
    and `response_input_lengths`, out."""
    model = transformers.GPT2LMHeadModel.from_pretrained(workspace / "gpt2").eval()
    prompt = [5, 17, 42, 8, 99]
    inputs = [
        _tensor(httpclient, "input_ids", np.array([prompt], np.uint32)),
        _tensor(httpclient, "input_lengths", np.array([[len(prompt)]], np.uint32)),
        _tensor(httpclient, "request_output_len", np.array([[8]], np.uint32)),
        _tensor(httpclient, "is_return_log_probs", np.array([[True]], bool)),
    ]
    with httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}") as client:
        result = client.infer("gpt", inputs)
    expected = _generate(model, prompt, 8)
    length = result.as_numpy("sequence_length")[0, 0]
    assert result.as_numpy("output_ids")[0, 0, :length].tolist() == expected
    assert result.as_numpy("response_input_lengths").tolist() == [[len(prompt)]]
    assert result.as_numpy("output_log_probs").shape == (1, 1, 8)
    assert result.as_numpy("context_embeddings") is None  # declared, never produced


@pytest.mark.parametrize(("name", "array", "says"), [
    ("beam_search_diversity_rate", np.array([[0.5]], np.float32), "diverse beam search"),
    ("start_id", np.array([[7]], np.uint32), "send 0 or leave it out"),
    ("ia3_tasks", np.array([[1]], np.int32), "IA3 adapters"),
])
def test_fastertransformer_inputs_without_effect_here_are_refused_unless_neutral(server, name, array, says):
    inputs = [
        _tensor(httpclient, "input_ids", np.array([[5, 6, 7]], np.uint32)),
        _tensor(httpclient, "sequence_length", np.array([[3]], np.uint32)),
        _tensor(httpclient, "max_output_len", np.array([[4]], np.uint32)),
        _tensor(httpclient, name, array),
    ]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    with client, pytest.raises(InferenceServerException) as caught:
        client.infer("fastertransformer", inputs)
    assert caught.value.status() == "400" and says in caught.value.message()


def test_broken_models_are_unavailable_with_the_reason_and_the_rest_serves(server):
    index = requests.post(f"{server.base_url}/v2/repository/index", json={}, timeout=30).json()
    states = {entry["name"]: entry for entry in index}
    reasons = {
        "missing_folder": "the checkpoint folder does not exist",
        "missing_tensor": "no tensor file 'decoder.block.1.layer.2.DenseReluDense.wo.weight.0.bin'",
        "wrong_size": "encoder.final_layer_norm.weight.bin' holds 248 bytes",
        "escaping": "leads outside the model repository",
        "bert": "model_type 'bert' is not one transerve's fastertransformer backend serves",
    }
    for name, words in reasons.items():
        assert states[name]["state"] == "UNAVAILABLE", name
        assert words in states[name]["reason"], states[name]["reason"]
    assert "transerve convert" in states["bert"]["reason"]
    assert states["fastertransformer"]["state"] == "READY" and states["gpt"]["state"] == "READY"


def test_parameters_that_do_not_apply_are_logged_and_nothing_is_left_on_disk(server):
    assert "tensor_para_size=1, pipeline_para_size=1, enable_custom_all_reduce=0 do not apply" in server.log
    assert "data_type fp16 applies to KIND_GPU instances; KIND_CPU ones compute in float32" in server.log
    assert list(server.scratch.iterdir()) == []  # the converted folders are gone once the engines loaded
