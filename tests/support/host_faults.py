"""Faults across real hosts (the testbed, ddl_triton/testbed/): one job of 2 hosts x 2 ranks, one
fault injected into it mid-run, and what every rank raised, when, and how the job ended.

The job is tests/multirank/host_faults_worker.py: allreduces in a loop, under ``ddlrun -H h1:2,h2:2``
(MPI between the hosts) or one ``torchrun --nnodes 2`` per host (gloo between them). Once every
rank has finished its first allreduce, the fault strikes h2, the far host:

    cut        h2's link carries nothing, either way
    cut-up     what h2 sends is lost (h1 still reaches h2)
    cut-down   what is sent to h2 is lost (h2 still reaches h1)
    kill-host  h2 ends as in a power cut: its link goes silent, then every process on it is killed
    kill-rank  one rank on h2 is killed (SIGKILL); its host and link stay up
    slow       h2's link drops from 1 Gbit/s to 10 Mbit/s: not a fault, the job must finish cleanly

``run_fault`` returns a :class:`FaultRun`; every job is bounded (the deadline plus
``_ENDING_S``), and the testbed goes down on every exit. tests/multirank/test_host_faults.py
asserts on the runs; bench/faults_across_hosts.py prints them as a table.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddl_triton import testbed
from support.launch import TESTS, TORCHRUN, torch_launcher_env

FAULTS = ("cut", "cut-up", "cut-down", "kill-host", "kill-rank", "slow")
LAUNCHERS = ("ddlrun", "torchrun")
WORKER = TESTS / "multirank" / "host_faults_worker.py"
ROOT = TESTS.parent
SCRATCH = ROOT / "build" / "host-faults"  # on the shared file system: each host's /tmp is its own
BIN = Path(sys.executable).parent
_READY_S = 90.0     # for 4 ranks to start and finish one allreduce (torch imports, on 2 busy cores)
_ENDING_S = 30.0    # past the deadline, for every launcher to end: then the run is stopped by force
_SLOW_RUN_S = 5.0   # how long the slow-link job runs (rank 0's clock), most of it on the slow link


@dataclass
class RankEnd:
    """How one rank ended: ``error`` is what it raised (None: it finished), ``after_s`` when,
    counted from the fault (None: it left no record, e.g. it was killed)."""

    rank: int
    host: str
    size: int = 0       # the world size the rank saw
    done: int = 0
    wrong: int = 0
    error: str | None = None
    after_s: float | None = None
    recorded: bool = False


@dataclass
class FaultRun:
    fault: str
    launcher: str
    timeout_s: float
    exit_codes: dict[str, int | None] = field(default_factory=dict)  # per launcher process, by host
    ended_after_s: float | None = None  # from the fault until the last launcher ended
    ranks_gone_after_s: float | None = None  # from the fault until every rank's process was gone
    ranks: dict[int, RankEnd] = field(default_factory=dict)
    victim: int | None = None           # the rank killed (kill-rank)
    forced: list[str] = field(default_factory=list)  # hosts whose launcher outlived the wait and was killed
    shm_left: dict[str, list[str]] = field(default_factory=dict)  # per live host: ddl_triton segments
    output: str = ""

    @property
    def lost_host(self) -> str:
        return "h2"


def run_fault(fault: str, launcher: str, timeout_s: float = 5.0, rate: str = "1gbit") -> FaultRun:
    """Run one job of 2 hosts x 2 ranks on a fresh testbed under ``launcher``, inject ``fault`` into
    h2 once every rank is running, and gather how every rank and launcher ended."""
    if fault not in FAULTS or launcher not in LAUNCHERS:
        raise ValueError(f"fault {fault!r} or launcher {launcher!r} unknown")
    SCRATCH.mkdir(parents=True, exist_ok=True)
    results = Path(tempfile.mkdtemp(prefix=f"{launcher}-{fault}-", dir=SCRATCH))
    run = FaultRun(fault, launcher, timeout_s)
    seconds = _SLOW_RUN_S if fault == "slow" else 0.0
    with testbed.Testbed(hosts=2, rate=rate) as bed:
        jobs = _start(bed, launcher, results, timeout_s, seconds)
        try:
            ready = _wait_ready(results, jobs)
            # Each host has its own PID namespace: a rank's pid is its host's number for it. The
            # machine's, to watch and kill it from here, is looked up while the rank surely runs.
            pids = {r: bed.process(info["host"], info["pid"]) for r, info in ready.items()}
            struck = time.time()
            if ready:
                run.victim = _strike(bed, fault, ready, pids)
            pids = [pid for pid in pids.values() if pid is not None]
            run.ranks_gone_after_s = _wait_ended(jobs, pids, struck,
                                                 timeout_s + _ENDING_S + (_SLOW_RUN_S if fault == "slow" else 0))
            run.ended_after_s = time.time() - struck
            run.shm_left = shm_left(bed)
        finally:
            for host, (proc, out) in jobs.items():
                if proc.poll() is None:
                    run.forced.append(host)
                    proc.kill()
                    proc.wait(10)
        for host, (proc, out) in jobs.items():
            run.exit_codes[host] = proc.returncode
            out.seek(0)
            run.output += f"--- {launcher} on {host}: exit {proc.returncode}\n{out.read()[-20000:]}\n"
            out.close()
    for path in results.glob("rank*.ready"):
        info = json.loads(path.read_text())
        end = RankEnd(info["rank"], info["host"], info.get("size", 0), info["done"])
        final = path.with_suffix(".json")
        if final.exists():
            got = json.loads(final.read_text())
            end.done, end.wrong, end.error, end.recorded = got["done"], got["wrong"], got["error"], True
            end.after_s = got["time"] - struck
        run.ranks[end.rank] = end
    shutil.rmtree(results, ignore_errors=True)
    return run


def shm_left(bed) -> dict[str, list[str]]:
    """Per host still up (a killed host's /dev/shm went with it): the ddl_triton segments in its /dev/shm."""
    return {host: [n for n in bed.run(host, ["ls", "/dev/shm"], timeout=30).stdout.split() if n.startswith("ddl")]
            for host in bed.holders}


def shm_problems(left: dict[str, list[str]]) -> list[str]:
    """What ``shm_left``'s answer shows wrong: a segment kept, or h1 (never a victim) not checked."""
    found = [f"{h}: /dev/shm kept {names}" for h, names in left.items() if names]
    if "h1" not in left:
        found.append("h1's /dev/shm was not checked")
    return found


def _start(bed, launcher: str, results: Path, timeout_s: float, seconds: float) -> dict:
    """{host: (process, output file)}: ddlrun from h1, or torchrun on each host."""
    worker = [str(WORKER), "ddl" if launcher == "ddlrun" else "torch", str(results), str(seconds)]
    jobs = {}
    if launcher == "ddlrun":
        env = torch_launcher_env(UCX_NET_DEVICES="eth0", HYDRA_LAUNCHER_EXEC=str(BIN / "ddl-testbed-ssh"),
                                 DDL_TUNING_FILE="off", DDL_TIMEOUT=f"{timeout_s:g}")
        env.pop("DDL_TOPOLOGY", None)
        out = tempfile.TemporaryFile("w+")
        jobs["h1"] = (bed.popen("h1", [str(BIN / "ddlrun"), "-n", "4", "-H", "h1:2,h2:2", "--", sys.executable, *worker],
                                cwd=str(ROOT), env=env, stdout=out, stderr=subprocess.STDOUT), out)
        return jobs
    env = torch_launcher_env(GLOO_SOCKET_IFNAME="eth0", DDL_TUNING_FILE="off", DDL_TIMEOUT=f"{timeout_s:g}")
    env.pop("DDL_TOPOLOGY", None)
    for host in bed.hosts:
        out = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would stall the host's ranks
        cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               "h1:29400", "--rdzv-id", results.name, *worker]
        jobs[host] = (bed.popen(host, cmd, cwd=str(TESTS), env=env, stdout=out, stderr=subprocess.STDOUT), out)
    return jobs


