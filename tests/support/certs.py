"""Throwaway certificates for TLS tests and benchmarks: a CA, a server and a client certificate it signed, and a
second CA that signed nothing the server trusts. Made with `cryptography` (the `test` extra) in a folder the
caller owns; EC P-256 keys, because they are made in milliseconds."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Certificates:
    """PEM files: `ca` signed `server` (localhost, 127.0.0.1, ::1) and `client`; `other_ca` signed `stranger`."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    stranger_cert: Path
    stranger_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, issuer_key: ec.EllipticCurvePrivateKey,
                 *, ca: bool = False, usage: x509.ObjectIdentifier | None = None,
                 names: list[x509.GeneralName] | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                          encipher_only=False, decipher_only=False), critical=True)
        builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    else:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


def make_certificates(folder: Path) -> Certificates:
    """Write every file of `Certificates` into `folder` (which must exist)."""
    ca_key, other_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    stranger_key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                     x509.IPAddress(ipaddress.ip_address("::1"))]
    files = Certificates(*(folder / name for name in (
        "ca.pem", "server.pem", "server.key", "client.pem", "client.key", "other-ca.pem", "stranger.pem",
        "stranger.key")))
    files.ca.write_bytes(_pem(_certificate("transerve test CA", ca_key, "transerve test CA", ca_key, ca=True)))
    files.other_ca.write_bytes(_pem(_certificate("another CA", other_key, "another CA", other_key, ca=True)))
    files.server_cert.write_bytes(_pem(_certificate("localhost", server_key, "transerve test CA", ca_key,
                                                    usage=ExtendedKeyUsageOID.SERVER_AUTH, names=names)))
    files.client_cert.write_bytes(_pem(_certificate("test client", client_key, "transerve test CA", ca_key,
                                                    usage=ExtendedKeyUsageOID.CLIENT_AUTH)))
    files.stranger_cert.write_bytes(_pem(_certificate("stranger", stranger_key, "another CA", other_key,
                                                      usage=ExtendedKeyUsageOID.CLIENT_AUTH)))
    for key, path in ((server_key, files.server_key), (client_key, files.client_key),
                      (stranger_key, files.stranger_key)):
        _write_key(key, path)
    return files
