"""A hide_home session's sandbox and its owner's runtime directory (/run/user/UID: $XDG_RUNTIME_DIR,
where `podman login` keeps registry credentials and agents their sockets), on the real kernel. From
the hostile pass 9b (finding 3): hide_home covers it as it covers the home. The control: the user's
own unconfined process reaches the socket; the sandboxed one can neither read the files nor connect."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from daemon_fixtures import daemon  # noqa: F401
from daemon_helpers import Daemon, DaemonFactory, plain_users, run_client_as
from sandboxd.v1 import sandboxd_pb2 as pb

pytestmark = pytest.mark.timeout(300)

PROBE = r'''
rt, ws = ARGS["rt"], ARGS["ws"]
policy = pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, hide_home=ARGS["hide"])
s = stub.CreateSession(pb.CreateSessionRequest(workspace=ws, sandbox_policy=policy, approval_policy=pb.NEVER), timeout=120)
connect = "import socket,sys; c=socket.socket(socket.AF_UNIX); c.connect(sys.argv[1]); print(c.recv(100).decode())"
out = {"hide": s.sandbox_policy.hide_home,
       "read": run(s.id, ["cat", rt + "/containers/auth.json"]),
       "connect": run(s.id, ["python3", "-c", connect, rt + "/agent.sock"])}
stub.CloseSession(pb.CloseSessionRequest(session_id=s.id), timeout=60)
print(json.dumps(out))
'''


def test_the_owners_runtime_dir_is_out_of_reach(sandboxd_daemon_module: DaemonFactory, daemon: Daemon) -> None:  # noqa: F811
    with plain_users(1) as (user,):
        home = sandboxd_daemon_module.base / f"home-{user.name}"
        subprocess.run(["usermod", "-d", str(home), user.name], check=True, capture_output=True)
        (home / "project").mkdir(parents=True)
        for p in (home, home / "project"):
            os.chown(p, user.uid, user.gid)
        os.chmod(home, 0o700)
        rt = Path(f"/run/user/{user.uid}")
        rt.mkdir(parents=True)
        try:
            (rt / "containers").mkdir()
            (rt / "containers" / "auth.json").write_text('{"auths": {"quay.io": {"auth": "sbxt-h9b-runtime"}}}\n')
            (rt / "agent-note").write_text("sbxt-h9b-runtime\n")
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(str(rt / "agent.sock"))
            listener.listen(4)
            for p in (rt, rt / "containers", rt / "containers" / "auth.json", rt / "agent-note", rt / "agent.sock"):
                os.chown(p, user.uid, user.gid)
            os.chmod(rt, 0o700)
            os.chmod(rt / "agent.sock", 0o600)

            def serve() -> None:
                listener.settimeout(120)
                try:
                    while True:
                        conn, _ = listener.accept()
                        conn.sendall(b"sbxt-h9b-agent-answer\n")
                        conn.close()
                except OSError:
                    return
            threading.Thread(target=serve, daemon=True).start()
            # control: the user's own (unconfined) process reaches it
            ctl = subprocess.run(["python3", "-c", "import socket,sys; c=socket.socket(socket.AF_UNIX); "
                                  "c.connect(sys.argv[1]); print(c.recv(100).decode())", str(rt / "agent.sock")],
                                 capture_output=True, text=True, user=user.uid, group=user.gid, extra_groups=[],
                                 timeout=60)
            assert "sbxt-h9b-agent-answer" in ctl.stdout, ctl
            args = {"rt": str(rt), "ws": str(home / "project")}
            shown = run_client_as(user.uid, user.gid, daemon.socket, PROBE, {**args, "hide": False})
            out = run_client_as(user.uid, user.gid, daemon.socket, PROBE, {**args, "hide": True})
            listener.close()
        finally:
            shutil.rmtree(rt, ignore_errors=True)
    assert shown["read"][1] == 0 and "sbxt-h9b-runtime" in shown["read"][0], shown   # control: without hide_home
    assert out["hide"] is True
    text, status = out["connect"]
    assert status != 0 and "sbxt-h9b" not in text, out        # holds: the sandbox's unix-socket wall
    text, status = out["read"]                                  # podman's registry login
    assert status != 0 and "sbxt-h9b" not in text, out