def _wait_ready(results: Path, jobs: dict) -> dict[int, dict]:
    """{rank: its ready record} once all 4 ranks finished an allreduce; {} if a job ended first."""
    deadline = time.monotonic() + _READY_S
    while time.monotonic() < deadline:
        ready = {}
        for path in results.glob("rank*.ready"):
            info = json.loads(path.read_text())
            ready[info["rank"]] = info
        if len(ready) == 4:
            return ready
        if any(proc.poll() is not None for proc, _ in jobs.values()):
            return {}
        time.sleep(0.1)
    return {}


def _strike(bed, fault: str, ready: dict[int, dict], pids: dict[int, int | None]) -> int | None:
    """Inject ``fault`` into h2; returns the rank killed, if one was."""
    if fault == "cut":
        bed.cut("h2")
    elif fault in ("cut-up", "cut-down"):
        bed.cut("h2", fault.split("-")[1])
    elif fault == "kill-host":
        bed.kill("h2")
    elif fault == "slow":
        bed.shape("h2", "10mbit")
    else:
        victim = max(r for r, info in ready.items() if info["host"] == "h2")
        if pids[victim] is None:
            raise RuntimeError(f"rank {victim}'s process (pid {ready[victim]['pid']} on h2) is not running")
        os.kill(pids[victim], signal.SIGKILL)
        return victim
    return None


