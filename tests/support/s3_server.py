"""A local S3 server for the object-storage repository tests: moto in server mode, in its own process on 127.0.0.1,
recording every request it gets so a test can read which access key signed them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .servers import free_ports, http_status

_CREDENTIAL = re.compile(r"Credential=([^/]+)/")


@dataclass
class S3Server:
    """A running moto server: its address, and the file it records requests in."""

    port: int
    recording: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, bucket: str, prefix: str) -> str:
        """The repository's URL in Triton's form for a server of one's own: s3://http://host:port/bucket/prefix."""
        return f"s3://{self.endpoint}/{bucket}/{prefix}"

    def client(self):  # noqa: ANN201 (boto3 has no static types)
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="test-uploader",
                            aws_secret_access_key="test-secret", region_name="us-east-1")

    def upload_folder(self, folder: Path, bucket: str, prefix: str) -> None:
        client = self.client()
        for path in sorted(folder.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")

    def access_keys(self) -> set[str]:
        """The access key ids that signed the requests recorded so far (the uploader's included)."""
        keys = set()
        if self.recording.exists():
            for line in self.recording.read_text().splitlines():
                headers = json.loads(line).get("headers", {})
                found = _CREDENTIAL.search(headers.get("Authorization", ""))
                if found:
                    keys.add(found.group(1))
        return keys


@contextlib.contextmanager
def start_s3_server(require_keys: bool = False) -> Iterator[S3Server]:
    """Run `moto.server` on a free loopback port until the block exits; with `require_keys`, it checks every
    request's access key (moto's IAM: only keys created through it are accepted, and none is)."""
    with tempfile.TemporaryDirectory(prefix="transerve-s3-") as tmp:
        port = free_ports(1)[0]
        recording = Path(tmp) / "requests.jsonl"
        env = dict(os.environ, MOTO_ENABLE_RECORDING="1", MOTO_RECORDER_FILEPATH=str(recording))
        if require_keys:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        with open(Path(tmp) / "moto.log", "wb") as log:
            process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                       stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while http_status(port, "/moto-api/") is None:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto did not start: {(Path(tmp) / 'moto.log').read_text()[-2000:]}")
                time.sleep(0.1)
            yield S3Server(port, recording)
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
