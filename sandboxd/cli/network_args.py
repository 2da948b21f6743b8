"""The network flags of the daemon's clients (`sandboxctl session create`, `sandboxctl session
policy`, `sandboxd mcp`): allowed domains and endpoints, what happens to an unlisted host, and
credentials whose secrets the client reads once and sends to the daemon (docs/networks.md).

``--credential VAR=https://HOST[:PORT][;HEADER: TEMPLATE | ;basic[:USER]]``: the secret is this
process's environment variable VAR, unless ``--credential-file VAR=PATH`` (the file's content,
one trailing newline dropped) or ``--daemon-credential VAR=NAME`` (the daemon's
``[network.secrets] NAME``) gives it. A secret is read once, sent in credential_secrets and never
printed: every message names the variable, never the value. One from the environment is taken
out of it, the process made non-dumpable first (cli.environment_secrets, as `sandboxd run`).

``parse_credentials`` is pure (no flags, no protobuf): `sandboxd run` may share it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from sandboxd.errors import InvalidPolicy
from sandboxd.policy.network import MAX_SECRET, check_secret, check_secret_name, parse_credential
from sandboxd.v1 import sandboxd_pb2 as pb


@dataclass(frozen=True)
class CredentialArgs:
    """Credentials as given: their specs (canonical text) and each one's secret: bytes read by
    the client, or the name of a daemon secret (str). A spec without a secret (``policy``: one the
    session may keep) is left out of ``secrets``."""

    specs: tuple[str, ...] = ()
    secrets: dict[str, "bytes | str"] = field(default_factory=dict)

    def __repr__(self) -> str:                       # never the secrets
        return f"CredentialArgs({self.specs!r}, {sorted(self.secrets)!r})"


def _pairs(flag: str, texts: "list[str]") -> dict[str, str]:
    pairs: dict[str, str] = {}
    for text in texts:
        name, equals, value = text.partition("=")
        if not equals or not name or not value:
            raise ValueError(f"{flag} {text!r}: give VAR=VALUE")
        if name in pairs:
            raise ValueError(f"{flag}: {name} is given twice")
        pairs[name] = value
    return pairs


def read_secret_file(name: str, path: str) -> bytes:
    """A --credential-file's secret: the file's bytes, one trailing newline dropped."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_SECRET + 3)
    except OSError as exc:
        raise ValueError(f"--credential-file {name}: cannot read {path!r} ({exc.strerror})") from None
    return data.removesuffix(b"\n").removesuffix(b"\r")


def parse_credentials(credentials: "list[str]", files: "list[str]", daemon: "list[str]",
                      environ: "Mapping[str, str | bytes]", *, secret_required: bool = True) -> CredentialArgs:
    """The --credential, --credential-file and --daemon-credential flags as specs and secrets.
    ``secret_required``: a credential whose variable is unset is an error (else it is sent
    without a secret: the session keeps the one it holds for the same spec). ValueError saying
    what to fix, naming variables, never values."""
    specs = []
    for text in credentials:
        try:
            specs.append(parse_credential(text))
        except InvalidPolicy as exc:
            raise ValueError(f"--credential: {exc}") from None
    names = [spec.name for spec in specs]
    for name in {name for name in names if names.count(name) > 1}:
        raise ValueError(f"--credential: {name} is named twice")
    from_files, from_daemon = _pairs("--credential-file", files), _pairs("--daemon-credential", daemon)
    for flag, given in (("--credential-file", from_files), ("--daemon-credential", from_daemon)):
        for name in given:
            if name not in names:
                raise ValueError(f"{flag} {name}: no --credential names {name} (give --credential "
                                 f"{name}=https://HOST first)")
    for name in set(from_files) & set(from_daemon):
        raise ValueError(f"{name}: give --credential-file or --daemon-credential, not both")
    secrets: dict[str, bytes | str] = {}
    for name in names:
        try:
            if name in from_daemon:
                secrets[name] = check_secret_name(from_daemon[name])
            elif name in from_files:
                secrets[name] = check_secret(name, read_secret_file(name, from_files[name]))
            elif name in environ:
                secrets[name] = check_secret(name, os.fsencode(environ[name]))
            elif secret_required:
                raise ValueError(f"--credential {name}: ${name} is not set: set it to the secret, or give "
                                 f"--credential-file {name}=PATH or --daemon-credential {name}=NAME")
        except InvalidPolicy as exc:
            raise ValueError(str(exc)) from None
    return CredentialArgs(tuple(spec.text() for spec in specs), secrets)


