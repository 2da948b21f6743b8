"""Where a proxied sandbox finds the CA bundle that trusts its session's CA (design §3.3), and
the variables that point every client at it. Shared by the daemon (which sets a session's
environment), ``sandboxd run`` and the rootfs step that binds the bundle (step 8e).

The sandbox's root is a read-only view of the host's, so the bundle's path inside is one of the
host's own system bundles; the step binds the host bundle plus the session's CA over it."""

from __future__ import annotations

import os

# The system bundles of Debian/Ubuntu, Fedora/RHEL and Alpine/Arch, in the order looked for.
TRUST_BUNDLE_PATHS = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt",
                      "/etc/ssl/cert.pem")

# Each names the bundle to a family of clients: OpenSSL/Python ssl and httpx, requests (else
# certifi), curl, git, Node (added to its own store at start).
BUNDLE_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO",
                    "NODE_EXTRA_CA_CERTS")


def host_bundle_path() -> str | None:
    """The first of TRUST_BUNDLE_PATHS that is a regular file (after symlinks) on the host, which
    is the path the sandbox sees too; None when the host has none."""
    for path in TRUST_BUNDLE_PATHS:
        if os.path.isfile(path):
            return path
    return None


def trust_environment(bundle_path: str) -> dict[str, str]:
    """The variables that make clients read ``bundle_path``, and NODE_USE_ENV_PROXY (Node 24 and
    later then honour HTTPS_PROXY; earlier ones ignore it and are caught by transparent capture)."""
    env = {name: bundle_path for name in BUNDLE_VARIABLES}
    env["NODE_USE_ENV_PROXY"] = "1"
    return env
