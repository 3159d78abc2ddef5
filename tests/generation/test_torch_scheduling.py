"""The torch engine's scheduling and threads: sequences joining and leaving a running batch (in-flight batching)
with outputs still `generate`'s, admission under the budgets, cancellation and close, the schedulings kept to
compare against, and the thread counts each kind of work runs with."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.generation_models import ARCHITECTURES  # noqa: E402
from support.torch_engine import TEXTS, joining_load, run, submit, tokens  # noqa: E402

from transerve.backends.generation.engine import (  # noqa: E402
    DecodingOptions,
    GenerationRequest,
)
from transerve.backends.generation.torch.batch_runner import cpu_count  # noqa: E402
from transerve.backends.generation.torch.engine import TorchEngine  # noqa: E402
from transerve.backends.generation.torch.scheduler import RequestLevel  # noqa: E402
from transerve.backends.generation.torch.static_scheduling import Static  # noqa: E402
from transerve.core.errors import ErrorCode, ServerError  # noqa: E402


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sequences_joining_a_running_batch_get_their_own_output(models, arch):
    model = models[arch]
    first_ids = model.ids(TEXTS[2])
    steps = threading.Semaphore(0)
    first = submit(model.engine, first_ids, DecodingOptions(max_new_tokens=40, end_ids=[]),
                   on_tokens=lambda new: steps.release())
    futures = []
    for ids, options, kwargs in joining_load(model):
        assert steps.acquire(timeout=30)  # each joins at a later step of the first one
        futures.append((submit(model.engine, ids, options), model.reference(ids, **kwargs)))
    for future, expected in futures:
        assert tokens(future.result(timeout=60)) == expected
    assert tokens(first.result(timeout=60)) == model.reference(first_ids, end_ids=[], max_new_tokens=40)


@pytest.mark.parametrize("arch", ["t5", "gpt2"])
def test_rows_join_and_leave_in_place_in_the_cache_buffers(models, arch):
    """After the first steps, joining rows are written into the buffers' spare rows and a leaving row's place is
    taken by the last row: the caches stay in the same buffers (that the rows still decode right, the parity tests
    under joins and leaves check)."""
    engine = TorchEngine(models[arch].path, max_batch_rows=4)
    runner = engine.runner.forward

    def storages(kv):
        return [k.untyped_storage().data_ptr() for k, _ in kv]

    def first_inputs(first):  # the start tokens (encoder-decoder), or the tokens after the prompts' logits
        return first if runner.encoder_decoder else first.argmax(-1)

    try:
        with torch.inference_mode():
            batch, first = runner.new_rows([[5, 6, 7], [8, 9]], [1, 1])
            inputs = first_inputs(first)
            for _ in range(3):  # the first steps move the caches into buffers of max_batch_rows rows
                inputs = runner.step(batch, inputs).argmax(-1)
            self_buffers = storages(batch.self_kv)
            joining = runner.new_rows([[10, 11]], [1])
            batch.extend(joining[0])
            inputs = torch.cat((inputs, first_inputs(joining[1])))
            assert storages(batch.self_kv) == self_buffers
            inputs = runner.step(batch, inputs).argmax(-1)
            cross_buffers = storages(batch.cross_kv) if batch.cross_kv else []
            batch.select(torch.tensor([2, 1]))  # row 0 leaves; row 2 takes its place
            runner.step(batch, inputs[[2, 1]])
            assert batch.rows == 2
            assert storages(batch.self_kv) == self_buffers
            assert (storages(batch.cross_kv) if batch.cross_kv else []) == cross_buffers
    finally:
        engine.close()


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="no CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("arch", ["t5", "gpt2"])
def test_the_hosts_row_lengths_follow_the_masks_and_trimming_keeps_no_unneeded_padding(models, arch, device):
    """The batch trims padding from the host's copy of each row's history and source lengths (no read from the
    device): through prefill or encoding, steps, joins, leaves (by a host list or an index tensor alone) and
    splits, the copies equal the masks' counts, and the windows keep only what the longest row needs."""
    engine = TorchEngine(models[arch].path, max_batch_rows=4, device=device)
    runner = engine.runner.forward

    def check(batch):
        assert batch.lengths == batch.mask.sum(dim=1).tolist()
        assert batch.mask.shape[1] == max(batch.lengths, default=0)
        assert all(k.shape[2] == batch.mask.shape[1] for k, _ in batch.self_kv)
        if runner.encoder_decoder:
            assert batch.sources == batch.encoder_mask.sum(dim=1).tolist()
            assert batch.encoder_mask.shape[1] == max(batch.sources)
            assert all(k.shape[2] == max(batch.sources) for k, _ in batch.cross_kv)

    def first_inputs(first):
        return first if runner.encoder_decoder else first.argmax(-1)

    try:
        with torch.inference_mode():
            batch, first = runner.new_rows([[5, 6, 7, 8, 9, 10], [8, 9]], [1, 2])
            check(batch)
            inputs = first_inputs(first)
            for _ in range(3):
                inputs = runner.step(batch, inputs).argmax(-1)
            check(batch)
            joining, first = runner.new_rows([[10, 11, 12]], [1])
            batch.extend(joining)
            inputs = torch.cat((inputs, first_inputs(first)))
            check(batch)
            inputs = runner.step(batch, inputs).argmax(-1)
            batch.select(torch.tensor([3, 1, 2], device=device), order=[3, 1, 2])  # the longest row (and source) leaves
            check(batch)
            inputs = runner.step(batch, inputs[[3, 1, 2]]).argmax(-1)
            batch.select(torch.tensor([1, 0], device=device))  # no host list: the index is read once
            check(batch)
            runner.step(batch, inputs[[1, 0]])
            check(batch)
            for start, stop in ((0, 1), (1, 2)):
                check(batch.rows_range(start, stop, own=start == 0))
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("join_group", [4, 1])
def test_a_joining_call_prepares_waiting_sequences_too(models, arch, join_group):
    """Under in-flight batching, the call that computes a joining sequence's rows computes those of the
    sequences waiting behind it too (up to `join_group` in all), beams included; they join later with those rows
    and their outputs are still generate's. `join_group` 1 computes each sequence's rows on its own. A model that
    prefills joining prompts in the step's own forward (decoder-only on the CPU) has no joining call once rows
    run: every sequence after the first call's joins that way."""
    model = models[arch]
    # decoding on every core: no joining thread, which could prepare the waiting sequences first
    engine = TorchEngine(model.path, max_batch_rows=3, join_group=join_group, intra_op_threads=cpu_count())
    calls: list[int] = []
    fused: list[int] = []
    runner = engine.runner.forward
    new_rows, step_with_prompts = runner.new_rows, runner.step_with_prompts
    runner.new_rows = lambda inputs, repeats: calls.append(len(inputs)) or new_rows(inputs, repeats)
    runner.step_with_prompts = lambda batch, tokens, prompts, repeats: (
        fused.append(len(prompts)) or step_with_prompts(batch, tokens, prompts, repeats))
    texts = [model.ids(text) for text in TEXTS]
    # C (1 row) joins when B's 2 rows leave; D (2 rows) and E (1 row) wait behind it. Beam search keeps its end
    # tokens (generate's beam search needs one), greedy decoding runs to max_new_tokens.
    beam = {"beam_width": 2, "num_return_sequences": 2}
    waiting = [(texts[0], {"max_new_tokens": 8, "end_ids": []}), (texts[1], {"max_new_tokens": 5, **beam}),
               (texts[2][:7], {"max_new_tokens": 7, "end_ids": []})]
    futures = []

    def submit_waiting(new_tokens: list[int]) -> None:  # on A's first token, from the engine thread: before B leaves
        if not futures:
            futures.extend(submit(engine, ids, DecodingOptions(**options)) for ids, options in waiting)

    def reference(ids: list[int], max_new_tokens: int, end_ids: list[int] | None = None, **options) -> list:
        if "beam_width" in options:
            options = {"num_beams": options["beam_width"], "num_return_sequences": options["num_return_sequences"]}
        return model.reference(ids, end_ids=end_ids, max_new_tokens=max_new_tokens, **options)

    try:
        first = submit(engine, texts[2], DecodingOptions(max_new_tokens=30, end_ids=[]), on_tokens=submit_waiting)
        beams = submit(engine, texts[0], DecodingOptions(max_new_tokens=6, **beam))
        expected = [(first, reference(texts[2], 30, [])), (beams, reference(texts[0], 6, **beam))]
        assert tokens(first.result(timeout=60))
        for (ids, options), future in zip(waiting, futures, strict=True):
            expected.append((future, reference(ids, **options)))
        for name, (future, want) in zip("ABCDE", expected, strict=True):
            assert tokens(future.result(timeout=60)) == want, name
    finally:
        engine.close()
    if runner.fuses_joins:
        assert len(calls) == 1 and sum(calls) + sum(fused) == 5  # A (and B), then the rest in steps
        return
    assert not fused
    assert sum(calls) == 5  # each sequence's rows computed once (A and B together, or each as it came)
    assert max(calls) == (3 if join_group == 4 else 2 if calls[0] == 2 else 1)  # C's call: C, D and E, or C alone


