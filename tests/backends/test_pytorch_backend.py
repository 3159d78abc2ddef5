"""The pytorch backend: Triton's naming conventions, batching, parameters, bad input and broken models."""

from __future__ import annotations

import asyncio
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
from support.in_process import outputs, request, states, with_server
from support.tiny_models import token_states_reference, write_torchscript

from transerve.config.devices import visible_gpus
from transerve.core.errors import ErrorCode, ServerError
from transerve.server import Server

torch = pytest.importorskip("torch")

CONFIG = """
platform: "pytorch_libtorch"
max_batch_size: 8
input [ {{ name: "{a}" data_type: TYPE_FP32 dims: [ 4 ] }}, {{ name: "{b}" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "{sum}" data_type: {sum_type} dims: [ 4 ] }}, {{ name: "{diff}" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""


def add_model(repository: Path, name: str, config: str | None, model: str = "add_sub") -> Path:
    write_torchscript(model, repository / name / "1" / "model.pt")
    if config is not None:
        (repository / name / "config.pbtxt").write_text(textwrap.dedent(config))
    return repository / name


def config(a: str = "INPUT__0", b: str = "INPUT__1", sum: str = "OUTPUT__0", diff: str = "OUTPUT__1",  # noqa: A002
           sum_type: str = "TYPE_FP32", extra: str = "") -> str:
    return CONFIG.format(a=a, b=b, sum=sum, diff=diff, sum_type=sum_type) + extra


def inputs(a: str, b: str, rows: int = 1, dtype: str = "FP32") -> dict[str, tuple[str, np.ndarray]]:
    first = np.arange(4 * rows, dtype=np.float32).reshape(rows, 4) * 10
    second = np.arange(4 * rows, dtype=np.float32).reshape(rows, 4)
    if dtype != "FP32":
        first, second = first.astype(np.float64), second.astype(np.float64)
    return {a: (dtype, first), b: (dtype, second)}


def test_inputs_and_outputs_map_by_index_by_argument_name_or_in_config_order(tmp_path: Path):
    # INPUT__1 listed first: the index, not the position in the config, decides.
    add_model(tmp_path, "indexed", config(a="INPUT__1", b="INPUT__0", sum="OUTPUT__1", diff="OUTPUT__0"))
    add_model(tmp_path, "by_argument", config(a="INPUT1", b="INPUT0", sum="SUM", diff="DIFF"))
    add_model(tmp_path, "in_order", config(a="left", b="right", sum="SUM", diff="DIFF"))

    async def check(server: Server) -> None:
        got = outputs(await server.infer(request("indexed", **inputs("INPUT__1", "INPUT__0"))))
        # forward(INPUT__0 = [0, 1, 2, 3], INPUT__1 = [0, 10, 20, 30]): output 0 is the sum, output 1 the difference
        assert got["OUTPUT__0"].tolist() == [[0, 11, 22, 33]]
        assert got["OUTPUT__1"].tolist() == [[0, -9, -18, -27]]
        got = outputs(await server.infer(request("by_argument", **inputs("INPUT1", "INPUT0"))))
        assert got["SUM"].tolist() == [[0, 11, 22, 33]] and got["DIFF"].tolist() == [[0, -9, -18, -27]]
        got = outputs(await server.infer(request("in_order", **inputs("left", "right", rows=2))))
        assert got["DIFF"].tolist() == [[0, 9, 18, 27], [36, 45, 54, 63]]  # left - right

    with_server(tmp_path, check)


def test_batches_of_different_lengths_are_padded_and_trimmed(tmp_path: Path):
    add_model(tmp_path, "tokens", """
        platform: "pytorch_libtorch"
        max_batch_size: 8
        input [ { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] },
                { name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ] } ]
        output [ { name: "hidden" data_type: TYPE_FP32 dims: [ -1, 3 ] },
                 { name: "length" data_type: TYPE_INT64 dims: [ 1 ] } ]
        dynamic_batching { max_queue_delay_microseconds: 200000 }
        parameters { key: "batching_strategy" value: { string_value: "bucketed" } }
        parameters { key: "INFERENCE_MODE" value: { string_value: "false" } }
        parameters { key: "INTRA_OP_THREAD_COUNT" value: { string_value: "1" } }
    """, model="token_states")

    async def check(server: Server) -> None:
        sent = [(np.arange(1, n + 1, dtype=np.int64)[None], np.ones((1, n), dtype=np.int64)) for n in (3, 7, 5)]
        answers = await asyncio.gather(*(
            server.infer(request("tokens", input_ids=("INT64", ids), attention_mask=("INT64", mask)))
            for ids, mask in sent
        ))
        for (ids, mask), answer in zip(sent, answers, strict=True):
            np.testing.assert_allclose(outputs(answer)["hidden"], token_states_reference(ids, mask), rtol=1e-6)
        sizes = [entry["batch_size"] for entry in server.statistics("tokens")["model_stats"][0]["batch_stats"]]
        assert sizes == [3]

    with_server(tmp_path, check)


def test_bad_requests_and_wrong_output_types_fail_with_reasons(tmp_path: Path):
    add_model(tmp_path, "add_sub", config())
    add_model(tmp_path, "says_fp64", config(sum_type="TYPE_FP64"))

    async def check(server: Server) -> None:
        with pytest.raises(ServerError) as caught:
            await server.infer(request("add_sub", **inputs("INPUT__0", "INPUT__1", dtype="FP64")))
        assert caught.value.code is ErrorCode.INVALID_ARG and "expects 'FP32'" in caught.value.message
        with pytest.raises(ServerError) as caught:
            await server.infer(request("says_fp64", **inputs("INPUT__0", "INPUT__1")))
        assert caught.value.code is ErrorCode.INTERNAL
        assert "produced output 'OUTPUT__0' as float32, but its config declares FP64" in caught.value.message
        assert outputs(await server.infer(request("add_sub", **inputs("INPUT__0", "INPUT__1"))))["OUTPUT__0"].size == 4

    with_server(tmp_path, check)


def test_broken_models_are_unavailable_with_a_reason_while_the_others_serve(tmp_path: Path):
    add_model(tmp_path, "good", config())
    add_model(tmp_path, "no_config", None)
    (tmp_path / "missing" / "1").mkdir(parents=True)
    (tmp_path / "missing" / "config.pbtxt").write_text(config())
    (tmp_path / "corrupt" / "1").mkdir(parents=True)
    (tmp_path / "corrupt" / "1" / "model.pt").write_bytes(b"PK\x03\x04 not really a zip")
    (tmp_path / "corrupt" / "config.pbtxt").write_text(config())
    (tmp_path / "not_torchscript" / "1").mkdir(parents=True)
    torch.save({"weights": torch.ones(2)}, tmp_path / "not_torchscript" / "1" / "model.pt")
    (tmp_path / "not_torchscript" / "config.pbtxt").write_text(config())
    add_model(tmp_path, "bad_mode", config(extra='parameters { key: "INFERENCE_MODE" value: { string_value: "yes" } }'))
    (tmp_path / "linked_out" / "1").mkdir(parents=True)
    (tmp_path / "linked_out" / "1" / "model.pt").symlink_to(tmp_path / "good" / "1" / "model.pt")
    (tmp_path / "linked_out" / "config.pbtxt").write_text(config())
    expected = {
        "no_config": "a TorchScript model does not record its inputs and outputs",
        "missing": "model file",
        "corrupt": "torch cannot load model.pt",
        "not_torchscript": "torch cannot load model.pt",
        "bad_mode": "parameter INFERENCE_MODE must be 'true' or 'false', got 'yes'",
        "linked_out": "failed to load 'linked_out' version 1: default_model_filename 'model.pt' leads outside the "
                      "folder 'linked_out' through a symbolic link",
    }

    async def check(server: Server) -> None:
        index = states(server)
        for name, fragment in expected.items():
            assert index[name]["state"] == "UNAVAILABLE", index[name]
            assert fragment in index[name]["reason"], index[name]["reason"]
            assert "\n" not in index[name]["reason"]
        assert server.model_config("good")["backend"] == "pytorch"
        assert outputs(await server.infer(request("good", **inputs("INPUT__0", "INPUT__1"))))["OUTPUT__1"].size == 4

    with_server(tmp_path, check)


@pytest.mark.gpu
@pytest.mark.skipif(not visible_gpus() or not torch.cuda.is_available(), reason="needs an NVIDIA GPU and CUDA torch")
def test_gpu_instances_run_on_their_device(tmp_path: Path):
    add_model(tmp_path, "add_sub", config(extra="instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]"))

    async def check(server: Server) -> None:
        got = outputs(await server.infer(request("add_sub", **inputs("INPUT__0", "INPUT__1"))))
        assert got["OUTPUT__0"].tolist() == [[0, 11, 22, 33]]

    with_server(tmp_path, check)


def test_an_idle_instance_thread_ends_and_the_next_request_starts_one_with_the_thread_count(tmp_path: Path,
                                                                                            monkeypatch):
    """An instance's thread ends when idle (torch's OpenMP pool with it: an idle model's pool would slow the busy
    ones); the next request runs on a new thread, which gets INTRA_OP_THREAD_COUNT too."""
    from transerve.backends.pytorch import backend as pytorch_backend

    monkeypatch.setattr(pytorch_backend, "IDLE_SECONDS", 0.2)
    threads = 'parameters { key: "INTRA_OP_THREAD_COUNT" value: { string_value: "1" } }'
    add_model(tmp_path, "add_sub", config(extra=threads))

    async def check(server: Server) -> None:
        (model,) = [m for m in server.serving_versions() if m.name == "add_sub"]
        executor = model.backend_model.instances[0]._executor
        loop = asyncio.get_running_loop()

        async def idle() -> bool:
            deadline = loop.time() + 10
            while executor.thread is not None and loop.time() < deadline:
                await asyncio.sleep(0.05)
            return executor.thread is None

        assert await idle()  # the loading thread ended
        started = executor.threads_started
        for _ in range(2):
            # torch gives a new thread the count last set anywhere: another model's, here 2
            await loop.run_in_executor(None, torch.set_num_threads, 2)
            got = outputs(await server.infer(request("add_sub", **inputs("INPUT__0", "INPUT__1"))))
            assert got["OUTPUT__0"].tolist() == [[0, 11, 22, 33]]
            assert await loop.run_in_executor(executor, torch.get_num_threads) == 1
            assert await idle()
        assert executor.threads_started == started + 2  # a new thread for each request after an idle end

    original = torch.get_num_threads()
    try:
        with_server(tmp_path, check)
    finally:
        torch.set_num_threads(original)



class _ComputedTable(torch.nn.Module):
    """An embedding whose table is computed per call: the bound cannot be read at load."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.arange(20, dtype=torch.float32).reshape(10, 2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.table * 1.0)


