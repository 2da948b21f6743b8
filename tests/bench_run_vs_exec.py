"""Run vs Exec in one daemon (not a test: pytest does not collect it).

CLIENTS threads, each with its own SandboxClient and session, run `true` in a loop, in phases of
PHASE seconds that alternate Run (SandboxClient.exec) and Exec (the same clients forced to their
Exec fallback), ROUNDS rounds, the order swapped every round. Same daemon, same store, same
sessions: only the RPC differs. Prints per phase execs/s, p50 and p99, and the CPU per exec of the
daemon and fork server together (with their reaped children: the helpers and commands) and of
this process (the clients).

    .venv/bin/python tests/bench_run_vs_exec.py [CLIENTS PHASE ROUNDS]     # default 16 6 6
"""
import os, sys, threading, time, tempfile, statistics
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent)); sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark import DaemonProcess
from sandboxd.client import SandboxClient
TICK = 1 / os.sysconf("SC_CLK_TCK")
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split(); return (int(f[11]) + int(f[12])) * TICK
def tree_cpu(pid):  # daemon + fork server and their reaped children
    total = 0.0
    for p in [pid] + [int(x) for x in open(f"/proc/{pid}/task/{pid}/children").read().split()]:
        f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split(); total += sum(int(x) for x in f[11:15]) * TICK
    return total
CLIENTS, PHASE, ROUNDS = (int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (16, 6.0, 6)
base = tempfile.mkdtemp(prefix="sbxd-ab-", dir="/var/tmp"); os.makedirs(base + "/ws", exist_ok=True)
d = DaemonProcess(base); d.start()
try:
    clients = [SandboxClient(d.socket) for _ in range(CLIENTS)]
    sids = [c.create_session(base + "/ws", approval="never").id for c in clients]
    for c, s in zip(clients, sids):
        for _ in range(3): c.exec(s, ["true"])
    print(f"loadavg {os.getloadavg()}")
    results = {"Run": [], "Exec": []}
    for r in range(ROUNDS):
        for mode in (("Run", "Exec") if r % 2 == 0 else ("Exec", "Run")):
            for c in clients: c._run_supported = (mode == "Run")
            lat, stop = [], time.monotonic() + PHASE
            def loop(c, s):
                while time.monotonic() < stop:
                    a = time.perf_counter(); c.exec(s, ["true"]); lat.append(time.perf_counter() - a)
            c0, t0, cl0 = tree_cpu(d.pid), time.perf_counter(), os.times()
            ths = [threading.Thread(target=loop, args=(c, s)) for c, s in zip(clients, sids)]
            [t.start() for t in ths]; [t.join() for t in ths]
            el, c1, cl1 = time.perf_counter() - t0, tree_cpu(d.pid), os.times()
            n = len(lat); lat.sort()
            row = (n / el, lat[n // 2] * 1000, lat[int(n * .99)] * 1000, (c1 - c0) / n * 1000,
                   ((cl1.user - cl0.user) + (cl1.system - cl0.system)) / n * 1000, os.getloadavg()[0])
            results[mode].append(row)
            print(f"round {r} {mode:4}: {row[0]:6.1f} execs/s  p50 {row[1]:6.1f} ms  p99 {row[2]:6.1f} ms  server CPU {row[3]:.2f} ms/exec  client CPU {row[4]:.2f} ms/exec  load {row[5]:.1f}", flush=True)
    for mode, rows in results.items():
        print(f"{mode:4} median of {len(rows)}: " + "  ".join(f"{name} {statistics.median(col):.2f}" for name, col in zip(("execs/s", "p50", "p99", "server CPU", "client CPU"), zip(*rows))))
    for c, s in zip(clients, sids): c.close_session(s); c.close()
finally:
    d.proc.terminate(); d.proc.wait(30)
    import shutil; shutil.rmtree(base, ignore_errors=True)
