"""Fake Kubernetes pods for tests of tenancy by pod: cgroups named as kubelet names them, under a
parent cgroup the test creates (and the daemon is told of: tenancy.cgroup_root), on the cgroup2
hierarchy; and an agent that joins one and makes gRPC calls from inside it.

The machine's own cgroups (and other tests' and daemons') are never touched: everything is below
``/sbxt-pods-<random>`` of the cgroup2 mount, removed afterwards."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cgroup_helpers import remove_group

# Runs in the agent's process: joins the cgroup (argv[1]; "-": stays where it is, in a real pod),
# becomes uid argv[3] if given (a pod's non-root container or one that dropped privileges), then
# makes each call read from stdin ({"rpc": name, "request": {...}}) on the socket (argv[2]) and
# prints one JSON answer per call: {"ok": response} ({"ok": [responses]} for a stream) or
# {"code": status name, "details": text}.
AGENT = r'''
import json, os, sys
if sys.argv[1] != "-":
    with open(sys.argv[1] + "/cgroup.procs", "w") as f:
        f.write("0")
if len(sys.argv) > 3:
    os.setgroups([]); os.setgid(int(sys.argv[3])); os.setuid(int(sys.argv[3]))
import grpc
from google.protobuf import json_format
from sandboxd.v1 import sandboxd_pb2 as pb, sandboxd_pb2_grpc as pb_grpc
channel = grpc.insecure_channel("unix:" + sys.argv[2])
stub = pb_grpc.SandboxStub(channel)
methods = pb.DESCRIPTOR.services_by_name["Sandbox"].methods_by_name
out = []
for call in json.loads(sys.stdin.read()):
    method = methods[call["rpc"]]
    request = json_format.ParseDict(call.get("request", {}), getattr(pb, method.input_type.name)())
    as_dict = lambda m: json_format.MessageToDict(m, preserving_proto_field_name=True)
    try:
        answer = getattr(stub, call["rpc"])(request, timeout=120)
        out.append({"ok": [as_dict(m) for m in answer] if method.server_streaming else as_dict(answer)})
    except grpc.RpcError as exc:
        out.append({"code": exc.code().name, "details": exc.details()})
print(json.dumps(out))
'''

# Runs in a pod's process: joins the cgroup (argv[1]), connects argv[3] times to the socket
# (argv[2]), says so, and holds the connections until its stdin closes.
HOLDER = r'''
import socket, sys
with open(sys.argv[1] + "/cgroup.procs", "w") as f:
    f.write("0")
held = []
for _ in range(int(sys.argv[3])):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[2])
    held.append(s)
print("held", flush=True)
sys.stdin.read()
'''

# As HOLDER, but each connection is made by a short-lived child that exits (and is reaped) before
# the daemon can look at it; the parent keeps the socket (fork shared it): the daemon refuses those
# connections (whoever holds them is unknown) but they stay open.
HOLDER_OF_ORPHANS = r'''
import os, socket, sys
with open(sys.argv[1] + "/cgroup.procs", "w") as f:
    f.write("0")
held = []
for _ in range(int(sys.argv[3])):
    s = socket.socket(socket.AF_UNIX)
    pid = os.fork()
    if pid == 0:
        s.connect(sys.argv[2])
        os._exit(0)
    os.waitpid(pid, 0)
    held.append(s)
print("held", flush=True)
sys.stdin.read()
'''


def cgroup2_mount() -> Path | None:
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if fields[2] == "cgroup2":
                return Path(fields[1])
    return None


@dataclass
class FakePod:
    uid: str
    directory: Path          # the container cgroup the agent joins

    def call(self, socket: str, *calls: dict[str, Any], uid: int | None = None) -> list[dict[str, Any]]:
        """Each call made from a fresh process in this pod's container cgroup (as ``uid``: else
        root), as its answers."""
        return run_agent(self.directory, socket, list(calls), uid)

    @contextlib.contextmanager
    def holding(self, socket: str, connections: int, *, orphans: bool = False) -> Iterator[None]:
        """``connections`` connections to the daemon held open from this pod while the block runs
        (``orphans``: each made by a child gone before the daemon looked: HOLDER_OF_ORPHANS)."""
        script = HOLDER_OF_ORPHANS if orphans else HOLDER
        holder = subprocess.Popen([sys.executable, "-c", script, str(self.directory), socket, str(connections)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            yield
        finally:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait(timeout=60)


def run_agent(directory: Path, socket: str, calls: list[dict[str, Any]], uid: int | None = None) -> list[dict[str, Any]]:
    as_uid = [] if uid is None else [str(uid)]
    done = subprocess.run([sys.executable, "-c", AGENT, str(directory), socket, *as_uid], input=json.dumps(calls),
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr
    answers: list[dict[str, Any]] = json.loads(done.stdout)
    return answers


class PodNode:
    """A kubepods tree below a test-owned cgroup (``root``, relative to the cgroup2 mount)."""

    def __init__(self, mount: Path) -> None:
        self.name = f"sbxt-pods-{uuid.uuid4().hex[:8]}"
        self.top = mount / self.name
        self.top.mkdir()

    @property
    def root(self) -> str:
        return "/" + self.name

    def cgroup(self, relative: str) -> Path:
        """A cgroup below the test's parent (made with its parents)."""
        path = self.top / relative.lstrip("/")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def pod(self, driver: str = "cgroupfs", qos: str = "besteffort") -> FakePod:
        uid = str(uuid.uuid4())
        if driver == "cgroupfs":
            pod = f"kubepods/{qos}/pod{uid}" if qos else f"kubepods/pod{uid}"
            container = uuid.uuid4().hex * 2
        else:
            escaped = uid.replace("-", "_")
            pod = (f"kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{escaped}.slice" if qos
                   else f"kubepods.slice/kubepods-pod{escaped}.slice")
            container = f"cri-containerd-{uuid.uuid4().hex * 2}.scope"
        return FakePod(uid, self.cgroup(f"{pod}/{container}"))

    def close(self) -> None:
        remove_group(self.top)


@contextlib.contextmanager
def pod_node() -> Iterator[PodNode]:
    mount = cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 hierarchy mounted (the fake pods' cgroups live there)")
    node = PodNode(mount)
    try:
        yield node
    finally:
        node.close()
        assert not node.top.exists(), f"{node.top} left behind"


def refused(answer: dict[str, Any], code: str, *words: str) -> bool:
    """Whether ``answer`` is the error ``code`` whose details say each of ``words``."""
    return answer.get("code") == code and all(word in answer.get("details", "") for word in words)


def pod_config(node: PodNode, *, mode: str = "pod", sessions: int = 2, admin_pods: tuple[str, ...] = ()) -> str:
    pods = ", ".join(json.dumps(uid) for uid in admin_pods)
    return (f"[tenancy]\nmode = \"{mode}\"\ncgroup_root = \"{node.root}\"\nadmin_pods = [{pods}]\n"
            f"[quotas]\nsessions_per_uid = {sessions}\n")
