"""The pure policy model: what a sandbox may do, with no OS calls at all."""

from sandboxd.policy.limits import Limits, parse_size
from sandboxd.policy.sandbox import (
    DEFAULT_PROTECTED_SUBPATHS,
    DangerFullAccess,
    ReadOnly,
    SandboxPolicy,
    WorkspaceWrite,
    default_policy,
    policy_from_name,
    validate_policy,
)
from sandboxd.policy.spec import LaunchSpec

__all__ = [
    "DEFAULT_PROTECTED_SUBPATHS", "DangerFullAccess", "LaunchSpec", "Limits", "ReadOnly",
    "SandboxPolicy", "WorkspaceWrite", "default_policy", "parse_size", "policy_from_name",
    "validate_policy",
]
