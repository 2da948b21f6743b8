"""How the intercepting proxy checks the real upstream: the host's trust store as OpenSSL finds
it (``SSL_CERT_FILE``/``SSL_CERT_DIR`` of this process honoured), plus the configuration's
``network.upstream_ca_file``; the certificate must name the host asked for. No request reaches an
upstream whose certificate did not verify (a credential's secret above all)."""

from __future__ import annotations

import ssl

from sandboxd.network.interception.ca import ALPN


def upstream_context(extra_ca_pem: str = "") -> ssl.SSLContext:
    """The client context for upstreams: the default trust (set_default_verify_paths, which reads
    SSL_CERT_FILE and SSL_CERT_DIR) and ``extra_ca_pem`` (network.upstream_ca_file's content), host
    names checked, TLS 1.2 at least, HTTP/1.1 offered. One per process."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if extra_ca_pem:
        context.load_verify_locations(cadata=extra_ca_pem)
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(ALPN)
    return context


def why_untrusted(host: str, port: int, error: Exception) -> str:
    """The one line a sandbox (and the event) gets when ``host``:``port``'s certificate fails."""
    reason = getattr(error, "verify_message", None) or getattr(error, "reason", None) or type(error).__name__
    return (f"sandboxd: the certificate of {host}:{port} is not trusted ({reason}); the proxy trusts the "
            "host's store, network.upstream_ca_file and SSL_CERT_FILE")


__all__ = ["upstream_context", "why_untrusted"]
