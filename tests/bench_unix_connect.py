"""What the connect broker costs per Unix connect (not a test module: pytest does not collect it).

One `sandboxd run` per mode runs a server and connects to it in a loop from the same process, one
connection each (connect, accept, close), by a path in the sandbox's /tmp (the workspace under
danger-full-access, which shares the host's /tmp) and by an abstract name; it prints the median
over rounds of the time per connect. danger-full-access has no broker: the kernel's own cost.
``--processes N`` adds N idle processes to the sandbox, each holding ``--descriptors`` open files
(with the host's network the broker reads the descriptors of the sandbox's processes).

    .venv/bin/python tests/bench_unix_connect.py [--sandboxd PATH] [--count 2000] [--rounds 5]
        [--processes 0] [--descriptors 0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import textwrap

LOOP = textwrap.dedent('''
    import json, os, socket, statistics, sys, time
    where, count, rounds, processes, descriptors = sys.argv[1], *map(int, sys.argv[2:6])   # argv[6]: the mode
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(descriptors)]
    children = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:
            time.sleep(3600)
            os._exit(0)
        children.append(pid)
    def init_cpu():
        """init's CPU time, in seconds (none under danger-full-access: PID 1 is the host's)."""
        try:
            fields = open("/proc/1/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    out = {}
    for name, address in (("path", where + "/bench.sock"), ("abstract", "\\0sbx-bench-%d" % os.getpid())):
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(address)
        srv.listen(128)
        times = []
        cpu = init_cpu()
        for _ in range(rounds):
            started = time.perf_counter()
            for _ in range(count):
                c = socket.socket(socket.AF_UNIX)
                c.connect(address)
                srv.accept()[0].close()
                c.close()
            times.append((time.perf_counter() - started) / count * 1e6)
        srv.close()
        if name == "path":
            os.unlink(address)
        out[name] = round(statistics.median(times), 1)
        if "danger" not in sys.argv[6]:
            out[name + " init cpu"] = round((init_cpu() - cpu) / (count * rounds) * 1e6, 1)
    for pid in children:
        os.kill(pid, 9)
    print(json.dumps(out))
''')

MODES = {
    "danger-full-access (no broker)": ["--sandbox", "danger-full-access"],
    "no network": ["--sandbox", "workspace-write"],
    "--network=host": ["--sandbox", "workspace-write", "--network=host"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sandboxd", default=shutil.which("sandboxd") or ".venv/bin/sandboxd")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=0)
    parser.add_argument("--descriptors", type=int, default=0)
    args = parser.parse_args()
    workspace = tempfile.mkdtemp(prefix="sandboxd-bench-unix-", dir="/var/tmp")
    try:
        for mode, options in MODES.items():
            where = workspace if "danger" in mode else "/tmp"
            done = subprocess.run([args.sandboxd, "run", *options, "--workspace", workspace, "--pids", "4096",
                                   "--", "/usr/bin/python3", "-c", LOOP, where, str(args.count), str(args.rounds),
                                   str(args.processes), str(args.descriptors), mode],
                                  capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                raise SystemExit(f"{mode}: {done.stderr}")
            print(f"{mode:32} µs per connect: {json.loads(done.stdout)}")
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
    print(f"(load average: {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
