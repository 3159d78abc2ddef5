"""FasterTransformer checkpoint folders read back into Hugging Face models: the weights come back equal, for T5 and
GPT-2, one and two tensor-parallel ranks, float32 and float16 files; a broken folder fails naming what is wrong;
and the folder a config names is found where FasterTransformer's backend finds it, inside the repository."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.ft_checkpoints import write_gpt_checkpoint, write_t5_checkpoint
from support.generation_models import build_generation_model
from tritonclient.grpc import model_config_pb2

from transerve.backends.base import ModelContext
from transerve.backends.generation.fastertransformer import checkpoint_folder
from transerve.backends.generation.ft_checkpoint import read_checkpoint
from transerve.core.errors import ErrorCode, ServerError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WRITERS = {"T5": ("t5", write_t5_checkpoint), "GPT": ("gpt2", write_gpt_checkpoint)}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("hf")
    t5 = build_generation_model("t5", root / "t5")
    gpt2 = build_generation_model("gpt2", root / "gpt2")
    return {
        "T5": transformers.T5ForConditionalGeneration.from_pretrained(t5).eval(),
        "GPT": transformers.GPT2LMHeadModel.from_pretrained(gpt2).eval(),
    }


@pytest.mark.parametrize("model_type", ["T5", "GPT"])
@pytest.mark.parametrize("tensor_para_size", [1, 2])
def test_weights_come_back_equal(hf_models, tmp_path, model_type, tensor_para_size):
    original = hf_models[model_type]
    folder = WRITERS[model_type][1](original, tmp_path, tensor_para_size)
    assert folder == tmp_path / f"{tensor_para_size}-gpu" and (folder / "config.ini").is_file()
    read = read_checkpoint(folder, model_type)
    assert type(read) is type(original)
    expected, got = original.state_dict(), read.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert read.generate(ids, max_new_tokens=8).tolist() == original.generate(ids, max_new_tokens=8).tolist()


def test_float16_files_hold_the_weights_rounded(hf_models, tmp_path):
    original = hf_models["GPT"]
    read = read_checkpoint(write_gpt_checkpoint(original, tmp_path, 2, "fp16"), "GPT")
    for name, tensor in original.state_dict().items():
        assert torch.equal(read.state_dict()[name], tensor.half().float()), name


def test_the_t5_layout_is_fastertransformers(hf_models, tmp_path):
    """The names, transposes and splits FasterTransformer's T5 converter writes."""
    folder = write_t5_checkpoint(hf_models["T5"], tmp_path, 2)
    config = hf_models["T5"].config
    d, inner = config.d_model, config.num_heads * config.d_kv
    q = np.fromfile(folder / "encoder.block.0.layer.0.SelfAttention.q.weight.1.bin", np.float32)
    assert q.size == d * inner // 2  # [d_model, inner / 2]: transposed, the second half of the heads
    expected = hf_models["T5"].state_dict()["encoder.block.0.layer.0.SelfAttention.q.weight"].numpy().T[:, inner // 2:]
    assert np.array_equal(q.reshape(d, inner // 2), expected)
    assert (folder / "decoder.block.1.layer.0.SelfAttention.qkv.weight.0.bin").is_file()
    assert (folder / "shared.weight_T.bin").is_file() and (folder / "lm_head.weight.bin").is_file()


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
    ("missing config.ini", "has no config.ini"),
])
def test_a_broken_checkpoint_names_what_is_wrong(hf_models, tmp_path, how, says):
    folder = write_gpt_checkpoint(hf_models["GPT"], tmp_path)
    _broken(folder, how)
    with pytest.raises(ServerError) as caught:
        read_checkpoint(folder, "GPT")
    assert caught.value.code is ErrorCode.UNAVAILABLE and says in caught.value.message


def test_a_missing_folder_and_another_model_type_are_refused(hf_models, tmp_path):
    with pytest.raises(ServerError, match="does not exist"):
        read_checkpoint(tmp_path / "nowhere", "T5")
    folder = write_t5_checkpoint(hf_models["T5"], tmp_path)
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
    from transerve.backends.generation.fastertransformer import _data_type, _model_type, _on
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
