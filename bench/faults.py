"""Kill tests: survivors' time-to-error per killed-rank position, and shared-memory leaks.

Run: python bench/faults.py [--ranks 3] [--runs 3] [--kill-all-runs 20]

1. For each rank position v and each transport (shm, MPI), ``--runs`` jobs of
   tests/multirank/faults_worker.py under ``ddlrun`` (``mpiexec -disable-auto-cleanup``, each rank
   below its guard, so nobody kills the survivors for them): rank v SIGKILLs itself in
   the middle of a stream of 4 MiB allreduces; each survivor records the error it raised
   and the seconds from the kill to the error.
2. ``--kill-all-runs`` jobs in which this script SIGKILLs every rank at a random
   moment of the run; the ddl_triton entries of /dev/shm are compared before and
   after each.
"""
from __future__ import annotations

import argparse
import glob
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "multirank" / "faults_worker.py"
_WORKER_PATH = {"PYTHONPATH": str(ROOT / "tests")}  # the worker imports tests/support


def _mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def _ddlrun() -> str:
    return str(Path(sys.executable).parent / "ddlrun")


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("ddl_triton-")}


def kill_one(ranks: int, victim: int, timeout: float, transport: str) -> tuple[list[tuple[int, str, float]], str]:
    """One job under ddlrun in which rank ``victim`` SIGKILLs itself; returns the survivors'
    (rank, error, seconds from the kill to the error) and ddlrun's line naming the killed rank."""
    folder = tempfile.mkdtemp(prefix="ddl-kill-")  # a private folder (0700, a fresh name) for the ranks' stamps
    stamp = os.path.join(folder, "stamp")
    env = dict(os.environ, DDL_TRANSPORT=transport, PYTHONUNBUFFERED="1", **_WORKER_PATH)
    proc = subprocess.run([_ddlrun(), "-n", str(ranks), "--timeout", str(timeout), "--", sys.executable, str(WORKER),
                           "kill", str(victim), "--stamp", stamp], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout + 120)
    out = []
    for path in glob.glob(stamp + ".rank*"):
        line = Path(path).read_text()
        fields = dict(p.split("=", 1) for p in line.split(" msg=")[0].split()[1:])
        out.append((int(fields["rank"]), fields["error"], float(fields["seconds"])))
    shutil.rmtree(folder, ignore_errors=True)
    named = next((ln.removeprefix("ddlrun: ") for ln in proc.stderr.splitlines() if "was killed by" in ln), "-")
    return sorted(out), named


def kill_all(ranks: int, rng: random.Random) -> int:
    """SIGKILL every rank at a random moment; return the ddl_triton segments left behind."""
    before = _segments()
    scratch = tempfile.mkdtemp(prefix="ddl-killall-")  # private; the ranks' stamps are never read here
    env = dict(os.environ, DDL_TIMEOUT="30", **_WORKER_PATH)
    proc = subprocess.Popen([_mpiexec(), "-n", str(ranks), sys.executable, str(WORKER), "kill", str(ranks),
                             "--stamp", os.path.join(scratch, "stamp")], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(rng.uniform(0.5, 6.0))  # anywhere from start-up (imports, init) to the collectives
    pids = subprocess.run(["pgrep", "-f", str(WORKER)], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)
    time.sleep(0.2)
    shutil.rmtree(scratch, ignore_errors=True)
    return len(_segments() - before)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kill-all-runs", type=int, default=20)
    p.add_argument("--timeout", type=float, default=10.0, help="DDL_TIMEOUT for the jobs")
    args = p.parse_args()
    print(f"# kill one rank: {args.ranks} ranks under ddlrun, DDL_TIMEOUT={args.timeout:g} s, "
          f"{args.runs} runs per position and transport")
    print(f"{'killed':>6} {'transport':>9} {'survivor reports':>16} {'errors':>18} "
          f"{'time-to-error p50 (max) s':>26}  ddlrun says")
    for transport in ("shm", "mpi"):
        for victim in range(args.ranks):
            reports, named = [], set()
            for _ in range(args.runs):
                rows, line = kill_one(args.ranks, victim, args.timeout, "auto" if transport == "shm" else "mpi")
                reports += rows
                named.add(re.sub(r"pid \d+", "pid …", line))
            errors = sorted({e for _, e, _ in reports})
            times = [t for _, _, t in reports]
            expected = args.runs * (args.ranks - 1)
            span = f"{statistics.median(times):.2f} ({max(times):.2f})" if times else "-"
            print(f"{victim:>6} {transport:>9} {len(reports):>7} of {expected:<6} {','.join(errors) or '-':>18} "
                  f"{span:>26}  {' | '.join(sorted(named))}")
    rng = random.Random(1)
    leaks = [kill_all(args.ranks, rng) for _ in range(args.kill_all_runs)]
    print(f"\n# SIGKILL every rank at a random moment: {args.kill_all_runs} runs, "
          f"ddl_triton segments left in /dev/shm: {sum(leaks)} (per run: {leaks})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
