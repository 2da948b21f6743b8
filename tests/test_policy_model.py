"""Pure unit tests of the policy model (``sandboxd.policy``): no OS calls, no sandbox."""

from __future__ import annotations

import json
import re

import pytest

from sandboxd.errors import InvalidPolicy
from sandboxd.policy import (
    DEFAULT_PROTECTED_SUBPATHS,
    DangerFullAccess,
    LaunchSpec,
    Limits,
    ReadOnly,
    WorkspaceWrite,
    default_policy,
    parse_size,
    policy_from_name,
    validate_policy,
)
from sandboxd.policy.decision import ApprovalPolicy, approval_policy
from sandboxd.policy.sandbox import NetworkMode, SandboxMode, SandboxPolicy

# --------------------------------------------------------------------------- policy names


@pytest.mark.parametrize("name, kind", [
    ("read-only", ReadOnly), ("read_only", ReadOnly), ("readonly", ReadOnly), ("READ-ONLY", ReadOnly),
    (" read-only ", ReadOnly),
    ("workspace-write", WorkspaceWrite), ("workspace_write", WorkspaceWrite), ("auto", WorkspaceWrite),
    ("danger-full-access", DangerFullAccess), ("danger_full_access", DangerFullAccess), ("full", DangerFullAccess),
])
def test_policy_from_name_accepts_aliases(name: str, kind: type) -> None:
    """Every documented spelling maps to its policy class."""
    assert isinstance(policy_from_name(name), kind)


@pytest.mark.parametrize("name", ["", "bogus", "read", "write", "danger", "workspace", "none"])
def test_policy_from_name_rejects_unknown(name: str) -> None:
    """Unknown names raise InvalidPolicy listing the valid names."""
    with pytest.raises(InvalidPolicy, match="read-only, workspace-write, danger-full-access"):
        policy_from_name(name)


def test_invalid_policy_is_a_value_error() -> None:
    """InvalidPolicy is catchable as ValueError (callers validating input rely on that)."""
    assert issubclass(InvalidPolicy, ValueError)


def test_default_policy_is_workspace_write_without_network() -> None:
    """The default is WorkspaceWrite, no network, no extra roots, default protections."""
    policy = default_policy()
    assert policy == WorkspaceWrite()
    assert policy.network_access is False
    assert policy.writable_roots == ()
    assert policy.protected_subpaths == DEFAULT_PROTECTED_SUBPATHS == (".git/hooks", ".git/config")


def test_policy_names_and_network_flags() -> None:
    """Each policy reports its wire name and whether it has network."""
    assert ReadOnly().name == "read-only" and ReadOnly().network_access is False
    assert DangerFullAccess().name == "danger-full-access" and DangerFullAccess().network_access is True
    assert WorkspaceWrite(network_access=True).name == "workspace-write"
    assert WorkspaceWrite(network_access=True).network_access is True


def test_read_only_refuses_network_and_roots() -> None:
    """read-only cannot be combined with network access or writable roots."""
    with pytest.raises(InvalidPolicy, match="network"):
        policy_from_name("read-only", network_access=True)
    with pytest.raises(InvalidPolicy, match="writable roots"):
        policy_from_name("read-only", writable_roots=["/var/tmp"])


def test_workspace_write_from_name_carries_options() -> None:
    """Network, roots and protected subpaths given by name end up in the policy."""
    policy = policy_from_name("workspace-write", network_access=True, writable_roots=["/var/tmp/a"],
                              protected_subpaths=["secrets"])
    assert policy == WorkspaceWrite(network_access=True, writable_roots=("/var/tmp/a",),
                                    protected_subpaths=("secrets",))
    assert policy_from_name("workspace-write").protected_subpaths == DEFAULT_PROTECTED_SUBPATHS
    assert policy_from_name("workspace-write", protected_subpaths=[]).protected_subpaths == ()


