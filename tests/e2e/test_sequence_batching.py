"""The sequence batcher end to end: stateful python models in a temporary repository, driven by the real
tritonclient over HTTP and gRPC (`sequence_id`, `sequence_start`, `sequence_end`), then the same requests
against the real Triton 2.51 on the same repository, whose outputs, status codes and messages must match.

The model is an accumulator per sequence that reads the control inputs the batcher adds (START resets,
END forgets, READY false marks a null request, CORRID keys the sum), checks them against the request's own
`correlation_id()` and `flags()`, and reports the READY value of every request of the execution it ran in,
which shows the direct strategy's slots and null requests. A request cancelled by its gRPC client while it waits
cancels its sequence in both servers.

Known divergences from Triton 2.51, not tested here against it: a STRING CORRID fails every request in
Triton 2.51 ("unexpected number of string elements"), while transerve passes the id as documented; a
config with implicit `state` loads in Triton but is refused by transerve's python backend (Triton's never
carries the output state, so such a model would silently see its initial state forever).
"""

from __future__ import annotations

import asyncio
import queue
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from support import ServerProcess, require_triton, start_transerve, start_triton
from support.repositories import write_model
from tritonclient.utils import InferenceServerException

TIMEOUT_S = 30.0

MODEL = '''
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Sums INPUT per sequence, as the sequence batcher's control inputs direct."""

    def initialize(self, args):
        self.sums = {}
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.delay_s = float(parameters.get("delay_ms", {}).get("string_value", 0)) / 1000

    def execute(self, requests):
        if self.delay_s:
            time.sleep(self.delay_s)
        ready = [bool(self.control(r, "READY")) for r in requests]
        responses = []
        for request, is_ready in zip(requests, ready):
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            total = 0
            if is_ready:
                key = self.control(request, "CORRID")
                self.check(request, key)
                if self.control(request, "START"):
                    self.sums[key] = 0
                total = self.sums[key] = self.sums.get(key, 0) + int(value.reshape(-1)[0])
                if self.control(request, "END"):
                    del self.sums[key]
            lead = value.shape[:-1]
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT", np.full(value.shape, total, np.int32)),
                pb_utils.Tensor("READY_SEEN", np.array(ready, np.int32).reshape(lead + (len(ready),))),
            ]))
        return responses

    def check(self, request, key):
        """The request's own sequence id and flags agree with the control inputs."""
        sequence = request.correlation_id()
        if isinstance(key, bytes):
            sequence = str(sequence).encode()
        flags = request.flags()
        if (key, flags & 1, flags & 2) != (sequence, self.control(request, "START"), 2 * self.control(request, "END")):
            raise ValueError(f"controls disagree with the request: {key} {sequence} {flags}")

    @staticmethod
    def control(request, name):
        value = pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0]
        return value.item() if hasattr(value, "item") else value
'''

CONTROLS = """
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: %s } ] }
  ]
"""

IO = """
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "READY_SEEN" data_type: TYPE_INT32 dims: [ -1 ] }
]
"""

MODELS = {
    # One instance, two slots: which slot a sequence holds is deterministic, and so are the null requests.
    "seq_direct": "max_batch_size: 2\nsequence_batching { direct { }" + CONTROLS % "TYPE_UINT64" + "}" + IO,
    # Two instances, four candidate sequences each, executions slow enough for batches to form.
    "seq_oldest": (
        "max_batch_size: 4\nsequence_batching { oldest { max_candidate_sequences: 4 }" + CONTROLS % "TYPE_UINT64"
        + "}" + IO + 'instance_group [ { count: 2 kind: KIND_CPU } ]\n'
        + 'parameters { key: "delay_ms" value: { string_value: "20" } }\n'
    ),
    # No batching, but four sequences at a time.
    "seq_strings": (
        "max_batch_size: 0\nsequence_batching { oldest { max_candidate_sequences: 4 }" + CONTROLS % "TYPE_STRING"
        + "}" + IO
    ),
    "seq_idle": (
        "max_batch_size: 1\nsequence_batching { max_sequence_idle_microseconds: 300000" + CONTROLS % "TYPE_UINT64"
        + "}" + IO
    ),
    # START is also a client input: clients must send it, and the control value replaces it.
    "seq_start_input": (
        "max_batch_size: 2\nsequence_batching {" + CONTROLS % "TYPE_UINT64" + "}"
        + IO.replace("input [ {", 'input [ { name: "START" data_type: TYPE_INT32 dims: [ 1 ] }, {')
    ),
    # One slot, one second per execution: requests wait behind a running one long enough to be cancelled.
    **{f"seq_slow_{strategy}": (
        f"max_batch_size: 1\nsequence_batching {{ {body}" + CONTROLS % "TYPE_UINT64" + "}" + IO
        + 'parameters { key: "delay_ms" value: { string_value: "1000" } }\n'
    ) for strategy, body in (("direct", "direct { }"), ("oldest", "oldest { max_candidate_sequences: 1 }"))},
    "seq_state": (
        "max_batch_size: 2\nsequence_batching {" + CONTROLS % "TYPE_UINT64"
        + 'state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ] } ] }'
        + IO
    ),
}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sequence_models")
    for name, config in MODELS.items():
        write_model(root, name, f'name: "{name}"\nbackend: "python"\n{config}', textwrap.dedent(MODEL))
    return root


