"""FasterTransformer repositories of both generations served unchanged by a real `transerve serve`, called with
tritonclient over HTTP and gRPC.

fastertransformer_backend's configs (examples/fastertransformer/: dev/v1.1_beta's T5 and GPT, main's T5 and GPT)
are served over checkpoint folders written by tests/support/ft_checkpoints.py and ft_megatron.py, which redo
FasterTransformer's converter scripts step by step, from random-weight Hugging Face T5 and GPT-2 models:
dev/v5.0_beta's t5_ckpt_convert.py (its `1-gpu/` files moved up into `1/`, as the T5 tutorial does) and
megatron_ckpt_convert.py (a two-rank Megatron checkpoint, converted for two; no config.ini: the v1.1_beta GPT
config's parameters give the sizes), the later huggingface_t5_ckpt_convert.py (two ranks, float16 files) and
huggingface_gpt_convert.py (two ranks). The tokens served equal transformers' greedy `generate` on the same
weights. Token ids outside the vocabulary are a 400 naming the input and the range, and the request beside them is
answered.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import requests
from support.ft_checkpoints import huggingface_gpt_convert, huggingface_t5_ckpt_convert, t5_ckpt_convert
from support.ft_megatron import megatron_ckpt_convert, megatron_gpt_checkpoint
from support.generation_models import build_generation_model
from support.servers import REPO_ROOT, start_server, transerve_argv

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

CONFIGS = REPO_ROOT / "examples" / "fastertransformer"
MAIN_T5_CHECKPOINT = "./all_models/t5/fastertransformer/1/1-gpu/"  # as main's T5 config says
TEXTS = ["The house is wonderful.", "Hello world"]
MAX_OUTPUT_LEN = 12
#: dev/v1.1_beta's T5 config: the tokens generated when the request does not say (`max_decoding_seq_len`).
V1_DECODING_LENGTH = 528


def _parameter(text: str, key: str, value: str) -> str:
    """`text` with parameter `key`'s string_value replaced by `value`."""
    head, found, tail = text.partition(f'key: "{key}"')
    assert found, key
    before, _, after = tail.partition('string_value: "')
    return head + found + before + 'string_value: "' + value + after[after.index('"'):]


def _config(source: str, name: str, **parameters: str) -> str:
    text = (CONFIGS / source / "config.pbtxt").read_text().replace('name: "fastertransformer"', f'name: "{name}"', 1)
    for key, value in parameters.items():
        text = _parameter(text, key, value)
    return text


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """`all_models/` with one model per config generation, and broken models beside them."""
    ws = tmp_path_factory.mktemp("ft_workspace")
    build_generation_model("t5", ws / "t5-small")
    build_generation_model("gpt2", ws / "gpt2")
    repository = ws / "all_models" / "t5"
    # dev/v1.1_beta's T5: converted by dev/v5.0_beta's t5_ckpt_convert.py, 1-gpu/ moved up into 1/.
    v1_t5 = repository / "fastertransformer"
    converted = t5_ckpt_convert(ws / "t5-small", v1_t5 / "1", 1)
    for file in converted.iterdir():
        file.rename(v1_t5 / "1" / file.name)
    converted.rmdir()
    (v1_t5 / "config.pbtxt").write_text(_config("v1.1_beta/t5", "fastertransformer",
                                                model_checkpoint_path=str(v1_t5 / "1")))
    # dev/v1.1_beta's GPT: a Megatron checkpoint trained on two ranks, converted by dev/v5.0_beta's
    # megatron_ckpt_convert.py for two, the model's sizes in the config.
    gpt2 = transformers.GPT2LMHeadModel.from_pretrained(ws / "gpt2")
    megatron_ckpt_convert(megatron_gpt_checkpoint(gpt2, ws / "megatron", 2), repository / "gpt_v1" / "1", 2, 2)
    sizes = {"head_num": "4", "size_per_head": "16", "inter_size": "256", "vocab_size": str(gpt2.config.vocab_size),
             "decoder_layers": "2", "start_id": str(gpt2.config.bos_token_id),
             "end_id": str(gpt2.config.eos_token_id), "tensor_para_size": "2"}
    (repository / "gpt_v1" / "config.pbtxt").write_text(
        _config("v1.1_beta/gpt", "gpt_v1", model_checkpoint_path="1/2-gpu", **sizes))
    # main's T5 (its relative model_checkpoint_path found from the working directory) and GPT, over two ranks.
    huggingface_t5_ckpt_convert(ws / "t5-small", repository / "t5" / "1", 2, "fp16")
    (repository / "t5" / "config.pbtxt").write_text(_config("main/t5", "t5", model_checkpoint_path="1/2-gpu"))
    huggingface_gpt_convert(ws / "gpt2", repository / "gpt" / "1", 2)
    (repository / "gpt" / "config.pbtxt").write_text(_config("main/gpt", "gpt", model_checkpoint_path="1/2-gpu"))
    # Broken ones: each must be UNAVAILABLE with its reason while the rest serves.
    broken = {
        "missing_folder": ("main/t5", {"model_checkpoint_path": "1/nowhere"}),
        "missing_tensor": ("main/t5", {"model_checkpoint_path": "1/1-gpu"}),
        "wrong_size": ("main/t5", {"model_checkpoint_path": "1/1-gpu"}),
        "escaping": ("main/t5", {"model_checkpoint_path": "../../../outside/1-gpu"}),
        "bert": ("main/t5", {"model_type": "bert", "model_checkpoint_path": "1/1-gpu"}),
        "beams_model_wide": ("v1.1_beta/t5", {"beam_width": "4", "model_checkpoint_path": "1/1-gpu"}),
    }
    for name, (source, parameters) in broken.items():
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(_config(source, name, **parameters))
        if name != "missing_folder":
            huggingface_t5_ckpt_convert(ws / "t5-small", repository / name / "1", 1)
    (repository / "missing_tensor" / "1" / "1-gpu" / "decoder.block.1.layer.2.DenseReluDense.wo.weight.0.bin").unlink()
    truncated = repository / "wrong_size" / "1" / "1-gpu" / "encoder.final_layer_norm.weight.bin"
    truncated.write_bytes(truncated.read_bytes()[:-8])
    huggingface_t5_ckpt_convert(ws / "t5-small", ws / "outside", 1)
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


