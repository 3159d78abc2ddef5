"""Model repositories and requests more than one benchmark serves: the three-step ensemble of identity python models,
and the add_sub example loaded in process through the python backend (no server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from benchmarks.common.results import REPO_ROOT

if TYPE_CHECKING:
    from transerve.backends.base import ModelContext
    from transerve.core.types import InferRequest

EXAMPLES = REPO_ROOT / "examples" / "model_repository"

STEPS = 3
PASSTHROUGH = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT", pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy())]) for r in requests]
'''


def write_chain_repository(root: Path) -> None:
    """`pass_1..3` (identity on FP32 [4]) and `chain`, an ensemble running them one after another."""
    for index in range(1, STEPS + 1):
        model = root / f"pass_{index}"
        (model / "1").mkdir(parents=True)
        (model / "1" / "model.py").write_text(PASSTHROUGH)
        (model / "config.pbtxt").write_text(
            f'name: "pass_{index}" backend: "python" max_batch_size: 8 '
            'input [{name: "INPUT" data_type: TYPE_FP32 dims: [4]}] '
            'output [{name: "OUTPUT" data_type: TYPE_FP32 dims: [4]}]')
    steps = []
    for index in range(1, STEPS + 1):
        source = "INPUT" if index == 1 else f"t{index - 1}"
        target = "OUTPUT" if index == STEPS else f"t{index}"
        steps.append(f'{{ model_name: "pass_{index}" model_version: -1 input_map {{ key: "INPUT" value: "{source}" }} '
                     f'output_map {{ key: "OUTPUT" value: "{target}" }} }}')
    (root / "chain" / "1").mkdir(parents=True)
    (root / "chain" / "1" / ".keep").write_text("")
    (root / "chain" / "config.pbtxt").write_text(
        'name: "chain" platform: "ensemble" max_batch_size: 8 '
        'input [{name: "INPUT" data_type: TYPE_FP32 dims: [4]}] '
        'output [{name: "OUTPUT" data_type: TYPE_FP32 dims: [4]}] '
        f'ensemble_scheduling {{ step [ {", ".join(steps)} ] }}')


def request_bytes(host: str, model: str) -> bytes:
    body = json.dumps({"inputs": [{"name": "INPUT", "shape": [1, 4], "datatype": "FP32",
                                   "data": [1, 2, 3, 4]}]}).encode()
    head = f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def example_context(name: str) -> ModelContext:
    """The examples' model `name` as a backend receives it, config parsed, normalized and validated."""
    from transerve.backends.base import ModelContext
    from transerve.config import model_config

    model_path = EXAMPLES / name
    config = model_config.load_config_file(model_path)
    model_config.normalize(config, name)
    model_config.validate(config, name)
    return ModelContext(name, "1", model_path, model_path / "1", EXAMPLES, config)


def add_sub_request(batch: int = 1) -> InferRequest:
    from transerve.core.types import InferRequest, Tensor

    in0 = np.arange(4 * batch, dtype=np.float32).reshape(batch, 4)
    in1 = np.ones((batch, 4), np.float32)
    return InferRequest("add_sub", [Tensor("INPUT0", "FP32", in0), Tensor("INPUT1", "FP32", in1)], id="bench")
