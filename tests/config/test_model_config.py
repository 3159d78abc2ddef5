"""config.pbtxt into Triton's ModelConfig, with Triton's defaults and load-time checks."""

import json

import pytest

from transerve.config.model_config import (
    ConfigError,
    complete_backend_fields,
    normalize,
    parse_config_json,
    parse_config_text,
    to_json,
    validate,
)


def loaded(text: str, name: str = "m"):
    config = parse_config_text(text)
    normalize(config, name)
    validate(config, name)
    return config


def test_defaults_match_triton():
    config = json.loads(to_json(loaded('backend: "python" max_batch_size: 2 '
                                       'input [{name: "A" data_type: TYPE_FP32 dims: [4]}] '
                                       'output [{name: "B" data_type: TYPE_STRING dims: [-1]}]')))
    assert config["name"] == "m"
    assert config["version_policy"] == {"latest": {"num_versions": 1}}
    assert config["default_model_filename"] == "model.py"
    assert config["instance_group"][0]["name"] == "m" and config["instance_group"][0]["kind"] == "KIND_CPU"
    assert config["instance_group"][0]["count"] == 1
    assert config["input"][0]["dims"] == [4]  # int64 printed as numbers, as Triton does
    assert config["output"][0]["data_type"] == "TYPE_STRING"
    assert list(config)[:3] == ["name", "platform", "backend"]


def test_named_groups_get_indexed_names():
    config = loaded('backend: "python" instance_group [{count: 2}, {kind: KIND_CPU}]')
    assert [g.name for g in config.instance_group] == ["m_0", "m_1"]
    assert [g.count for g in config.instance_group] == [2, 1]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('name: "other" backend: "python"', "must match the folder name 'm'"),
        ("max_batch_size: 1", "names neither a backend nor a platform"),
        ('backend: "python" input [{name: "A" dims: [1]}]', "has no data_type"),
        ('backend: "python" input [{name: "A" data_type: TYPE_FP32 dims: [1]}, '
         '{name: "A" data_type: TYPE_FP32 dims: [1]}]', "declared twice"),
        ('backend: "python" input [{name: "A" data_type: TYPE_FP32 dims: [-2]}]', "invalid dimension"),
        ('backend: "python" input [{name: "A" data_type: TYPE_FP32 dims: [4] reshape: {shape: [3]}}]',
         "different element count"),
    ],
)
def test_invalid_configs_give_one_line_reasons(text, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        loaded(text)


def test_parse_errors_say_where():
    with pytest.raises(ConfigError, match="failed to parse"):
        parse_config_text('backend: "python" max_batch_size: "eight"')
    with pytest.raises(ConfigError, match="JSON model config"):
        parse_config_json("{not json")


def test_json_config_override():
    config = parse_config_json('{"backend": "python", "max_batch_size": 4}')
    assert config.max_batch_size == 4


@pytest.mark.parametrize(("files", "text", "backend", "platform"), [
    (["1/model.py"], "", "python", ""),
    (["1/model.onnx", "1/model.py"], "", "onnxruntime", "onnxruntime_onnx"),  # Triton looks for ONNX first
    (["1/model.plan", "1/model.onnx"], "", "tensorrt", "tensorrt_plan"),
    (["1/model.pt"], "", "pytorch", "pytorch_libtorch"),
    (["1/other.py"], 'default_model_filename: "model.py"', "python", ""),
    (["1/model.py"], 'default_model_filename: "mine.py"', "", ""),  # a file of its own name reveals nothing
    (["1/model.py"], 'backend: "onnxruntime"', "onnxruntime", "onnxruntime_onnx"),
])
def test_backend_found_from_model_files_as_triton(tmp_path, files, text, backend, platform):
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    config = parse_config_text(text)
    complete_backend_fields(config, tmp_path)
    assert (config.backend, config.platform) == (backend, platform)
