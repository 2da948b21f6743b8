"""The git guard: no git configuration planted in a sandbox runs on the host afterwards (issue 10).

Each attack is real: git and sh inside the sandbox plant code (a core.fsmonitor
or a hook that touches a marker file in a directory the sandbox cannot write),
then real git runs on the host AS A PLAIN USER who owns the workspace, exactly
as that user's next `git status` would. The controls run the same attack with
--no-default-protect (the guard off) and show the marker does appear, so each
"did not run" below can fail.

  (a) .git/commondir -> ../evil, whose config holds core.fsmonitor
  (b) a repository made in the sandbox, with an fsmonitor, added to the outer index as a gitlink
  (c) a repository made without a hooks directory gets .git/hooks/post-checkout
  (d) a repository made in the sandbox gets a hook and an fsmonitor

Through `sandboxd run` (stderr names each neutralisation) and through the daemon
(Exec, WriteFile, a background job, session close; each neutralisation is a
GitConfigNeutralized event), with the session owned by that same plain user.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import BASE_ENV, describe, make_dir, run_sbx
from daemon_helpers import Daemon
from daemon_fixtures import daemon  # noqa: F401 - pytest fixture: the module's daemon, with its leak check

IDENTITY = {"GIT_AUTHOR_NAME": "sandbox", "GIT_AUTHOR_EMAIL": "s@example.invalid",
            "GIT_COMMITTER_NAME": "sandbox", "GIT_COMMITTER_EMAIL": "s@example.invalid"}
SANDBOX_ENV = {**BASE_ENV, "HOME": "/tmp", "GIT_CONFIG_NOSYSTEM": "1", **IDENTITY}
# `sandboxd run` passes only what is named (sandboxd/cli/run_env.py): the command's variables.
SANDBOX_OPTIONS = tuple(f"--env={key}={value}" for key, value in SANDBOX_ENV.items() if key not in ("PATH", "LANG"))
HOST_GIT_ENV = ["env", "-i", f"PATH={BASE_ENV['PATH']}", "HOME=/nonexistent", "XDG_CONFIG_HOME=/nonexistent",
                "GIT_CONFIG_NOSYSTEM=1", *(f"{k}={v}" for k, v in IDENTITY.items())]


class Setup:
    def __init__(self, user: str, uid: int, gid: int, ws: Path, markers: Path, outside: Path) -> None:
        self.user, self.uid, self.gid, self.ws, self.markers, self.outside = user, uid, gid, ws, markers, outside

    def git(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Real git on the host, as the plain user who owns the workspace."""
        return subprocess.run(["runuser", "-u", self.user, "--", *HOST_GIT_ENV, "git", "-C", str(cwd or self.ws),
                               *args], capture_output=True, text=True, timeout=60)

    def fired(self) -> list[str]:
        return sorted(os.listdir(self.markers))


@pytest.fixture
def host_user(plain_users: "Callable[[int], list[Any]]") -> tuple[str, int, int]:
    """A fresh plain user (conftest's plain_users: removed afterwards) who owns the workspace."""
    user = plain_users(1)[0]
    return user.name, user.uid, user.gid


def make_setup(base_dir: Path, host_user: tuple[str, int, int], *, template: bool = True) -> Setup:
    """A committed repository owned by the plain user; a 0777 marker directory and a 0777 ``outside``
    directory, both outside the workspace (the sandbox cannot write them; host code can)."""
    user, uid, gid = host_user
    ws = make_dir(base_dir / "ws")
    markers = make_dir(base_dir / "markers", 0o777)
    outside = make_dir(base_dir / "outside", 0o777)
    env = {**BASE_ENV, "GIT_CONFIG_NOSYSTEM": "1", **IDENTITY}
    subprocess.run(["git", "init", "-q", *([] if template else ["--template="]), str(ws)], check=True, env=env)
    (ws / "file.txt").write_text("hello\n")
    subprocess.run(["git", "-C", str(ws), "add", "file.txt"], check=True, env=env)
    subprocess.run(["git", "-C", str(ws), "commit", "-qm", "base"], check=True, env=env)
    subprocess.run(["chown", "-R", f"{uid}:{gid}", str(ws)], check=True)
    return Setup(user, uid, gid, ws, markers, outside)