@pytest.fixture(scope="module")
def t5(workspace):
    tokenizer = transformers.AutoTokenizer.from_pretrained(workspace / "t5-small")
    return tokenizer, transformers.T5ForConditionalGeneration.from_pretrained(workspace / "t5-small").eval()


def _generate(model, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens)[0].tolist()


def _t5_tokens(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' tokens as FasterTransformer returns them: no decoder start token, up to the end token."""
    generated = _generate(model, ids, max_new_tokens)[1:]
    return generated[: generated.index(1) + 1] if 1 in generated else generated


def _tensor(module, name: str, array: np.ndarray):
    tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def _url(server, protocol) -> str:
    return f"127.0.0.1:{server.http_port if protocol is httpclient else server.grpc_port}"


@pytest.mark.parametrize("protocol", [httpclient, grpcclient])
def test_v1_t5_config_answers_the_tutorial_clients_tensors(server, t5, protocol):
    """dev/v1.1_beta's T5 config over dev/v5.0_beta's checkpoint: uint32 INPUT_ID [1, L] and REQUEST_INPUT_LEN
    [1, 1] (dims [-1]) in, OUTPUT0 [batch, beams, T] and OUTPUT1 [batch, beams] out, `max_decoding_seq_len` tokens
    at most, as the tutorial's client sends and reads them."""
    tokenizer, model = t5
    encoded = tokenizer(f"translate English to German: {TEXTS[0]}", return_tensors="np")
    ids = encoded.input_ids.astype(np.uint32)
    lengths = encoded.attention_mask.sum(1).astype(np.uint32).reshape([1, 1])
    with protocol.InferenceServerClient(_url(server, protocol)) as client:
        result = client.infer("fastertransformer", [_tensor(protocol, "INPUT_ID", ids),
                                                    _tensor(protocol, "REQUEST_INPUT_LEN", lengths)])
    output, length = result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1")
    assert output.dtype == np.uint32 and output.ndim == 3 and length.shape == (1, 1)
    assert output[0, 0, : length[0, 0]].tolist() == _t5_tokens(model, ids[0].tolist(), V1_DECODING_LENGTH)


@pytest.mark.parametrize("protocol", [httpclient, grpcclient])
def test_main_t5_config_over_two_float16_ranks(server, workspace, t5, protocol):
    """main's T5 config: `input_ids`, `sequence_length`, `max_output_len` and its decoding tensors, over the later
    converter's two-rank float16 files; the weights are float16-rounded, so the reference is too."""
    tokenizer, model = t5
    rounded = transformers.T5ForConditionalGeneration.from_pretrained(workspace / "t5-small").eval()
    with torch.no_grad():
        for parameter in rounded.parameters():
            parameter.copy_(parameter.half().float())
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
    with protocol.InferenceServerClient(_url(server, protocol)) as client:
        result = client.infer("t5", inputs)
    output_ids, lengths = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
    assert output_ids.dtype == np.int32 and lengths.dtype == np.int32 and lengths.shape == (batch, 1)
    for row in range(batch):
        ids = encoded.input_ids[row, : encoded.attention_mask[row].sum()].tolist()
        assert output_ids[row, 0, : lengths[row, 0]].tolist() == _t5_tokens(rounded, ids, MAX_OUTPUT_LEN)


@pytest.mark.parametrize("protocol", [httpclient, grpcclient])
def test_v1_gpt_config_without_config_ini(server, workspace, protocol):
    """dev/v1.1_beta's GPT config over megatron_ckpt_convert.py's two ranks: INPUT_ID [batch, 1, L] (dims
    [-1, -1]), REQUEST_INPUT_LEN, REQUEST_OUTPUT_LEN in; OUTPUT0 the prompt and its continuation."""
    model = transformers.GPT2LMHeadModel.from_pretrained(workspace / "gpt2").eval()
    prompt = [5, 17, 42, 8, 99]
    inputs = [
        _tensor(protocol, "INPUT_ID", np.array([[prompt]], np.uint32)),
        _tensor(protocol, "REQUEST_INPUT_LEN", np.array([[len(prompt)]], np.uint32)),
        _tensor(protocol, "REQUEST_OUTPUT_LEN", np.array([[8]], np.uint32)),
    ]
    with protocol.InferenceServerClient(_url(server, protocol)) as client:
        result = client.infer("gpt_v1", inputs)
    assert result.as_numpy("OUTPUT0")[0, 0].tolist() == _generate(model, prompt, 8)


def test_main_gpt_config_over_two_ranks(server, workspace):
    """main's GPT config: `input_lengths`, `request_output_len` in; the prompt and its continuation, and
    `response_input_lengths`, out."""
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
    length = result.as_numpy("sequence_length")[0, 0]
    assert result.as_numpy("output_ids")[0, 0, :length].tolist() == _generate(model, prompt, 8)
    assert result.as_numpy("response_input_lengths").tolist() == [[len(prompt)]]
    assert result.as_numpy("output_log_probs").shape == (1, 1, 8)
    assert result.as_numpy("context_embeddings") is None  # declared, never produced


@pytest.mark.parametrize(("model", "tensors"), [
    ("fastertransformer", lambda ids: [("INPUT_ID", ids), ("REQUEST_INPUT_LEN", np.array([[ids.shape[1]]],
                                                                                          np.uint32))]),
    ("t5", lambda ids: [("input_ids", ids), ("sequence_length", np.array([[ids.shape[1]]], np.uint32)),
                        ("max_output_len", np.array([[4]], np.uint32))]),
    ("gpt_v1", lambda ids: [("INPUT_ID", ids[:, None, :]), ("REQUEST_INPUT_LEN", np.array([[ids.shape[1]]],
                                                                                           np.uint32)),
                            ("REQUEST_OUTPUT_LEN", np.array([[4]], np.uint32))]),
])
@pytest.mark.parametrize("protocol", [httpclient, grpcclient])
def test_out_of_range_ids_are_a_400_and_the_request_beside_them_is_answered(server, workspace, model, tensors,
                                                                            protocol):
    folder = workspace / ("gpt2" if model == "gpt_v1" else "t5-small")
    vocabulary = transformers.AutoConfig.from_pretrained(folder).vocab_size
    good = np.array([[5, 6, 7]], np.uint32)
    answers: list[object] = []

    def send_good() -> None:
        with protocol.InferenceServerClient(_url(server, protocol)) as client:
            answers.append(client.infer(model, [_tensor(protocol, n, a) for n, a in tensors(good)]))

    beside = threading.Thread(target=send_good)
    beside.start()
    for bad in (vocabulary, 2**32 - 1, np.random.default_rng(0).integers(vocabulary, 2**31)):
        ids = np.array([[5, int(bad), 7]], np.uint32)
        with protocol.InferenceServerClient(_url(server, protocol)) as client, pytest.raises(
            InferenceServerException
        ) as caught:
            client.infer(model, [_tensor(protocol, n, a) for n, a in tensors(ids)])
        name = tensors(ids)[0][0]
        assert caught.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        assert f"input '{name}' holds token id {int(bad)}, outside this model's vocabulary [0, {vocabulary})" in (
            caught.value.message())
    beside.join(120)
    assert len(answers) == 1
    send_good()  # and the model still serves
    assert len(answers) == 2


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
        client.infer("t5", inputs)
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
        "beams_model_wide": "parameter 'beam_width' is 4: model-wide decoding parameters are served at 1 only",
    }
    for name, words in reasons.items():
        assert states[name]["state"] == "UNAVAILABLE", name
        assert words in states[name]["reason"], states[name]["reason"]
    assert "transerve convert" in states["bert"]["reason"]
    for name in ("fastertransformer", "gpt_v1", "t5", "gpt"):
        assert states[name]["state"] == "READY", name


def test_parameters_that_do_not_apply_are_logged_and_nothing_is_left_on_disk(server):
    assert "tensor_para_size=1, pipeline_para_size=1, enable_custom_all_reduce=0 do not apply" in server.log
    assert "data_type fp16 applies to KIND_GPU instances; KIND_CPU ones compute in float32" in server.log
    assert list(server.scratch.iterdir()) == []  # the converted folders are gone once the engines loaded
