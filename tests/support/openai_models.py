"""The model repository the OpenAI API's tests serve, and the libraries' own answers to compare with.

One random-weight GPT-2 folder with a chat template (tests/support/generation_models.py, plus a ChatML-like Jinja
template that starts with `bos_token`), converted three times: torch and CTranslate2 decoupled generators (they
stream) and a torch one that is not decoupled; and the real all-MiniLM-L6-v2 exported as an embedding ensemble.
`transformers`' greedy `generate` on the same folder and `sentence-transformers` on MiniLM are the references.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

#: ChatML-like, as instruction-tuned models ship them: `bos_token` first, one block per message, and the
#: assistant's header when the caller asks for a generation prompt. The markers are plain text to this tokenizer;
#: `bos_token` is its special token, which must come out as its one id, as apply_chat_template tokenizes it.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: The GPT-2's context: long enough for a stream that is cancelled long before it ends, and for a prompt past it.
N_POSITIONS = 2048
#: Converted models: name -> (engine, decoupled).
GENERATORS = {"gpt": ("torch", True), "gpt_ct2": ("ctranslate2", True), "gpt_plain": ("torch", False)}
EMBEDDING = "minilm"
MODEL_IDS = sorted([*GENERATORS, EMBEDDING])


def build_chat_gpt2(path: Path) -> Path:
    """The tiny GPT-2 folder, its chat template saved as transformers 5 saves it (`chat_template.jinja`)."""
    from support.generation_models import build_generation_model

    build_generation_model("gpt2", path, config={"n_positions": N_POSITIONS})
    tokenizer_config = path / "tokenizer_config.json"  # the tokenizer's limit is the model's, as GPT-2's own is
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()),
                                            "model_max_length": N_POSITIONS}, indent=1))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return path


def build_repository(root: Path) -> tuple[Path, Path]:
    """Convert and export every model into `root / "repository"`; return it and the GPT-2 folder."""
    from support.hf_models import minilm_path
    from transerve.convert.command import convert
    from transerve.export.command import export

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = build_chat_gpt2(root / "gpt2")
    repository = root / "repository"
    for name, (engine, decoupled) in GENERATORS.items():
        convert(folder, repository, engine=engine, name=name, max_batch_size=8, decoupled=decoupled)
    export(minilm_path(), "embedding", "onnx", repository, EMBEDDING, max_batch_size=8, dynamic_batching=True)
    return repository, folder


@dataclass(frozen=True)
class Generation:
    """transformers' greedy answer: the new ids (up to and with the end token) and their text."""

    prompt_ids: list[int]
    ids: list[int]
    text: str
    #: "stop" when the end token ended it, "length" when max_new_tokens did.
    finish_reason: str


class GPT2Reference:
    """transformers on the GPT-2 folder the served models were converted from."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._answers: dict[tuple[tuple[int, ...], int], Generation] = {}

    @cached_property
    def tokenizer(self):
        import transformers

        return transformers.AutoTokenizer.from_pretrained(self.folder)

    @cached_property
    def model(self):
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(self.folder).eval()

    @property
    def eos(self) -> int:
        return int(self.model.generation_config.eos_token_id)

    def ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt's ids as apply_chat_template tokenizes it: the rendered text, no special tokens added."""
        return list(self.tokenizer(self.chat_prompt(messages), add_special_tokens=False).input_ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._answers:
            import torch

            with torch.no_grad():
                out = self.model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                          dtype=torch.long), do_sample=False, max_new_tokens=max_new_tokens,
                                          pad_token_id=self.eos)
            new = out[0, len(prompt_ids):].tolist()
            stopped = self.eos in new
            if stopped:
                new = new[: new.index(self.eos) + 1]
            self._answers[key] = Generation(list(prompt_ids), new, self.decode(new), "stop" if stopped else "length")
        return self._answers[key]

    def complete(self, prompt: str, max_new_tokens: int) -> Generation:
        return self.greedy(self.ids(prompt), max_new_tokens)

    def chat(self, messages: list[dict[str, str]], max_new_tokens: int) -> Generation:
        return self.greedy(self.chat_ids(messages), max_new_tokens)


@cache
def _sentence_transformer():
    import sentence_transformers

    from support.hf_models import minilm_path

    return sentence_transformers.SentenceTransformer(str(minilm_path()), device="cpu")


def sentence_embeddings(texts: list[str]):
    """sentence-transformers' embeddings of `texts` with the real MiniLM, as float32 numpy rows."""
    return _sentence_transformer().encode(texts, convert_to_numpy=True)


def scrape(server) -> dict[tuple[str, str], float]:
    """The server's vLLM-named metrics: (sample name, labels text) -> value."""
    import requests

    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            sample, value = line.rsplit(" ", 1)
            name, _, labels = sample.partition("{")
            samples[(name, labels.rstrip("}"))] = float(value)
    return samples