@pytest.fixture
def setup(base_dir: Path, host_user: tuple[str, int, int]) -> Setup:
    return make_setup(base_dir, host_user)


@pytest.fixture
def bare_setup(base_dir: Path, host_user: tuple[str, int, int]) -> Setup:
    """(c): the repository was made with `git init --template=`: no hooks directory."""
    return make_setup(base_dir, host_user, template=False)


def fsmonitor_config(marker: Path) -> str:
    return f"[core]\n\trepositoryformatversion = 0\n\tfsmonitor = touch {marker}\n"


def hook(marker: Path) -> str:
    return f"#!/bin/sh\ntouch {marker}\n"


def attack_script(kind: str, markers: Path) -> str:
    if kind == "a":
        return ("mkdir evil && cp -r .git/objects .git/refs evil/ && "
                f"printf '%s' '{fsmonitor_config(markers / 'a')}' > evil/config && "
                "printf '../evil\\n' > .git/commondir")
    if kind == "b":
        return (f"git init -q sub && git -C sub commit -q --allow-empty -m s && "
                f"git -C sub config core.fsmonitor 'touch {markers / 'b'}' && git add sub")
    if kind == "c":
        return (f"mkdir -p .git/hooks; printf '%s' '{hook(markers / 'c')}' > .git/hooks/post-checkout; "
                "chmod +x .git/hooks/post-checkout; true")
    if kind == "d":
        return (f"git init -q inner && cd inner && git commit -q --allow-empty -m i && "
                f"printf '%s' '{hook(markers / 'd')}' > .git/hooks/post-checkout && "
                "chmod +x .git/hooks/post-checkout && "
                f"git config core.fsmonitor 'touch {markers / 'd2'}'")
    raise AssertionError(kind)


def host_uses(s: Setup) -> None:
    """What the user does next on the host: status, log, diff in the workspace and in any repository
    the sandbox made, and a checkout (which runs post-checkout)."""
    for repo in (s.ws, s.ws / "sub", s.ws / "inner"):
        if repo.exists():
            for args in (("status",), ("log", "--oneline", "-1"), ("diff",)):
                s.git(*args, cwd=repo)
    s.git("checkout", "-q", "-b", f"next-{secrets.token_hex(3)}")
    if (s.ws / "inner").exists():
        s.git("checkout", "-q", "-b", "next", cwd=s.ws / "inner")


# --------------------------------------------------------------------------- sandboxd run


@pytest.mark.parametrize("kind", ["a", "b", "c", "d"])
def test_planted_git_code_does_not_run_on_the_host(kind: str, base_dir: Path,
                                                   host_user: tuple[str, int, int]) -> None:
    s = make_setup(base_dir, host_user, template=kind != "c")
    result = run_sbx(["sh", "-c", attack_script(kind, s.markers)], workspace=s.ws, env=SANDBOX_ENV,
                     options=SANDBOX_OPTIONS)
    assert result.returncode == 0 or kind == "c", describe(result)
    host_uses(s)
    assert s.fired() == [], describe(result)
    status = s.git("status", "--short")
    assert status.returncode == 0, status.stderr
    if kind != "c":                                  # (c) is stopped by the mount: nothing to remove
        assert "sandboxd run: git guard: removed" in result.stderr, describe(result)
    else:
        assert not (s.ws / ".git" / "hooks" / "post-checkout").exists()
        assert "Read-only file system" in result.stderr, describe(result)


