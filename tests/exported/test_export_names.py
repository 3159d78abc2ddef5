"""`transerve export` for the seed tutorial's clients: the ensemble's tensors under the names they call
(`--input-name`/`--output-name`), raw logits beside the post-processed outputs, and the refusal of a checkpoint
without the task's head (`--allow-random-head`)."""

from __future__ import annotations

import concurrent.futures
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import ServerProcess, start_transerve
from support.hf_models import minilm_path
from test_export import cli, config_of

from transerve.export.command import export
from transerve.export.convert import TASKS
from transerve.export.hf import ExportError, read_folder
from transerve.export.names import parse, parse_tokenizer_inputs, step_names
from transerve.export.repository import Options, write

TEXTS = ["I love this server", "this is terrible", "a third, somewhat longer text than the two before it"]
CONTEXT = "transerve serves Triton model repositories over HTTP and gRPC, written in Python."


@pytest.fixture(scope="module")
def base_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BERT without any task head, as `bert-base-uncased` is."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("base")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=30522, max_position_embeddings=128)
    transformers.BertModel(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(minilm_path() / name, path / name)
    return path


@pytest.mark.parametrize(("inputs", "outputs", "reason"), [
    (["TEXT"], [], "--input-name 'TEXT': expected OLD=NEW, e.g. input_text=INPUT_TEXT"),
    (["text=TEXT"], [], "--input-name 'text=TEXT': the seqcls ensemble has no input 'text' (its inputs: input_text)"),
    ([], ["answer=ANSWER"], "the seqcls ensemble has no output 'answer' (its outputs: label, score, probabilities, "
                            "logits)"),
    ([], ["logits="], "'' is not a tensor name"),
    ([], ["logits=LOG ITS"], "'LOG ITS' is not a tensor name"),
    ([], ["logits=2x"], "'2x' is not a tensor name"),
    ([], ["logits=A:B"], "'A:B' is not a tensor name"),
    ([], ["logits=A", "logits=B"], "'logits' is renamed twice"),
    ([], ["label=X", "score=X"], "'score=X': the ensemble's tensor 'label' is named 'X' already"),
    (["input_text=label"], [], "'input_text=label': the ensemble's tensor 'label' is named 'label' already"),
    ([], ["logits=input_ids"], "'logits=input_ids': the ensemble's tensor 'input_ids' is named 'input_ids' already"),
])
def test_names_triton_would_refuse_are_refused_in_one_line(inputs, outputs, reason):
    with pytest.raises(ExportError) as caught:
        parse("seqcls", inputs, outputs)
    assert reason in str(caught.value) and "\n" not in str(caught.value)


def test_the_openai_parameters_follow_a_renamed_embedding(tmp_path: Path, model_folders):
    renamed = parse("embedding", ["input_text=TEXT"], ["embedding=EMBEDDING"])
    options = Options("embed", "onnx", 8, False, False, renamed)
    write(tmp_path, read_folder(model_folders["minilm"]), TASKS["embedding"], ["input_ids", "attention_mask"], options)
    ensemble = config_of(tmp_path, "embed")
    assert ([t.name for t in ensemble.input], [t.name for t in ensemble.output]) == (["TEXT"], ["EMBEDDING"])
    assert ensemble.parameters["openai_text_input"].string_value == "TEXT"
    assert ensemble.parameters["openai_embedding_output"].string_value == "EMBEDDING"


def test_the_cli_refuses_a_bad_name_before_loading_anything(tmp_path: Path, model_folders):
    result = cli(str(model_folders["seqcls"]), "--task", "seqcls", "--format", "onnx", "--output",
                 str(tmp_path / "out"), "--output-name", "LOGITS")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "transerve export: --output-name 'LOGITS': expected OLD=NEW, e.g. label=LABEL"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("task", "head"), [("seqcls", "classifier.bias, classifier.weight"),
                                            ("qa", "qa_outputs.bias, qa_outputs.weight")])
def test_a_checkpoint_without_the_tasks_head_is_refused(tmp_path: Path, base_bert: Path, task: str, head: str):
    result = cli(str(base_bert), "--task", task, "--format", "onnx", "--output", str(tmp_path / "out"))
    assert result.returncode == 2
    description = {"seqcls": "sequence classification", "qa": "question answering"}[task]
    assert result.stderr.strip().splitlines()[-1] == (
        f"transerve export: '{base_bert}' has no weights for the {task} head ({head} would be random): export a "
        f"checkpoint fine-tuned for {description}, or pass --allow-random-head")
    assert not (tmp_path / "out" / task).exists()


def test_allow_random_head_exports_it_and_a_base_model_encodes_without_it(tmp_path: Path, base_bert: Path):
    names = export(base_bert, "seqcls", "onnx", tmp_path, "random", allow_random_head=True)
    assert names == ["random_tokenizer", "random_model", "random_postprocess", "random"]
    assert export(base_bert, "encode", "onnx", tmp_path, "base")[-1] == "base"  # the pooler is not needed


