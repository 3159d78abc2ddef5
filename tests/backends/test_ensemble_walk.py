"""The ensemble's callback-driven walk, in process: statistics per step, errors naming the step, nothing left in
flight."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.in_process import outputs, request, with_server

from transerve.core.errors import ErrorCode, ServerError
from transerve.core.server import Server

IDENTITY = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
'''

NO_OUTPUT = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for _ in requests]
'''


def chain_repository(root: Path, first_model: str) -> Path:
    """`chain`: X -> first -> second -> Y, on INT32 [2] without batching."""
    for name, code in (("first", first_model), ("second", IDENTITY)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(code)
        (root / name / "config.pbtxt").write_text(
            f'name: "{name}" backend: "python" input [{{name: "IN" data_type: TYPE_INT32 dims: [2]}}] '
            'output [{name: "OUT" data_type: TYPE_INT32 dims: [2]}]')
    (root / "chain" / "1").mkdir(parents=True)
    (root / "chain" / "config.pbtxt").write_text(
        'name: "chain" platform: "ensemble" input [{name: "X" data_type: TYPE_INT32 dims: [2]}] '
        'output [{name: "Y" data_type: TYPE_INT32 dims: [2]}] ensemble_scheduling { step [ '
        '{ model_name: "first" model_version: -1 input_map { key: "IN" value: "X" } '
        'output_map { key: "OUT" value: "t" } }, '
        '{ model_name: "second" model_version: -1 input_map { key: "IN" value: "t" } '
        'output_map { key: "OUT" value: "Y" } } ] }')
    return root


def success_counts(server: Server) -> dict[str, int]:
    return {s["name"]: s["inference_stats"]["success"]["count"] for s in server.statistics()["model_stats"]}


def test_every_step_is_counted_as_a_request_of_its_model(tmp_path: Path):
    async def check(server: Server) -> None:
        for value in range(5):
            answer = await server.infer(request("chain", X=("INT32", np.array([value, 7], np.int32))))
            assert outputs(answer)["Y"].tolist() == [value, 7]
        assert success_counts(server) == {"chain": 5, "first": 5, "second": 5}
        assert server._inflight == 0

    with_server(chain_repository(tmp_path, IDENTITY), check)


def test_a_step_whose_inputs_never_come_fails_the_request_naming_it(tmp_path: Path):
    async def check(server: Server) -> None:
        with pytest.raises(ServerError) as failed:
            await server.infer(request("chain", X=("INT32", np.array([1, 2], np.int32))))
        assert failed.value.code is ErrorCode.INTERNAL
        assert "in ensemble 'chain', step 1 (model 'second') cannot run" in failed.value.message
        assert success_counts(server)["first"] == 1
        assert server._inflight == 0

    with_server(chain_repository(tmp_path, NO_OUTPUT), check)