def test_sequences_prepared_ahead_are_those_nearest_in_length_within_the_next_rows(models):
    """Of the waiting sequences that fill the next `max_batch_rows` rows (cancelled and already prepared ones
    left out), those whose inputs are nearest in length to the joining sequence's: little padding computed."""
    import collections

    engine = TorchEngine(models["t5"].path, max_batch_rows=7, join_group=3)
    try:
        def sequence(length: int, beam_width: int = 1):
            request = GenerationRequest(list(range(5, 5 + length)), DecodingOptions(beam_width=beam_width))
            return engine.scheduler.new_sequence(request, None, lambda outcome: None)

        fresh = sequence(10)
        far, near, cancelled, prepared, beams, near_too, beyond = (
            sequence(30), sequence(11), sequence(10), sequence(10), sequence(8, beam_width=2), sequence(12),
            sequence(10),
        )
        cancelled.cancelled = True
        engine.scheduler.deliver([prepared], [("rows", "first")])
        engine.scheduler.queue = collections.deque([far, near, cancelled, prepared, beams, near_too, beyond])  # 8 rows
        assert engine._join_ahead([fresh]) == []  # no batch runs: the admitted sequences join in one call anyway
        engine.runner.batch = "running"
        assert engine._join_ahead([fresh]) == [near, beams]  # lengths 11 and 8 (12 is as near as 8: queue order)
        preparing = engine.scheduler._preparing
        assert near in preparing and beams in preparing and near_too not in preparing
        assert engine._join_ahead([fresh]) == [near_too, far]  # `beyond` is past the next 7 rows
    finally:
        engine.runner.batch, engine.scheduler.queue = None, collections.deque()
        engine.close()