class _ReshapedIds(torch.nn.Module):
    """An embedding of its argument converted and reshaped first: the bound is still found."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids.to(torch.int64).reshape(-1))


TOKENS_CONFIG = """
    platform: "pytorch_libtorch"
    max_batch_size: 8
    input [ { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] },
            { name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ] } ]
    output [ { name: "hidden" data_type: TYPE_FP32 dims: [ -1, 3 ] },
             { name: "length" data_type: TYPE_INT64 dims: [ 1 ] } ]
    dynamic_batching { max_queue_delay_microseconds: 200000 }
"""


def test_ids_outside_an_embedding_table_are_refused_alone_with_the_range(tmp_path: Path):
    add_model(tmp_path, "tokens", TOKENS_CONFIG, model="token_states")
    (tmp_path / "computed" / "1").mkdir(parents=True)
    (tmp_path / "reshaped" / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(_ComputedTable()).save(str(tmp_path / "computed" / "1" / "model.pt"))
        torch.jit.script(_ReshapedIds()).save(str(tmp_path / "reshaped" / "1" / "model.pt"))
    (tmp_path / "computed" / "config.pbtxt").write_text(
        'platform: "pytorch_libtorch"\nmax_batch_size: 4\ninput [ { name: "INPUT__0" data_type: TYPE_INT64 '
        'dims: [ -1 ] } ]\noutput [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ -1, 2 ] } ]\n')
    (tmp_path / "reshaped" / "config.pbtxt").write_text(
        'platform: "pytorch_libtorch"\nmax_batch_size: 0\ninput [ { name: "ids" data_type: TYPE_INT32 '
        'dims: [ -1, -1 ] } ]\noutput [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ -1, 2 ] } ]\n')

    def tokens(*ids: int):
        row = np.array([ids], dtype=np.int64)
        return request("tokens", input_ids=("INT64", row), attention_mask=("INT64", np.ones_like(row)))

    async def check(server: Server) -> None:
        answers = await asyncio.gather(*(server.infer(tokens(*ids)) for ids in ((1, 2), (-1, 2), (3, 4))),
                                       return_exceptions=True)
        assert outputs(answers[0])["hidden"].shape == outputs(answers[2])["hidden"].shape == (1, 2, 3)
        assert isinstance(answers[1], ServerError) and answers[1].code == ErrorCode.INVALID_ARG
        assert answers[1].message == ("input 'input_ids' holds id -1, outside the vocabulary (0..99) of the "
                                      "embedding table 'embedding.weight'")
        # One batch of the three: the bad one was answered alone, the other two ran together.
        assert [b["batch_size"] for b in server.statistics("tokens")["model_stats"][0]["batch_stats"]] == [3]

        good = outputs(await server.infer(request("computed", INPUT__0=("INT64", np.array([[9, 0]])))))
        assert good["OUTPUT__0"].tolist() == [[[18.0, 19.0], [0.0, 1.0]]]
        with pytest.raises(ServerError) as caught:  # torch's own refusal, still the client's error
            await server.infer(request("computed", INPUT__0=("INT64", np.array([[10, 0]]))))
        assert caught.value.code == ErrorCode.INVALID_ARG
        assert caught.value.message.startswith("an input holds an id outside its embedding table: ")
        assert "index out of range" in caught.value.message

        reshaped = outputs(await server.infer(request("reshaped", ids=("INT32", np.array([[9, 0]], np.int32)))))
        assert reshaped["OUTPUT__0"].shape == (2, 2)
        with pytest.raises(ServerError) as caught:  # found through the conversion and the reshape
            await server.infer(request("reshaped", ids=("INT32", np.array([[3, 10]], np.int32))))
        assert caught.value.message == ("input 'ids' holds id 10, outside the vocabulary (0..9) of the embedding "
                                        "table 'embedding.weight'")

    with_server(tmp_path, check)
