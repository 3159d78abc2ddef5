"""The onnxruntime backend through the core's loading path: auto-complete, batching, bad input, broken models."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from support.in_process import outputs, request, states, with_server
from support.tiny_models import token_states_reference, write_onnx

from transerve.config.devices import visible_gpus
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.types import InferRequest
from transerve.server import Server

pytest.importorskip("onnxruntime")

ADD_SUB_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def add_model(repository: Path, name: str, model: str = "add_sub", config: str | None = None) -> Path:
    write_onnx(model, repository / name / "1" / "model.onnx")
    if config is not None:
        (repository / name / "config.pbtxt").write_text(textwrap.dedent(config))
    return repository / name


def pair(rows: int = 1, width: int = 4, dtype: str = "FP32") -> dict[str, tuple[str, np.ndarray]]:
    a = np.arange(rows * width, dtype=np.float32).reshape(rows, width)
    return {"INPUT0": (dtype, a if dtype == "FP32" else a.astype(np.int32)), "INPUT1": (dtype, np.ones_like(a))}


def test_a_folder_without_config_is_served_from_what_the_graph_says(tmp_path: Path):
    add_model(tmp_path, "add_sub")

    async def check(server: Server) -> None:
        config = server.model_config("add_sub")
        assert (config["platform"], config["backend"]) == ("onnxruntime_onnx", "onnxruntime")
        assert config["max_batch_size"] == 4  # Triton's default for a graph with a dynamic batch axis
        assert config["dynamic_batching"]["preferred_batch_size"] == [4]
        assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
            ("INPUT0", "TYPE_FP32", [4]), ("INPUT1", "TYPE_FP32", [4])]
        assert [t["name"] for t in config["output"]] == ["OUTPUT0", "OUTPUT1"]
        assert server.model_metadata("add_sub")["platform"] == "onnxruntime_onnx"
        got = outputs(await server.infer(request("add_sub", **pair(rows=2))))
        np.testing.assert_array_equal(got["OUTPUT0"], np.arange(8).reshape(2, 4) + 1)
        np.testing.assert_array_equal(got["OUTPUT1"], np.arange(8).reshape(2, 4) - 1)

    with_server(tmp_path, check)


def test_a_partial_config_keeps_what_it_says_and_gets_the_rest(tmp_path: Path):
    add_model(tmp_path, "add_sub", config='max_batch_size: 2\ninput [ { name: "INPUT1" } ]\n')
    add_model(tmp_path, "unbatched", config="max_batch_size: 1\n")

    async def check(server: Server) -> None:
        config = server.model_config("add_sub")
        assert config["max_batch_size"] == 2
        assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
            ("INPUT1", "TYPE_FP32", [4]), ("INPUT0", "TYPE_FP32", [4])]
        assert "dynamic_batching" in config
        assert "dynamic_batching" not in server.model_config("unbatched")  # one at a time: nothing to batch
        with pytest.raises(ServerError, match="batch-size must be <= 2"):
            await server.infer(request("add_sub", **pair(rows=3)))

    with_server(tmp_path, check)


def test_requests_of_different_lengths_batch_padded_and_come_back_trimmed(tmp_path: Path):
    add_model(tmp_path, "bucketed", "token_states", """
        max_batch_size: 8
        dynamic_batching { max_queue_delay_microseconds: 200000 }
        parameters { key: "batching_strategy" value: { string_value: "bucketed" } }
        parameters { key: "bucket_boundaries" value: { string_value: "4,16" } }
    """)
    add_model(tmp_path, "triton_rule", "token_states", "max_batch_size: 8\ndynamic_batching { }\n")

    async def check(server: Server) -> None:
        lengths = [5, 9, 6, 16, 12]
        sent = []
        for length in lengths:
            ids = (np.arange(length, dtype=np.int64) % 90 + 1)[None]
            mask = np.ones_like(ids)
            mask[0, -1] = 0  # a request's own padding stays the model's business
            sent.append((ids, mask))
        answers = await asyncio.gather(*(
            server.infer(request("bucketed", input_ids=("INT64", ids), attention_mask=("INT64", mask)))
            for ids, mask in sent
        ))
        for (ids, mask), answer in zip(sent, answers, strict=True):
            got = outputs(answer)
            np.testing.assert_allclose(got["hidden"], token_states_reference(ids, mask), rtol=1e-6)
            assert got["length"].tolist() == [[ids.shape[1] - 1]]
        sizes = [entry["batch_size"] for entry in server.statistics("bucketed")["model_stats"][0]["batch_stats"]]
        assert sizes == [5]  # one bucket (5..16 tokens), one batch
        # Without buckets, Triton's rule: only equal shapes share a batch; answers are right either way.
        answers = await asyncio.gather(*(
            server.infer(request("triton_rule", input_ids=("INT64", ids), attention_mask=("INT64", mask)))
            for ids, mask in sent
        ))
        assert [outputs(a)["hidden"].shape[1] for a in answers] == lengths

    with_server(tmp_path, check)


def test_text_tensors_cross_as_bytes(tmp_path: Path):
    onnx = pytest.importorskip("onnx")
    helper = onnx.helper
    graph = helper.make_graph(
        [helper.make_node("Identity", ["TEXT"], ["SAME"])], "echo",
        [helper.make_tensor_value_info("TEXT", onnx.TensorProto.STRING, ["batch", 1])],
        [helper.make_tensor_value_info("SAME", onnx.TensorProto.STRING, ["batch", 1])],
    )
    (tmp_path / "echo" / "1").mkdir(parents=True)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, tmp_path / "echo" / "1" / "model.onnx")

    async def check(server: Server) -> None:
        assert server.model_config("echo")["input"][0]["data_type"] == "TYPE_STRING"
        text = np.array([["héllo".encode()], [b"world"]], dtype=object)
        got = outputs(await server.infer(request("echo", TEXT=("BYTES", text))))["SAME"]
        assert got.tolist() == [["héllo".encode()], [b"world"]]

    with_server(tmp_path, check)


def test_bad_requests_are_refused_before_the_engine(tmp_path: Path):
    add_model(tmp_path, "add_sub", config=ADD_SUB_CONFIG)

    async def check(server: Server) -> None:
        for tensors, message in (
            (pair(dtype="INT32"), "data-type is 'INT32', but model 'add_sub' expects 'FP32'"),
            (pair(width=5), "unexpected shape for input 'INPUT0'"),
            ({"INPUT0": pair()["INPUT0"]}, "missing required input(s) ['INPUT1']"),
        ):
            with pytest.raises(ServerError) as caught:
                await server.infer(request("add_sub", **tensors))
            assert caught.value.code is ErrorCode.INVALID_ARG
            assert message in caught.value.message
        assert outputs(await server.infer(request("add_sub", **pair())))["OUTPUT0"].shape == (1, 4)

    with_server(tmp_path, check)


def test_broken_models_are_unavailable_with_a_reason_while_the_others_serve(tmp_path: Path):
    add_model(tmp_path, "good", config=ADD_SUB_CONFIG)
    (tmp_path / "missing" / "1").mkdir(parents=True)
    (tmp_path / "missing" / "config.pbtxt").write_text(ADD_SUB_CONFIG)
    (tmp_path / "corrupt" / "1").mkdir(parents=True)
    (tmp_path / "corrupt" / "1" / "model.onnx").write_bytes(b"\x08\x07not an onnx graph")
    add_model(tmp_path, "wrong_type", config=ADD_SUB_CONFIG.replace("TYPE_FP32", "TYPE_INT32", 1))
    add_model(tmp_path, "wrong_name", config=ADD_SUB_CONFIG.replace('"INPUT1"', '"INPUT9"'))
    add_model(tmp_path, "wrong_dims", config=ADD_SUB_CONFIG.replace("dims: [ 4 ] }, {", "dims: [ 5 ] }, {", 1))
    add_model(tmp_path, "bad_threads", config=ADD_SUB_CONFIG
              + 'parameters { key: "intra_op_thread_count" value: { string_value: "many" } }')
    add_model(tmp_path, "outside", config=ADD_SUB_CONFIG + 'default_model_filename: "../../good/1/model.onnx"')
    stats = tmp_path.parent / "stats.csv"
    add_model(tmp_path, "writes_outside", config=ADD_SUB_CONFIG + 'parameters { key: '
              f'"session.collect_node_memory_stats_to_file" value: {{ string_value: "{stats}" }} }}')
    expected = {
        "missing": "model file",
        "corrupt": "onnxruntime cannot load model.onnx",
        "wrong_type": "unexpected datatype TYPE_INT32 for input 'INPUT0', model provides TYPE_FP32",
        "wrong_name": "unexpected inference input 'INPUT9', allowed inputs are: INPUT0, INPUT1",
        "wrong_dims": "the model expects shape [-1, 4] but the model configuration specifies [-1, 5]",
        "bad_threads": "parameter intra_op_thread_count must be an integer, got 'many'",
        "outside": "default_model_filename '../../good/1/model.onnx' points outside the folder 'outside'",
        "writes_outside": "parameter session.collect_node_memory_stats_to_file '/",
    }

    async def check(server: Server) -> None:
        index = states(server)
        for name, fragment in expected.items():
            assert index[name]["state"] == "UNAVAILABLE", index[name]
            assert fragment in index[name]["reason"], index[name]["reason"]
            assert "\n" not in index[name]["reason"]
        assert index["good"]["state"] == "READY"
        assert outputs(await server.infer(request("good", **pair())))["OUTPUT1"].tolist() == [[-1, 0, 1, 2]]

    with_server(tmp_path, check)
    assert not stats.exists()


def test_session_settings_naming_files_are_relative_to_the_version_folder(tmp_path: Path):
    model = add_model(tmp_path, "profiled", config=ADD_SUB_CONFIG
                      + 'parameters { key: "session.collect_node_memory_stats_to_file" value: { string_value: '
                        '"stats.csv" } }')

    async def check(server: Server) -> None:
        session = server.get_version("profiled").backend_model.instances[0].engine.session
        entry = session.get_session_options().get_session_config_entry("session.collect_node_memory_stats_to_file")
        assert entry == str(model / "1" / "stats.csv")

    with_server(tmp_path, check)


def test_without_auto_complete_the_config_must_describe_the_graph(tmp_path: Path):
    add_model(tmp_path, "bare")
    add_model(tmp_path, "complete", config=ADD_SUB_CONFIG)

    async def check(server: Server) -> None:
        index = states(server)
        assert "configuration expects 0 inputs, model provides 2" in index["bare"]["reason"]
        assert index["complete"]["state"] == "READY"

    with_server(tmp_path, check, auto_complete=False)


def test_parameters_and_instance_groups_shape_the_sessions(tmp_path: Path):
    add_model(tmp_path, "tuned", config=ADD_SUB_CONFIG + """
        instance_group [ { count: 2 kind: KIND_CPU } ]
        optimization { graph { level: -1 } }
        parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
        parameters { key: "inter_op_thread_count" value: { string_value: "1" } }
        parameters { key: "session.intra_op.allow_spinning" value: { string_value: "0" } }
    """)

    async def check(server: Server) -> None:
        import onnxruntime

        instances = server.get_version("tuned").backend_model.instances
        assert [instance.name for instance in instances] == ["tuned_0_0", "tuned_0_1"]
        sessions = [instance.engine.session for instance in instances]
        assert sessions[0] is not sessions[1]
        options = sessions[0].get_session_options()
        assert (options.intra_op_num_threads, options.inter_op_num_threads) == (1, 1)
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
        assert options.graph_optimization_level == onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
        assert sessions[0].get_providers() == ["CPUExecutionProvider"]
        answers = await asyncio.gather(*(server.infer(request("tuned", **pair())) for _ in range(8)))
        assert all(outputs(a)["OUTPUT0"].tolist() == [[1, 2, 3, 4]] for a in answers)

    with_server(tmp_path, check)


def test_without_onnxruntime_the_model_is_unavailable_naming_the_extra(tmp_path: Path):
    repository = tmp_path / "repo"
    add_model(repository, "add_sub", config=ADD_SUB_CONFIG)
    hidden = tmp_path / "hide" / "onnxruntime"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('onnxruntime is hidden by the test')\n")
    script = textwrap.dedent(f"""
        import asyncio
        from pathlib import Path
        from transerve.server import Server, ServerOptions

        async def main():
            server = Server(ServerOptions([Path({str(repository)!r})], strict_readiness=False))
            await server.start()
            print(server.repository_index()[0]["reason"])
            await server.stop()

        asyncio.run(main())
    """)
    src = Path(__file__).resolve().parents[2] / "src"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hidden.parent), str(src)]))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "onnxruntime is not installed" in result.stdout and "pip install 'transerve[onnx]'" in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not visible_gpus(), reason="needs an NVIDIA GPU")
def test_gpu_instances_run_on_the_cuda_provider(tmp_path: Path):
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("needs onnxruntime-gpu")
    add_model(tmp_path, "add_sub", config=ADD_SUB_CONFIG + "instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]")

    async def check(server: Server) -> None:
        session = server.get_version("add_sub").backend_model.instances[0].engine.session
        assert session.get_providers()[0] == "CUDAExecutionProvider"
        assert outputs(await server.infer(request("add_sub", **pair())))["OUTPUT0"].tolist() == [[1, 2, 3, 4]]

    with_server(tmp_path, check)


def test_a_gpu_instance_whose_cuda_provider_fails_to_start_is_unavailable_naming_what_to_install(
    tmp_path: Path, monkeypatch
):
    """onnxruntime that lists the CUDA provider but cannot start it (its CUDA or cuDNN libraries missing) logs the
    failure and runs the session on the CPU; a KIND_GPU instance must not silently serve from the CPU. Here the
    CPU-only onnxruntime is made to list the provider, and the config's GPU made visible."""
    import onnxruntime

    import transerve.config.model_config as model_config

    monkeypatch.setattr(model_config, "visible_gpus", lambda: [0])
    listed = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: listed)
    add_model(tmp_path, "on_gpu", config=ADD_SUB_CONFIG + "instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]")
    add_model(tmp_path, "on_cpu", config=ADD_SUB_CONFIG + "instance_group [ { kind: KIND_CPU } ]")

    async def check(server: Server) -> None:
        index = states(server)
        assert index["on_gpu"]["state"] == "UNAVAILABLE"
        assert index["on_gpu"]["reason"] == (
            "failed to load 'on_gpu' version 1: instance 'on_gpu_0_0' is KIND_GPU but onnxruntime's CUDA execution "
            "provider failed to start (its CUDA or cuDNN libraries did not load; onnxruntime's log says which): "
            "pip install 'onnxruntime-gpu[cuda,cudnn]' (CUDA and cuDNN from PyPI, the versions it was built for)"
        )
        assert outputs(await server.infer(request("on_cpu", **pair())))["OUTPUT0"].tolist() == [[1, 2, 3, 4]]

    with_server(tmp_path, check)


