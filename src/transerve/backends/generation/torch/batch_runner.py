"""The torch engine's side of the model: loading it (linear layers swapped for oneDNN's), the facts the rest of
the engine reads from it, the thread counts its calls run with, and the running batch it steps (`decoder_batch`:
the forward pass and the KV cache). A part of its own because everything here touches the device and torch's
threads; the scheduler and token selection never do.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transerve.backends.generation.host_copies import to_device
from transerve.backends.generation.sampling import ModelRules
from transerve.backends.threaded import import_engine
from transerve.backends.torch_attention import use_decoding_attention
from transerve.core.errors import invalid_arg

if TYPE_CHECKING:
    import torch

    from transerve.backends.generation.decoder_batch import DecoderBatch, ModelRunner

logger = logging.getLogger(__name__)

COMPUTE_TYPES = ("float32", "float16", "bfloat16")
#: Longest source of a model without absolute positions (T5) whose tokenizer does not say.
DEFAULT_MAX_INPUT_LENGTH = 512


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What admission and token selection need to know of the model, read once at load."""

    is_encoder_decoder: bool
    eos_token_ids: list[int]
    vocab_size: int
    #: Decoder positions (absolute position embeddings), None when unbounded (relative).
    max_positions: int | None
    max_input_length: int
    early_stopping: bool | str
    #: The constraints of the model's generation config that `generate` applies whatever the call asks.
    rules: ModelRules
    #: The decoder start token (encoder-decoder models), and the padding token.
    start_id: int | None
    pad_id: int


def load(model_dir: Path, device: str, compute_type: str, onednn_linear: bool) -> tuple[Any, bool, ModelFacts]:
    """The model on its device, whether its linear layers compute on oneDNN (`onednn_linear`: CPU float32 only),
    and its facts."""
    import_engine("torch", "generation")
    transformers = import_engine("transformers", "generation")
    if compute_type not in COMPUTE_TYPES:
        raise invalid_arg(f"compute_type {compute_type!r} is not one of {', '.join(COMPUTE_TYPES)} for torch")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    encoder_decoder = bool(config.is_encoder_decoder)
    loader = transformers.AutoModelForSeq2SeqLM if encoder_decoder else transformers.AutoModelForCausalLM
    model, onednn = _on_own_thread(lambda: _load_model(loader, model_dir, device, compute_type, onednn_linear))
    generation = model.generation_config
    eos = generation.eos_token_id if generation.eos_token_id is not None else getattr(config, "eos_token_id", None)
    eos_token_ids: list[int] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    text = config.get_text_config(decoder=True)
    pad = generation.pad_token_id if generation.pad_token_id is not None else getattr(config, "pad_token_id", None)
    pad = pad if pad is not None else (eos_token_ids[0] if eos_token_ids else 0)
    start = generation.decoder_start_token_id
    if start is None:
        start = getattr(config, "decoder_start_token_id", None)
        start = start if start is not None else getattr(config, "bos_token_id", None)
    if encoder_decoder and start is None:
        raise invalid_arg(f"{model_dir}: the model names no decoder_start_token_id")
    facts = ModelFacts(
        is_encoder_decoder=encoder_decoder,
        eos_token_ids=eos_token_ids,
        vocab_size=text.vocab_size,
        max_positions=_max_positions(text),
        max_input_length=_max_input_length(model_dir, config),
        early_stopping=generation.early_stopping,
        rules=_model_rules(generation, encoder_decoder),
        start_id=start,
        pad_id=pad,
    )
    return model, onednn, facts


