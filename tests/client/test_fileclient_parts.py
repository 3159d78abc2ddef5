"""`transerve client`'s parts in process: reading lines in bounded memory, the output file as checkpoint, answers in
input order whatever order requests finish in, a refused batch retried line by line, the model's tensors picked from
its config, and the progress bar. The end-to-end runs against a real server are in tests/e2e/test_fileclient.py."""

from __future__ import annotations

import io
import random
import threading
import time

import numpy as np
import pytest

from transerve.client.command import parse_parameter
from transerve.client.errors import LineFailed, RunStopped
from transerve.client.files import Line, Output, count_lines, read_lines
from transerve.client.progress import ProgressBar
from transerve.client.runner import Outcome, answer_batch, answer_lines
from transerve.client.sink import GIVE_UP_AFTER, Sink
from transerve.client.target import Target, tensor_target


def test_lines_are_counted_and_read_without_their_endings(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"one\r\ntwo\n\nfour")
    assert count_lines(path) == 4
    assert [line.text for line in read_lines(path, 0, 100)] == ["one", "two", "", "four"]
    assert [line.number for line in read_lines(path, 2, 100)] == [3, 4]


def test_a_long_line_and_a_line_that_is_not_utf8_are_problems_of_their_own(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"ok\n" + b"x" * 5000 + b"\nbad \xff byte\n" + b"y" * 10 + b"\r\nlast")
    lines = list(read_lines(path, 0, 10))
    assert [line.number for line in lines] == [1, 2, 3, 4, 5]
    assert lines[1].text is None and "5000 bytes, more than --max-line-bytes 10" in lines[1].problem
    assert lines[2].text is None and "not UTF-8 (byte 5" in lines[2].problem
    assert lines[3].text == "y" * 10  # exactly the limit, its \r\n not counted
    assert lines[4].text == "last"


def test_the_output_resumes_after_its_complete_lines_and_drops_a_partial_one(tmp_path):
    path = tmp_path / "out.txt"
    path.write_bytes(b"a\nb\npart")
    output = Output(path, 5)
    assert output.done == 2
    output.write(["c", "two\nlines\r\nhere"])
    output.close()
    assert path.read_bytes() == b"a\nb\nc\ntwo lines here\n"
    assert Output(tmp_path / "new.txt", 3).done == 0


def test_an_output_longer_than_the_input_is_refused(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("a\nb\nc\n")
    with pytest.raises(RunStopped, match="3 lines, more than the input's 2"):
        Output(path, 2)


def test_answers_come_in_input_order_whatever_order_requests_finish_in():
    lines = [Line(number, f"line {number}") for number in range(1, 101)]
    seen = []

    def send(texts):
        time.sleep(random.random() / 200)
        return [text.upper() for text in texts]

    answer_lines(iter(lines), 3, 8, send, lambda batch, outcome: seen.extend(outcome.answers))
    assert seen == [f"LINE {number}" for number in range(1, 101)]


def test_a_refused_batch_is_sent_again_line_by_line_so_the_others_are_answered():
    calls = []

    def send(texts):
        calls.append(list(texts))
        if "bad" in texts:
            raise LineFailed("HTTP 400: too long")
        return [text.upper() for text in texts]

    lines = [Line(1, "a"), Line(2, "bad"), Line(3, ""), Line(4, None, "not UTF-8"), Line(5, "c")]
    outcome = answer_batch(lines, send)
    assert outcome.answers == ["A", "", "", "", "C"]
    assert outcome.failures == [(2, "HTTP 400: too long"), (4, "not UTF-8")]
    assert calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]  # the blank and the unreadable line never sent


def test_a_stopped_run_hands_over_the_batches_before_it_and_no_later_one():
    seen = []

    def send(texts):
        if texts == ["5"]:
            raise RunStopped("HTTP 503: gone")
        return texts

    with pytest.raises(RunStopped, match="gone"):
        answer_lines(iter([Line(n, str(n)) for n in range(1, 20)]), 1, 4, send,
                     lambda batch, outcome: seen.extend(outcome.answers))
    assert seen == ["1", "2", "3", "4"]


def test_at_most_concurrency_requests_are_in_flight():
    active, most, lock = 0, 0, threading.Lock()

    def send(texts):
        nonlocal active, most
        with lock:
            active += 1
            most = max(most, active)
        time.sleep(0.005)
        with lock:
            active -= 1
        return texts

    answer_lines(iter([Line(n, "x") for n in range(1, 60)]), 2, 3, send, lambda batch, outcome: None)
    assert most == 3


CONFIG = {
    "max_batch_size": 8,
    "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
              {"name": "beam", "data_type": "TYPE_INT32", "dims": [1], "optional": True}],
    "output": [{"name": "score", "data_type": "TYPE_FP32", "dims": [1]},
               {"name": "text_output", "data_type": "TYPE_STRING", "dims": [1]}],
}