@pytest.fixture(scope="module")
def transerve(repository: Path) -> Iterator[ServerProcess]:
    # seq_state does not load, so readiness must not wait for every model.
    with start_transerve(repository, "--strict-readiness=false") as server:
        yield server


@pytest.fixture(scope="module")
def triton(repository: Path) -> Iterator[ServerProcess]:
    install = require_triton()
    with start_triton(repository, install=install) as server:
        yield server


def inputs(module: Any, value: int, shape: tuple[int, ...] = (1, 1), start: int | None = None) -> list[Any]:
    tensor = module.InferInput("INPUT", list(shape), "INT32")
    tensor.set_data_from_numpy(np.full(shape, value, np.int32))
    if start is None:
        return [tensor]
    extra = module.InferInput("START", list(shape), "INT32")
    extra.set_data_from_numpy(np.full(shape, start, np.int32))
    return [tensor, extra]


Outcome = tuple[Any, ...]


def outcome(call: Any) -> Outcome:
    """("ok", OUTPUT, READY_SEEN) or ("error", status, message): what a client sees, comparable across servers."""
    try:
        result = call()
    except InferenceServerException as exc:
        return ("error", exc.status(), exc.message())
    return ("ok", result.as_numpy("OUTPUT").reshape(-1).tolist(), result.as_numpy("READY_SEEN").reshape(-1).tolist())


# --- transerve ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["seq_direct", "seq_oldest"])
def test_interleaved_sequences_over_http_each_keep_their_own_sum(transerve: ServerProcess, model: str):
    """Ten sequences at once, more than either model has slots: each awaits its own answers."""
    sequences = {1000 + s: [s + 1 + 10 * step for step in range(6)] for s in range(10)}

    async def one(client: httpaio.InferenceServerClient, sequence: int, values: list[int]) -> list[int]:
        totals = []
        for step, value in enumerate(values):
            result = await client.infer(
                model, inputs(httpaio, value), sequence_id=sequence, sequence_start=step == 0,
                sequence_end=step == len(values) - 1,
            )
            totals.append(int(result.as_numpy("OUTPUT")[0, 0]))
        return totals

    async def run() -> list[list[int]]:
        async with httpaio.InferenceServerClient(transerve.http_url, conn_timeout=TIMEOUT_S) as client:
            calls = [one(client, sequence, values) for sequence, values in sequences.items()]
            return await asyncio.wait_for(asyncio.gather(*calls), TIMEOUT_S)

    for got, values in zip(asyncio.run(run()), sequences.values(), strict=True):
        assert got == np.cumsum(values).tolist()