def test_workspace_write_is_immutable_and_hashable() -> None:
    """Lists given by callers become tuples; the policy is frozen and hashable."""
    policy = WorkspaceWrite(writable_roots=["/a"], protected_subpaths=["x"])  # type: ignore[arg-type]
    assert policy.writable_roots == ("/a",) and policy.protected_subpaths == ("x",)
    hash(policy)
    with pytest.raises(AttributeError):
        policy.network_access = True  # type: ignore[misc]


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("root, message", [
    ("relative/dir", "relative"),
    ("", "non-empty"),
    ("/", "whole host"),
    ("//", "whole host"),
    ("/./", "whole host"),
    ("/var/..", "whole host"),
    ("/proc", "/proc"),
    ("/proc/self/root", "/proc"),
    ("/sys", "/sys"),
    ("/sys/fs/cgroup", "/sys"),
    ("/dev", "/dev"),
    ("/dev/shm", "/dev"),
    ("/tmp/../proc/1", "/proc"),
    ("/var/tmp/a\0b", "NUL"),
])
def test_validate_rejects_bad_writable_roots(root: str, message: str) -> None:
    """Relative roots, '/', kernel filesystems and NUL bytes are refused with a clear reason."""
    with pytest.raises(InvalidPolicy, match=re.escape(message)):
        validate_policy(WorkspaceWrite(writable_roots=(root,)))


@pytest.mark.parametrize("root", ["/var/tmp/x", "/tmp/build", "/procfoo", "/system", "/device", "/home/u/proj"])
def test_validate_accepts_ordinary_roots(root: str) -> None:
    """Roots that merely share a prefix with /proc, /sys, /dev are fine."""
    validate_policy(WorkspaceWrite(writable_roots=(root,)))


@pytest.mark.parametrize("sub", ["", "/abs/path", "../escape", "a/../../b", ".."])
def test_validate_rejects_bad_protected_subpaths(sub: str) -> None:
    """Protected subpaths must be relative, non-empty and free of '..'."""
    with pytest.raises(InvalidPolicy, match="protected subpath"):
        validate_policy(WorkspaceWrite(protected_subpaths=(sub,)))


def test_validate_rejects_non_policies() -> None:
    """Anything but the three policy classes is refused."""
    with pytest.raises(InvalidPolicy, match="not a sandbox policy"):
        validate_policy("workspace-write")  # type: ignore[arg-type]


def test_policy_from_name_validates_roots() -> None:
    """policy_from_name runs the same validation as validate_policy."""
    with pytest.raises(InvalidPolicy, match="relative"):
        policy_from_name("workspace-write", writable_roots=["rel"])
    with pytest.raises(InvalidPolicy, match="/proc"):
        policy_from_name("workspace-write", writable_roots=["/proc"])


# --------------------------------------------------------------------------- sizes and limits


@pytest.mark.parametrize("text, value", [
    ("100", 100), ("1", 1), ("512K", 512 << 10), ("512k", 512 << 10), ("64M", 64 << 20), ("64m", 64 << 20),
    ("2G", 2 << 30), ("1T", 1 << 40), ("64MB", 64 << 20), ("64MiB", 64 << 20), (" 8M ", 8 << 20),
    (4096, 4096),
])
def test_parse_size_accepts(text: str | int, value: int) -> None:
    """Plain bytes and K/M/G/T suffixes (binary multiples) parse to bytes."""
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "12X", "1.5G", "-5", "M", "0", "0M", 0, -1, "1e6"])
def test_parse_size_rejects(text: str | int) -> None:
    """Garbage, fractions, negatives and zero are refused with InvalidPolicy."""
    with pytest.raises(InvalidPolicy):
        parse_size(text)


def test_parse_size_error_names_the_option() -> None:
    """The error message names what was being parsed."""
    with pytest.raises(InvalidPolicy, match="--memory"):
        parse_size("lots", "--memory")


def test_limits_defaults() -> None:
    """No limits by default except the 512M /tmp."""
    limits = Limits()
    assert (limits.timeout_seconds, limits.memory_bytes, limits.pids, limits.cpu_seconds, limits.open_files) == (
        None, None, None, None, None)
    assert limits.tmp_size_bytes == 512 << 20


