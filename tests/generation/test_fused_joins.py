"""Joining prompts prefilled in the running rows' step (`fused_joins`): the same numbers as a step and a prefill."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transerve.backends.generation.torch.engine import TorchEngine  # noqa: E402

#: Tiny decoder-only configurations of the other model types fused joins are allowed for (grouped-query
#: attention: fewer key heads than query heads), and one whose sliding window a sequence could outgrow.
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256, "vocab_size": 300}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=None),
    "mistral_window": lambda: transformers.MistralConfig(**SMALL, sliding_window=64),
}


@pytest.fixture(scope="module")
def model_dirs(models, tmp_path_factory):
    torch.manual_seed(0)
    dirs = {"gpt2": models["gpt2"].path}
    for name, config in CONFIGS.items():
        dirs[name] = tmp_path_factory.mktemp(name)
        transformers.AutoModelForCausalLM.from_config(config()).save_pretrained(dirs[name])
    return dirs


@pytest.fixture(params=["gpt2", "llama", "qwen2", "mistral"])
def runner(request, model_dirs):
    engine = TorchEngine(model_dirs[request.param], max_batch_rows=8)
    yield engine.runner.forward
    engine.close()


@pytest.fixture
def gpt2_runner(models):
    engine = TorchEngine(models["gpt2"].path, max_batch_rows=8)
    yield engine.runner.forward
    engine.close()


def running_batch(runner, prompts):
    """A running batch of `prompts` (one row each), two steps in, and its next tokens."""
    batch, logits = runner.new_rows(prompts, [1] * len(prompts))
    tokens = logits.argmax(-1)
    for _ in range(2):
        tokens = runner.step(batch, tokens).argmax(-1)
    return batch, tokens


@pytest.mark.parametrize("repeats", [[1, 1], [2, 1]])
def test_a_step_with_prompts_equals_a_step_and_a_prefill(runner, repeats):
    """Logits of the running rows and of the new ones, the grown caches and the new rows' caches, masks and
    positions: those of a step and a separate prefill (beams' repeated rows included); the running rows' bitwise,
    the new rows' within float rounding (the separate prefill pads the shorter prompt and masks the padding)."""
    assert runner.fuses_joins
    running, prompts = [[5, 6, 7, 8, 9], [10, 11]], [[12, 13, 14], [15, 16, 17, 18, 19, 20, 21]]
    with torch.inference_mode():
        apart, apart_tokens = running_batch(runner, running)
        together, together_tokens = running_batch(runner, running)
        step_logits = runner.step(apart, apart_tokens)
        new, new_logits = runner.new_rows(prompts, repeats)
        fused_logits, fused_new, fused_new_logits = runner.step_with_prompts(
            together, together_tokens, prompts, repeats)
    assert torch.equal(step_logits, fused_logits)
    torch.testing.assert_close(new_logits, fused_new_logits, rtol=1e-5, atol=1e-5)
    for mine, theirs in ((apart, together), (new, fused_new)):
        assert torch.equal(mine.mask, theirs.mask) and torch.equal(mine.positions, theirs.positions)
        assert mine.lengths == theirs.lengths
        for (k, v), (fk, fv) in zip(mine.self_kv, theirs.self_kv, strict=True):
            if mine is apart:
                assert torch.equal(k, fk) and torch.equal(v, fv)
            else:  # the real steps (the separate prefill's padding holds the pad token's keys, ours zeros)
                for row, length in enumerate(mine.lengths):
                    torch.testing.assert_close((k[row, :, -length:], v[row, :, -length:]),
                                               (fk[row, :, -length:], fv[row, :, -length:]), rtol=1e-5, atol=1e-5)


def test_a_forward_whose_attention_did_not_run_fused_fails_instead_of_answering(gpt2_runner):
    """Should a model's attention layers bypass the fused attention (here: switched to transformers' eager one),
    the step fails loudly rather than return what attention over the whole token axis computed."""
    runner = gpt2_runner
    with torch.inference_mode():
        batch, tokens = running_batch(runner, [[5, 6, 7]])
        runner.model.set_attn_implementation("eager")
        with pytest.raises(RuntimeError, match="did not run the fused attention"):
            runner.step_with_prompts(batch, tokens, [[8, 9]], [1])


def test_a_sliding_window_model_joins_as_before(model_dirs):
    """The fused attention sees every key: a model whose window a sequence could outgrow keeps separate prefills."""
    engine = TorchEngine(model_dirs["mistral_window"], max_batch_rows=4)
    try:
        assert not engine.runner.forward.fuses_joins
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_encoder_decoder_models_join_as_before(models, arch):
    """Their new rows decode their first token in the next step anyway: nothing to fuse."""
    engine = TorchEngine(models[arch].path, max_batch_rows=4)
    try:
        assert not engine.runner.forward.fuses_joins
    finally:
        engine.close()


@pytest.mark.parametrize("repeats", [[1, 1, 1], [2, 1, 1]])
def test_prompts_with_a_cached_start_join_as_a_cold_prefill_would(runner, repeats):
    """Prompts whose start is cached (`prefix_cache`, blocks of 4 here) feed only the tokens after it, in the step
    (`step_with_prompts`) and in a prefill of their own: the running rows' logits bitwise, the new rows' logits and
    caches within float rounding of a cold prefill's; one prompt has no cached start, one a single token after it."""
    from transerve.backends.generation.torch.prefix_cache import PrefixCache

    start = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]
    running, prompts = [[5, 6, 7, 8, 9], [10, 11]], [start + [40, 41], [50, 51, 52], start[:9]]
    kept = runner.prefixes
    try:
        runner.prefixes = None
        with torch.inference_mode():
            apart, apart_tokens = running_batch(runner, running)
            together, together_tokens = running_batch(runner, running)
            step_logits = runner.step(apart, apart_tokens)
            cold, cold_logits = runner.new_rows(prompts, repeats)
            runner.prefixes = PrefixCache(1024, runner.device, block=4)
            runner.new_rows([start], [1])  # its two whole blocks are kept
            fused_logits, fused, fused_new_logits = runner.step_with_prompts(
                together, together_tokens, prompts, repeats)
            assert runner.prefixes.stats.hit_tokens == 16
            alone, alone_logits = runner.new_rows(prompts, repeats)
            assert runner.prefixes.stats.hit_tokens == 16 + 8 + 8
    finally:
        runner.prefixes = kept
    assert torch.equal(step_logits, fused_logits)
    for new, logits in ((fused, fused_new_logits), (alone, alone_logits)):
        torch.testing.assert_close(cold_logits, logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(cold.mask, new.mask) and torch.equal(cold.positions, new.positions)
        assert cold.lengths == new.lengths
        for (k, v), (nk, nv) in zip(cold.self_kv, new.self_kv, strict=True):
            for row, length in enumerate(cold.lengths):
                torch.testing.assert_close((k[row, :, -length:], v[row, :, -length:]),
                                           (nk[row, :, -length:], nv[row, :, -length:]), rtol=1e-5, atol=1e-5)