def test_cross_attention_of_joining_rows_without_known_module_names(models):
    """A decoder whose cross-attention modules are not known by name gets its joining rows' cross-attention
    keys/values from one decoder run on the start token: outputs still equal generate's."""
    model = models["bart"]
    engine = TorchEngine(model.path)
    engine.runner.forward.cross_attention = []
    try:
        steps = threading.Semaphore(0)
        first_ids = model.ids(TEXTS[2])
        first = submit(engine, first_ids, DecodingOptions(max_new_tokens=20, end_ids=[]),
                       on_tokens=lambda new: steps.release())
        assert steps.acquire(timeout=30)
        later = [(ids, submit(engine, ids, DecodingOptions(max_new_tokens=12, end_ids=[])))
                 for ids in (model.ids(TEXTS[0]), model.ids(TEXTS[1]))]
        for ids, future in later:
            assert tokens(future.result(timeout=60)) == model.reference(ids, end_ids=[], max_new_tokens=12)
        assert tokens(first.result(timeout=60)) == model.reference(first_ids, end_ids=[], max_new_tokens=20)
    finally:
        engine.close()


def test_short_sequence_finishes_first(models):
    model = models["bart"]
    order: list[str] = []
    long = submit(model.engine, model.ids(TEXTS[0]), DecodingOptions(max_new_tokens=60, end_ids=[]))
    short = submit(model.engine, model.ids(TEXTS[1]), DecodingOptions(max_new_tokens=5, end_ids=[]))
    long.add_done_callback(lambda _: order.append("long"))
    short.add_done_callback(lambda _: order.append("short"))
    assert len(tokens(long.result(timeout=60))[0]) == 60
    assert len(tokens(short.result(timeout=60))[0]) == 5
    assert order == ["short", "long"]


