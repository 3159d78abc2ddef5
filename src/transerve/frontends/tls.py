"""TLS for the HTTP and gRPC listeners: tritonserver's `--grpc-use-ssl*` flags and transerve's own `--http-use-ssl*`,
read and checked before anything listens, then handed to a listener as an `ssl.SSLContext` (the asyncio servers) or
as grpcio's server credentials (`--grpc-transport=grpcio`).

Both forms mean the same: the server's certificate chain and key; with mutual TLS a client certificate is required
and verified against the root certificate, and without it none is asked for (the root is then unused, as in
Triton). The asyncio listeners speak TLS 1.2 or 1.3 with forward-secret AEAD suites only, without compression or
renegotiation, which also meets what RFC 9113 section 9.2 asks of HTTP/2 over TLS; they offer one ALPN protocol.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

#: Seconds a client has to complete its TLS handshake. A connection is the frontend's only once the handshake is
#: done, so the protocol's own timeouts cannot cover that phase: without this, asyncio waits 60 s per connection.
HANDSHAKE_TIMEOUT = 10.0
#: TLS 1.2 suites (1.3 has its own, all AEAD): ECDHE key exchange and an AEAD cipher, nothing else.
CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


class TlsError(ValueError):
    """A TLS flag that cannot be served: the message names the flag, for `transerve serve: <message>`."""


@dataclass(frozen=True)
class TlsOptions:
    """One listener's TLS settings, with the PEM files already read (so nothing fails once serving)."""

    flags: str  # "grpc" or "http": the prefix of the flags that set these, for messages
    cert: Path
    key: Path
    cert_pem: bytes
    key_pem: bytes
    root_pem: bytes | None  # the CA client certificates are verified against; only with `mutual`
    mutual: bool

    @classmethod
    def from_flags(cls, flags: str, use_ssl: bool, mutual: bool, cert: str | None, key: str | None,
                   root: str | None) -> TlsOptions | None:
        """None without `use_ssl`; otherwise checked options, or TlsError saying which flag is wrong."""
        if not use_ssl:
            return None
        if not cert or not key:
            raise TlsError(f"--{flags}-use-ssl needs --{flags}-server-cert and --{flags}-server-key")
        if mutual and not root:
            raise TlsError(f"--{flags}-use-ssl-mutual needs --{flags}-root-cert, the CA that client certificates "
                           "are verified against")
        options = cls(flags, Path(cert), Path(key), _read(f"--{flags}-server-cert", cert),
                      _read(f"--{flags}-server-key", key), _read(f"--{flags}-root-cert", root) if mutual else None,
                      mutual)
        options.context("h2")  # parses every file, so a bad certificate or key stops the server before it serves
        return options

    def context(self, alpn: str) -> ssl.SSLContext:
        """A server context offering the ALPN protocol `alpn` ("h2" for gRPC, "http/1.1" for HTTP)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
        context.set_ciphers(CIPHERS)
        context.set_alpn_protocols([alpn])
        try:
            context.load_cert_chain(self.cert, self.key, password=self._no_password)
        except ssl.SSLError as exc:
            raise TlsError(f"--{self.flags}-server-cert '{self.cert}' and --{self.flags}-server-key '{self.key}' "
                           f"are not a PEM certificate chain and its private key ({exc.reason or exc})") from None
        if self.mutual:
            assert self.root_pem is not None
            try:
                context.load_verify_locations(cadata=self.root_pem.decode("latin-1"))
            except (ssl.SSLError, ValueError) as exc:
                raise TlsError(f"--{self.flags}-root-cert holds no PEM certificate ({exc})") from None
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def _no_password(self) -> bytes:
        # OpenSSL would otherwise ask for the passphrase on the terminal, and wait there.
        raise TlsError(f"--{self.flags}-server-key '{self.key}' is encrypted; transerve reads unencrypted keys only")

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """The same settings for grpcio: client certificates requested, required and verified only when mutual."""
        import grpc

        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.root_pem,
                                           require_client_auth=self.mutual)


def listen_kwargs(tls: TlsOptions | None, alpn: str) -> dict[str, Any]:
    """`loop.create_server`'s TLS arguments: none for a plain listener."""
    return {"ssl": tls.context(alpn), "ssl_handshake_timeout": HANDSHAKE_TIMEOUT} if tls is not None else {}


def _read(flag: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsError(f"{flag} '{path}': {exc.strerror or exc}") from None
    if not data.strip():
        raise TlsError(f"{flag} '{path}' is empty")
    return data
