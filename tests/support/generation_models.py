"""Small random-weight generation models saved as Hugging Face folders (nothing can be downloaded here).

Each folder holds `config.json`, the weights, `generation_config.json` and a byte-level BPE tokenizer trained
locally on a few sentences (`tokenizer.json`, loaded by `AutoTokenizer` as a `PreTrainedTokenizerFast`), with the
special tokens where each architecture's converters and `generate` expect them. Byte-level tokens mean any text,
Korean or emoji included, encodes without unknown tokens, and a multi-byte character can span several tokens:
what a streaming detokenizer must not split. Weights are drawn wider than the defaults so that logits are peaked
and greedy decoding is not decided by rounding noise between engines.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

ARCHITECTURES = ("t5", "bart", "marian", "gpt2")
ENCODER_DECODER = ("t5", "bart", "marian")

CORPUS = [
    "translate English to German: The house is wonderful.",
    "Das Haus ist wunderbar.",
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, how are you today?",
    "Serving transformer models should be simple.",
    "안녕하세요 세계, 반갑습니다.",
    "emoji 🙂 and more emoji 🚀 in one line",
]


def _train_tokenizer(specials: list[str], template: tuple[str, list[str]] | None, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 10, trainer)
    if tokenizer.get_vocab_size() < vocab_size:
        tokenizer = _pad_vocabulary(tokenizer, vocab_size)
    if template is not None:
        single, tokens = template
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=[(token, tokenizer.token_to_id(token)) for token in tokens],
        )
    return tokenizer


def _pad_vocabulary(tokenizer, vocab_size: int):
    """The tokenizer with `<extra_id_N>` tokens appended up to `vocab_size`: the corpus yields a few hundred tokens,
    benchmarks need real vocabulary sizes (the output layer's cost). BPE never produces them (no merges lead
    there); they decode to their own text, as T5's extra ids do."""
    from tokenizers import Tokenizer

    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    for index in range(vocab_size - tokenizer.get_vocab_size()):
        vocab[f"<extra_id_{index}>"] = len(vocab)
    return Tokenizer.from_str(json.dumps(data))


def _save_tokenizer(path: Path, tokenizer, special_tokens: dict[str, str]) -> None:
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 128, **special_tokens}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def build_t5(path: Path, overrides: dict, d_model: int = 64, layers: int = 2, vocab_size: int = 400):
    import transformers

    tokenizer = _train_tokenizer(["<pad>", "</s>", "<unk>"], ("$A </s>", ["</s>"]), vocab_size)
    config = transformers.T5Config(
        vocab_size=tokenizer.get_vocab_size(), d_model=d_model, d_kv=d_model // 4, d_ff=2 * d_model,
        num_layers=layers, num_heads=4, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        initializer_factor=4.0,
    )
    config.update(overrides)
    model = transformers.T5ForConditionalGeneration(config)
    return model, tokenizer, {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}


def build_bart(path: Path, overrides: dict, d_model: int = 64, layers: int = 2, vocab_size: int = 400):
    import transformers

    tokenizer = _train_tokenizer(["<s>", "<pad>", "</s>", "<unk>"], ("<s> $A </s>", ["<s>", "</s>"]), vocab_size)
    config = transformers.BartConfig(
        vocab_size=tokenizer.get_vocab_size(), d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model, max_position_embeddings=256, bos_token_id=0, pad_token_id=1, eos_token_id=2,
        decoder_start_token_id=2, forced_bos_token_id=None, forced_eos_token_id=None, init_std=0.3,
        # Keys real BART checkpoints carry in config.json, which CTranslate2's converter reads.
        normalize_before=False, normalize_embedding=True, add_final_layer_norm=False, scale_embedding=False,
    )
    config.update(overrides)
    model = transformers.BartForConditionalGeneration(config)
    specials = {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
    return model, tokenizer, specials


def build_marian(path: Path, overrides: dict, d_model: int = 64, layers: int = 2, vocab_size: int = 400):
    import transformers

    # Marian's vocabulary ends with <pad>, which is also the decoder's start token.
    tokenizer = _train_tokenizer(["</s>", "<unk>"], ("$A </s>", ["</s>"]), vocab_size - 1)
    tokenizer.add_special_tokens(["<pad>"])
    pad = tokenizer.token_to_id("<pad>")
    config = transformers.MarianConfig(
        vocab_size=tokenizer.get_vocab_size(), d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model, max_position_embeddings=256, pad_token_id=pad, eos_token_id=0,
        decoder_start_token_id=pad, forced_eos_token_id=None, init_std=0.3, scale_embedding=True,
    )
    config.update(overrides)
    model = transformers.MarianMTModel(config)
    return model, tokenizer, {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}


def build_gpt2(path: Path, overrides: dict, d_model: int = 64, layers: int = 2, vocab_size: int = 400):
    import transformers

    tokenizer = _train_tokenizer(["<|endoftext|>"], None, vocab_size)
    config = transformers.GPT2Config(
        vocab_size=tokenizer.get_vocab_size(), n_embd=d_model, n_layer=layers, n_head=4, n_positions=256,
        bos_token_id=0, eos_token_id=0, initializer_range=0.3,
    )
    config.update(overrides)
    model = transformers.GPT2LMHeadModel(config)
    token = "<|endoftext|>"
    return model, tokenizer, {"bos_token": token, "eos_token": token, "unk_token": token}


BUILDERS: dict[str, Callable] = {"t5": build_t5, "bart": build_bart, "marian": build_marian, "gpt2": build_gpt2}


def build_generation_model(
    architecture: str, path: Path, seed: int = 0, config: dict[str, object] | None = None, **sizes: int
) -> Path:
    """Save a random-weight `architecture` model with its tokenizer at `path` (created); return `path`.

    `sizes` (d_model, layers, vocab_size) default to a tiny model; benchmarks pass real shapes, and `config`
    overrides any other field of the transformers config (e.g. t5-small's `d_ff`, `num_heads`, `d_kv`). Past the
    few hundred tokens the training corpus yields, the vocabulary is padded with tokens BPE never produces.
    """
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model, tokenizer, specials = BUILDERS[architecture](path, config or {}, **sizes)
    model.eval()
    model.generation_config = transformers.GenerationConfig.from_model_config(model.config)
    model.save_pretrained(path)
    _save_tokenizer(path, tokenizer, specials)
    return path