@pytest.mark.parametrize("arch", ["t5", "gpt2"])
def test_twenty_concurrent_sequences_each_get_their_own_tokens(models, arch):
    model = models[arch]
    words = " ".join(TEXTS).split()
    load = []
    for index in range(20):
        ids = model.ids(" ".join(words[index % 7: index % 7 + 2 + index]))
        load.append((ids, DecodingOptions(max_new_tokens=3 + 2 * index, end_ids=[])))
    futures = [submit(model.engine, ids, options) for ids, options in load]
    for (ids, options), future in zip(load, futures, strict=True):
        assert tokens(future.result(timeout=120)) == model.reference(
            ids, end_ids=[], max_new_tokens=options.max_new_tokens
        )


def test_sequence_beyond_the_budget_is_refused(models):
    engine = TorchEngine(models["gpt2"].path, kv_cache_tokens=100)
    try:
        result = submit(engine, [5] * 30, DecodingOptions(max_new_tokens=20, beam_width=3)).result(timeout=10)
        assert isinstance(result, ServerError) and result.code is ErrorCode.INVALID_ARG
        assert "100" in result.message and "kv_cache_tokens" in result.message
        result = submit(engine, [5] * 30, DecodingOptions(max_new_tokens=20, beam_width=40)).result(timeout=10)
        assert isinstance(result, ServerError) and result.code is ErrorCode.INVALID_ARG
        assert "beam_width" in result.message
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("ids", "options", "words"),
    [
        ([], DecodingOptions(), "no tokens"),
        ([5] * 300, DecodingOptions(), "at most 256"),
        ([5] * 250, DecodingOptions(max_new_tokens=10), "positions"),
        ([5], DecodingOptions(beam_width=0), "beam_width"),
        ([5], DecodingOptions(max_new_tokens=0), "max_new_tokens"),
        ([5], DecodingOptions(beam_width=2, num_return_sequences=3), "num_return_sequences"),
        ([100000], DecodingOptions(), "token ids"),
    ],
)
def test_bad_requests_are_refused_at_submit(models, ids, options, words):
    result = submit(models["gpt2"].engine, ids, options).result(timeout=10)
    assert isinstance(result, ServerError) and result.code is ErrorCode.INVALID_ARG
    assert words in result.message


def test_small_budget_queues_sequences_and_all_complete(models):
    model = models["marian"]
    # Room for one sequence at a time: the others wait their turn.
    engine = TorchEngine(model.path, kv_cache_tokens=60, max_batch_rows=2)
    try:
        load = [(model.ids(text)[:10], DecodingOptions(max_new_tokens=12, end_ids=[])) for text in TEXTS * 2]
        futures = [submit(engine, ids, options) for ids, options in load]
        for (ids, _), future in zip(load, futures, strict=True):
            assert tokens(future.result(timeout=60)) == model.reference(ids, end_ids=[], max_new_tokens=12)
    finally:
        engine.close()


def test_cancel_stops_a_sequence_at_the_next_step(models):
    model = models["gpt2"]
    produced: list[int] = []
    started = threading.Event()

    def on_tokens(new: list[int]) -> None:
        produced.extend(new)
        started.set()

    options = DecodingOptions(max_new_tokens=200, end_ids=[])
    handle_future: Future = Future()
    handle = model.engine.submit(GenerationRequest(model.ids(TEXTS[1]), options, stream=True), on_tokens,
                                 handle_future.set_result)
    assert started.wait(30)
    handle.cancel()
    result = handle_future.result(timeout=30)
    assert result.finish_reason == "cancelled"
    assert len(result.hypotheses[0].token_ids) < 50
    assert result.hypotheses[0].token_ids == produced


