"""`transerve export`: what it refuses, what it writes for every task and format, and what it shows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format
from support.hf_models import EXPORTS, LABELS
from tritonclient.grpc import model_config_pb2

from transerve.export.command import export
from transerve.export.hf import ExportError, read_folder

SRC = Path(__file__).resolve().parents[2] / "src"


def config_of(repository: Path, name: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse((repository / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "transerve", "export", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_folders_that_are_not_hugging_face_models_are_refused_in_one_line(tmp_path: Path, model_folders):
    (tmp_path / "empty").mkdir()
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "bert"}))
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(model_folders["seqcls"], no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    cases = {
        tmp_path / "nowhere": "no such folder",
        tmp_path / "empty": "it has no config.json with a model_type",
        no_weights: "it has no weights (model.safetensors, pytorch_model.bin)",
        no_tokenizer: "has no tokenizer.json (a fast tokenizer)",
    }
    for folder, reason in cases.items():
        with pytest.raises(ExportError) as caught:
            read_folder(folder)
        assert reason in str(caught.value) and "\n" not in str(caught.value)
    result = cli(str(tmp_path / "empty"), "--task", "seqcls", "--format", "onnx", "--output", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"transerve export: '{tmp_path / 'empty'}' is not a Hugging Face model folder: it has no config.json "
        "with a model_type"]
    assert not (tmp_path / "out").exists()


def test_an_export_never_overwrites_a_model(exported_repository: Path, model_folders):
    with pytest.raises(ExportError, match="already exists: choose another --output or --name"):
        export(model_folders["seqcls"], "seqcls", "onnx", exported_repository, "seqcls_onnx")


def test_the_cli_shows_its_progress_and_writes_a_complete_repository(tmp_path: Path, model_folders):
    result = cli(str(model_folders["seqcls"]), "--task", "seqcls", "--format", "torchscript", "--output",
                 str(tmp_path / "repo"), "--max-batch-size", "4", "--dynamic-batching")
    assert result.returncode == 0, result.stderr
    steps = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert [step.split("]")[0] + "]" for step in steps] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert all(step.endswith(" s") for step in steps), steps
    assert "largest difference" in result.stderr
    written = sorted(path.relative_to(tmp_path / "repo").as_posix() for path in (tmp_path / "repo").rglob("*")
                     if path.is_file())
    assert written == [
        "seqcls/config.pbtxt", "seqcls/labels.txt",
        "seqcls_model/1/model.pt", "seqcls_model/config.pbtxt",
        "seqcls_postprocess/1/model.py", "seqcls_postprocess/config.pbtxt", "seqcls_postprocess/labels.txt",
        "seqcls_tokenizer/1/model.py", "seqcls_tokenizer/1/tokenizer.json", "seqcls_tokenizer/config.pbtxt",
    ]
    for name in ("seqcls", "seqcls_model", "seqcls_postprocess", "seqcls_tokenizer"):
        config = config_of(tmp_path / "repo", name)
        assert config.max_batch_size == 4
        assert config.HasField("dynamic_batching") == (name != "seqcls")


@pytest.mark.parametrize("name", list(EXPORTS))
def test_every_task_and_format_writes_its_models(exported_repository: Path, name: str):
    _, task, fmt, options = EXPORTS[name]
    ensemble = config_of(exported_repository, name)
    steps = [step.model_name for step in ensemble.ensemble_scheduling.step]
    expected = [f"{name}_tokenizer", f"{name}_model"] + ([f"{name}_postprocess"] if task != "encode" else [])
    assert steps == expected
    model = config_of(exported_repository, f"{name}_model")
    assert model.platform == ("onnxruntime_onnx" if fmt == "onnx" else "pytorch_libtorch")
    assert (exported_repository / f"{name}_model" / "1" / ("model.onnx" if fmt == "onnx" else "model.pt")).is_file()
    outputs = {"embedding": ["embedding"], "seqcls": ["label", "score", "probabilities", "logits"],
               "qa": ["answer", "score", "start", "end", "start_logits", "end_logits"],
               "encode": ["last_hidden_state", "attention_mask"]}
    assert [output.name for output in ensemble.output] == outputs[task]
    assert model.HasField("dynamic_batching") == bool(options)
    bucketed = model.parameters["batching_strategy"].string_value == "bucketed"
    assert bucketed == options.get("bucketed", False)
    if task == "seqcls":
        assert json.loads(config_of(exported_repository, f"{name}_postprocess").parameters["labels"].string_value) \
            == LABELS
        for folder in (f"{name}_postprocess", name):  # `probabilities` names its labels, for class_count
            (probabilities,) = [o for o in config_of(exported_repository, folder).output if o.name == "probabilities"]
            labels = exported_repository / folder / probabilities.label_filename
            assert labels.read_text(encoding="utf-8").splitlines() == LABELS
    if task == "embedding":
        tokenizer = config_of(exported_repository, f"{name}_tokenizer")
        assert tokenizer.parameters["max_length"].string_value == "256"  # sentence-transformers' limit
        openai = {key: value.string_value for key, value in ensemble.parameters.items() if key.startswith("openai_")}
        assert openai == {"openai_api": "embeddings", "openai_text_input": "input_text",
                          "openai_embedding_output": "embedding", "openai_context_length": "256"}
    else:
        assert not any(key.startswith("openai_") for key in ensemble.parameters)


def test_model_instances_give_the_onnx_model_one_thread_sessions_side_by_side(tmp_path: Path, model_folders):
    export(model_folders["seqcls"], "seqcls", "onnx", tmp_path, "many", model_instances=2)
    model = config_of(tmp_path, "many_model")
    assert [(group.count, group.kind) for group in model.instance_group] == [
        (2, model_config_pb2.ModelInstanceGroup.KIND_CPU)]
    assert model.parameters["intra_op_thread_count"].string_value == "1"
    assert not config_of(tmp_path, "many_tokenizer").parameters.get("intra_op_thread_count")
    with pytest.raises(ExportError, match="--model-instances .* for --format onnx only"):
        export(model_folders["seqcls"], "seqcls", "torchscript", tmp_path / "ts", "ts", model_instances=2)
    assert not (tmp_path / "ts").exists()
