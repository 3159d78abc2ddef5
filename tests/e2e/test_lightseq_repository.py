"""LightSeq's Triton example repository served by a real `transerve serve`, called with tritonclient.

The model files are written by tests/support/lightseq_files.py from random-weight BART, GPT-2 and BERT models, as
LightSeq's export scripts write them (HDF5 as the examples name them, and protobuf), and the configs are LightSeq's
examples unchanged, except `KIND_GPU` -> `KIND_CPU` on a host without a GPU (Triton refuses KIND_GPU there too).
Tokens are compared with transformers' `generate` on the original models. docs/tutorials/lightseq.md shows this.
"""

from __future__ import annotations

import numpy as np
import pytest
from support import start_transerve
from support.lightseq_files import (
    bert_arrays,
    bert_conf,
    example_folder,
    example_repository,
    gpt_arrays,
    gpt_conf,
    tiny_bart,
    tiny_bert,
    tiny_gpt2,
    transformer_arrays,
    transformer_conf,
    write,
)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("h5py")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from transerve.config.devices import visible_gpus  # noqa: E402

EXTRA_DECODE_LENGTH = 10
CPU = not visible_gpus()


@pytest.fixture(scope="module")
def models():
    return {"bart": tiny_bart(), "gpt2": tiny_gpt2(), "bert": tiny_bert()}


@pytest.fixture(scope="module")
def server(tmp_path_factory, models):
    repository = tmp_path_factory.mktemp("lightseq")
    bart, gpt = models["bart"], models["gpt2"]
    example_repository(repository, models, cpu=CPU, extra_decode_length=EXTRA_DECODE_LENGTH)
    # the Transformer as protobuf
    folder = example_folder(repository, "transformer_example", "transformer_pb", "lightseq_bart_base.pb", cpu=CPU)
    write(folder / "lightseq_bart_base.pb", "Transformer", transformer_arrays(bart),
          transformer_conf(bart, extra_decode_length=EXTRA_DECODE_LENGTH))
    # Bert with its output declared as what it is
    folder = example_folder(repository, "bert_example", "bert_fp32", cpu=CPU)
    config = folder / "config.pbtxt"
    config.write_text(config.read_text().replace("TYPE_INT32\n    dims: [ -1 ]\n  }\n]\ninstance",
                                                 "TYPE_FP32\n    dims: [ -1, -1 ]\n  }\n]\ninstance"))
    assert "TYPE_FP32" in config.read_text()
    write(folder / "lightseq_bert_base_uncased.hdf5", "Bert", bert_arrays(models["bert"]), bert_conf(models["bert"]))
    # what a broken repository answers
    broken = example_folder(repository, "gpt_example", "gpt_broken", cpu=CPU)
    (broken / "lightseq_gpt2_base.hdf5").write_bytes(b"not an hdf5 file")
    unsupported = example_folder(repository, "gpt_example", "gpt_ppl", cpu=CPU)
    write(unsupported / "lightseq_gpt2_base.hdf5", "Gpt", gpt_arrays(gpt), gpt_conf(gpt, sampling_method="ppl"))
    example_folder(repository, "transformer_example", "transformer_escape", "../transformer_example/x.hdf5", cpu=CPU)
    moe = example_folder(repository, "gpt_example", "gpt_moe", cpu=CPU)
    (moe / "config.pbtxt").write_text((moe / "config.pbtxt").read_text().replace('"Gpt"', '"Moe"'))
    with start_transerve(repository, "--strict-readiness=false") as process:
        yield process


def _bart_reference(bart, row: list[int], padded_length: int) -> tuple[list[int], float]:
    ids = torch.tensor([row])
    # LightSeq's limit: from the batch's padded length
    max_new = min(bart.config.max_position_embeddings, padded_length + EXTRA_DECODE_LENGTH) - 1
    out = bart.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4, max_new_tokens=max_new,
                        length_penalty=1.0, do_sample=False, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, 1:].tolist()  # without the decoder start token
    while tokens and tokens[-1] == bart.config.pad_token_id:
        tokens.pop()
    return tokens, float(out.sequences_scores[0])