def add_network_options(parser: argparse.ArgumentParser) -> None:
    """The flags (interfaces.md spells them the same everywhere)."""
    group = parser.add_argument_group("network (an isolated network whose only way out is the egress proxy)")
    group.add_argument("--allow-domain", action="append", default=[], metavar="NAME",
                       help="a host name (or *.suffix) commands may reach through the proxy (repeatable)")
    group.add_argument("--allow-endpoint", action="append", default=[], metavar="HOST=METHOD[,...]:PATH-GLOB",
                       help="only these requests to HOST pass, its HTTPS read by the proxy (repeatable)")
    group.add_argument("--unlisted", choices=["refuse", "ask"], default=None,
                       help="a host the lists do not allow: refused (default), or held and asked as an approval")
    group.add_argument("--credential", action="append", default=[], metavar="VAR=https://HOST[:PORT][;...]",
                       help="VAR holds a phantom inside; the proxy puts in the secret (your $VAR, read once) for "
                            "that upstream only (';x-api-key: {}' or ';basic[:USER]' set how) (repeatable)")
    group.add_argument("--credential-file", action="append", default=[], metavar="VAR=PATH",
                       help="the secret of --credential VAR is PATH's content instead (repeatable)")
    group.add_argument("--daemon-credential", action="append", default=[], metavar="VAR=NAME",
                       help="the secret of --credential VAR is the daemon's [network.secrets] NAME (repeatable)")


def given(args: argparse.Namespace) -> bool:
    """Whether any network flag was given."""
    return bool(args.allow_domain or args.allow_endpoint or args.unlisted or args.credential
                or args.credential_file or args.daemon_credential)


def credentials_from_args(args: argparse.Namespace, environ: "Mapping[str, str | bytes] | None" = None, *,
                          secret_required: bool = True) -> CredentialArgs:
    """The credential flags' specs and secrets; without ``environ``, each secret from this
    process's environment is taken out of it (cli.environment_secrets: the process made
    non-dumpable first, the environment's copies zeroed), so the user's other processes cannot
    read it from a long-lived client (`sandboxd mcp`)."""
    if environ is None:
        environ = _taken_from_environment(args)
    return parse_credentials(args.credential, args.credential_file, args.daemon_credential, environ,
                             secret_required=secret_required)


def _taken_from_environment(args: argparse.Namespace) -> dict[str, bytes]:
    """The secrets of the --credential variables no file or daemon secret gives, taken out of
    this process's environment (those set)."""
    from sandboxd.cli.environment_secrets import take_secrets

    names = set()
    for text in args.credential:
        try:
            names.add(parse_credential(text).name)
        except InvalidPolicy:
            continue                                # parse_credentials says what to fix
    names -= {text.partition("=")[0] for text in (*args.credential_file, *args.daemon_credential)}
    try:
        return take_secrets(sorted(names))
    except InvalidPolicy as exc:
        raise ValueError(str(exc)) from None


def apply_network(policy: pb.SandboxPolicy, args: argparse.Namespace, credentials: CredentialArgs) -> None:
    """Put the flags in ``policy`` (an isolated network when any is given). Each list given
    replaces that list; a list not given stays as it is in ``policy``."""
    if not given(args):
        return
    policy.network_access = True
    policy.network_mode = "isolated"
    for flag, name in ((args.allow_domain, "allowed_domains"), (args.allow_endpoint, "allowed_endpoints"),
                       (list(credentials.specs), "credentials")):
        if flag:
            del getattr(policy, name)[:]
            getattr(policy, name).extend(flag)
    if args.unlisted:
        policy.unlisted = args.unlisted


def secrets_proto(credentials: CredentialArgs) -> dict[str, pb.CredentialSecret]:
    return {name: pb.CredentialSecret(daemon_secret=value) if isinstance(value, str) else
            pb.CredentialSecret(value=value) for name, value in credentials.secrets.items()}


def credential_states_line(session: pb.Session) -> str:
    """``VAR→upstream (source[, unusable])`` for each credential, printable; "" when none."""
    from sandboxd.printable import printable

    parts = [f"{printable(state.name)}->{printable(state.upstream)} ({printable(state.source)}"
             f"{'' if state.usable else ', secret lost: send it again'})" for state in session.credential_states]
    return "credentials: " + ", ".join(parts) if parts else ""