def test_grpc_streams_deliver_each_sequence_in_order_and_batches_form(transerve: ServerProcess):
    """Each sequence streams all its requests without waiting: the stream's order is the sequence's order."""
    before = model_stats(transerve, "seq_oldest")
    count, steps = 6, 8
    answers: dict[int, queue.Queue] = {sequence: queue.Queue() for sequence in range(1, count + 1)}
    clients = []
    for sequence in answers:
        client = grpcclient.InferenceServerClient(transerve.grpc_url)
        client.start_stream(lambda result, error, box=answers[sequence]: box.put((result, error)))
        clients.append(client)
    try:
        for step in range(steps):
            for sequence, client in zip(answers, clients, strict=True):
                client.async_stream_infer(
                    "seq_oldest", inputs(grpcclient, sequence * 100 + step), sequence_id=sequence,
                    sequence_start=step == 0, sequence_end=step == steps - 1,
                )
        for sequence, box in answers.items():
            totals = []
            for _ in range(steps):
                result, error = box.get(timeout=TIMEOUT_S)
                assert error is None, error
                totals.append(int(result.as_numpy("OUTPUT")[0, 0]))
            assert totals == np.cumsum([sequence * 100 + step for step in range(steps)]).tolist()
    finally:
        for client in clients:
            client.stop_stream()
            client.close()
    after = model_stats(transerve, "seq_oldest")
    executions = after["execution_count"] - before["execution_count"]
    assert after["inference_count"] - before["inference_count"] == count * steps
    assert executions < count * steps  # the requests of different sequences shared executions
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    assert sum(sizes.values()) == after["execution_count"] and max(sizes) > 1


def test_string_sequence_ids_over_http_and_grpc(transerve: ServerProcess):
    http = httpclient.InferenceServerClient(transerve.http_url)
    grpc = grpcclient.InferenceServerClient(transerve.grpc_url)

    def send(client: Any, module: Any, sequence: str | int, value: int, **flags: bool) -> int:
        result = client.infer("seq_strings", inputs(module, value, (1,)), sequence_id=sequence, **flags)
        return int(result.as_numpy("OUTPUT")[0])

    assert send(http, httpclient, "alpha", 1, sequence_start=True) == 1
    assert send(grpc, grpcclient, "beta", 10, sequence_start=True) == 10
    assert send(grpc, grpcclient, "alpha", 2) == 3
    assert send(http, httpclient, "beta", 20) == 30
    assert send(http, httpclient, 7, 5, sequence_start=True, sequence_end=True) == 5  # integer id, string CORRID
    assert send(http, httpclient, "alpha", 3, sequence_end=True) == 6
    assert send(grpc, grpcclient, "beta", 30, sequence_end=True) == 60
    with pytest.raises(InferenceServerException, match="sequence alpha to model 'seq_strings' must specify the START"):
        send(grpc, grpcclient, "alpha", 1)


def test_implicit_state_is_refused_with_the_reason(transerve: ServerProcess):
    index = requests.post(f"{transerve.base_url}/v2/repository/index", json={}, timeout=TIMEOUT_S).json()
    (entry,) = [entry for entry in index if entry["name"] == "seq_state"]
    assert entry["state"] == "UNAVAILABLE"
    assert "implicit state (sequence_batching.state) is not supported by the python backend" in entry["reason"]


def model_stats(server: ServerProcess, model: str) -> dict[str, Any]:
    response = requests.get(f"{server.base_url}/v2/models/{model}/stats", timeout=TIMEOUT_S)
    return response.json()["model_stats"][0]


# --- against Triton 2.51 -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(triton: ServerProcess, transerve: ServerProcess) -> dict[str, ServerProcess]:
    """Triton first, so that a machine without it skips before anything else starts."""
    return {"triton": triton, "transerve": transerve}


def both(servers: dict[str, ServerProcess], scenario: Any) -> dict[str, list[Outcome]]:
    """Run `scenario(http client, grpc client)` against each server: the lists of outcomes it returns."""
    results = {}
    for name, server in servers.items():
        http = httpclient.InferenceServerClient(server.http_url, network_timeout=TIMEOUT_S)
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            results[name] = scenario(http, grpc)
        finally:
            http.close()
            grpc.close()
    return results


