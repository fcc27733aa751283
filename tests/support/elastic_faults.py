"""Faults across real hosts (the testbed) in an elastic job: one process per host, launched with env://,
examples/elastic_train.py as the worker, one fault struck mid-run, and what the job's record shows.

Each case runs on a testbed of its own (up and down take about 0.6 s, and a host killed by
``bed.kill`` stays dead, as a powered-off server does): rank 0 on h1 serves the store at h1's
address, rank r on h(r+1); ``--record`` gives each host its own JSON-lines file on the shared file
system (a host's /tmp is its own). The faults, each struck once rank 0 has committed ``at_step``
(plus ``delay_s``), on the victim hosts:

    kill       ``bed.kill``: the link goes silent, then every process of the host dies (a power cut)
    kill2      the victim's host is killed as above (silent: the survivors see it at the deadline, then
               wait the agreement's grace, 1 s, for its word), and the deadline plus ``delay_s2`` later
               a second host too, inside that wait, after it said it was here
    cut        the link carries nothing, both ways (``cut-up``: what the host sends is lost)
    stop       SIGSTOP to the victim's process, SIGCONT ``stop_s`` later
    join       the host's process starts then, with DDL_ELASTIC_JOIN=1: the world grows

``Case.launcher`` starts the hosts' processes: "env" (default) one process per host with env://;
"torchrun-c10d" one torchrun agent per host (``--nnodes 2:N``, the c10d rendezvous at h1), each
starting one worker. Under c10d the agent of group rank 0 serves the workers' store, and h1 the
rendezvous's: the victim is then chosen at the strike among the other hosts (``Case.victims`` says
"auto"), as a host that is not the job's coordinator.

``run_case`` returns a :class:`CaseRun`; every wait is bounded, every process left is killed, and
the testbed goes down on every exit. ``run_cases`` runs several, each starting when the one before
has struck (two at most at once: one importing torch while the other waits out its deadline). ``problems`` lists what a run falls short of (what "nothing
lost" means: see its doc); tests/multirank/test_elastic_faults.py asserts on it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddl_triton import testbed
from support.host_faults import shm_left, shm_problems
from support.launch import TESTS, torch_launcher_env

ROOT = TESTS.parent
EXAMPLE = ROOT / "examples" / "elastic_train.py"
SCRATCH = ROOT / "build" / "elastic-faults"  # on the shared file system: each host's /tmp is its own
STEPS = 30
GLOBAL_BATCH = 120                           # divides evenly over 2, 3 and 4 ranks
PORT = 29500
_SECRET = secrets.token_hex(32)  # every process of a drill, joiners included: DDL_JOB_SECRET
_READY_S = 90.0     # for the processes to start (torch imports on 2 busy cores) and reach the trigger
_POLL_S = 0.02
# What a process that cannot go on must end with: one of ddl_triton's errors, by name.
CLEAR_ERROR = re.compile(r"ddl_triton\.errors\.(ExcludedFromWorld|CoordinatorLost|PeersLost|CollectiveTimeout)"
                         r": (.+)")


@dataclass(frozen=True)
class Case:
    """One fault drill. ``hosts``: processes at launch (h1..hN, one each); ``victims``: the hosts
    struck; ``survivors_sizes``: the world sizes the survivors' records must show, in order of
    generation (a generation that failed before any step committed shows none)."""

    name: str
    fault: str
    victims: tuple[str, ...]
    survivors_sizes: tuple[int, ...]
    hosts: int = 3
    at_step: int = 10
    delay_s: float = 0.0
    delay_s2: float = 0.3
    stop_s: float = 0.0
    step_seconds: float = 0.0
    compression: str = "none"
    timeout_s: float = 4.0       # DDL_TIMEOUT: 3 s was seen too short for the first collective (the ranks' imports skew)
    joiner: str = ""            # a host started later with DDL_ELASTIC_JOIN=1
    launcher: str = "env"       # "env" or "torchrun-c10d" (the module doc)
    ending_s: float = 12.0      # past the strike and the deadline, for every process to end: then it is killed

    @property
    def launched(self) -> list[str]:
        return [f"h{i}" for i in range(1, self.hosts + 1)]

    @property
    def lost(self) -> list[str]:
        """The struck hosts that the job must go on without (a stop shorter than the deadline loses none)."""
        return [] if self.fault == "stop" and self.stop_s < self.timeout_s else list(self.victims)

    @property
    def survivors(self) -> list[str]:
        """The hosts whose processes must finish the job (exit 0)."""
        return [h for h in self.launched + ([self.joiner] if self.joiner else []) if h not in self.lost]


@dataclass
class CaseRun:
    case: Case
    struck: float = 0.0                                   # time.time() of the (first) strike; 0: never
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    forced: list[str] = field(default_factory=list)       # hosts whose process outlived the wait
    records: dict[str, list[dict]] = field(default_factory=dict)   # per host: its step records
    resets: dict[str, list[dict]] = field(default_factory=dict)    # per host: its state after each world change
    finals: dict[str, dict] = field(default_factory=dict)          # per host: its final record
    shm_left: dict[str, list[str]] = field(default_factory=dict)   # per live host: ddl* in /dev/shm
    outputs: dict[str, str] = field(default_factory=dict)
    ended_after_s: dict[str, float] = field(default_factory=dict)  # per host: from the strike to its end

    def story(self) -> str:
        lines = [f"case {self.case.name}: exit {self.exit_codes}, forced {self.forced}, ended after "
                 f"{ {h: round(s, 2) for h, s in self.ended_after_s.items()} }, shm left {self.shm_left}"]
        for host, out in self.outputs.items():
            lines.append(f"--- {host}: exit {self.exit_codes.get(host)}\n{out[-4000:]}")
        return "\n".join(lines)


def worker_argv(case: Case, record: Path, steps: int = STEPS) -> list[str]:
    argv = [sys.executable, str(EXAMPLE), "--steps", str(steps), "--global-batch", str(GLOBAL_BATCH),
            "--record", str(record)]
    if case.step_seconds:
        argv += ["--step-seconds", f"{case.step_seconds:g}"]
    if case.compression != "none":
        argv += ["--compression", case.compression]
    return argv


def reference_runs(compressions=("none", "int8"), steps: int = STEPS) -> dict[str, tuple[float, list[float]]]:
    """Uninterrupted runs of the same steps in a world of one, on this machine, one per compression
    (at once): {compression: (final test accuracy, loss per step)}. The global batches are the
    same, so each step's mean gradient is the same sum up to rounding (a world of N averages the
    means of N equal shards)."""
    SCRATCH.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="reference-", dir=SCRATCH))
    procs = {}
    sockets = [socket.socket() for _ in compressions]
    for s in sockets:  # a free port for each world of one's store: all held at once, so they differ
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    try:
        for c, port in zip(compressions, ports):
            env = torch_launcher_env(DDL_TUNING_FILE="off", DDL_TIMEOUT="30", RANK="0", WORLD_SIZE="1",
                                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env.pop("DDL_TOPOLOGY", None)
            argv = worker_argv(Case("reference", "", (), (), compression=c), folder / f"{c}.jsonl", steps)
            procs[c] = subprocess.Popen(argv, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = {}
        for c, proc in procs.items():
            text = proc.communicate(timeout=120)[0]
            if proc.returncode != 0:
                raise RuntimeError(f"the reference run ({c}) failed (exit {proc.returncode}):\n{text[-3000:]}")
            records, _, final = _read_record(folder / f"{c}.jsonl")
            out[c] = (final["accuracy"], [r["loss"] for r in records])
        return out
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def run_cases(cases: list[Case], in_flight: int = 2) -> dict[str, CaseRun | BaseException]:
    """Run ``cases`` in order, each on its own testbed, the next one starting as soon as the one
    before has struck (its processes then mostly wait out a deadline or an agreement, while the
    next one's import torch), at most ``in_flight`` at once. {name: its run, or what it raised}."""
    done: dict[str, CaseRun | BaseException] = {}
    threads: list[threading.Thread] = []

    def one(case: Case, struck: threading.Event) -> None:
        try:
            done[case.name] = run_case(case, struck)
        except BaseException as e:  # the test of this case reports it
            done[case.name] = e
        finally:
            struck.set()

    for case in cases:
        while sum(t.is_alive() for t in threads) >= in_flight:
            time.sleep(_POLL_S)
        struck = threading.Event()
        threads.append(threading.Thread(target=one, args=(case, struck), name=f"case-{case.name}"))
        threads[-1].start()
        struck.wait()
    for t in threads:
        t.join()
    return done


def run_case(case: Case, struck: threading.Event | None = None) -> CaseRun:
    """Run ``case`` on a testbed of its own (see the module doc) and gather how it went; ``struck``
    is set once the fault has struck (or the run failed before it could)."""
    SCRATCH.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{case.name}-", dir=SCRATCH))
    run = CaseRun(case)
    hosts = case.hosts + (1 if case.joiner else 0)
    procs: dict[str, tuple[subprocess.Popen, object]] = {}
    ended: dict[str, float] = {}
    try:
        with testbed.Testbed(hosts=hosts, rate="1gbit") as bed:
            try:
                for rank, host in enumerate(case.launched):
                    procs[host] = _start(bed, case, host, folder, RANK=str(rank), WORLD_SIZE=str(case.hosts)) \
                        if case.launcher == "env" else _start_torchrun(bed, case, host, folder)
                if _wait_step(folder / "h1.jsonl", 1 if case.fault == "join" else case.at_step, procs):
                    if case.delay_s:
                        time.sleep(case.delay_s)
                    if case.victims == ("auto",):
                        case = run.case = dataclasses.replace(case, victims=(_not_a_coordinator(case, folder),))
                    run.struck = time.time()
                    try:
                        _strike(bed, case, folder, procs)
                    finally:
                        if struck is not None:
                            struck.set()
                _wait_all(procs, ended, run.struck or time.time(), case.timeout_s + case.ending_s)
                run.shm_left = shm_left(bed)
            finally:
                for host, (proc, out) in procs.items():
                    if proc.poll() is None:
                        run.forced.append(host)
                        _resume(proc)
                        proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
                        try:
                            proc.wait(3)
                        except subprocess.TimeoutExpired:
                            pass
                        proc.kill()
                        try:
                            proc.wait(10)
                        except subprocess.TimeoutExpired:
                            os.kill(proc.pid, signal.SIGKILL)  # nsenter itself; the testbed's end kills the rest
                            proc.wait(10)
    finally:
        if struck is not None:
            struck.set()
        for host, (proc, out) in procs.items():
            run.exit_codes[host] = proc.returncode
            out.seek(0)
            run.outputs[host] = out.read()[-20000:]
            out.close()
            if host in ended and run.struck:
                run.ended_after_s[host] = ended[host] - run.struck
            run.records[host], run.resets[host], run.finals[host] = _read_record(folder / f"{host}.jsonl")
        shutil.rmtree(folder, ignore_errors=True)
    return run


def _start(bed, case: Case, host: str, folder: Path, **variables) -> tuple[subprocess.Popen, object]:
    env = torch_launcher_env(GLOO_SOCKET_IFNAME="eth0", DDL_TUNING_FILE="off", DDL_TIMEOUT=f"{case.timeout_s:g}",
                             MASTER_ADDR=bed.address["h1"], MASTER_PORT=str(PORT), PYTHONFAULTHANDLER="1",
                             DDL_JOB_SECRET=_SECRET, **variables)
    env.pop("DDL_TOPOLOGY", None)
    out = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would stall the process
    proc = bed.popen(host, worker_argv(case, folder / f"{host}.jsonl"), cwd=str(ROOT), env=env, stdout=out,
                     stderr=subprocess.STDOUT)
    return proc, out


def _start_torchrun(bed, case: Case, host: str, folder: Path) -> tuple[subprocess.Popen, object]:
    """``host``'s torchrun agent (c10d rendezvous at h1, ``--nnodes 2:hosts``), starting one worker."""
    env = torch_launcher_env(GLOO_SOCKET_IFNAME="eth0", DDL_TUNING_FILE="off", DDL_TIMEOUT=f"{case.timeout_s:g}",
                             PYTHONFAULTHANDLER="1", DDL_JOB_SECRET=_SECRET)
    env.pop("DDL_TOPOLOGY", None)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"2:{case.hosts}", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{bed.address['h1']}:{PORT}", "--rdzv-id", case.name,
            "--max-restarts", "0", *worker_argv(case, folder / f"{host}.jsonl")[1:]]
    out = tempfile.TemporaryFile("w+")
    proc = bed.popen(host, argv, cwd=str(ROOT), env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, out


def _not_a_coordinator(case: Case, folder: Path) -> str:
    """A launched host other than h1 (the rendezvous's store) whose worker is not rank 0 (its agent
    serves the workers' store): losing it loses a rank, not the job."""
    for host in reversed(case.launched[1:]):
        ranks = [r["rank"] for r in _lines(folder / f"{host}.jsonl") if "rank" in r] if \
            (folder / f"{host}.jsonl").exists() else []
        if ranks and ranks[-1] != 0:
            return host
    raise RuntimeError(f"{case.name}: no host but h1 and the rank-0 worker's recorded a step")


def _wait_step(record: Path, step: int, procs: dict) -> bool:
    """Wait (bounded) until ``record`` holds step ``step``; False if a process ended first."""
    deadline = time.monotonic() + _READY_S
    while time.monotonic() < deadline:
        if record.exists() and any(r.get("step", 0) >= step for r in _lines(record)):
            return True
        if any(proc.poll() is not None for proc, _ in procs.values()):
            return False
        time.sleep(_POLL_S)
    return False


def _strike(bed, case: Case, folder: Path, procs: dict) -> None:
    victim = case.victims[0] if case.victims else ""
    if case.fault == "kill":
        bed.kill(victim)
    elif case.fault == "kill2":
        # A power cut (silent: no socket closes), so the survivors see it at the deadline and then wait
        # out the grace for its word; a second power cut lands inside that wait. (A crash closes its
        # sockets: the survivors then know it gone and agree in tens of ms, too fast to strike inside.)
        bed.kill(victim)
        time.sleep(case.timeout_s + case.delay_s2)
        bed.kill(case.victims[1])
    elif case.fault in ("cut", "cut-up"):
        bed.cut(victim, "both" if case.fault == "cut" else "up")
    elif case.fault == "stop":
        proc = procs[victim][0]
        proc.send_signal(signal.SIGSTOP)  # reaches the worker inside the host (HostProcess)
        try:
            time.sleep(case.stop_s)
        finally:
            _resume(proc)
    elif case.fault == "join":
        procs[case.joiner] = _start(bed, case, case.joiner, folder, DDL_ELASTIC_JOIN="1")
    else:
        raise ValueError(f"unknown fault {case.fault!r}")


def _resume(proc: subprocess.Popen) -> None:
    """SIGCONT to a worker that ``bed.popen`` started and SIGSTOP stopped. nsenter, its parent,
    passes job control on: when its child stops it stops itself too, and resumes the child only
    once it is resumed; a SIGCONT to the child alone leaves nsenter stopped, never reaping the
    child (seen: the worker finished, a zombie, its nsenter stopped). So both get one; nsenter is
    this process's own unreaped child, so its pid cannot have been reused."""
    proc.send_signal(signal.SIGCONT)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)