@pytest.mark.parametrize("kwargs", [
    {"timeout_seconds": 0}, {"timeout_seconds": -1.5}, {"memory_bytes": 0}, {"memory_bytes": 1 << 20},
    {"pids": 0}, {"pids": -3}, {"cpu_seconds": 0}, {"open_files": 0}, {"open_files": 15},
    {"tmp_size_bytes": 0}, {"tmp_size_bytes": -1},
])
def test_limits_reject_bad_values(kwargs: dict[str, float]) -> None:
    """Zero/negative limits, memory below 4M and open files below 16 are refused."""
    with pytest.raises(InvalidPolicy):
        Limits(**kwargs)  # type: ignore[arg-type]


def test_limits_accept_minimums() -> None:
    """The smallest sensible limits are accepted."""
    limits = Limits(timeout_seconds=0.1, memory_bytes=4 << 20, pids=1, cpu_seconds=1, open_files=16,
                    tmp_size_bytes=1)
    assert limits.memory_bytes == 4 << 20 and limits.open_files == 16


# --------------------------------------------------------------------------- LaunchSpec


def test_launch_spec_defaults() -> None:
    """A minimal spec gets the default policy and limits and turns argv into a tuple."""
    spec = LaunchSpec(argv=["true"], workspace="/var/tmp")  # type: ignore[arg-type]
    assert spec.argv == ("true",)
    assert spec.policy == WorkspaceWrite() and spec.limits == Limits()
    assert spec.cwd is None and spec.user is None and spec.env == {}


@pytest.mark.parametrize("kwargs, message", [
    ({"argv": ()}, "no program"),
    ({"argv": ("",)}, "no program"),
    ({"argv": ("echo", "a\0b")}, "NUL"),
    ({"workspace": "relative"}, "absolute"),
    ({"cwd": "relative"}, "absolute"),
    ({"env": {"": "x"}}, "environment"),
    ({"env": {"A=B": "x"}}, "environment"),
    ({"env": {"A": "x\0y"}}, "environment"),
    ({"user": (-1, 0)}, "user"),
    ({"user": (0, -1)}, "user"),
    ({"policy": WorkspaceWrite(writable_roots=("/",))}, "whole host"),
    ({"owner": "../../pids"}, "owner"),             # it names a cgroup: nothing that climbs or nests
    ({"owner": "uid-1/run-1"}, "owner"),
    ({"owner": "UID-1"}, "owner"),
    ({"owner": "-x"}, "owner"),
    ({"owner": "a" * 65}, "owner"),
])
def test_launch_spec_rejects_bad_input(kwargs: dict[str, object], message: str) -> None:
    """Bad argv, paths, env names, users and policies raise InvalidPolicy."""
    base: dict[str, object] = {"argv": ("true",), "workspace": "/var/tmp"}
    base.update(kwargs)
    with pytest.raises(InvalidPolicy, match=message):
        LaunchSpec(**base)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- modes and derived values


def test_the_modes_are_closed_choices() -> None:
    """The policy's modes are choices (a str each, so they compare and encode as their names): parse
    gives the member, anything else is refused naming the choices, and what the model holds is
    always a member, whatever text it was given."""
    assert SandboxMode.parse("read-only") is SandboxMode.READ_ONLY and SandboxMode.all() == (
        "read-only", "workspace-write", "danger-full-access")
    assert NetworkMode.parse("host") is NetworkMode.HOST and ApprovalPolicy.parse("never") is ApprovalPolicy.NEVER
    for choice, bad in ((SandboxMode, "full"), (NetworkMode, "Host"), (ApprovalPolicy, "sometimes"), (NetworkMode, 7)):
        with pytest.raises(ValueError, match="is not one of"):
            choice.parse(bad)
    policy = WorkspaceWrite(network_access=True, network_mode="host")       # a caller's text
    assert policy.network_mode is NetworkMode.HOST and json.dumps(policy.network_mode) == '"host"'
    assert policy_from_name("workspace-write").network_mode is NetworkMode.ISOLATED
    with pytest.raises(InvalidPolicy, match="unknown network mode 'moon'"):
        WorkspaceWrite(network_mode="moon")
    with pytest.raises(InvalidPolicy, match="unknown approval policy 'sometimes'"):
        approval_policy("sometimes")


