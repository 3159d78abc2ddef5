"""Decoding steps at bucketed shapes over fixed buffers (`step_graphs`): what a GPU records as CUDA graphs, run
eagerly on the CPU. They must compute what the engine's ordinary steps compute, through joins, leaves, beams and
splits, with every step's caches staying in the buffers; on a GPU, the recorded graphs must decode as eager steps
do."""

from __future__ import annotations

import json
import shutil
import threading

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.generation_models import ARCHITECTURES  # noqa: E402
from support.torch_engine import TEXTS, joining_load, submit, tokens  # noqa: E402

from transerve.backends.generation.engine import DecodingOptions  # noqa: E402
from transerve.backends.generation.torch import step_graphs  # noqa: E402
from transerve.backends.generation.torch.engine import TorchEngine  # noqa: E402


@pytest.fixture(scope="module")
def static_engines(models):
    """Per architecture, an engine whose steps run at bucketed shapes (eagerly: this is the CPU)."""
    engines = {arch: TorchEngine(models[arch].path, max_batch_rows=16, static_steps=True) for arch in ARCHITECTURES}
    yield engines
    for engine in engines.values():
        engine.close()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sequences_joining_and_leaving_get_generates_output(models, static_engines, arch):
    """Greedy and beam sequences join a running sequence at later steps and leave at different ones; each gets
    what transformers' `generate` gives it alone, and the steps ran over the fixed buffers."""
    model, engine = models[arch], static_engines[arch]
    graphs = engine.runner.forward.graphs
    first_ids = model.ids(TEXTS[2])
    steps = threading.Semaphore(0)
    first = submit(engine, first_ids, DecodingOptions(max_new_tokens=40, end_ids=[]),
                   on_tokens=lambda new: steps.release())
    futures = []
    for ids, options, kwargs in joining_load(model):
        assert steps.acquire(timeout=30)  # each joins at a later step of the first one
        futures.append((submit(engine, ids, options), model.reference(ids, **kwargs)))
    for future, expected in futures:
        assert tokens(future.result(timeout=60)) == expected
    assert tokens(first.result(timeout=60)) == model.reference(first_ids, end_ids=[], max_new_tokens=40)
    assert graphs.off is None
    assert graphs.graphs, "no step ran at a bucketed shape"
    assert all(rows in (8, 16) and time % step_graphs.TIME_BUCKET == 0 for rows, time, _ in graphs.graphs)


def _first_inputs(runner, first):
    return first if runner.encoder_decoder else first.argmax(-1)


def _storages(kv):
    return {tensor.untyped_storage().data_ptr() for layer in kv for tensor in layer}


@pytest.mark.parametrize("arch", ["t5", "gpt2"])
def test_each_step_computes_what_an_eager_step_does_and_the_caches_stay_in_the_buffers(models, arch):
    """Step by step against the ordinary steps of the same batch: logits equal, the batch's caches views of the
    fixed buffers (once its first step has copied them in) through a join, a leave, and a reallocation by a join
    that needs more steps before the window than the buffer has."""
    engine = TorchEngine(models[arch].path, max_batch_rows=8, static_steps=True)
    runner = engine.runner.forward
    graphs = runner.graphs

    def both(batch, inputs):
        """The step at a bucketed shape, checked against an eager step of a copy of the batch."""
        twin = batch.rows_range(0, batch.rows, own=True)
        runner.graphs = None
        expected = runner.step(twin, inputs)
        runner.graphs = graphs
        logits = runner.step(batch, inputs)
        torch.testing.assert_close(logits, expected.float(), rtol=1e-4, atol=1e-4)
        assert batch.lengths == twin.lengths == batch.mask.sum(dim=1).tolist()
        torch.testing.assert_close(batch.mask, twin.mask)
        return logits.argmax(-1)

    try:
        with torch.inference_mode():
            batch, first = runner.new_rows([[5, 6, 7, 8], [8, 9]], [1, 2])
            inputs = _first_inputs(runner, first)
            for _ in range(3):
                inputs = both(batch, inputs)
            buffers = _storages(zip(graphs.keys, graphs.values, strict=True))
            assert _storages(batch.self_kv) == buffers
            joining, first = runner.new_rows([[10, 11, 12]], [1])
            batch.extend(joining)
            inputs = torch.cat((inputs, _first_inputs(runner, first)))
            assert _storages(batch.self_kv) == buffers  # joined into the buffers' spare rows
            inputs = both(batch, inputs)
            batch.select(torch.tensor([3, 1, 2]), order=[3, 1, 2])  # the longest row leaves
            inputs = both(batch, inputs[[3, 1, 2]])
            assert _storages(batch.self_kv) == buffers
            long_prompt = list(range(5, 5 + step_graphs.LEFT_ROOM + 20))  # more steps than room before the window
            joining, first = runner.new_rows([long_prompt if not runner.encoder_decoder else [4, 5]], [1])
            batch.extend(joining)
            inputs = torch.cat((inputs, _first_inputs(runner, first)))
            for _ in range(2):
                inputs = both(batch, inputs)
            assert _storages(batch.self_kv) == buffers  # copied back in after the join moved them
    finally:
        engine.close()