def _wait_all(procs: dict, ended: dict, since: float, limit_s: float) -> None:
    deadline = since + limit_s
    while time.time() < deadline:
        for host, (proc, _) in procs.items():
            if host not in ended and proc.poll() is not None:
                ended[host] = time.time()
        if len(ended) == len(procs):
            return
        time.sleep(_POLL_S)


def _lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut short by a kill mid-write
    return out


def _read_record(path: Path) -> tuple[list[dict], list[dict], dict]:
    """(step records, reset records, the final record or {}) of one process's file."""
    if not path.exists():
        return [], [], {}
    lines = _lines(path)
    finals = [r for r in lines if r.get("final")]
    return ([r for r in lines if "loss" in r], [r for r in lines if r.get("reset")],
            finals[-1] if finals else {})


ACCURACY_POINTS = 0.5   # how far (in points of test accuracy) a run may end from the uninterrupted one


def problems(run: CaseRun, reference: float, steps: int = STEPS) -> list[str]:
    """What ``run`` falls short of (empty: nothing); "nothing lost" means all of it:

    - the fault struck; every survivor (``Case.survivors``) exits 0 by itself, says its replicas
      ended bitwise identical, and ends within ``ACCURACY_POINTS`` of ``reference``'s test accuracy;
    - every process's records agree: one parameter hash per (generation, step), whoever recorded it;
      within a generation each process records steps 1 apart (none twice, none skipped);
    - a new generation resumes at the survivors' lowest commit + 1 (a step that failed anywhere is
      redone; the +2 allowed is a commit saved whose record line the failure cut off), and steps
      1..``steps`` are each in some record;
    - the survivors' world sizes, generation by generation, are ``Case.survivors_sizes``;
    - the loss falls: the mean of the last 5 steps' is below the first 5's (each step's loss is the
      mean over its ranks' shards, from the latest generation that ran it);
    - no live host keeps a ddl* name in /dev/shm."""
    case, found = run.case, []
    if not run.struck:
        found.append("the fault never struck (a process ended, or rank 0 never reached the step)")
    for host in case.survivors:
        if run.exit_codes.get(host) != 0 or host in run.forced:
            found.append(f"survivor {host} exited {run.exit_codes.get(host)}{' (killed: it outlived the wait)' if host in run.forced else ''}")
        final = run.finals.get(host, {})
        if not final.get("identical"):
            found.append(f"survivor {host}: no final record saying its replicas are identical ({final})")
        elif abs(final["accuracy"] - reference) * 100 > ACCURACY_POINTS:
            found.append(f"survivor {host}: test accuracy {final['accuracy']:.4f}, the uninterrupted run's {reference:.4f}")
    everything = [(host, r) for host, recs in run.records.items() for r in recs]
    by_key: dict[tuple[int, int], set[str]] = {}
    for host, r in everything:
        by_key.setdefault((r["generation"], r["step"]), set()).add(r["hash"])
    found += [f"generation {g} step {s}: {len(h)} different hashes {sorted(h)}" for (g, s), h in sorted(by_key.items())
              if len(h) > 1]
    for host, recs in run.records.items():
        for prev, nxt in zip(recs, recs[1:]):
            if nxt["generation"] == prev["generation"] and nxt["step"] != prev["step"] + 1:
                found.append(f"{host}: generation {prev['generation']} recorded step {prev['step']}, then {nxt['step']}")
    found += _resumes(run)
    missing = sorted(set(range(1, steps + 1)) - _recorded_steps(run))
    if missing:
        found.append(f"steps {missing} are in no record")
    sizes = tuple(size for _, size in sorted({(r["generation"], r["size"]) for h in case.survivors
                                              for r in run.records.get(h, [])}))
    if sizes != case.survivors_sizes:
        found.append(f"the survivors' world sizes by generation were {sizes}, expected {case.survivors_sizes}")
    losses = step_losses(run)
    if len(losses) < 10 or not sum(losses[-5:]) / 5 < sum(losses[:5]) / 5:
        found.append(f"the loss did not fall: {[round(x, 3) for x in losses]}")
    found += shm_problems(run.shm_left)
    return found


