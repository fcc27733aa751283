"""Kill tests: survivors' time-to-error per killed-rank position, and shared-memory leaks.

Run: python bench/faults.py [--ranks 3] [--runs 3] [--kill-all-runs 20]

1. For each rank position v, ``--runs`` jobs of tests/fault_worker.py under
   ``mpiexec -disable-auto-cleanup``: rank v SIGKILLs itself in the middle of a
   stream of 4 MiB allreduces; each survivor records the error it raised and the
   seconds from the kill to the error (in a file, since the launcher may stop
   forwarding output once a rank has died).
2. ``--kill-all-runs`` jobs in which this script SIGKILLs every rank at a random
   moment of the run; the ddl_triton entries of /dev/shm are compared before and
   after each.
"""
from __future__ import annotations

import argparse
import glob
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "fault_worker.py"


def _mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("ddl_triton-")}


def kill_one(ranks: int, victim: int, timeout: float) -> list[tuple[int, str, float]]:
    stamp = tempfile.mktemp(prefix="ddl-kill-")
    env = dict(os.environ, DDL_TIMEOUT=str(timeout), PYTHONUNBUFFERED="1")
    subprocess.run([_mpiexec(), "-disable-auto-cleanup", "-n", str(ranks), sys.executable, str(WORKER), "kill",
                    str(victim), "--stamp", stamp], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                   timeout=timeout + 120)
    out = []
    for path in glob.glob(stamp + ".rank*"):
        line = Path(path).read_text()
        fields = dict(p.split("=", 1) for p in line.split(" msg=")[0].split()[1:])
        out.append((int(fields["rank"]), fields["error"], float(fields["seconds"])))
        os.unlink(path)
    if os.path.exists(stamp):
        os.unlink(stamp)
    return sorted(out)


def kill_all(ranks: int, rng: random.Random) -> int:
    """SIGKILL every rank at a random moment; return the ddl_triton segments left behind."""
    before = _segments()
    env = dict(os.environ, DDL_TIMEOUT="30")
    proc = subprocess.Popen([_mpiexec(), "-n", str(ranks), sys.executable, str(WORKER), "kill", str(ranks),
                             "--stamp", tempfile.mktemp(prefix="ddl-killall-")], env=env, stdin=subprocess.DEVNULL,
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
    return len(_segments() - before)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kill-all-runs", type=int, default=20)
    p.add_argument("--timeout", type=float, default=10.0, help="DDL_TIMEOUT for the jobs")
    args = p.parse_args()
    print(f"# kill one rank: {args.ranks} ranks, DDL_TIMEOUT={args.timeout:g} s, {args.runs} runs per position")
    print(f"{'killed':>6} {'survivor reports':>16} {'errors':>28} {'time-to-error p50 (max) s':>26}")
    for victim in range(args.ranks):
        reports = []
        for _ in range(args.runs):
            reports += kill_one(args.ranks, victim, args.timeout)
        errors = sorted({e for _, e, _ in reports})
        times = [t for _, _, t in reports]
        expected = args.runs * (args.ranks - 1)
        span = f"{statistics.median(times):.2f} ({max(times):.2f})" if times else "-"
        print(f"{victim:>6} {len(reports):>7} of {expected:<6} {','.join(errors) or '-':>28} {span:>26}")
    rng = random.Random(1)
    leaks = [kill_all(args.ranks, rng) for _ in range(args.kill_all_runs)]
    print(f"\n# SIGKILL every rank at a random moment: {args.kill_all_runs} runs, "
          f"ddl_triton segments left in /dev/shm: {sum(leaks)} (per run: {leaks})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
