"""The warm-up decode at load (`load_probe`): an engine that cannot decode on its device is UNAVAILABLE at load with
the reason, the rest of the repository serves, and what the warm-up adds to a load stays small."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from support.generation_models import build_generation_model
from support.in_process import outputs, request, states, with_server

from transerve.backends.generation.engine import GenerationResult, Hypothesis
from transerve.backends.generation.load_probe import install_hint, probe
from transerve.core.errors import ErrorCode, ServerError, internal
from transerve.server import Server

#: What CTranslate2 4.8.5 (built for CUDA 12) says at its first decode on a host with only CUDA 13's cuBLAS.
CUBLAS_MISSING = "Library libcublas.so.12 is not found or cannot be loaded"
INTERFACE = """
input [
  { name: "input_ids" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "sequence_length" data_type: TYPE_UINT32 dims: [ 1 ] }
]
output [
  { name: "output_ids" data_type: TYPE_UINT32 dims: [ -1, -1 ] },
  { name: "sequence_length" data_type: TYPE_UINT32 dims: [ -1 ] }
]
"""


class FakeEngine:
    """Answers each submitted sequence with `outcome`, or never when it is None."""

    max_input_length = 512

    def __init__(self, outcome: GenerationResult | Exception | None) -> None:
        self.outcome = outcome
        self.submitted = []

    def submit(self, request, on_tokens, done):
        self.submitted.append(request)
        if self.outcome is not None:
            done(self.outcome)

    def close(self) -> None:
        pass


def test_a_decode_that_works_passes_and_asks_few_tokens():
    engine = FakeEngine(GenerationResult([Hypothesis([5, 6])]))
    probe(engine, "cpu")
    (asked,) = engine.submitted
    assert asked.options.max_new_tokens == 2 and asked.input_ids and not asked.stream


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (internal(f"CTranslate2 failed: {CUBLAS_MISSING}"),
         f"the engine cannot decode on cuda:0: CTranslate2 failed: {CUBLAS_MISSING}; install CUDA 12's cuBLAS: "
         "pip install 'transerve[gpu]'"),
        (RuntimeError("CUDA error: no kernel image is available\nfor execution"),
         "the engine cannot decode on cuda:0: RuntimeError: CUDA error: no kernel image is available for execution"),
    ],
)
def test_a_failed_decode_is_unavailable_with_the_reason_on_one_line(error, words):
    with pytest.raises(ServerError) as caught:
        probe(FakeEngine(error), "cuda:0")
    assert caught.value.code == ErrorCode.UNAVAILABLE
    assert caught.value.message.startswith(words)
    assert "\n" not in caught.value.message


def test_a_decode_that_never_ends_is_unavailable_after_the_timeout():
    with pytest.raises(ServerError, match=r"the warm-up decode on cuda:1 did not finish within 0.05 s"):
        probe(FakeEngine(None), "cuda:1", timeout=0.05)


@pytest.mark.parametrize(
    ("message", "hint"),
    [
        (CUBLAS_MISSING, "transerve[gpu]"),
        ("libcublasLt.so.12: cannot open shared object file", "transerve[gpu]"),
        ("libcudnn_ops.so.9: cannot open shared object file", "the CUDA libraries the engine was built for"),
        ("CUDA out of memory", None),
        ("the input has no tokens", None),
    ],
)
def test_install_hints_name_what_to_install_for_a_missing_library(message, hint):
    found = install_hint(message)
    assert found is None if hint is None else hint in found


# -- served: the load path of a real Server in process ----------------------------------------------------------------


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    """t5 served by both engines, each also as a copy named `broken_*` that the tests break."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("probe_models")
    hf_dir = build_generation_model("t5", root / "t5")
    ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(root / "t5_ct2"), quantization="float32")
    repo = root / "repo"
    for name, (source, engine) in {
        "t5_ct2": ("t5_ct2", "ctranslate2"), "broken_ct2": ("t5_ct2", "ctranslate2"),
        "t5_torch": ("t5", "torch"), "broken_torch": ("t5", "torch"),
    }.items():
        shutil.copytree(root / source, repo / name / "1" / "model")
        (repo / name / "config.pbtxt").write_text(
            f'name: "{name}" backend: "generation" max_batch_size: 4\n{INTERFACE}'
            f'parameters {{ key: "engine" value {{ string_value: "{engine}" }} }}\n'
            'parameters { key: "intra_op_threads" value { string_value: "1" } }\n'
            "instance_group [{ kind: KIND_CPU count: 2 }]\n"
        )
    return repo


def test_engines_whose_library_fails_at_the_first_decode_are_unavailable_and_the_rest_serves(repository, monkeypatch):
    """The CTranslate2 model fails as it did on a CUDA 13 host (the library is loaded at the first decode, not at
    load); the torch model's step fails as a device failure would. Neither is listed READY."""
    from transerve.backends.generation.ctranslate2.engine import CTranslate2Engine
    from transerve.backends.generation.torch.engine import TorchEngine

    call, torch_init = CTranslate2Engine._call, TorchEngine.__init__

    def failing_call(self, model, batch):
        if "broken" in self._load_args[0]:
            raise RuntimeError(CUBLAS_MISSING)
        return call(self, model, batch)

    def breaking_init(self, model_dir, *args, **kwargs):
        torch_init(self, model_dir, *args, **kwargs)
        if "broken" in str(model_dir):
            def step(new, prompts=None):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

            self.runner.step = step

    monkeypatch.setattr(CTranslate2Engine, "_call", failing_call)
    monkeypatch.setattr(TorchEngine, "__init__", breaking_init)

    async def check(server: Server) -> None:
        index = states(server)
        assert index["broken_ct2"]["state"] == "UNAVAILABLE"
        assert index["broken_ct2"]["reason"] == (
            "failed to load 'broken_ct2' version 1: the engine cannot decode on cpu: CTranslate2 failed: "
            f"{CUBLAS_MISSING}; install CUDA 12's cuBLAS: pip install 'transerve[gpu]' (docs/generation.md, "
            "'On a GPU')"
        )
        assert index["broken_torch"]["state"] == "UNAVAILABLE"
        assert index["broken_torch"]["reason"] == (
            "failed to load 'broken_torch' version 1: the engine cannot decode on cpu: generation failed: "
            "CUDA error: an illegal memory access was encountered"
        )
        for name in ("t5_ct2", "t5_torch"):
            assert index[name]["state"] == "READY"
            ids = np.array([[5, 6, 7, 1]], dtype=np.uint32)
            got = outputs(await server.infer(request(name, input_ids=("UINT32", ids),
                                                     sequence_length=("UINT32", np.array([[4]], np.uint32)))))
            assert got["sequence_length"][0][0] > 0

    with_server(repository, check)


def test_the_warm_up_adds_little_to_a_load_on_the_cpu(repository, monkeypatch):
    """Both engines' tiny models load with and without the warm-up decode (two instances each): what it adds is
    printed (run with -s) and bounded loosely, as a 2-core machine shared with other work is noisy."""
    import transerve.backends.generation.backend as backend

    async def check(server: Server) -> None:
        assert all(entry["state"] == "READY" for entry in states(server).values())

    def load_seconds() -> float:
        begun = time.perf_counter()
        with_server(repository, check)
        return time.perf_counter() - begun

    with_probe = min(load_seconds() for _ in range(2))
    monkeypatch.setattr(backend, "probe", lambda engine, device: None)
    without = min(load_seconds() for _ in range(2))
    print(f"\nload of 8 instances (4 models x 2): {without:.2f} s without the warm-up, {with_probe:.2f} s with it")
    assert with_probe - without < 5.0
