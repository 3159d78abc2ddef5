"""Triton's response cache end to end, against the real Triton 2.51 with its local cache: the same requests, the
same answers, the same statistics and metrics.

The models (`response_cache_models/`) double their input and report how many times they have executed, so an
answer from the cache shows as an old count. Deliberate divergences from Triton 2.51, tested against transerve
alone: a hit answers only the outputs the request asks for (Triton answers every cached output); a model with
sequence batching and a response cache is refused at load, as a decoupled one is; and the cache-wide metrics
(nv_cache_num_hits, ...) count, where Triton 2.51's stay at 0 with its local cache.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from support import ServerProcess, require_triton, start_transerve, start_triton
from support.repositories import copy_model

MODELS = Path(__file__).resolve().parent / "response_cache_models"
DIFFERENTIAL_MODELS = ("counter_cached", "counter_batched", "counter_uncached")
COUNTER = MODELS / "counter.py"
"""The code of every model here but counter_stream: they differ only in their configs."""
CACHE_BYTES = 1 << 20
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("response_cache") / "models"
    for name in DIFFERENTIAL_MODELS:
        copy_model(MODELS / name, repo / name, COUNTER)
    return repo


@pytest.fixture(scope="module")
def servers(repository: Path) -> Iterator[dict[str, ServerProcess]]:
    install = require_triton()
    caches = install.server_dir / "caches"
    cache = f"--cache-config=local,size={CACHE_BYTES}"
    with start_triton(repository, cache, f"--cache-directory={caches}", install=install) as triton, \
            start_transerve(repository, cache) as transerve:
        yield {"triton": triton, "transerve": transerve}


def infer(server: ServerProcess, model: str, values: list[float], **extra: Any) -> dict[str, Any]:
    shape = [1, len(values)] if model == "counter_batched" else [len(values)]
    body = {"inputs": [{"name": "IN", "shape": shape, "datatype": "FP32", "data": values}], **extra}
    answer = requests.post(f"http://127.0.0.1:{server.http_port}/v2/models/{model}/infer", json=body,
                           timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    return answer.json()


def counts(answer: dict[str, Any]) -> list[int]:
    return [value for output in answer["outputs"] if output["name"] == "COUNT" for value in output["data"]]


@pytest.mark.parametrize("model", DIFFERENTIAL_MODELS)
def test_hits_misses_and_statistics_match_triton(servers: dict[str, ServerProcess], model: str) -> None:
    """Same inputs hit whatever the request's id and parameters; other values or shapes miss."""
    sequence = [
        ([1.0, 2.0], {}), ([1.0, 2.0], {"id": "second"}), ([1.0, 2.0], {"parameters": {"custom": 7}}),
        ([1.0, 3.0], {}), ([1.0, 2.0, 0.0], {}), ([1.0, 3.0], {}),
    ]
    answers: dict[str, list[list[int]]] = {}
    statistics = {}
    for name, server in servers.items():
        answers[name] = [counts(infer(server, model, values, **extra)) for values, extra in sequence]
        deadline = time.monotonic() + 10
        while True:  # Triton counts a request just after answering it: wait until all six are counted
            stats = requests.get(f"http://127.0.0.1:{server.http_port}/v2/models/{model}/stats",
                                 timeout=TIMEOUT_S).json()["model_stats"][0]
            inference = stats["inference_stats"]
            if inference["success"]["count"] >= len(sequence) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        statistics[name] = {"success": inference["success"]["count"], "hits": inference["cache_hit"]["count"],
                            "misses": inference["cache_miss"]["count"], "inferences": stats["inference_count"],
                            "executions": stats["execution_count"]}
    assert answers["transerve"] == answers["triton"]
    assert statistics["transerve"] == statistics["triton"]
    if model == "counter_uncached":
        assert answers["transerve"] == [[1], [2], [3], [4], [5], [6]]
    else:
        assert answers["transerve"] == [[1], [1], [1], [2], [3], [2]]
        assert statistics["transerve"] == {"success": 6, "hits": 3, "misses": 3, "inferences": 3, "executions": 3}


