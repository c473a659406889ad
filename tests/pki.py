"""A throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1 and localhost,
and a client certificate for mutual TLS, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CA_NAME = "pdcluster test CA"


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer_key: ec.EllipticCurvePrivateKey,
          ca: bool = False, san: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                              critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   issuer_key.public_key()), critical=False))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(root: Path) -> dict[str, str]:
    """Write `ca.pem`, `server.pem`/`server.key` (valid for 127.0.0.1) and
    `client.pem`/`client.key` under `root`; returns their paths by file name."""
    ca_key = _key()
    files: dict[str, str] = {}

    def write(name: str, data: bytes) -> None:
        path = Path(root, name)
        path.write_bytes(data)
        files[name] = str(path)

    write("ca.pem", _cert(CA_NAME, ca_key, ca_key, ca=True).public_bytes(
        serialization.Encoding.PEM))
    for name, san in (("server", True), ("client", False)):
        key = _key()
        write(f"{name}.pem", _cert(name, key, ca_key, san=san).public_bytes(
            serialization.Encoding.PEM))
        write(f"{name}.key", key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return files


def trusting(pki: dict[str, str], client_cert: bool = False) -> ssl.SSLContext:
    """An SSL context that trusts the test CA (and presents the client certificate)."""
    context = ssl.create_default_context(cafile=pki["ca.pem"])
    if client_cert:
        context.load_cert_chain(pki["client.pem"], pki["client.key"])
    return context
