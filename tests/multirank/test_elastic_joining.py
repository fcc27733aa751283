"""Who may join a running elastic job (ddl_triton/elastic/membership.py, ddl_triton/job_secret.py), on
one host: two members (env://, examples/elastic_train.py) started with DDL_JOB_SECRET, then three
processes asking to join at once:

- one with another secret and one with none: both refused with an error that says why (exit 1), and
  the members go on undisturbed: no world change, every step at world 2;
- one with the job's secret that planted a state of its own before asking (every parameter 7.0,
  lr 1e9, saved: the fewest commits; tests/multirank/elastic_planted_joiner.py): admitted, and every
  rank then holds the members' state, bit for bit (the reset record's digest is the members' last
  committed one), trains on with finite losses, and ends identical. Before this was fixed, the
  planted state was taken by every member.

Every process that did nothing wrong exits 0; no shared memory is left behind."""
from __future__ import annotations

import math
import secrets
import subprocess
import sys
import time

import torch

from support.elastic_drill import free_port, record_lines
from support.launch import TESTS, ddl_segments, torch_launcher_env

EXAMPLE = TESTS.parent / "examples" / "elastic_train.py"
PLANTED = TESTS / "multirank" / "elastic_planted_joiner.py"
STEPS = 240


def _planted_hash() -> str:
    """The digest examples/elastic_train.py records for the planted parameters (every one 7.0)."""
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import elastic_train
    finally:
        sys.path.pop(0)
    net = elastic_train.build_model(seed=0)
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(7.0)
    return elastic_train.params_hash(net)


def test_only_a_process_with_the_jobs_secret_joins_and_it_never_brings_its_own_state(tmp_path):
    before = ddl_segments()
    record, port, secret = tmp_path / "record.jsonl", str(free_port()), secrets.token_hex(32)
    env = torch_launcher_env(DDL_TIMEOUT="20", DDL_TUNING_FILE="off", DDL_JOB_SECRET=secret,
                             MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONFAULTHANDLER="1")
    args = ["--steps", str(STEPS), "--record", str(record), "--step-seconds", "0.03"]
    logs = {name: open(tmp_path / f"{name}.log", "w+") for name in ("rank0", "rank1", "wrong", "none", "planted")}
    procs = {f"rank{r}": subprocess.Popen([sys.executable, str(EXAMPLE), *args], stdout=logs[f"rank{r}"],
                                          stderr=subprocess.STDOUT, env={**env, "RANK": str(r), "WORLD_SIZE": "2"})
             for r in range(2)}
    joiner = {**env, "DDL_ELASTIC_JOIN": "1"}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(x.get("step", 0) >= 5 for x in record_lines(record)):
            time.sleep(0.05)
        procs["wrong"] = subprocess.Popen([sys.executable, str(EXAMPLE), *args], stdout=logs["wrong"],
                                          stderr=subprocess.STDOUT, env={**joiner, "DDL_JOB_SECRET": "w" * 32})
        procs["none"] = subprocess.Popen([sys.executable, str(EXAMPLE), *args], stdout=logs["none"],
                                         stderr=subprocess.STDOUT,
                                         env={k: v for k, v in joiner.items() if k != "DDL_JOB_SECRET"})
        procs["planted"] = subprocess.Popen([sys.executable, str(PLANTED), *args], stdout=logs["planted"],
                                            stderr=subprocess.STDOUT, env=joiner)
        codes = {n: p.wait(timeout=max(1.0, deadline - time.monotonic())) for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    out = {}
    for name, f in logs.items():
        f.seek(0)
        out[name] = f.read()
    everything = "\n".join(f"--- {n} (exit {codes.get(n)}):\n{o[-3000:]}" for n, o in out.items())
    assert codes == {"rank0": 0, "rank1": 0, "wrong": 1, "none": 1, "planted": 0}, everything
    assert "refused to admit this process: its proof of the job's secret does not hold" in out["wrong"], everything
    assert "DDL_JOB_SECRET is not set" in out["none"], everything
    assert "refused joiner" in out["rank0"], everything
    assert f"step {STEPS}/{STEPS}: loss " in out["rank0"] and ", world 3, 1 world change(s)" in out["rank0"], \
        everything  # the example's progress line (rank 0 stays rank 0: ranks keep their order)

    lines = record_lines(record)
    steps = [x for x in lines if "step" in x and "reset" not in x]
    resets = [x for x in lines if x.get("reset")]
    # The refused ones changed nothing: one change of the world only, the planted joiner's.
    assert {(x["generation"], x["size"]) for x in steps} == {(0, 2), (1, 3)}, sorted({(x["generation"], x["size"])
                                                                                       for x in steps})
    assert [x["generation"] for x in resets] == [1, 1, 1], resets
    # The state every rank holds after the join is the members' (one digest on every rank, the step they
    # had committed), never the planted one; the training goes on from it with finite losses.
    taken = resets[0]["step"]
    assert len({x["hash"] for x in resets}) == 1 and {x["step"] for x in resets} == {taken}, resets
    assert resets[0]["hash"] != _planted_hash(), "every rank took the joiner's planted state"
    assert max(x["step"] for x in steps if x["generation"] == 0) == taken - 1, "the members' steps before the join"
    for step in range(taken + 1, STEPS + 1):
        at = [x for x in steps if x["step"] == step and x["generation"] == 1]
        assert len(at) == 3 and len({x["hash"] for x in at}) == 1, at
        assert all(math.isfinite(x["loss"]) for x in at), at
    finals = [x for x in lines if x.get("final")]
    assert len(finals) == 3 and all(x["identical"] for x in finals), finals
    assert all(x["accuracy"] > 0.8 for x in finals), finals  # trained: the planted state scores ~0.1
    assert ddl_segments() - before == set()
