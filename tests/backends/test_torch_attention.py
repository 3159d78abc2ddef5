"""cuDNN's attention kernel is turned off wherever transerve loads a torch model onto a GPU (`torch_attention`):
it builds a plan per shape, and decoding and variable-length encoders bring a new shape nearly every call. No GPU
here: loading onto `cuda` fails after the switch, which is what these tests look at."""

from __future__ import annotations

from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2

from transerve.backends.base import Placement
from transerve.backends.torch_attention import use_decoding_attention

torch = pytest.importorskip("torch")


@pytest.fixture
def switches(monkeypatch) -> list[bool]:
    """What `enable_cudnn_sdp` was called with; the kernel starts enabled."""
    calls: list[bool] = []
    state = {"enabled": True}

    def enable(value: bool) -> None:
        calls.append(value)
        state["enabled"] = value

    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", enable)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: state["enabled"])
    return calls


def test_only_cuda_devices_turn_it_off_and_once(switches):
    use_decoding_attention(torch, torch.device("cpu"))
    assert switches == []
    use_decoding_attention(torch, torch.device("cuda", 0))
    use_decoding_attention(torch, torch.device("cuda", 1))
    assert switches == [False]


def test_loading_a_generation_engine_onto_a_gpu_turns_it_off(switches, tmp_path: Path):
    pytest.importorskip("transformers")
    from support.generation_models import build_generation_model

    from transerve.backends.generation.torch.engine import TorchEngine

    model = build_generation_model("gpt2", tmp_path / "gpt2")
    if torch.cuda.is_available():
        TorchEngine(model, device="cuda:0").close()
    else:
        with pytest.raises((AssertionError, RuntimeError)):  # this torch has no CUDA: the move to the GPU fails
            TorchEngine(model, device="cuda:0")
    assert switches == [False]


def test_loading_a_pytorch_backend_gpu_instance_turns_it_off(switches, tmp_path: Path, monkeypatch):
    from transerve.backends.pytorch import backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the device check; the load itself then fails
    config = model_config_pb2.ModelConfig(name="m")
    with pytest.raises(ValueError, match="does not exist"):
        backend._open(torch, tmp_path / "missing.pt", Placement("m_0", "GPU", 0), config, backend._Settings(config))
    assert switches == [False]
    switches.clear()
    with pytest.raises(ValueError, match="does not exist"):
        backend._open(torch, tmp_path / "missing.pt", Placement("m_0", "CPU", 0), config, backend._Settings(config))
    assert switches == []