def test_close_fails_pending_sequences_and_ends_the_thread(models):
    engine = TorchEngine(models["t5"].path, max_batch_rows=1)
    running = submit(engine, [5, 6, 7], DecodingOptions(max_new_tokens=100, end_ids=[]))
    pending = [submit(engine, [5, 6], DecodingOptions(max_new_tokens=100)) for _ in range(3)]
    engine.close()
    engine.join(30)
    assert engine.thread is not None and not engine.thread.is_alive()
    for future in [running, *pending]:
        result = future.result(timeout=10)
        assert isinstance(result, ServerError) and result.code is ErrorCode.UNAVAILABLE
    late = submit(engine, [5], DecodingOptions()).result(timeout=10)
    assert isinstance(late, ServerError) and late.code is ErrorCode.UNAVAILABLE


def test_idle_threads_end_and_the_next_request_starts_new_ones(models):
    """An idle engine holds no thread: torch's OpenMP runtime keeps a pool of workers for every thread that has
    computed, and more of them than cores slow down whichever engine is busy."""
    model = models["gpt2"]
    engine = TorchEngine(model.path, max_batch_rows=1, intra_op_threads=1)
    engine.idle_seconds = 0.05
    ids = [5, 6, 7]
    expected = model.reference(ids, end_ids=[], max_new_tokens=5)
    try:
        assert engine.thread is None and engine.joining_thread is None
        decoding: list[threading.Thread] = []

        def on_tokens(_: list[int]) -> None:
            decoding.append(threading.current_thread())

        for _ in range(2):
            options = DecodingOptions(max_new_tokens=5, end_ids=[])
            assert tokens(submit(engine, ids, options, on_tokens=on_tokens).result(timeout=60)) == expected
            deadline = time.monotonic() + 10
            while (engine.thread or engine.joining_thread) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.thread is None and engine.joining_thread is None
            decoding[-1].join(10)
            assert not decoding[-1].is_alive()
        assert len(set(decoding)) == 2  # each request's own engine thread
    finally:
        engine.close()
        engine.join(30)


def test_request_level_scheduling_admits_only_into_an_empty_batch(models):
    model = models["t5"]
    engine = TorchEngine(model.path, scheduling=RequestLevel())
    try:
        steps = threading.Semaphore(0)
        order: list[str] = []
        long_ids, short_ids = model.ids(TEXTS[0]), model.ids(TEXTS[1])
        long = submit(engine, long_ids, DecodingOptions(max_new_tokens=30, end_ids=[]),
                      on_tokens=lambda new: steps.release())
        assert steps.acquire(timeout=30)
        short = submit(engine, short_ids, DecodingOptions(max_new_tokens=3, end_ids=[]))
        long.add_done_callback(lambda _: order.append("long"))
        short.add_done_callback(lambda _: order.append("short"))
        assert tokens(short.result(timeout=60)) == model.reference(short_ids, end_ids=[], max_new_tokens=3)
        assert tokens(long.result(timeout=60)) == model.reference(long_ids, end_ids=[], max_new_tokens=30)
        assert order == ["long", "short"]
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["t5", "gpt2"])
def test_static_scheduling_decodes_finished_rows_until_the_batch_ends(models, arch):
    """Request-level batching as FasterTransformer and `generate` run it: the short sequence's result comes when it
    ends, but its row keeps decoding (past the model's last position, for GPT-2's long prompt) until the long one
    ends; neither output changes."""
    model = models[arch]
    engine = TorchEngine(model.path, scheduling=Static())
    rows: list[int] = []
    step = engine.runner.forward.step
    engine.runner.forward.step = lambda batch, next_tokens: rows.append(batch.rows) or step(batch, next_tokens)
    try:
        long_ids = model.ids(TEXTS[0])
        short_ids = model.ids(TEXTS[1]) if arch == "t5" else [5, 9, 11] * 80
        order: list[str] = []
        with engine.scheduler.cond:  # both queued before the engine thread looks: one batch
            long = submit(engine, long_ids, DecodingOptions(max_new_tokens=60, end_ids=[]))
            short = submit(engine, short_ids, DecodingOptions(max_new_tokens=3, end_ids=[]))
        long.add_done_callback(lambda _: order.append("long"))
        short.add_done_callback(lambda _: order.append("short"))
        assert tokens(short.result(timeout=60)) == model.reference(short_ids, end_ids=[], max_new_tokens=3)
        assert tokens(long.result(timeout=60)) == model.reference(long_ids, end_ids=[], max_new_tokens=60)
        assert order == ["short", "long"]
        assert set(rows) == {2}  # the short sequence's row decoded on to the end
        assert engine.runner.batch is None and engine.scheduler.running == []
    finally:
        engine.close()


