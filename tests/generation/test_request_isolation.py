"""One client's hostile decoding options never reach the batch another client's sequence decodes in.

A real `transerve serve` holds a random-weight GPT-2 in the torch engine and in CTranslate2. For each hostile
option, a bystander streams a long greedy answer while the hostile request is sent to the same engine: the hostile
one is a 400 naming its field, and the bystander's tokens equal those of the same request run alone.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import requests
from support import start_transerve
from support.generation_models import build_generation_model

ctranslate2 = pytest.importorskip("ctranslate2")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from transerve.backends.generation.engine import MAX_WORD_TOKENS, MAX_WORDS  # noqa: E402

#: The bystander's length: long enough that each hostile request arrives while it decodes (the model has 256
#: positions).
BYSTANDER_TOKENS = 200
PROMPT = [5, 17, 33, 41, 8]
INTERFACE = """
input [
  { name: "input_ids" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "sequence_length" data_type: TYPE_UINT32 dims: [ 1 ] },
  { name: "bad_words_list" data_type: TYPE_INT32 dims: [ 2, -1 ] optional: true }
]
output [
  { name: "output_ids" data_type: TYPE_UINT32 dims: [ -1, -1 ] },
  { name: "sequence_length" data_type: TYPE_UINT32 dims: [ -1 ] }
]
"""
#: Hostile parameters (request parameters, or the `bad_words_list` tensor in FasterTransformer's [2, L] layout),
#: and the field each 400 names.
HOSTILE = {
    "bad_word_outside_vocabulary": ({"bad_words": "[[99999999]]"}, "bad_words"),
    "end_id_outside_vocabulary": ({"end_id": 99999999, "min_length": 2}, "end_id"),
    "stop_word_outside_vocabulary": ({"stop_words": "[[3, 99999999]]"}, "stop_words"),
    "too_many_bad_words": ({"bad_words": json.dumps([[7, 9]] * (MAX_WORDS + 1))}, "bad_words"),
    "too_many_bad_word_tokens": ({"bad_words": json.dumps([[7] * 9] * MAX_WORDS)}, "bad_words"),
    "empty_stop_word": ({"stop_words": "[[4], []]"}, "stop_words"),
    "bad_words_tensor_outside_vocabulary": ({"bad_words_list": [[[99999999], [1]]]}, "bad_words"),
    "beam_width_past_the_rows": ({"beam_width": 100000}, "beam_width"),
    "max_tokens_past_the_positions": ({"max_tokens": 10**9}, "max_new_tokens"),
    "repetition_penalty_zero": ({"repetition_penalty": 0.0}, "repetition_penalty"),
    "bad_words_string_past_its_bound": ({"bad_words": json.dumps([[7, 9]] * 500_000)}, "bad_words"),
    "bad_words_list_of_many_ids": ({"bad_words": [[7] * (MAX_WORD_TOKENS + 1)]}, "bad_words"),
}
assert MAX_WORDS * 9 > MAX_WORD_TOKENS


def config(name: str, engine: str) -> str:
    return (
        f'name: "{name}"\nbackend: "generation"\nmax_batch_size: 8\n'
        "model_transaction_policy { decoupled: true }\n"
        f'{INTERFACE}parameters {{ key: "engine" value {{ string_value: "{engine}" }} }}\n'
        'parameters { key: "max_new_tokens" value { string_value: "16" } }\n'
        'parameters { key: "intra_op_threads" value { string_value: "1" } }\n'
        "instance_group [{ kind: KIND_CPU }]\n"
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("isolation_models")
    hf_dir = build_generation_model("gpt2", root / "gpt2")
    ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(root / "gpt2_ct2"), quantization="float32")
    repo = root / "repository"
    for name, source, engine in (("gpt_torch", hf_dir, "torch"), ("gpt_ct2", root / "gpt2_ct2", "ctranslate2")):
        shutil.copytree(source, repo / name / "1" / "model")
        (repo / name / "config.pbtxt").write_text(config(name, engine))
    with start_transerve(repo) as running:
        yield running


def body(parameters: dict) -> dict:
    return {"input_ids": PROMPT, "sequence_length": len(PROMPT), **parameters}


def bystander(server, model: str, started: threading.Event | None = None) -> list[int]:
    """A greedy stream of `BYSTANDER_TOKENS` tokens (no end token before them); its last event's ids."""
    wanted = {"stream": True, "max_tokens": BYSTANDER_TOKENS, "min_length": BYSTANDER_TOKENS}
    last = None
    with requests.post(f"{server.base_url}/v2/models/{model}/generate_stream", json=body(wanted), stream=True,
                       timeout=120) as answer:
        assert answer.status_code == 200, answer.text
        for line in answer.iter_lines():
            if not line.startswith(b"data: "):
                continue
            last = json.loads(line[len(b"data: "):])
            assert "error" not in last, last
            if started is not None:
                started.set()
    assert last is not None
    return last["output_ids"][: last["sequence_length"]]


@pytest.fixture(scope="module")
def alone(server) -> dict[str, list[int]]:
    return {model: bystander(server, model) for model in ("gpt_torch", "gpt_ct2")}


@pytest.mark.parametrize("model", ["gpt_torch", "gpt_ct2"])
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_option_is_a_400_and_the_bystander_decodes_as_alone(server, alone, model, case):
    parameters, field = HOSTILE[case]
    started = threading.Event()
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["ids"] = bystander(server, model, started)
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60), outcome
    begin = time.monotonic()
    answer = requests.post(f"{server.base_url}/v2/models/{model}/generate", json=body(parameters), timeout=60)
    refused_in = time.monotonic() - begin
    thread.join(120)
    assert not thread.is_alive()
    assert answer.status_code == 400, answer.text
    assert field in answer.json()["error"], answer.json()
    assert refused_in < 5.0
    assert "error" not in outcome, outcome
    assert outcome["ids"] == alone[model]
    assert server.alive()


def test_a_generate_body_past_its_bound_is_a_413_and_the_connection_serves_on(server):
    """A /generate body is JSON read on the event loop: past --http-max-generate-size (4 MiB by default) it is
    refused unread, and the same connection then serves a request."""
    with requests.Session() as session:
        big = {"input_ids": [5] * 2_000_000, "sequence_length": 2_000_000, "max_tokens": 1}  # 6 MB
        answer = session.post(f"{server.base_url}/v2/models/gpt_torch/generate", json=big, timeout=60)
        assert answer.status_code == 413, answer.text
        assert "--http-max-generate-size" in answer.json()["error"]
        answer = session.post(f"{server.base_url}/v2/models/gpt_torch/generate", json=body({"max_tokens": 2}),
                              timeout=60)
        assert answer.status_code == 200, answer.text