def test_the_text_input_and_output_are_found_in_the_config():
    target = tensor_target(CONFIG, "m", "", None, None, {})
    assert (target.input_name, target.output_name, target.shape(3)) == ("text_input", "text_output", [3, 1])
    assert tensor_target(CONFIG, "m", "", None, "score", {}).output_name == "score"
    # gRPC's ModelConfig as JSON: dims as strings, max_batch_size left out when 0
    grpc_config = {"input": [{"name": "t", "data_type": "TYPE_STRING", "dims": ["-1"]}],
                   "output": [{"name": "o", "data_type": "TYPE_FP32", "dims": ["4"]}]}
    target = tensor_target(grpc_config, "m", "", None, None, {})
    assert (target.output_name, target.shape(1)) == ("o", [1])


@pytest.mark.parametrize(("config", "names", "message"), [
    ({**CONFIG, "input": CONFIG["input"] + [{"name": "x", "data_type": "TYPE_STRING", "dims": [1]}]}, (None, None),
     "cannot tell which input of model 'm' to use .*--input-name"),
    ({**CONFIG, "input": CONFIG["input"] + [{"name": "ids", "data_type": "TYPE_INT32", "dims": [1]}]}, (None, None),
     "also needs ids"),
    (CONFIG, ("nope", None), "no input 'nope'; its inputs: text_input, beam"),
    ({**CONFIG, "model_transaction_policy": {"decoupled": True}}, (None, None), "decoupled .* use --generate"),
    (CONFIG, (None, "nope"), "no output 'nope'"),
    ({**CONFIG, "input": [{"name": "t", "data_type": "TYPE_STRING", "dims": [2]}]}, (None, None), "dims \\[2\\]"),
])
def test_tensors_that_cannot_be_told_or_sent_are_refused_with_the_choices(config, names, message):
    with pytest.raises(RunStopped, match=message):
        tensor_target(config, "m", "", *names, {})


def test_answers_are_one_line_per_row():
    target = Target("m", "", "i", "o", max_batch_size=4)
    assert target.answers(np.array([[b"caf\xc3\xa9"], [b"b"]], dtype=np.object_), 2) == ["café", "b"]
    assert target.answers(np.array([[0.5, 1.0], [2.0, 3.0]], dtype=np.float32), 2) == ["0.5 1.0", "2.0 3.0"]


def test_parameters_are_typed():
    assert [parse_parameter(text) for text in ("max_tokens=64", "top_p=0.5", "stream=false", "stop=a=b")] == [
        ("max_tokens", 64), ("top_p", 0.5), ("stream", False), ("stop", "a=b")]
    with pytest.raises(RunStopped, match="KEY=VALUE"):
        parse_parameter("oops")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_draws_on_a_terminal_and_stays_silent_elsewhere():
    terminal, pipe = Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        bar = ProgressBar(stream, 10, 2)
        bar.advance(8, 1)
        bar.interrupt("line 3: bad")
        bar.close()
    assert "[" + "#" * 30 + "] 10/10 lines 100%" in terminal.getvalue() and "1 failed" in terminal.getvalue()
    assert pipe.getvalue() == "line 3: bad\n"


def failing(first: int, count: int) -> tuple[list[Line], Outcome]:
    lines = [Line(number, "x") for number in range(first, first + count)]
    return lines, Outcome([""] * count, [(line.number, "HTTP 400: unknown parameter") for line in lines])


def test_when_the_first_lines_sent_all_fail_the_run_stops_with_nothing_written(tmp_path):
    output = Output(tmp_path / "out.txt", 100)
    sink = Sink(output, None, ProgressBar(io.StringIO(), 100, 0))
    sink.take([Line(1, "")], Outcome([""]))  # a blank line: nothing to judge, written
    sink.take(*failing(2, GIVE_UP_AFTER - 1))
    with pytest.raises(RunStopped, match=f"the first {GIVE_UP_AFTER + 1} lines sent all failed, the last with: line "
                                         f"{GIVE_UP_AFTER + 2}: HTTP 400: unknown parameter; nothing was written"):
        sink.take(*failing(GIVE_UP_AFTER + 1, 2))
    output.close()
    assert (tmp_path / "out.txt").read_bytes() == b"\n"


def test_failures_held_until_a_line_is_answered_are_then_written_in_order(tmp_path):
    output, errors = Output(tmp_path / "out.txt", 100), io.StringIO()
    sink = Sink(output, errors, ProgressBar(io.StringIO(), 100, 0))
    sink.take(*failing(1, 3))
    assert (tmp_path / "out.txt").read_bytes() == b""
    sink.take([Line(4, "x"), Line(5, "y")], Outcome(["X", "Y"]))
    sink.take(*failing(6, GIVE_UP_AFTER))  # once a line was answered, failures never stop the run
    output.close()
    assert (tmp_path / "out.txt").read_bytes() == b"\n\n\nX\nY\n" + b"\n" * GIVE_UP_AFTER
    assert errors.getvalue().startswith("1\tHTTP 400: unknown parameter\n2\t") and sink.failed == 3 + GIVE_UP_AFTER


def test_the_seed_client_line_parses_as_the_client_options():
    """Seed 001's `triton_client` flags are spellings of the client's own: its line parses unchanged."""
    from transerve.cli import build_parser

    args = build_parser().parse_args([
        "client", "--server=localhost:8000", "--model-name=transformer", "--model-version=1",
        "--input_file=in.txt", "--output_file=out.txt"])
    assert (args.url, args.model, args.model_version) == ("localhost:8000", "transformer", "1")
    assert (str(args.input_file), str(args.output_file)) == ("in.txt", "out.txt")
