"""The per-session CA: its leaves verify with OpenSSL against its certificate alone, carry what
strict verifiers (Go's) require, are cached, are loaded without leaving a descriptor or a file, and
the CA's key has no way out of the process."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography import x509

from sandboxd.network.interception.ca import LEAF_CACHE, SessionCA


@pytest.fixture(scope="module")
def ca() -> SessionCA:
    return SessionCA.generate("0123456789abcdef")


def test_a_leaf_verifies_with_openssl_against_the_session_ca_only(ca: SessionCA, tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    assert openssl is not None, "openssl is not installed (packaging/setup.sh test installs it)"
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem())
    (tmp_path / "leaf.pem").write_bytes(ca.leaf_pem("api.internet.test"))
    ok = subprocess.run([openssl, "verify", "-CAfile", str(tmp_path / "ca.pem"), "-verify_hostname",
                         "api.internet.test", str(tmp_path / "leaf.pem")], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # Control: another session's CA does not vouch for it; nor does it stand for another name.
    (tmp_path / "other.pem").write_bytes(SessionCA.generate("other").cert_pem())
    other = subprocess.run([openssl, "verify", "-CAfile", str(tmp_path / "other.pem"), str(tmp_path / "leaf.pem")],
                           capture_output=True, text=True, check=False)
    assert other.returncode != 0
    name = subprocess.run([openssl, "verify", "-CAfile", str(tmp_path / "ca.pem"), "-verify_hostname",
                           "evil.test", str(tmp_path / "leaf.pem")], capture_output=True, text=True, check=False)
    assert name.returncode != 0


def test_the_certificates_carry_what_strict_verifiers_require(ca: SessionCA) -> None:
    root = x509.load_pem_x509_certificate(ca.cert_pem())
    constraints = root.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    assert root.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    assert "0123456789abcdef"[:8] in root.subject.rfc4514_string()
    leaf = x509.load_pem_x509_certificate(ca.leaf_pem("api.internet.test"))
    assert leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == ["api.internet.test"]
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert leaf.issuer == root.subject


def test_leaves_are_cached_and_bounded(ca: SessionCA) -> None:
    assert ca.leaf("cached.test") is ca.leaf("cached.test")
    for number in range(LEAF_CACHE + 5):
        ca.leaf(f"h{number}.test")
    assert ca.cached == LEAF_CACHE


def test_minting_leaves_no_descriptor_open(ca: SessionCA) -> None:
    before = len(os.listdir("/proc/self/fd"))
    for number in range(20):
        ca.leaf(f"fd{number}.test")
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_leaf_is_only_for_a_host_name(ca: SessionCA) -> None:
    for bad in ("127.0.0.1", "a b", "x.test\nDNS:evil", "*.test", ""):
        with pytest.raises(ValueError):
            ca.leaf(bad)


def test_the_ca_never_leaves_the_process(ca: SessionCA) -> None:
    with pytest.raises(TypeError):
        pickle.dumps(ca)
    assert b"PRIVATE KEY" not in ca.cert_pem() and b"PRIVATE KEY" not in ca.leaf_pem("api.internet.test")


def test_the_server_name_of_a_real_client_hello() -> None:
    import ssl

    from sandboxd.network.interception.sni import needs_more, server_name

    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname="API.Internet.test")
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    hello = outgoing.read()
    assert server_name(hello) == "api.internet.test" and not needs_more(hello)
    # Controls: cut short it is not read (and more is wanted); no SNI, no name; not TLS, nothing.
    assert server_name(hello[:40]) is None and needs_more(hello[:40])
    bare = ssl.create_default_context()
    bare.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    with pytest.raises(ssl.SSLWantReadError):
        bare.wrap_bio(incoming, outgoing).do_handshake()
    assert server_name(outgoing.read()) is None
    assert server_name(b"GET / HTTP/1.1\r\n\r\n") is None
