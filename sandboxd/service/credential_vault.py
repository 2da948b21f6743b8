"""The daemon's credential secrets, per session: what a session's proxy puts in for its phantoms.

A session's credentials (SandboxPolicy.credentials: only the public spec) get their secrets from
the caller (CreateSessionRequest / UpdateSessionPolicyRequest.credential_secrets: bytes it read
once, or the name of a daemon secret, ``[network.secrets] NAME``). The secrets live only here, in
the daemon's memory, as network.credentials.Secret: never in the store, an event, a record or an
error. They are wiped on every path a session ends by (close, expiry, a failed create, its owner's
process gone: all go through SessionLifecycle's close or create) and when replaced.

After a daemon restart a caller's secret is gone: the session keeps working, its credential shows
``usable = false`` (CredentialState) until the owner sends the secret again (UpdateSessionPolicy).
A daemon secret is read again from its file (the store keeps which NAME a variable used).

Rules (hostile callers):
- A secret kept across an UpdateSessionPolicy follows the whole credential spec, not the variable:
  re-pointing VAR to another upstream, header or format needs a new secret (``known_names``).
- Only the session's owner gives its secrets: an administrator changing another owner's session
  may keep or drop its credentials, never put its own secret (or daemon secret) in.
- A daemon secret is used only by root and the users and groups its entry names, and only for the
  upstreams its entry names (and its injection, when the entry fixes one). Group membership is
  the owner's now (the group database), checked at every use: create, each UpdateSessionPolicy
  (a kept daemon secret of an owner taken out of the group stays as a phantom, not usable) and
  restore.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping

from sandboxd.config.settings import SecretSource
from sandboxd.errors import Forbidden, InvalidPolicy
from sandboxd.network.credentials import Credential, CredentialSet, Secret, new_phantom
from sandboxd.policy.network import (DEFAULT_HEADER, DEFAULT_TEMPLATE, MAX_SECRET, CredentialSpec, CredentialState,
                                     DaemonSecret, check_secret)
from sandboxd.service.callers import Caller
from sandboxd.service.sessions.access import current_groups

# How a daemon secret whose entry sets no ``inject`` is sent: (header, template, basic user).
DEFAULT_INJECTION = (DEFAULT_HEADER, DEFAULT_TEMPLATE, None)

CALLER_SOURCE = "caller"
DAEMON_SOURCE = "daemon:"


class Held:
    """One credential of a session as the daemon holds it. ``secret`` is None when it was a
    caller's and the daemon restarted since (or a daemon secret that could not be read)."""

    __slots__ = ("spec", "phantom", "secret", "source")

    def __init__(self, spec: CredentialSpec, phantom: str, secret: Secret | None, source: str) -> None:
        self.spec, self.phantom, self.secret, self.source = spec, phantom, secret, source

    def __repr__(self) -> str:
        return f"Held({self.spec.text()!r}, {self.source!r}, usable={self.secret is not None})"


class SessionCredentials:
    """One session's credentials: an immutable snapshot, replaced whole by a change (``replace``),
    so a proxy's CredentialSet and the sandbox's phantoms always come from one version."""

    __slots__ = ("held",)

    def __init__(self, held: "Iterable[Held]" = ()) -> None:
        self.held: dict[str, Held] = {h.spec.name: h for h in held}

    def __repr__(self) -> str:
        return f"SessionCredentials({sorted(self.held)})"

    def credential_set(self) -> CredentialSet:
        """What the proxy swaps: the credentials whose secret the daemon holds."""
        return CredentialSet([Credential(h.spec, h.secret, h.phantom) for h in self.held.values()
                              if h.secret is not None])

    def phantoms(self) -> dict[str, str]:
        """VAR = phantom, for the sandbox's environment (every credential, usable or not: the
        sandbox's commands see the same variables whatever the daemon holds)."""
        return {name: h.phantom for name, h in self.held.items()}

    def states(self) -> list[CredentialState]:
        return [CredentialState(name=name, upstream=h.spec.upstream, source=h.source, usable=h.secret is not None)
                for name, h in sorted(self.held.items())]

    def daemon_sources(self) -> dict[str, str]:
        """VAR = NAME of each credential whose secret is a daemon secret (what the store keeps)."""
        return {name: h.source[len(DAEMON_SOURCE):] for name, h in self.held.items()
                if h.source.startswith(DAEMON_SOURCE)}

    def known_names(self, specs: "Iterable[CredentialSpec]") -> frozenset[str]:
        """The variables of ``specs`` whose secret may be kept: those held for exactly the same spec
        (upstream, header, format). A re-pointed variable needs its secret again."""
        return frozenset(spec.name for spec in specs if spec.name in self.held and self.held[spec.name].spec == spec)

    def wipe(self) -> None:
        for held in self.held.values():
            if held.secret is not None:
                held.secret.wipe()

    def wipe_unused(self, kept: "SessionCredentials") -> None:
        """Wipe the secrets of this (replaced) version that ``kept`` does not hold any more."""
        still = {id(h.secret) for h in kept.held.values()}
        for held in self.held.values():
            if held.secret is not None and id(held.secret) not in still:
                held.secret.wipe()


