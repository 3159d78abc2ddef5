"""Decoding-step self-attention in groups of rows (`row_groups`): the plan, and steps that give the logits one
attention call over the whole window gives, on every architecture the engine serves."""

from __future__ import annotations

import random

import pytest

from transerve.backends.generation.row_groups import MAX_BLOCKS, Group, plan


def reads(groups: list[Group], group_cost: int) -> int:
    return sum((g.stop - g.start) * g.window for g in groups) + group_cost * (len(groups) - 1)


def test_rows_of_like_length_stay_one_group():
    assert plan([10] * 8) == [Group(0, 8, 10)]
    assert plan([]) == []
    assert plan([7]) == [Group(0, 1, 7)]


def test_rows_far_apart_in_length_split_where_it_reads_less():
    assert plan([100, 100, 100, 5, 5, 5], group_cost=64) == [Group(0, 3, 100), Group(3, 6, 5)]
    assert plan([100, 100, 100, 90, 50], group_cost=64) == [Group(0, 5, 100)]  # saves 50 < a call's cost


@pytest.mark.parametrize("rows", [1, 2, 5, 31, 32, 33, 100, 256])
def test_groups_cover_every_row_in_order_and_never_read_more_than_one_call(rows):
    generator = random.Random(rows)
    for _ in range(20):
        lengths = [generator.randint(1, 300) for _ in range(rows)]
        groups = plan(lengths)
        assert groups[0].start == 0 and groups[-1].stop == rows
        assert all(a.stop == b.start for a, b in zip(groups, groups[1:], strict=False))
        assert all(g.window == max(lengths[g.start:g.stop]) for g in groups)
        assert reads(groups, 64) <= rows * max(lengths)
        assert len(groups) <= MAX_BLOCKS


def test_planning_finds_the_cheapest_split_of_a_few_rows():
    generator = random.Random(3)
    for _ in range(50):
        lengths = [generator.randint(1, 200) for _ in range(6)]
        best = min(
            reads([Group(a, b, max(lengths[a:b])) for a, b in zip(cuts, cuts[1:], strict=False)], 64)
            for mask in range(32)
            for cuts in [[0] + [i + 1 for i in range(5) if mask >> i & 1] + [6]]
        )
        assert reads(plan(lengths, 64), 64) == best


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.generation_models import ARCHITECTURES  # noqa: E402

from transerve.backends.generation import decoder_batch, row_groups  # noqa: E402
from transerve.backends.generation.decoder_batch import ModelRunner  # noqa: E402
from transerve.backends.generation.torch_runner import load  # noqa: E402


def decode(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Sequences joining two steps apart (so their histories differ), each step's logits; greedy tokens fed."""
    logits_per_step, batch, tokens = [], None, None
    with torch.inference_mode():
        for step in range(8):
            if step < 2 * len(prompts) and step % 2 == 0:
                new, first = runner.new_rows([prompts[step // 2]], [1])
                if runner.encoder_decoder:
                    tokens = first if tokens is None else torch.cat((tokens, first))
                if batch is None:
                    batch = new
                else:
                    batch.extend(new)
                if not runner.encoder_decoder:  # the prompt's logits come from prefill; its first token joins
                    chosen = first.argmax(-1)
                    tokens = chosen if tokens is None else torch.cat((tokens, chosen))
            logits = runner.step(batch, tokens)
            logits_per_step.append(logits.clone())
            tokens = logits.argmax(-1)
    return logits_per_step


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_grouped_steps_give_the_logits_of_one_call_over_the_window(models, arch, monkeypatch):
    model, _, facts = load(models[arch].path, "cpu", "float32", onednn_linear=False)
    assert model.config._attn_implementation == row_groups.GROUPED_SDPA
    runner = ModelRunner(model, facts.start_id, facts.pad_id)
    assert runner.row_groups
    prompts = [models[arch].ids(text) for text in ("The quick brown fox jumps over the lazy dog " * 3, "Hi", "A b")]
    plans: list[int] = []

    def free_calls(lengths: list[int]) -> list[row_groups.Group]:  # a group per distinct history
        groups = row_groups.plan(lengths, group_cost=0)
        plans.append(len(groups))
        return groups

    monkeypatch.setattr(decoder_batch, "plan", free_calls)
    grouped = decode(runner, prompts)
    assert max(plans) >= 2  # steps ran in several groups
    runner.row_groups = False
    whole = decode(runner, prompts)
    assert len(grouped) == len(whole)
    for mine, reference in zip(grouped, whole, strict=True):
        torch.testing.assert_close(mine, reference, atol=1e-4, rtol=1e-4)  # summed in another order
        assert mine.argmax(-1).tolist() == reference.argmax(-1).tolist()
