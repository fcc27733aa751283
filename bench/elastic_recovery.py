"""Time to recover across real hosts: an elastic job loses a host, and how long until its survivors
train again, split into detection, agreement, rebuild and sync+resume; beside what a fresh launch
of the same job costs (torchrun's restart from a checkpoint).

Run (root, on a machine that can build testbed hosts; from the repository root)::

    python bench/elastic_recovery.py [--layouts 3x1,2x2] [--faults kill,power-cut,cut] [--repeats 3]
                                     [--timeout 3] [--steps 60] [--fault-step 15] [--step-seconds 0.1]

The job is examples/elastic_train.py (the digits CNN, DDP on "ddl", a commit per step, ``--record``),
one process per rank started on its host with env:// (RANK, WORLD_SIZE, MASTER_ADDR=h1: rank 0,
on h1, serves the store) on a fresh 1 Gbit/s testbed per fault: ``3x1`` is 3 hosts x 1 rank,
``2x2`` 2 hosts x 2 ranks. Once every rank has committed ``--fault-step`` steps, the fault strikes
h2 (every rank on it):

    kill       SIGKILL to h2's ranks, its link up: the kernel closes their sockets (a crash, an OOM kill)
    power-cut  ``ddl-testbed kill h2``: the link goes silent first, then every process on h2 is killed
    cut        h2's link carries nothing either way; its ranks live on (cut off, past DDL_TIMEOUT)

From the fault (t0, the harness's clock; the hosts share it), on the survivors' recovery records
(``elastic.recoveries()``; each phase ends when the last survivor ends it): detection = t_failed - t0
(first: the earliest survivor), agreement = t_agreed - t_failed, rebuild = t_rebuilt - t_agreed,
sync+resume = t_resumed - t_rebuilt; "training again" = the first step committed in the new world
(the last survivor's) - t0. Each job must show exactly one world change, losing exactly h2's ranks,
survivors exiting 0 with bitwise-identical parameters at every step of the new world; else FAILED.

The restart row: the same job launched fresh on the surviving hosts (what torchrun --nnodes MIN:MAX
restarts on), from starting the processes to the first committed step (processes, imports, init,
data, the first step): a lower bound of torchrun's restart, which first has to notice the failure,
stop the survivors' workers and re-rendezvous; loading a checkpoint (0.5 MB here) is left out.
Beside it, the steps a restart redoes on average with a checkpoint every K steps: K/2 x the step time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddl_triton.testbed import Testbed

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "elastic_train.py"
FAULTS = ("kill", "power-cut", "cut")
LAYOUTS = {"3x1": (3, 1), "2x2": (2, 2)}
_READY_S = 120.0     # for every rank to start and commit --fault-step steps
_AFTER_S = 90.0      # after the fault, for the survivors to finish


def _env(rank: int, size: int, port: int, timeout: float) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("PMI", "MPI", "HYDRA"))}
    env.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="h1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0",
               DDL_TIMEOUT=f"{timeout:g}", DDL_TUNING_FILE="off", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONFAULTHANDLER="1")
    return env


def _launch(bed, hosts: int, per_host: int, port: int, args, steps: int, folder: Path) -> list[tuple]:
    """[(rank, host, process, output file)]: one env:// process per rank, ranks filling h1 first;
    each host's ranks record into ``folder/<host>.jsonl`` (a host's pids are its own)."""
    size = hosts * per_host
    jobs = []
    for rank in range(size):
        host = f"h{rank // per_host + 1}"
        argv = [sys.executable, str(EXAMPLE), "--steps", str(steps), "--record", str(folder / f"{host}.jsonl"),
                "--step-seconds", f"{args.step_seconds:g}"]
        out = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would stall a rank
        proc = bed.popen(host, argv, cwd=str(ROOT), env=_env(rank, size, port, args.timeout), stdout=out,
                         stderr=subprocess.STDOUT)
        jobs.append((rank, host, proc, out))
    return jobs


def _records(folder: Path) -> list[dict]:
    """Every complete JSON line of every host's record, with its host."""
    found = []
    for path in sorted(folder.glob("h*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line being written
            rec["host"] = path.stem
            found.append(rec)
    return found


def _wait(jobs, until, limit_s: float) -> bool:
    """Wait (at most ``limit_s``) until ``until()``; False if it did not come, or a process ended first."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if until():
            return True
        if any(proc.poll() not in (None, 0) for _, _, proc, _ in jobs):
            return False
        time.sleep(0.05)
    return False


def _stop(jobs) -> str:
    """End whatever still runs; returns every process's exit and output tail."""
    text = ""
    for rank, host, proc, out in jobs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        out.seek(0)
        text += f"--- rank {rank} on {host}: exit {proc.returncode}\n{out.read()[-3000:]}\n"
        out.close()
    return text


def _strike(bed, fault: str, jobs) -> None:
    if fault == "kill":
        for _, host, proc, _ in jobs:
            if host == "h2":
                proc.kill()  # reaches the rank itself (Testbed.popen), back to back
    elif fault == "power-cut":
        bed.kill("h2")
    else:
        bed.cut("h2")


def fault_run(layout: str, fault: str, args, n: int) -> dict:
    """One job on a fresh testbed, one fault; returns its figures and ``problems`` (empty: as it must be)."""
    hosts, per_host = LAYOUTS[layout]
    folder = Path(tempfile.mkdtemp(prefix=f"{layout}-{fault}-", dir=args.scratch))
    run = {"layout": layout, "fault": fault, "problems": [], "load": _load()}
    with Testbed(hosts=hosts, rate="1gbit") as bed:
        jobs = _launch(bed, hosts, per_host, 29500 + n, args, args.steps, folder)
        size = hosts * per_host
        try:
            def ready():
                done = {(r["host"], r["pid"]) for r in _records(folder) if r.get("step", 0) >= args.fault_step}
                return len(done) >= size
            if not _wait(jobs, ready, _READY_S):
                run["problems"].append("the job did not reach the fault step")
                return run
            t0 = time.time()
            _strike(bed, fault, jobs)
            struck = time.time()
            survivors = [j for j in jobs if j[1] != "h2"]
            _wait(survivors, lambda: all(p.poll() is not None for _, _, p, _ in survivors), _AFTER_S)
            run["strike_s"] = struck - t0
            run["codes"] = {f"{host}/{rank}": proc.poll() for rank, host, proc, _ in jobs}
        finally:
            run["output"] = _stop(jobs)
    _figures(run, _records(folder), t0, size, [r for r in range(size) if r // per_host == 1])
    return run


def _figures(run: dict, recs: list[dict], t0: float, size: int, lost: list[int]) -> None:
    problems = run["problems"]
    steps = [r for r in recs if "step" in r and "t" in r and r["host"] != "h2"]  # not the reset lines
    finals = [r for r in recs if r.get("final") and r["host"] != "h2"]
    survivors = size - len(lost)
    codes = {k: c for k, c in run["codes"].items() if not k.startswith("h2/")}
    problems += [f"{k} exited {c}" for k, c in codes.items() if c != 0]
    if len(finals) != survivors:
        problems.append(f"{len(finals)} survivors' final records, expected {survivors}")
    if not all(f.get("identical") for f in finals):
        problems.append("the survivors did not end bitwise identical")
    changes = [f["recoveries"] for f in finals]
    if any(len(c) != 1 for c in changes) or not finals:
        problems.append(f"world changes per survivor: {[len(c) for c in changes]}, expected one each")
        return
    recs1 = [c[0] for c in changes]
    for rec in recs1:
        if sorted(rec["lost"]) != lost or rec["size_after"] != survivors:
            problems.append(f"a survivor saw lost {rec['lost']}, world {rec['size_after']}: expected {lost}, "
                            f"{survivors}")
    by_step: dict[tuple, set] = {}
    for r in steps:
        by_step.setdefault((r["step"], r["generation"]), set()).add(r["hash"])
    split = [k for k, h in by_step.items() if len(h) != 1]
    if split:
        problems.append(f"survivors' hashes differ at (step, generation) {sorted(split)[:5]}")
    new = [r for r in steps if r["generation"] >= 1]
    if not new:
        problems.append("no step committed in the new world")
        return
    last = lambda key: max(rec[key] for rec in recs1)  # noqa: E731 - the last survivor to get there
    first_new = {}
    for r in sorted(new, key=lambda r: r["t"]):
        first_new.setdefault((r["host"], r["pid"]), r)
    old_max = max((r["step"] for r in steps if r["generation"] == 0), default=0)
    gen0 = sorted((r["t"] for r in steps if r["generation"] == 0 and r["rank"] == 0 and r["step"] > 3))
    run.update(detect_first=min(rec["t_failed"] for rec in recs1) - t0, detect=last("t_failed") - t0,
               agree=last("t_agreed") - last("t_failed"), rebuild=last("t_rebuilt") - last("t_agreed"),
               sync=last("t_resumed") - last("t_rebuilt"),
               again=max(r["t"] for r in first_new.values()) - t0,
               redone=old_max - (min(r["step"] for r in first_new.values()) - 1),
               step_s=statistics.median(b - a for a, b in zip(gen0, gen0[1:])) if len(gen0) > 2 else None,
               accuracy=statistics.median(f["accuracy"] for f in finals))


def restart_run(layout: str, args, n: int, bed) -> dict:
    """The same job launched fresh on the surviving hosts, until every rank has committed its first step."""
    hosts, per_host = LAYOUTS[layout]
    if hosts > 2:  # h1 and h3 survive: renumber them as h1, h2 of a testbed of the survivors
        hosts -= 1
    else:
        hosts, per_host = 1, per_host
    folder = Path(tempfile.mkdtemp(prefix=f"restart-{layout}-", dir=args.scratch))
    load = _load()
    t0 = time.time()
    jobs = _launch(bed, hosts, per_host, 29700 + n, args, 5, folder)
    try:
        size = hosts * per_host
        ok = _wait(jobs, lambda: len({(r["host"], r["pid"]) for r in _records(folder) if r.get("step") == 1}) >= size,
                   _READY_S)
        firsts = [r["t"] for r in _records(folder) if r.get("step") == 1]
        _wait(jobs, lambda: all(p.poll() is not None for _, _, p, _ in jobs), 60)
    finally:
        output = _stop(jobs)
    if not ok:
        return {"problems": [f"restart {layout}: no first step\n{output}"], "load": load}
    return {"first_step": max(firsts) - t0, "load": load, "problems": []}


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _ms(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="3x1,2x2")
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--restarts", type=int, default=3, help="fresh launches per layout (0: none)")
    p.add_argument("--timeout", type=float, default=3.0, help="DDL_TIMEOUT of every job (seconds)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--fault-step", type=int, default=15)
    p.add_argument("--step-seconds", type=float, default=0.1, help="the example's sleep in each backward")
    p.add_argument("--checkpoint-every", type=int, default=100, help="K, for the restart's redone steps")
    args = p.parse_args()
    layouts, faults = args.layouts.split(","), args.faults.split(",")
    if not set(layouts) <= set(LAYOUTS) or not set(faults) <= set(FAULTS) or args.repeats < 1:
        p.error(f"--layouts from {sorted(LAYOUTS)}, --faults from {FAULTS}, --repeats >= 1")
    base = ROOT / "build" / "elastic-bench"
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o700)
    args.scratch = Path(tempfile.mkdtemp(prefix="recovery-", dir=base))  # every host sees it
    print(f"# elastic recovery, DDL_TIMEOUT={args.timeout:g} s, {args.steps} steps, fault after step "
          f"{args.fault_step}, --step-seconds {args.step_seconds:g}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("# seconds: median (min-max) over the faults; phases end when the last survivor ends them\n")
    print("| layout | fault | n | load (1 min) | detection (first) | detection | agreement | rebuild | "
          "sync+resume | training again | goal (deadline+2) | steps redone | step s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    failed, n, step_times = [], 0, []
    for layout in layouts:
        for fault in faults:
            runs = []
            for _ in range(args.repeats):
                n += 1
                run = fault_run(layout, fault, args, n)
                runs.append(run)
                failed += [f"{layout} {fault} #{len(runs)}: {x}" for x in run["problems"]]
                if run["problems"]:
                    print(f"FAILED {layout} {fault}: {run['problems']}\n{run.get('output', '')[-6000:]}",
                          file=sys.stderr, flush=True)
            good = [r for r in runs if not r["problems"] and "again" in r]
            step_times += [r["step_s"] for r in good if r.get("step_s")]
            col = lambda k: _ms(r.get(k) for r in good)  # noqa: E731
            print(f"| {layout} | {fault} | {len(good)}/{len(runs)} | {', '.join(r['load'].split()[0] for r in runs)} | "
                  f"{col('detect_first')} | {col('detect')} | {col('agree')} | {col('rebuild')} | {col('sync')} | "
                  f"{col('again')} | {args.timeout + 2:g} | {_ms(r.get('redone') for r in good)} | {col('step_s')} |",
                  flush=True)
    if args.restarts:
        step = statistics.median(step_times) if step_times else None
        print(f"\n| fresh launch of the same job on the survivors | n | load (1 min) | processes to first committed "
              f"step, s | + redone steps, checkpoint every K={args.checkpoint_every} (K/2 x {step or 0:.3f} s) |")
        print("|---|---|---|---|---|")
        for layout in layouts:
            hosts = LAYOUTS[layout][0] - 1 if LAYOUTS[layout][0] > 2 else 1
            with Testbed(hosts=hosts, rate="1gbit") as bed:
                got = [restart_run(layout, args, i, bed) for i in range(args.restarts)]
            failed += [x for g in got for x in g["problems"]]
            firsts = [g["first_step"] for g in got if not g["problems"]]
            redo = args.checkpoint_every / 2 * step if step else None
            print(f"| {layout} -> survivors ({hosts} host(s)) | {len(firsts)}/{len(got)} | "
                  f"{', '.join(g['load'].split()[0] for g in got)} | {_ms(firsts)} | "
                  f"{'-' if redo is None or not firsts else f'{statistics.median(firsts) + redo:.2f}'} |", flush=True)
    for line in failed:
        print(f"FAILED {line.splitlines()[0]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