@pytest.mark.parametrize("kind", ["a", "b", "c", "d"])
def test_control_without_the_guard_the_planted_code_runs(kind: str, base_dir: Path,
                                                         host_user: tuple[str, int, int]) -> None:
    """The same attacks with --no-default-protect: the marker appears, so the test above can fail."""
    s = make_setup(base_dir, host_user, template=kind != "c")
    result = run_sbx(["sh", "-c", attack_script(kind, s.markers)], workspace=s.ws, env=SANDBOX_ENV,
                     options=("--no-default-protect", *SANDBOX_OPTIONS))
    assert result.returncode == 0, describe(result)
    assert "git guard" not in result.stderr
    host_uses(s)
    assert s.fired() != [], describe(result)


def test_git_commands_work_in_the_sandbox_and_on_the_host_after(setup: Setup) -> None:
    """Control: add, commit, checkout, branch, stash, fetch (from a local bare repository), gc and a
    linked worktree work in the sandbox; the guard removes nothing; the host user's git status and
    log work afterwards and show the commits."""
    s = setup
    bare = s.outside / "bare.git"
    assert s.git("clone", "-q", "--bare", str(s.ws), str(bare), cwd=s.outside).returncode == 0
    assert s.git("remote", "add", "origin", str(bare)).returncode == 0
    script = ("set -e; echo one >> file.txt; git add file.txt; git commit -qm one; git checkout -qb topic; "
              "echo two >> file.txt; git stash -q; git stash pop -q; git commit -qam two; git branch keep; "
              "git fetch -q origin; git checkout -q master 2>/dev/null || git checkout -q main; "
              "git merge -q --no-edit topic; git gc -q 2>/dev/null; git worktree add -q wt keep; "
              "git -C wt log -1 --format=%s; git log --format=%s")
    result = run_sbx(["sh", "-c", script], workspace=s.ws, env=SANDBOX_ENV, options=SANDBOX_OPTIONS)
    assert result.returncode == 0, describe(result)
    assert result.stdout.split() == ["two", "two", "one", "base"], describe(result)
    assert "git guard" not in result.stderr, describe(result)
    status = s.git("status", "--short")
    assert status.returncode == 0 and status.stdout == "?? wt/\n", status
    assert s.git("log", "--format=%s").stdout.split() == ["two", "one", "base"]
    assert s.git("branch", "--list", "keep").stdout.split()[-1] == "keep"
    assert (s.ws / ".git" / "worktrees" / "wt" / "commondir").exists()       # the worktree's own is kept
    assert s.git("log", "-1", "--format=%s", cwd=s.ws / "wt").stdout == "two\n"


def test_users_own_configuration_is_left_alone(setup: Setup) -> None:
    """What the repository had before the sandbox ran is the user's: an fsmonitor and a hook the user
    set up survive a call that changes the repository (and the user's hook still runs)."""
    s = setup
    assert s.git("config", "core.fsmonitor", f"touch {s.markers}/mine").returncode == 0
    post = s.ws / ".git" / "hooks" / "post-checkout"
    post.write_text(hook(s.markers / "myhook"))
    post.chmod(0o755)
    os.chown(post, s.uid, s.gid)
    result = run_sbx(["sh", "-c", "git add file.txt && git commit -q --allow-empty -m c && git init -q sub"],
                     workspace=s.ws, options=(*SANDBOX_OPTIONS, "--env=GIT_CONFIG_COUNT=1",
                                              "--env=GIT_CONFIG_KEY_0=core.fsmonitor", "--env=GIT_CONFIG_VALUE_0="))
    assert result.returncode == 0, describe(result)
    assert "git guard" not in result.stderr, describe(result)
    assert post.exists()
    s.git("checkout", "-q", "-b", "x")
    assert s.fired() == ["mine", "myhook"]


