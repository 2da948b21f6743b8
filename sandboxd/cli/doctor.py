"""`sandboxd doctor`: check this machine for everything enforcement needs, in plain words.

Each check prints one line: ``ok``, ``warn`` (works, with less) or ``FAIL`` (a policy could not
be enforced), and for anything not ok, what to do. Exit status 1 when something FAILs. The
sandbox, limits, isolated network and call helper checks build real sandboxes (a session with a
memory and a pids limit proves both hold) and remove them; nothing else changes the machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from sandboxd.printable import printable

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def _failure(exc: Exception) -> tuple[str, str]:
    """What failed, and the fix, apart (a SetupError's message ends with its hint)."""
    hint = getattr(exc, "hint", None)
    text = str(exc)
    if hint and text.endswith("; " + hint):
        text = text[:-len(hint) - 2]
    return text, hint or "see the error above"


def _line(status: str, what: str, detail: str, fix: str = "") -> tuple[str, str]:
    """One check's line (and its fix), printable: the detail may quote what the machine holds (a
    path, a cgroup's content, a command's error), which whoever could write there chose."""
    text = f"{status:<5} {printable(what)}: {printable(detail)}"
    if fix:
        text += f"\n      fix: {printable(fix)}"
    return status, text


def check_root() -> tuple[str, str]:
    if os.geteuid() == 0:
        return _line("ok", "privileges", "running as root (namespaces, mounts, cgroups and networks need it)")
    return _line("FAIL", "privileges", f"running as uid {os.geteuid()}",
                 "run sandboxd as root (the systemd unit does), or in a container with CAP_SYS_ADMIN")


def check_sandbox() -> tuple[str, str]:
    """A real sandbox: namespaces, mounts, pivot_root, seccomp, Landlock, exec."""
    from sandboxd.errors import SandboxdError
    from sandboxd.policy import LaunchSpec, WorkspaceWrite
    from sandboxd.supervisor.spawner import Spawner

    workspace = tempfile.mkdtemp(prefix="sandboxd-doctor-", dir="/var/tmp")
    try:
        null = os.open(os.devnull, os.O_RDWR)
        try:
            proc = Spawner().launch(LaunchSpec(argv=("true",), workspace=workspace, policy=WorkspaceWrite(),
                                               env={"PATH": "/usr/bin:/bin"}), stdio=(null, null, null))
            proc.wait_started()
            info = proc.wait(30)
        finally:
            os.close(null)
    except SandboxdError as exc:
        return _line("FAIL", "sandbox", f"a workspace-write sandbox could not start: {exc}",
                     getattr(exc, "hint", None) or "see the error above")
    finally:
        os.rmdir(workspace)
    if info.exit_code != 0:
        return _line("FAIL", "sandbox", f"`true` in a sandbox ended with {info.shell_status}")
    return _line("ok", "sandbox", "namespaces (mount, pid, ipc, uts, cgroup, net), read-only root, pivot_root, "
                 "seccomp and exec all work")


def check_seccomp() -> tuple[str, str]:
    try:
        with open("/proc/sys/kernel/seccomp/actions_avail") as f:
            actions = f.read().split()
    except OSError:
        return _line("FAIL", "seccomp", "the kernel has no seccomp filter support", "a kernel with CONFIG_SECCOMP_FILTER")
    if "user_notif" not in actions:
        return _line("FAIL", "seccomp", "no user notification: host Unix sockets could not be guarded",
                     "Linux 5.0 or newer")
    return _line("ok", "seccomp", f"filters with {', '.join(actions)}")


YAMA_PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


def check_yama() -> tuple[str, str]:
    """Yama's ptrace scope: the connect broker reads each caller's address and duplicates its socket,
    ptrace-attach checks that a scope above 0 narrows (docs/policies.md, "Yama")."""
    try:
        with open(YAMA_PTRACE_SCOPE) as f:
            scope = int(f.read())
    except (OSError, ValueError):
        return _line("ok", "yama", "no Yama ptrace scope: the connect broker reaches every process of its sandbox")
    if scope == 0:
        return _line("ok", "yama", "ptrace_scope 0: the connect broker reaches every process of its sandbox")
    if scope == 1:
        return _line("warn", "yama", "ptrace_scope 1: in a daemon session, a process a call's command forks "
                     "cannot connect() (EPERM); the command itself and one-shot sandboxes can",
                     "kernel.yama.ptrace_scope=0 if session commands fork clients (docs/policies.md, \"Yama\")")
    return _line("warn", "yama", f"ptrace_scope {scope}: the connect broker has no CAP_SYS_PTRACE, so no "
                 "confined sandbox can connect() (EPERM)", "kernel.yama.ptrace_scope=1 or 0")


def check_landlock() -> tuple[str, str]:
    from sandboxd.kernel import landlock

    abi = landlock.abi_version()
    if abi == 0:
        return _line("warn", "landlock", "not available: the read-only mounts are the only wall for writes",
                     "Linux 5.13+ with landlock in the lsm= boot parameter")
    if abi < 6:
        return _line("warn", "landlock", f"ABI {abi}: writes are restricted, but signals to the host are not scoped",
                     "Linux 6.12 or newer for ABI 6")
    return _line("ok", "landlock", f"ABI {abi} (writes by path, signal scope)")


def check_cgroups() -> tuple[str, str]:
    from sandboxd.kernel import cgroups

    h = cgroups.hierarchies()
    where = {c: cgroups.where(c) for c in ("memory", "pids")}
    found = {c: v for c, v in where.items() if v}
    detail = ", ".join(f"{c} on cgroup {v}" for c, v in sorted(found.items())) or "no controller"
    if h.unified and "v2" in found.values():
        detail += f" (below {h.unified_own})"
    missing = [c for c, v in where.items() if not v]
    if missing:
        return _line("FAIL", "cgroups", f"{detail}; no {' or '.join(missing)} controller for this process's cgroup "
                     f"{h.unified_own}: --memory/--pids limits are refused", cgroups.DELEGATE_HINT)
    return _line("ok", "cgroups", detail)


# Run in the limited session below: 128 MiB touched under a 64 MiB limit, then 64 children under 16 pids.
_LIMIT_MEMORY, _LIMIT_PIDS = 64 << 20, 16
_ALLOCATE = ("b = bytearray(128 << 20)\n"
             "for i in range(0, len(b), 4096): b[i] = 1\n"
             "print('ALIVE')\n")
_FORK = ("import os, time\n"
         "n = 0\n"
         "try:\n"
         "    for _ in range(64):\n"
         "        if os.fork() == 0:\n"
         "            time.sleep(3); os._exit(0)\n"
         "        n += 1\n"
         "    print('FORKED', n)\n"
         "except OSError as e:\n"
         "    print('FORK-FAILED', e.errno, n)\n")


class _Session:
    """A real session sandbox (what the daemon builds), closed on exit; ``call`` runs one command in it
    through the call helper when ``helper`` is set, and returns (ExitInfo, stdout)."""

    def __init__(self, *, limits: bool = False, network: bool = False, helper: str | None = None) -> None:
        self.limits, self.network, self.helper = limits, network, helper

    def __enter__(self) -> "_Session":
        from sandboxd.policy import LaunchSpec, Limits, WorkspaceWrite
        from sandboxd.supervisor.spawner import Spawner

        self.workspace = tempfile.mkdtemp(prefix="sandboxd-doctor-", dir="/var/tmp")
        self.spawner = Spawner(native_helper=self.helper)
        limits = Limits(memory_bytes=_LIMIT_MEMORY, pids=_LIMIT_PIDS) if self.limits else Limits()
        try:
            self.session = self.spawner.open_session(LaunchSpec(
                argv=("true",), workspace=self.workspace, policy=WorkspaceWrite(network_access=self.network),
                limits=limits, env={"PATH": "/usr/bin:/bin"}))
        except BaseException:
            os.rmdir(self.workspace)
            raise
        return self

    def call(self, *argv: str) -> "tuple[Any, str]":
        null = os.open(os.devnull, os.O_RDWR)
        out_r, out_w = os.pipe()
        try:
            proc = self.spawner.launch_call(self.session, tuple(argv), {"PATH": "/usr/bin:/bin"}, self.workspace,
                                            stdio=(null, out_w, null))
            os.close(out_w)
            out_w = -1
            proc.wait_started()
            info = proc.wait(60)
            with os.fdopen(out_r, closefd=False) as f:
                return info, f.read()
        finally:
            for fd in (null, out_r, out_w):
                if fd >= 0:
                    os.close(fd)

    def __exit__(self, *_exc: object) -> None:
        self.session.close()
        os.rmdir(self.workspace)


def check_limits() -> tuple[str, str]:
    """A session with a memory and a pids limit, and the proof that both hold (through the call helper
    when it is built, as the daemon's calls go)."""
    from sandboxd.errors import SandboxdError
    from sandboxd.launcher.native_call import helper_path

    python = sys.executable
    try:
        with _Session(limits=True, helper=helper_path()) as s:
            control, _ = s.call("true")
            memory, out = s.call(python, "-c", _ALLOCATE)
            oom = s.session.cgroup is not None and s.session.cgroup.oom_killed()
            forks, forked = s.call(python, "-c", _FORK)
    except SandboxdError as exc:
        text, fix = _failure(exc)
        return _line("FAIL", "limits", f"a session with --memory 64M --pids 16 could not be built: {text}", fix)
    if control.exit_code != 0:
        return _line("FAIL", "limits", f"`true` in a limited session ended with {control.shell_status}")
    if "ALIVE" in out or memory.exit_code == 0:
        return _line("FAIL", "limits", "128 MiB were allocated under a 64 MiB memory limit",
                     "the memory controller does not enforce memory.max here: check the kernel's cgroup setup")
    if forked.split()[:2] != ["FORK-FAILED", "11"]:
        return _line("FAIL", "limits", f"64 forks under a pids limit of 16: {forked.strip() or forks.shell_status}",
                     "the pids controller does not enforce pids.max here: check the kernel's cgroup setup")
    return _line("ok", "limits", "a session with --memory 64M --pids 16 holds: 128 MiB is killed"
                 f"{' (OOM reported)' if oom else ''}, fork fails at 16 processes")


def check_isolated_network() -> tuple[str, str]:
    from sandboxd.errors import SandboxdError

    try:
        with _Session(network=True) as s:
            info, out = s.call("ls", "/sys/class/net")
            link = s.session.network is not None
    except SandboxdError as exc:
        text, fix = _failure(exc)
        return _line("FAIL", "isolated network", f"a session with an isolated network could not be built: {text}", fix)
    inside = set(out.split())
    if info.exit_code != 0 or not link or "lo" not in inside or inside & _host_links():
        return _line("FAIL", "isolated network", f"the session sees {sorted(inside)} (exit {info.shell_status})")
    return _line("ok", "isolated network", "a session gets a network namespace of its own behind NAT")


def _host_links() -> set[str]:
    return set(os.listdir("/sys/class/net")) - {"lo", "eth0"}


def check_nftables() -> tuple[str, str]:
    if shutil.which("nft") is None:
        return _line("FAIL", "nftables", "the nft command is missing: isolated networks cannot be built",
                     "apt-get install nftables (or use --network=host, or no network)")
    # Checked by the kernel and rolled back (nft -c): nothing is left behind.
    probe = ("table inet sandboxd_doctor {\n  chain c {\n    type nat hook postrouting priority 100; policy accept;\n"
             "    masquerade\n  }\n}\n")
    result = subprocess.run(["nft", "-c", "-f", "-"], input=probe, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        return _line("FAIL", "nftables", f"the kernel refuses a NAT table: {result.stderr.strip()[:200]}",
                     "a kernel with nf_tables and NAT (CONFIG_NF_TABLES, CONFIG_NFT_NAT, CONFIG_NFT_MASQ)")
    return _line("ok", "nftables", "nft present, NAT tables accepted")


def check_call_helper() -> tuple[str, str]:
    from sandboxd.errors import SandboxdError
    from sandboxd.launcher.native_call import REBUILD, check_helper

    checked = check_helper()
    if checked.unusable:
        return _line("warn", "call helper", f"sandboxd-call is {checked.state}: the daemon does not use it, "
                     "its calls take the slower Python path", REBUILD)
    helper = checked.path
    if helper is None:
        return _line("warn", "call helper", "sandboxd-call is not built: daemon calls take the slower Python path",
                     REBUILD)
    try:
        with _Session(helper=helper) as s:
            info, out = s.call("sh", "-c", "echo called")
    except SandboxdError as exc:
        text, fix = _failure(exc)
        return _line("FAIL", "call helper", f"a session for a call could not be built: {text}", fix)
    if info.exit_code != 0 or out != "called\n":
        return _line("FAIL", "call helper", f"a session call through {helper} ended with {info.shell_status}",
                     "rebuild it: python -m sandboxd.launcher.native_call build")
    return _line("ok", "call helper", "a session call ran through sandboxd-call (the daemon's fast call path)")


# Each open session holds a few descriptors in the daemon and the fork server (pidfds, sockets,
# pipes of running calls): below this, a busy daemon runs out long before its session limit.
LOW_FD_LIMIT = 65536
LOW_PID_MAX = 32768
LOW_THREADS_MAX = 16384
LOW_NPROC = 4096


def check_fd_limit() -> tuple[str, str]:
    """RLIMIT_NOFILE as this process has it, and what `sandboxd serve` started the same way would use."""
    from sandboxd.kernel.rlimits import nofile_target

    soft, hard, target = nofile_target()
    detail = (f"soft {soft}, hard {hard}: the daemon raises its soft limit to {target} (each open session "
              "holds 2 in the fork server, each client connection 7 in the daemon)")
    if target < LOW_FD_LIMIT:
        return _line("warn", "open files", detail,
                     f"raise the hard limit to at least {LOW_FD_LIMIT} (the systemd unit sets LimitNOFILE=1048576; "
                     "elsewhere: ulimit -Hn, or /etc/security/limits.conf)")
    return _line("ok", "open files", detail)


def _read_proc_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def check_thread_limit() -> tuple[str, str]:
    """Every sandbox is processes, and the daemon's calls are threads: the kernel's and the
    per-user caps on both."""
    import resource

    threads_max = _read_proc_int("/proc/sys/kernel/threads-max")
    pid_max = _read_proc_int("/proc/sys/kernel/pid_max")
    nproc, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    nproc_text = "unlimited" if nproc == resource.RLIM_INFINITY else str(nproc)
    detail = f"threads-max {threads_max}, pid_max {pid_max}, RLIMIT_NPROC {nproc_text} (sandboxes inherit it, per user)"
    low = []
    if threads_max is not None and threads_max < LOW_THREADS_MAX:
        low.append(f"sysctl kernel.threads-max={LOW_THREADS_MAX * 4}")
    if pid_max is not None and pid_max < LOW_PID_MAX:
        low.append(f"sysctl kernel.pid_max={LOW_PID_MAX * 4}")
    if nproc != resource.RLIM_INFINITY and nproc < LOW_NPROC:
        low.append(f"LimitNPROC={LOW_NPROC * 4} in the unit (or ulimit -u)")
    if low:
        return _line("warn", "threads", detail, "; ".join(low))
    return _line("ok", "threads", detail)


def check_ceiling(path: str | None = None) -> tuple[str, str]:
    """The default limits and the caps of all sandboxes together, from the daemon's configuration
    (``path``, else ``$SANDBOXD_CONFIG`` or /etc/sandboxd/sandboxd.toml), and what the parent group
    carries now."""
    from sandboxd import config
    from sandboxd.kernel import cgroups

    limits = config.resource_limits(config.read_file(path or config.default_path()))
    detail = (f"each sandbox by default: pids {limits.pids}, memory {limits.memory >> 20} MiB (at most "
              f"{limits.max_pids} and {limits.max_memory >> 20} MiB); all together: pids {limits.total_pids}, "
              f"memory {limits.total_memory >> 20} MiB; each owner's share: pids {limits.owner_pids}, memory "
              f"{f'{limits.owner_memory >> 20} MiB' if limits.owner_memory else 'not capped'}")
    in_force = cgroups.ceiling_in_force()
    if in_force:
        detail += "; now " + ", ".join(f"{path} = {value}" for path, value in in_force.values())
    else:
        detail += f"; written on the {cgroups.BASE_NAME} group when the first sandbox starts"
    return _line("ok", "ceiling", detail)


CHECKS = (check_root, check_sandbox, check_seccomp, check_yama, check_landlock, check_cgroups, check_limits,
          check_nftables, check_isolated_network, check_call_helper, check_fd_limit, check_thread_limit)


def main(argv: list[str]) -> int:
    import argparse
    from functools import partial

    from sandboxd.cli import doctor_config

    p = argparse.ArgumentParser(prog="sandboxd doctor", description="Check this machine for everything enforcement "
                                "needs, and what the daemon's configuration names: its address pool, state directory "
                                "and audit database.")
    p.add_argument("--config", metavar="FILE", help="the daemon's configuration file (default: $SANDBOXD_CONFIG, "
                   "else /etc/sandboxd/sandboxd.toml if it exists)")
    args = p.parse_args(argv)
    configured = doctor_config.configured(args.config)
    checks = [(check.__name__, check) for check in CHECKS]
    checks[7:7] = [("check_ceiling", partial(check_ceiling, configured.path))] + [
        (check.__name__, partial(check, configured)) for check in doctor_config.CHECKS]
    failed = False
    for name, check in checks:
        try:
            status, text = check()
        except Exception as exc:  # noqa: BLE001 - a check that breaks is itself a finding
            status, text = _line("FAIL", name.removeprefix("check_"), f"{type(exc).__name__}: {exc}")
        failed |= status == "FAIL"
        print(text, flush=True)
    print("\nsandboxd doctor: " + ("something enforcement needs is missing (see FAIL above)" if failed
                                   else "everything enforcement needs is here"))
    return 1 if failed else 0
