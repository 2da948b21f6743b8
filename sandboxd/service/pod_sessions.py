"""Sessions charged to the pod that asked for them (limits.charge_pods; kernel.pod_placement).

With the switch on, a CreateSession from a process in a Kubernetes pod (its cgroup is a container's
group inside a pod's group, read from /proc/PID/cgroup of its SO_PEERCRED pid) gets its sandbox's
cgroups as leaves of the pod's group, beside the containers: the pod's memory and pids limits hold
its sandboxes (its limits are fitted to the pod's and its ancestors', service.ancestor_fit, not the
daemon's) and the pod, not the daemon's pod, pays for them. A caller outside a pod keeps the
daemon's own layout.

The placement is kept with the session (service.sessions.placement: its label, which no caller may
set), so a restarted daemon rebuilds it in the same pod.

A pod ends; its session must not keep its group: a kubelet removes the pod's group when its
containers are gone, and the rmdir fails while our leaf is in it. ``PodSessions`` looks every
CHECK_SECONDS at the pods of open sessions and closes the sessions of a pod none of whose own
groups holds a process any more (or whose group vanished): the close kills the sandbox and removes
its leaf, like a CloseSession of its owner (SessionClosed says why). So a pod's group is free at
most CHECK_SECONDS plus a sandbox's close after its last container ended. One thread for every pod:
each look is a directory listing and a ``cgroup.events`` read per container group.
"""

from __future__ import annotations

import logging
import threading

from sandboxd.errors import InvalidPolicy, NotFound
from sandboxd.kernel import pod_placement
from sandboxd.service.sessions.placement import LABEL
from sandboxd.service.sessions.registry import Session, SessionRegistry

log = logging.getLogger("sandboxd")
CHECK_SECONDS = 2.0
REASON = "its pod is gone: none of the pod's containers holds a process (limits.charge_pods)"


class PodSessions:
    """Closes the sessions whose pod is gone, every CHECK_SECONDS, on a thread of its own."""

    def __init__(self, registry: SessionRegistry, interval: float = CHECK_SECONDS) -> None:
        self._registry = registry
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sandboxd-pods", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - a bad look must not end the watch
                log.exception("looking for sessions of ended pods failed")

    def sweep(self) -> int:
        """Close every open session whose pod is gone; how many were closed."""
        by_pod: dict[str, list[Session]] = {}
        for session in self._registry.open_sessions():
            text = session.labels.get(LABEL)
            if text:
                by_pod.setdefault(text, []).append(session)
        closed = 0
        for text, sessions in by_pod.items():
            try:
                alive = pod_placement.pod_alive(pod_placement.decode(text))
            except InvalidPolicy:
                alive = False                     # a label no pod has: nothing to keep it for
            if alive:
                continue
            for session in sessions:
                try:
                    self._registry.close(session.owner, session.id, reason=REASON)
                    closed += 1
                except NotFound:
                    pass                          # closed meanwhile by its owner
        return closed

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