class ThreadPolicy:
    """How many threads each kind of work computes with. Joining work (the encoder call or prompt prefill:
    compute-bound) while at most `latency_rows` rows run (a lone request: idle cores, and its time to first token
    waits on it) runs on `latency_threads`; the rest on `load_threads` (intra_op_threads), which leaves other cores
    to the server and its clients: a step of a few rows reads every weight for little arithmetic and gains nothing
    from more threads. OpenMP's thread count (and MKL's) belongs to the calling thread, so each thread of the
    engine sets its own."""

    def __init__(self, device: torch.device, intra_op_threads: int, latency_threads: int, latency_rows: int) -> None:
        import torch

        self.device = device
        self.load_threads = intra_op_threads or torch.get_num_threads()
        self.latency_threads = latency_threads or cpu_count()
        self.latency_rows = latency_rows
        #: What the engine thread last set (0: nothing yet).
        self.current = 0
        #: Threads the joining thread computes with: it prepares waiting sequences' rows while the engine thread
        #: decodes, on the cores decoding leaves idle (on a GPU: the device's work, `load_threads` for the CPU
        #: side); there is no such thread when decoding uses every core (0).
        self.joining_threads = (
            self.load_threads if device.type != "cpu" else min(self.load_threads, cpu_count() - self.load_threads)
        )

    def start_thread(self, joining: bool) -> None:
        """At the start of an engine thread (`joining`: the joining thread, which keeps `joining_threads`). torch's
        lazy per-thread setup runs first, so that it cannot undo a count set later; and the thread's current CUDA
        device, which torch also keeps per thread (cuda:0 until set), becomes the engine's, so that the streams and
        graph recordings that name no device are on it."""
        import torch

        torch.get_num_threads()
        if self.device.type == "cuda" and self.device.index is not None:  # bare "cuda" is the current one
            torch.cuda.set_device(self.device)
        if joining:
            torch.set_num_threads(self.joining_threads)
        else:
            self.current = 0  # a new thread: nothing set yet

    def set(self, joining: bool, used_rows: int) -> None:
        """On the engine thread: the count for joining work (`joining`) or a step, with `used_rows` rows running."""
        import torch

        wanted = self.latency_threads if joining and used_rows <= self.latency_rows else self.load_threads
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted


class BatchRunner:
    """The running batch on the device: its rows' caches (`DecoderBatch`), their next input tokens, and the model
    calls (`forward`) that step it. Used by the engine thread only."""

    def __init__(self, forward: ModelRunner, threads: ThreadPolicy) -> None:
        self.forward = forward
        self.threads = threads
        self.device = forward.device
        self.batch: DecoderBatch | None = None
        self.next_tokens: torch.Tensor | None = None

    def step(self, new: tuple[DecoderBatch, torch.Tensor] | None,
             prompts: tuple[list[list[int]], list[int]] | None = None) -> torch.Tensor | None:
        """One step: the running rows and the `new` ones (their batch, and first decoder inputs or first logits)
        merged, then those of `prompts` (decoder-only, inputs and rows per sequence, with rows running: prefilled
        in the step's own forward, `ModelRunner.step_with_prompts`); returns every row's logits (float32, batch
        order), None when no row runs."""
        import torch

        if self.forward.encoder_decoder:  # new rows' first decoder inputs go through this step with the others'
            if new is not None:
                self._merge(new[0])
                self.next_tokens = new[1] if self.next_tokens is None else torch.cat((self.next_tokens, new[1]))
            if self.batch is None:
                return None
            self.threads.set(joining=False, used_rows=0)
            return self.forward.step(self.batch, self.next_tokens).float()
        logits, fresh = None, None
        if self.batch is not None:
            self.threads.set(joining=False, used_rows=0)
            if prompts:
                logits, *fresh = self.forward.step_with_prompts(self.batch, self.next_tokens, *prompts)
            else:
                logits = self.forward.step(self.batch, self.next_tokens)
        for rows in (new, fresh):  # their prompts are in the cache already, and `rows[1]` holds their first logits
            if rows:
                self._merge(rows[0])
                logits = rows[1] if logits is None else torch.cat((logits, rows[1]))
        return None if logits is None else logits.float()

    def feed(self, keep: list[int], next_tokens: list[int], same_sequences: bool) -> None:
        """After a step: keep the batch rows `keep`, in that order, with their next input tokens. `same_sequences`
        says that rows only moved among their own sequence's rows (beams), whose encoder states are all alike."""
        import torch

        self.next_tokens = None
        self.select(keep, same_sequences)
        if self.batch is not None:
            self.next_tokens = to_device(next_tokens, self.device, torch.long)

    def select(self, keep: list[int], same_sequences: bool = False) -> None:
        """Keep the batch rows `keep`, in that order (no-op when nothing changes)."""
        import torch

        if self.batch is None:
            return
        if not keep:
            self.clear()
            return
        if keep != list(range(self.batch.rows)):
            index = to_device(keep, self.device, torch.long)
            self.batch.select(index, decoder_only=same_sequences, order=keep)
            if self.next_tokens is not None:
                self.next_tokens = self.next_tokens.index_select(0, index)

    def clear(self) -> None:
        self.batch, self.next_tokens = None, None

    def _merge(self, batch: DecoderBatch) -> None:
        if self.batch is None:
            self.batch = batch
        else:
            self.batch.extend(batch)


