"""Object-storage model repositories against a local S3 server (moto, on loopback): a real `transerve serve` on
`s3://http://127.0.0.1:PORT/bucket/repo`, beside a local repository; explicit loads and polling after the bucket
changes; the credentials that sign the requests; and a repository that cannot be read stopping the start."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from support import EXAMPLE_REPOSITORY, REPO_ROOT, start_server, start_transerve
from support.doc_blocks import code_blocks, commands
from support.s3_server import S3Server, start_s3_server

pytest.importorskip("s3fs", reason="the cloud extra (s3fs) is not installed")
pytest.importorskip("moto", reason="moto[server] is not installed")

ADD_SUB = EXAMPLE_REPOSITORY / "add_sub"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with start_s3_server() as server:
        yield server


@pytest.fixture
def hermetic_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No AWS setting of the machine's reaches the server: only what each test sets."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_DEFAULT_REGION", "TRITON_CLOUD_CREDENTIAL_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


def new_bucket(s3: S3Server, name: str) -> str:
    s3.client().create_bucket(Bucket=name)
    s3.upload_folder(ADD_SUB, name, "repo/add_sub")
    return s3.url(name, "repo")


def add_sub(url: str, version: str = "", model: str = "add_sub") -> np.ndarray:
    client = httpclient.InferenceServerClient(url)
    a, b = np.arange(4, dtype=np.float32).reshape(1, 4), np.ones((1, 4), dtype=np.float32)
    inputs = [httpclient.InferInput("INPUT0", [1, 4], "FP32"), httpclient.InferInput("INPUT1", [1, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return client.infer(model, inputs, model_version=version).as_numpy("OUTPUT0")


def test_explicit_load_downloads_again_after_the_bucket_changes(
    s3: S3Server, hermetic_aws: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    url = new_bucket(s3, "explicit")
    local = tmp_path / "local"
    shutil.copytree(EXAMPLE_REPOSITORY / "identity", local / "identity")
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "transerve-env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "transerve-env-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with start_transerve(url, "--model-repository", str(local), "--model-control-mode=explicit",
                         "--load-model=add_sub", "--load-model=identity", "--model-repository-cache", str(cache),
                         "--model-repository-max-model-bytes", "100000") as server:
        assert add_sub(server.http_url).tolist() == [[1, 2, 3, 4]]
        assert "transerve-env-key" in s3.access_keys()
        index = requests.post(f"{server.base_url}/v2/repository/index", timeout=10).json()
        assert {entry["name"] for entry in index} == {"add_sub", "identity"}
        # The mirror is this server's own folder under the cache, read by the loaders like any repository.
        assert list(cache.glob("transerve-models-*/0/add_sub/1/model.py"))

        s3.upload_folder(ADD_SUB / "1", "explicit", "repo/add_sub/2")
        assert requests.post(f"{server.base_url}/v2/repository/models/add_sub/load", timeout=60).status_code == 200
        versions = requests.get(f"{server.base_url}/v2/models/add_sub", timeout=10).json()["versions"]
        assert versions == ["2"]
        assert add_sub(server.http_url, "2").tolist() == [[1, 2, 3, 4]]

        # A model too large to download: a clear refusal, never a 500, and nothing else disturbed.
        s3.upload_folder(ADD_SUB, "explicit", "repo/big")
        s3.client().put_object(Bucket="explicit", Key="repo/big/1/weights.bin", Body=b"0" * 200_000)
        answer = requests.post(f"{server.base_url}/v2/repository/models/big/load", timeout=60)
        assert answer.status_code == 400
        assert "more than the 100000 that --model-repository-max-model-bytes allows" in answer.json()["error"]
        # A model the bucket does not hold.
        answer = requests.post(f"{server.base_url}/v2/repository/models/absent/load", timeout=60)
        assert answer.status_code == 400
    assert not list(cache.iterdir()), "the server removes its mirror at exit"


def test_poll_serves_a_version_added_to_the_bucket(
    s3: S3Server, hermetic_aws: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    url = new_bucket(s3, "polled")
    credentials = tmp_path / "credentials.json"
    credentials.write_text(json.dumps({"s3": {
        "": {"key_id": "transerve-default-key", "secret_key": "s"},
        url.rsplit("/", 1)[0]: {"key_id": "transerve-file-key", "secret_key": "s", "region": "us-east-1"},
    }}))
    monkeypatch.setenv("TRITON_CLOUD_CREDENTIAL_PATH", str(credentials))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "transerve-ignored-env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    with start_transerve(url, "--model-control-mode=poll", "--repository-poll-secs=0.5") as server:
        assert add_sub(server.http_url).tolist() == [[1, 2, 3, 4]]
        s3.upload_folder(ADD_SUB / "1", "polled", "repo/add_sub/2")
        deadline = time.monotonic() + 60
        while requests.get(f"{server.base_url}/v2/models/add_sub", timeout=10).json()["versions"] != ["2"]:
            assert time.monotonic() < deadline, server.log[-3000:]
            time.sleep(0.2)
        assert add_sub(server.http_url, "2").tolist() == [[1, 2, 3, 4]]
    keys = s3.access_keys()
    assert "transerve-file-key" in keys
    assert not {"transerve-default-key", "transerve-ignored-env-key"} & keys


def serve_once(repository: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`transerve serve` expected to exit at start (ports 0: it never gets to listen)."""
    argv = [sys.executable, "-m", "transerve", "serve", "--model-repository", repository, "--http-port", "0",
            "--grpc-port", "0", "--metrics-port", "0", "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
            "--metrics-address", "127.0.0.1"]
    env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT / "src"), env.get("PYTHONPATH")])))
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def test_unreadable_repository_stops_the_start(s3: S3Server, hermetic_aws: None, tmp_path: Path) -> None:
    env = dict(os.environ, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s")
    missing = serve_once(s3.url("no-such-bucket", "repo"), env)
    assert missing.returncode == 1
    assert f"model repository {s3.url('no-such-bucket', 'repo')} does not exist" in missing.stderr
    bad = dict(env, TRITON_CLOUD_CREDENTIAL_PATH=str(tmp_path / "absent.json"))
    unreadable = serve_once(s3.url("no-such-bucket", "repo"), bad)
    assert unreadable.returncode == 1
    assert "cannot read the credential file TRITON_CLOUD_CREDENTIAL_PATH=" in unreadable.stderr
    malformed = serve_once("s3://http://127.0.0.1:1/", env)
    assert malformed.returncode == 2 and "names no bucket" in malformed.stderr


def test_refused_credentials_stop_the_start(hermetic_aws: None) -> None:
    with start_s3_server(require_keys=True) as s3:
        refused = serve_once(s3.url("models", "repo"), dict(os.environ, AWS_ACCESS_KEY_ID="transerve-unknown-key",
                                                            AWS_SECRET_ACCESS_KEY="s"))
        assert "transerve-unknown-key" in s3.access_keys()
    assert refused.returncode == 1
    assert f"model repository {s3.url('models', 'repo')} cannot be read: The AWS Access Key Id you provided does " \
           "not exist" in refused.stderr


PAGE = REPO_ROOT / "docs" / "object-storage.md"


def test_the_pages_command(s3: S3Server, hermetic_aws: None, tmp_path: Path) -> None:
    """docs/object-storage.md's `transerve serve` command as it shows it, moto's port for its 9000: a bucket's
    model served beside the local example repository, with the keys the command sets."""
    s3.client().create_bucket(Bucket="models")
    client = s3.client()
    client.put_object(Bucket="models", Key="repo/add_sub_remote/config.pbtxt",
                      Body=(ADD_SUB / "config.pbtxt").read_text().replace('"add_sub"', '"add_sub_remote"'))
    client.upload_file(str(ADD_SUB / "1" / "model.py"), "models", "repo/add_sub_remote/1/model.py")
    (command,) = commands(code_blocks(PAGE, "bash")[0])
    tokens = shlex.split(command.replace("127.0.0.1:9000", f"127.0.0.1:{s3.port}"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT / "src"),
                                                                    os.environ.get("PYTHONPATH")])))
    while "=" in tokens[0]:
        name, _, value = tokens.pop(0).partition("=")
        env[name] = value
    assert tokens[:2] == ["transerve", "serve"]
    loopback = ["--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1"]
    server = start_server("transerve", lambda http, grpc, metrics: [
        sys.executable, "-m", "transerve", *tokens[1:], "--http-port", str(http), "--grpc-port", str(grpc),
        "--metrics-port", str(metrics), *loopback], log_dir=tmp_path, env=env, cwd=REPO_ROOT)
    try:
        assert add_sub(server.http_url, model="add_sub_remote").tolist() == [[1, 2, 3, 4]]
        assert add_sub(server.http_url).tolist() == [[1, 2, 3, 4]]
    finally:
        server.stop()
    assert "KEY" in s3.access_keys()
