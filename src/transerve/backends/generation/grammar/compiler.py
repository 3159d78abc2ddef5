"""Compiling constraints against one model's tokenizer: the llguidance tokenizer is built once per model (the
first constrained request pays for it), and each constraint's grammar once per tokenizer, kept in a bounded LRU of
matchers in their start state; a row gets a copy of its constraint's matcher, which shares the compiled grammar.
"""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transerve.backends.generation.grammar.constraint import Constraint, _llguidance
from transerve.backends.generation.grammar.masks import BatchMasks, RowGrammar
from transerve.core.errors import invalid_arg

if TYPE_CHECKING:
    import torch

#: Compiled constraints one model keeps (each a matcher in its start state); the least recently used goes first.
CACHE_SIZE = 256


class GrammarCompiler:
    """One model's tokenizer for llguidance and its compiled constraints. Thread-safe: submits may come from any
    thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int], device: torch.device,
                 cache_size: int = CACHE_SIZE) -> None:
        #: The llguidance tokenizer (`LLTokenizer`) over the model's whole vocabulary (logits' width).
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.cache_size = cache_size
        #: The mask buffer every constrained row of this model's batch shares.
        self.masks = BatchMasks(vocab_size, device)
        self._cache: collections.OrderedDict[Constraint, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        #: Compilations done (cache misses), for tests and benchmarks.
        self.compiled = 0

    @classmethod
    def from_model_dir(cls, model_dir: Path, vocab_size: int, eos_ids: list[int],
                       device: torch.device) -> GrammarCompiler:
        """The compiler for the tokenizer saved with the model (a fast tokenizer: `tokenizer.json`)."""
        _llguidance()  # installed, or INVALID_ARG naming the extra
        import transformers

        try:
            hf = transformers.AutoTokenizer.from_pretrained(model_dir)
        except Exception as error:  # noqa: BLE001 - any failure means: no tokenizer to constrain with
            raise invalid_arg(f"structured outputs need the model's tokenizer, which did not load: {error}") from None
        if not isinstance(hf, transformers.PreTrainedTokenizerFast):
            raise invalid_arg("structured outputs need a fast tokenizer (tokenizer.json) saved with the model")
        from llguidance.hf import from_tokenizer

        tokenizer = from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos_ids or None)
        return cls(tokenizer, vocab_size, eos_ids, device)

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher (`LLMatcher`, start state) for `constraint`, compiled on first use; INVALID_ARG for one
        that does not compile against this tokenizer."""
        with self._lock:
            start = self._cache.get(constraint)
            if start is not None:
                self._cache.move_to_end(constraint)
                return start.deep_copy()
        llguidance = _llguidance()
        start = llguidance.LLMatcher(self.tokenizer, constraint.grammar(), log_level=0)
        if start.is_error():
            raise invalid_arg(f"the {constraint.kind} constraint does not compile: {start.get_error()}")
        with self._lock:
            self.compiled += 1
            self._cache[constraint] = start
            self._cache.move_to_end(constraint)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return start.deep_copy()

    def row(self, constraint: Constraint, end_ids: list[int]) -> RowGrammar:
        """The grammar state of one new row decoding under `constraint`, ended by `end_ids`."""
        return RowGrammar(self.matcher(constraint), end_ids, self.masks)
