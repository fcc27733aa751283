"""torchft as a live peer: how long the surviving replica group takes to step again after the other is killed.

Semantics: one torchft Lighthouse (`torchft_lighthouse`, bound to 127.0.0.1) and two replica groups of one
process each (`Manager` + `ProcessGroupGloo` + torchft's `Optimizer`, gradients through torchft's
`DistributedDataParallel` or, with `--sync manager`, `Manager.allreduce` per tensor; CPU, a small MLP on
synthetic batches), all on this host. Once both groups have committed steps together, group 1 is SIGKILLed;
the figure is the time from the kill to group 0's first committed step in a quorum of one. A round where
group 0 dies instead is reported with its last error line and left out of the median. Each round is a
fresh lighthouse and fresh groups.

torchft is not a dependency of the project: run this with an interpreter that has it, e.g.
    python3 -m venv /tmp/tft && /tmp/tft/bin/pip install torch==2.13.0 torchft==0.2.0 numpy
    /tmp/tft/bin/python bench/torchft_recovery.py --rounds 3
(numpy: torchft's PGTransport needs it to heal a joining group and does not declare it.)
Without torchft it says so and exits 0 (skipped). Results: bench/results/torchft_peer.md.
"""
import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

_RUN_LIMIT_S = 120.0  # one round never waits longer than this, whatever torchft does


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(args):
    # Loopback only: gloo picks its interface from this, not from the hostname.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import logging
    from datetime import timedelta

    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    torch.set_num_threads(1)
    torch.manual_seed(0)  # same initial weights in both groups
    # torchrun would host the group's store; a group of one process hosts its own.
    store = TCPStore("127.0.0.1", args.store_port, is_master=True, wait_for_workers=False)
    net = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 10))
    timeout = timedelta(seconds=args.timeout)
    pg = ProcessGroupGloo(timeout=timeout)
    opt_inner = torch.optim.SGD(net.parameters(), lr=0.01)
    manager = Manager(
        pg=pg, min_replica_size=1,
        load_state_dict=lambda sd: (net.load_state_dict(sd["model"]), opt_inner.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": net.state_dict(), "optim": opt_inner.state_dict()},
        replica_id=f"peer_{args.group}", timeout=timeout, quorum_timeout=timedelta(seconds=60),
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=args.store_port,
        lighthouse_addr=f"http://127.0.0.1:{args.lighthouse_port}", hostname="localhost",
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")))
    # torchft's DDP (its comm hook) or, with --sync manager, one Manager.allreduce per gradient after backward.
    model = DistributedDataParallel(manager, net) if args.sync == "ddp" else net
    opt = Optimizer(manager, opt_inner)
    gen = torch.Generator().manual_seed(1 + args.group)
    t_end = time.monotonic() + _RUN_LIMIT_S
    while time.monotonic() < t_end:
        x = torch.randn(args.batch, args.width, generator=gen)
        y = torch.randint(0, 10, (args.batch,), generator=gen)
        before = manager.current_step()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if args.sync == "manager":
            for work in [manager.allreduce(p.grad) for p in net.parameters()]:
                work.wait()
        opt.step()
        committed = manager.current_step() > before
        # CLOCK_MONOTONIC is system-wide, so the driver can subtract its own kill time from this.
        print(f"{'STEP' if committed else 'FAIL'} {manager.current_step()} {manager.num_participants()} "
              f"{time.monotonic():.6f}", flush=True)
    manager.shutdown(wait=False)
    del store


def _reader(proc, lines, log):
    for raw in proc.stdout:
        line = raw.decode(errors="replace").rstrip()
        if line.startswith(("STEP ", "FAIL ")):
            kind, step, parts, t = line.split()
            lines.append((kind, int(step), int(parts), float(t)))
        else:
            log.append(line)


def _round(args, lighthouse_bin):
    lh_port = _free_port()
    procs = []
    lh_log = (open(os.path.join(args.log_dir, "lighthouse.log"), "wb", opener=lambda p, f: os.open(p, f, 0o600))
              if args.log_dir else subprocess.DEVNULL)
    try:
        lh = subprocess.Popen(
            [lighthouse_bin, "--min_replicas", "1", "--bind", f"127.0.0.1:{lh_port}",
             "--heartbeat_timeout_ms", str(args.heartbeat_ms), "--join_timeout_ms", str(args.join_ms)],
            # Its log goes to a file, never an unread pipe: a full pipe would stall the lighthouse itself.
            stdout=subprocess.DEVNULL, stderr=lh_log)
        procs.append(lh)
        lines, logs = [[], []], [[], []]
        for g in range(2):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(g), "--store-port", str(_free_port()),
                   "--lighthouse-port", str(lh_port), "--width", str(args.width), "--batch", str(args.batch),
                   "--timeout", str(args.timeout), "--sync", args.sync] + (["--verbose"] if args.verbose else [])
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            procs.append(p)
            threading.Thread(target=_reader, args=(p, lines[g], logs[g]), daemon=True).start()
        deadline = time.monotonic() + _RUN_LIMIT_S
        # Both groups must have committed steps together (a quorum of 2) before the fault.
        while sum(1 for k, _, n, _ in lines[0] if k == "STEP" and n == 2) < args.warm_steps:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"no joint steps: group0 {lines[0][-3:]} log {logs[0][-15:]}\n"
                                   f"group1 {lines[1][-3:]} log {logs[1][-15:]}")
            time.sleep(0.01)
        joint = [t for k, _, n, t in lines[0] if k == "STEP" and n == 2]
        step_s = statistics.median(b - a for a, b in zip(joint[-10:], joint[-9:]))
        t_kill = time.monotonic()
        procs[2].send_signal(signal.SIGKILL)
        after, next_alone = [], None
        while time.monotonic() < deadline and next_alone is None:
            after = [rec for rec in list(lines[0]) if rec[3] > t_kill]
            alone = [rec for rec in after if rec[0] == "STEP" and rec[2] == 1]
            next_alone = alone[0][3] - t_kill if alone else None
            if procs[1].poll() is not None:
                break
            time.sleep(0.01)
        if next_alone is None:
            # What happened to the survivor instead: its own last words (torchft's errors end in one line).
            procs[1].wait(timeout=5) if procs[1].poll() is None else None
            last = [l for l in logs[0] if l and not l.startswith(" ")][-1:] or ["(no output)"]
            return {"crashed": f"exit {procs[1].poll()} after {time.monotonic() - t_kill:.2f} s: {last[0][:200]}",
                    "step_s": step_s}
        before_alone = [rec for rec in after if rec[3] <= t_kill + next_alone]
        # A step whose allreduce had finished before the kill still commits (commit is per replica group).
        late = sum(1 for rec in before_alone if rec[0] == "STEP" and rec[2] == 2)
        fails = sum(1 for rec in before_alone if rec[0] == "FAIL")
        return {"crashed": None, "step_s": step_s, "alone_s": next_alone, "late_commits": late, "failed_steps": fails}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if args.log_dir:  # the workers' and lighthouse's own words, for when a round goes wrong
            for g in range(2):
                with open(os.path.join(args.log_dir, f"group{g}.log"), "w",
                          opener=lambda p, f: os.open(p, f, 0o600)) as f:
                    f.write("\n".join(logs[g]) + "\n")
            lh_log.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--width", type=int, default=256, help="MLP width (params ~ width^2)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=5.0, help="Manager/gloo timeout, s (DDL_TIMEOUT's role)")
    ap.add_argument("--heartbeat-ms", type=int, default=5000, help="lighthouse heartbeat timeout (its default)")
    ap.add_argument("--join-ms", type=int, default=60000, help="lighthouse join timeout (its default)")
    ap.add_argument("--sync", choices=("ddp", "manager"), default="ddp",
                    help="gradients through torchft's DistributedDataParallel, or Manager.allreduce per tensor")
    ap.add_argument("--warm-steps", type=int, default=20)
    ap.add_argument("--log-dir", help="write each process's output of the last round here")
    ap.add_argument("--verbose", action="store_true", help="torchft's INFO log in the workers' output")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        args.group = args.worker
        return _worker(args)
    try:
        import torchft  # noqa: F401
    except ImportError as e:
        print(f"SKIPPED: torchft is not importable by {sys.executable} ({e}); "
              "see this file's docstring for a scratch venv that has it")
        return 0
    lighthouse_bin = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable)) \
        or shutil.which("torchft_lighthouse")
    if lighthouse_bin is None:
        print("SKIPPED: torchft imports but its torchft_lighthouse binary is not on PATH")
        return 0
    results = []
    for r in range(args.rounds):
        res = _round(args, lighthouse_bin)
        if res["crashed"]:
            print(f"round {r}: step {res['step_s'] * 1e3:.1f} ms; the surviving group did not recover: {res['crashed']}",
                  flush=True)
            continue
        results.append(res)
        print(f"round {r}: step {res['step_s'] * 1e3:.1f} ms; kill -> first commit alone {res['alone_s']:.2f} s; "
              f"in between: {res['late_commits']} commit(s) of the step in flight, {res['failed_steps']} failed step(s)",
              flush=True)
    med = f"{statistics.median(r['alone_s'] for r in results):.2f} s" if results else "n/a"
    print(f"recovered in {len(results)} of {args.rounds} rounds; median kill -> first commit alone: {med} "
          f"(lighthouse heartbeat timeout {args.heartbeat_ms} ms, join timeout {args.join_ms} ms, "
          f"Manager/gloo timeout {args.timeout} s, --sync {args.sync})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
