"""oneDNN linear layers against torch's own, whatever the number of rows (fewer than the packed kernels' minimum
are padded) and the input's shape."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.pytorch_utils import Conv1D  # noqa: E402

from transerve.backends.generation.torch.onednn_linear import (  # noqa: E402
    MIN_PACKED_ROWS,
    onednn_available,
    use_onednn_linears,
)

pytestmark = pytest.mark.skipif(not onednn_available(torch), reason="this torch build has no oneDNN linear op")


def _model() -> torch.nn.Module:
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), Conv1D(16, 40), torch.nn.Linear(16, 8, bias=False))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model.eval()


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (2, 24), (MIN_PACKED_ROWS, 24), (7, 24), (1, 1, 24), (2, 3, 24)])
def test_outputs_equal_torch_linear(pack, shape):
    reference, model = _model(), _model()
    assert use_onednn_linears(model, pack=pack) == 3
    assert all(type(module).__name__ == "OneDnnLinear" and module.packed == pack for module in model)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got, expected = model(x), reference(x)
    assert got.shape == expected.shape == (*shape[:-1], 8)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-3)
