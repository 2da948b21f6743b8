"""Between the wire (sandboxd.v1 messages) and the policy model. Pure: no OS calls."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping

from sandboxd.defaults import NETWORK_MODE
from sandboxd.errors import InvalidPolicy
from sandboxd.policy import DEFAULT_PROTECTED_SUBPATHS, Limits, SandboxPolicy, policy_from_name
from sandboxd.policy.sandbox import SandboxMode
from sandboxd.policy.decision import ApprovalPolicy, PermissionMode, ToolRules, axes_for
from sandboxd.policy.network import (
    CredentialState,
    DaemonSecret,
    check_secret,
    check_secret_name,
    check_secrets_match,
)
from sandboxd.policy.session_defaults import SessionDefaults
from sandboxd.policy.limits import (DEFAULT_TMP_SIZE, MAX_LABEL_KEY, MAX_LABEL_VALUE, MAX_LABELS, PATH_MAX, check_count,
                                    check_timeout)
from sandboxd.v1 import sandboxd_pb2 as pb

_MODE_NAMES = {pb.SandboxPolicy.READ_ONLY: SandboxMode.READ_ONLY,
               pb.SandboxPolicy.WORKSPACE_WRITE: SandboxMode.WORKSPACE_WRITE,
               pb.SandboxPolicy.MODE_UNSPECIFIED: SandboxMode.WORKSPACE_WRITE,
               pb.SandboxPolicy.DANGER_FULL_ACCESS: SandboxMode.DANGER_FULL_ACCESS}
_MODES = {SandboxMode.READ_ONLY: pb.SandboxPolicy.READ_ONLY,
          SandboxMode.WORKSPACE_WRITE: pb.SandboxPolicy.WORKSPACE_WRITE,
          SandboxMode.DANGER_FULL_ACCESS: pb.SandboxPolicy.DANGER_FULL_ACCESS}
APPROVAL_NAMES = {pb.NEVER: ApprovalPolicy.NEVER, pb.ON_REQUEST: ApprovalPolicy.ON_REQUEST,
                  pb.ALWAYS: ApprovalPolicy.ALWAYS, pb.APPROVAL_POLICY_UNSPECIFIED: ApprovalPolicy.ON_REQUEST}
_APPROVALS = {ApprovalPolicy.NEVER: pb.NEVER, ApprovalPolicy.ON_REQUEST: pb.ON_REQUEST,
              ApprovalPolicy.ALWAYS: pb.ALWAYS}


NAME_MAX = 255
NAME_LIMIT = 1024                   # host and domain names, socket names in policies
ENTRY_LIMIT = 2048                  # an endpoint rule: a host name and a path glob of 1024 (policy.network)


def check_path(path: str, what: str = "path") -> str:
    """A path the kernel can take: no NUL byte, shorter than PATH_MAX, no name above NAME_MAX."""
    if "\0" in path:
        raise InvalidPolicy(f"{what} may not contain NUL bytes")
    encoded = os.fsencode(path)
    if len(encoded) >= PATH_MAX:
        raise InvalidPolicy(f"{what} is {len(encoded)} bytes long: the kernel takes paths below {PATH_MAX} bytes")
    if any(len(name) > NAME_MAX for name in encoded.split(b"/")):
        raise InvalidPolicy(f"{what} has a name longer than {NAME_MAX} bytes, which no Linux file system takes")
    return path


def check_text(text: str, what: str, limit: int = NAME_LIMIT) -> str:
    """A short string for the kernel or a resolver: no NUL byte, at most ``limit`` characters."""
    if "\0" in text:
        raise InvalidPolicy(f"{what} may not contain NUL bytes")
    if len(text) > limit:
        raise InvalidPolicy(f"{what} is {len(text)} characters long: give at most {limit}")
    return text


def check_finite(value: float, what: str) -> float:
    """A time or other float field: NaN and infinities refused, negatives too."""
    if not math.isfinite(value) or value < 0:
        raise InvalidPolicy(f"{what} must be a finite number, 0 or more; got {value!r}")
    return value


def policy_from_proto(message: pb.SandboxPolicy, defaults: SessionDefaults | None = None) -> SandboxPolicy:
    name = _MODE_NAMES.get(message.mode)
    network = message.network_access
    if message.mode == pb.SandboxPolicy.MODE_UNSPECIFIED and defaults is not None:
        name = defaults.sandbox
        network = network or (defaults.network_access and name is SandboxMode.WORKSPACE_WRITE)
    if name is None:
        raise InvalidPolicy(f"unknown sandbox policy mode {message.mode}: use READ_ONLY, WORKSPACE_WRITE "
                            "or DANGER_FULL_ACCESS")
    for root in message.writable_roots:
        check_path(root, "a writable root")
    for sub in message.protected_subpaths:
        check_path(sub, "a protected subpath")
    for socket_path in message.allowed_unix_sockets:
        check_path(socket_path, "an allowed Unix socket")
    for field in ("allowed_hosts", "published_ports", "allowed_domains", "allowed_endpoints", "credentials"):
        for entry in getattr(message, field):
            check_text(entry, f"an entry of {field}", ENTRY_LIMIT if field == "allowed_endpoints" else NAME_LIMIT)
    check_text(message.network_mode, "network_mode")
    check_text(message.unlisted, "unlisted")
    protected = tuple(message.protected_subpaths)
    if not message.no_default_protected_subpaths:
        protected = tuple(dict.fromkeys(DEFAULT_PROTECTED_SUBPATHS + protected))
    return policy_from_name(name, network_access=network,
                            writable_roots=list(message.writable_roots), protected_subpaths=protected,
                            network_mode=message.network_mode or NETWORK_MODE,
                            allowed_unix_sockets=list(message.allowed_unix_sockets),
                            allowed_hosts=list(message.allowed_hosts), published_ports=list(message.published_ports),
                            allowed_domains=list(message.allowed_domains),
                            allowed_endpoints=list(message.allowed_endpoints), unlisted=message.unlisted,
                            credentials=list(message.credentials), hide_home=message.hide_home)


def policy_to_proto(policy: SandboxPolicy) -> pb.SandboxPolicy:
    return pb.SandboxPolicy(mode=_MODES[policy.name], network_access=bool(policy.network_access),
                            writable_roots=list(policy.writable_roots),
                            protected_subpaths=list(policy.protected_subpaths),
                            network_mode=str(policy.network_mode) if policy.workspace_writable and policy.network_access
                            else "",
                            allowed_unix_sockets=list(policy.allowed_unix_sockets),
                            allowed_hosts=list(policy.allowed_hosts), published_ports=list(policy.published_ports),
                            allowed_domains=list(policy.allowed_domains),
                            allowed_endpoints=list(policy.allowed_endpoints),
                            unlisted="" if policy.unlisted == "refuse" else str(policy.unlisted),
                            credentials=list(policy.credentials), hide_home=policy.hide_home,
                            no_default_protected_subpaths=True)


def credential_secrets_from_proto(secrets: Mapping[str, pb.CredentialSecret], policy: SandboxPolicy,
                                  known: frozenset[str] = frozenset()) -> dict[str, bytes | DaemonSecret]:
    """The secrets of ``policy``'s credentials (CreateSessionRequest / UpdateSessionPolicyRequest
    .credential_secrets), checked: one for each credential not in ``known`` (those the session
    holds already), none for a variable no credential names, each a caller's bytes a header can
    carry or a daemon secret's name. Whether the caller may use that daemon secret is the
    service's to say. InvalidPolicy naming the variable, never a secret's value."""
    specs = policy.network_rules.credentials
    check_count("credential_secrets", secrets, len(specs))
    check_secrets_match(specs, secrets, known)
    checked: dict[str, bytes | DaemonSecret] = {}
    for name, secret in secrets.items():
        source = secret.WhichOneof("source")
        if source == "value":
            checked[name] = check_secret(name, secret.value)
        elif source == "daemon_secret":
            checked[name] = DaemonSecret(check_secret_name(secret.daemon_secret))
        else:
            raise InvalidPolicy(f"the secret of {name} is empty: give its value or a daemon_secret")
    return checked


def credential_states_to_proto(states: Iterable[CredentialState]) -> list[pb.CredentialState]:
    return [pb.CredentialState(name=state.name, upstream=state.upstream, source=state.source, usable=state.usable)
            for state in states]


def approval_from_proto(value: pb.ApprovalPolicy) -> ApprovalPolicy:
    if value not in APPROVAL_NAMES:
        raise InvalidPolicy(f"unknown approval policy {value}: use NEVER, ON_REQUEST or ALWAYS")
    return APPROVAL_NAMES[value]


def approval_to_proto(approval: ApprovalPolicy) -> pb.ApprovalPolicy:
    return _APPROVALS[approval]


def labels_from_proto(labels: Mapping[str, str]) -> dict[str, str]:
    """A session's labels: at most MAX_LABELS, each key and value a short string."""
    check_count("labels", labels, MAX_LABELS)
    for key, value in labels.items():
        check_text(key, "a label key", MAX_LABEL_KEY)
        check_text(value, f"the value of label {key[:100]!r}", MAX_LABEL_VALUE)
    return dict(labels)