def test_symlinks_and_gitfiles_are_removed_not_followed(setup: Setup) -> None:
    """A new repository whose config is a symlink to a file outside, a .git symlink and a .git file
    pointing outside the workspace: the guard removes the links and never writes through them."""
    s = setup
    target = s.outside / "victim"
    target.write_text(fsmonitor_config(s.markers / "x"))
    before = target.read_text()
    script = (f"git init -q r1 && rm r1/.git/config && ln -s {target} r1/.git/config; "
              f"mkdir r2 && ln -s {s.outside} r2/.git; mkdir r3 && printf 'gitdir: {s.outside}\\n' > r3/.git; true")
    result = run_sbx(["sh", "-c", script], workspace=s.ws, env=SANDBOX_ENV, options=SANDBOX_OPTIONS)
    assert result.returncode == 0, describe(result)
    assert target.read_text() == before
    assert not os.path.lexists(s.ws / "r1" / ".git" / "config")
    assert not os.path.lexists(s.ws / "r2" / ".git") and not os.path.lexists(s.ws / "r3" / ".git")
    lines = [line for line in result.stderr.splitlines() if "git guard" in line]
    assert len(lines) == 3, describe(result)


def test_rewritten_config_keeps_safe_keys_owner_and_mode(setup: Setup) -> None:
    """Only the unsafe keys go; the new file keeps the old owner and mode, and is a new inode."""
    s = setup
    script = ("git init -q sub && cd sub && git remote add origin /x/y.git && git config user.name me && "
              "git config alias.st '!touch /x' && git config core.pager 'touch /x' && "
              "git config filter.f.clean 'touch /x' && git config include.path ../../evil && "
              "git config core.sshCommand 'touch /x' && git config remote.ev.url 'ext::sh -c touch% /x' && "
              "chmod 640 .git/config && stat -c %i .git/config")
    result = run_sbx(["sh", "-c", script], workspace=s.ws, env=SANDBOX_ENV, options=SANDBOX_OPTIONS)
    assert result.returncode == 0, describe(result)
    config = s.ws / "sub" / ".git" / "config"
    listing = s.git("config", "-f", str(config), "--list").stdout.splitlines()
    assert "remote.origin.url=/x/y.git" in listing and "user.name=me" in listing, listing
    assert not [line for line in listing if line.split("=")[0] in (
        "alias.st", "core.pager", "filter.f.clean", "include.path", "core.sshcommand", "remote.ev.url")], listing
    st = config.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (s.uid, s.gid, 0o640)
    assert str(st.st_ino) != result.stdout.strip()
    assert not [n for n in os.listdir(config.parent) if ".sandboxd-" in n]


# --------------------------------------------------------------------------- the daemon


CLIENT_ATTACK = r'''
sess = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER))
res = {"sid": sess.id, "exec": []}
for script in ARGS["scripts"]:
    out, err, code = b"", b"", None
    start = pb.ExecStart(session_id=sess.id, argv=["sh", "-c", script], env=ARGS["env"])
    for r in stub.Exec(iter([pb.ExecRequest(start=start)]), timeout=120):
        kind = r.WhichOneof("kind")
        if kind == "stdout":
            out += r.stdout
        elif kind == "stderr":
            err += r.stderr
        elif kind == "result":
            code = r.result.exit_code
    res["exec"].append([code, err.decode()[-500:]])
for path, data in ARGS["writes"]:
    stub.WriteFile(pb.WriteFileRequest(session_id=sess.id, path=path, data=data.encode(), create_parents=True))
print(json.dumps(res))
'''


def neutralized(daemon: Daemon, session_id: str) -> list[dict[str, str]]:
    from sandboxd.v1 import sandboxd_pb2 as pb
    events = daemon.stub.QueryEvents(pb.QueryEventsRequest(
        session_id=session_id, types=["GitConfigNeutralized"], page_size=1000), timeout=60).events
    return [json.loads(e.data_json) for e in events]


def close(daemon: Daemon, session_id: str) -> None:
    from daemon_helpers import close_quietly
    close_quietly(daemon.stub, session_id)


def as_user(daemon: Daemon, s: Setup, scripts: list[str], writes: list[tuple[str, str]] | None = None
            ) -> dict[str, Any]:
    from daemon_helpers import run_client_as
    return run_client_as(s.uid, s.gid, daemon.socket, CLIENT_ATTACK,
                         {"ws": str(s.ws), "scripts": scripts, "writes": writes or [], "env": SANDBOX_ENV})