def test_differential_direct_slots_null_requests_and_errors(servers: dict[str, ServerProcess]):
    """Deterministic: requests in turn, so slots, null requests and batch statistics must equal Triton's."""

    def scenario(http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient) -> list[Outcome]:
        def send(client: Any, value: int, shape: tuple[int, ...] = (1, 1), **sequence: Any) -> Outcome:
            module = httpclient if client is http else grpcclient
            return outcome(lambda: client.infer("seq_direct", inputs(module, value, shape), **sequence))

        return [
            send(http, 1, sequence_id=11, sequence_start=True),  # slot 0
            send(grpc, 10, sequence_id=12, sequence_start=True),  # slot 1, after a null request
            send(http, 2, sequence_id=11),
            send(grpc, 5, sequence_id=12, sequence_end=True),
            send(http, 1, sequence_id=12),  # ended: needs START again
            send(grpc, 1, sequence_id=12),
            send(http, 7, sequence_id=13, sequence_start=True),  # takes the freed slot 1
            send(grpc, 3, sequence_id=11, sequence_end=True),
            send(http, 1),  # no sequence id
            send(grpc, 1),
            send(http, 1, shape=(2, 1), sequence_id=14, sequence_start=True),  # batch of 2
            send(grpc, 1, shape=(2, 1), sequence_id=14, sequence_start=True),
            send(http, 100, sequence_id=13, sequence_start=True),  # START again: restarts in place
            send(grpc, 1, sequence_id=13, sequence_end=True),
            send(grpc, 4, sequence_id=15, sequence_start=True, sequence_end=True),
        ]

    before = {name: model_stats(server, "seq_direct") for name, server in servers.items()}
    results = both(servers, scenario)
    assert results["transerve"] == results["triton"]
    assert results["triton"][1] == ("ok", [10], [0, 1])
    after = {name: model_stats(server, "seq_direct") for name, server in servers.items()}

    def counted(name: str) -> dict[str, Any]:
        then, now = before[name], after[name]
        batches = {b["batch_size"]: b["compute_infer"]["count"] for b in now["batch_stats"]}
        earlier = {b["batch_size"]: b["compute_infer"]["count"] for b in then["batch_stats"]}
        return {
            "inferences": now["inference_count"] - then["inference_count"],
            "executions": now["execution_count"] - then["execution_count"],
            "successes": now["inference_stats"]["success"]["count"] - then["inference_stats"]["success"]["count"],
            "batches": {size: count - earlier.get(size, 0) for size, count in batches.items()},
        }

    assert counted("transerve") == counted("triton")


def test_differential_oldest_over_grpc_and_http(servers: dict[str, ServerProcess]):
    def scenario(http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient) -> list[Outcome]:
        steps = []
        for step in range(4):
            for sequence, client, module in ((21, http, httpclient), (22, grpc, grpcclient)):
                flags = {"sequence_start": step == 0, "sequence_end": step == 3}
                steps.append(outcome(lambda c=client, m=module, s=sequence, v=step, f=flags: c.infer(
                    "seq_oldest", inputs(m, s + v), sequence_id=s, **f)))
        steps.append(outcome(lambda: grpc.infer("seq_oldest", inputs(grpcclient, 1), sequence_id=21)))
        return steps

    results = both(servers, scenario)
    assert results["transerve"] == results["triton"]
    assert [r[1] for r in results["transerve"][:8:2]] == [[21], [43], [66], [90]]


def test_differential_idle_sequences_need_start_again(servers: dict[str, ServerProcess]):
    def scenario(http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient) -> list[Outcome]:
        first = outcome(lambda: http.infer("seq_idle", inputs(httpclient, 1), sequence_id=31, sequence_start=True))
        second = outcome(lambda: grpc.infer("seq_idle", inputs(grpcclient, 2), sequence_id=31))
        time.sleep(0.6)  # twice max_sequence_idle_microseconds
        late = [outcome(lambda c=c, m=m: c.infer("seq_idle", inputs(m, 3), sequence_id=31))
                for c, m in ((http, httpclient), (grpc, grpcclient))]
        restart = outcome(lambda: http.infer("seq_idle", inputs(httpclient, 4), sequence_id=31, sequence_start=True,
                                             sequence_end=True))
        return [first, second, *late, restart]

    results = both(servers, scenario)
    assert results["transerve"] == results["triton"]
    assert results["transerve"][2][0] == "error" and results["transerve"][4] == ("ok", [4], [1])