def _wait_ended(jobs: dict, pids: list[int], struck: float, limit_s: float) -> float | None:
    """Wait, at most ``limit_s``, for every launcher to end; returns when (from ``struck``) the
    last of the ranks' processes ``pids`` was gone, None if one outlived the wait."""
    deadline = time.monotonic() + limit_s
    gone_at = None
    while time.monotonic() < deadline:
        if gone_at is None and not any(_exists(pid) for pid in pids):
            gone_at = time.time() - struck
        if all(proc.poll() is not None for proc, _ in jobs.values()):
            break
        time.sleep(0.1)
    if gone_at is None and not any(_exists(pid) for pid in pids):
        gone_at = time.time() - struck
    return gone_at


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def problems(run: FaultRun, size: int = 4) -> list[str]:
    """What in ``run`` falls short of the least every scenario must show (empty: nothing): every
    rank ran in a world of ``size``, exact until its end; no host kept a segment; every rank's
    process ended; a slow link ended the job cleanly; any other fault made the surviving side, h1
    (every fault strikes h2), raise the expected error: a CollectiveTimeout naming a rank and its
    host, from at least one of its ranks (under torchrun the host's agent may end the others
    first), and from each of its ranks under ddlrun. A run where no survivor said anything fails."""
    found = []
    if sorted(run.ranks) != list(range(size)):
        found.append(f"ranks {sorted(run.ranks)} ran, not 0..{size - 1}")
    found += [f"rank {r} ran in a world of {e.size}, not {size}" for r, e in sorted(run.ranks.items()) if e.size != size]
    found += [f"rank {r}: {e.wrong} wrong results" for r, e in sorted(run.ranks.items()) if e.wrong]
    found += shm_problems(run.shm_left)
    if run.ranks_gone_after_s is None:
        found.append("a rank's process outlived the run")
    if run.fault == "slow":
        found += [f"rank {r} did not finish cleanly: {e.error}" for r, e in sorted(run.ranks.items())
                  if not e.recorded or e.error is not None]
        found += [f"{h} exited {code}" for h, code in run.exit_codes.items() if code != 0]
        return found
    survivors = {r: e for r, e in run.ranks.items() if e.host == "h1"}
    expected = {r: e for r, e in survivors.items() if e.recorded and e.error and
                e.error.startswith("CollectiveTimeout: ") and re.search(r"rank(?:\(s\))? [\d, ]+ on h\d", e.error)}
    if not expected:
        found.append("no rank on h1, the surviving side, raised a CollectiveTimeout naming a rank and its host")
    if run.launcher == "ddlrun":
        found += [f"rank {r} on h1 raised no CollectiveTimeout naming a rank and its host ({e.error})"
                  for r, e in sorted(survivors.items()) if r not in expected]
    return found
