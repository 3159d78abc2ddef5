"""The evaluation and benchmark clients people point at an OpenAI-compatible server, run against transerve as
their users run them: lm-evaluation-harness's `local-completions`, NVIDIA's aiperf and guidellm, each a subprocess
from the tools virtualenv of tests/support/client_tools.py (built on first use; a failure under CI without it).

The server: the random-weight GPT-2 of tests/support/openai_models.py converted for the torch engine, its folder
the tools' tokenizer (offline). References: transformers' log-softmax and greedy `generate` on the same folder, the
`openai` client's answers, and the server's vLLM-named metrics for what the tools say they counted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import ServerProcess
from support.client_tools import ClientTools, require_tools
from support.openai_models import GPT2Reference, build_chat_gpt2, scrape

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

MODEL = "gpt"
LABEL = f'model_name="{MODEL}"'
#: Each tool's run is a few requests; this bounds one run, start-up (imports, tokenizer) included.
RUN_TIMEOUT_S = 300
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tools() -> ClientTools:
    return require_tools()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    from transerve.convert.command import convert

    root = tmp_path_factory.mktemp("eval_clients")
    folder = build_chat_gpt2(root / "gpt2")
    repository = root / "repository"
    convert(folder, repository, engine="torch", name=MODEL, max_batch_size=8, decoupled=True)
    return repository, folder


def grown(before: dict, after: dict, name: str, labels: str = LABEL) -> float:
    return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)


def finished(samples: dict) -> float:
    """Choices that ended, whatever their reason."""
    return sum(value for (name, labels), value in samples.items()
               if name == "vllm:request_success_total" and labels.endswith(LABEL))


def checked(run, what: str):
    assert run.returncode == 0, f"{what} exited {run.returncode}:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    return run


# ---- lm-evaluation-harness -------------------------------------------------------------------------------------

def lm_eval(tools: ClientTools, server: ServerProcess, folder: Path, tmp_path: Path, task: dict,
            docs: list[dict], model_args: str = "", batch_size: int = 1) -> tuple[list[dict], dict]:
    """Run `task` (its dataset `docs`, a local jsonl) with local-completions (`model_args` beside the defaults,
    `batch_size` prompts a request); return its logged samples, by doc, and its results for the task. The
    tokenizer is the model's folder: lm-eval sends token ids (unless `tokenized_requests=False`), and counts the
    context's tokens with it to cut the echoed prompt's log-probabilities."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tasks / f"{task['task']}.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs), encoding="utf-8")
    config = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test",
              **task}
    (tasks / f"{task['task']}.yaml").write_text(json.dumps(config, indent=1), encoding="utf-8")  # JSON is YAML
    output = tmp_path / "output"
    model_args = ",".join(filter(None, [f"model={MODEL},base_url={server.base_url}/v1/completions,"
                                        f"tokenizer={folder},tokenizer_backend=huggingface,num_concurrent=1,"
                                        "max_retries=1,timeout=60", model_args]))
    checked(tools.run(["lm_eval", "--model", "local-completions", "--model_args", model_args, "--tasks",
                       task["task"], "--include_path", str(tasks), "--batch_size", str(batch_size), "--log_samples",
                       "--output_path", str(output)], cwd=tmp_path, timeout=RUN_TIMEOUT_S), "lm_eval")
    [samples_file] = output.rglob(f"samples_{task['task']}_*.jsonl")
    [results_file] = output.rglob("results_*.json")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    return samples, json.loads(results_file.read_text())["results"][task["task"]]


