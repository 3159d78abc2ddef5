"""perf_analyzer's search, as its older flags write it (`-d -l MS -t START -c END`): concurrency from START up to
END in steps of one, ending at the first level whose latency reaches the limit, which is left out of the report;
against a real server whose one instance takes 100 ms a request, so that latency grows with concurrency."""

from __future__ import annotations

import csv
import re

import pytest
from support import start_transerve
from support.repositories import write_model

from transerve.cli import main

SLOW_CONFIG = """
name: "slow" backend: "python" max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
SLOW_CODE = """
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            time.sleep(0.1)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(
                request, "INPUT0").as_numpy())]))
        return responses
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("search")
    write_model(repo, "slow", SLOW_CONFIG, SLOW_CODE)
    with start_transerve(repo) as process:
        yield process


@pytest.mark.parametrize("protocol", ["HTTP", "GRPC"])
def test_the_search_ends_at_the_first_level_over_the_latency_limit(server, capsys, tmp_path, protocol):
    report = tmp_path / "search.csv"
    url = server.http_url if protocol == "HTTP" else server.grpc_url
    # Concurrency k waits for k requests of 100 ms: about 100, 200, 300 ms; the limit is 250.
    code = main(["perf", "-m", "slow", "-u", url, "-i", protocol, "-v", "-p400", "-d", "-l250", "-t1", "-c5", "-b1",
                 "-s", "1000", "-r", "4", "--latency-report-file", str(report)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = captured.out
    assert "  Latency limit: 250 msec\n  Concurrency limit: 5 concurrent requests\n" in out
    # As perf_analyzer: each level's line as it starts, the third's too, but no report of it.
    assert re.findall(r"^Request concurrency: (\d+)$", out, re.MULTILINE) == ["1", "2", "3"]
    assert out.count("  Client: ") == 2
    assert "Measured latency went over the set limit of 250 msec." in captured.err
    assert re.findall(r"  Pass \[\d+\] throughput", out)  # -v: each window
    table = out.split("Inferences/Second vs. Client Average Batch Latency\n")[1].splitlines()
    assert [line.split(",")[0] for line in table] == ["Concurrency: 1", "Concurrency: 2"]
    latencies = [float(value) for value in re.findall(r"latency (\d+) usec", "\n".join(table))]
    assert 80_000 < latencies[0] < 200_000 and 160_000 < latencies[1] < 250_000, table
    rows = list(csv.reader(report.open()))
    assert [row[0] for row in rows] == ["Concurrency", "1", "2"]


def test_a_first_level_over_the_limit_reports_no_level(server, capsys):
    code = main(["perf", "-m", "slow", "-u", server.http_url, "-p", "300", "-l", "50", "-t", "2", "-c", "4",
                 "-s", "1000"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert re.findall(r"^Request concurrency: (\d+)$", captured.out, re.MULTILINE) == ["2"]
    assert "  Client: " not in captured.out
    assert "Measured latency went over the set limit of 50 msec." in captured.err
    assert captured.out.rstrip().endswith("Inferences/Second vs. Client Average Batch Latency")


def test_without_a_limit_every_level_from_t_to_c_is_measured_and_c_0_searches_until_the_limit(server, capsys):
    code = main(["perf", "-m", "slow", "-u", server.http_url, "-p", "300", "-t", "1", "-c", "2", "-s", "1000",
                 "--percentile", "90"])
    captured = capsys.readouterr()
    assert code in (0, 1), captured.err  # 1: a level not stable within 10 windows on a busy machine
    assert re.findall(r"^Request concurrency: (\d+)$", captured.out, re.MULTILINE) == ["1", "2"]
    assert "Inferences/Second vs. Client p90 Batch Latency" in captured.out

    code = main(["perf", "-m", "slow", "-u", server.http_url, "-p", "300", "-t", "1", "-c", "0", "-l", "150",
                 "-s", "1000"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert re.findall(r"^Request concurrency: (\d+)$", captured.out, re.MULTILINE) == ["1", "2"]
    assert captured.out.count("  Client: ") == 1
    assert "went over the set limit of 150 msec" in captured.err