@pytest.fixture(scope="module")
def seed_repository(model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three ensembles of the seed tutorial, under the names its clients call."""
    pytest.importorskip("onnxruntime")
    repository = tmp_path_factory.mktemp("seed_names")
    text = ["input_text=TEXT"]
    export(model_folders["seqcls"], "seqcls", "onnx", repository, "seqcls", input_names=text,
           output_names=["logits=LOGITS"], dynamic_batching=True)
    export(model_folders["encode"], "encode", "onnx", repository, "encode", input_names=text,
           output_names=["last_hidden_state=HIDDEN_STATE"])
    export(model_folders["qa"], "qa", "torchscript", repository, "qa", input_names=["context=TEXT"],
           output_names=["start_logits=START_LOGITS", "end_logits=END_LOGITS"], dynamic_batching=True)
    return repository


@pytest.fixture(scope="module")
def seed_server(seed_repository: Path) -> Iterator[ServerProcess]:
    with start_transerve(seed_repository) as server:
        yield server


def texts(module: object, texts: list[str], name: str = "TEXT") -> object:
    tensor = module.InferInput(name, [len(texts), 1], "BYTES")  # type: ignore[attr-defined]
    tensor.set_data_from_numpy(np.array([[text.encode()] for text in texts], dtype=object))
    return tensor


def reference(folder: Path, auto_class: str, text: str, *pair: str) -> object:
    import torch
    import transformers

    model = getattr(transformers, auto_class).from_pretrained(str(folder)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    with torch.no_grad():
        return model(**tokenizer(*pair, text, truncation=True, max_length=128, return_tensors="pt"))


def test_the_ensembles_carry_the_names_the_clients_call(seed_repository: Path):
    ensembles = {name: config_of(seed_repository, name) for name in ("seqcls", "encode", "qa")}
    assert {name: [t.name for t in config.input] for name, config in ensembles.items()} == {
        "seqcls": ["TEXT"], "encode": ["TEXT"], "qa": ["question", "TEXT"]}
    assert {name: [t.name for t in config.output] for name, config in ensembles.items()} == {
        "seqcls": ["label", "score", "probabilities", "LOGITS"],
        "encode": ["HIDDEN_STATE", "attention_mask"],
        "qa": ["answer", "score", "start", "end", "START_LOGITS", "END_LOGITS"]}
    assert [t.optional for t in ensembles["qa"].input] == [True, False]


def test_seqcls_returns_raw_logits_beside_label_and_score(seed_server, model_folders):
    client = httpclient.InferenceServerClient(seed_server.http_url)
    result = client.infer("seqcls", [texts(httpclient, TEXTS)])
    logits = result.as_numpy("LOGITS")
    for row, text in enumerate(TEXTS):
        np.testing.assert_allclose(logits[row], reference(model_folders["seqcls"],
                                                          "AutoModelForSequenceClassification", text).logits[0],
                                   atol=1e-4)
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(result.as_numpy("probabilities"), probabilities, atol=1e-5)
    np.testing.assert_allclose(result.as_numpy("score").reshape(-1), probabilities.max(axis=1), atol=1e-5)
    # Asked for LOGITS alone, over gRPC: the post-processing does not run, and the answer is the same.
    postprocessed = postprocess_count(seed_server)
    only = grpcclient.InferenceServerClient(seed_server.grpc_url).infer(
        "seqcls", [texts(grpcclient, TEXTS)], outputs=[grpcclient.InferRequestedOutput("LOGITS")])
    np.testing.assert_allclose(only.as_numpy("LOGITS"), logits, atol=1e-6)
    assert only.as_numpy("label") is None
    assert postprocess_count(seed_server) == postprocessed


def postprocess_count(server: ServerProcess) -> int:
    stats = httpclient.InferenceServerClient(server.http_url).get_inference_statistics("seqcls_postprocess")
    return int(stats["model_stats"][0]["inference_count"])


def test_encode_returns_hidden_state(seed_server, model_folders):
    client = httpclient.InferenceServerClient(seed_server.http_url)
    result = client.infer("encode", [texts(httpclient, TEXTS[:1])],
                          outputs=[httpclient.InferRequestedOutput("HIDDEN_STATE")])
    expected = reference(model_folders["encode"], "AutoModel", TEXTS[0]).last_hidden_state[0].numpy()
    np.testing.assert_allclose(result.as_numpy("HIDDEN_STATE")[0], expected, atol=1e-4)


def test_qa_takes_text_alone_or_with_a_question(seed_server, model_folders):
    client = grpcclient.InferenceServerClient(seed_server.grpc_url)
    wanted = [grpcclient.InferRequestedOutput(name) for name in ("START_LOGITS", "END_LOGITS")]
    alone = client.infer("qa", [texts(grpcclient, [CONTEXT])], outputs=wanted)
    expected = reference(model_folders["qa"], "AutoModelForQuestionAnswering", CONTEXT)
    np.testing.assert_allclose(alone.as_numpy("START_LOGITS")[0], expected.start_logits[0], atol=1e-4)
    np.testing.assert_allclose(alone.as_numpy("END_LOGITS")[0], expected.end_logits[0], atol=1e-4)
    answer = client.infer("qa", [texts(grpcclient, [CONTEXT])]).as_numpy("answer")[0, 0].decode()
    assert answer and answer in CONTEXT  # the likeliest span of the text itself
    question = "What does it serve?"
    paired = client.infer("qa", [texts(grpcclient, [question], "question"), texts(grpcclient, [CONTEXT])])
    expected = reference(model_folders["qa"], "AutoModelForQuestionAnswering", CONTEXT, question)
    np.testing.assert_allclose(paired.as_numpy("START_LOGITS")[0], expected.start_logits[0], atol=1e-4)
    start, end = int(paired.as_numpy("start")[0, 0]), int(paired.as_numpy("end")[0, 0])
    assert CONTEXT[start:end] == paired.as_numpy("answer")[0, 0].decode()


def test_qa_truncates_a_long_text_alone_and_batches_texts_with_pairs(seed_server, model_folders):
    long = "serving " * 300  # more than the model's 128 positions: cut as transformers cuts it
    wanted = [grpcclient.InferRequestedOutput("START_LOGITS")]
    client = grpcclient.InferenceServerClient(seed_server.grpc_url)
    cut = client.infer("qa", [texts(grpcclient, [long])], outputs=wanted).as_numpy("START_LOGITS")
    expected = reference(model_folders["qa"], "AutoModelForQuestionAnswering", long).start_logits.numpy()
    assert cut.shape == expected.shape == (1, 128)
    np.testing.assert_allclose(cut, expected, atol=1e-4)
    # Requests with and without a question, at once: the tokenizer may get both kinds in one batch.
    requests = [[texts(grpcclient, [CONTEXT])], [texts(grpcclient, ["why?"], "question"), texts(grpcclient, [CONTEXT])],
                [texts(grpcclient, [long])]] * 4

    def call(inputs):
        return grpcclient.InferenceServerClient(seed_server.grpc_url).infer("qa", inputs).as_numpy("START_LOGITS")

    alone = [call(inputs) for inputs in requests[:3]]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(call, requests))
    for index, logits in enumerate(together):
        np.testing.assert_allclose(logits, alone[index % 3], atol=1e-5)


@pytest.mark.parametrize(("spec", "reason"), [
    ("tokenizer", "--step-names 'tokenizer': expected TOKENIZER,MODEL[,POSTPROCESS], e.g. tokenizer,model"),
    ("a,b,c,d", "expected TOKENIZER,MODEL[,POSTPROCESS]"),
    ("tokenizer,bad name", "--step-names 'bad name' is not a model name: a space is not allowed"),
    ("tokenizer,llm", "the ensemble 'llm' and its steps need a name each"),
    ("same,same", "need a name each (same, same, llm_postprocess, llm)"),
])
def test_step_names_are_checked_in_one_line(spec, reason):
    with pytest.raises(ExportError) as caught:
        step_names("llm", "seqcls", spec)
    assert reason in str(caught.value) and "\n" not in str(caught.value)


def test_step_names_as_the_tutorials_repository_has_them():
    assert step_names("llm", "seqcls", "tokenizer,model") == {
        "tokenizer": "tokenizer", "model": "model", "postprocess": "llm_postprocess"}
    assert step_names("llm", "qa", "tok,net,post") == {"tokenizer": "tok", "model": "net", "postprocess": "post"}
    assert step_names("enc", "encode", None) == {"tokenizer": "enc_tokenizer", "model": "enc_model"}
    with pytest.raises(ExportError, match=r"expected TOKENIZER,MODEL, e\.g\."):
        step_names("enc", "encode", "a,b,c")  # encode has no post-processing step


@pytest.mark.parametrize(("task", "specs", "reason"), [
    ("seqcls", ["text"], "expected OLD=NEW, e.g. TEXT=text"),
    ("seqcls", ["QUESTION=q"], "the seqcls tokenizer has no input 'QUESTION' (its inputs: TEXT)"),
    ("seqcls", ["TEXT=a b"], "'a b' is not a tensor name"),
    ("qa", ["QUESTION=x", "CONTEXT=x"], "the tokenizer's inputs would share a name (x, x)"),
    ("qa", ["QUESTION=CONTEXT"], "would share a name (CONTEXT, CONTEXT)"),
])
def test_tokenizer_input_names_are_checked(task, specs, reason):
    with pytest.raises(ExportError) as caught:
        parse_tokenizer_inputs(task, specs)
    assert reason in str(caught.value)
    assert parse_tokenizer_inputs("qa", ["CONTEXT=context"]) == {"CONTEXT": "context"}
