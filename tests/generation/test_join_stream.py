"""The handover of rows the joining thread computes: on a GPU they come from a CUDA stream of their own, and the
decoding stream must neither read them early nor let their memory be reused while it still reads them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from transerve.backends.generation.torch.decoder_batch import DecoderBatch  # noqa: E402
from transerve.backends.generation.torch.join_stream import JoinStream  # noqa: E402


def batch_on(device: str, value: float, rows: int = 2) -> DecoderBatch:
    kv = [(torch.full((rows, 2, 3, 4), value, device=device), torch.full((rows, 2, 3, 4), -value, device=device))]
    return DecoderBatch(kv, torch.ones(rows, 3, dtype=torch.long, device=device),
                        torch.full((rows,), 3, dtype=torch.long, device=device), cross_kv=kv,
                        encoder_hidden=torch.zeros(rows, 5, 8, device=device),
                        encoder_mask=torch.ones(rows, 5, dtype=torch.long, device=device), lengths=[3] * rows,
                        sources=[5] * rows)


def test_the_batch_names_every_tensor_it_holds():
    batch = batch_on("cpu", 1.0)
    held = [id(t) for t in batch.tensors()]
    expected = [batch.self_kv[0][0], batch.self_kv[0][1], batch.cross_kv[0][0], batch.cross_kv[0][1], batch.mask,
                batch.positions, batch.encoder_hidden, batch.encoder_mask]
    assert held == [id(t) for t in expected]
    decoder_only = DecoderBatch([], batch.mask, batch.positions)
    assert [id(t) for t in decoder_only.tensors()] == [id(batch.mask), id(batch.positions)]


def test_on_the_cpu_rows_pass_as_they_are():
    stream = JoinStream(torch.device("cpu"))
    assert stream.stream is None
    with stream.joining():
        batch, first = batch_on("cpu", 2.0), torch.zeros(2, dtype=torch.long)
        prepared = stream.prepared(batch, first)
    assert prepared.ready is None
    received = JoinStream.receive(prepared)
    assert received[0] is batch and received[1] is first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_decoding_stream_reads_rows_only_once_the_joining_stream_wrote_them():
    device = torch.device("cuda")
    join = JoinStream(device)
    assert join.stream is not None and join.stream != torch.cuda.current_stream()
    with join.joining():
        assert torch.cuda.current_stream() == join.stream
        torch.cuda._sleep(200_000_000)  # the joining stream is busy for a while (~0.1 s) before it writes
        batch, first = batch_on("cuda", 7.0), torch.arange(2, device=device)
        prepared = join.prepared(batch, first)
    assert prepared.ready is not None and not prepared.ready.query()
    received, first_received = JoinStream.receive(prepared)
    # Read on the decoding stream right after the handover: without the wait they would read unwritten memory.
    assert float(received.self_kv[0][0].sum()) == 7.0 * received.self_kv[0][0].numel()
    assert first_received.tolist() == [0, 1]
    # Freed after decoding work that reads it was queued: the allocator gives that memory to the joining stream
    # only once that work is done (record_stream), so a new tensor there cannot overwrite what is read.
    torch.cuda._sleep(200_000_000)
    copy = received.self_kv[0][0] * 1
    del batch, received, prepared
    with join.joining():
        torch.full((2, 2, 3, 4), -1.0, device=device)
    torch.cuda.synchronize()
    assert float(copy.sum()) == 7.0 * copy.numel()
