"""Elastic DiLoCo on one host (examples/diloco_train.py --elastic): 3 ranks started by three torchrun
agents (one per rank, as one per host), fragments=2 with fragment_sync_delay=1; rank 2 kills itself
(SIGKILL, its own pid) in its third outer step: after inner step 11, before joining the average of
fragment 0 that the survivors begin there (applied at step 12). What must hold, read from the
example's record:

- the survivors re-form a world of 2 and finish every inner step; the killed rank's agent exits 1,
  the others 0;
- the outer step the lost rank interrupted is undone and redone on the survivors: the world resumes
  from the commit of step 11 (the average cannot complete without rank 2), DiLoCo's step counter
  restored with the model's (the state's own count of steps agrees with it), the survivors holding
  bitwise the same global parameters, parameters and outer optimizer state;
- every rank holds bitwise the same global parameters (the backups) after every outer step of
  every generation and at the end; no shared memory is left behind.
The second drill (tests/support/elastic_drill.py's: world 3 -> 2 -> 3, rank 2 killed from outside, a
fourth process joining) checks that a joiner receives the DiLoCo's backups, step and outer momentum."""
from __future__ import annotations

import secrets
import subprocess
import time

import pytest

from support.elastic_drill import end_all, free_port, lose_one_then_join, record_lines
from support.launch import TESTS, TORCHRUN, ddl_segments, torch_launcher_env

EXAMPLE = TESTS.parent / "examples" / "diloco_train.py"
STEPS, SYNC_EVERY = 32, 8


@pytest.mark.slow
def test_a_rank_lost_mid_outer_step_world_3_2(tmp_path):
    before = ddl_segments()
    record = tmp_path / "record.jsonl"
    port = str(free_port())
    env = torch_launcher_env(DDL_TIMEOUT="20", DDL_TUNING_FILE="off", PYTHONFAULTHANDLER="1",
                             DDL_JOB_SECRET=secrets.token_hex(32))
    args = [str(EXAMPLE), "--elastic", "--steps", str(STEPS), "--sync-every", str(SYNC_EVERY), "--fragments", "2",
            "--delay", "1", "--die-at-outer", "3", "--record", str(record), "--log-every", "0"]
    logs = {r: open(tmp_path / f"rank{r}.log", "w+") for r in range(3)}
    procs = {r: subprocess.Popen([TORCHRUN, "--nnodes", "3", "--nproc-per-node", "1", "--node-rank", str(r),
                                  "--master-addr", "127.0.0.1", "--master-port", port, *args],
                                 env=env, stdout=logs[r], stderr=subprocess.STDOUT) for r in range(3)}
    try:
        deadline = time.monotonic() + 180
        codes = {r: p.wait(timeout=max(1.0, deadline - time.monotonic())) for r, p in procs.items()}
    finally:
        out = end_all(procs, logs)  # ours: started here
    assert codes == {0: 0, 1: 0, 2: 1}, out  # 2: the agent whose rank died reports the failure
    lines = record_lines(record)
    steps = [x for x in lines if "hash" in x and not x.get("reset")]
    resets = [x for x in lines if x.get("reset")]
    finals = [x for x in lines if x.get("final")]
    assert {x["generation"]: x["size"] for x in steps} == {0: 3, 1: 2}, out
    by_step: dict[tuple, set] = {}
    for x in steps:
        by_step.setdefault((x["generation"], x["step"]), set()).add(x["hash"])
    assert all(len(h) == 1 for h in by_step.values()), by_step
    assert len(resets) == 2 and len({(x["hash"], x["params"], x["outer"], x["step"]) for x in resets}) == 1, resets
    resumed = resets[0]["step"]
    assert resumed == 11 and all(x["batch"] == x["step"] for x in resets), resets  # fragment 0's sync at 12: redone
    assert min(s for g, s in by_step if g == 1) > resumed and max(s for _, s in by_step) == STEPS
    assert len(finals) == 2 and all(f["identical"] for f in finals), finals
    assert ddl_segments() - before == set()


@pytest.mark.slow
def test_a_joiner_takes_the_outer_state_world_3_2_3(tmp_path):
    # tests/support/elastic_drill.py's drill (3 env:// ranks, rank 2 SIGKILLed after its second outer
    # step, then a fourth process joining): the joiner must receive the DiLoCo's backups, step and
    # outer momentum with the model (its own would be its initial parameters), so that every rank
    # holds the same global parameters after every later outer step and at the end.
    before = ddl_segments()
    record = tmp_path / "record.jsonl"
    args = [str(EXAMPLE), "--elastic", "--steps", "400", "--sync-every", "8", "--step-seconds", "0.04",
            "--record", str(record), "--log-every", "0"]
    codes, out = lose_one_then_join(tmp_path, args, lambda x: x.get("step") == 16 and "reset" not in x,
                                    lambda x: "hash" in x and not x.get("reset"), 240, DDL_TIMEOUT="20")
    assert codes == {0: 0, 1: 0, 2: -9, 3: 0}, out
    lines = record_lines(record)
    steps = [x for x in lines if "hash" in x and not x.get("reset")]
    resets = [x for x in lines if x.get("reset")]
    assert {x["generation"]: x["size"] for x in steps} == {0: 3, 1: 2, 2: 3}, out
    by_step: dict[tuple, set] = {}
    for x in steps:
        by_step.setdefault((x["generation"], x["step"]), set()).add(x["hash"])
    assert all(len(h) == 1 for h in by_step.values()), by_step
    grown = [x for x in resets if x["generation"] == 2]
    assert len(grown) == 3 and len({(x["hash"], x["params"], x["outer"], x["step"], x["batch"]) for x in grown}) == 1
    assert max(s for _, s in by_step) == 400
    finals = [x for x in lines if x.get("final")]
    assert len(finals) == 3 and all(f["identical"] for f in finals), finals
    assert ddl_segments() - before == set()