@pytest.mark.parametrize("kind", ["a", "b", "d"])
def test_daemon_exec_attacks_are_neutralized(kind: str, daemon: Daemon, setup: Setup) -> None:
    s = setup
    res = as_user(daemon, s, [attack_script(kind, s.markers)])
    try:
        assert res["exec"][0][0] == 0, res
        host_uses(s)
        assert s.fired() == []
        assert s.git("status", "--short").returncode == 0
        events = neutralized(daemon, res["sid"])
        expected = {"a": ("commondir", "commondir"), "b": ("config-key", "core.fsmonitor"),
                    "d": ("hook", "post-checkout")}[kind]
        assert expected in [(e["what"], e["key"]) for e in events], events
    finally:
        close(daemon, res["sid"])


def test_daemon_mount_keeps_hooks_out_of_a_repository_without_hooks(daemon: Daemon, bare_setup: Setup) -> None:
    """(c) through the daemon: the hooks directory made at sandbox build is read-only."""
    s = bare_setup
    res = as_user(daemon, s, [attack_script("c", s.markers)])
    try:
        assert "Read-only file system" in res["exec"][0][1], res
        host_uses(s)
        assert s.fired() == []
        assert (s.ws / ".git" / "hooks").is_dir() and os.listdir(s.ws / ".git" / "hooks") == []
    finally:
        close(daemon, res["sid"])


def test_daemon_write_file_attack_is_neutralized(daemon: Daemon, setup: Setup) -> None:
    """(a) with WriteFile alone: .git/commondir and a config for it."""
    s = setup
    writes = [(str(s.ws / "evil" / "config"), fsmonitor_config(s.markers / "a")),
              (str(s.ws / ".git" / "commondir"), "../evil\n"),
              (str(s.ws / "sub" / ".git" / "config"), fsmonitor_config(s.markers / "s")),
              (str(s.ws / "sub" / ".git" / "HEAD"), "ref: refs/heads/main\n")]
    res = as_user(daemon, s, [], writes)
    try:
        assert not (s.ws / ".git" / "commondir").exists()
        host_uses(s)
        s.git("status", cwd=s.ws / "sub")
        assert s.fired() == []
        assert s.git("status", "--short").returncode == 0
        events = [(e["what"], e["key"]) for e in neutralized(daemon, res["sid"])]
        assert ("commondir", "commondir") in events and ("config-key", "core.fsmonitor") in events, events
        assert all(e["repo"].startswith(str(s.ws)) for e in neutralized(daemon, res["sid"]))
    finally:
        close(daemon, res["sid"])


def test_daemon_background_job_end_and_session_close_inspect(daemon: Daemon, setup: Setup) -> None:
    """A background job that ends is inspected before it is reported ended; one still running when
    the session closes is inspected by the close, after its processes are gone."""
    from sandboxd.v1 import sandboxd_pb2 as pb
    s = setup
    stub = daemon.stub
    res = as_user(daemon, s, [])
    sid = res["sid"]
    try:
        job = stub.StartBackground(pb.StartBackgroundRequest(
            session_id=sid, argv=["sh", "-c", attack_script("b", s.markers)], env=SANDBOX_ENV), timeout=60)
        deadline = time.monotonic() + 60
        while stub.ListBackground(pb.ListBackgroundRequest(session_id=sid), timeout=60).processes[0].running:
            assert time.monotonic() < deadline, "the background job did not end"
            time.sleep(0.05)
        assert ("config-key", "core.fsmonitor") in [(e["what"], e["key"]) for e in neutralized(daemon, sid)]
        assert "fsmonitor" not in (s.ws / "sub" / ".git" / "config").read_text()
        script = (attack_script("d", s.markers) + " && touch ../planted && sleep 600")
        stub.StartBackground(pb.StartBackgroundRequest(session_id=sid, argv=["sh", "-c", script],
                                                       env=SANDBOX_ENV), timeout=60)
        while not (s.ws / "planted").exists():
            assert time.monotonic() < deadline, "the second job did not plant"
            time.sleep(0.05)
        assert (s.ws / "inner" / ".git" / "hooks" / "post-checkout").exists()      # not inspected yet
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=60)
        assert not (s.ws / "inner" / ".git" / "hooks" / "post-checkout").exists()
        host_uses(s)
        assert s.fired() == []
        assert job.id
    finally:
        close(daemon, sid)


