"""Elastic Keras training on one host (examples/elastic_train_tf.py, ddl_triton/tensorflow/elastic/), in
one TensorFlow job (TensorFlow's import costs seconds per process): 3 ranks started with env://,
rank 2 SIGKILLed mid-run, then a fourth process joining (DDL_ELASTIC_JOIN=1); the world goes
3 -> 2 -> 3 without a restart, ``model.fit``'s traced step following each world. What must hold:

- every rank's weights are bitwise identical after every batch of every generation (the records of
  one commit count, the batch's identity across ranks) and after every world change;
- each generation trains at its own size; the job ends at the last epoch (UpdateEpochStateCallback);
- the survivors and the joiner exit 0, the killed rank's status is -SIGKILL; no shared memory left."""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import pytest

from support.launch import TESTS, ddl_segments, torch_launcher_env

pytest.importorskip("tensorflow")

EXAMPLE = TESTS.parent / "examples" / "elastic_train_tf.py"
EPOCHS, KILL_AT = 40, 15  # batches enough for a joiner to import TensorFlow and be admitted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(path) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def test_a_keras_rank_lost_then_a_joiner_world_3_2_3(tmp_path):
    before = ddl_segments()
    record = tmp_path / "record.jsonl"
    env = torch_launcher_env(DDL_TIMEOUT="30", DDL_TUNING_FILE="off", PYTHONFAULTHANDLER="1",
                             TF_CPP_MIN_LOG_LEVEL="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                             DDL_JOB_SECRET=secrets.token_hex(32))
    args = [str(EXAMPLE), "--epochs", str(EPOCHS), "--record", str(record), "--step-seconds", "0.05"]
    logs = {r: open(tmp_path / f"rank{r}.log", "w+") for r in range(4)}
    procs = {r: subprocess.Popen([sys.executable, *args], env={**env, "RANK": str(r), "WORLD_SIZE": "3"},
                                 stdout=logs[r], stderr=subprocess.STDOUT) for r in range(3)}
    try:
        deadline = time.monotonic() + 300
        victim = None
        while victim is None and time.monotonic() < deadline:  # rank 2 dies once it has committed 15 batches
            victim = next((x["pid"] for x in _lines(record) if x.get("rank") == 2 and x.get("commits") == KILL_AT
                           and "loss" in x), None)
            time.sleep(0.02)
        assert victim is not None and victim == procs[2].pid, "rank 2 never committed 15 batches"
        os.kill(victim, signal.SIGKILL)  # ours: the process this test started as rank 2
        while time.monotonic() < deadline and not any(x.get("generation") == 1 and "loss" in x
                                                       for x in _lines(record)):
            time.sleep(0.05)
        procs[3] = subprocess.Popen([sys.executable, *args], env={**env, "DDL_ELASTIC_JOIN": "1"},
                                    stdout=logs[3], stderr=subprocess.STDOUT)
        codes = {r: p.wait(timeout=max(1.0, deadline - time.monotonic())) for r, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    out = ""
    for r, log in logs.items():
        log.seek(0)
        out += f"--- rank {r}\n{log.read()[-5000:]}\n"
        log.close()
    assert codes == {0: 0, 1: 0, 2: -signal.SIGKILL, 3: 0}, out
    lines = _lines(record)
    steps = [x for x in lines if "loss" in x]
    resets = [x for x in lines if x.get("reset")]
    finals = [x for x in lines if x.get("final")]

    sizes = {g: {x["size"] for x in steps if x["generation"] == g} for g in {x["generation"] for x in steps}}
    assert sizes == {0: {3}, 1: {2}, 2: {3}}, (sizes, out)
    assert "generation 1 (lost): world 3 -> 2; lost rank 2 on" in out and "generation 2 (grow): world 2 -> 3" in out

    by_step: dict[tuple, list] = {}
    for x in steps:
        by_step.setdefault((x["generation"], x["commits"]), []).append(x["hash"])
    assert all(len(set(h)) == 1 for h in by_step.values()), [k for k, h in by_step.items() if len(set(h)) > 1]
    for (g, c), h in by_step.items():
        assert len(h) == (2 if g == 1 else 3) or (g == 0 and c > KILL_AT - 2), (g, c, h)
    for g in (1, 2):
        held = [x for x in resets if x["generation"] == g]
        assert len(held) == (2 if g == 1 else 3) and len({(x["hash"], x["epoch"]) for x in held}) == 1, held
    assert len(finals) == 3 and all(f["identical"] and f["epoch"] == EPOCHS for f in finals), finals
    assert ddl_segments() - before == set()
