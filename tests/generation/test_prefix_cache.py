"""The torch engine's prefix cache: prompts that share a long start (decoder-only) or a repeated source
(encoder-decoder) reuse its key/value cache, with the output of a cold run and of transformers' `generate`, one
after another, concurrently and joining a running batch; a tiny bound forgets entries and serves everything; 0
turns it off; a failing cache falls back to a cold prefill."""

from __future__ import annotations

import random
import threading

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.torch_engine import run, submit, tokens  # noqa: E402

from transerve.backends.generation.engine import DecodingOptions  # noqa: E402
from transerve.backends.generation.torch.engine import TorchEngine  # noqa: E402
from transerve.backends.generation.torch.prefix_cache import BLOCK_TOKENS, PrefixCache  # noqa: E402

ARCHS = ("gpt2", "t5")


def _prompts(count: int, shared: int = 100, seed: int = 0) -> list[list[int]]:
    """`count` prompts of random ids that start with the same `shared` ids, each with a tail of its own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 399) for _ in range(shared)]
    return [prefix + [rng.randrange(1, 399) for _ in range(rng.randrange(1, 24))] for _ in range(count)]


@pytest.fixture(scope="module")
def engines(models):
    """Per architecture: an engine with the default prefix cache and one without (the cold run)."""
    built = {arch: (TorchEngine(models[arch].path), TorchEngine(models[arch].path, prefix_cache_tokens=0))
             for arch in ARCHS}
    yield built
    for warm, cold in built.values():
        warm.close()
        cold.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_prompts_sharing_a_start_reuse_its_cache_with_generates_output(models, engines, arch):
    model, (warm, cold) = models[arch], engines[arch]
    assert cold.prefix_cache is None
    options = DecodingOptions(max_new_tokens=12)
    prompts = _prompts(4) if arch == "gpt2" else [_prompts(1, seed=1)[0]] * 3
    before = warm.prefix_cache.stats.hit_tokens
    for ids in prompts:
        got = tokens(run(warm, ids, options))
        assert got == model.reference(ids, max_new_tokens=12)
        assert got == tokens(run(cold, ids, options))
    stats = warm.prefix_cache.stats
    # decoder-only: the shared 100 tokens' 3 whole blocks for each later prompt; encoder-decoder: the whole source
    expected = 3 * 96 if arch == "gpt2" else 2 * len(prompts[0])
    assert stats.hit_tokens - before == expected


def test_beams_start_from_a_cached_prefix(models, engines):
    model, (warm, _) = models["gpt2"], engines["gpt2"]
    first, second = _prompts(2, seed=2)
    options = DecodingOptions(max_new_tokens=10, beam_width=3, num_return_sequences=2)
    kwargs = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 10}
    assert tokens(run(warm, first, options)) == model.reference(first, **kwargs)
    assert warm.prefix_cache.probe(second) == 96
    assert tokens(run(warm, second, options)) == model.reference(second, **kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_concurrent_and_joining_requests_with_a_shared_start_match_generate(models, engines, arch, monkeypatch):
    """Requests submitted at once, and requests joining a running batch (on the CPU, a decoder-only model's joins
    are prefilled in the step: those with a cached start feed only the tokens after it)."""
    model, (warm, _) = models[arch], engines[arch]
    shared = _prompts(6, seed=3)
    if arch == "t5":
        shared = shared[:3] * 2
    others = _prompts(3, shared=40, seed=4)  # no start in common with the cached ones
    run(warm, shared[0], DecodingOptions(max_new_tokens=2))  # now cached
    forward, fused = warm.runner.forward, []
    if forward.fuses_joins:
        step_with_prompts = forward.step_with_prompts

        def spy(batch, next_tokens, prompts, repeats):
            fused.extend(prompts)
            return step_with_prompts(batch, next_tokens, prompts, repeats)

        monkeypatch.setattr(forward, "step_with_prompts", spy)
    started = threading.Event()
    long = submit(warm, shared[1], DecodingOptions(max_new_tokens=60), on_tokens=lambda *args: started.set())
    assert started.wait(60)
    options = DecodingOptions(max_new_tokens=12)
    hits_before = warm.prefix_cache.stats.hits
    futures = [submit(warm, ids, options) for ids in shared + others]
    for future, ids in zip(futures, shared + others, strict=True):
        assert tokens(future.result(timeout=120)) == model.reference(ids, max_new_tokens=12)
    assert tokens(long.result(timeout=120)) == model.reference(shared[1], max_new_tokens=60)
    if forward.fuses_joins:  # prefilled in the step, those with a cached start from it
        assert any(ids in shared for ids in fused) and any(ids in others for ids in fused)
    # gpt2: every shared prompt; t5: both copies of the two sources encoded before
    assert warm.prefix_cache.stats.hits - hits_before >= (len(shared) if arch == "gpt2" else 4)


def test_prompts_sharing_an_uncached_start_in_one_prefill_compute_it_once(models, engines):
    """A prefill call of several prompts that start alike, nothing cached yet (a burst of a new system prompt):
    the first computes the start and keeps it, the others start from it; the logits are a cold batch's."""
    from transerve.backends.generation.torch.prefix_cache import PrefixCache

    forward = engines["gpt2"][0].runner.forward
    prompts = _prompts(3, seed=30) + [_prompts(1, seed=31)[0]]
    kept = forward.prefixes
    try:
        with torch.inference_mode():
            forward.prefixes = None
            _, cold = forward.prefill(prompts, [1, 2, 1, 1])
            forward.prefixes = PrefixCache(4096, forward.device)
            _, warm = forward.prefill(prompts, [1, 2, 1, 1])
        stats = forward.prefixes.stats
    finally:
        forward.prefixes = kept
    torch.testing.assert_close(cold, warm, rtol=1e-5, atol=1e-5)
    assert (stats.hits, stats.misses, stats.hit_tokens) == (2, 2, 2 * 96)


