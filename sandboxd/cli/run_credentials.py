"""`sandboxd run --credential VAR=https://HOST[:PORT][;...]`: the command holds a phantom, the run's
egress proxy puts the real secret in (network.credentials, docs/networks.md).

The run process makes everything the proxy needs: a CA of its own (network.interception.ca), whose
certificate the sandbox trusts (rootfs step 8e, LaunchSpec.trust_pem, and the variables of
launcher.trust_bundle), an Interceptor whose upstream context is the host's trust store plus this
process's SSL_CERT_FILE (as OpenSSL reads them), and a CredentialSet of one phantom per credential.
Inside the sandbox VAR is the phantom, whatever --pass-env or --env say of VAR.

Where the secrets are, and when (the hostile pass's findings):

- A secret is never in the sandbox's init, nor in a rootless run's outer process: both are forks of
  this process, so a secret in its memory at the fork would be copied there. A --credential-file
  is read after the fork (``held_secrets``). A secret from this process's environment is there
  from its start, so before the fork it is moved (cli.environment_secrets.take_from_environment, which
  the daemon's clients use too) into a mapping the
  kernel empties in every child (MADV_WIPEONFORK), and each copy the process had is zeroed: libc's
  (the environment block /proc/PID/environ shows) and the bytes Python's os.environ keeps.
- This process is made non-dumpable before it takes any secret: a plain user's other processes
  (another agent, a danger-full-access command) run as the same uid, and could otherwise read its
  memory through /proc/PID/mem or ptrace. Its children are unaffected: the rootless outer process
  makes itself dumpable again to enter its user namespace (it holds no secret: see above) and
  non-dumpable once init exists (launcher.rootless).
- The CA's key is made before the fork (the sandbox's trust needs its certificate at the build);
  the sandbox's init drops every privilege and is non-dumpable before the command exists, and the
  key signs for nothing but this sandbox's own trust.
"""

from __future__ import annotations

import os

from sandboxd.cli.environment_secrets import HeldSecret, take_from_environment
from sandboxd.errors import InvalidPolicy
from sandboxd.kernel import process
from sandboxd.launcher import trust_bundle
from sandboxd.policy.network import MAX_SECRET, CredentialSpec, check_secret, parse_credential

TYPE_CHECKING = False
if TYPE_CHECKING:
    from sandboxd.network.credentials import CredentialSet
    from sandboxd.network.interception.ca import SessionCA
    from sandboxd.network.interception.intercepted import Interceptor

class RunCredentials:
    """What `sandboxd run` made for its credentials before the fork: the specs, a phantom each, its
    CA, and where each secret comes from (a HeldSecret, or a file read after the fork)."""

    def __init__(self, specs: "tuple[CredentialSpec, ...]", files: "dict[str, str]",
                 held: "dict[str, HeldSecret]", ca: "SessionCA", bundle: str) -> None:
        from sandboxd.network.credentials import new_phantom

        self.specs, self.files, self.held, self.ca, self.bundle = specs, files, held, ca, bundle
        self.phantoms = {spec.name: new_phantom() for spec in specs}

    @property
    def policy_entries(self) -> "list[str]":
        return [spec.text() for spec in self.specs]

    @property
    def trust_pem(self) -> str:
        return self.ca.cert_pem().decode("ascii")

    def environment(self) -> "dict[str, str]":
        """What the command's environment gets over everything else: each VAR's phantom (so neither
        --pass-env VAR nor --env VAR=... passes a secret on) and the trust variables."""
        return {**trust_bundle.trust_environment(self.bundle), **self.phantoms}

    def credential_set(self) -> "CredentialSet":
        """The proxy's credentials, their secrets taken now: call after the sandbox's fork.
        InvalidPolicy naming the variable and file when a file cannot be read or holds no secret."""
        from sandboxd.network.credentials import Credential, CredentialSet, Secret

        credentials = []
        for spec in self.specs:
            value = self.held[spec.name].take() if spec.name in self.held else _read_secret_file(spec.name,
                                                                                                 self.files[spec.name])
            credentials.append(Credential(spec, Secret(check_secret(spec.name, value)), self.phantoms[spec.name]))
        return CredentialSet(credentials)

    def interceptor(self) -> "Interceptor":
        from sandboxd.network.interception.intercepted import Interceptor
        from sandboxd.network.interception.upstream_tls import upstream_context

        context = upstream_context()
        if os.environ.get("SSL_CERT_FILE"):
            # OpenSSL reads SSL_CERT_FILE instead of the host's bundle (its hashed directory stays,
            # where a distribution has one): the host's store is loaded too, so a corporate or test
            # CA adds to the public ones rather than replacing them.
            context.load_verify_locations(cafile=self.bundle)
        return Interceptor(self.ca, context)


def _read_secret_file(name: str, path: str) -> bytes:
    """A --credential-file's secret: the file's bytes without one trailing newline."""
    try:
        with open(path, "rb") as f:
            value = f.read(MAX_SECRET + 3)
    except OSError as exc:
        raise InvalidPolicy(f"--credential-file {name}={path}: {os.strerror(exc.errno or 0)}") from None
    return value[:-2] if value.endswith(b"\r\n") else value[:-1] if value.endswith(b"\n") else value


def prepare(credentials: "list[str]", files: "list[str]", *, intercepts: bool = False) -> "RunCredentials | None":
    """Before the fork: parse --credential and --credential-file, make this process non-dumpable,
    move the environment's secrets aside (see the module's text) and make the CA. ``intercepts``:
    there are endpoint rules (--allow-endpoint), whose hosts the proxy ends TLS for too. None when
    there is nothing to intercept. InvalidPolicy says what to fix."""
    if files and not credentials:
        raise InvalidPolicy("--credential-file gives the secret of a --credential: name it with --credential")
    if not credentials and not intercepts:
        return None
    specs = tuple(parse_credential(text) for text in credentials)
    names = [spec.name for spec in specs]
    for name in names:
        if names.count(name) > 1:
            raise InvalidPolicy(f"credential variable {name} is named twice: give each variable one upstream")
    by_name: dict[str, str] = {}
    for item in files:
        name, equals, path = item.partition("=")
        if not equals or not path:
            raise InvalidPolicy(f"--credential-file {item[:200]!r}: give VAR=PATH")
        if name not in names:
            raise InvalidPolicy(f"--credential-file {item[:200]!r}: no --credential names {name[:100]}")
        if not os.path.isfile(path):
            raise InvalidPolicy(f"--credential-file {item[:200]!r}: not a readable file")
        by_name[name] = os.path.abspath(path)
    bundle = trust_bundle.host_bundle_path()
    if bundle is None:
        raise InvalidPolicy("--credential needs the host's CA bundle (none of "
                            + ", ".join(trust_bundle.TRUST_BUNDLE_PATHS) + "): install the system's CA certificates")
    process.set_dumpable(False)
    held = {name: take_from_environment(name) for name in names if name not in by_name}
    from sandboxd.network.interception.ca import SessionCA

    return RunCredentials(specs, by_name, held, SessionCA.generate(f"run{os.getpid()}"), bundle)