def test_a_window_that_drifted_far_from_the_buffers_start_is_moved_back():
    """`_adopt` moves a window back to `LEFT_ROOM` when more of the attended span would be stale steps before it
    than steps in it, keeping its contents."""
    graphs = step_graphs.StepGraphs.__new__(step_graphs.StepGraphs)
    graphs.time = 512
    graphs.keys = [torch.arange(2 * 2 * 512 * 4, dtype=torch.float32).reshape(2, 2, 512, 4)]
    graphs.values = [graphs.keys[0].clone()]
    time, start = 10, 300

    class Batch:
        mask = torch.ones(2, time)
        self_kv = [(graphs.keys[0][:2, :, start:start + time], graphs.values[0][:2, :, start:start + time])]
        cross_kv = None

    expected = Batch.self_kv[0][0].clone()
    assert graphs._adopt(Batch) == step_graphs.LEFT_ROOM
    moved = Batch.self_kv[0][0]
    assert moved.untyped_storage().data_ptr() == graphs.keys[0].untyped_storage().data_ptr()
    torch.testing.assert_close(moved, expected)
    Batch.self_kv = [(graphs.keys[0][:2, :, 50:60], graphs.values[0][:2, :, 50:60])]
    assert graphs._adopt(Batch) == 50  # within `LEFT_ROOM` of the start: stays where it is


@pytest.mark.parametrize(("rows", "most", "bucket"), [(1, 64, 8), (8, 64, 8), (9, 64, 16), (33, 64, 64), (40, 40, 40)])
def test_rows_are_rounded_up_to_powers_of_two_within_the_buffers(rows, most, bucket):
    assert step_graphs._row_bucket(rows, most) == bucket


