"""A generation model's config parameters: defaults, the engine a model folder implies, and clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from transerve.backends.generation.settings import read_settings
from transerve.config.model_config import parse_config_text
from transerve.core.errors import ErrorCode, ServerError


def settings(version: Path, **parameters: str):
    lines = "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n' for k, v in parameters.items())
    return read_settings(parse_config_text(f'name: "gen"\nbackend: "generation"\n{lines}'), version)


def refused(version: Path, code: ErrorCode = ErrorCode.INVALID_ARG, **parameters: str) -> str:
    with pytest.raises(ServerError) as caught:
        settings(version, **parameters)
    assert caught.value.code is code
    return caught.value.message


@pytest.fixture
def version(tmp_path) -> Path:
    (tmp_path / "model").mkdir()
    return tmp_path


def test_defaults_and_the_engine_a_folder_implies(version):
    hf = settings(version)
    assert (hf.engine, hf.model_dir, hf.compute_type) == ("torch", version / "model", "float32")
    # max_batch_rows unset: the engine picks (16 on the CPU, sized from free memory on a GPU)
    assert (hf.intra_op_threads, hf.max_batch_rows, hf.kv_cache_tokens, hf.max_new_tokens) == (0, None, 65536, 64)
    assert hf.max_concurrent_calls == 2
    assert (hf.latency_threads, hf.latency_rows, hf.onednn_linear, hf.join_group) == (0, 1, True, 4)
    assert hf.cuda_graphs is True and hf.prefix_cache_tokens == 2048
    (version / "model" / "model.bin").write_bytes(b"")
    assert settings(version).engine == "ctranslate2"  # a converted CTranslate2 model
    assert settings(version, engine="torch").engine == "torch"


def test_values_are_read(version):
    (version / "weights").mkdir()
    read = settings(version, model_dir="weights", engine="ctranslate2", compute_type="int8_float16",
                    intra_op_threads="2", max_batch_rows="32", max_new_tokens="128", max_concurrent_calls="3",
                    latency_threads="4", latency_rows="2", onednn_linear="False", join_group="8",
                    cuda_graphs="false", prefix_cache_tokens="0", unknown_key="ignored")
    assert read.max_concurrent_calls == 3 and read.onednn_linear is False and read.cuda_graphs is False
    assert read.prefix_cache_tokens == 0
    assert (read.latency_threads, read.latency_rows, read.join_group) == (4, 2, 8)
    assert read.model_dir == version / "weights"
    assert (read.compute_type, read.intra_op_threads, read.max_batch_rows, read.max_new_tokens) == (
        "int8_float16", 2, 32, 128)


@pytest.mark.parametrize(
    ("parameters", "words"),
    [
        ({"engine": "vllm"}, "parameter 'engine' is 'vllm'; it must be one of ctranslate2, torch"),
        ({"engine": "torch", "compute_type": "int8"}, "the torch engine takes float32, float16, bfloat16"),
        ({"max_batch_rows": "many"}, "parameter 'max_batch_rows' must be an integer, got 'many'"),
        ({"max_batch_rows": "0"}, "parameter 'max_batch_rows' must be at least 1, got 0"),
        ({"intra_op_threads": "-1"}, "parameter 'intra_op_threads' must be at least 0"),
        ({"latency_threads": "two"}, "parameter 'latency_threads' must be an integer, got 'two'"),
        ({"onednn_linear": "yes"}, "parameter 'onednn_linear' must be true or false, got 'yes'"),
        ({"cuda_graphs": "1"}, "parameter 'cuda_graphs' must be true or false, got '1'"),
        ({"max_new_tokens": "0"}, "parameter 'max_new_tokens' must be at least 1"),
        ({"join_group": "0"}, "parameter 'join_group' must be at least 1, got 0"),
        ({"max_concurrent_calls": "0"}, "parameter 'max_concurrent_calls' must be at least 1"),
        ({"prefix_cache_tokens": "-1"}, "parameter 'prefix_cache_tokens' must be at least 0, got -1"),
    ],
)
def test_bad_values_are_refused_with_the_reason(version, parameters, words):
    assert words in refused(version, **parameters)


def test_a_missing_model_folder_makes_the_model_unavailable(tmp_path):
    message = refused(tmp_path, ErrorCode.UNAVAILABLE, model_dir="nowhere")
    assert f"model directory '{tmp_path / 'nowhere'}' not found" in message


@pytest.mark.parametrize("name", ["/usr", "../../elsewhere", "link"])
def test_a_model_folder_outside_the_models_is_refused(tmp_path, name):
    version = tmp_path / "gen" / "1"
    version.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (version / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert "parameter model_dir" in refused(version, model_dir=name)
    config = parse_config_text(f'name: "gen"\nbackend: "generation"\ndefault_model_filename: "{name}"')
    with pytest.raises(ServerError, match="default_model_filename"):
        read_settings(config, version)
