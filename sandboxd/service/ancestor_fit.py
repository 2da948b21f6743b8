"""A session's memory and pids limits against the caps of the cgroups above its sandbox.

The kernel enforces the tightest cap on the path above a sandbox (kernel.ancestor_limits), whatever
the sandbox's own limit says. So, at CreateSession:

- a limit the caller **asked for** above that cap is **refused** (INVALID_ARGUMENT naming the group,
  its file and cap, and what to ask for). Refused rather than capped: a caller that asked for 2 GiB
  plans for 2 GiB (a build's -j, a test's workers); quietly giving it 700 MiB turns its plan into an
  OOM kill later, while a refusal says at once what it can have, and the caller decides.
- a limit it left **unset** gets the daemon's default **capped** to the cap: the caller asked for
  nothing in particular, so the most it can really get is the right answer. The session's limits
  show the capped value, its SessionCreated audit event carries the note, and ``sandboxctl status``
  says which default is capped and by which group (``status_features``).

The cap is the group's whole limit: the daemon (outside Kubernetes) or the pod's containers (a
session placed in a pod) share it, as the sandboxes share their base group's ceiling, so a session at
the bound can still meet that group's OOM killer when the others use memory; its call then reports
``oom_killed``.
"""

from __future__ import annotations

from sandboxd.errors import InvalidPolicy
from sandboxd.kernel.ancestor_limits import AncestorLimits, Bound
from sandboxd.policy.limits import Limits
from sandboxd.printable import printable

RESOURCES = (("memory", "memory_bytes", "bytes"), ("pids", "pids", "tasks"))


def fit(limits: Limits, asked_memory: int, asked_pids: int, above: AncestorLimits) -> tuple[Limits, list[str]]:
    """``limits`` (defaults filled in) within ``above``: InvalidPolicy for an asked-for limit past a
    cap; a default past one capped, with a note saying so. ``asked_*``: what the request set (0: unset)."""
    notes: list[str] = []
    changes: dict[str, int] = {}
    for resource, field, unit in RESOURCES:
        bound = above.get(resource)
        value = getattr(limits, field)
        if bound is None or value is None or value <= bound.value:
            continue
        asked = asked_memory if resource == "memory" else asked_pids
        if asked:
            raise InvalidPolicy(
                f"limits.{field} {asked} is above what the cgroups this session's sandbox lives in allow: "
                f"{_where(bound)} caps {resource} at {bound.value} {unit}{_mib(resource, bound.value)}, and the "
                f"kernel enforces it whatever the session's own limit says; ask for at most {bound.value}, "
                f"or leave limits.{field} unset for the default (capped to fit)")
        changes[field] = bound.value
        notes.append(f"the default limits.{field} {value} is capped to {bound.value}{_mib(resource, bound.value)}: "
                     f"{_where(bound)} allows no more")
    return (limits.replace(**changes) if changes else limits), notes


def status_features(memory_default: int | None, pids_default: int | None,
                    above: AncestorLimits) -> dict[str, str]:
    """What `sandboxctl status` shows of the caps above the sandboxes: each cap and where it is
    (``cgroup.ancestor_memory``; "none"), and each default as a session that sets nothing gets it
    (``defaults.memory``), saying when a cap lowered it."""
    features: dict[str, str] = {}
    for (resource, _field, unit), default in zip(RESOURCES, (memory_default, pids_default), strict=True):
        bound = above.get(resource)
        features[f"cgroup.ancestor_{resource}"] = (
            f"{bound.value} {unit}{_mib(resource, bound.value)} at {_where(bound)}" if bound else "none")
        if default is None:
            features[f"defaults.{resource}"] = "none"
        elif bound is not None and default > bound.value:
            features[f"defaults.{resource}"] = (f"{bound.value}{_mib(resource, bound.value)} (capped from {default}: "
                                                f"{_where(bound)} allows no more)")
        else:
            features[f"defaults.{resource}"] = f"{default}{_mib(resource, default)}"
    return features


def _where(bound: Bound) -> str:
    return printable(bound.where())          # a pod's path names what its creator chose


def _mib(resource: str, value: int) -> str:
    return f" ({value / (1 << 20):.0f} MiB)" if resource == "memory" else ""