def test_a_prefill_from_cached_starts_with_tails_of_any_length_equals_a_cold_one(models, engines):
    """Prompts with a cached start and tails of 1 to 60 tokens in one prefill call, and one whose cached start is
    shorter than the others': logits, caches, masks and positions as a cold prefill's."""
    from transerve.backends.generation.torch.prefix_cache import PrefixCache

    forward = engines["gpt2"][0].runner.forward
    start = _prompts(1, shared=70, seed=40)[0][:70]
    rng = random.Random(41)
    prompts = [start + [rng.randrange(1, 399) for _ in range(tail)] for tail in (1, 60, 7)] + [start[:40]]
    kept = forward.prefixes
    try:
        with torch.inference_mode():
            forward.prefixes = None
            cold, cold_logits = forward.prefill(prompts, [1, 1, 2, 1])
            forward.prefixes = PrefixCache(4096, forward.device)
            forward.prefill([start], [1])  # its two whole blocks are kept
            warm, warm_logits = forward.prefill(prompts, [1, 1, 2, 1])
        stats = forward.prefixes.stats
    finally:
        forward.prefixes = kept
    assert (stats.hits, stats.hit_tokens) == (4, 64 * 3 + 32)
    torch.testing.assert_close(cold_logits, warm_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(cold.mask, warm.mask) and torch.equal(cold.positions, warm.positions)
    for (k, v), (wk, wv) in zip(cold.self_kv, warm.self_kv, strict=True):
        for row, length in enumerate(cold.lengths):
            torch.testing.assert_close((k[row, :, -length:], v[row, :, -length:]),
                                       (wk[row, :, -length:], wv[row, :, -length:]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tiny_bound_forgets_entries_and_serves_every_request(models, arch):
    model = models[arch]
    engine = TorchEngine(model.path, prefix_cache_tokens=2 * BLOCK_TOKENS if arch == "gpt2" else 120)
    try:
        load = [ids for seed in range(4) for ids in _prompts(2, seed=10 + seed)]
        options = DecodingOptions(max_new_tokens=8)
        futures = [submit(engine, ids, options) for ids in load]
        for ids in load:  # one after another too
            assert tokens(run(engine, ids, options)) == model.reference(ids, max_new_tokens=8)
        for future, ids in zip(futures, load, strict=True):
            assert tokens(future.result(timeout=120)) == model.reference(ids, max_new_tokens=8)
        cache = engine.prefix_cache
        assert 0 < cache.used_tokens <= cache.capacity and cache.stats.misses > 4
    finally:
        engine.close()


def test_a_failing_cache_falls_back_to_a_cold_prefill(models, engines, monkeypatch):
    model, (warm, _) = models["gpt2"], engines["gpt2"]
    ids = _prompts(1, seed=20)[0]
    run(warm, ids, DecodingOptions(max_new_tokens=2))
    assert warm.prefix_cache.probe(ids) == 96

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(warm.prefix_cache, "lookup", broken)
    monkeypatch.setattr(warm.prefix_cache, "store", broken)
    assert tokens(run(warm, ids, DecodingOptions(max_new_tokens=12))) == model.reference(ids, max_new_tokens=12)
    assert len(warm.prefix_cache) == 0  # a failed store empties it


def test_negative_bound_is_refused(models):
    with pytest.raises(Exception, match="prefix_cache_tokens"):
        TorchEngine(models["gpt2"].path, prefix_cache_tokens=-1)


def _kv(tokens_: int, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer keys and values [heads 1, tokens, dim 1] whose entries are their positions."""
    position = torch.arange(tokens_, dtype=torch.float32)[None, :, None]
    return [(position + layer, -position - layer) for layer in range(layers)]


def test_lookup_returns_whole_blocks_and_never_the_last_token():
    cache = PrefixCache(1024, torch.device("cpu"), block=4)
    ids = list(range(1, 11))
    cache.store(ids, _kv(10))
    assert len(cache) == 2 and cache.used_tokens == 8
    assert cache.lookup(ids[:8]).length == 4  # the 8th token is left to compute: its logits start decoding
    found = cache.lookup(ids + [99])
    assert found.length == 8 and found.kv[1][0].shape == (1, 1, 8, 1)
    assert found.kv[1][0].flatten().tolist() == [p + 1.0 for p in range(8)]
    assert cache.lookup([1, 2, 3, 5, 5, 6, 7, 8, 9]).length == 0
    assert (cache.stats.hits, cache.stats.misses, cache.stats.hit_tokens) == (2, 1, 12)


def test_the_least_recently_used_chain_end_is_forgotten_first():
    cache = PrefixCache(12, torch.device("cpu"), block=4)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]
    cache.store(a, _kv(8))
    cache.store(b, _kv(8))  # shares a's first block
    assert len(cache) == 3
    cache.lookup(a + [0])  # a's chain is used last: b's end goes first
    cache.store([7, 7, 7, 7], _kv(4))
    assert cache.probe(a + [0]) == 8 and cache.probe(b + [0]) == 4 and cache.probe([7, 7, 7, 7, 0]) == 4
    cache.store([6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6], _kv(12))  # a chain as large as the cache replaces all
    assert cache.probe([6] * 13) == 12 and cache.used_tokens == 12 and len(cache) == 3
