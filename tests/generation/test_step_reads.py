"""A decoding step's token selection reads the device once: on a GPU every read waits for the device, so the
chosen tokens, beam search's candidates and the `top_logprobs` of every row come back in one copy. Checked with
logits on torch's meta device, where a tensor has no values: every read must go through the one copy counted
here, and any other (`item`, `bool`, `tolist`) would fail."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transerve.backends.generation.engine import DecodingOptions, GenerationRequest  # noqa: E402
from transerve.backends.generation.torch_selection import choose  # noqa: E402

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
