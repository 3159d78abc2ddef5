"""FasterTransformer checkpoint folders read back into Hugging Face models: the weights come back equal from every
converter generation (dev/v5.0_beta's t5_ckpt_convert.py, the later huggingface_t5_ckpt_convert.py, the GPT
converters with and without config.ini, Megatron's split and merged), one and two tensor-parallel ranks, float32 and
float16 files; a broken folder fails naming what is wrong; and the folder a config names is found where
FasterTransformer's backend finds it, inside the repository. The folders are written by
tests/support/ft_checkpoints.py and ft_megatron.py, which redo each converter script step by step."""

from __future__ import annotations

import configparser
from pathlib import Path

import numpy as np
import pytest
from support.ft_checkpoints import (
    huggingface_gpt_convert,
    huggingface_jp_gpt_convert,
    huggingface_t5_ckpt_convert,
    t5_ckpt_convert,
)
from support.ft_megatron import megatron_ckpt_convert, megatron_gpt_checkpoint
from support.generation_models import build_generation_model
from tritonclient.grpc import model_config_pb2

from transerve.backends.base import ModelContext
from transerve.backends.generation.fastertransformer.backend import checkpoint_folder
from transerve.backends.generation.fastertransformer.checkpoint import read_checkpoint
from transerve.core.errors import ErrorCode, ServerError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

#: fastertransformer_backend dev/v1.1_beta's GPT config gives the sizes where the converter wrote no config.ini.
V1_GPT_PARAMETERS = {"head_num": "4", "size_per_head": "16", "inter_size": "256", "vocab_size": "{vocab}",
                     "decoder_layers": "2", "start_id": "{bos}", "end_id": "{eos}"}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {"T5": build_generation_model("t5", root / "t5"), "GPT": build_generation_model("gpt2", root / "gpt2")}


@pytest.fixture(scope="module")
def hf_models(hf_dirs) -> dict[str, object]:
    return {
        "T5": transformers.T5ForConditionalGeneration.from_pretrained(hf_dirs["T5"]).eval(),
        "GPT": transformers.GPT2LMHeadModel.from_pretrained(hf_dirs["GPT"]).eval(),
    }


def _convert(converter: str, hf_dirs, tmp_path: Path, ranks: int, weight_data_type: str = "fp32") -> Path:
    if converter == "t5_ckpt_convert":
        return t5_ckpt_convert(hf_dirs["T5"], tmp_path, ranks)
    if converter == "huggingface_t5_ckpt_convert":
        return huggingface_t5_ckpt_convert(hf_dirs["T5"], tmp_path, ranks, weight_data_type)
    if converter.startswith("huggingface_gpt_convert"):
        version = converter.split("@")[1]
        return huggingface_gpt_convert(hf_dirs["GPT"], tmp_path, ranks, weight_data_type, version=version)
    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dirs["GPT"])
    if converter.startswith("megatron_ckpt_convert"):
        trained = int(converter.split("@t")[1])
        megatron = megatron_gpt_checkpoint(model, tmp_path / "megatron", trained)
        return megatron_ckpt_convert(megatron, tmp_path, trained, ranks)
    state = tmp_path / "gpt2.pt"
    torch.save(model.state_dict(), state)
    return huggingface_jp_gpt_convert(state, tmp_path, ranks)


def _v1_parameters(model) -> dict[str, str]:
    config = model.config
    values = {"vocab": config.vocab_size, "bos": config.bos_token_id, "eos": config.eos_token_id}
    return {key: value.format(**values) for key, value in V1_GPT_PARAMETERS.items()}


CONVERTERS = {
    "t5_ckpt_convert": "T5", "huggingface_t5_ckpt_convert": "T5", "huggingface_gpt_convert@v5.0": "GPT",
    "huggingface_gpt_convert@main": "GPT", "huggingface_jp_gpt_convert": "GPT",
    # trained on one rank (split further) and on two (joined, or split by 1)
    "megatron_ckpt_convert@t1": "GPT", "megatron_ckpt_convert@t2": "GPT",
}
#: Converters that write no config.ini.
WITHOUT_INI = ("huggingface_jp_gpt_convert", "megatron_ckpt_convert@t1", "megatron_ckpt_convert@t2")


@pytest.mark.parametrize("converter", list(CONVERTERS))
@pytest.mark.parametrize("tensor_para_size", [1, 2])
def test_weights_come_back_equal(hf_dirs, hf_models, tmp_path, converter, tensor_para_size):
    model_type = CONVERTERS[converter]
    original = hf_models[model_type]
    folder = _convert(converter, hf_dirs, tmp_path, tensor_para_size)
    assert folder == tmp_path / f"{tensor_para_size}-gpu"
    assert (folder / "config.ini").is_file() is (converter not in WITHOUT_INI)
    read = read_checkpoint(folder, model_type, _v1_parameters(original) if model_type == "GPT" else {})
    assert type(read) is type(original)
    expected, got = original.state_dict(), read.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert read.generate(ids, max_new_tokens=8).tolist() == original.generate(ids, max_new_tokens=8).tolist()