def scrape(server: ServerProcess) -> dict[str, float]:
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=TIMEOUT_S).text
    samples = {}
    for line in text.splitlines():
        if line.startswith("nv_cache") and 'model="counter_cached"' in line or line.startswith("nv_cache_num"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_metrics_match_triton(servers: dict[str, ServerProcess]) -> None:
    before = {name: scrape(server) for name, server in servers.items()}
    for server in servers.values():
        for values in ([5.0], [5.0], [6.0]):
            infer(server, "counter_cached", values)
    hits = 'nv_cache_num_hits_per_model{model="counter_cached",version="1"}'
    misses = 'nv_cache_num_misses_per_model{model="counter_cached",version="1"}'
    after = {}
    for name, server in servers.items():  # Triton may count a request just after answering it
        deadline = time.monotonic() + 10
        while True:
            after[name] = scrape(server)
            counted = sum(after[name].get(key, 0.0) - before[name].get(key, 0.0) for key in (hits, misses))
            if counted >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    changes = {name: {key: after[name][key] - before[name].get(key, 0.0) for key in after[name]
                      if "duration" not in key and "entries" not in key} for name in servers}
    per_model = {name: {key: value for key, value in change.items() if "model=" in key}
                 for name, change in changes.items()}
    assert per_model["transerve"] == per_model["triton"]
    assert per_model["transerve"][hits] == 1
    assert per_model["transerve"][misses] == 2
    # Triton 2.51 leaves its cache-wide counters at 0 with the local cache; transerve's count.
    assert {key: changes["transerve"][key] for key in ("nv_cache_num_hits", "nv_cache_num_misses",
                                                        "nv_cache_num_lookups")} == {
        "nv_cache_num_hits": 1, "nv_cache_num_misses": 2, "nv_cache_num_lookups": 3}


# ---- transerve alone -------------------------------------------------------------------------------------


def test_a_hit_answers_only_the_requested_outputs(servers: dict[str, ServerProcess]) -> None:
    server = servers["transerve"]
    first = infer(server, "counter_cached", [9.0, 9.5])
    hit = infer(server, "counter_cached", [9.0, 9.5], outputs=[{"name": "COUNT"}])
    assert [output["name"] for output in hit["outputs"]] == ["COUNT"]
    assert counts(hit) == counts(first)


def test_eviction_and_refusals(tmp_path: Path) -> None:
    """A cache of 40 bytes holds one answer of two floats and a count (16 bytes) at a time, at most two; an
    answer larger than the cache is not kept; decoupled and sequence-batched models cannot cache."""
    repo = tmp_path / "models"
    copy_model(MODELS / "counter_cached", repo / "counter_cached", COUNTER)
    copy_model(MODELS / "counter_stream", repo / "counter_stream")
    sequence = copy_model(MODELS / "counter_cached", repo / "counter_sequence", COUNTER)
    config = (sequence / "config.pbtxt").read_text()
    (sequence / "config.pbtxt").write_text(config.replace("max_batch_size: 0", "max_batch_size: 0\n"
                                                          "sequence_batching { }"))
    with start_transerve(repo, "--cache-config=local,size=40", "--strict-readiness=false") as server:
        index = {entry["name"]: entry for entry in requests.post(
            f"http://127.0.0.1:{server.http_port}/v2/repository/index", timeout=TIMEOUT_S).json()}
        assert index["counter_stream"]["reason"] == (
            "Response Cache does not currently support model counter_stream with 'decoupled' transaction policy. "
            "Please disable the response cache.")
        assert "with sequence batching" in index["counter_sequence"]["reason"]
        seen = [counts(infer(server, "counter_cached", values)) for values in (
            [1.0, 2.0], [3.0, 4.0], [1.0, 2.0], [5.0, 6.0], [3.0, 4.0], [1.0] * 20, [1.0] * 20)]
        # [1,2] and [3,4] fit together; [5,6] evicts the least recently used, [3,4]; 20 floats never fit.
        assert seen == [[1], [2], [1], [3], [4], [5], [6]]
        metrics = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=TIMEOUT_S).text
        assert "nv_cache_num_evictions 2\n" in metrics
        assert "nv_cache_num_entries 2\n" in metrics
