"""`transerve serve-ray --autoscaling-config` on a live local cluster: Serve takes the config and adds a replica
when the ongoing requests ask for one (docs/ray.md). Started at one replica, with a target of one ongoing request
per replica and no upscale delay; four long `counter` streams held open make Serve start the second replica (each
node has one `transerve` resource, so two is the most there can be)."""

from __future__ import annotations

import json
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

pytest.importorskip("ray.serve", reason="the ray extra (pip install 'transerve[ray]')")

from support import EXAMPLE_REPOSITORY, ServerProcess  # noqa: E402
from support.ray_cluster import HEAD, NODE, ray_cluster, replica_of, wait_for_replicas  # noqa: E402
from support.servers import free_ports  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

COUNTER = Path(__file__).resolve().parents[1] / "e2e" / "decoupled_bls_models" / "counter"
AUTOSCALING = {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
               "upscale_delay_s": 0, "downscale_delay_s": 600, "look_back_period_s": 2, "metrics_interval_s": 0.5}


@pytest.fixture(scope="module")
def autoscaled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repository = tmp_path_factory.mktemp("autoscaled_repository")
    shutil.copytree(EXAMPLE_REPOSITORY / "add_sub", repository / "add_sub")
    shutil.copytree(COUNTER, repository / "counter")
    logs = tmp_path_factory.mktemp("autoscaled_logs")
    with ray_cluster(HEAD, NODE, env={"RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0"}) as address:
        (port,) = free_ports(1)
        server = ServerProcess(
            "transerve serve-ray",
            [sys.executable, "-m", "transerve", "serve-ray", f"--model-repository={repository}",
             f"--autoscaling-config={json.dumps(AUTOSCALING)}", f"--ray-address={address}", f"--http-port={port}",
             "--health-check-period-s=1", "--graceful-shutdown-timeout-s=5", f"--log-dir={logs}"],
            http_port=port, grpc_port=0, metrics_port=0, log_path=logs / "serve-ray.log")
        try:
            server.wait_ready(timeout=240)
            yield server
        finally:
            server.stop(timeout=60)


def test_load_brings_up_a_second_replica(autoscaled: ServerProcess) -> None:
    assert len(wait_for_replicas(autoscaled, 1, timeout=60)) == 1  # initial_replicas: one, until there is load
    done = threading.Event()

    def hold() -> None:  # a stream of 3000 events 20 ms apart, closed once the test has seen what it waits for
        try:
            with requests.post(f"{autoscaled.base_url}/v2/models/counter/generate_stream", json={"N": 3000},
                               stream=True, timeout=120) as response:
                for _ in response.iter_lines():
                    if done.is_set():
                        return
        except requests.RequestException:  # only load: one that waits past its timeout behind the others held it
            return

    holders = [threading.Thread(target=hold, daemon=True) for _ in range(4)]
    for holder in holders:
        holder.start()
    try:
        assert len(wait_for_replicas(autoscaled, 2, timeout=150)) == 2
    finally:
        done.set()
        for holder in holders:
            holder.join(timeout=30)
    assert replica_of(autoscaled) is not None  # still serving
