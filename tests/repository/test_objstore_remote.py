"""Object-storage repositories without a server: URL forms, Triton's credential conventions, and the local
mirror's refusals (keys that would leave the model's folder, models over the size limit)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from transerve.repository.credentials import CredentialError, storage_options
from transerve.repository.remote import RemoteRepository, StorageError
from transerve.repository.storage_url import StorageUrlError, is_storage_url, parse_storage_url
from transerve.server.options import parse_repository

PAGE = Path(__file__).resolve().parents[2] / "docs" / "object-storage.md"


@pytest.mark.parametrize(("text", "parts"), [
    ("s3://bucket/a/b", ("s3", "bucket", "a/b", None, None)),
    ("s3://bucket", ("s3", "bucket", "", None, None)),
    ("s3://http://127.0.0.1:9000/bucket/repo", ("s3", "bucket", "repo", "http://127.0.0.1:9000", None)),
    ("s3://https://minio.local:9000/bucket/repo/", ("s3", "bucket", "repo", "https://minio.local:9000", None)),
    ("s3://minio.local:9000/bucket/repo", ("s3", "bucket", "repo", "http://minio.local:9000", None)),
    ("gs://bucket/models", ("gs", "bucket", "models", None, None)),
    ("as://account/container/models", ("as", "container", "models", None, "account")),
    ("az://container/models", ("as", "container", "models", None, None)),
])
def test_url_forms(text: str, parts: tuple) -> None:
    url = parse_storage_url(text)
    assert (url.scheme, url.bucket, url.prefix, url.endpoint, url.account) == parts
    assert str(url) == text


@pytest.mark.parametrize("text", ["s3://", "s3://http://host:1/", "as://account", "gs://bucket/../other"])
def test_url_without_bucket_is_refused(text: str) -> None:
    with pytest.raises(StorageUrlError):
        parse_storage_url(text)


def test_local_paths_stay_paths() -> None:
    assert not is_storage_url("models/s3")
    assert parse_repository("/srv/models") == Path("/srv/models")
    assert parse_repository("S3://bucket/x").scheme == "s3"


AWS_ENV = {"AWS_ACCESS_KEY_ID": "env-id", "AWS_SECRET_ACCESS_KEY": "env-secret", "AWS_DEFAULT_REGION": "eu-west-1",
           "AWS_SESSION_TOKEN": "env-token"}


def test_s3_credentials_from_the_environment() -> None:
    options = storage_options(parse_storage_url("s3://http://127.0.0.1:9/b/r"), AWS_ENV)
    assert options == {"key": "env-id", "secret": "env-secret", "token": "env-token",
                       "client_kwargs": {"region_name": "eu-west-1"}, "endpoint_url": "http://127.0.0.1:9"}


def test_credential_file_longest_prefix_wins(tmp_path: Path) -> None:
    path = tmp_path / "creds.json"
    path.write_text(json.dumps({
        "s3": {"": {"key_id": "any-id", "secret_key": "any-secret"},
               "s3://bucket-2": {"key_id": "two-id", "secret_key": "two-secret", "region": "us-east-2"}},
        "gs": {"": "/keys/default.json", "gs://special": "/keys/special.json"},
        "as": {"": {"account_str": "acct", "account_key": "a2V5"}},
    }))
    env = dict(AWS_ENV, TRITON_CLOUD_CREDENTIAL_PATH=str(path))
    assert storage_options(parse_storage_url("s3://bucket-2/models"), env) == {
        "key": "two-id", "secret": "two-secret", "client_kwargs": {"region_name": "us-east-2"}}
    assert storage_options(parse_storage_url("s3://bucket-1/models"), env)["key"] == "any-id"
    assert storage_options(parse_storage_url("gs://special/m"), env) == {"token": "/keys/special.json"}
    assert storage_options(parse_storage_url("az://container/m"), env) == {"account_name": "acct",
                                                                          "account_key": "a2V5"}
    # An account the URL names wins over the file's.
    assert storage_options(parse_storage_url("as://other/container"), env)["account_name"] == "other"


def test_the_pages_credential_file(tmp_path: Path) -> None:
    """docs/object-storage.md's example file, read as the page says."""
    import re

    (block,) = re.findall(r"^```json\n(.*?)^```$", PAGE.read_text(), re.MULTILINE | re.DOTALL)
    path = tmp_path / "credentials.json"
    path.write_text(block)
    env = {"TRITON_CLOUD_CREDENTIAL_PATH": str(path)}
    assert storage_options(parse_storage_url("s3://http://127.0.0.1:9000/models/repo"), env)["key"] == "OTHER_KEY"
    assert storage_options(parse_storage_url("s3://elsewhere/repo"), env)["key"] == "KEY"
    assert storage_options(parse_storage_url("gs://bucket/repo"), env) == {"token": "/keys/service-account.json"}
    assert storage_options(parse_storage_url("as://acct/container"), env)["account_key"] == "KEY"