def test_differential_control_inputs_are_not_client_inputs_unless_the_config_says_so(
    servers: dict[str, ServerProcess],
):
    def scenario(http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient) -> list[Outcome]:
        return [
            outcome(lambda: http.infer("seq_start_input", inputs(httpclient, 5), sequence_id=41,
                                       sequence_start=True)),
            outcome(lambda: grpc.infer("seq_start_input", inputs(grpcclient, 5, start=0), sequence_id=41,
                                       sequence_start=True)),
            outcome(lambda: http.infer("seq_start_input", inputs(httpclient, 6, start=1), sequence_id=41,
                                       sequence_end=True)),
            # Only the status: Triton lists the inputs in hash order, and its "missing" list loses its "[".
            outcome(lambda: http.infer("seq_direct", inputs(httpclient, 1, start=1), sequence_id=42,
                                       sequence_start=True, sequence_end=True))[:2],
        ]

    results = both(servers, scenario)
    assert results["transerve"] == results["triton"]
    assert results["transerve"][3] == ("error", "400")
    # The START a client sends is replaced by the control: the second request started, the third did not.
    assert results["transerve"][1:3] == [("ok", [5], [1]), ("ok", [11], [1])]
    for name in ("seq_direct", "seq_start_input"):
        metadata = {n: requests.get(f"{s.base_url}/v2/models/{name}", timeout=TIMEOUT_S).json()
                    for n, s in servers.items()}
        assert metadata["transerve"] == metadata["triton"]
        configs = {n: requests.get(f"{s.base_url}/v2/models/{name}/config", timeout=TIMEOUT_S).json()
                   for n, s in servers.items()}
        assert configs["transerve"]["sequence_batching"] == configs["triton"]["sequence_batching"]


def canceled_metric(server: ServerProcess, model: str) -> int:
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=TIMEOUT_S).text
    for line in text.splitlines():
        if line.startswith(f'nv_inference_request_failure{{model="{model}",reason="CANCELED",version="1"}}'):
            return int(float(line.split()[-1]))
    raise AssertionError(f"no CANCELED failure metric for {model}")


def cancel_a_queued_request(server: ServerProcess, model: str, backlog: bool) -> list[Any]:
    """Scheduler_test's scenario, faster: sequence 51 runs; two requests wait (behind it in its slot, or as the
    backlogged sequence 52), the first of them cancelled by its client. What each request saw, and whether the
    cancelled sequence can go on without START."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: dict[str, queue.Queue[Any]] = {key: queue.Queue() for key in ("running", "first", "second", "end")}

    def answer(key: str) -> Any:
        return lambda result, error: answers[key].put(("error", error.status()) if error else
                                                      ("ok", result.as_numpy("OUTPUT").reshape(-1).tolist()))

    waiting_sequence = 52 if backlog else 51
    try:
        client.async_infer(model, inputs(grpcclient, 1), answer("running"), sequence_id=51, sequence_start=True)
        time.sleep(0.2)
        # A pause between calls: Triton takes concurrent gRPC calls on several threads, in either order.
        first = client.async_infer(model, inputs(grpcclient, 2), answer("first"), sequence_id=waiting_sequence,
                                   sequence_start=backlog)
        time.sleep(0.1)
        client.async_infer(model, inputs(grpcclient, 3), answer("second"), sequence_id=waiting_sequence)
        if backlog:  # the running sequence ends next, which hands its slot on
            time.sleep(0.1)
            client.async_infer(model, inputs(grpcclient, 4), answer("end"), sequence_id=51, sequence_end=True)
        time.sleep(0.2)
        first.cancel()
        seen = [answers[key].get(timeout=TIMEOUT_S) for key in ("running", "first", "second")]
        if backlog:
            seen.append(answers["end"].get(timeout=TIMEOUT_S))
        seen.append(outcome(lambda: client.infer(model, inputs(grpcclient, 5), sequence_id=waiting_sequence))[:2])
        client.infer(model, inputs(grpcclient, 0), sequence_id=51, sequence_start=True, sequence_end=True)
        return seen
    finally:
        client.close()


@pytest.mark.parametrize("model, backlog", [("seq_slow_direct", False), ("seq_slow_oldest", False),
                                            ("seq_slow_direct", True)])
def test_differential_a_cancelled_request_cancels_its_sequence(
    servers: dict[str, ServerProcess], model: str, backlog: bool
):
    results, counted = {}, {}
    for name, server in servers.items():
        before = canceled_metric(server, model)
        results[name] = cancel_a_queued_request(server, model, backlog)
        deadline = time.monotonic() + 5  # Triton counts a cancellation just after answering it
        while canceled_metric(server, model) - before < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        counted[name] = canceled_metric(server, model) - before
    assert results["transerve"] == results["triton"]
    expected = [("ok", [1]), ("error", "StatusCode.CANCELLED"), ("error", "StatusCode.CANCELLED")]
    assert results["transerve"][:3] == expected
    assert results["transerve"][-1] == ("error", "StatusCode.INVALID_ARGUMENT")  # ended: the next needs START
    assert counted["transerve"] == counted["triton"] == 2
