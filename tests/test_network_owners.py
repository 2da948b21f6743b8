"""Isolated networks of daemons that share the host's network but not a PID namespace.

A daemon in a container with the host's network and a PID namespace of its own shares the host's
links and the address pool with every other daemon on the machine, while its pids name other
processes. Before, kernel.netns named a host link ``sbx<creator pid>x<n>`` and swept those whose
pid was gone from its /proc: two fork servers of the same pid in two namespaces collided on the
name (EEXIST), and one daemon's sweep deleted another's live links. Now a link's name is random,
its alias names its creator (pid, start time, PID namespace: kernel.creators, the rule the cgroup
sweep follows), and its block of the pool is claimed in the kernel by its route.

Each claim here is shown on the real kernel with a control: by its pid alone, the live link's
creator is dead in the sweeper's namespace (the old rule deleted it), a dead creator's link is
swept there, both creators have pid 1 and the kernel refuses a second link of one name, and the
block a competitor claimed is the one handed out once the claim is gone. Pools are the test's own
(``free_pool``); the only links touched are the test's.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from daemon_helpers import free_pool, sandbox_links
from sandboxd.kernel import netns
from sandboxd.policy import LaunchSpec, WorkspaceWrite
from sandboxd.supervisor.fork_client import ForkServer

pytestmark = pytest.mark.timeout(300)

# A creator that dies without closing its network, as a SIGKILLed fork server or `sandboxd run` does,
# while its sandbox lives on in the namespace (else the namespace, and the link, end with the creator).
MAKE_AND_DIE = """
import os, sys, time
from sandboxd.kernel import namespaces, netns
network = netns.create_isolated(pool=sys.argv[1], resolvers=[])
sandbox = os.fork()
if sandbox == 0:
    namespaces.setns(network.netns_fd, namespaces.CLONE_NEWNET)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    time.sleep(600)
    os._exit(0)
print(network.host_link, sandbox, flush=True)
os._exit(0)
"""

# A daemon starting in a PID namespace of its own (run with unshare --pid --fork --mount-proc): a
# creator of its namespace dies leaving a link, then it sweeps.
SWEEP_IN_ANOTHER_PID_NAMESPACE = """
import json, os, subprocess, sys
from sandboxd.kernel import netns
pool, creator, links, make_and_die = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
links["dead"] = subprocess.run([sys.executable, "-c", make_and_die, pool], capture_output=True, text=True,
                               check=True).stdout.split()[0]
there = lambda: {what: os.path.exists(f"/sys/class/net/{name}") for what, name in links.items()}
before = there()
netns.sweep_stale()
print(json.dumps({"pid": os.getpid(), "creator_seen": os.path.exists(f"/proc/{creator}"), "links": links,
                  "before": before, "after": there()}))
"""

# A creator that holds its network until its stdin closes.
HOLD = """
import json, os, sys
from sandboxd.kernel import netns
network = netns.create_isolated(pool=sys.argv[1], resolvers=[])
print(json.dumps({"pid": os.getpid(), "link": network.host_link, "address": network.host_address,
                  "creator": netns.link_creator(network.host_link)}), flush=True)
sys.stdin.read()
network.close()
"""

# Creators that begin together on a line from the test and print what they got.
RACE = """
import json, sys
from sandboxd.kernel import netns
pool, count = sys.argv[1], int(sys.argv[2])
sys.stdin.readline()
networks = [netns.create_isolated(pool=pool, resolvers=[]) for _ in range(count)]
print(json.dumps([[network.host_link, network.host_address] for network in networks]), flush=True)
sys.stdin.read()
for network in networks:
    network.close()
"""


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def test_a_sweep_in_another_pid_namespace_leaves_a_live_daemons_links_alone(workspace: Path) -> None:
    """A daemon starting in a PID namespace of its own sweeps: a live fork server's isolated session
    keeps its link, and so does an older sandboxd's link (``sbx<pid>x<n>``, which names no creator), although
    the pid both are named after is not there (the control: the old rule, by /proc/PID, deleted them).
    A link whose creator died in the sweeper's namespace goes (the control: this sweep does sweep)."""
    pool = free_pool(2)
    fs = ForkServer.start()
    older = f"{netns.LINK_PREFIX}{fs.pid:x}x{os.urandom(1).hex()}"       # as an older sandboxd named its links
    ip("link", "add", older, "type", "veth", "peer", "name", f"tpo{os.urandom(4).hex()}")
    try:
        fs.open_session("net", LaunchSpec(argv=("true",), workspace=str(workspace), network_pool=pool,
                                          policy=WorkspaceWrite(network_access=True)))
        (live,) = sandbox_links(fs.pid)
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                               SWEEP_IN_ANOTHER_PID_NAMESPACE, pool, str(fs.pid),
                               json.dumps({"live": live, "older": older}), MAKE_AND_DIE],
                              capture_output=True, text=True, timeout=120, env=child_env())
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["pid"] == 1 and seen["creator_seen"] is False, seen     # by pid alone, dead there
        assert seen["before"] == {"live": True, "older": True, "dead": True}, seen
        assert seen["after"] == {"live": True, "older": True, "dead": False}, seen
        assert link_exists(live) and link_exists(older)
        fs.close_session("net")
        assert sandbox_links(fs.pid) == set()
    finally:
        fs.close()
        ip("link", "del", older, check=False)