def _no_accelerators():
    """A stand-in config for `_open_session`: only the execution accelerators are read, and it asks for none."""
    return type("Config", (), {"optimization": type("O", (), {"execution_accelerators": type(
        "A", (), {"gpu_execution_accelerator": []})()})()})()


def test_a_cuda_provider_that_raises_at_session_creation_is_unavailable_and_a_bad_model_stays_invalid(
    tmp_path: Path,
):
    from transerve.backends.base import Placement
    from transerve.backends.onnxruntime.backend import _open_session

    class FakeOrt:
        def __init__(self, error: str) -> None:
            self.error = error

        def get_available_providers(self):
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]

        def InferenceSession(self, *args, **kwargs):  # noqa: N802 - onnxruntime's name
            raise RuntimeError(self.error)

    gpu, config = Placement("m_0_0", "GPU", 0), _no_accelerators()
    missing = "libcudnn.so.9: cannot open shared object file: No such file or directory"
    with pytest.raises(ServerError) as caught:
        _open_session(FakeOrt(missing), tmp_path / "model.onnx", None, gpu, config)
    assert caught.value.code == ErrorCode.UNAVAILABLE
    assert missing in caught.value.message and "onnxruntime-gpu[cuda,cudnn]" in caught.value.message
    with pytest.raises(RuntimeError, match="Protobuf parsing failed"):
        _open_session(FakeOrt("Protobuf parsing failed"), tmp_path / "model.onnx", None, gpu, config)