def test_llama_style_model_matches_transformers_in_flight(tmp_path):
    """Rotary positions and grouped-query attention: rows joining at different steps keep their own positions."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, initializer_range=0.3,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.generation_config = transformers.GenerationConfig.from_model_config(config)
    hf.save_pretrained(tmp_path)
    engine = TorchEngine(tmp_path)
    try:
        steps = threading.Semaphore(0)
        first_ids = [1, *range(50, 80)]
        first = submit(engine, first_ids, DecodingOptions(max_new_tokens=30, end_ids=[]),
                       on_tokens=lambda new: steps.release())
        load = []
        for index, ids in enumerate([[1, 5, 6, 7, 8, 9], [1, 40], [1, *range(100, 112)]]):
            assert steps.acquire(timeout=30)
            greedy = submit(engine, ids, DecodingOptions(max_new_tokens=15 + index, end_ids=[]))
            beam = submit(engine, ids, DecodingOptions(max_new_tokens=10, end_ids=[], beam_width=3,
                                                       num_return_sequences=2))
            load.append((ids, index, greedy, beam))
        for ids, index, greedy, beam in load:
            with torch.inference_mode():
                prompt = torch.tensor([ids])
                expected = hf.generate(prompt, max_new_tokens=15 + index, do_sample=False, eos_token_id=[],
                                       pad_token_id=3)[:, len(ids):].tolist()
                expected_beam = hf.generate(prompt, max_new_tokens=10, num_beams=3, num_return_sequences=2,
                                            eos_token_id=[], pad_token_id=3)[:, len(ids):].tolist()
            assert tokens(greedy.result(timeout=60)) == expected
            assert tokens(beam.result(timeout=60)) == expected_beam
        with torch.inference_mode():
            expected = hf.generate(torch.tensor([first_ids]), max_new_tokens=30, do_sample=False, eos_token_id=[],
                                   pad_token_id=3)[:, len(first_ids):].tolist()
        assert tokens(first.result(timeout=60)) == expected
    finally:
        engine.close()


def test_decoder_without_per_row_positions_batches_whole_requests(tmp_path):
    """M2M100 computes decoder positions from the cache length: the engine falls back to request-level batching,
    so its rows stay in lockstep, and outputs still equal generate's."""
    torch.manual_seed(0)
    config = transformers.M2M100Config(
        vocab_size=300, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=256,
        pad_token_id=1, eos_token_id=2, bos_token_id=0, decoder_start_token_id=2, init_std=0.3,
    )
    hf = transformers.M2M100ForConditionalGeneration(config).eval()
    hf.generation_config = transformers.GenerationConfig.from_model_config(config)
    hf.save_pretrained(tmp_path)
    engine = TorchEngine(tmp_path)
    try:
        assert engine.scheduling.name == "request"
        steps = threading.Semaphore(0)
        prompts = [[5, 6, 7, 8, 9, 2], [40, 2], [*range(100, 120), 2]]
        first = submit(engine, prompts[0], DecodingOptions(max_new_tokens=20, end_ids=[]),
                       on_tokens=lambda new: steps.release())
        assert steps.acquire(timeout=30)
        later = [submit(engine, ids, DecodingOptions(max_new_tokens=12, end_ids=[])) for ids in prompts[1:]]
        for ids, future, count in zip(prompts, [first, *later], [20, 12, 12], strict=True):
            with torch.inference_mode():
                expected = hf.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False, eos_token_id=[],
                                       pad_token_id=1)[:, 1:].tolist()
            assert tokens(future.result(timeout=60)) == expected
    finally:
        engine.close()