# --------------------------------------------------------------------------- the config filter


TRICKY_CONFIGS = [
    '[core]\n\trepositoryformatversion = 0\n\tfsmonitor = "touch /x"\n[remote "origin"]\n\turl = /x/y\n',
    '[core] fsmonitor = a\\\n b ; c\n[Core]bare\n[branch.main]\nremote=origin # hi\n[alias]\n x = "!sh -c \\"a\\""\n',
    '[include]\npath=../evil\n[remote "a\\"b"]\nurl = ext::sh -c x\n[CORE]\n\tHooksPath = /tmp\n',
    '[core]\n\tsshCommand = touch /x\n[filter "f"]\n\tclean = touch /x\n[diff "d"]\n\ttextconv = touch /x\n'
    '[user]\n\tname = "me ; not a comment"\n[includeIf "gitdir:/"]\n\tpath = /x\n',
]


@pytest.mark.parametrize("text", TRICKY_CONFIGS)
def test_config_filter_reads_like_git_and_leaves_only_safe_keys(text: str, tmp_path: Path) -> None:
    """The filter parses as real git does, and what it writes git reads back as only safe keys."""
    from sandboxd.policy.git_config import SAFE_KEYS, filter_config, parse
    path = tmp_path / "config"
    path.write_text(text)

    def git_list() -> list[tuple[str, str | None]]:
        out = subprocess.run(["git", "config", "-f", str(path), "--null", "--list"], capture_output=True,
                             text=True, check=True).stdout
        items = []
        for item in out.split("\0")[:-1]:
            key, sep, value = item.partition("\n")
            items.append((key, value if sep else None))
        return items

    assert [e.ident() for e in parse(text)] == git_list()
    new, dropped = filter_config(text)
    assert new is not None and dropped
    path.write_text(new)
    for key, value in git_list():
        section, _, name = key.partition(".")
        middle, _, last = name.rpartition(".")
        assert f"{section}.{'*.' if middle else ''}{last}" in SAFE_KEYS, key
        assert not (value or "").startswith("ext::")


def test_gitfile_rewritten_in_place_is_checked_again(setup: Setup) -> None:
    """A .git file that pointed inside the workspace, rewritten in place (same inode: no directory
    event, no ctime change on its directory) to point outside: the guard notices and removes it."""
    s = setup
    script = (f"git init -q real && mkdir wt && printf 'gitdir: ../real/.git\\n' > wt/.git && "
              f"stat -c %i wt/.git && sleep 0.01 && printf 'gitdir: {s.outside}\\n' 1<> wt/.git && stat -c %i wt/.git")
    result = run_sbx(["sh", "-c", script], workspace=s.ws, env=SANDBOX_ENV, options=SANDBOX_OPTIONS)
    assert result.returncode == 0, describe(result)
    first, second = result.stdout.split()
    assert first == second                                   # really the same inode
    assert f"removed gitfile '{s.outside}'" in result.stderr, describe(result)
    assert not os.path.lexists(s.ws / "wt" / ".git")


def test_daemon_gitfile_rewritten_in_place_by_a_later_call(daemon: Daemon, setup: Setup) -> None:
    """Call 1 makes wt/.git point at a repository inside the workspace (kept); call 2 rewrites that
    file in place (same inode) to point outside: the inspection after call 2 removes it."""
    s = setup
    res = as_user(daemon, s, ["git init -q real && mkdir wt && printf 'gitdir: ../real/.git\\n' > wt/.git",
                              f"printf 'gitdir: {s.outside}\\n' 1<> wt/.git"])
    try:
        assert [r[0] for r in res["exec"]] == [0, 0], res
        assert not os.path.lexists(s.ws / "wt" / ".git")
        assert [(e["what"], e["key"]) for e in neutralized(daemon, res["sid"])] == [("gitfile", str(s.outside))]
    finally:
        close(daemon, res["sid"])


