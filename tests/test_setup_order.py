"""The order of a sandbox's setup, recorded without root: the session init's (sequence._build_sandbox,
rootfs.build: namespaces, the mount tree, pivot_root, the privilege drop) and a call's
(sequence.run_call and _run_command, up to exec) run against tests/syscall_recorder.py, which
records each kernel call instead of making it. Each sequence is asserted as a numbered list (as
codex-rs's linux-sandbox asserts its mounts): moving one step moves its number, and the test
fails. Only the order: what each step blocks is tested against the real kernel
(test_call_paths, test_sandbox*, test_hostile_tenants)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from sandboxd.kernel import overlay, syscalls
from sandboxd.launcher import report, sequence
from sandboxd.launcher.plan import LaunchPlan
from sandboxd.policy import Limits
from sandboxd.policy.git_dirs import FoundGitDirs
from syscall_recorder import SyscallRecorder

WORKSPACE = "/srv/ws"
# The host as the recorder's lookups see it: what /proc and /sys hold, a workspace with a git
# repository, sandboxd's own directory.
HOST = {
    **{f"/proc/{name}": "dir" for name in ("sys", "irq", "bus", "fs", "driver")},
    **{f"/proc/{name}": "file" for name in ("sysrq-trigger", "kcore", "keys", "timer_list", "kallsyms", "kmsg")},
    "/sys/firmware": "dir", "/sys/kernel/security": "dir", "/sys/kernel/debug": "dir",
    "/etc/resolv.conf": "link:/run/systemd/resolve/stub-resolv.conf",
    "/run/systemd/resolve/stub-resolv.conf": "file",
    WORKSPACE: "dir", f"{WORKSPACE}/.git": "dir", f"{WORKSPACE}/.git/config": "file",
    f"{WORKSPACE}/.git/hooks": "dir", f"{WORKSPACE}/.git/HEAD": "file", f"{WORKSPACE}/.git/objects": "dir",
    "/run/sandboxd": "dir",
}


def make_plan(**changes: object) -> LaunchPlan:
    tree = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)      # closed by the build, as a real tree is
    plan = LaunchPlan(argv=("/bin/true",), env={"PATH": "/usr/bin:/bin"}, cwd=WORKSPACE, workspace=WORKSPACE,
                      confined=True, network=False, network_isolated=False, writable_roots=(WORKSPACE,),
                      readonly_roots=(), protected_subpaths=(".git/hooks", ".git/config"), uid=1000, gid=1000,
                      limits=Limits(cpu_seconds=60, open_files=256), seccomp_program=b"", brokers_connect=False,
                      root_trees={WORKSPACE: tree}, hidden_paths=("/run/sandboxd",),
                      git_dirs={WORKSPACE: FoundGitDirs(git_dirs=(".git",))})
    return plan.replace(**changes) if changes else plan


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[SyscallRecorder]:
    fake = SyscallRecorder(HOST)
    monkeypatch.setattr(syscalls, "current", fake)
    yield fake


R = "/tmp/root"
SESSION_INIT = [
    "unshare mnt,ipc,uts,cgroup,net",                     # every namespace before any mount
    "loopback up",
    "sethostname sandbox",
    "make-rprivate /",                                    # nothing propagates to the host from here on
    "mount tmpfs /tmp nosuid,nodev",
    f"mkdir {R}",
    f"bind / -> {R}",
    f"setattr -R {R} +ro,nosuid,nodev",                   # the whole copy read-only ...
    f"mount proc {R}/proc nosuid,nodev,noexec",           # ... then a /proc of the new PID namespace
    f"bind {R}/proc/sys -> {R}/proc/sys",
    f"setattr -R {R}/proc/sys +ro,nosuid,nodev",
    f"bind {R}/proc/sysrq-trigger -> {R}/proc/sysrq-trigger",
    f"setattr -R {R}/proc/sysrq-trigger +ro,nosuid,nodev",
    f"bind {R}/proc/irq -> {R}/proc/irq",
    f"setattr -R {R}/proc/irq +ro,nosuid,nodev",
    f"bind {R}/proc/bus -> {R}/proc/bus",
    f"setattr -R {R}/proc/bus +ro,nosuid,nodev",
    f"bind {R}/proc/fs -> {R}/proc/fs",
    f"setattr -R {R}/proc/fs +ro,nosuid,nodev",
    f"bind {R}/proc/driver -> {R}/proc/driver",
    f"setattr -R {R}/proc/driver +ro,nosuid,nodev",
    f"bind /dev/null -> {R}/proc/kcore (one mount)",
    f"bind /dev/null -> {R}/proc/keys (one mount)",
    f"bind /dev/null -> {R}/proc/timer_list (one mount)",
    f"bind /dev/null -> {R}/proc/kallsyms (one mount)",
    f"bind /dev/null -> {R}/proc/kmsg (one mount)",
    f"mount sysfs {R}/sys ro,nosuid,nodev,noexec",
    f"mount tmpfs {R}/sys/firmware ro,nosuid,nodev,noexec",
    f"mount tmpfs {R}/sys/kernel/security ro,nosuid,nodev,noexec",
    f"mount tmpfs {R}/sys/kernel/debug ro,nosuid,nodev,noexec",
    f"mount tmpfs {R}/dev nosuid,noexec",
    *(line for name in ("null", "zero", "full", "random", "urandom", "tty")
      for line in (f"create {R}/dev/{name}", f"bind /dev/{name} -> {R}/dev/{name} (one mount)")),
    f"mkdir {R}/dev/pts",
    f"mount devpts {R}/dev/pts nosuid,noexec",
    f"symlink {R}/dev/ptmx -> pts/ptmx",
    f"mkdir {R}/dev/shm",
    f"mount tmpfs {R}/dev/shm nosuid,nodev",
    f"symlink {R}/dev/fd -> /proc/self/fd",
    f"symlink {R}/dev/stdin -> /proc/self/fd/0",
    f"symlink {R}/dev/stdout -> /proc/self/fd/1",
    f"symlink {R}/dev/stderr -> /proc/self/fd/2",
    f"remount {R}/dev ro,nosuid,noexec",                  # /dev read-only once its nodes are in
    f"mount tmpfs {R}/tmp nosuid,nodev",
    f"move_mount {R}{WORKSPACE}",                         # the writable root, after the read-only copy
    f"setattr -R {R}{WORKSPACE} +nosuid,nodev -ro",
    f"bind {R}{WORKSPACE}/.git -> {R}{WORKSPACE}/.git",   # its git directory pinned, then protected
    f"bind {R}{WORKSPACE}/.git/config -> {R}{WORKSPACE}/.git/config",
    f"setattr -R {R}{WORKSPACE}/.git/config +ro,nosuid,nodev",
    f"bind {R}{WORKSPACE}/.git/hooks -> {R}{WORKSPACE}/.git/hooks",
    f"setattr -R {R}{WORKSPACE}/.git/hooks +ro,nosuid,nodev",
    f"mount tmpfs {R}/run/sandboxd ro,nosuid,nodev,noexec",  # sandboxd's own places, after the roots
    f"pivot_root {R}",                                    # the last mount step
    f"chdir {WORKSPACE}",
    "title sandboxd-session",
    "drop privileges to 1000:1000",                       # after every mount (they need CAP_SYS_ADMIN)
    "pdeathsig, parent 0",                                # again, the credential change cleared it
    "dumpable 0",
]


def _numbered(calls: list[str]) -> list[str]:
    return [f"{index}. {call}" for index, call in enumerate(calls, 1)]


def test_the_session_init_sets_up_in_order(recorder: SyscallRecorder) -> None:
    sequence._build_sandbox(make_plan(), "sandboxd-session")
    assert _numbered(recorder.calls) == _numbered(SESSION_INIT), recorder.numbered()


def test_a_reviewed_root_is_an_overlay_over_its_attached_tree(recorder: SyscallRecorder) -> None:
    """Review mode (kernel.overlay): the layers opened right after the namespace is private (before
    /tmp is covered), each overlay mounted over its root as soon as that is attached, before the
    protections and the hiding of sandboxd's places (the review directory among them)."""
    review = "/var/lib/sandboxd/review/s1"
    layers = overlay.Layers(root=WORKSPACE, upper=f"{review}/0/upper", work=f"{review}/0/work", userxattr=False,
                            root_dev=1, root_ino=2, started_ns=0)
    sequence._build_sandbox(make_plan(review_layers={WORKSPACE: layers}), "sandboxd-session")
    expected = list(SESSION_INIT)
    private = expected.index("make-rprivate /") + 1
    expected[private:private] = [f"open {review}/0/upper", f"open {review}/0/work"]
    attach = expected.index(f"move_mount {R}{WORKSPACE}")
    expected[attach + 1:attach + 1] = [f"open {R}{WORKSPACE}", f"mount overlay {R}{WORKSPACE} nosuid,nodev"]
    # Its git directory is not walked for nor protected as a whole (review flags what the sandbox
    # writes there): only the policy's protected subpaths are, in their order.
    git = expected.index(f"bind {R}{WORKSPACE}/.git/config -> {R}{WORKSPACE}/.git/config")
    assert expected[git:git + 4] == [
        f"bind {R}{WORKSPACE}/.git/config -> {R}{WORKSPACE}/.git/config", f"setattr -R {R}{WORKSPACE}/.git/config +ro,nosuid,nodev",
        f"bind {R}{WORKSPACE}/.git/hooks -> {R}{WORKSPACE}/.git/hooks", f"setattr -R {R}{WORKSPACE}/.git/hooks +ro,nosuid,nodev"]
    expected[git:git + 4] = [*expected[git + 2:git + 4], *expected[git:git + 2]]
    assert _numbered(recorder.calls) == _numbered(expected), recorder.numbered()


