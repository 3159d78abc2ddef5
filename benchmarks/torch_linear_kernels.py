"""The torch engine's forward passes with torch's default linear kernels (MKL's sgemm) against oneDNN's on plain
weights and on weights packed ahead (`onednn_linear`, the default on CPU float32, packs them), on the random-weight
t5-small and GPT-2 small shapes that benchmarks.inflight_vs_request builds, called the way the engine calls
them (`torch/model_runner.ModelRunner`), and how often greedy decoding with each agrees with transformers' `generate`
(which uses torch's kernels).

    python -m benchmarks.torch_linear_kernels                  # both shapes, 1 and 2 threads
    python -m benchmarks.torch_linear_kernels --quick          # tiny models: checks the script

Rows: a decoding step of 1, 4 and 16 rows (after 60 steps, so the cache holds 60 steps past the prompts), and
the new rows of one prompt or source of 36 tokens (the prefill with its first logits, or the encoder call with
the cross-attention keys/values). The three kernel choices are three copies of the model in one process (one per
thread count), timed in turn call by call, so that the machine's noise falls on all three alike: the median of
`--repeats` calls each, after warm-up calls (oneDNN builds a kernel per new shape on first use).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.generation_models import build_model
from benchmarks.common.results import add_json_option, write_json

PROMPT_TOKENS = 36
STEPS_BEFORE = 60
STEP_ROWS = (1, 4, 16)
#: The kernel choices, by the name the table gives them.
KERNELS = {"mkl": "torch default (MKL)", "onednn": "oneDNN, plain weights", "packed": "oneDNN, packed weights"}


def measure(model_dir: Path, threads: int, repeats: int, agreement: int) -> dict[str, dict[str, float]]:
    """This process: each kernel choice's timings, taken in turn, and its greedy agreement with `generate`."""
    import torch
    import transformers

    from transerve.backends.generation.torch.model_runner import ModelRunner
    from transerve.backends.generation.torch.onednn_linear import use_onednn_linears

    torch.set_num_threads(threads)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    loader = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    reference = loader.from_pretrained(model_dir).eval()
    runners = {}
    for kernel in KERNELS:
        model = loader.from_pretrained(model_dir).eval()
        if kernel != "mkl":
            use_onednn_linears(model, pack=kernel == "packed")
        runners[kernel] = ModelRunner(model, model.generation_config.decoder_start_token_id, config.pad_token_id or 0)
    rng = random.Random(0)
    result: dict[str, dict[str, float]] = {kernel: {} for kernel in KERNELS}

    def in_turn(name: str, calls: dict[str, object]) -> None:
        times: dict[str, list[float]] = {kernel: [] for kernel in calls}
        for round_ in range(3 + repeats):
            for kernel, call in calls.items():
                started = time.perf_counter()
                call()
                if round_ >= 3:
                    times[kernel].append(time.perf_counter() - started)
        for kernel, measured in times.items():
            result[kernel][name] = statistics.median(measured) * 1000

    with torch.inference_mode():
        for rows in STEP_ROWS:
            inputs = [[rng.randrange(3, 259) for _ in range(rng.randint(8, 64))] for _ in range(rows)]
            steps = {}
            for kernel, runner in runners.items():
                batch, first = runner.new_rows(inputs, [1] * rows)
                state = {"tokens": first if config.is_encoder_decoder else first.argmax(-1)}

                def step(runner=runner, batch=batch, state=state) -> None:
                    state["tokens"] = runner.step(batch, state["tokens"]).argmax(-1)

                for _ in range(STEPS_BEFORE):
                    step()
                steps[kernel] = step
            in_turn(f"step {rows} rows", steps)
        prompt = [rng.randrange(3, 259) for _ in range(PROMPT_TOKENS)]
        in_turn("new rows", {kernel: lambda r=runner: r.new_rows([prompt], [1]) for kernel, runner in runners.items()})
        prompts = [torch.tensor([[rng.randrange(3, 259) for _ in range(rng.randint(8, 64))]]) for _ in range(agreement)]
        kwargs = {"max_new_tokens": 64, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
        expected = [reference.generate(ids, **kwargs) for ids in prompts]
        for kernel, runner in runners.items():
            outputs = [runner.model.generate(ids, **kwargs) for ids in prompts]
            result[kernel]["greedy equal to generate"] = sum(map(torch.equal, outputs, expected))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default="t5,gpt2")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--agreement", type=int, default=8, help="greedy outputs of 64 tokens compared with generate")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "transerve-inflight-bench")
    parser.add_argument("--quick", action="store_true", help="tiny models, few repeats")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args()
    if args.worker:
        model_dir, threads = args.worker.split(",")
        print(json.dumps(measure(Path(model_dir), int(threads), args.repeats, args.agreement)))
        return
    if args.quick:
        args.repeats, args.agreement = 3, 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"median ms of {args.repeats} calls each, the three kernels in turn; greedy: of {args.agreement} outputs "
          "of 64 tokens")
    steps = " | ".join(f"step {rows} row{'s' if rows > 1 else ''}" for rows in STEP_ROWS)
    print(f"| model | threads | kernels | {steps} | new rows, {PROMPT_TOKENS} tokens | greedy equal to generate |")
    print("|---|---:|---|" + "---:|" * (len(STEP_ROWS) + 2))
    results: list[dict] = []
    for arch in args.archs.split(","):
        model = build_model(args.workdir, arch, args.quick)
        for threads in args.threads.split(","):
            command = [sys.executable, "-m", "benchmarks.torch_linear_kernels", "--worker", f"{model},{threads}",
                       "--repeats", str(args.repeats), "--agreement", str(args.agreement)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            results.append({"model": model.name, "threads": int(threads), "kernels": got})
            for kernel, label in KERNELS.items():
                times = " | ".join(f"{got[kernel][f'step {rows} rows']:.1f}" for rows in STEP_ROWS)
                print(f"| {model.name} | {threads} | {label} | {times} | {got[kernel]['new rows']:.1f} | "
                      f"{got[kernel]['greedy equal to generate']:.0f} / {args.agreement} |", flush=True)
    write_json(args.json, "torch_linear_kernels", results, args)


if __name__ == "__main__":
    main()