def test_daemon_git_commands_work_and_nothing_is_removed(daemon: Daemon, setup: Setup) -> None:
    """Control through the daemon: ordinary git work in the session (and a repository it makes,
    with a remote and an identity) leaves nothing for the guard; the host user sees the commits."""
    s = setup
    script = ("set -e; echo one >> file.txt; git add file.txt; git commit -qm one; git checkout -qb topic; "
              "echo two >> file.txt; git stash -q; git stash pop -q; git commit -qam two; git branch keep; "
              "git gc -q 2>/dev/null; git init -q fresh; git -C fresh remote add origin /x/y.git; "
              "git -C fresh config user.name me")
    res = as_user(daemon, s, [script])
    try:
        assert res["exec"][0][0] == 0, res
        assert neutralized(daemon, res["sid"]) == []
        assert s.git("log", "--format=%s").stdout.split() == ["two", "one", "base"]
        assert s.git("status", "--short").returncode == 0
        assert s.git("config", "remote.origin.url", cwd=s.ws / "fresh").stdout == "/x/y.git\n"
    finally:
        close(daemon, res["sid"])


@pytest.mark.parametrize("watch", [True, False], ids=["inotify", "ctime-walk"])
def test_guard_finds_plants_with_and_without_inotify(watch: bool, setup: Setup) -> None:
    """The guard's two ways of finding what changed (inotify; the ctime walk it falls back to when the
    kernel's inotify limits are reached) find the same plants, deep in the tree too. The sandbox
    runs with --no-default-protect so that only this guard looks."""
    from sandboxd.gitguard.guard import GitGuard
    s = setup
    guard = GitGuard([str(s.ws)], watch=watch)
    try:
        assert (guard.inspect(), guard.inotify is not None) == ([], watch)
        script = (f"mkdir -p a/b/c && cd a/b/c && {attack_script('d', s.markers)} && cd /; cd {s.ws} && "
                  "printf '../evil\\n' > .git/commondir")
        result = run_sbx(["sh", "-c", script], workspace=s.ws, env=SANDBOX_ENV,
                         options=("--no-default-protect", *SANDBOX_OPTIONS))
        assert result.returncode == 0, describe(result)
        found = sorted((n.what, n.key) for n in guard.inspect())
        assert found == [("commondir", "commondir"), ("config-key", "core.fsmonitor"), ("hook", "post-checkout")]
        assert guard.inspect() == []
        host_uses(s)
        s.git("checkout", "-q", "-b", "y", cwd=s.ws / "a" / "b" / "c" / "inner")
        s.git("status", cwd=s.ws / "a" / "b" / "c" / "inner")
        assert s.fired() == []
    finally:
        guard.close()


# --------------------------------------------------------------------------- issue 16: git's own reading


def issue16_script(markers: Path) -> str:
    """The three .git-file variants of issue 16, each naming a git directory hidden in the writable
    .git/objects/ (a file over 4096 bytes; a trailing blank, part of the path for git; a symlinked
    component) and reached by a gitlink in the index, plus a rebase stopped at `break` with an
    `exec` line queued."""
    e = ".git/objects/ab"
    todo = f"break\\nexec touch {markers}/rebase\\n"
    return (f"set -e; mkdir -p {e}; "
            f"git init -q --separate-git-dir \"$PWD/{e}/big\" s1; git init -q --separate-git-dir \"$PWD/{e}/blank \" s2; "
            f"git init -q --separate-git-dir \"$PWD/{e}/linked\" s3; ln -s {e} lnk; "
            f"for i in 1 2 3; do git -C s$i commit -q --allow-empty -m s; "
            f"git -C s$i config core.fsmonitor \"touch {markers}/s$i; :\"; done; "
            f"{{ printf 'gitdir: ../{e}/big'; head -c 5000 /dev/zero | tr '\\0' '\\n'; }} > s1/.git; "
            f"printf 'gitdir: ../{e}/blank \\n' > s2/.git; printf 'gitdir: ../lnk/linked\\n' > s3/.git; "
            "for i in 1 2 3; do git update-index --add --cacheinfo 160000,$(git -C s$i rev-parse HEAD),s$i; done; "
            f"git commit -qm subs; GIT_SEQUENCE_EDITOR=\"printf '{todo}' >\" git rebase -q -i HEAD")