def test_a_lone_prompt_gets_its_first_token_from_the_prefill(models):
    """A decoder-only sequence's whole prompt goes through one forward pass whose last position gives its first
    token: no decoding step runs before it."""
    model = models["gpt2"]
    engine = TorchEngine(model.path)
    steps: list[int] = []
    step = engine.runner.forward.step
    engine.runner.forward.step = lambda batch, tokens: steps.append(batch.rows) or step(batch, tokens)
    try:
        ids = model.ids(TEXTS[0])
        assert tokens(run(engine, ids, DecodingOptions(max_new_tokens=1))) == model.reference(ids, max_new_tokens=1)
        assert steps == []
        assert tokens(run(engine, ids, DecodingOptions(max_new_tokens=3))) == model.reference(ids, max_new_tokens=3)
        assert steps == [1, 1]
    finally:
        engine.close()


@pytest.mark.parametrize(("arch", "joining"), [("gpt2", "prefill"), ("t5", "encode")])
def test_joining_work_of_few_rows_runs_on_the_latency_threads(models, arch, joining):
    """With at most `latency_rows` rows running, the engine thread computes the joining work (prefill or encoder
    call) with `latency_threads`, and everything else with `intra_op_threads`; OpenMP's count is the engine
    thread's own, which is what torch.get_num_threads() reports there."""
    model = models[arch]
    engine = TorchEngine(model.path, intra_op_threads=1, latency_threads=3, latency_rows=1)
    seen: list[tuple[str, int]] = []

    def spy(name: str, method):
        def call(*args):
            seen.append((name, torch.get_num_threads()))
            return method(*args)
        return call

    engine.runner.forward.step = spy("step", engine.runner.forward.step)
    setattr(engine.runner.forward, joining, spy("join", getattr(engine.runner.forward, joining)))
    try:
        ids = model.ids(TEXTS[1])
        run(engine, ids, DecodingOptions(max_new_tokens=3))
        assert seen[0] == ("join", 3) and {threads for name, threads in seen[1:]} == {1}
        seen.clear()
        # A second sequence joins a running one: two rows, beyond latency_rows, so one thread throughout.
        steps = threading.Semaphore(0)
        first = submit(engine, ids, DecodingOptions(max_new_tokens=30, end_ids=[]), on_tokens=lambda _: steps.release())
        assert steps.acquire(timeout=30)
        second = submit(engine, model.ids(TEXTS[0]), DecodingOptions(max_new_tokens=3, end_ids=[]))
        second.result(timeout=60)
        first.result(timeout=60)
        # Its rows: one joining call (the joining thread's or the engine thread's), or, for GPT-2 on the CPU, none
        # when the engine admits it before the joining thread got to it (prefilled in the step: `fused_joins`).
        assert seen[0] == ("join", 3) and seen.count(("join", 1)) in ((0, 1) if joining == "prefill" else (1,))
        assert all(threads == 1 for name, threads in seen[1:])
    finally:
        engine.close()


def test_no_joining_thread_when_decoding_uses_every_core(models):
    """Its work would only compete with decoding's: waiting sequences join in one batched call instead."""
    engine = TorchEngine(models["gpt2"].path, intra_op_threads=cpu_count(), max_batch_rows=2)
    try:
        assert engine.joining_thread is None and engine.runner.threads.joining_threads == 0
        futures = [submit(engine, [5, 6, 7 + i], DecodingOptions(max_new_tokens=4 + i, end_ids=[])) for i in range(5)]
        assert [len(tokens(f.result(timeout=60))[0]) for f in futures] == [4, 5, 6, 7, 8]
    finally:
        engine.close()
        engine.join(30)


