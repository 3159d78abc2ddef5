"""LightSeq's model files: the test-support writer's protobuf and HDF5 files read back into the same arrays and
model_conf, the Hugging Face models built from them computing what the originals compute, and files that cannot be
served refused with the reason."""

from __future__ import annotations

import numpy as np
import pytest
from support.lightseq_files import (
    bert_arrays,
    bert_conf,
    gpt_arrays,
    gpt_conf,
    tiny_bart,
    tiny_bert,
    tiny_gpt2,
    transformer_arrays,
    transformer_conf,
    write,
)

from transerve.backends.lightseq.decoding import decoding
from transerve.backends.lightseq.weights import FormatError, read

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("h5py")
from transerve.backends.lightseq.models import bert_model, gpt_model, transformer_model  # noqa: E402

FORMATS = [".pb", ".hdf5"]


@pytest.fixture(scope="module")
def bart():
    return tiny_bart()


@pytest.fixture(scope="module")
def gpt2():
    return tiny_gpt2()


@pytest.mark.parametrize("suffix", FORMATS)
def test_transformer_round_trip(tmp_path, bart, suffix):
    arrays, conf = transformer_arrays(bart), transformer_conf(bart, beam_size=2, length_penalty=0.6)
    weights = read(write(tmp_path / f"model{suffix}", "Transformer", arrays, conf), "Transformer")
    assert weights.layers == {"encoder_stack": 2, "decoder_stack": 2}
    assert set(weights.arrays) == set(arrays)
    for name, value in arrays.items():
        np.testing.assert_array_equal(weights.arrays[name], value.ravel())
    for key, value in conf.items():
        assert weights.conf[key] == pytest.approx(value)
    model = transformer_model(weights)
    ids = torch.tensor([[5, 6, 7, 8, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, decoder_input_ids=ids).logits, bart(ids, decoder_input_ids=ids).logits)
    plan = decoding(weights, model.config.max_position_embeddings)
    assert (plan.beam_size, plan.length_penalty, plan.sampling_method) == (2, pytest.approx(0.6), "beam_search")
    options = plan.options(5, 7)
    assert (options.beam_width, options.max_new_tokens, options.end_ids) == (2, 7 + 10 - 1, [2])
    weights.conf |= {"sampling_method": "topp", "topp": 0.5}
    options = decoding(weights, 40).options(5, 7)
    assert options.sampling and options.beam_width == 1 and options.top_p == 0.5 and options.max_new_tokens == 39


@pytest.mark.parametrize("suffix", FORMATS)
def test_gpt_round_trip(tmp_path, gpt2, suffix):
    weights = read(write(tmp_path / f"model{suffix}", "Gpt", gpt_arrays(gpt2), gpt_conf(gpt2, topk=4)), "Gpt")
    assert weights.conf["sampling_method"] == "topk" and weights.conf["topk"] == 4
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(gpt_model(weights)(ids).logits, gpt2(ids).logits)
    options = decoding(weights, 40).options(4, 4)
    assert options.sampling and options.top_k == 4 and options.max_new_tokens == 36


@pytest.mark.parametrize("suffix", FORMATS)
def test_bert_round_trip(tmp_path, suffix):
    bert = tiny_bert()
    weights = read(write(tmp_path / f"model{suffix}", "Bert", bert_arrays(bert), bert_conf(bert)), "Bert")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(bert_model(weights)(ids).last_hidden_state, bert(ids).last_hidden_state)


def test_unservable_files_are_refused_with_the_reason(tmp_path, bart, gpt2):
    arrays = transformer_arrays(bart)
    with pytest.raises(FormatError, match="pre-LN"):
        transformer_model(read(write(tmp_path / "pre.pb", "Transformer", arrays,
                                     transformer_conf(bart, is_post_ln=False)), "Transformer"))
    del arrays["decoder_stack/1/ffn_first_kernel"]
    with pytest.raises(FormatError, match="decoder_stack/1/ffn_first_kernel"):
        transformer_model(read(write(tmp_path / "missing.hdf5", "Transformer", arrays, transformer_conf(bart)),
                               "Transformer"))
    with pytest.raises(FormatError, match="ppl"):
        decoding(read(write(tmp_path / "ppl.pb", "Gpt", gpt_arrays(gpt2), gpt_conf(gpt2, sampling_method="ppl")),
                      "Gpt"), 40)
    (tmp_path / "junk.pb").write_bytes(b"\xff\xff\xff")
    with pytest.raises(FormatError, match="protobuf"):
        read(tmp_path / "junk.pb", "Gpt")
    (tmp_path / "junk.hdf5").write_bytes(b"junk")
    with pytest.raises(FormatError, match="HDF5"):
        read(tmp_path / "junk.hdf5", "Gpt")
    with pytest.raises(FormatError, match="model_type"):
        read(tmp_path / "junk.pb", "Moe")