def test_credential_file_without_a_matching_section_falls_back_to_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "creds.json"
    path.write_text(json.dumps({"gs": {"": "/keys/default.json"}}))
    env = {"TRITON_CLOUD_CREDENTIAL_PATH": str(path), "GOOGLE_APPLICATION_CREDENTIALS": "/env.json",
           "AZURE_STORAGE_ACCOUNT": "envacct", "AZURE_STORAGE_KEY": "k"}
    assert storage_options(parse_storage_url("as://a/c"), env) == {"account_name": "a", "account_key": "k"}
    assert storage_options(parse_storage_url("az://c"), env)["account_name"] == "envacct"


def test_unreadable_credential_file(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    for path in (tmp_path / "bad.json", tmp_path / "missing.json"):
        with pytest.raises(CredentialError, match="TRITON_CLOUD_CREDENTIAL_PATH"):
            storage_options(parse_storage_url("s3://b/r"), {"TRITON_CLOUD_CREDENTIAL_PATH": str(path)})


class FakeFilesystem:
    """Just what the mirror calls, over a dict of keys to contents."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.downloads = 0

    def ls(self, path: str, detail: bool, refresh: bool) -> list[dict[str, Any]]:
        names = {key[len(path) + 1:].split("/")[0] for key in self.objects if key.startswith(path + "/")}
        return [{"name": f"{path}/{name}", "type": "directory"} for name in names]

    def find(self, path: str, detail: bool, refresh: bool) -> dict[str, dict[str, Any]]:
        return {key: {"type": "file", "size": len(data), "ETag": str(hash(data))}
                for key, data in self.objects.items() if key.startswith(path + "/")}

    def get_file(self, key: str, target: str) -> None:
        self.downloads += 1
        Path(target).write_bytes(self.objects[key])


def mirror(tmp_path: Path, objects: dict[str, bytes], limit: int = 1 << 20) -> tuple[RemoteRepository, FakeFilesystem]:
    remote = RemoteRepository(parse_storage_url("s3://bucket/repo"), tmp_path / "cache", limit)
    fs = remote._fs = FakeFilesystem(objects)
    return remote, fs


def test_download_only_when_the_listing_changes(tmp_path: Path) -> None:
    remote, fs = mirror(tmp_path, {"bucket/repo/m/config.pbtxt": b"name: 'm'", "bucket/repo/m/1/model.py": b"x"})
    assert remote.list_models() == {"m"}
    remote.download("m")
    remote.download("m")
    assert fs.downloads == 2
    assert (remote.local / "m" / "1" / "model.py").read_bytes() == b"x"
    fs.objects["bucket/repo/m/2/model.py"] = b"y"
    remote.download("m")
    assert (remote.local / "m" / "2" / "model.py").read_bytes() == b"y"
    del fs.objects["bucket/repo/m/config.pbtxt"], fs.objects["bucket/repo/m/1/model.py"], fs.objects[
        "bucket/repo/m/2/model.py"]
    assert remote.list_models() == set()
    assert not (remote.local / "m").exists()


@pytest.mark.parametrize("key", ["../../escape.py", "1/../../../escape.py", "/abs.py", "1//model.py", "1/./m.py"])
def test_keys_that_leave_the_model_folder_are_refused(tmp_path: Path, key: str) -> None:
    remote, _ = mirror(tmp_path, {"bucket/repo/m/config.pbtxt": b"", f"bucket/repo/m/{key}": b"evil"})
    with pytest.raises(StorageError, match="outside its folder: refused"):
        remote.download("m")
    assert not (remote.local / "m").exists()
    assert not list(tmp_path.rglob("escape.py"))


def test_size_limit(tmp_path: Path) -> None:
    remote, fs = mirror(tmp_path, {"bucket/repo/m/config.pbtxt": b"", "bucket/repo/m/1/w.bin": b"0" * 2000},
                        limit=1000)
    with pytest.raises(StorageError, match="2000 bytes, more than the 1000 that --model-repository-max-model-bytes"):
        remote.download("m")
    assert fs.downloads == 0


def test_missing_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "gcsfs", None)
    remote = RemoteRepository(parse_storage_url("gs://bucket/repo"), tmp_path, 1)
    with pytest.raises(StorageError, match=r"needs the package 'gcsfs': pip install 'transerve\[cloud\]'"):
        remote.list_models()


def test_an_object_that_grew_after_the_listing(tmp_path: Path) -> None:
    remote, fs = mirror(tmp_path, {"bucket/repo/m/config.pbtxt": b"", "bucket/repo/m/1/w.bin": b"0" * 10}, limit=1000)
    listing = fs.find

    def grown(path: str, detail: bool, refresh: bool) -> dict[str, dict[str, Any]]:
        found = listing(path, detail, refresh)
        fs.objects["bucket/repo/m/1/w.bin"] = b"0" * 5000
        return found

    fs.find = grown
    with pytest.raises(StorageError, match="grew past --model-repository-max-model-bytes"):
        remote.download("m")
    assert not (remote.local / "m").exists()
    assert not list((remote.local / ".staging").iterdir())