def test_creators_of_one_pid_in_two_pid_namespaces_get_links_of_their_own() -> None:
    """Two creators, each pid 1 of its own PID namespace, make isolated networks from one pool at the
    same time: two links, two names, two blocks, each alias naming its own creator. The control: both
    are pid 1, so the old naming gave both ``sbx1x1``, a name the kernel gives only once."""
    pool = free_pool(2)
    holders = [subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-c",
                                 HOLD, pool], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=child_env()) for _ in range(2)]
    try:
        made = []
        for holder in holders:
            assert holder.stdout is not None
            line = holder.stdout.readline()
            assert line, "a creator made no network"
            made.append(json.loads(line))
        assert [m["pid"] for m in made] == [1, 1]
        (first, second) = made
        assert first["link"] != second["link"] and first["address"] != second["address"], made
        assert first["creator"][0] == second["creator"][0] == 1 and first["creator"][2] != second["creator"][2], made
        for m in made:
            assert link_exists(m["link"]) and netns.link_creator(m["link"]) == tuple(m["creator"])
            assert "x" not in m["link"][len(netns.LINK_PREFIX):]     # older sandboxd's sweep reads sbx<pid>x<n>
        collision = subprocess.run(["unshare", "--net", "sh", "-c", "ip link add sbx1x1 type veth peer name a && "
                                    "ip link add sbx1x1 type veth peer name b"], capture_output=True, text=True,
                                   timeout=30)
        assert collision.returncode != 0 and "File exists" in collision.stderr, collision
    finally:
        for holder in holders:
            holder.communicate(timeout=60)                # closes stdin: each closes its network
    assert not any(link_exists(m["link"]) for m in made)


def test_a_block_another_creator_claimed_is_not_handed_out() -> None:
    """A creator that does not share our lock file (a daemon in a container with the host's network)
    has claimed the pool's first block (its route) and not yet put its address on its link: the
    next network gets the second block. The control: no address of the host is in the first block,
    so by addresses alone (the pool's rule before) it was free; with the claim gone it is handed out."""
    pool = free_pool(2)
    first, second = ipaddress.ip_network(pool).subnets(new_prefix=30)
    competitor = f"tcl{os.urandom(4).hex()}"
    ip("link", "add", competitor, "type", "veth", "peer", "name", f"{competitor}p")
    try:
        ip("link", "set", competitor, "up")
        ip("route", "add", str(first), "dev", competitor, "scope", "link", "proto", "kernel")
        addresses = ip("-o", "-4", "addr", "show").stdout.split()
        assert not any(ipaddress.ip_interface(word).ip in first for word in addresses if word[:1].isdigit() and "/" in word)
        network = netns.create_isolated(pool=pool, resolvers=[])
        try:
            assert network.host_address == str(second[1]), network.host_address
        finally:
            network.close()
    finally:
        ip("link", "del", competitor, check=False)
    network = netns.create_isolated(pool=pool, resolvers=[])
    try:
        assert network.host_address == str(first[1]), network.host_address
    finally:
        network.close()


def test_creators_with_lock_files_of_their_own_never_share_a_block() -> None:
    """Two creators, each in a mount namespace of its own with its own /run/sandboxd (so its own
    network lock, as daemons in two containers have), make 8 networks each from one pool of 16 blocks,
    starting together: 16 links on 16 blocks."""
    pool = free_pool(16)
    os.makedirs(os.path.dirname(netns.LOCK_PATH), exist_ok=True)
    own_run = f"mount -t tmpfs tmpfs {os.path.dirname(netns.LOCK_PATH)} && exec \"$0\" \"$@\""
    racers = [subprocess.Popen(["unshare", "--mount", "sh", "-c", own_run, sys.executable, "-c", RACE, pool, "8"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env())
              for _ in range(2)]
    made: list[list[str]] = []
    try:
        for racer in racers:
            assert racer.stdin is not None
            racer.stdin.write("go\n")
            racer.stdin.flush()
        for racer in racers:
            assert racer.stdout is not None
            line = racer.stdout.readline()
            assert line, "a creator failed"
            made.extend(json.loads(line))
        network = ipaddress.ip_network(pool)
        assert len({link for link, _ in made}) == len({address for _, address in made}) == 16, made
        assert all(ipaddress.ip_address(address) in network for _, address in made), made
    finally:
        for racer in racers:
            racer.communicate(timeout=60)
    assert not any(link_exists(link) for link, _ in made)


def test_stale_links_of_a_dead_creator_are_swept() -> None:
    """A creator of our PID namespace that died without closing its network (a SIGKILLed `sandboxd
    run`) while its sandbox lives on leaves a link the next sweep deletes, with its block: the pool
    hands it out again."""
    pool = free_pool()
    dying = subprocess.Popen([sys.executable, "-c", MAKE_AND_DIE, pool], stdout=subprocess.PIPE, text=True,
                             env=child_env())
    out, _ = dying.communicate(timeout=60)
    name, sandbox = out.split()
    try:
        assert sandbox_links(dying.pid) == {name}
        assert netns.sweep_stale() >= 1
        assert not link_exists(name)
        network = netns.create_isolated(pool=pool, resolvers=[])
        network.close()
    finally:
        os.kill(int(sandbox), signal.SIGKILL)