@pytest.mark.parametrize("converter", ["huggingface_t5_ckpt_convert", "huggingface_gpt_convert@v5.0",
                                       "huggingface_gpt_convert@main"])
def test_float16_files_hold_the_weights_rounded(hf_dirs, hf_models, tmp_path, converter):
    original = hf_models[CONVERTERS[converter]]
    read = read_checkpoint(_convert(converter, hf_dirs, tmp_path, 2, "fp16"), CONVERTERS[converter])
    for name, tensor in original.state_dict().items():
        assert torch.equal(read.state_dict()[name], tensor.half().float()), name


def test_the_v5_beta_t5_layout_is_its_converters(hf_dirs, hf_models, tmp_path):
    """dev/v5.0_beta's t5_ckpt_convert.py: the Hugging Face keys unrenamed, no weight_data_type, the decoder's
    self-attention fused, shared.weight_T.bin, no lm_head.weight.bin; split ranks transposed halves."""
    folder = _convert("t5_ckpt_convert", hf_dirs, tmp_path, 2)
    ini = configparser.ConfigParser()
    ini.read(folder / "config.ini")
    assert ini["encoder"]["relative_attention_num_buckets"] == "32" and "weight_data_type" not in ini["encoder"]
    assert ini["decoder"]["is_decoder"] == "True" and not ini.has_section("structure")
    config = hf_models["T5"].config
    d, inner = config.d_model, config.num_heads * config.d_kv
    q = np.fromfile(folder / "encoder.block.0.layer.0.SelfAttention.q.weight.1.bin", np.float32)
    expected = hf_models["T5"].state_dict()["encoder.block.0.layer.0.SelfAttention.q.weight"].numpy().T[:, inner // 2:]
    assert np.array_equal(q.reshape(d, inner // 2), expected)
    assert (folder / "decoder.block.1.layer.0.SelfAttention.qkv.weight.1.bin").is_file()
    assert not (folder / "decoder.block.1.layer.0.SelfAttention.q.weight.0.bin").exists()
    assert (folder / "shared.weight_T.bin").is_file() and not (folder / "lm_head.weight.bin").exists()


def test_the_later_t5_layout_is_its_converters(hf_dirs, tmp_path):
    folder = _convert("huggingface_t5_ckpt_convert", hf_dirs, tmp_path, 1, "fp16")
    ini = configparser.ConfigParser()
    ini.read(folder / "config.ini")
    assert ini["encoder"]["relative_attention_num_buckets_or_max_pos_seq_len"] == "32"
    assert ini["decoder"]["weight_data_type"] == "fp16" and ini["structure"]["t5_with_bias"] == "false"
    assert (folder / "lm_head.weight.bin").is_file() and (folder / "shared.weight_T.bin").is_file()


def test_a_gpt_checkpoint_without_config_ini_needs_the_sizes(hf_dirs, tmp_path):
    folder = _convert("huggingface_jp_gpt_convert", hf_dirs, tmp_path, 1)
    with pytest.raises(ServerError, match="the model config's parameters .the checkpoint has no config.ini. "
                                          "has no 'head_num'"):
        read_checkpoint(folder, "GPT", {})


def _broken(folder: Path, how: str) -> None:
    if how == "missing tensor file":
        (folder / "model.layers.1.mlp.dense_4h_to_h.weight.0.bin").unlink()
    elif how == "wrong size file":
        path = folder / "model.layers.0.attention.dense.bias.bin"
        path.write_bytes(path.read_bytes()[:-4])
    elif how == "missing config.ini":
        (folder / "config.ini").unlink()


@pytest.mark.parametrize(("how", "says"), [
    ("missing tensor file", "no tensor file 'model.layers.1.mlp.dense_4h_to_h.weight.0.bin'"),
    ("wrong size file", "model.layers.0.attention.dense.bias.bin' holds 252 bytes; shape [64] in float32"),
    ("missing config.ini", "has no config.ini) has no 'head_num'"),
])
def test_a_broken_checkpoint_names_what_is_wrong(hf_dirs, tmp_path, how, says):
    folder = _convert("huggingface_gpt_convert@main", hf_dirs, tmp_path, 1)
    _broken(folder, how)
    with pytest.raises(ServerError) as caught:
        read_checkpoint(folder, "GPT")
    assert caught.value.code is ErrorCode.UNAVAILABLE and says in caught.value.message


def test_a_missing_folder_and_another_model_type_are_refused(hf_dirs, tmp_path):
    with pytest.raises(ServerError, match="does not exist"):
        read_checkpoint(tmp_path / "nowhere", "T5")
    folder = _convert("huggingface_t5_ckpt_convert", hf_dirs, tmp_path, 1)
    with pytest.raises(ServerError, match=r"no \[gpt\] section"):
        read_checkpoint(folder, "GPT")


def _context(repository: Path, parameters: dict[str, str], default_model_filename: str = "") -> ModelContext:
    config = model_config_pb2.ModelConfig(name="ft", default_model_filename=default_model_filename)
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    model = repository / "ft"
    return ModelContext("ft", "1", model, model / "1", repository, config)


def test_the_checkpoint_folder_is_found_as_fastertransformer_finds_it(tmp_path, monkeypatch):
    repository = tmp_path / "all_models" / "t5"
    for name in ("1-gpu", "2-gpu", "t5"):
        (repository / "ft" / "1" / name).mkdir(parents=True)
    # no model_checkpoint_path: <version>/<default_model_filename>, else <version>/<tensor_para_size>-gpu
    assert checkpoint_folder(_context(repository, {}, "t5"), {}) == repository / "ft" / "1" / "t5"
    assert checkpoint_folder(_context(repository, {}), {"tensor_para_size": "2"}) == repository / "ft" / "1" / "2-gpu"
    # relative to the model's folder; else to the working directory (the FasterTransformer tutorial's way)
    assert checkpoint_folder(_context(repository, {}), {"model_checkpoint_path": "1/1-gpu"}) == (
        repository / "ft" / "1" / "1-gpu")
    monkeypatch.chdir(tmp_path)
    relative = "./all_models/t5/ft/1/1-gpu/"
    assert checkpoint_folder(_context(repository, {}), {"model_checkpoint_path": relative}).resolve() == (
        repository / "ft" / "1" / "1-gpu").resolve()
    absolute = str(repository / "ft" / "1" / "2-gpu")
    assert checkpoint_folder(_context(repository, {}), {"model_checkpoint_path": absolute}) == Path(absolute)


@pytest.mark.parametrize("path", ["../../outside", "{tmp}/outside", "./outside"])
def test_a_checkpoint_outside_the_repository_is_refused(tmp_path, monkeypatch, path):
    repository = tmp_path / "repo"
    (repository / "ft" / "1").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ServerError, match="leads outside the model repository") as caught:
        checkpoint_folder(_context(repository, {}), {"model_checkpoint_path": path.format(tmp=tmp_path)})
    assert caught.value.code is ErrorCode.INVALID_ARG


def test_a_missing_checkpoint_folder_says_where_it_looked(tmp_path):
    repository = tmp_path / "repo"
    (repository / "ft" / "1").mkdir(parents=True)
    with pytest.raises(ServerError, match="does not exist") as caught:
        checkpoint_folder(_context(repository, {}), {"model_checkpoint_path": "1/1-gpu"})
    assert str(repository / "ft" / "1" / "1-gpu") in caught.value.message
    with pytest.raises(ServerError, match="'<tensor_para_size>-gpu'"):
        checkpoint_folder(_context(repository, {}), {})


def test_parameters_translate_as_fastertransformer_means_them():
    from transerve.backends.base import Placement
    from transerve.backends.generation.fastertransformer.backend import _data_type, _model_type, _on
    from transerve.backends.generation.settings import GenerationSettings

    assert _model_type({}) == "GPT" and _model_type({"model_type": "T5"}) == "T5"
    for unsupported in ("bert", "GPT-J", "T5-Encoder"):
        with pytest.raises(ServerError, match="reads T5 and GPT checkpoints.*transerve convert") as caught:
            _model_type({"model_type": unsupported})
        assert caught.value.code is ErrorCode.UNAVAILABLE
    assert [_data_type({"data_type": t}) for t in ("fp32", "fp16", "bf16")] == ["float32", "float16", "bfloat16"]
    assert (_data_type({"is_half": "1"}), _data_type({"is_half": "0"}), _data_type({})) == (
        "float16", "float32", "float32")
    with pytest.raises(ServerError, match="'data_type' is 'int4'"):
        _data_type({"data_type": "int4"})
    settings = GenerationSettings("torch", Path("m"), "float16", 0, None, 2, 65536, 64, None)
    assert _on(Placement("g", "GPU", 0), settings, explicit=False).compute_type == "float16"
    assert _on(Placement("c", "CPU", 0), settings, explicit=False).compute_type == "float32"
    assert _on(Placement("c", "CPU", 0), settings, explicit=True).compute_type == "float16"