def continuation_ids(reference: GPT2Reference, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: the whole text's ids, past the context's own."""
    whole = reference.ids(context + continuation)
    context_ids = reference.ids(context)
    assert whole[:len(context_ids)] == context_ids
    return context_ids, whole[len(context_ids):]


def scored(reference: GPT2Reference, context: str, continuation: str) -> tuple[float, bool]:
    """transformers' sum of log p(continuation token | everything before it), and whether each was the argmax."""
    context_ids, ids = continuation_ids(reference, context, continuation)
    with torch.no_grad():
        logits = reference.model(torch.tensor([context_ids + ids])).logits[0].double()
    rows = torch.log_softmax(logits, dim=-1)[len(context_ids) - 1:-1]
    picked = rows[torch.arange(len(ids)), torch.tensor(ids)]
    return float(picked.sum()), bool((rows.argmax(dim=-1) == torch.tensor(ids)).all())


#: lm-eval's defaults (one prompt of token ids a request), several prompts a request, and text prompts.
REQUEST_FORMS = {"ids": ("", 1), "batched": ("", 3), "text": ("tokenized_requests=False", 2)}


@pytest.mark.parametrize("form", list(REQUEST_FORMS))
def test_lm_eval_multiple_choice_loglikelihoods_equal_transformers(tools, server, built, reference, tmp_path, form):
    """A loglikelihood task: lm-eval sends each context + choice (as ids, or as text the server tokenizes) with
    `echo: true, logprobs: 1, max_tokens: 1` and sums the echoed log-probabilities past the context. Each choice's
    sum, its greediness, and the accuracy equal those of transformers' log-softmax. One choice of each question is
    the model's own greedy continuation (so greediness is seen true), and the gold answers are set so one question
    is right and one is wrong by the references."""
    contexts = ["The quick brown fox jumps over the", "Hello world, how are"]
    questions = []
    for context in contexts:
        context_ids = reference.ids(context)
        greedy = reference.greedy(context_ids, 3)
        assert reference.ids(context + greedy.text) == context_ids + greedy.ids  # it tokenizes back to itself
        questions.append([greedy.text, " lazy dog.", " you today?", "!"])
    expected = [[scored(reference, context, choice) for choice in choices]
                for context, choices in zip(contexts, questions, strict=True)]
    best = [max(range(len(rows)), key=lambda index, rows=rows: rows[index][0]) for rows in expected]
    gold = [best[0], (best[1] + 1) % len(questions[1])]
    docs = [{"question": context, "choices": choices, "answer": answer}
            for context, choices, answer in zip(contexts, questions, gold, strict=True)]
    task = {"task": "transerve_choice", "output_type": "multiple_choice", "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}", "target_delimiter": "",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    before = scrape(server)
    samples, results = lm_eval(tools, server, built[1], tmp_path, task, docs, *REQUEST_FORMS[form])
    after = scrape(server)
    assert [sample["doc_id"] for sample in samples] == [0, 1]
    for sample, context, choices, rows in zip(samples, contexts, questions, expected, strict=True):
        arguments = [sample["arguments"][f"gen_args_{index}"] for index in range(len(choices))]
        assert [(argument["arg_0"], argument["arg_1"]) for argument in arguments] == \
            [(context, choice) for choice in choices]
        answers = [(float(value), str(greedy) == "True") for value, greedy in sample["filtered_resps"]]
        for (value, greedy), (want, want_greedy), choice in zip(answers, rows, choices, strict=True):
            assert value == pytest.approx(want, abs=TOLERANCE), (context, choice)
            assert greedy == want_greedy, (context, choice)
        assert answers[0][1]  # the model's own continuation
    accuracy = [float(best[index] == gold[index]) for index in range(2)]
    assert accuracy == [1.0, 0.0]
    assert [sample["acc"] for sample in samples] == accuracy
    assert results["acc,none"] == pytest.approx(0.5)
    # One choice per context + choice, each echoing its prompt and generating the one token it asks for; the
    # batched forms send `batch_size` prompts a request.
    choices = sum(map(len, questions))
    assert finished(after) - finished(before) == choices
    assert grown(before, after, "vllm:e2e_request_latency_seconds_count") == -(-choices // REQUEST_FORMS[form][1])
    prompts = sum(len(reference.ids(context + choice)) for context, choices in zip(contexts, questions, strict=True)
                  for choice in choices)
    assert grown(before, after, "vllm:prompt_tokens_total") == prompts


def test_lm_eval_generate_until_equals_the_openai_client(tools, server, built, reference, client, tmp_path):
    """A generate_until task with `until` stop strings: lm-eval's generations equal the server's greedy answers
    to the same prompts through the `openai` client (and transformers' greedy text cut at the stop), and its
    exact_match is the share of targets equal to them."""
    prompts = ["The quick brown fox", "Hello world, how are you today?"]
    budget = 12
    plain = [reference.complete(prompt, budget).text for prompt in prompts]
    stop = plain[0][4:6]  # a string the first answer holds, so that it ends there
    assert stop and stop in plain[0] and "\n" not in stop
    until = [stop, "\n\n"]
    eos = reference.tokenizer.eos_token
    answers = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=budget, temperature=0,
                                         stop=[*until, eos], seed=1234).choices[0].text for prompt in prompts]
    expected = [text.split(stop)[0].split("\n\n")[0] for text in plain]
    assert answers == expected
    assert len(answers[0]) < len(plain[0])  # the stop string cut it
    docs = [{"prompt": prompts[0], "target": answers[0]}, {"prompt": prompts[1], "target": answers[1] + "x"}]
    task = {"task": "transerve_until", "output_type": "generate_until", "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{target}}",
            "generation_kwargs": {"until": until, "max_gen_toks": budget, "do_sample": False, "temperature": 0},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}
    samples, results = lm_eval(tools, server, built[1], tmp_path, task, docs)
    assert [sample["filtered_resps"][0] for sample in samples] == answers
    assert [sample["exact_match"] for sample in samples] == [1.0, 0.0]
    assert results["exact_match,none"] == pytest.approx(0.5)


# ---- aiperf ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_aiperf_server_token_counts_equal_the_servers_metrics(tools, server, built, tmp_path, endpoint):
    """aiperf with `--use-server-token-count` (it takes the tokens from the answers' `usage`): its request count
    and its total prompt and completion tokens are what the server's vLLM metrics grew by over the run. Chat
    streams, so aiperf asks for `stream_options.include_usage` and (`--per-chunk-usage`)
    `continuous_usage_stats`."""
    requests_sent = 4
    streaming = ["--streaming", "--per-chunk-usage"] if endpoint == "chat" else []
    artifacts = tmp_path / "aiperf"
    before = scrape(server)
    # aiperf 0.13.0 with HF_HUB_OFFLINE set takes even a local tokenizer folder for a hub repository id (and fails
    # to find it in the hub cache), so it runs online here; the folder is read locally all the same.
    checked(tools.run(["aiperf", "profile", "--model", MODEL, "--url", server.base_url, "--endpoint-type", endpoint,
                       *streaming, "--tokenizer", str(built[1]), "--use-server-token-count",
                       "--request-count", str(requests_sent), "--concurrency", "2",
                       "--prompt-input-tokens-mean", "12", "--prompt-input-tokens-stddev", "0",
                       "--prompt-output-tokens-mean", "6", "--prompt-output-tokens-stddev", "0",
                       "--random-seed", "1", "--request-timeout-seconds", "60", "--output-artifact-dir",
                       str(artifacts), "--no-server-metrics", "--no-gpu-telemetry", "--no-auto-plot",
                       "--ui-type", "none"],
                      cwd=tmp_path, timeout=RUN_TIMEOUT_S, offline=False), "aiperf")
    after = scrape(server)
    metrics = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert metrics["request_count"]["avg"] == requests_sent
    assert metrics["request_error_rate"]["avg"] == 0
    prompt = grown(before, after, "vllm:prompt_tokens_total")
    completion = grown(before, after, "vllm:generation_tokens_total")
    assert finished(after) - finished(before) == requests_sent
    assert grown(before, after, "vllm:e2e_request_latency_seconds_count") == requests_sent
    assert metrics["total_usage_prompt_tokens"]["avg"] == metrics["total_isl"]["avg"] == prompt > 0
    assert metrics["total_usage_completion_tokens"]["avg"] == metrics["total_osl"]["avg"] == completion > 0


# ---- guidellm --------------------------------------------------------------------------------------------------

#: guidellm's OpenAI HTTP backend as it starts by default, in the tools' interpreter: prints the models it found.
GUIDELLM_VALIDATION = """
import asyncio, json, sys
from guidellm.backends.openai.http import OpenAIHTTPBackend
from guidellm.schemas.backends import OpenAIHTTPBackendArgs

async def validated():
    backend = OpenAIHTTPBackend(OpenAIHTTPBackendArgs(target=sys.argv[1]))
    await backend.process_startup()
    try:
        await backend.validate()
        return await backend.available_models()
    finally:
        await backend.process_shutdown()

print(json.dumps(asyncio.run(validated())))
"""


def test_guidellm_default_backend_validation_and_a_benchmark_run(tools, server, built, tmp_path):
    """guidellm's OpenAI HTTP backend as it starts by default (`GET /health`, then the models), then a short
    synchronous benchmark of synthetic prompts (guidellm's own request fields, chat by default) whose requests are
    all served, its token counts what the server's metrics grew by."""
    validation = checked(tools.run(["python", "-c", GUIDELLM_VALIDATION, server.base_url], cwd=tmp_path,
                                   timeout=RUN_TIMEOUT_S), "guidellm's validation")
    assert json.loads(validation.stdout.strip().splitlines()[-1]) == [MODEL]
    output = tmp_path / "guidellm.json"
    before = scrape(server)
    checked(tools.run(["guidellm", "run", "--backend", f"kind=openai_http,target={server.base_url},model={MODEL}",
                       "--tokenizer", f"kind=hf_auto,model={built[1]}",
                       "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
                       "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=4",
                       "--output", f"kind=json,path={output}", "--disable-console-interactive"],
                      cwd=tmp_path, timeout=RUN_TIMEOUT_S), "guidellm")
    after = scrape(server)
    metrics = json.loads(output.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]
    assert totals["successful"] == 4 and totals["errored"] == 0, totals
    assert finished(after) - finished(before) == 4
    assert grown(before, after, "vllm:generation_tokens_total") == 4 * 8
    assert metrics["output_token_count"]["successful"]["total_sum"] == 4 * 8
    assert metrics["prompt_token_count"]["successful"]["total_sum"] == grown(before, after,
                                                                            "vllm:prompt_tokens_total")
