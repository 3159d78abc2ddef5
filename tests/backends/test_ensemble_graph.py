"""An ensemble's graph at sizes a config could give it: checked and pruned in time linear in its steps, a cycle
named, and ensembles nested past the bound refused at load (a 400 under explicit model control) while the
shallower ones serve."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.in_process import outputs, request, states, with_server
from support.repositories import int32_in_out, write_model
from test_ensemble_walk import IDENTITY
from tritonclient.grpc import model_config_pb2

from transerve.backends.ensemble.backend import MAX_DEPTH
from transerve.backends.ensemble.graph import build_steps, needed_steps
from transerve.config.model_config import ConfigError
from transerve.core.signature import ModelSignature
from transerve.server import Server

IDENTITY_CONFIG = model_config_pb2.ModelConfig(
    name="identity", input=[model_config_pb2.ModelInput(name="IN", data_type=model_config_pb2.TYPE_INT32, dims=[2])],
    output=[model_config_pb2.ModelOutput(name="OUT", data_type=model_config_pb2.TYPE_INT32, dims=[2])])


def chain_config(length: int, cycle: bool = False) -> model_config_pb2.ModelConfig:
    """X -> identity -> t1 -> ... -> Y, its steps listed last first (the walk cannot take them in order); with
    `cycle`, X -> identity -> Y beside a ring of the other steps, t1 -> ... -> t1."""
    config = model_config_pb2.ModelConfig(name="chain", platform="ensemble")
    config.input.add(name="X", data_type=model_config_pb2.TYPE_INT32, dims=[2])
    config.output.add(name="Y", data_type=model_config_pb2.TYPE_INT32, dims=[2])
    links = [("X", "Y"), *((f"t{n}", f"t{n % (length - 1) + 1}") for n in range(1, length))] if cycle else \
        list(zip(["X", *(f"t{n}" for n in range(1, length))], [*(f"t{n}" for n in range(1, length)), "Y"],
                 strict=True))
    for read, written in reversed(links):
        step = config.ensemble_scheduling.step.add(model_name="identity", model_version=-1)
        step.input_map["IN"] = read
        step.output_map["OUT"] = written
    return config


def test_a_long_chain_listed_backwards_is_checked_and_pruned():
    signatures = {("identity", ""): ModelSignature("identity", IDENTITY_CONFIG)}
    steps = build_steps("chain", chain_config(1000), signatures)
    assert len(steps) == 1000
    assert len(needed_steps(steps, ["Y"], {"Y"})) == 1000
    with pytest.raises(ConfigError, match="has a cycle: step 0 .*step 998 .* wait on each other"):
        build_steps("chain", chain_config(1000, cycle=True), signatures)


def nested_repository(root: Path, levels: int) -> Path:
    """`e1` wraps `identity`; each `eN` wraps `e(N-1)`: `eN` nests N ensembles."""
    write_model(root, "identity", int32_in_out("identity", 2), IDENTITY)
    inner = "identity"
    for level in range(1, levels + 1):
        write_model(root, f"e{level}",
                    f'name: "e{level}" platform: "ensemble" input [{{name: "X" data_type: TYPE_INT32 dims: [2]}}] '
                    'output [{name: "Y" data_type: TYPE_INT32 dims: [2]}] ensemble_scheduling { step [ '
                    f'{{ model_name: "{inner}" model_version: -1 input_map {{ key: "{"IN" if level == 1 else "X"}" '
                    f'value: "X" }} output_map {{ key: "{"OUT" if level == 1 else "Y"}" value: "Y" }} }} ] }}')
        inner = f"e{level}"
    return root


def test_ensembles_nested_past_the_bound_are_refused_and_the_others_serve(tmp_path: Path):
    async def check(server: Server) -> None:
        found = states(server)
        assert found[f"e{MAX_DEPTH}"]["state"] == "READY"
        assert found[f"e{MAX_DEPTH + 1}"]["state"] == "UNAVAILABLE"
        assert f"nests ensembles more than {MAX_DEPTH} deep" in found[f"e{MAX_DEPTH + 1}"]["reason"]
        answer = await server.infer(request(f"e{MAX_DEPTH}", X=("INT32", np.array([3, 4], np.int32))))
        assert outputs(answer)["Y"].tolist() == [3, 4]

    with_server(nested_repository(tmp_path, MAX_DEPTH + 2), check)