@pytest.mark.parametrize("policy, confined, writable, isolated", [
    (ReadOnly(), True, False, False),
    (WorkspaceWrite(), True, True, False),
    (WorkspaceWrite(network_access=True), True, True, True),
    (WorkspaceWrite(network_access=True, network_mode="host"), True, True, False),
    (DangerFullAccess(), False, False, False),
], ids=["read-only", "workspace-write", "isolated", "host-network", "danger"])
def test_every_kind_has_every_field_and_its_derived_values(policy: SandboxPolicy, confined: bool, writable: bool,
                                                          isolated: bool) -> None:
    """Readers take the fields typed, whatever the kind (no getattr with a default): the kinds other
    than workspace-write have empty lists and the host's network mode; what used to be worked out at
    each reader is a property."""
    assert policy.name is policy.mode and isinstance(policy.mode, SandboxMode)
    assert (policy.confined, policy.workspace_writable, policy.isolated_network) == (confined, writable, isolated)
    if not writable:
        assert policy.writable_roots == policy.allowed_hosts == policy.published_ports == ()
        assert policy.network_mode is NetworkMode.HOST


@pytest.mark.parametrize("kind, field, value", [
    (ReadOnly, "writable_roots", ("/x",)), (ReadOnly, "allowed_unix_sockets", ("/s",)),
    (ReadOnly, "network_mode", "isolated"), (DangerFullAccess, "protected_subpaths", (".git/hooks",)),
    (DangerFullAccess, "allowed_domains", ("pypi.org",)), (DangerFullAccess, "network_mode", "isolated"),
])
def test_the_other_kinds_refuse_workspace_write_options(kind: type[SandboxPolicy], field: str, value: object) -> None:
    """Every kind has every field, but only workspace-write may set the lists and the network mode."""
    kind()                                                   # the control: the kind itself is fine
    with pytest.raises(InvalidPolicy, match="workspace-write"):
        kind(**{field: value})


# --------------------------------------------------------------------------- network rules (issue 26)

def _isolated(**fields: object) -> WorkspaceWrite:
    return WorkspaceWrite(network_access=True, network_mode="isolated", **fields)  # type: ignore[arg-type]


def test_proxied_is_any_rule_that_needs_the_proxy() -> None:
    from sandboxd.policy.network import Unlisted

    assert not _isolated().proxied                                           # the control: no list, no proxy
    assert _isolated(allowed_domains=("pypi.org",)).proxied
    assert _isolated(credentials=("T=https://api.test",)).proxied
    assert _isolated(unlisted="ask").proxied and _isolated(unlisted="ask").unlisted is Unlisted.ASK
    assert _isolated(allowed_domains=("*",)).proxied
    assert not WorkspaceWrite(network_access=True, network_mode="host").proxied
    assert not DangerFullAccess().proxied and not ReadOnly().proxied


def test_endpoint_rules_and_credentials_are_kept_canonical_and_typed() -> None:
    policy = _isolated(allowed_domains=("*.GitHub.com",),
                       allowed_endpoints=("api.github.com=get:/repos/%7eme/**", "API.github.com=GET:/repos/~me/**"),
                       credentials=("T=https://uploads.test:443;Authorization: Bearer {}",))
    assert policy.allowed_endpoints == ("api.github.com=GET:/repos/~me/**",)          # one, canonical
    assert policy.credentials == ("T=https://uploads.test",)
    rules = policy.network_rules
    assert rules.domains == ("*.github.com",) and rules.credentials[0].host == "uploads.test"
    assert rules.endpoints[0].path == "/repos/~me/**" and rules.allowed("uploads.test", 443)
    assert policy.without_network_rules() == _isolated()


