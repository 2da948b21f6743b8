"""The per-session certificate authority: made in this process (the daemon, or one ``sandboxd
run``), its key never serialised and never leaving it; only ``cert_pem`` (the certificate) goes
into the sandbox's trust bundle.

``leaf(host)`` is the server-side TLS context the proxy shows a sandbox for ``host``: one EC P-256
leaf key per CA (a key generation per session, a signature per host), a certificate with
``DNS:host`` as its only name, valid for a week, cached (LRU, ``LEAF_CACHE`` hosts). ``ssl`` loads
a certificate chain only from a path: the PEM goes through a ``memfd`` (no file system holds it),
read back through ``/proc/self/fd`` and closed at once.
"""

from __future__ import annotations

import datetime
import os
import ssl
import threading
from collections import OrderedDict

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sandboxd.policy.domains import host_name

CA_DAYS = 365
LEAF_DAYS = 7
LEAF_CACHE = 256                       # hosts whose leaf context a CA keeps
MAX_LABEL = 8                          # characters of the session id in the CA's name
ALPN = ["http/1.1"]                    # intercepted connections speak HTTP/1.1 only (no h2)


class SessionCA:
    """A session's CA (``generate``): signs leaves for the hosts its proxy intercepts."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, certificate: x509.Certificate) -> None:
        self._key, self._certificate = key, certificate
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        self._leaves: OrderedDict[str, tuple[ssl.SSLContext, bytes, datetime.datetime]] = OrderedDict()
        self._lock = threading.Lock()                   # leaves are minted on the loop's workers

    def __repr__(self) -> str:
        return f"SessionCA({self._certificate.subject.rfc4514_string()!r})"

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a SessionCA never leaves its process")

    @classmethod
    def generate(cls, label: str) -> "SessionCA":
        """A new CA named after ``label`` (a session id; its first 8 characters)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        name = x509.Name([
            x509.NameAttribute(NameOID.COMMON_NAME, f"sandboxd session {label[:MAX_LABEL]} CA"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "sandboxd")])
        public = key.public_key()
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256()))
        return cls(key, certificate)

    def cert_pem(self) -> bytes:
        """The CA's certificate (PEM): all of it that leaves this process."""
        return self._certificate.public_bytes(serialization.Encoding.PEM)

    def leaf(self, host: str) -> ssl.SSLContext:
        """The server context for ``host`` (a host name: policy.domains.host_name), minted or
        cached. Blocking work (a signature): call it off the loop."""
        return self._entry(host)[0]

    def leaf_pem(self, host: str) -> bytes:
        """The certificate ``leaf(host)`` presents (PEM)."""
        return self._entry(host)[1]

    @property
    def cached(self) -> int:
        return len(self._leaves)

    def _entry(self, host: str) -> tuple[ssl.SSLContext, bytes, datetime.datetime]:
        if host_name(host) != host:
            raise ValueError("a leaf is minted for a host name only")
        now = datetime.datetime.now(datetime.timezone.utc)
        with self._lock:
            entry = self._leaves.get(host)
            if entry is not None and entry[2] > now:
                self._leaves.move_to_end(host)
                return entry
        entry = self._mint(host, now)
        with self._lock:
            self._leaves[host] = entry
            self._leaves.move_to_end(host)
            while len(self._leaves) > LEAF_CACHE:
                self._leaves.popitem(last=False)
        return entry

    def _mint(self, host: str, now: datetime.datetime) -> tuple[ssl.SSLContext, bytes, datetime.datetime]:
        expires = now + datetime.timedelta(days=LEAF_DAYS)
        public = self._leaf_key.public_key()
        certificate = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(self._certificate.subject).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(expires)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256()))
        pem = certificate.public_bytes(serialization.Encoding.PEM)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(ALPN)
        key_pem = self._leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption())
        _load_from_memory(context, pem + self.cert_pem(), key_pem)
        return context, pem, expires


def _load_from_memory(context: ssl.SSLContext, chain: bytes, key: bytes) -> None:
    """``context.load_cert_chain`` from bytes: through an anonymous memory file, closed at once."""
    fd = os.memfd_create("sbx-leaf", os.MFD_CLOEXEC)
    try:
        os.write(fd, chain + key)
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


__all__ = ["SessionCA"]