def test_each_engine_thread_makes_the_engines_gpu_its_current_device(monkeypatch):
    """torch keeps the current CUDA device per thread (cuda:0 until set): each thread of an engine on cuda:1 sets
    it, so that the streams and graph recordings that name no device are on the engine's GPU; the joining thread
    also takes its own thread count."""
    from transerve.backends.generation.torch.batch_runner import ThreadPolicy

    policy = ThreadPolicy(torch.device("cuda", 1), intra_op_threads=1, latency_threads=2, latency_rows=1)
    seen = []

    def thread(joining: bool) -> None:
        policy.start_thread(joining)
        seen.append((joining, torch.get_num_threads() if joining else None))

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.append(device))
    for joining in (False, True):
        worker = threading.Thread(target=thread, args=(joining,))
        worker.start()
        worker.join(10)
    assert seen == [torch.device("cuda", 1), (False, None), torch.device("cuda", 1), (True, policy.joining_threads)]
    assert policy.current == 0
    ThreadPolicy(torch.device("cpu"), 1, 2, 1).start_thread(joining=False)
    assert len(seen) == 4  # the CPU has no current device to set


def test_thread_settings_are_checked(models):
    with pytest.raises(ServerError, match="must not be negative"):
        TorchEngine(models["t5"].path, latency_threads=-1)


ON_CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("arch", ["t5", "gpt2"])
def test_waiting_sequences_are_prepared_while_the_batch_decodes(models, arch, device):
    """The joining thread computes a waiting sequence's rows (encoder call or prefill) while the engine thread
    decodes (on a GPU, on a CUDA stream of its own: `join_stream`); the sequence joins with them and its output
    is still generate's."""
    if device == "cpu" and cpu_count() < 2:
        pytest.skip("the joining thread needs a core that decoding leaves idle")
    model = models[arch]
    engine = TorchEngine(model.path, device=device, max_batch_rows=1, intra_op_threads=1)
    prepared = threading.Event()
    streams = []
    new_rows = engine.runner.forward.new_rows

    def spy(inputs, repeats):
        rows = new_rows(inputs, repeats)
        if threading.current_thread() is engine.joining_thread:
            streams.append(torch.cuda.current_stream() if device == "cuda" else None)
            prepared.set()
        return rows

    engine.runner.forward.new_rows = spy
    model.hf.to(device)
    try:
        first_ids, second_ids = model.ids(TEXTS[2]), model.ids(TEXTS[0])
        long = 30 if device == "cpu" else 120  # a GPU decodes a tiny model's steps in a millisecond or two
        steps = threading.Semaphore(0)
        first = submit(engine, first_ids, DecodingOptions(max_new_tokens=long, end_ids=[]),
                       on_tokens=lambda _: steps.release())
        assert steps.acquire(timeout=30)
        second = submit(engine, second_ids, DecodingOptions(max_new_tokens=6, end_ids=[]))
        assert prepared.wait(30)
        assert not first.done()  # prepared while the first one still ran: max_batch_rows 1 kept it waiting
        assert tokens(second.result(timeout=60)) == model.reference(second_ids, end_ids=[], max_new_tokens=6)
        assert tokens(first.result(timeout=60)) == model.reference(first_ids, end_ids=[], max_new_tokens=long)
        assert streams == [engine.join_stream.stream]  # None on the CPU
        if device == "cuda":
            assert engine.join_stream.stream != torch.cuda.default_stream()
    finally:
        model.hf.to("cpu")
        engine.close()
        engine.join(30)
    assert engine.joining_thread is None or not engine.joining_thread.is_alive()


def test_no_joining_thread_work_for_a_model_that_changes_in_its_forward(models):
    """RoPE of type dynamic rescales its frequencies inside the forward pass: such a model's rows are computed by
    the engine thread only."""
    from transerve.backends.generation.torch.model_runner import _mutable_forward

    assert _mutable_forward(transformers.LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert not _mutable_forward(transformers.LlamaConfig())
    engine = TorchEngine(models["gpt2"].path, max_batch_rows=1, intra_op_threads=1)
    engine.runner.forward.mutable_forward = True
    callers: list[threading.Thread] = []
    new_rows = engine.runner.forward.new_rows
    engine.runner.forward.new_rows = lambda *args: callers.append(threading.current_thread()) or new_rows(*args)
    try:
        futures = [submit(engine, [5, 6, 7], DecodingOptions(max_new_tokens=8, end_ids=[])) for _ in range(3)]
        for future in futures:
            assert len(tokens(future.result(timeout=60))[0]) == 8
        assert callers == [engine.thread] * 3
    finally:
        engine.close()
