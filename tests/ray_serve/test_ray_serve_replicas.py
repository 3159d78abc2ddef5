"""`transerve serve-ray` on a local two-node Ray cluster (docs/ray.md): two replicas, each a transerve server,
behind Serve's HTTP proxy. tritonclient works against the Serve address unchanged, requests spread across the
replicas (the `transerve-replica` header names the one that answered), statistics are per replica and add up,
server-sent events stream through, a killed replica is replaced, and stopping drains a stream in flight.

One replica per node: each node has one `transerve` resource and each replica needs it. The head's proxy would
otherwise send every request to the replica on its own node (Serve's local-node preference), so the head runs
with RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING=0 to show Serve's spread across nodes."""

from __future__ import annotations

import collections
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests

pytest.importorskip("ray.serve", reason="the ray extra (pip install 'transerve[ray]')")

import tritonclient.http as triton_http  # noqa: E402
from support import EXAMPLE_REPOSITORY, REPO_ROOT, ServerProcess  # noqa: E402
from support.doc_blocks import code_blocks, commands  # noqa: E402
from support.ray_cluster import REPLICA, ray_cluster, replica_of, wait_for_replicas  # noqa: E402
from support.servers import free_ports  # noqa: E402

from transerve.ray.child import REPLICA_ENV  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RAY_PAGE = REPO_ROOT / "docs" / "ray.md"
COUNTER = Path(__file__).resolve().parents[1] / "e2e" / "decoupled_bls_models" / "counter"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ray_repository")
    shutil.copytree(EXAMPLE_REPOSITORY / "add_sub", root / "add_sub")
    shutil.copytree(COUNTER, root / "counter")
    return root


def page_commands(repository: Path) -> tuple[list[str], list[str], list[str]]:
    """docs/ray.md's three commands as argument lists: `ray start` twice (GCS port as `{port}`), then serve-ray's."""
    lines = [shlex.split(line.replace("6379", "{port}")) for line in commands(code_blocks(RAY_PAGE, "bash")[0])]
    (ray_head, ray_node, serve_ray) = lines
    assert ray_head[:2] == ray_node[:2] == ["ray", "start"] and serve_ray[:2] == ["transerve", "serve-ray"]
    serve_ray = [str(repository) if arg == "examples/model_repository" else arg
                 for arg in serve_ray[2:]]
    return ray_head[2:], ray_node[2:], serve_ray