class CredentialVault:
    """Turns a policy's credential specs and the secrets a caller sent into a SessionCredentials,
    judging who may give what (the module's rules); reads daemon secrets."""

    def __init__(self, secrets: "Mapping[str, SecretSource] | None" = None) -> None:
        self._secrets = dict(secrets or {})    # network.secrets, as loaded at start

    def resolve(self, caller: Caller, owner: Caller, current: SessionCredentials | None,
                specs: "Iterable[CredentialSpec]", given: "Mapping[str, bytes | DaemonSecret]") -> SessionCredentials:
        """The session's credentials for ``specs``: each given secret taken (checked), each
        unchanged one kept, a re-pointed one without a new secret refused. Nothing of
        ``current`` is changed or wiped (the caller wipes what the new version drops, once it
        took effect). Secrets read here that end up unused are wiped on failure."""
        specs = tuple(specs)
        if given and (caller.uid, caller.principal) != (owner.uid, owner.principal):
            raise Forbidden("only the session's owner gives its credentials' secrets: an administrator may keep or "
                            "remove them, not put its own in (ask the owner to send them)")
        current = current or SessionCredentials()
        made: list[Secret] = []
        try:
            held: list[Held] = []
            for spec in specs:
                old = current.held.get(spec.name)
                same = old is not None and old.spec == spec
                if spec.name not in given:
                    if not same:
                        raise InvalidPolicy(f"credential {spec.name} changes its upstream, header or format: send its "
                                            "secret again (a kept secret follows the whole credential)")
                    assert old is not None
                    held.append(old if self._still_granted(owner, old) else
                                Held(old.spec, old.phantom, None, old.source))    # kept, not usable
                    continue
                value = given[spec.name]
                if isinstance(value, DaemonSecret):
                    secret = self._daemon_secret(owner, value.name, spec)
                    source = DAEMON_SOURCE + value.name
                else:
                    secret, source = Secret(check_secret(spec.name, bytes(value))), CALLER_SOURCE
                made.append(secret)
                held.append(Held(spec, old.phantom if same and old is not None else new_phantom(), secret, source))
            return SessionCredentials(held)
        except BaseException:
            for secret in made:
                secret.wipe()
            raise

    def restored(self, owner: Caller, specs: "Iterable[CredentialSpec]",
                 daemon_sources: "Mapping[str, str]") -> SessionCredentials:
        """A session resumed after a daemon restart: its daemon secrets read again (when the owner
        may still use them), every caller's secret lost (``usable`` false)."""
        held = []
        for spec in specs:
            name, secret = daemon_sources.get(spec.name), None
            if name is not None:
                try:
                    secret = self._daemon_secret(owner, name, spec)
                except (InvalidPolicy, Forbidden):
                    secret = None
            held.append(Held(spec, new_phantom(), secret,
                             DAEMON_SOURCE + name if name is not None else CALLER_SOURCE))
        return SessionCredentials(held)

    def _still_granted(self, owner: Caller, held: Held) -> bool:
        """Whether a kept credential's secret may stay: a caller's always (its owner gave it), a
        daemon secret while its entry still grants it to the owner as the owner is now (taken out
        of its group, the owner keeps the credential's phantom, not the secret)."""
        if not held.source.startswith(DAEMON_SOURCE) or held.secret is None:
            return True
        source = self._secrets.get(held.source[len(DAEMON_SOURCE):])
        return source is not None and may_use(owner, source)

    def _daemon_secret(self, owner: Caller, name: str, spec: CredentialSpec) -> Secret:
        source = self._secrets.get(name)
        if source is None or not may_use(owner, source):
            # The same answer for a name that does not exist: a user learns nothing of the others.
            raise Forbidden(f"daemon secret {name!r} does not exist or is not granted to this session's owner "
                            "(network.secrets: users, groups)")
        upstream = (spec.host, spec.port)
        if upstream not in source.upstreams:
            allowed = ", ".join(f"https://{host}:{port}" for host, port in source.upstreams)
            raise InvalidPolicy(f"daemon secret {name!r} is only for {allowed}, not {spec.upstream} "
                                f"(credential {spec.name})")
        # Without ``inject`` the default header only: a header the user picks could be one the
        # upstream reflects or logs (an echo of X-Debug: SECRET), and the secret is root's, not theirs.
        inject = source.inject if source.inject is not None else DEFAULT_INJECTION
        if inject != (spec.header, spec.template, spec.basic_user):
            raise InvalidPolicy(f"daemon secret {name!r} is sent only as its configuration says "
                                f"(network.secrets.{name}.inject, else {DEFAULT_HEADER}: {DEFAULT_TEMPLATE}): "
                                f"credential {spec.name} must use that header")
        return Secret(read_secret_file(name, source.file))


def may_use(owner: Caller, source: SecretSource) -> bool:
    """Root, or a user the entry names, or a member now of a group it names: the owner's groups
    as the group database says at this use (create, update, restore), not as its connection
    carried them when the session was created (a user taken out of the group loses the secret
    at the session's next change)."""
    if owner.principal:
        return False                        # a TLS principal or a pod is no local user an entry can name
    if owner.uid == 0 or owner.uid in source.uids:
        return True
    return bool(current_groups(owner) & set(source.gids))


def read_secret_file(name: str, path: str) -> bytes:
    """A daemon secret's bytes: a regular file of root's that only root may read or change (0600
    or narrower), not a symlink; its trailing newline dropped. InvalidPolicy naming the secret
    (never its content: a failure says only what is wrong with the file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise InvalidPolicy(f"daemon secret {name!r}: its file cannot be opened ({exc.strerror}): the daemon's "
                            "administrator must fix network.secrets") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o077:
            raise InvalidPolicy(f"daemon secret {name!r}: its file must be a regular file of root's, mode 0600: "
                                "the daemon's administrator must fix it")
        data = os.read(fd, MAX_SECRET + 2)
    finally:
        os.close(fd)
    if data.endswith(b"\n"):
        data = data[:-1]
    if data.endswith(b"\r"):
        data = data[:-1]
    value = bytearray(data)
    try:
        check_secret(f"daemon secret {name!r}", bytes(value))
    except InvalidPolicy as exc:
        raise InvalidPolicy(f"{exc} (the daemon's administrator must fix its file)") from None
    return bytes(value)


__all__ = ["CredentialVault", "Held", "SessionCredentials", "may_use", "read_secret_file"]
