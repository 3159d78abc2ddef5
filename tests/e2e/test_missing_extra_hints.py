"""A missing optional package is one line naming the extra that brings it, never a traceback: in `transerve
convert`, `transerve export` and `transerve perf --plot`, in the python models convert and export write (loaded by
a server whose `tokenizers` cannot be imported), in LightSeq's HDF5 reader and in the OpenAI layer's tokenizer.
Each missing module is simulated (`sys.modules` set to None, in a subprocess or by monkeypatch, or a module on
PYTHONPATH that fails to import), so this machine's installation is untouched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from support import start_transerve

from transerve.core.extras import MissingExtra, import_optional

SRC = Path(__file__).resolve().parents[2] / "src"


def transerve_without(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`transerve ARGS` in a process where `module` cannot be imported."""
    code = (f"import sys; sys.modules[{module!r}] = None; from transerve.cli import main; "
            f"sys.exit(main({list(args)!r}))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def model_folder(path: Path, model_type: str) -> Path:
    """Enough of a Hugging Face folder to pass the checks made before any library is imported."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    (path / "model.safetensors").write_bytes(b"")
    (path / "tokenizer.json").write_text("{}")
    return path


def test_import_optional_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(MissingExtra) as caught:
        import_optional("tokenizers", "generation")
    assert str(caught.value).startswith("tokenizers is not installed (")
    assert str(caught.value).endswith("): pip install 'transerve[generation]'")
    assert isinstance(caught.value, ImportError)


#: Each command's optional modules, in the order it imports them: the hint names the first one missing.
COMMAND_MODULES = {"convert": ("ctranslate2", "transformers"), "export": ("torch", "onnxruntime")}


@pytest.mark.parametrize(("command", "module", "extra"), [
    ("convert", "ctranslate2", "generation"),
    ("convert", "transformers", "generation"),
    ("export", "torch", "export"),
    ("export", "onnxruntime", "export"),
])
def test_the_commands_print_one_line_naming_the_extra(tmp_path: Path, command, module, extra):
    modules = COMMAND_MODULES[command]
    for earlier in modules[:modules.index(module)]:  # only `module` may be the missing one
        pytest.importorskip(earlier)
    folder = model_folder(tmp_path / "model", "t5" if command == "convert" else "bert")
    args = ["--output", str(tmp_path / "out")]
    args += ["--task", "seqcls", "--format", "onnx"] if command == "export" else []
    result = transerve_without(module, command, str(folder), *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith(f"transerve {command}:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert errors[0].startswith(f"transerve {command}: {module} is not installed (")
    assert errors[0].endswith(f"): pip install 'transerve[{extra}]'")


def test_perf_plot_names_the_extra(tmp_path: Path):
    # transerve perf is a client that imports nothing of the server's (so not core.extras): its own line.
    result = transerve_without("matplotlib", "perf", "-m", "add_sub", "-u", "127.0.0.1:1", "--plot",
                               str(tmp_path / "plot.png"), cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        "transerve perf: --plot needs matplotlib: pip install 'transerve[perf]'"]


def test_lightseq_hdf5_files_name_the_extra(tmp_path: Path, monkeypatch):
    from transerve.backends.lightseq.weights import FormatError, read

    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(FormatError) as caught:
        read(tmp_path / "model.hdf5", "Transformer")
    assert str(caught.value).startswith("reading LightSeq's HDF5 files: h5py is not installed (")
    assert str(caught.value).endswith("): pip install 'transerve[lightseq]'")


def test_the_openai_tokenizer_names_the_extra(tmp_path: Path, monkeypatch):
    from transerve.frontends.http.openai.text import TextTokenizer

    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(MissingExtra, match=r"pip install 'transerve\[generation\]'"):
        TextTokenizer(tmp_path)


PYTHON_MODEL = """name: "{name}"
backend: "python"
max_batch_size: 8
input {{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }}
output {{ name: "OUT" data_type: TYPE_INT64 dims: [ -1 ] }}
"""


def test_python_models_without_tokenizers_are_unavailable_naming_the_extra(tmp_path: Path, monkeypatch):
    sources = SRC / "transerve"
    models = {"export_tokenizer": (sources / "export/models/tokenizer.py", "export"),
              "convert_tokenizer": (sources / "convert/models/tokenizer.py", "generation"),
              "convert_detokenizer": (sources / "convert/models/detokenizer.py", "generation")}
    repository = tmp_path / "repository"
    for name, (source, _) in models.items():
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(PYTHON_MODEL.format(name=name))
        shutil.copyfile(source, repository / name / "1" / "model.py")
    shadow = tmp_path / "shadow"  # a `tokenizers` that fails as a missing one does, ahead of the installed one
    shadow.mkdir()
    (shadow / "tokenizers.py").write_text("raise ModuleNotFoundError(\"No module named 'tokenizers'\")\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")])))
    with start_transerve(repository, "--strict-readiness=false") as server:
        index = requests.post(f"{server.base_url}/v2/repository/index", json={}, timeout=30).json()
    reasons = {entry["name"]: entry for entry in index}
    for name, (_, extra) in models.items():
        assert reasons[name]["state"] == "UNAVAILABLE"
        reason = reasons[name]["reason"]
        assert "tokenizers is not installed (No module named 'tokenizers')" in reason, reason
        assert f"pip install 'transerve[{extra}]'" in reason and "Traceback" not in reason, reason
