"""Credentials for object-storage repositories, by Triton's conventions: the JSON file that
TRITON_CLOUD_CREDENTIAL_PATH names (sections "s3", "gs", "as", each keyed by a URL prefix; the longest prefix
that the repository's URL starts with wins, "" matching every URL), else the provider's environment variables.
The result is the keyword arguments of the fsspec filesystem that reads the repository."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from transerve.repository.storage_url import StorageUrl

CREDENTIAL_PATH_VARIABLE = "TRITON_CLOUD_CREDENTIAL_PATH"


class CredentialError(ValueError):
    """The credential file cannot be read, or holds no usable entry."""


def storage_options(url: StorageUrl, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The filesystem arguments for `url`: the credential file's entry when one matches, else the environment."""
    entry = _file_entry(url, environ)
    if url.scheme == "s3":
        options = _s3(entry, environ)
        if url.endpoint:
            options["endpoint_url"] = url.endpoint
        return options
    if url.scheme == "gs":
        token = entry if isinstance(entry, str) else environ.get("GOOGLE_APPLICATION_CREDENTIALS")
        return {"token": token} if token else {}
    return _azure(url, entry, environ)


def _s3(entry: Any, environ: Mapping[str, str]) -> dict[str, Any]:
    if isinstance(entry, dict):
        values = {name: str(entry.get(name) or "") for name in ("key_id", "secret_key", "region", "session_token",
                                                                 "profile")}
    else:
        variables = {"key_id": "AWS_ACCESS_KEY_ID", "secret_key": "AWS_SECRET_ACCESS_KEY",
                     "region": "AWS_DEFAULT_REGION", "session_token": "AWS_SESSION_TOKEN"}
        values = {name: environ.get(variable, "") for name, variable in variables.items()} | {"profile": ""}
    options: dict[str, Any] = {}
    for name, option in (("key_id", "key"), ("secret_key", "secret"), ("session_token", "token"),
                         ("profile", "profile")):
        if values[name]:
            options[option] = values[name]
    if values["region"]:
        options["client_kwargs"] = {"region_name": values["region"]}
    return options


def _azure(url: StorageUrl, entry: Any, environ: Mapping[str, str]) -> dict[str, Any]:
    if isinstance(entry, dict):
        account, key = str(entry.get("account_str") or ""), str(entry.get("account_key") or "")
    else:
        account, key = environ.get("AZURE_STORAGE_ACCOUNT", ""), environ.get("AZURE_STORAGE_KEY", "")
    options: dict[str, Any] = {"account_name": url.account or account}
    if key:
        options["account_key"] = key
    return options


def _file_entry(url: StorageUrl, environ: Mapping[str, str]) -> Any:
    """The credential file's entry for `url`, or None (no file, or no prefix of it matches)."""
    path = environ.get(CREDENTIAL_PATH_VARIABLE)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as file:
            document = json.load(file)
    except (OSError, ValueError) as exc:
        raise CredentialError(f"cannot read the credential file {CREDENTIAL_PATH_VARIABLE}={path}: {exc}") from None
    section = document.get(url.scheme) if isinstance(document, dict) else None
    if section is None:
        return None
    if not isinstance(section, dict):
        raise CredentialError(f"the credential file {path}: section '{url.scheme}' must be an object of URL prefixes")
    matches = [prefix for prefix in section if url.text.startswith(prefix)]
    return section[max(matches, key=len)] if matches else None