def cpu_count() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _load_model(loader: Any, model_dir: Path, device: str, compute_type: str, onednn_linear: bool) -> tuple[Any, bool]:
    """The model on its device, and whether its linear layers compute on oneDNN (`onednn_linear`: CPU float32)."""
    import torch

    use_decoding_attention(torch, torch.device(device))  # the key length changes every step
    model = loader.from_pretrained(model_dir, dtype=getattr(torch, compute_type))
    model.to(torch.device(device)).eval()
    if not (onednn_linear and model.device.type == "cpu" and compute_type == "float32"):
        return model, False
    from transerve.backends.generation.onednn_linear import onednn_available, use_onednn_linears

    if onednn_available(torch):
        return model, use_onednn_linears(model) > 0
    logger.warning("%s: this torch build has no working oneDNN linear; using torch's own", model_dir)
    return model, False


def _on_own_thread(function: Callable[[], Any]) -> Any:
    """`function()` on a thread that ends with it. torch's OpenMP runtime (libgomp) keeps a pool of worker threads
    for each thread that has run a parallel region, for as long as that thread lives; once a process holds more
    such threads than cores, every pool's workers stop spinning between regions and go to sleep, and waking them
    costs each parallel region time. Loading runs parallel regions (packing weights for oneDNN does), so it must
    not leave a pool behind in the caller's thread (an executor's, which lives on), or the engine thread decodes
    slower (benchmarks/README.md, "Figures behind the code")."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-generation-load") as loader:
        return loader.submit(function).result()


def _model_rules(generation: Any, encoder_decoder: bool) -> ModelRules:
    """The constraints of the model's generation config that `generate` applies whatever the call asks."""
    forced_last = generation.forced_eos_token_id
    return ModelRules(
        bad_words=[list(word) for word in generation.bad_words_ids or []],
        forced_first=generation.forced_bos_token_id if encoder_decoder else None,
        forced_last=None if forced_last is None else [forced_last] if isinstance(forced_last, int) else forced_last,
        no_repeat_ngram_size=generation.no_repeat_ngram_size or 0,
    )


def _max_positions(config: Any) -> int | None:
    """Decoder positions the model has (absolute position embeddings), None when unbounded (relative)."""
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _max_input_length(model_dir: Path, config: Any) -> int:
    """Longest input: the model's position table, else the tokenizer's `model_max_length`, else 512."""
    positions = _max_positions(config)
    if positions is not None:
        return positions
    tokenizer_config = model_dir / "tokenizer_config.json"
    if tokenizer_config.is_file():
        value = json.loads(tokenizer_config.read_text()).get("model_max_length")
        if isinstance(value, int) and 0 < value < 1_000_000:
            return value
    return DEFAULT_MAX_INPUT_LENGTH