def test_the_cuda_libraries_of_onnxruntime_gpu_are_preloaded_once_before_the_first_gpu_session(tmp_path: Path):
    """onnxruntime-gpu's `[cuda,cudnn]` extras install CUDA 12 and cuDNN outside the loader's path (and torch cu130
    brings CUDA 13): `preload_dlls` loads them, once, before a GPU session; a preload that fails is only logged, so
    that the session's start says what is missing; an onnxruntime without `preload_dlls` (before 1.21) is fine."""
    from transerve.backends.base import Placement
    from transerve.backends.onnxruntime.backend import _open_session

    class FakeOrt:
        def __init__(self, preload_error: Exception | None = None) -> None:
            self.preloads = 0
            self.preload_error = preload_error

        def preload_dlls(self):
            self.preloads += 1
            if self.preload_error:
                raise self.preload_error

        def get_available_providers(self):
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]

        def InferenceSession(self, path, sess_options, providers):  # noqa: N802 - onnxruntime's name
            names = [provider[0] if isinstance(provider, tuple) else provider for provider in providers]
            if "CUDAExecutionProvider" in names:
                assert self.preloads == 1, "the session started before the libraries were preloaded"
            return type("Session", (), {"get_providers": lambda _: names})()

    gpu, config = Placement("m_0_0", "GPU", 0), _no_accelerators()
    ort = FakeOrt()
    for _ in range(2):
        _open_session(ort, tmp_path / "model.onnx", None, gpu, config)
    assert ort.preloads == 1
    failing = FakeOrt(OSError("libcudnn.so.9: cannot open shared object file"))
    _open_session(failing, tmp_path / "model.onnx", None, gpu, config)
    assert failing.preloads == 1
    cpu = FakeOrt()
    _open_session(cpu, tmp_path / "model.onnx", None, Placement("m_0_0", "CPU", 0), config)
    assert cpu.preloads == 0


