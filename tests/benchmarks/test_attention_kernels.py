"""benchmarks/common/attention_kernels.py: gpu_check's record of which attention kernel each kind of call can take.
On the CPU torch's CUDA checks refuse every call, so the verdicts here are all "math"; on a GPU gpu_check prints
them."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_calls_are_counted_by_signature_from_every_thread_and_still_computed(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT))  # benchmarks run as modules from the repository root
    from benchmarks.common.attention_kernels import attention_calls

    query, key = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 5, 8)
    mask = torch.zeros(2, 1, 1, 5, dtype=torch.bool)
    mask[:, :, :, :3] = True
    original = torch.nn.functional.scaled_dot_product_attention
    expected = original(query, key, key, attn_mask=mask)
    with attention_calls() as report:
        assert torch.nn.functional.scaled_dot_product_attention is not original
        out = torch.nn.functional.scaled_dot_product_attention(query, key, key, attn_mask=mask)
        worker = threading.Thread(target=torch.nn.functional.scaled_dot_product_attention, args=(query, key, key),
                                  kwargs={"attn_mask": mask})
        worker.start()
        worker.join()
        torch.nn.functional.scaled_dot_product_attention(query, key, key, is_causal=False)
    assert torch.equal(out, expected)
    assert torch.nn.functional.scaled_dot_product_attention is original  # put back
    assert sorted(s.calls for s in report.signatures.values()) == [1, 2]
    lines = report.lines()
    assert lines[0].startswith("      2 calls  math") and "mask (2, 1, 1, 5)/(5, 5, 5, 1)/bool" in lines[0]
    assert all(s.checked and not any(s.allowed.values()) for s in report.signatures.values())
    assert any("efficient: " in line for line in lines)  # why each fused kernel refused, once per reason
