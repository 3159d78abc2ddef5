"""The contract between the generation backend and its engines (CTranslate2, PyTorch).

The backend turns each row of a request into one `GenerationRequest` (token ids in, decoding options) and hands it
to the instance's engine with `submit`. An engine owns its thread: it schedules the sequences it holds as it sees fit
(the torch engine joins new sequences into the running batch at the next decoding step; CTranslate2 batches whole
requests) and reports back through the two callbacks, which it calls from its own thread. The backend moves those
reports onto the event loop; an engine never touches the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from transerve.backends.generation.grammar.constraint import Constraint
from transerve.core.engine_load import EngineLoad
from transerve.core.errors import invalid_arg


@dataclass(slots=True)
class DecodingOptions:
    """How one sequence is decoded. Defaults decode greedily up to `max_new_tokens`."""

    max_new_tokens: int = 64
    #: Fewest new tokens before an end token may be chosen.
    min_new_tokens: int = 0
    beam_width: int = 1
    #: Hypotheses returned (at most `beam_width`; 1 when sampling).
    num_return_sequences: int = 1
    #: Beam scores are divided by length ** length_penalty, as transformers does.
    length_penalty: float = 1.0
    #: Sampling is on when `top_k` != 1 or `top_p` < 1 or `temperature` != 1 is asked for with beam width 1;
    #: `sampling` says so explicitly. 0 for top_k means no top-k cut.
    sampling: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    #: When sampling, after top-p: tokens less likely than `min_p` times the likeliest are cut (0: off), as
    #: transformers' MinPLogitsWarper cuts them. The torch engine honours it; CTranslate2 refuses it.
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    #: Seeds the sequence's own generator: the same seed gives the same tokens, whatever else runs alongside.
    random_seed: int | None = None
    #: End tokens; None means the model's own end-of-sequence token(s).
    end_ids: list[int] | None = None
    #: Token sequences that end generation when produced (the sequence is kept, the stop tokens included).
    stop_sequences: list[list[int]] = field(default_factory=list)
    #: Token sequences never produced.
    bad_words: list[list[int]] = field(default_factory=list)
    return_log_probs: bool = False
    #: Per generated token, this many likeliest tokens with their log-probabilities (0: none; at most
    #: `MAX_TOP_LOGPROBS`, beam width 1 only), from the distribution `log_probs` reports; implies `return_log_probs`.
    top_logprobs: int = 0
    #: The structured output the tokens must form (a JSON schema, a regex, ...: `grammar`); None: free text. The
    #: torch engine decodes it under a grammar (beam width 1); CTranslate2 refuses it.
    constraint: Constraint | None = None
    #: The prompt's own log-probabilities (decoder-only models): None: not asked; k: each prompt token's after the
    #: first, and its position's k likeliest tokens. With it, `max_new_tokens` may be 0: the prompt is scored only.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.top_logprobs:  # a top list without the chosen token's own log-probability would be half an answer
            self.return_log_probs = True


@dataclass(slots=True)
class GenerationRequest:
    """One sequence to generate: the encoder's input (encoder-decoder) or the prompt (decoder-only)."""

    input_ids: list[int]
    options: DecodingOptions
    #: Whether `on_tokens` should be called as tokens are produced (streaming, beam width 1 only).
    stream: bool = False
    #: Admission order among waiting sequences: lower first, then arrival (`request_priority` maps a request's).
    priority: int = 0


#: The largest `top_logprobs` a request may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
#: Bounds on one sequence's word lists (`bad_words`, `stop_sequences`), each list on its own: how many words, and
#: how many token ids in all. Every step checks every running sequence's words, so one client's lists are bounded
#: for the sake of the sequences that share its batch (docs/generation.md).
MAX_WORDS = 1024
MAX_WORD_TOKENS = 8192
#: The most end ids one sequence may name.
MAX_END_IDS = 64


def check_token_options(options: DecodingOptions, vocab_size: int) -> None:
    """INVALID_ARG, naming the field, for an option that names a token the model cannot produce or a word list
    past its bounds: checked before a sequence is queued, because inside a running batch such a token would fail
    the step of every sequence that shares it."""
    for name, words in (("bad_words", options.bad_words), ("stop_words", options.stop_sequences)):
        check_word_count(name, len(words))
        if sum(len(word) for word in words) > MAX_WORD_TOKENS:
            raise invalid_arg(f"{name} holds {sum(len(word) for word in words)} token ids in all; at most "
                              f"{MAX_WORD_TOKENS} are taken")
        for word in words:
            if not word:
                raise invalid_arg(f"{name} holds an empty word: each word needs at least one token id")
            outside = next((token for token in word if not 0 <= token < vocab_size), None)
            if outside is not None:
                raise invalid_arg(f"{name} holds token id {outside}, outside this model's vocabulary "
                                  f"[0, {vocab_size})")
    if options.end_ids is not None:
        if len(options.end_ids) > MAX_END_IDS:
            raise invalid_arg(f"end_id names {len(options.end_ids)} tokens; at most {MAX_END_IDS} are taken")
        outside = next((token for token in options.end_ids if not 0 <= token < vocab_size), None)
        if outside is not None:
            raise invalid_arg(f"end_id {outside} is outside this model's vocabulary [0, {vocab_size})")