def test_the_buffers_are_sized_for_the_longest_history_and_source(models):
    """GPT-2's positions bound its history; t5's (relative positions) decoder steps and sources are bounded by its
    longest input; `kv_cache_tokens` bounds both."""
    for arch, kv_cache_tokens in (("gpt2", 65536), ("t5", 65536), ("gpt2", 100)):
        engine = models[arch].engine
        graphs = step_graphs.step_graphs_for(engine.runner.forward, engine.scheduler.model, 8, kv_cache_tokens)
        history = min(engine.max_positions or engine.max_input_length, kv_cache_tokens)
        assert graphs.time % step_graphs.TIME_BUCKET == 0 and history < graphs.time <= history + 64
        assert graphs.source == (0 if arch == "gpt2" else -(-engine.max_input_length // 64) * 64)
        assert graphs.capture is False and graphs.rows == 8


def test_graphs_beyond_the_most_kept_are_dropped_least_recently_used_first(models, monkeypatch):
    monkeypatch.setattr(step_graphs, "MAX_GRAPHS", 2)
    engine = TorchEngine(models["gpt2"].path, max_batch_rows=32, static_steps=True)
    runner = engine.runner.forward
    try:
        with torch.inference_mode():
            for rows in (1, 9, 20):  # buckets of 8, 16 and 32 rows
                batch, first = runner.new_rows([[5, 6, 7]] * rows, [1] * rows)
                runner.step(batch, first.argmax(-1))
        assert [key[0] for key in runner.graphs.graphs] == [16, 32]
    finally:
        engine.close()


def test_a_model_with_masks_of_another_kind_steps_eagerly(models, tmp_path):
    """The prepared masks are boolean: a model whose attention wants additive ones (eager) never uses them."""
    path = tmp_path / "gpt2-eager"
    shutil.copytree(models["gpt2"].path, path)
    config = json.loads((path / "config.json").read_text())
    config["attn_implementation"] = "eager"
    config["_attn_implementation"] = "eager"
    (path / "config.json").write_text(json.dumps(config))
    engine = TorchEngine(path, static_steps=True)
    try:
        graphs = engine.runner.forward.graphs
        if engine.runner.forward.model.config._attn_implementation != "eager":
            pytest.skip("transformers did not load the model with eager attention")
        assert graphs.off and "eager" in graphs.off
        ids = models["gpt2"].ids(TEXTS[0])
        result = submit(engine, ids, DecodingOptions(max_new_tokens=6)).result(timeout=60)
        assert tokens(result) == models["gpt2"].reference(ids, max_new_tokens=6)
        assert not graphs.graphs
    finally:
        engine.close()


def test_a_recording_that_fails_in_any_way_leaves_eager_steps_and_releases_the_buffers(models):
    """Whatever a recording raises (here a ValueError: a CPU device handed to CUDA's calls), the step runs eagerly
    at once, every later step too, and the buffers are let go: the sequence still gets `generate`'s tokens."""
    engine = TorchEngine(models["gpt2"].path, max_batch_rows=8, static_steps=True)
    graphs = engine.runner.forward.graphs
    graphs.capture = True  # record: on the CPU the recording's first CUDA call fails
    try:
        ids = models["gpt2"].ids(TEXTS[1])
        result = submit(engine, ids, DecodingOptions(max_new_tokens=8)).result(timeout=60)
        assert tokens(result) == models["gpt2"].reference(ids, max_new_tokens=8)
        assert graphs.off and "could not be recorded" in graphs.off and "ValueError" in graphs.off
        assert not graphs.graphs and not graphs.keys and not graphs.values
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("arch", ["t5", "gpt2"])
def test_recorded_cuda_graphs_decode_as_eager_steps_do(models, arch):
    """On a GPU: sequences joining and leaving decode the same tokens with recorded steps as with eager ones, and
    the steps were recorded (no fallback)."""
    recorded = TorchEngine(models[arch].path, device="cuda", max_batch_rows=16)
    eager = TorchEngine(models[arch].path, device="cuda", max_batch_rows=16, static_steps=False)
    try:
        assert recorded.runner.forward.graphs is not None and eager.runner.forward.graphs is None
        model = models[arch]
        load = [(model.ids(text)[: 4 + 5 * index], DecodingOptions(max_new_tokens=5 + 7 * index))
                for index, text in enumerate(TEXTS * 3)]
        results = []
        for engine in (recorded, eager):
            futures = [submit(engine, ids, options) for ids, options in load]
            results.append([tokens(future.result(timeout=120)) for future in futures])
        assert results[0] == results[1]
        graphs = recorded.runner.forward.graphs
        assert graphs.off is None and graphs.graphs
        assert all(graph.recording is not None for graph in graphs.graphs.values())
    finally:
        recorded.close()
        eager.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_engines_sharing_a_gpu_record_their_graphs_at_the_same_time(models):
    """Two engines on one GPU, first used together (as a model's instances are): starting a recording empties
    torch's cache of free memory, which fails while another recording is underway, so they take turns, and both
    keep their graphs."""
    archs = ("t5", "gpt2")
    engines = [TorchEngine(models[arch].path, device="cuda", max_batch_rows=16) for arch in archs]
    try:
        futures = [submit(engine, models[arch].ids(text), DecodingOptions(max_new_tokens=12, end_ids=[]))
                   for text in TEXTS for engine, arch in zip(engines, archs, strict=True)]
        for future in futures:
            assert [len(beam) for beam in tokens(future.result(timeout=120))] == [12]
        for engine in engines:
            graphs = engine.runner.forward.graphs
            assert graphs.off is None and graphs.graphs
    finally:
        for engine in engines:
            engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="fewer than 2 GPUs")
def test_an_engine_on_a_second_gpu_records_its_steps_there(models):
    """torch's current device is per thread, cuda:0 until set: an engine on cuda:1 makes it its threads' own, or
    its recordings would capture none of its kernels (queued on cuda:1's streams) and replay stale logits."""
    model = models["gpt2"]
    recorded = TorchEngine(model.path, device="cuda:1", max_batch_rows=16)
    eager = TorchEngine(model.path, device="cuda:1", max_batch_rows=16, static_steps=False)
    try:
        results = []
        for engine in (recorded, eager):
            futures = [submit(engine, model.ids(text), DecodingOptions(max_new_tokens=10)) for text in TEXTS]
            results.append([tokens(future.result(timeout=120)) for future in futures])
        assert results[0] == results[1]
        graphs = recorded.runner.forward.graphs
        assert graphs.off is None and graphs.graphs and graphs.keys[0].device == torch.device("cuda", 1)
    finally:
        recorded.close()
        eager.close()


#: Operators that read a tensor's values back to the host (or shape a result by them), or make a tensor of host
#: data (a copy to the device): a recorded CUDA graph can hold none of them.
READS_BACK = {"_local_scalar_dense", "is_nonzero", "item", "nonzero", "equal", "unique", "masked_select",
              "lift_fresh", "lift_fresh_copy"}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_steps_forward_reads_nothing_back(models, arch):
    """What a GPU records must not read values back to the host nor copy host data in: every operator a step's
    forward dispatches is checked (on the CPU, where the same operators run)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Operators(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    engine = TorchEngine(models[arch].path, max_batch_rows=16, static_steps=True)
    runner = engine.runner.forward
    graphs = runner.graphs
    try:
        with torch.inference_mode():
            batch, first = runner.new_rows([[5, 6, 7, 8], [8, 9]], [1, 1])
            inputs = _first_inputs(runner, first)
            for _ in range(2):
                inputs = runner.step(batch, inputs).argmax(-1)
            seen = set()
            for key, graph in graphs.graphs.items():
                with Operators() as operators:
                    graphs._forward(key, graph)
                seen |= operators.names
        assert "index_copy_" in seen and not seen & READS_BACK
    finally:
        engine.close()


def _runner(attention="sdpa", per_row_positions=True, mutable_forward=False, **config):
    from types import SimpleNamespace

    text = SimpleNamespace(**config)
    model_config = SimpleNamespace(_attn_implementation=attention, get_text_config=lambda decoder: text)
    return SimpleNamespace(model=SimpleNamespace(config=model_config), per_row_positions=per_row_positions,
                           mutable_forward=mutable_forward)


@pytest.mark.parametrize(
    ("runner", "why"),
    [
        (_runner(), None),
        (_runner(attention="transerve_fused_joins"), None),
        (_runner(attention="eager"), "takes masks of another kind"),
        (_runner(sliding_window=4096, max_position_embeddings=32768), "a sliding window could be outgrown"),
        (_runner(sliding_window=4096, max_position_embeddings=4096), None),
        (_runner(layer_types=["full_attention", "sliding_attention"]), "a sliding window could be outgrown"),
        (_runner(per_row_positions=False), "positions cannot be set per row"),
        (_runner(mutable_forward=True), "changes the model"),
    ],
)
def test_models_the_fixed_shape_steps_would_get_wrong_step_eagerly(runner, why):
    """Boolean masks over the whole history, and the write position taken for the query's: a model that wants
    other masks, a sliding window, positions from the cache's length, or that changes in its forward, is left to
    eager steps."""
    found = step_graphs._unsuited(runner)
    assert found == why if why is None else why in found
