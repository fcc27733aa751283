"""Elastic training on one host (examples/elastic_train.py, the int8 hook): 3 ranks started by three
torchrun agents (one per rank, as one per host), rank 2 SIGKILLed mid-run, then a fourth process
joining (DDL_ELASTIC_JOIN=1, outside torchrun). The world goes
3 -> 2 -> 3 without a restart. What must hold, read from the example's record:

- every rank's parameters are bitwise identical at every step of every generation, and after
  every world change (the reset records: model and optimizer);
- the steps run in order without a gap: each generation resumes at the step the state it took
  had reached, and the last generation ends at the last step;
- error feedback follows the stated rule (ddl_triton/torch/elastic/state.py): a survivor resumes
  with its own residuals of the step it resumes from; the joiner starts with none;
- the survivors' agents and the joiner exit 0 (and at once: torchrun's exit barrier is released for
  the lost agent), the killed rank's agent 1, the loss falls, and no shared memory is left behind.
The same drill across real hosts, with cuts and stops: tests/multirank/test_elastic_faults.py."""
from __future__ import annotations

import secrets
import subprocess
import sys
import time

from support.elastic_drill import end_all, free_port, kill_rank_2, parent_of, record_lines
from support.launch import TESTS, TORCHRUN, ddl_segments, torch_launcher_env

EXAMPLE = TESTS.parent / "examples" / "elastic_train.py"
STEPS, KILL_AT = 200, 8  # steps enough for a joiner to start (imports: seconds, more on a loaded machine) and be admitted


def test_a_rank_lost_then_a_joiner_world_3_2_3(tmp_path):
    before = ddl_segments()
    record = tmp_path / "record.jsonl"
    port = str(free_port())
    env = torch_launcher_env(DDL_TIMEOUT="20", DDL_TUNING_FILE="off", PYTHONFAULTHANDLER="1",
                             DDL_JOB_SECRET=secrets.token_hex(32))  # the joiner proves it holds it
    args = [str(EXAMPLE), "--steps", str(STEPS), "--compression", "int8", "--record", str(record),
            "--step-seconds", "0.05"]
    logs = {r: open(tmp_path / f"rank{r}.log", "w+") for r in range(4)}
    # One torchrun agent per rank, as one per host on a cluster (static rendezvous, node 0's agent
    # serving the store): the killed rank's agent then ends too, as a lost host's would, and the
    # others must still exit at once (their exit barrier waits for every agent: finish() checks in
    # for the lost one).
    procs = {r: subprocess.Popen([TORCHRUN, "--nnodes", "3", "--nproc-per-node", "1", "--node-rank", str(r),
                                  "--master-addr", "127.0.0.1", "--master-port", port, *args],
                                 env=env, stdout=logs[r], stderr=subprocess.STDOUT) for r in range(3)}
    try:
        deadline = time.monotonic() + 120
        kill_rank_2(record, lambda x: x.get("step") == KILL_AT and "reset" not in x and "final" not in x,
                    lambda x: "step" in x, deadline, lambda pid: parent_of(pid) == procs[2].pid)  # torchrun's child
        procs[3] = subprocess.Popen([sys.executable, *args], env={**env, "DDL_ELASTIC_JOIN": "1", "MASTER_ADDR":
                                                                   "127.0.0.1", "MASTER_PORT": port},
                                    stdout=logs[3], stderr=subprocess.STDOUT)
        ended: dict[int, float] = {}  # when each launcher exited (time.time(), as the records' "t")
        while len(ended) < len(procs) and time.monotonic() < deadline:
            ended.update({r: time.time() for r, p in procs.items() if r not in ended and p.poll() is not None})
            time.sleep(0.05)
        codes = {r: p.wait(timeout=max(1.0, deadline - time.monotonic())) for r, p in procs.items()}
    finally:
        out = end_all(procs, logs)  # ours: started here
    assert codes == {0: 0, 1: 0, 2: 1, 3: 0}, out  # 2: the agent whose rank was killed reports the failure
    lines = record_lines(record)
    steps = [x for x in lines if "loss" in x]
    resets = [x for x in lines if x.get("reset")]
    finals = [x for x in lines if x.get("final")]

    # The worlds: generation 0 of 3, 1 of 2 (rank 2 lost), 2 of 3 (the joiner in).
    sizes = {x["generation"]: x["size"] for x in steps}
    assert sizes == {0: 3, 1: 2, 2: 3}, (sizes, out)
    assert "generation 1 (lost): world 3 -> 2; lost rank 2 on" in out and "generation 2 (grow): world 2 -> 3" in out

    # Bitwise identical replicas: at every step of every generation, and after every world change.
    by_step: dict[tuple, set] = {}
    for x in steps:
        by_step.setdefault((x["generation"], x["step"]), set()).add(x["hash"])
    assert all(len(h) == 1 for h in by_step.values()), [k for k, h in by_step.items() if len(h) > 1]
    for g in (1, 2):
        held = [x for x in resets if x["generation"] == g]
        assert len(held) == sizes[g] and len({(x["hash"], x["optimizer"], x["step"]) for x in held}) == 1, held
    assert all(f["identical"] for f in finals) and len(finals) == 3
    # Every launcher that did nothing wrong exits soon after the last rank (torchrun's exit barrier is
    # released for the lost agent: it would hold the others 300 s).
    last_rank_out = max(f["t"] for f in finals)
    assert all(ended[r] - last_rank_out < 30 for r in (0, 1, 3)), (ended, last_rank_out)

    # The steps: each generation resumes from a state the previous one held (the state of the step it
    # resumes at, as recorded there; a commit whose record line had not been written yet when the
    # world changed is one step past the last line), and the last generation ends at STEPS.
    for g in (1, 2):
        reset = resets[[x["generation"] for x in resets].index(g)]
        resumed, before_change = reset["step"], max(s for gg, s in by_step if gg == g - 1)
        assert before_change - 1 <= resumed <= before_change + 1, (g, resumed, before_change)
        if (g - 1, resumed) in by_step:
            assert by_step[(g - 1, resumed)] == {reset["hash"]}, (g, resumed)
        assert min(s for gg, s in by_step if gg == g) == resumed + 1
    assert max(s for _, s in by_step) == STEPS

    # Error feedback: a survivor resumes with its own residuals of the step it resumes from; the
    # joiner with none (the digest of no residual at all).
    for x in (r for r in resets if r["generation"] == 1):
        mine = [s for s in steps if s["generation"] == 0 and s["pid"] == x["pid"] and s["step"] == x["step"]]
        assert mine and mine[-1]["residuals"] == x["residuals"], (x, mine)
    joiner_reset = [x for x in resets if x["generation"] == 2 and x["pid"] == _joiner_pid(lines)]
    assert joiner_reset and joiner_reset[0]["residuals"] == _empty_digest()

    # Training went on: the loss falls, and nothing is left in /dev/shm.
    losses = [x["loss"] for x in sorted(steps, key=lambda x: x["step"]) if x["rank"] == 0]
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    assert ddl_segments() - before == set()


def _joiner_pid(lines) -> int:
    first = {x["pid"] for x in lines if x.get("generation") in (0, 1) and "pid" in x}
    return next(x["pid"] for x in lines if "pid" in x and x["pid"] not in first)


def _empty_digest() -> str:
    import hashlib
    return hashlib.sha256().hexdigest()[:16]
