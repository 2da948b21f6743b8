"""connect() from inside sandboxes and from the host, as a plain user: the probes of the connect
broker's tests (test_channel_entries, test_btrfs_sockets). A plan names what to try; the answer
says, per name, "connected" or the errno's name."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from typing import Any

from conftest import BASE_ENV, PY, SLOW, describe
from daemon_helpers import PlainUser, run_client_as

# A connect() and what became of it: "connected", or the errno's name.
ATTEMPT = textwrap.dedent('''
    import errno, socket
    def attempt(family, address):
        s = socket.socket(family)
        s.settimeout(10)
        try:
            s.connect(address)
            return "connected"
        except OSError as e:
            return errno.errorcode.get(e.errno, str(e.errno))
        finally:
            s.close()
''')

# {"tcp": {NAME: [HOST, PORT]}, "unix": {NAME: PATH}, "own": {NAME: PATH}}; "own": a server of the
# command's own, bound and listening at PATH (relative: in its cwd), then connected to.
PROBE = ATTEMPT + textwrap.dedent('''
    import json, os, sys
    plan, seen = json.loads(sys.argv[1]), {}
    for name, (host, port) in plan.get("tcp", {}).items():
        seen[name] = attempt(socket.AF_INET6 if ":" in host else socket.AF_INET, (host, port))
    for name, path in plan.get("unix", {}).items():
        seen[name] = attempt(socket.AF_UNIX, path)
    for name, path in plan.get("own", {}).items():
        server = socket.socket(socket.AF_UNIX)
        server.bind(path)
        server.listen(4)
        seen[name] = attempt(socket.AF_UNIX, path)
        server.close()
        os.unlink(path)
    print(json.dumps(seen))
''')

SESSION = textwrap.dedent('''
    session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["workspace"], approval_policy=pb.NEVER,
        sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, **ARGS["policy"])))
    try:
        out, status = run(session.id, ["/usr/bin/python3", "-c", ARGS["probe"], ARGS["plan"]])
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=session.id))
    print(json.dumps({"out": out, "status": status}))
''')


def _as(user: PlainUser, cwd: str = "/") -> dict[str, Any]:
    return {"user": user.uid, "group": user.gid, "extra_groups": [], "cwd": cwd}


def on_host(user: PlainUser, plan: dict[str, Any]) -> dict[str, str]:
    """The control: the plan run by ``user`` outside any sandbox."""
    done = subprocess.run([PY, "-c", PROBE, json.dumps(plan)], capture_output=True, text=True,
                          timeout=120 * SLOW, env=BASE_ENV, **_as(user))
    assert done.returncode == 0, describe(done)
    return dict(json.loads(done.stdout))


def in_session(socket_path: str, user: PlainUser, workspace: Path, plan: dict[str, Any],
               **policy: Any) -> dict[str, str]:
    """The plan in a WORKSPACE_WRITE session (with ``policy``) that ``user`` opens on the daemon."""
    answer = run_client_as(user.uid, user.gid, socket_path, SESSION, {
        "workspace": str(workspace), "policy": policy, "probe": PROBE, "plan": json.dumps(plan)})
    assert answer["status"] == 0, answer
    return dict(json.loads(answer["out"].strip().splitlines()[-1]))


def in_rootless_run(user: PlainUser, code: Path, workspace: Path, plan: dict[str, Any], *options: str,
                    socket_path: str = "") -> dict[str, str]:
    """The plan in ``user``'s rootless `sandboxd run OPTIONS` (the package copy ``code``: conftest's
    readable_copy_of_sandboxd); with ``socket_path`` as $SANDBOXD_SOCKET, whose registry of approval
    channels it reads."""
    env = {**BASE_ENV, "HOME": str(workspace), "PYTHONPATH": str(code)}
    if socket_path:
        env["SANDBOXD_SOCKET"] = socket_path
    done = subprocess.run([PY, "-m", "sandboxd.cli.main", "run", "--workspace", str(workspace), *options, "--",
                           PY, "-c", PROBE, json.dumps(plan)], capture_output=True, text=True,
                          timeout=120 * SLOW, stdin=subprocess.DEVNULL, env=env, **_as(user, str(workspace)))
    assert done.returncode == 0, describe(done)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))