def test_checkpoint_layers_are_opened_with_the_others_and_stacked(recorder: SyscallRecorder) -> None:
    """A review session with checkpoints (review.checkpoints): its layers opened in step 1b with the
    upper and work directories (before /tmp is covered), and the overlay mounted with them stacked."""
    review = "/var/lib/sandboxd/review/s1"
    layers = overlay.Layers(root=WORKSPACE, upper=f"{review}/0/upper", work=f"{review}/0/work", userxattr=False,
                            root_dev=1, root_ino=2, started_ns=0,
                            checkpoints=(f"{review}/0/checkpoints/1", f"{review}/0/checkpoints/3"))
    sequence._build_sandbox(make_plan(review_layers={WORKSPACE: layers}), "sandboxd-session")
    calls = recorder.calls
    private = calls.index("make-rprivate /")
    assert calls[private + 1:private + 5] == [f"open {review}/0/upper", f"open {review}/0/work",
                                              f"open {review}/0/checkpoints/1", f"open {review}/0/checkpoints/3"]
    assert f"mount overlay {R}{WORKSPACE} nosuid,nodev checkpoints=2" in calls, recorder.numbered()


def test_the_order_holds_the_rules_it_is_for(recorder: SyscallRecorder) -> None:
    """The same sequence, asserted as the rules docs/policies.md states (a reader's check of the list
    above), with an isolated network and a resolv.conf this time."""
    sequence._build_sandbox(make_plan(network=True, network_isolated=True, netns_fd=7,
                                      resolv_conf="nameserver 10.0.0.1\n"), "sandboxd-session")
    calls = recorder.calls
    at = {call: index for index, call in reversed(list(enumerate(calls)))}   # the first of each
    assert calls[:2] == ["unshare mnt,ipc,uts,cgroup", "setns net"], recorder.numbered()
    assert "loopback up" not in calls                      # the spawner's namespace has its own link
    assert at["make-rprivate /"] < min(i for i, c in enumerate(calls) if c.startswith(("mount", "bind")))
    assert at[f"setattr -R {R} +ro,nosuid,nodev"] < at[f"move_mount {R}{WORKSPACE}"]
    assert at["unshare mnt,ipc,uts,cgroup"] < at[f"mount proc {R}/proc nosuid,nodev,noexec"]
    resolv = f"{R}/run/systemd/resolve/stub-resolv.conf"   # followed inside the copy, not bound over the link
    assert calls[at["write /tmp/resolv.conf"]:at["write /tmp/resolv.conf"] + 3] == [
        "write /tmp/resolv.conf", f"bind /tmp/resolv.conf -> {resolv}", f"remount {resolv} ro,nosuid,nodev"]
    assert at[f"remount {resolv} ro,nosuid,nodev"] < at[f"mount tmpfs {R}/run/sandboxd ro,nosuid,nodev,noexec"]
    last_mount = max(i for i, c in enumerate(calls) if c.split()[0] in ("mount", "bind", "remount", "setattr"))
    assert last_mount < at[f"pivot_root {R}"] < at["drop privileges to 1000:1000"], recorder.numbered()