def limits_from_proto(message: pb.Limits, defaults: SessionDefaults | None = None) -> Limits:
    defaults = defaults or SessionDefaults()
    timeout = check_timeout(message.timeout_seconds, "limits.timeout_seconds") if message.timeout_seconds else None
    for name, asked, most, key in (("memory_bytes", message.memory_bytes, defaults.max_memory_bytes, "max_memory"),
                                   ("pids", message.pids, defaults.max_pids, "max_pids")):
        if most is not None and asked > most:
            raise InvalidPolicy(f"limits.{name} {asked} is above this daemon's maximum of {most} (its "
                                f"limits.{key} setting): ask for at most {most}, or leave it unset for the default")
    return Limits(timeout_seconds=timeout or defaults.timeout_seconds,
                  memory_bytes=int(message.memory_bytes) or defaults.memory_bytes,
                  pids=int(message.pids) or defaults.pids,
                  cpu_seconds=int(message.cpu_seconds) or None, open_files=int(message.open_files) or None,
                  tmp_size_bytes=int(message.tmp_size_bytes) or DEFAULT_TMP_SIZE,
                  total_pids=defaults.total_pids, total_memory_bytes=defaults.total_memory_bytes,
                  owner_pids=defaults.owner_pids, owner_memory_bytes=defaults.owner_memory_bytes,
                  ptys=defaults.ptys)


