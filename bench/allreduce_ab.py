"""Before and after: the allreduce (and init) of an earlier revision against this checkout, in
alternating jobs of one run, on one host and across two testbed hosts.

    python bench/allreduce_ab.py --old-rev 69cf7ec [--rounds 5] [--places host,hosts] [--bytes 128]
    python bench/allreduce_ab.py --old-rev a73ca32 --places host --launchers ddlrun --bytes 8,65536,16777216
    python bench/allreduce_ab.py --old-rev 2d6b431 --places host --launchers ddlrun --bytes 8,65536 --async-op

The earlier revision is checked out into a private temporary folder (``git worktree``, removed at the
end) and run from there through ``PYTHONPATH``, with the same interpreter and packages; each job is
bench/_allreduce_ab_job.py (this checkout's) under one launcher:

    host  ddlrun   2 ranks under ``ddlrun -n 2`` (MPI bootstrap; the call lane rides MPI, the data shm)
    host  env://   2 ranks with RANK/WORLD_SIZE/MASTER_*, ``DDL_TOPOLOGY=1x2`` (two emulated hosts:
                   gloo between them, the call lane on its own TCP sockets)
    hosts ddlrun   2 testbed hosts x 1 rank, links shaped to ``--rate`` (MPI between the hosts)
    hosts env://   the same hosts, one process each, gloo and the lane's sockets between them

Jobs alternate old, new, old, new, ... per launcher, so both see the same machine drift; the table
gives, per size, launcher and revision, the median over jobs of each job's median block (the slowest rank's
time per call) and init's time, and the new/old ratio. Every job also checks its result exactly and
names the package folder it ran, so a job that ran the wrong checkout fails the run (exit 1).
Needs root for the testbed (``--places host`` alone does not).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
JOB = str(ROOT / "bench" / "_allreduce_ab_job.py")
_PORTS = iter(range(29731, 29999))


def _old_checkout(rev: str, folder: Path) -> Path:
    """``rev`` checked out under ``folder``, importable as ``ddl_triton`` from its root: the editable
    install maps transports/, schedules/ and examples/ into the package, so the checkout gets links."""
    tree = folder / "old"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
    for name in ("transports", "schedules", "examples"):
        (tree / "ddl_triton" / name).symlink_to(Path("..") / name)
    return tree


def _env(old: Path | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "DDL_"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")}
    env.update({"OMP_NUM_THREADS": "1", "DDL_TUNING_FILE": "off", "PYTHONUNBUFFERED": "1"})
    if old is not None:
        env["PYTHONPATH"] = str(old)
    env.update(extra)
    return env


def _result(out: str, old: Path | None, where: str) -> list[dict]:
    """The job's result per size, each checked (the checkout it ran, 2 ranks, no wrong element)."""
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if not results:
        raise RuntimeError(f"{where}: the job printed no result:\n{out[-3000:]}")
    expected = str(old / "ddl_triton") if old is not None else str(ROOT / "ddl_triton")
    for result in results:
        if result["package"] != expected or result["wrong"] or result["ranks"] != 2:
            raise RuntimeError(f"{where}: ran {result['package']} (expected {expected}), {result['ranks']} ranks, "
                               f"{result['wrong']} wrong elements at {result.get('bytes')} B")
    return results


