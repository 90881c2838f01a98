"""Throwaway certificate authorities and agent certificates for TLS tests and benchmarks (``cryptography``, in the
``dev`` extra).

A test needs a CA per deployment (so that one deployment's certificates are
refused by another's) and a certificate per agent signed by it, made at run
time so that no key is ever committed. Keys are P-256 (fast to make), valid
for a day, named for 127.0.0.1 and localhost.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdkv.errors import ConfigError

try:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
except ImportError:  # pragma: no cover - the dev extra has it
    x509 = None  # type: ignore[assignment]


@dataclass(frozen=True)
class TlsFiles:
    """One agent's PEM files: what the tcp channel's ``tls`` option names."""

    cert: Path
    key: Path
    ca: Path

    def options(self) -> dict[str, str]:
        return {"cert": str(self.cert), "key": str(self.key), "ca": str(self.ca)}


def _name(common: str) -> Any:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(key: Any, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


class CertificateAuthority:
    """A CA of its own in ``directory``; ``issue`` signs an agent's certificate with it."""

    def __init__(self, directory: Path, name: str = "pdkv-test-ca") -> None:
        if x509 is None:
            raise ConfigError("making TLS certificates needs the `cryptography` package: pip install 'pdkv[dev]'")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        self.ca = directory / f"{name}.pem"
        self.ca.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, agent: str) -> TlsFiles:
        """A certificate for ``agent`` (client and server use, 127.0.0.1 and localhost), its key, and this CA."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(agent))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        files = TlsFiles(
            self.directory / f"{self.name}-{agent}.pem", self.directory / f"{self.name}-{agent}.key", self.ca
        )
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, files.key)
        return files
