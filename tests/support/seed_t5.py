"""A local stand-in for the Hugging Face `t5-small`/`t5-base` folders the FasterTransformer T5 tutorial (seed 000)
downloads: a random-weight small T5 and a SentencePiece-style (Unigram) tokenizer that the tutorial's client loads
offline with `T5Tokenizer`, `PreTrainedTokenizerFast` and `T5ForConditionalGeneration.from_pretrained`."""

from __future__ import annotations

import json
from pathlib import Path

from support.generation_models import CORPUS

SENTENCES = [*CORPUS, "Translate EnglishTo German: I want to rest a bit!", "Ich möchte ein wenig Ruhe!"]


def build_seed_t5(path: Path, seed: int = 0) -> Path:
    """`path/` holding config.json, the weights and tokenizer.json + tokenizer_config.json (T5Tokenizer's)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=400, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
                                      show_progress=False)
    unigram.train_from_iterator(SENTENCES * 10, trainer)
    vocab = [tuple(piece) for piece in json.loads(unigram.to_str())["model"]["vocab"]]
    tokenizer = transformers.T5Tokenizer(vocab=vocab, extra_ids=0)
    config = transformers.T5Config(
        vocab_size=len(tokenizer), d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0, initializer_factor=4.0,
    )
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(config).eval()
    model.generation_config = transformers.GenerationConfig.from_model_config(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
