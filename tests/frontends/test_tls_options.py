"""The TLS flags as `transerve serve` reads them: tritonserver's forms of `--grpc-use-ssl*` (its quirk included),
transerve's `--http-use-ssl*`, and every refusal at start, with a message naming the flag."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from support import EXAMPLE_REPOSITORY, REPO_ROOT
from support.certs import Certificates, make_certificates

from transerve.cli import access_from_args, build_parser
from transerve.frontends.tls import TlsError, TlsOptions


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


def access(*flags: str):
    return access_from_args(build_parser().parse_args(["serve", "--model-repository", "x", *flags]))


def server_files(certs: Certificates, prefix: str = "grpc") -> list[str]:
    return [f"--{prefix}-server-cert={certs.server_cert}", f"--{prefix}-server-key", str(certs.server_key)]


def test_no_tls_by_default() -> None:
    options = access()
    assert options.grpc_tls is None and options.http_tls is None


@pytest.mark.parametrize(("flags", "on", "mutual"), [
    (["--grpc-use-ssl=true"], True, False),
    (["--grpc-use-ssl", "1"], True, False),
    (["--grpc-use-ssl=off"], False, False),
    # tritonserver: any value of --grpc-use-ssl-mutual turns TLS on, false included ...
    (["--grpc-use-ssl-mutual=false"], True, False),
    (["--grpc-use-ssl-mutual=true", "--grpc-root-cert=CA"], True, True),
    # ... and a later --grpc-use-ssl=false turns it off again.
    (["--grpc-use-ssl-mutual=true", "--grpc-use-ssl=false"], False, True),
    (["--grpc-use-ssl=false", "--grpc-use-ssl-mutual=false"], True, False),
])
def test_grpc_flags_are_read_as_tritonserver_reads_them(certs: Certificates, flags: list[str], on: bool,
                                                        mutual: bool) -> None:
    flags = [flag.replace("=CA", f"={certs.ca}") for flag in flags]
    options = access(*flags, *server_files(certs)).grpc_tls
    assert (options is not None) == on
    if options is not None:
        assert options.mutual == mutual
        assert options.context("h2").verify_mode == (ssl.CERT_REQUIRED if mutual else ssl.CERT_NONE)


@pytest.mark.parametrize(("flags", "on", "mutual"), [
    (["--http-use-ssl=true"], True, False),
    (["--http-use-ssl-mutual=true", "--http-root-cert=CA"], True, True),
    (["--http-use-ssl-mutual=false"], False, False),  # transerve's own flag: false means false
])
def test_http_flags(certs: Certificates, flags: list[str], on: bool, mutual: bool) -> None:
    flags = [flag.replace("=CA", f"={certs.ca}") for flag in flags]
    options = access(*flags, *server_files(certs, "http")).http_tls
    assert (options is not None) == on
    if options is not None:
        assert options.mutual == mutual
        assert options.context("http/1.1").verify_mode == (ssl.CERT_REQUIRED if mutual else ssl.CERT_NONE)


def test_the_context_is_tls_1_2_or_later_with_aead_suites_only(certs: Certificates) -> None:
    options = access("--grpc-use-ssl=true", *server_files(certs)).grpc_tls
    assert options is not None
    context = options.context("h2")
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.options & ssl.OP_NO_COMPRESSION and context.options & ssl.OP_NO_RENEGOTIATION
    suites = [suite for suite in context.get_ciphers() if suite["protocol"] == "TLSv1.2"]
    assert suites and all(suite["aead"] and suite["kea"] == "kx-ecdhe" for suite in suites)


def test_a_root_certificate_is_only_read_with_mutual_tls(certs: Certificates, tmp_path: Path) -> None:
    """As in tritonserver, where the root is unused without mutual TLS: a missing one is not an error then."""
    options = access("--grpc-use-ssl=true", f"--grpc-root-cert={tmp_path / 'missing.pem'}", *server_files(certs))
    assert options.grpc_tls is not None and options.grpc_tls.root_pem is None


def test_files_of_a_service_that_is_off_are_not_read(tmp_path: Path) -> None:
    assert access("--allow-grpc=false", "--grpc-use-ssl=true").grpc_tls is None
    assert access("--allow-http=false", "--http-use-ssl=true").http_tls is None


def encrypted_key(certs: Certificates, folder: Path) -> Path:
    path = folder / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", str(certs.server_key), "-aes256", "-passout", "pass:secret", "-out",
                    str(path)], check=True, capture_output=True)
    return path


@pytest.mark.parametrize(("prefix", "case", "message"), [
    ("grpc", "no files", "--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key"),
    ("http", "no files", "--http-use-ssl needs --http-server-cert and --http-server-key"),
    ("grpc", "missing cert", "--grpc-server-cert '{tmp}/missing.pem': No such file or directory"),
    ("http", "missing key", "--http-server-key '{tmp}/missing.pem': No such file or directory"),
    ("grpc", "empty cert", "--grpc-server-cert '{tmp}/empty.pem' is empty"),
    ("grpc", "key of another cert", "are not a PEM certificate chain and its private key (KEY_VALUES_MISMATCH)"),
    ("grpc", "key as cert", "are not a PEM certificate chain and its private key"),
    ("grpc", "encrypted key", "is encrypted; transerve reads unencrypted keys only"),
    ("grpc", "mutual without root", "--grpc-use-ssl-mutual needs --grpc-root-cert"),
    ("http", "mutual without root", "--http-use-ssl-mutual needs --http-root-cert"),
    ("grpc", "root not a certificate", "--grpc-root-cert holds no PEM certificate"),
    ("grpc", "missing root", "--grpc-root-cert '{tmp}/missing.pem': No such file or directory"),
])
def test_refusals_name_the_flag(certs: Certificates, tmp_path: Path, prefix: str, case: str, message: str) -> None:
    (tmp_path / "empty.pem").write_bytes(b"")
    cert, key, root, mutual = str(certs.server_cert), str(certs.server_key), str(certs.ca), False
    if case == "no files":
        cert = key = None
    elif case == "missing cert":
        cert = str(tmp_path / "missing.pem")
    elif case == "missing key":
        key = str(tmp_path / "missing.pem")
    elif case == "empty cert":
        cert = str(tmp_path / "empty.pem")
    elif case == "key of another cert":
        key = str(certs.client_key)
    elif case == "key as cert":
        cert = key
    elif case == "encrypted key":
        key = str(encrypted_key(certs, tmp_path))
    elif case == "mutual without root":
        root, mutual = None, True
    elif case == "root not a certificate":
        root, mutual = str(certs.client_key), True
    elif case == "missing root":
        root, mutual = str(tmp_path / "missing.pem"), True
    with pytest.raises(TlsError) as refused:
        TlsOptions.from_flags(prefix, True, mutual, cert, key, root)
    assert message.format(tmp=tmp_path) in str(refused.value)


def test_serve_refuses_to_start_before_loading_anything(tmp_path: Path) -> None:
    """Exit 1 with the message, as tritonserver exits 1 (its message is "Socket ... already in use")."""
    result = subprocess.run(
        [sys.executable, "-m", "transerve", "serve", "--model-repository", str(EXAMPLE_REPOSITORY),
         "--grpc-use-ssl=true", f"--grpc-server-cert={tmp_path / 'missing.pem'}", "--grpc-server-key=k.pem"],
        capture_output=True, text=True, timeout=60, check=False,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT / "src"),
                                                                     os.environ.get("PYTHONPATH")]))))
    assert result.returncode == 1
    assert f"transerve serve: --grpc-server-cert '{tmp_path / 'missing.pem'}': No such file or directory" \
        in result.stderr
    assert "READY" not in result.stderr