def limits_to_proto(limits: Limits) -> pb.Limits:
    return pb.Limits(timeout_seconds=limits.timeout_seconds or 0, memory_bytes=limits.memory_bytes or 0,
                     pids=limits.pids or 0, cpu_seconds=limits.cpu_seconds or 0, open_files=limits.open_files or 0,
                     tmp_size_bytes=limits.tmp_size_bytes)


def axes_from_create_request(
        request: pb.CreateSessionRequest,
        defaults: SessionDefaults | None = None) -> tuple[SandboxPolicy, ApprovalPolicy, ToolRules]:
    """The two axes (and a permission mode's tool rules) a CreateSession asks for. Single-axis
    clients send permission_mode, or the older allow_shell / allow_file_write, which win when
    both styles are sent (a missing one of the two counts as false)."""
    legacy = request.HasField("allow_shell") or request.HasField("allow_file_write")
    if legacy or request.permission_mode:
        mode = (PermissionMode.from_legacy(request.allow_shell, request.allow_file_write) if legacy
                else PermissionMode.parse(request.permission_mode))
        policy, approval, rules = axes_for(mode, network_access=request.sandbox_policy.network_access)
        # A mode's sandbox is always confined: the home is hidden in it when asked.
        return policy.replace(hide_home=request.sandbox_policy.hide_home), approval, rules
    approval = (defaults.approval if defaults is not None and request.approval_policy == pb.APPROVAL_POLICY_UNSPECIFIED
                else approval_from_proto(request.approval_policy))
    return policy_from_proto(request.sandbox_policy, defaults), approval, ToolRules()
