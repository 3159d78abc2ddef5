"""The ensemble's callback-driven walk, in process: statistics per step, errors naming the step, nothing left in
flight, steps pruned to the outputs asked for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.in_process import outputs, request, with_server
from support.repositories import int32_in_out, write_model

from transerve.backends.ensemble.graph import Step, needed_steps
from transerve.core.errors import ErrorCode, ServerError
from transerve.server import Server

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
        write_model(root, name, int32_in_out(name, 2), code)
    write_model(
        root, "chain",
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


def test_a_step_left_without_a_required_input_fails_the_request_naming_it(tmp_path: Path):
    """As in Triton, an output a step does not send is absent for the next step, whose model then refuses the
    request as any model refuses one without a required input."""
    async def check(server: Server) -> None:
        with pytest.raises(ServerError) as failed:
            await server.infer(request("chain", X=("INT32", np.array([1, 2], np.int32))))
        assert failed.value.code is ErrorCode.INVALID_ARG
        assert failed.value.message.startswith(
            "in ensemble 'chain', step 1 (model 'second') failed: [request id: <id_unknown>] expected 1 inputs but "
            "got 0 inputs for model 'second'")
        assert success_counts(server)["first"] == 1
        assert server._inflight == 0

    with_server(chain_repository(tmp_path, NO_OUTPUT), check)


def test_steps_are_pruned_to_the_outputs_asked_for():
    def step(index: int, inputs: list[str], outputs: list[str]) -> Step:
        return Step(index, f"m{index}", "", {f"i{n}": t for n, t in enumerate(inputs)},
                    {f"o{n}": t for n, t in enumerate(outputs)})

    # X -> 0 -> a -> 1 -> A;  a -> 2 -> B;  X -> 3 -> (c, unused: kept, as Triton keeps it);  Y -> 4 -> C
    steps = [step(0, ["X"], ["a"]), step(1, ["a"], ["A"]), step(2, ["a"], ["B"]), step(3, ["X"], ["c"]),
             step(4, ["Y"], ["C"])]
    kept = {wanted: [s.index for s in needed_steps(steps, ["A", "B", "C"], wanted)]
            for wanted in map(frozenset, ({"A"}, {"B"}, {"A", "B"}, {"C"}, set()))}
    assert kept == {frozenset({"A"}): [0, 1, 3], frozenset({"B"}): [0, 2, 3], frozenset({"A", "B"}): [0, 1, 2, 3],
                    frozenset({"C"}): [3, 4], frozenset(): [3]}