CA_PEM = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"


def test_a_trusted_certificate_is_bound_over_each_system_bundle_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 8e: with trust_pem the host bundle and the certificates go in one staging file, bound
    read-only over each system bundle the copy holds: a symlink followed inside the copy, two names
    of one file bound once, a bundle the copy lacks skipped; after sandboxd's places are hidden and
    before pivot_root. Without trust_pem nothing is written (SESSION_INIT above)."""
    recorder = SyscallRecorder({**HOST, "/etc/ssl/certs/ca-certificates.crt": "link:/usr/share/bundle.pem",
                                "/usr/share/bundle.pem": "file",
                                "/etc/ssl/cert.pem": "link:/etc/ssl/certs/ca-certificates.crt"})
    monkeypatch.setattr(syscalls, "current", recorder)
    sequence._build_sandbox(make_plan(trust_pem=CA_PEM, trust_source="/etc/ssl/certs/ca-certificates.crt"),
                            "sandboxd-session")
    expected = list(SESSION_INIT)
    hidden = expected.index(f"mount tmpfs {R}/run/sandboxd ro,nosuid,nodev,noexec")
    expected[hidden + 1:hidden + 1] = [
        f"write /tmp/trust-bundle.pem <- /etc/ssl/certs/ca-certificates.crt + {len(CA_PEM)} bytes",
        f"bind /tmp/trust-bundle.pem -> {R}/usr/share/bundle.pem (one mount)",
        f"remount {R}/usr/share/bundle.pem ro,nosuid,nodev"]
    assert _numbered(recorder.calls) == _numbered(expected), recorder.numbered()


CALL = [
    "pdeathsig, parent 0",                                # the call's supervisor, in the session
    "join cgroups /sys/fs/cgroup/test-call",              # before anything forks
    "setns mnt,ipc,uts,cgroup,net",
    f"chdir {WORKSPACE}",
    "child subreaper",
    "title sandboxd-call",
    "oom score adj",                                      # the call before the session's init, if memory runs out
    "drop privileges to 1000:1000",                       # before the command exists
    "pdeathsig, parent 0",
    "dumpable 0",
    "fork",                                               # the command, from here
    "default signals",                                    # and nothing held
    "pdeathsig, parent {supervisor}",
    "setsid",
    "ptracer 1",                                          # the session's init, its connect broker (Yama)
    "rlimits cpu=60 files=256",
    "verify dropped",
    f"landlock writes {WORKSPACE} /tmp /dev/shm; files /dev /proc",   # needs no_new_privs (the drop set it)
    "close-on-exec from 3",
    "seccomp",                                            # last, nothing after it but exec
    "execve /bin/true",
]


def record_in_child(body: Callable[[int, int], object]) -> list[str]:
    """The calls ``body(report_fd, status_fd)`` makes, run in a forked child (a setup sequence
    never returns: it ends in exec, which the recorder turns into the end of the child)."""
    record_r, record_w = os.pipe()
    report_r, report_w = os.pipe()
    status_r, status_w = os.pipe()
    pid = os.fork()
    if pid == 0:                                           # pragma: no cover - the child
        try:
            os.close(record_r)

            def dump() -> None:
                os.write(record_w, "\n".join(fake.calls).encode())
                os._exit(0)

            fake = SyscallRecorder(HOST, on_exec=dump)
            syscalls.current = fake
            body(report_w, status_w)
        finally:
            os._exit(report.SETUP_FAILED_EXIT)
    for fd in (record_w, report_w, status_w):
        os.close(fd)
    try:
        _, status = os.waitpid(pid, 0)
        with os.fdopen(record_r, "rb") as f:
            calls = f.read().decode().splitlines()
        with os.fdopen(report_r, "rb") as f:
            failure = f.read().decode()
    finally:
        os.close(status_r)
    assert os.waitstatus_to_exitcode(status) == 0, failure
    return calls


def test_a_call_sets_up_in_order() -> None:
    """run_call: its supervisor's steps, the fork (the recorder follows the command's side), the
    command's steps, exec."""
    supervisor = os.getpid()                               # the child's parent: run_call's "fork" is recorded only
    calls = record_in_child(lambda report_fd, status_fd: sequence.run_call(
        make_plan(), session_pidfd=5, intake_fd=None, report_fd=report_fd, status_fd=status_fd,
        cgroup_dirs=["/sys/fs/cgroup/test-call"]))
    expected = [line.format(supervisor=supervisor) for line in CALL]
    assert _numbered(calls) == _numbered(expected), "\n".join(_numbered(calls))


def test_a_one_shot_sandbox_sets_up_in_order() -> None:
    """`sandboxd run`'s init: the session's build (as init, PID 1), then its command's steps."""
    calls = record_in_child(lambda report_fd, status_fd: sequence._run_init(
        make_plan(), report_fd=report_fd, status_fd=status_fd))
    expected = [line.replace("title sandboxd-session", "title sandboxd-init") for line in SESSION_INIT]
    expected += ["hold forwarded signals", "fork",             # held until init forwards them
                 "default signals", "pdeathsig, parent 1", *[line for line in CALL[CALL.index("setsid"):] if line != "ptracer 1"]]
    assert _numbered(calls) == _numbered(expected), "\n".join(_numbered(calls))
