"""The fault table across real hosts: for each fault and launcher, what every rank raised and when,
how each launcher ended, and what was left in the hosts' /dev/shm.

Run (root, on a machine that can build testbed hosts)::

    python bench/faults_across_hosts.py [--timeout 5] [--faults cut,kill-host] [--launchers ddlrun]

Each job is 2 hosts x 2 ranks on a fresh 1 Gbit/s testbed (tests/support/host_faults.py): allreduces
of 400 KB in a loop, under ``ddlrun -H h1:2,h2:2`` (MPI between the hosts) or one ``torchrun`` per
host (gloo between them), with ``DDL_TIMEOUT`` = ``--timeout``; once every rank is running, the
fault strikes h2. Times count from the fault. One job at a time, so the times are not stretched by
other jobs (the test, tests/multirank/test_host_faults.py, runs them at once).

Exit status 1, with a ``FAILED`` line on stderr for each, when a run falls short of the least every
scenario must show (``support/host_faults.problems``: 4 ranks, exact, nothing left in /dev/shm, and
the surviving side raised the expected error); else 0.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests")
sys.path.insert(0, _TESTS)

from support.host_faults import FAULTS, LAUNCHERS, FaultRun, problems, run_fault  # noqa: E402


def _short(error: str | None) -> str:
    """The gist of a rank's error: its class and what it names (the rank and host lost)."""
    if error is None:
        return "finished"
    kind = error.split(":", 1)[0]
    body = re.sub(r" \[flight recorder: [^\]]*\]", "", error.split(": ", 1)[1])
    body = re.sub(r"gloo reported: .*?(Connection reset by peer|Connection closed by peer)[^)]*", r"gloo: \1", body)
    body = re.sub(r"^rank \d+: ", "", body)
    return f"{kind}: {body[:150]}"


def _row(run: FaultRun) -> list[str]:
    ranks = []
    for r, end in sorted(run.ranks.items()):
        if end.recorded:
            ranks.append(f"{r} ({end.host}) at {end.after_s:.1f} s: {_short(end.error)}")
        elif run.fault == "kill-host" and end.host == "h2" or r == run.victim:
            ranks.append(f"{r} ({end.host}): killed by the fault")
        else:
            ranks.append(f"{r} ({end.host}): ended by its launcher, no error of its own")
    exits = ", ".join(f"{h} {'still waiting, killed by the harness' if h in run.forced else code}"
                      for h, code in run.exit_codes.items())
    shm = "none" if not any(run.shm_left.values()) else str(run.shm_left)
    gone = "-" if run.ranks_gone_after_s is None else f"{run.ranks_gone_after_s:.1f} s"
    return [run.fault, run.launcher, "<br>".join(ranks), gone, f"{exits} (after {run.ended_after_s:.1f} s)", shm]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=float, default=5.0, help="DDL_TIMEOUT of every job (seconds)")
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--launchers", default=",".join(LAUNCHERS))
    args = p.parse_args()
    print(f"# 2 hosts x 2 ranks, 1 Gbit/s, DDL_TIMEOUT={args.timeout:g}; times from the fault\n")
    print("| fault | launcher | each rank: what it raised, and when | every rank's process gone | "
          "launchers' exit codes | /dev/shm left |")
    print("|---|---|---|---|---|---|")
    failed = []
    for fault in args.faults.split(","):
        for launcher in args.launchers.split(","):
            run = run_fault(fault, launcher, timeout_s=args.timeout)
            print("| " + " | ".join(_row(run)) + " |", flush=True)
            failed += [f"{fault} / {launcher}: {problem}" for problem in problems(run)]
    for line in failed:  # the least each scenario must show (support/host_faults.problems)
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