def issue16_host_uses(s: Setup) -> None:
    for args in (("status",), ("diff",), ("rebase", "--continue")):
        s.git(*args)
    for i in (1, 2, 3):
        s.git("status", cwd=s.ws / f"s{i}")


def test_issue16_control_the_owner_planting_it_fires(base_dir: Path, host_user: tuple[str, int, int]) -> None:
    """Control: the same plant made by the workspace owner on the host fires every payload."""
    s = make_setup(base_dir / "control", host_user)
    done = subprocess.run(["runuser", "-u", s.user, "--", *HOST_GIT_ENV, "sh", "-c", issue16_script(s.markers)],
                          cwd=s.ws, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    issue16_host_uses(s)
    assert s.fired() == ["rebase", "s1", "s2", "s3"]


def test_daemon_issue16_gitfiles_and_stopped_rebase_are_neutralized(daemon: Daemon, setup: Setup) -> None:
    """Through the daemon, as the owner: after CloseSession nothing planted runs under host git, and
    each removal is a GitConfigNeutralized event."""
    s = setup
    res = as_user(daemon, s, [issue16_script(s.markers)])
    close(daemon, res["sid"])
    assert res["exec"][0][0] == 0, res
    issue16_host_uses(s)
    assert s.fired() == []
    events = {(e["what"], e["key"]) for e in neutralized(daemon, res["sid"])}
    assert ("sequencer", "rebase-merge") in events and ("config-key", "core.fsmonitor") in events, events
    assert s.git("status", "--short").returncode == 0


def test_layouts_git_itself_makes_are_kept(setup: Setup) -> None:
    """Control for the .git-file rules: a submodule added in a repository made in the sandbox (its
    .git file names <gitdir>/modules/NAME), a linked worktree, a repository made with
    --separate-git-dir and an interactive rebase with an `exec` line that finishes inside the call
    leave no .git file, hook or sequencer state removed; host git works in each afterwards."""
    s = setup
    source = s.outside / "lib"
    assert s.git("init", "-q", str(source), cwd=s.outside).returncode == 0
    assert s.git("commit", "-q", "--allow-empty", "-m", "lib", cwd=source).returncode == 0
    script = (f"set -e; git init -q fresh; cd fresh; git commit -q --allow-empty -m f; "
              f"git -c protocol.file.allow=always submodule add -q {source} lib; git commit -qm lib; cd ..; "
              "git worktree add -q wt; mkdir store; git init -q --separate-git-dir \"$PWD/store/sep.git\" sep; "
              "git -C sep commit -q --allow-empty -m sep; "
              "GIT_SEQUENCE_EDITOR=\"sed -i '1i exec touch exec-ran'\" git rebase -q -i HEAD; test -e exec-ran")
    result = run_sbx(["sh", "-c", script], workspace=s.ws, env=SANDBOX_ENV, options=SANDBOX_OPTIONS)
    assert result.returncode == 0, describe(result)
    removed = [line for line in result.stderr.splitlines() if "git guard: removed" in line]
    # git submodule add writes core.worktree into the submodule's config: not a safe key, dropped.
    assert all("config-key 'core.worktree'" in line for line in removed), describe(result)
    for repo in ("fresh/lib", "wt", "sep"):
        assert (s.ws / repo / ".git").is_file(), repo
        assert s.git("status", "--short", cwd=s.ws / repo).returncode == 0, repo
    assert s.git("submodule", "status", cwd=s.ws / "fresh").stdout.split()[1] == "lib"
    assert not (s.ws / ".git" / "rebase-merge").exists() and s.fired() == []