def _run_here(launcher: str, old: Path | None, job_args: list[str]) -> list[dict]:
    if launcher == "ddlrun":
        cmd = [str(BIN / "ddlrun"), "-n", "2", "--", sys.executable, JOB, *job_args]
        done = subprocess.run(cmd, env=_env(old), capture_output=True, text=True, timeout=180,
                              stdin=subprocess.DEVNULL)
        if done.returncode:
            raise RuntimeError(f"host ddlrun: exit {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}")
        return _result(done.stdout, old, "host ddlrun")
    port = str(next(_PORTS))
    procs = [subprocess.Popen([sys.executable, JOB, *job_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, stdin=subprocess.DEVNULL,
                              env=_env(old, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                       DDL_TOPOLOGY="1x2"))
             for r in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"host env://: exits {[p.returncode for p in procs]}\n{outs[0][-2000:]}\n{outs[1][-2000:]}")
    return _result(outs[0], old, "host env://")


def _run_across(bed, ssh: Path, launcher: str, old: Path | None, job_args: list[str]) -> list[dict]:
    if launcher == "ddlrun":
        env = _env(old, UCX_NET_DEVICES="eth0", GLOO_SOCKET_IFNAME="eth0", HYDRA_LAUNCHER_EXEC=str(ssh))
        cmd = ["env", "-i", *(f"{k}={v}" for k, v in env.items()), str(BIN / "ddlrun"), "-n", "2", "-H", "h1:1,h2:1",
               "--", sys.executable, JOB, *job_args]
        done = bed.run("h1", cmd, cwd=str(ROOT), timeout=240)
        if done.returncode:
            raise RuntimeError(f"hosts ddlrun: exit {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}")
        return _result(done.stdout, old, "hosts ddlrun")
    port = str(next(_PORTS))
    procs = []
    for r, host in enumerate(("h1", "h2")):
        env = _env(old, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR=bed.address["h1"], MASTER_PORT=port,
                   GLOO_SOCKET_IFNAME="eth0")
        procs.append(bed.popen(host, ["env", "-i", *(f"{k}={v}" for k, v in env.items()), sys.executable, JOB,
                                      *job_args], cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"hosts env://: exits {[p.returncode for p in procs]}\n{outs[0][-2000:]}\n{outs[1][-2000:]}")
    return _result(outs[0], old, "hosts env://")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old-rev", required=True, help="the revision to compare with (a commit, tag or branch)")
    p.add_argument("--rounds", type=int, default=5, help="jobs per launcher and revision")
    p.add_argument("--places", default="host,hosts")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--bytes", default="128", help="a comma list of sizes")
    p.add_argument("--launchers", default="ddlrun,env://")
    p.add_argument("--json", default="")
    p.add_argument("--async-op", action="store_true", help="time allreduce(async_op=True).wait() instead")
    args = p.parse_args(argv)
    job_args = ["--bytes", args.bytes] + (["--async-op"] if args.async_op else [])
    places = args.places.split(",")
    launchers = args.launchers.split(",")
    results: dict[tuple[str, str, str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="ddl_triton-ab-") as tmp:  # mkdtemp: 0700, a fresh name
        folder = Path(tmp)
        old = _old_checkout(args.old_rev, folder)
        try:
            # The ssh stand-in hydra calls runs this checkout's testbed code whatever PYTHONPATH says.
            ssh = folder / "ssh"
            ssh.write_text(f"#!/bin/sh\nunset PYTHONPATH\nexec {BIN / 'ddl-testbed-ssh'} \"$@\"\n")
            ssh.chmod(0o700)
            for place in places:
                bed = None
                if place == "hosts":
                    from ddl_triton.testbed import Testbed
                    bed = Testbed(hosts=2, rate=args.rate, shared=(str(folder),)).__enter__()
                try:
                    for _ in range(args.rounds):
                        for launcher in launchers:
                            for label, tree in (("old", old), ("new", None)):
                                runs = _run_here(launcher, tree, job_args) if bed is None else \
                                    _run_across(bed, ssh, launcher, tree, job_args)
                                for run in runs:
                                    results.setdefault((place, launcher, label, run["bytes"]), []).append(run)
                                    print(f"# {place} {launcher} {label} {run['bytes']} B: "
                                          f"{statistics.median(run['us_per_call']):.1f} us, init {run['init_s']:.2f} s",
                                          flush=True)
                finally:
                    if bed is not None:
                        bed.__exit__(None, None, None)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    print(f"\n| where | launcher | bytes | old µs/call | new µs/call | new/old | old init s | new init s |")
    print("|---|---|---|---|---|---|---|---|")
    table = []
    sizes = sorted({key[3] for key in results})
    for place, launcher, nbytes in ((p, la, b) for p in places for la in launchers for b in sizes):
        o, n = (results[(place, launcher, lab, nbytes)] for lab in ("old", "new"))
        med = [statistics.median(statistics.median(r["us_per_call"]) for r in runs) for runs in (o, n)]
        init = [statistics.median(r["init_s"] for r in runs) for runs in (o, n)]
        spread = [f"{min(statistics.median(r['us_per_call']) for r in runs):.0f}–"
                  f"{max(statistics.median(r['us_per_call']) for r in runs):.0f}" for runs in (o, n)]
        print(f"| {place} | {launcher} | {nbytes} | {med[0]:.1f} ({spread[0]}) | {med[1]:.1f} ({spread[1]}) | "
              f"{med[1] / med[0]:.2f} | {init[0]:.2f} | {init[1]:.2f} |")
        table.append({"place": place, "launcher": launcher, "bytes": nbytes, "old_us": med[0], "new_us": med[1],
                      "old_init_s": init[0], "new_init_s": init[1]})
    if args.json:
        Path(args.json).write_text(json.dumps({"old_rev": args.old_rev, "rows": table,
                                               "raw": {"|".join(map(str, k)): v for k, v in results.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