def check_prompt_options(options: DecodingOptions, is_encoder_decoder: bool) -> None:
    """INVALID_ARG for `max_new_tokens` below 1 unless the prompt is only scored, and for prompt scores asked of an
    encoder-decoder model (its input is the encoder's, which the model does not predict)."""
    if options.prompt_logprobs is None:
        if options.max_new_tokens < 1:
            raise invalid_arg("max_new_tokens must be at least 1 (0 only with prompt_logprobs, to score the prompt)")
        return
    if is_encoder_decoder:
        raise invalid_arg("prompt_logprobs needs a decoder-only model: an encoder-decoder model's input goes to its "
                          "encoder, whose tokens it does not predict")
    if not 0 <= options.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid_arg(f"prompt_logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {options.prompt_logprobs}")
    if options.max_new_tokens < 0:
        raise invalid_arg("max_new_tokens must not be negative")


def check_word_count(name: str, count: int) -> None:
    """INVALID_ARG for a word list of more than `MAX_WORDS` words (checked while parsing, before it is copied)."""
    if count > MAX_WORDS:
        raise invalid_arg(f"{name} holds {count} words; at most {MAX_WORDS} are taken")

#: One generated token's `top_logprobs` likeliest tokens: (token id, log-probability), likeliest first.
TopLogProbs = list[tuple[int, float]]


@dataclass(slots=True)
class Hypothesis:
    #: The new tokens only (no prompt, no decoder start token); ends with the end token when one was produced.
    token_ids: list[int]
    #: Cumulative log-probability (beam search: the length-penalised score transformers reports).
    score: float = 0.0
    #: Log-probability of each token of `token_ids`, when `return_log_probs` was asked for.
    log_probs: list[float] | None = None
    #: Per token of `token_ids`, its step's likeliest tokens, when `top_logprobs` was asked for.
    top_log_probs: list[TopLogProbs] | None = None


@dataclass(slots=True)
class PromptScores:
    """A prompt's tokens scored by the model, each given the tokens before it: entry i is about token i + 1 (the
    first token has nothing before it)."""

    log_probs: list[float]
    #: Per entry, that position's likeliest tokens (`prompt_logprobs` of them; empty lists for 0).
    top: list[TopLogProbs]
    #: Per entry, the token's rank in its position's distribution (1: the likeliest), as vLLM reports it.
    ranks: list[int]


@dataclass(slots=True)
class GenerationResult:
    #: Best first, `num_return_sequences` of them.
    hypotheses: list[Hypothesis]
    #: "length" (max_new_tokens reached), "end" (an end token or stop sequence), "cancelled".
    finish_reason: str = "end"
    #: The prompt's scores, when `prompt_logprobs` was asked.
    prompt: PromptScores | None = None


class TokenCallback(Protocol):
    """Called from the engine thread with the token(s) a streaming sequence produced since the last call; when the
    request asked for log-probabilities, with theirs too (and, for `top_logprobs`, their top lists), so that a
    request that did not ask pays nothing for them."""

    def __call__(self, tokens: list[int], log_probs: list[float] | None = None,
                 top: list[TopLogProbs] | None = None) -> None: ...

#: Called exactly once from the engine thread: the result, or the error that ended the sequence.
DoneCallback = Callable[[GenerationResult | Exception], None]


class SequenceHandle(Protocol):
    def cancel(self) -> None:
        """Stop decoding this sequence at the engine's next step; `done` then gets finish_reason "cancelled"."""


class GenerationEngine(Protocol):
    """One loaded model on one device. `submit` and `close` are thread-safe and return at once."""

    #: True for encoder-decoder models (T5, BART, Marian), False for decoder-only ones.
    is_encoder_decoder: bool
    #: The model's own end-of-sequence token ids.
    eos_token_ids: list[int]
    #: Longest input (prompt) the model accepts, in tokens.
    max_input_length: int
    vocab_size: int
    #: Token ids an input may hold: `[0, input_vocab_size)` (the source vocabulary of a CTranslate2 translator).
    input_vocab_size: int
    #: Rows decoded together (each beam is a row): the largest beam width a request may ask for.
    max_batch_rows: int

    def submit(self, request: GenerationRequest, on_tokens: TokenCallback | None, done: DoneCallback) -> SequenceHandle:
        """Queue one sequence. A request the engine can never serve (too long for its memory budget, an option it
        does not support) gets `done(ServerError(INVALID_ARG ...))`, never a silent truncation."""

    def load(self) -> EngineLoad:
        """The sequences decoding and waiting now, and the key/value budget's use where the engine has one: read
        from any thread, without waiting for the engine (a gauge may be a step behind)."""

    def close(self) -> None:
        """Finish nothing more: pending sequences get `done(ServerError(UNAVAILABLE ...))`; the thread ends."""