@pytest.mark.parametrize("model", ["transformer_example", "transformer_pb"])
def test_transformer_beam_search_matches_transformers(server, models, model):
    """LightSeq's client example: `source_ids` [batch, length] padded with src_padding_id -> `target_ids`
    [batch, 1, steps] padded with the end token, `target_scores` [batch, 1]."""
    bart = models["bart"]
    rows = [[5, 9, 13, 17, 21, 25, 2], [30, 31, 32, 2], [7, 8, 2]]
    source = np.full((3, 7), bart.config.pad_token_id, np.int32)
    for index, row in enumerate(rows):
        source[index, :len(row)] = row
    client = httpclient.InferenceServerClient(server.http_url)
    inputs = [httpclient.InferInput("source_ids", list(source.shape), "INT32")]
    inputs[0].set_data_from_numpy(source)
    outputs = [httpclient.InferRequestedOutput("target_ids"), httpclient.InferRequestedOutput("target_scores")]
    result = client.infer(model, inputs, outputs=outputs)
    ids, scores = result.as_numpy("target_ids"), result.as_numpy("target_scores")
    assert ids.dtype == np.int32 and ids.ndim == 3 and ids.shape[:2] == (3, 1)
    assert scores.dtype == np.float32 and scores.shape == (3, 1)
    ended = []
    for index, row in enumerate(rows):
        expected, score = _bart_reference(bart, row, source.shape[1])
        got = ids[index, 0].tolist()
        assert got[:len(expected)] == expected
        assert all(token == bart.config.eos_token_id for token in got[len(expected):])
        ended.append(expected[-1] == bart.config.eos_token_id)
        assert scores[index, 0] == pytest.approx(score, abs=1e-4)
    assert True in ended and False in ended  # hypotheses that ended and one cut by the length limit


def test_gpt_greedy_matches_transformers_over_grpc(server, models):
    gpt = models["gpt2"]
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    pad = gpt_conf(gpt)["src_padding_id"]
    tokens = np.full((2, 5), pad, np.int32)
    for index, prompt in enumerate(prompts):
        tokens[index, :len(prompt)] = prompt
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = [grpcclient.InferInput("token_ids", list(tokens.shape), "INT32")]
    inputs[0].set_data_from_numpy(tokens)
    result = client.infer("gpt_example", inputs).as_numpy("result")
    assert result.dtype == np.int32 and result.shape[0] == 2
    for index, prompt in enumerate(prompts):
        # extra_decode_length 0: LightSeq decodes up to max_step tokens in all
        expected = gpt.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=gpt.config.n_positions - len(prompt), do_sample=False)[0].tolist()
        got = result[index].tolist()
        assert got[:len(expected)] == expected
        assert all(token == gpt.config.eos_token_id for token in got[len(expected):])


def test_bert_hidden_states_match_transformers(server, models):
    """LightSeq's example declares `encoder_output` TYPE_INT32 and sends the float32 bytes under it: so does
    transerve, and the client views them as float32, [batch, length, hidden]."""
    bert = models["bert"]
    tokens = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]], np.int32)  # src_padding_id 0
    client = httpclient.InferenceServerClient(server.http_url)
    inputs = [httpclient.InferInput("token_ids", list(tokens.shape), "INT32")]
    inputs[0].set_data_from_numpy(tokens)
    output = client.infer("bert_example", inputs).as_numpy("encoder_output")
    assert output.dtype == np.int32 and output.shape == (2, 6, bert.config.hidden_size)
    hidden = output.view(np.float32)
    ids = torch.from_numpy(tokens.astype(np.int64))
    with torch.no_grad():
        expected = bert(input_ids=ids, attention_mask=(ids != 0).long()).last_hidden_state.numpy()
    np.testing.assert_allclose(hidden[0], expected[0], atol=1e-4)
    np.testing.assert_allclose(hidden[1, :3], expected[1, :3], atol=1e-4)  # the padded positions are not defined
    values = client.infer("bert_fp32", inputs).as_numpy("encoder_output")
    assert values.dtype == np.float32
    np.testing.assert_array_equal(values, hidden)


def test_unservable_files_are_unavailable_with_the_reason(server):
    client = httpclient.InferenceServerClient(server.http_url)
    index = {entry["name"]: entry for entry in client.get_model_repository_index()}
    assert index["gpt_broken"]["state"] == "UNAVAILABLE"
    assert "not an HDF5 file" in index["gpt_broken"]["reason"]
    assert index["gpt_ppl"]["state"] == "UNAVAILABLE"
    assert "ppl" in index["gpt_ppl"]["reason"]
    assert index["gpt_moe"]["state"] == "UNAVAILABLE"
    assert "model_type is 'Moe'" in index["gpt_moe"]["reason"]
    assert index["transformer_escape"]["state"] == "UNAVAILABLE"
    assert "outside" in index["transformer_escape"]["reason"]


def test_a_bad_input_is_a_client_error(server):
    client = httpclient.InferenceServerClient(server.http_url)
    padding = np.full((1, 4), 1, np.int32)  # only src_padding_id
    inputs = [httpclient.InferInput("source_ids", [1, 4], "INT32")]
    inputs[0].set_data_from_numpy(padding)
    with pytest.raises(InferenceServerException, match="only padding") as raised:
        client.infer("transformer_example", inputs)
    assert raised.value.status() == "400"
    for tokens, reason in (([[5, 64, 2]], "outside the vocabulary"), ([[5] * 41], "max_step is 40")):
        inputs = [httpclient.InferInput("source_ids", [1, len(tokens[0])], "INT32")]
        inputs[0].set_data_from_numpy(np.array(tokens, np.int32))
        with pytest.raises(InferenceServerException, match=reason) as raised:
            client.infer("transformer_example", inputs)
        assert raised.value.status() == "400"

