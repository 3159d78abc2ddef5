"""`--model-repository` values that name object storage, in Triton's spelling: `s3://bucket/path`,
`s3://host:port/bucket/path` and `s3://https://host:port/bucket/path` (a server of one's own, e.g. MinIO),
`gs://bucket/path`, `as://account/container/path`; and `az://container/path` as fsspec spells Azure."""

from __future__ import annotations

from dataclasses import dataclass

SCHEMES = ("s3", "gs", "as", "az")


class StorageUrlError(ValueError):
    """A repository URL that names no bucket (or container)."""


@dataclass(frozen=True, slots=True)
class StorageUrl:
    """Where a remote repository lives."""

    #: The URL as given: credentials in TRITON_CLOUD_CREDENTIAL_PATH are matched against it by prefix.
    text: str
    #: "s3", "gs" or "as" (`az://` is Azure too, and shares Triton's "as" credentials).
    scheme: str
    bucket: str
    prefix: str
    #: S3 only: the server's address (`http://host:port`) when the URL names one.
    endpoint: str | None = None
    #: Azure only: the storage account an `as://` URL names (for `az://` it comes from the credentials).
    account: str | None = None

    @property
    def protocol(self) -> str:
        """The fsspec protocol that reads it."""
        return {"s3": "s3", "gs": "gcs", "as": "abfs"}[self.scheme]

    @property
    def root(self) -> str:
        """The repository's path as fsspec names it: `bucket/prefix`."""
        return f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket

    def __str__(self) -> str:
        return self.text


def is_storage_url(text: str) -> bool:
    return text.partition("://")[0].lower() in SCHEMES and "://" in text


def parse_storage_url(text: str) -> StorageUrl:
    """The parts of a repository URL; StorageUrlError when it names no bucket."""
    scheme, _, rest = text.partition("://")
    scheme = scheme.lower()
    endpoint = account = None
    if scheme == "s3":
        endpoint, rest = _s3_endpoint(rest)
    parts = [part for part in rest.split("/") if part]
    if scheme == "as":
        if len(parts) < 2:
            raise StorageUrlError(f"'{text}' names no container: expected as://ACCOUNT/CONTAINER[/PATH]")
        account, parts = parts[0], parts[1:]
    if not parts:
        raise StorageUrlError(f"'{text}' names no bucket: expected {scheme}://BUCKET[/PATH]")
    if any(part in (".", "..") for part in parts):
        raise StorageUrlError(f"'{text}' may not contain '.' or '..' path parts")
    return StorageUrl(text, "as" if scheme == "az" else scheme, parts[0], "/".join(parts[1:]), endpoint, account)


def _s3_endpoint(rest: str) -> tuple[str | None, str]:
    """Triton's S3 host forms: `http(s)://host:port/...`, or `host:port/...` (HTTP), before the bucket."""
    for web in ("http://", "https://"):
        if rest.startswith(web):
            host, _, path = rest[len(web):].partition("/")
            return f"{web}{host}", path
    first, _, path = rest.partition("/")
    if ":" in first:  # a bucket name never holds a colon
        return f"http://{first}", path
    return None, rest