@pytest.fixture(scope="module")
def serve_ray(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The cluster and the application docs/ray.md starts, on free ports, with faster probes."""
    logs = tmp_path_factory.mktemp("ray_logs")
    head, node, flags = page_commands(repository)
    with ray_cluster(head, node, env={"RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0"}) as address:
        (port,) = free_ports(1)
        flags = [address if arg == "127.0.0.1:{port}" else str(port) if arg == "8000" else arg for arg in flags]
        server = ServerProcess(
            "transerve serve-ray",
            [sys.executable, "-m", "transerve", "serve-ray", *flags, "--health-check-period-s=1",
             "--graceful-shutdown-timeout-s=20", f"--log-dir={logs}"],
            http_port=port, grpc_port=0, metrics_port=0, log_path=logs / "serve-ray.log")
        try:
            server.wait_ready(timeout=240)
            wait_for_replicas(server, 2, timeout=120)
            yield server
        finally:
            server.stop(timeout=60)


def add_sub_inputs() -> list[triton_http.InferInput]:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 2.0, np.float32)
    inputs = [triton_http.InferInput("INPUT0", [2, 4], "FP32"), triton_http.InferInput("INPUT1", [2, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b, binary_data=False)
    return inputs


def test_tritonclient_works_against_the_serve_address(serve_ray: ServerProcess) -> None:
    client = triton_http.InferenceServerClient(serve_ray.http_url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("add_sub")
    metadata = client.get_model_metadata("add_sub")
    assert [tensor["name"] for tensor in metadata["inputs"]] == ["INPUT0", "INPUT1"]
    assert client.get_model_config("add_sub")["max_batch_size"] == 8
    result = client.infer("add_sub", add_sub_inputs())
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + 2)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - 2)
    # Errors come through with the server's status and body.
    with pytest.raises(Exception, match="unknown model|not found|no model"):
        client.get_model_metadata("no_such_model")


def test_requests_spread_across_replicas(serve_ray: ServerProcess) -> None:
    client = triton_http.InferenceServerClient(serve_ray.http_url)
    answered = collections.Counter()
    for _ in range(40):
        client.infer("add_sub", add_sub_inputs())
        answered[replica_of(serve_ray)] += 1
    assert len(answered) == 2 and min(answered.values()) >= 5, answered


def stats_by_replica(server: ServerProcess) -> dict[str, int]:
    """Each replica's `add_sub` success count: `/stats` is one replica's, named by the header. The questions go 8
    at a time, for up to 30 s: a CI run saw 60 questions asked one at a time all go to one replica (Serve's proxy
    routes to a replica that is free, and prefers the one on its own node)."""
    counts: dict[str, int] = {}

    def ask(_: int) -> tuple[str, int]:
        response = requests.get(f"{server.base_url}/v2/models/add_sub/stats", timeout=10)
        return response.headers[REPLICA], response.json()["model_stats"][0]["inference_stats"]["success"]["count"]

    deadline = time.monotonic() + 30
    with ThreadPoolExecutor(8) as pool:
        while time.monotonic() < deadline:
            counts.update(pool.map(ask, range(8)))
            if len(counts) == 2:
                return counts
            time.sleep(0.2)
    raise AssertionError(f"stats of one replica only: {counts}\n{server.log_tail()}")


def test_statistics_are_per_replica_and_add_up(serve_ray: ServerProcess) -> None:
    before = stats_by_replica(serve_ray)
    client = triton_http.InferenceServerClient(serve_ray.http_url, concurrency=4)
    for request in [client.async_infer("add_sub", add_sub_inputs()) for _ in range(30)]:
        request.get_result()
    after = stats_by_replica(serve_ray)
    assert after.keys() == before.keys()
    assert sum(after.values()) - sum(before.values()) == 30


def test_server_sent_events_stream_through(serve_ray: ServerProcess) -> None:
    with requests.post(f"{serve_ray.base_url}/v2/models/counter/generate_stream", json={"N": 5}, stream=True,
                       timeout=30) as response:
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith(b"data:")]
    assert len(events) == 5 and b'"OUT":4' in events[-1].replace(b" ", b""), events


def test_openai_routes_pass_through(serve_ray: ServerProcess) -> None:
    """/v1 reaches the replicas' servers as /v2 does: this repository has no generation or embedding model, so the
    list is empty, and an unknown model is OpenAI's 404."""
    listing = requests.get(f"{serve_ray.base_url}/v1/models", timeout=30)
    assert listing.status_code == 200 and listing.json() == {"object": "list", "data": []}, listing.text
    unknown = requests.post(f"{serve_ray.base_url}/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found", unknown.text


def replica_processes(repository: Path) -> dict[str, psutil.Process]:
    """The replicas' actor processes, by replica: the parents of the `transerve serve` children on `repository`."""
    found = {}
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if cmdline[1:4] == ["-m", "transerve", "serve"] and f"--model-repository={repository}" in cmdline:
            found[process.environ()[REPLICA_ENV]] = process
    return found


class Stream(threading.Thread):
    """A `counter` stream of `count` events, read to its end; which replica held it, and whether it completed."""

    def __init__(self, server: ServerProcess, count: int) -> None:
        super().__init__()
        self.server, self.count = server, count
        self.replica: str | None = None
        self.events = 0
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with requests.post(f"{self.server.base_url}/v2/models/counter/generate_stream", json={"N": self.count},
                               stream=True, timeout=60) as response:
                self.replica = response.headers.get(REPLICA)
                for line in response.iter_lines():
                    if line.startswith(b"data:"):
                        self.events += 1
                        self.started.set()
        except requests.RequestException:
            pass  # a broken stream is what is counted
        finally:
            self.started.set()

    @property
    def completed(self) -> bool:
        return self.events == self.count


def test_a_killed_replica_is_replaced_and_only_its_requests_fail(serve_ray: ServerProcess, repository: Path) -> None:
    """Streams in flight on both replicas and add_sub load; one replica's process is killed. Only the streams
    it held break; no add_sub request fails beyond the one each client may have had on it; Serve starts a new
    replica and its server, and the killed one's server does not outlive it."""
    before = wait_for_replicas(serve_ray, 2, timeout=30)
    streams = []
    while len({stream.replica for stream in streams} - {None}) < 2 and len(streams) < 12:
        stream = Stream(serve_ray, 150)  # 20 ms an event: 3 s
        stream.start()
        stream.started.wait(30)
        streams.append(stream)
    held = {stream.replica for stream in streams}
    assert before <= held, f"streams on {held}, replicas {before}"
    outcomes: list[bool] = []
    stop = threading.Event()

    def load() -> None:
        client = triton_http.InferenceServerClient(serve_ray.http_url, network_timeout=30)
        while not stop.is_set():
            try:
                client.infer("add_sub", add_sub_inputs())
                outcomes.append(True)
            except Exception:  # noqa: BLE001  (a failed request is what is counted)
                outcomes.append(False)

    clients = [threading.Thread(target=load) for _ in range(2)]
    for thread in clients:
        thread.start()
    victim = streams[0].replica
    child = replica_processes(repository)[victim]
    child.parent().send_signal(signal.SIGKILL)
    # Its server follows it (parent-death signal), and Serve starts a new replica.
    assert psutil.wait_procs([child], timeout=30)[1] == [], "the killed replica's server still runs"
    after = wait_for_replicas(serve_ray, 1, timeout=120, besides=before)
    stop.set()
    for thread in [*clients, *streams]:
        thread.join()
    assert all(not stream.completed for stream in streams if stream.replica == victim)
    assert all(stream.completed for stream in streams if stream.replica != victim)
    assert outcomes.count(False) <= len(clients) and outcomes[-10:] == [True] * 10, outcomes.count(False)
    assert len(after - before) == 1 and len(replica_processes(repository)) == 2


def test_stopping_drains_a_stream_in_flight(serve_ray: ServerProcess, repository: Path) -> None:
    """The last test: SIGTERM to serve-ray deletes the application; Serve and the replica wait for the stream."""
    with requests.post(f"{serve_ray.base_url}/v2/models/counter/generate_stream", json={"N": 100}, stream=True,
                       timeout=60) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith(b"data:"))
        serve_ray.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith(b"data:")]
    assert b'"OUT":0' in first.replace(b" ", b"") and len(rest) == 99, rest[-3:]
    assert serve_ray.process.wait(timeout=60) == 0
    assert replica_processes(repository) == {}
