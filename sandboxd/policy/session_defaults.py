"""What a CreateSession that leaves something unset gets: the daemon's ``[defaults]`` and
``[limits]`` settings, as one record (service/convert.py applies them)."""

from __future__ import annotations

from sandboxd._record import Record
from sandboxd.policy.decision import ApprovalPolicy
from sandboxd.policy.limits import DEFAULT_PTYS
from sandboxd.policy.sandbox import SandboxMode


class SessionDefaults(Record):
    """What a CreateSession that leaves something unset gets (the daemon's `defaults` settings)."""

    sandbox: SandboxMode = SandboxMode.WORKSPACE_WRITE
    network_access: bool = False
    approval: ApprovalPolicy = ApprovalPolicy.ON_REQUEST
    timeout_seconds: float | None = None
    memory_bytes: int | None = None
    pids: int | None = None
    # The most a session may ask for (None: no maximum), and the caps of all sandboxes together.
    max_memory_bytes: int | None = None
    max_pids: int | None = None
    total_memory_bytes: int | None = None
    total_pids: int | None = None
    owner_memory_bytes: int | None = None     # and the share of them of one owner's sandboxes
    owner_pids: int | None = None
    charge_pods: bool = False                 # a pod's sessions go under the pod's cgroup (limits.charge_pods)
    ptys: int = DEFAULT_PTYS                  # terminals of each session's own devpts (limits.session_ptys)
    review: bool = False                      # review mode for a workspace-write session that does not say (review.default)
    max_checkpoints: int | None = None        # checkpoints a review session keeps (review.max_checkpoints; None: its default)
