"""The torch engine's KV cache buffers: every in-place operation gives what the copying one gives, and writes in
place exactly when the buffer is ours and has room."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from transerve.backends.generation.torch.cache_buffers import (  # noqa: E402
    HEADROOM,
    append,
    buffer_rows,
    fewest_moves,
    join_rows,
    keep_rows,
    room,
    row_capacity,
    select_rows,
    window,
)

HEADS, DIM = 2, 4


def kv(rows: int, time: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, HEADS, time, DIM, generator=generator)


def slotted(values: torch.Tensor, capacity_rows: int, capacity_time: int, start: int) -> torch.Tensor:
    """`values` as a view of a larger buffer, the way the engine holds its caches."""
    rows, _, time, _ = values.shape
    buffer = torch.full((capacity_rows, HEADS, capacity_time, DIM), 7.0)
    buffer[:rows, :, start:start + time] = values
    return buffer[:rows, :, start:start + time]


def padded(values: torch.Tensor, time: int, left: bool) -> torch.Tensor:
    missing = time - values.shape[2]
    return torch.nn.functional.pad(values, (0, 0, missing, 0) if left else (0, 0, 0, missing))


def test_window_row_capacity_and_room_describe_our_buffers_only():
    cache = slotted(kv(3, 5), capacity_rows=8, capacity_time=20, start=4)
    assert window(cache) == (4, 20)
    assert room(cache) == 16
    assert row_capacity(cache) == 8
    fused = torch.randn(3, 5, 3 * HEADS * DIM)[..., : HEADS * DIM].view(3, 5, HEADS, DIM).transpose(1, 2)
    assert window(fused) is None and room(fused) == 0 and row_capacity(fused) == 0
    assert window(slotted(kv(3, 5), 8, 20, 0)[1:]) is None  # not the buffer's first rows


def test_append_writes_in_place_when_there_is_room_and_reallocates_with_spare_rows_otherwise():
    cache, new = kv(3, 5), kv(3, 1, seed=1)
    grown = append(cache, new, rows_wanted=8)  # a plain tensor has no room: a buffer with spare rows and steps
    assert torch.equal(grown, torch.cat((cache, new), dim=2))
    assert row_capacity(grown) == 8 and room(grown) == 6 + HEADROOM
    again = append(grown, kv(3, 1, seed=2), rows_wanted=8)
    assert again.untyped_storage().data_ptr() == grown.untyped_storage().data_ptr()
    assert torch.equal(again[:, :, :6], grown) and torch.equal(again[:, :, 6:], kv(3, 1, seed=2))


def test_a_token_budget_bounds_the_spare_rows_of_long_buffers():
    assert buffer_rows(3, 32, 100, 0) == 32  # no budget: every row the batch could have
    assert buffer_rows(3, 32, 100, 1000) == 10  # 32 rows of 100 steps would hold 3,200 tokens: 10 rows do 1,000
    assert buffer_rows(3, 32, 10, 1000) == 32
    assert buffer_rows(12, 32, 100, 1000) == 12  # never fewer rows than run
    cache = append(kv(2, 40), kv(2, 1, seed=1), rows_wanted=32, token_budget=8 * (41 + HEADROOM))
    assert row_capacity(cache) == 8 and torch.equal(cache[:, :, :40], kv(2, 40))
    joined = join_rows(kv(2, 40), kv(1, 30, seed=2), (2, 1), 40, True, rows_wanted=32, token_budget=5 * (40 + HEADROOM))
    assert row_capacity(joined) == 5 and torch.equal(joined[2:, :, 10:], kv(1, 30, seed=2))


@pytest.mark.parametrize(
    "index",
    [[0, 2, 3], [3, 1, 2], [1, 1, 0, 3], [0, 1, 2, 3], [2]],
    ids=["leave-shift", "leave-fill", "beams-repeat", "unchanged", "one-left"],
)
def test_keep_rows_in_place_equals_index_select(index):
    values = kv(4, 5)
    cache = slotted(values, capacity_rows=8, capacity_time=12, start=3)
    storage = cache.untyped_storage().data_ptr()
    kept = keep_rows(cache, select_rows(torch.tensor(index)))
    assert torch.equal(kept, values[index])
    assert kept.untyped_storage().data_ptr() == storage


def test_keep_rows_copies_only_rows_that_change_place(monkeypatch):
    cache = slotted(kv(4, 5), capacity_rows=8, capacity_time=12, start=3)
    written = []
    original = torch.Tensor.index_copy_

    def spy(self, dim, index, source):
        written.append(index.tolist())
        return original(self, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy_", spy)
    keep_rows(cache, select_rows(torch.tensor([0, 3, 2])))
    assert written == [[1]]


def test_keep_rows_gathers_into_a_new_tensor_when_rows_grow_or_the_layout_is_not_ours():
    values = kv(2, 5)
    cache = slotted(values, 8, 12, 0)
    more = keep_rows(cache, select_rows(torch.tensor([0, 0, 1])))
    assert torch.equal(more, values[[0, 0, 1]]) and torch.equal(cache, values)
    foreign = values.transpose(0, 1).contiguous().transpose(0, 1)  # rows not outermost
    kept = keep_rows(foreign, select_rows(torch.tensor([1, 0])))
    assert torch.equal(kept, values[[1, 0]]) and torch.equal(foreign, values)


@pytest.mark.parametrize("left", [True, False], ids=["self-attention", "cross-attention"])
@pytest.mark.parametrize("their_time", [3, 5, 7])
def test_join_rows_in_place_equals_padding_and_concatenating(left, their_time):
    mine_values, theirs = kv(3, 5), kv(2, their_time, seed=1)
    start = 4 if left else 0  # room on the side the window widens to
    mine = slotted(mine_values, capacity_rows=8, capacity_time=16, start=start)
    time = max(5, their_time)
    joined = join_rows(mine, theirs, (3, 2), time, left, rows_wanted=8)
    expected = torch.cat((padded(mine_values, time, left), padded(theirs, time, left)))
    assert torch.equal(joined, expected)
    assert joined.untyped_storage().data_ptr() == mine.untyped_storage().data_ptr()


def test_join_rows_reallocates_when_rows_or_steps_do_not_fit():
    mine_values, theirs = kv(3, 5), kv(2, 9, seed=1)
    mine = slotted(mine_values, capacity_rows=8, capacity_time=16, start=2)  # 4 steps of room on the left, 9 needed
    joined = join_rows(mine, theirs, (3, 2), 9, True, rows_wanted=8)
    assert torch.equal(joined, torch.cat((padded(mine_values, 9, True), theirs)))
    assert joined.untyped_storage().data_ptr() != mine.untyped_storage().data_ptr()
    assert row_capacity(joined) == 8
    full = slotted(mine_values, capacity_rows=4, capacity_time=16, start=8)
    joined = join_rows(full, kv(2, 5, seed=2), (3, 2), 5, True, rows_wanted=4)
    assert torch.equal(joined, torch.cat((mine_values, kv(2, 5, seed=2))))
    assert row_capacity(joined) == 5


def test_join_rows_with_a_side_that_has_no_steps_yet_pads_it_with_zeros():
    mine_values = kv(3, 5)
    mine = slotted(mine_values, 8, 16, 4)
    joined = join_rows(mine, None, (3, 2), 5, True, rows_wanted=8)
    assert torch.equal(joined, torch.cat((mine_values, torch.zeros(2, HEADS, 5, DIM))))
    theirs = kv(2, 4, seed=1)
    joined = join_rows(None, theirs, (3, 2), 4, True, rows_wanted=8)
    assert torch.equal(joined, torch.cat((torch.zeros(3, HEADS, 4, DIM), theirs)))


@pytest.mark.parametrize(
    ("starts", "sizes", "order"),
    [
        ([0, 2, 3], [1, 1, 1], [0, 2, 1]),  # row 1 left: the last row takes its place
        ([0, 1, 2], [1, 1, 1], [0, 1, 2]),  # the last row left: nothing moves
        ([0, 4, 5], [2, 1, 2], [0, 2, 1]),  # rows 2-3 left: the last (2-row) group takes their place
        ([2, 3], [1, 2], [1, 0]),  # rows 0-1 left: the 1-row group inside the batch keeps its place
        ([1, 3, 4], [1, 1, 2], [0, 1, 2]),  # gaps of 1 and 1 cannot take the 2-row group: batch order
    ],
)
def test_fewest_moves_keeps_groups_in_place_and_fills_gaps(starts, sizes, order):
    assert fewest_moves(starts, sizes) == order