def _gather_model(path: Path) -> None:
    """`ids` (INT32) cast, unsqueezed and gathered from a 10-row table, and `free` (INT64) gathered from a table
    computed at run time (the table plus zero): the first bound is found from the graph, the second only when it
    fails."""
    import onnx
    from onnx import TensorProto, helper

    table = helper.make_tensor("table", TensorProto.FLOAT, [10, 2], [float(i) for i in range(20)])
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
    nodes = [
        helper.make_node("Cast", ["ids"], ["ids64"], to=TensorProto.INT64),
        helper.make_node("Unsqueeze", ["ids64", "axes"], ["ids3d"]),
        helper.make_node("Gather", ["table", "ids3d"], ["rows"], axis=0),
        helper.make_node("Add", ["table", "zero"], ["computed"]),
        helper.make_node("Gather", ["computed", "free"], ["free_rows"], axis=0),
    ]
    graph = helper.make_graph(
        nodes, "gathers",
        [helper.make_tensor_value_info("ids", TensorProto.INT32, ["b", 3]),
         helper.make_tensor_value_info("free", TensorProto.INT64, ["b", 3])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["b", 3, 1, 2]),
         helper.make_tensor_value_info("free_rows", TensorProto.FLOAT, ["b", 3, 2])],
        initializer=[table, zero, helper.make_tensor("axes", TensorProto.INT64, [1], [2])])
    path.parent.mkdir(parents=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_ids_outside_an_embedding_table_are_refused_alone_with_the_range(tmp_path: Path):
    pytest.importorskip("onnx")
    add_model(tmp_path, "tokens", "token_states",
              "max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 200000 }\n")
    _gather_model(tmp_path / "gathers" / "1" / "model.onnx")
    (tmp_path / "gathers" / "config.pbtxt").write_text("max_batch_size: 4\n")

    def tokens(*ids: int) -> InferRequest:
        row = np.array([ids], dtype=np.int64)
        return request("tokens", input_ids=("INT64", row), attention_mask=("INT64", np.ones_like(row)))

    async def check(server: Server) -> None:
        answers = await asyncio.gather(*(server.infer(tokens(*ids)) for ids in ((1, 2), (1, 100), (3, 4))),
                                       return_exceptions=True)
        assert outputs(answers[0])["hidden"].shape == outputs(answers[2])["hidden"].shape == (1, 2, 3)
        assert isinstance(answers[1], ServerError) and answers[1].code == ErrorCode.INVALID_ARG
        assert answers[1].message == ("input 'input_ids' holds id 100, outside the vocabulary (0..99) of the "
                                      "embedding table 'embedding.weight'")
        # One batch of the three: the bad one was answered alone, the other two ran together.
        assert [b["batch_size"] for b in server.statistics("tokens")["model_stats"][0]["batch_stats"]] == [3]

        good = {"ids": ("INT32", np.array([[0, 9, 3]], np.int32)), "free": ("INT64", np.array([[0, 1, 9]]))}
        assert outputs(await server.infer(request("gathers", **good)))["rows"][0, 1, 0].tolist() == [18.0, 19.0]
        with pytest.raises(ServerError) as caught:  # found through the Cast and the Unsqueeze
            await server.infer(request("gathers", **(good | {"ids": ("INT32", np.array([[0, 10, 1]], np.int32))})))
        assert caught.value.code == ErrorCode.INVALID_ARG
        assert caught.value.message.startswith("input 'ids' holds id 10, outside the vocabulary (0..9)")
        with pytest.raises(ServerError) as caught:  # a computed table: onnxruntime's own refusal, still a 400
            await server.infer(request("gathers", **(good | {"free": ("INT64", np.array([[0, 1, 10]]))})))
        assert caught.value.code == ErrorCode.INVALID_ARG
        assert caught.value.message.startswith("an input holds an id outside its embedding table: ")
        assert "out of data bounds" in caught.value.message

    with_server(tmp_path, check)