def _survivor_records(run: CaseRun) -> list[dict]:
    return [r for h in run.case.survivors for r in run.records.get(h, [])]


def _resumes(run: CaseRun) -> list[str]:
    """Each new generation resumes from one state on every rank, a state committed before (the
    lowest commit: a step that failed anywhere is redone; a grown world redoes nothing), at the
    next step. Where the worker records that state (its ``reset`` lines), all of it is checked:
    every rank's parameters and optimizer identical, equal to the last record of that step, and
    the generation's first step right after it. Else, from the steps alone: the first step of a
    generation is the survivors' lowest last step + 1, or + 2 where that commit's record line was
    cut off (the failure, or the grow, struck between a commit and its record)."""
    found = []
    steps_by_gen: dict[int, dict[str, list[int]]] = {}
    for h in run.case.survivors:
        for r in run.records.get(h, []):
            steps_by_gen.setdefault(r["generation"], {}).setdefault(h, []).append(r["step"])
    resets: dict[int, set[tuple]] = {}
    for r in (r for recs in run.resets.values() for r in recs):
        resets.setdefault(r["generation"], set()).add((r["step"], r["hash"], r.get("optimizer")))
    found += [f"generation {g}: the ranks resumed from different states {sorted(got)}" for g, got in
              sorted(resets.items()) if len(got) > 1]
    gens = sorted(steps_by_gen)
    for g, g2 in zip(gens, gens[1:]):
        lasts = [max(steps) for h, steps in steps_by_gen[g].items() if h in steps_by_gen[g2]]
        first = min(min(steps) for steps in steps_by_gen[g2].values())
        if not lasts:
            found.append(f"no survivor recorded steps in both generation {g} and {g2}")
            continue
        if len(resets.get(g2, ())) == 1:
            (step, digest, _), = resets[g2]
            before = [r for recs in run.records.values() for r in recs if r["step"] == step and r["generation"] < g2]
            if first != step + 1 or not min(lasts) <= step <= min(lasts) + 1:
                found.append(f"generation {g2} resumed from step {step} and ran step {first} first; generation {g}'s "
                             f"survivors had recorded up to {lasts}")
            if before and max(before, key=lambda r: r["generation"])["hash"] != digest:
                found.append(f"generation {g2} resumed from step {step} with hash {digest}, not the one recorded "
                             f"for that step: {max(before, key=lambda r: r['generation'])}")
        elif first not in (min(lasts) + 1, min(lasts) + 2):
            found.append(f"generation {g2} started at step {first}; generation {g}'s survivors ended at {lasts}")
    return found


def _recorded_steps(run: CaseRun) -> set[int]:
    """Every step some record (a step's, or a resumed state's) shows committed; without the
    worker's reset lines, also a step whose record a failure cut off (the next generation
    started right after it)."""
    steps = {r["step"] for recs in list(run.records.values()) + list(run.resets.values()) for r in recs}
    firsts: dict[int, int] = {}
    for r in _survivor_records(run):
        firsts[r["generation"]] = min(firsts.get(r["generation"], r["step"]), r["step"])
    if not any(run.resets.values()):
        steps |= {first - 1 for g, first in firsts.items() if g > 0}
    return steps - {0}


def step_losses(run: CaseRun) -> list[float]:
    """Per step (in order), the mean of its ranks' losses in the latest generation that ran it."""
    latest: dict[int, tuple[int, list[float]]] = {}
    for r in _survivor_records(run):
        g, losses = latest.get(r["step"], (-2, []))
        if r["generation"] > g:
            latest[r["step"]] = (r["generation"], [r["loss"]])
        elif r["generation"] == g:
            losses.append(r["loss"])
    return [sum(v) / len(v) for _, (_, v) in sorted(latest.items())]
