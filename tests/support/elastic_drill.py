"""The one-host elastic drill the JAX and Keras rooms share (test_elastic_jax_one_host.py,
test_elastic_tf_one_host.py), and the record reading and port picking of every one-host elastic
test: an example started as 3 env:// ranks, rank 2 SIGKILLed once the
example's record shows it reached ``kill_when``, then a fourth process joining (DDL_ELASTIC_JOIN=1)
once generation 1 trains; every process waited for within the drill's deadline, and killed (ours:
the processes started here) if still running past it."""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

from support.launch import torch_launcher_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record_lines(path) -> list[dict]:
    """The example's record (one JSON object per complete line; none yet: [])."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def kill_rank_2(record, kill_when, trained, deadline: float, ours) -> None:
    """SIGKILL rank 2 once the record shows ``kill_when(line)`` for it, if ``ours(pid)`` (a process
    this test started, or its launcher's child), then wait until generation 1 trains (``trained``),
    both before ``deadline`` (``time.monotonic()``)."""
    victim = None
    while victim is None and time.monotonic() < deadline:
        victim = next((x["pid"] for x in record_lines(record) if x.get("rank") == 2 and kill_when(x)), None)
        time.sleep(0.02)
    assert victim is not None, "rank 2 never reached the point where it is killed"
    assert ours(victim), f"rank 2's recorded pid {victim} is not a process this test started"
    os.kill(victim, signal.SIGKILL)
    while time.monotonic() < deadline and not any(x.get("generation") == 1 and trained(x)
                                                   for x in record_lines(record)):
        time.sleep(0.05)


def parent_of(pid: int) -> int:
    """``pid``'s parent (from /proc; -1 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def end_all(procs: dict, logs: dict) -> str:
    """Kill what is still running of ``procs`` (ours: the processes a drill started) and return the
    tail of each one's output, from ``logs`` (files opened "w+"), which are closed."""
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait(10)
    out = ""
    for r, log in logs.items():
        log.seek(0)
        out += f"--- rank {r}\n{log.read()[-6000:]}\n"
        log.close()
    return out


def lose_one_then_join(tmp_path, args: list[str], kill_when, trained, deadline_s: float, **env_vars):
    """Run the drill (module doc). ``args``: the example and its arguments; ``kill_when(line)``: the
    record line of rank 2 after which it is killed; ``trained(line)``: a line of generation 1's
    training (then the joiner starts). Returns ``(codes, out)``: each process's exit status (rank 3:
    the joiner) and the tail of each one's output."""
    env = torch_launcher_env(DDL_TUNING_FILE="off", PYTHONFAULTHANDLER="1", MASTER_ADDR="127.0.0.1",
                             MASTER_PORT=str(free_port()), DDL_JOB_SECRET=secrets.token_hex(32), **env_vars)
    record = args[args.index("--record") + 1]
    logs = {r: open(tmp_path / f"rank{r}.log", "w+") for r in range(4)}
    procs = {r: subprocess.Popen([sys.executable, *args], env={**env, "RANK": str(r), "WORLD_SIZE": "3"},
                                 stdout=logs[r], stderr=subprocess.STDOUT) for r in range(3)}
    codes: dict = {}
    try:
        deadline = time.monotonic() + deadline_s
        kill_rank_2(record, kill_when, trained, deadline, lambda pid: pid == procs[2].pid)
        procs[3] = subprocess.Popen([sys.executable, *args], env={**env, "DDL_ELASTIC_JOIN": "1"},
                                    stdout=logs[3], stderr=subprocess.STDOUT)
        codes = {r: p.wait(timeout=max(1.0, deadline - time.monotonic())) for r, p in procs.items()}
    finally:
        out = end_all(procs, logs)
    return codes, out
