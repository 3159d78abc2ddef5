"""A decoding step's token selection reads the device once: on a GPU every read waits for the device, so the
chosen tokens, beam search's candidates and the `top_logprobs` of every row come back in one copy. Checked with
logits on torch's meta device, where a tensor has no values: every read must go through the one copy counted
here, and any other (`item`, `bool`, `tolist`) would fail. Nor does a step wait for the device when it copies
host data in (the next tokens, the rows that stay, the token rules' indices): checked on the meta device by the
ways such a copy is made, and on a GPU (when there is one) by torch's sync debug mode."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transerve.backends.generation.engine import DecodingOptions, GenerationRequest  # noqa: E402
from transerve.backends.generation.torch.selection import choose  # noqa: E402

OPTIONS = [
    DecodingOptions(max_new_tokens=8),
    DecodingOptions(max_new_tokens=8, beam_width=3, num_return_sequences=2, repetition_penalty=1.3),
    DecodingOptions(max_new_tokens=8, top_logprobs=4, return_log_probs=True),
    DecodingOptions(max_new_tokens=8, beam_width=2, end_ids=[3, 4], stop_sequences=[[7, 8]]),
    DecodingOptions(max_new_tokens=8, stop_sequences=[[7, 8]], bad_words=[[9]]),
]


@pytest.mark.parametrize("arch", ["gpt2", "t5"])
def test_a_step_of_greedy_beam_and_top_logprobs_rows_reads_the_device_once(models, arch, monkeypatch):
    engine = models[arch].engine
    running = [engine.scheduler.new_sequence(GenerationRequest([5, 6, 7], options), None, lambda outcome: None)
               for options in OPTIONS]
    rows = sum(sequence.rows for sequence in running)
    reads = []
    tolist = torch.Tensor.tolist

    def counted(tensor):
        if tensor.device.type != "meta":
            return tolist(tensor)
        reads.append(tuple(tensor.shape))
        return [float(index % 50) for index in range(tensor.numel())]  # ids and log-probabilities alike

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    for step in range(3):
        reads.clear()
        choices = choose(running, torch.empty((rows, engine.vocab_size), device="meta"))
        assert len(reads) == 1, f"step {step}: {len(reads)} reads of the device"
        # one copy: each row's token and log-probability, each beam row's candidates, the asked top_logprobs
        beam_rows = sum(sequence.rows for sequence in running if sequence.beam is not None)
        keep = max(sequence.beam.keep for sequence in running if sequence.beam is not None)
        assert reads[0] == (2 * rows + 2 * beam_rows * keep + 2 * 4,)
        assert len(choices.tokens) == rows
        assert running[2].top and len(running[2].top[-1]) == 4


RULES = [
    DecodingOptions(max_new_tokens=8, repetition_penalty=1.3, bad_words=[[9], [5, 6]], min_new_tokens=4),
    DecodingOptions(max_new_tokens=8, beam_width=2, repetition_penalty=1.2, min_new_tokens=2),
    DecodingOptions(max_new_tokens=8),
]


def ruled_sequences(engine):
    """Sequences of `RULES`, each also with a model's rules (from its generation config): no repeated bigrams, a
    forced first token, and forced end tokens at the last step (the second of two here)."""
    running = [engine.scheduler.new_sequence(GenerationRequest([5, 6, 7], options), None, lambda outcome: None)
               for options in RULES]
    for sequence in running:
        sequence.rules = dataclasses.replace(sequence.rules, no_repeat_ngram_size=2, forced_first=5,
                                             forced_last=[2, 3], max_new_tokens=2)
    return running


class HostCopies:
    """Records the ways host data reaches the meta device (our stand-in for a GPU) that would wait for a GPU: a
    tensor made on the device from host values (`torch.tensor(..., device=)`, `new_tensor`), a list or host tensor
    used to index a device tensor (torch copies it in), and a copy that is not `non_blocking`."""

    def __init__(self, monkeypatch):
        from torch.utils._python_dispatch import TorchDispatchMode

        waits = self.waits = []

        def on_device(tensor):
            return isinstance(tensor, torch.Tensor) and tensor.device.type == "meta"

        def host_index(index):
            parts = index if isinstance(index, tuple) else (index,)
            return any(isinstance(part, list) or (isinstance(part, torch.Tensor) and part.device.type == "cpu"
                                                  and part.dim() > 0) for part in parts)

        def watched(name, method, check):
            def call(*args, **kwargs):
                if self.on and check(*args, **kwargs):
                    waits.append(name)
                return method(*args, **kwargs)
            return call

        tensor = torch.tensor
        monkeypatch.setattr(torch, "tensor", watched("torch.tensor", tensor, lambda *a, device=None, **k: (
            device is not None and torch.device(device).type == "meta")))
        monkeypatch.setattr(torch.Tensor, "new_tensor", watched("new_tensor", torch.Tensor.new_tensor,
                                                                lambda self, *a, **k: on_device(self)))
        for name in ("__getitem__", "__setitem__"):
            monkeypatch.setattr(torch.Tensor, name, watched(name, getattr(torch.Tensor, name),
                                                            lambda self, index, *a: on_device(self)
                                                            and host_index(index)))

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func.__name__.split(".")[0] in ("_to_copy", "copy_") and not kwargs.get("non_blocking", False):
                    source = args[-1] if func.__name__.startswith("copy_") else args[0]
                    target = args[0] if func.__name__.startswith("copy_") else None
                    if source.device.type == "cpu" and (
                            kwargs.get("device") == torch.device("meta") or on_device(target)):
                        waits.append(func.__name__)
                return func(*args, **kwargs)

        self.mode = Mode()
        self.on = False

    def __enter__(self):
        self.on = True
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.on = False
        return self.mode.__exit__(*exc)


def test_a_steps_copies_to_the_device_do_not_wait_for_it(models, monkeypatch):
    """Besides its one read, a step copies host data to the device: the next tokens, the rows that stay and the
    token rules' indices. On a GPU a copy of ordinary host memory, or a list used as an index, waits for the
    device; each of those goes non-blocking from pinned memory instead (`host_copies.to_device`)."""
    from transerve.backends.generation.torch.batch_runner import BatchRunner
    from transerve.backends.generation.torch.cache_buffers import select_rows
    from transerve.backends.generation.torch.decoder_batch import DecoderBatch

    engine = models["t5"].engine
    running = ruled_sequences(engine)
    rows = sum(sequence.rows for sequence in running)
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda tensor: tolist(tensor) if tensor.device.type != "meta"
                        else [float(i % 50) for i in range(tensor.numel())])
    meta = torch.device("meta")
    runner = BatchRunner(engine.runner.forward, engine.runner.threads)
    runner.device = meta
    copies = HostCopies(monkeypatch)
    for step in range(3):
        logits = torch.empty((rows, engine.vocab_size), device=meta)
        kv = [(torch.empty((rows, 2, 4, 8), device=meta), torch.empty((rows, 2, 4, 8), device=meta))]
        runner.batch = DecoderBatch(kv, torch.ones((rows, 4), device=meta, dtype=torch.long),
                                    torch.zeros(rows, device=meta, dtype=torch.long), lengths=[4] * rows)
        with copies:
            choices = choose(running, logits)
            keep = list(range(rows))[::-1][: rows - 1]  # rows leave and move
            runner.feed(keep, [choices.tokens[row] for row in keep], same_sequences=False)
            select_rows(torch.arange(rows, device=meta), [1, 0, *range(2, rows)])
        assert runner.next_tokens.device == meta and runner.batch.rows == rows - 1, step
    assert sorted(set(copies.waits)) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_a_step_synchronises_only_for_its_one_read(models, monkeypatch):
    """The same step on CUDA under torch's sync debug mode, which raises on any synchronising call but the one
    read (allowed here)."""
    from transerve.backends.generation.torch.batch_runner import BatchRunner
    from transerve.backends.generation.torch.decoder_batch import DecoderBatch

    engine = models["t5"].engine
    running = ruled_sequences(engine)
    rows = sum(sequence.rows for sequence in running)
    cuda = torch.device("cuda")
    tolist = torch.Tensor.tolist

    def one_read(tensor):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return tolist(tensor)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    runner = BatchRunner(engine.runner.forward, engine.runner.threads)
    runner.device = cuda
    kv = [(torch.zeros((rows, 2, 4, 8), device=cuda), torch.zeros((rows, 2, 4, 8), device=cuda))]
    runner.batch = DecoderBatch(kv, torch.ones((rows, 4), device=cuda, dtype=torch.long),
                                torch.zeros(rows, device=cuda, dtype=torch.long), lengths=[4] * rows)
    logits = torch.randn((rows, engine.vocab_size), device=cuda)
    monkeypatch.setattr(torch.Tensor, "tolist", one_read)
    torch.cuda.set_sync_debug_mode("error")
    try:
        choices = choose(running, logits)
        keep = list(range(rows))[::-1][: rows - 1]
        runner.feed(keep, [choices.tokens[row] for row in keep], same_sequences=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert tolist(runner.next_tokens) == [choices.tokens[row] for row in keep]