@pytest.mark.parametrize("fields, says", [
    ({"allowed_endpoints": ("api.github.com=GET:/**",)}, "endpoint rules only narrow: allow the host api.github.com"),
    ({"allowed_domains": ("github.com",), "allowed_endpoints": ("api.github.com=GET:/**",)}, "only narrow"),
    ({"allowed_domains": ("*.github.com",), "allowed_endpoints": ("*.com=GET:/**",)}, "only narrow"),
    ({"credentials": ("T=https://a.test", "T=https://b.test")}, "credential variable T is named twice"),
    ({"credentials": ("T=http://a.test",)}, "https://HOST"),
    ({"unlisted": "maybe"}, "use refuse (the default) or ask"),
    ({"allowed_endpoints": ("x",)}, "HOST=METHODS:PATH-GLOB"),
    ({"credentials": tuple(f"T{i}=https://a.test" for i in range(33))}, "credentials has 33 entries; the limit is 32"),
    ({"allowed_domains": ("a.test",), "allowed_endpoints": tuple(f"a.test=GET:/{i}" for i in range(257))},
     "allowed_endpoints has 257 entries; the limit is 256"),
])
def test_bad_network_rules_are_refused(fields: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidPolicy, match=re.escape(says)):
        _isolated(**fields)


def test_a_credential_host_takes_endpoint_rules_without_a_domain() -> None:
    policy = _isolated(credentials=("T=https://api.test",), allowed_endpoints=("api.test=GET:/v1/**",))
    assert policy.network_rules.intercepts("api.test", 443) and not policy.network_rules.allowed("other.test", 443)


@pytest.mark.parametrize("fields", [
    {"allowed_endpoints": ("a.test=GET:/",), "allowed_domains": ("a.test",)}, {"credentials": ("T=https://a.test",)},
    {"unlisted": "ask"},
])
def test_network_rules_need_the_isolated_network(fields: dict[str, object]) -> None:
    _isolated(**fields)                                                   # the control
    for network in ({"network_access": False}, {"network_access": True, "network_mode": "host"}):
        with pytest.raises(InvalidPolicy, match="apply to the isolated network"):
            WorkspaceWrite(**network, **fields)  # type: ignore[arg-type]
    for kind in (ReadOnly, DangerFullAccess):
        with pytest.raises(InvalidPolicy, match="workspace-write"):
            kind(**{k: v for k, v in fields.items() if k != "allowed_domains"})  # type: ignore[arg-type]
    name = "danger-full-access"
    with pytest.raises(InvalidPolicy, match="workspace-write"):
        policy_from_name(name, **{k: v for k, v in fields.items() if k != "allowed_domains"})  # type: ignore[arg-type]


def test_network_rules_survive_the_store() -> None:
    from sandboxd.policy.spec import policy_from_dict, policy_to_dict

    policy = _isolated(allowed_domains=("a.test",), allowed_endpoints=("a.test=GET:/x",), unlisted="ask",
                       credentials=("T=https://b.test;x-api-key: {}",))
    assert policy_from_dict(json.loads(json.dumps(policy_to_dict(policy)))) == policy
    old_row = {k: v for k, v in policy_to_dict(_isolated()).items()
               if k not in ("allowed_endpoints", "unlisted", "credentials")}
    assert policy_from_dict(old_row) == _isolated()                       # rows from before keep their meaning


def test_the_trust_bundle_of_a_launch_is_pem_certificates_only() -> None:
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    assert LaunchSpec(argv=("true",), workspace="/w", trust_pem=pem * 2).trust_pem == pem * 2
    for bad in ("-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n", "hello\n" + pem,
                pem.replace("-----END CERTIFICATE-----\n", ""), pem * 2000):
        with pytest.raises(InvalidPolicy, match="trusted certificates"):
            LaunchSpec(argv=("true",), workspace="/w", trust_pem=bad)
