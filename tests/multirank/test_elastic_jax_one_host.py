"""Elastic JAX training on one host (examples/elastic_train_jax.py, ddl_triton/jax/elastic/): 3 ranks
started with env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), rank 2 SIGKILLed mid-run, then a
fourth process joining (DDL_ELASTIC_JOIN=1). The world goes 3 -> 2 -> 3 without a restart, and the
jitted step, traced once, runs on each world in turn. What must hold, read from the example's record:

- every rank's parameters are bitwise identical at every step of every generation, and after every
  world change (the reset records: parameters and optimizer state);
- each generation's steps run at its own size (the averaging of the current world), and resume at
  the step the state it took had reached; the last generation ends at the last step;
- the survivors and the joiner exit 0, the killed rank's status is -SIGKILL; the loss falls, and no
  shared memory is left behind."""
from __future__ import annotations

import signal

from support.elastic_drill import lose_one_then_join, record_lines
from support.launch import TESTS, ddl_segments

EXAMPLE = TESTS.parent / "examples" / "elastic_train_jax.py"
STEPS, KILL_AT = 160, 8  # steps enough for a joiner to start (JAX's import: seconds) and be admitted


def test_a_jax_rank_lost_then_a_joiner_world_3_2_3(tmp_path):
    before = ddl_segments()
    record = tmp_path / "record.jsonl"
    args = [str(EXAMPLE), "--steps", str(STEPS), "--record", str(record), "--step-seconds", "0.05"]
    codes, out = lose_one_then_join(  # rank 2 dies once it has committed step 8
        tmp_path, args, lambda x: x.get("step") == KILL_AT and "reset" not in x and "final" not in x,
        lambda x: "step" in x, 150, DDL_TIMEOUT="20", JAX_PLATFORMS="cpu")
    assert codes == {0: 0, 1: 0, 2: -signal.SIGKILL, 3: 0}, out
    lines = record_lines(record)
    steps = [x for x in lines if "loss" in x]
    resets = [x for x in lines if x.get("reset")]
    finals = [x for x in lines if x.get("final")]

    # The worlds: generation 0 of 3, 1 of 2 (rank 2 lost), 2 of 3 (the joiner in).
    sizes = {x["generation"]: {y["size"] for y in steps if y["generation"] == x["generation"]} for x in steps}
    assert sizes == {0: {3}, 1: {2}, 2: {3}}, (sizes, out)
    assert "generation 1 (lost): world 3 -> 2; lost rank 2 on" in out and "generation 2 (grow): world 2 -> 3" in out

    # Bitwise identical replicas at every step of every generation (each step recorded by every rank
    # of its world), and after every world change.
    by_step: dict[tuple, list] = {}
    for x in steps:
        by_step.setdefault((x["generation"], x["step"]), []).append(x["hash"])
    assert all(len(set(h)) == 1 for h in by_step.values()), [k for k, h in by_step.items() if len(set(h)) > 1]
    for (g, s), h in by_step.items():
        assert len(h) == (2 if g == 1 else 3) or (g == 0 and s > KILL_AT - 2), (g, s, h)
    for g in (1, 2):
        held = [x for x in resets if x["generation"] == g]
        assert len(held) == (2 if g == 1 else 3), held
        assert len({(x["hash"], x["optimizer"], x["step"]) for x in held}) == 1, held
    assert len(finals) == 3 and all(f["identical"] for f in finals), finals

    # The steps: each generation resumes from a state the previous one held, without a gap, and the
    # last generation ends at STEPS.
    for g in (1, 2):
        reset = next(x for x in resets if x["generation"] == g)
        resumed, before_change = reset["step"], max(s for gg, s in by_step if gg == g - 1)
        assert before_change - 1 <= resumed <= before_change + 1, (g, resumed, before_change)
        if (g - 1, resumed) in by_step:
            assert set(by_step[(g - 1, resumed)]) == {reset["hash"]}, (g, resumed)
        assert min(s for gg, s in by_step if gg == g) == resumed + 1
    assert max(s for _, s in by_step) == STEPS

    # Training went on: the loss falls, and nothing is left in /dev/shm.
    losses = [x["loss"] for x in sorted(steps, key=lambda x: x["step"]) if x["rank"] == 0]
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    assert ddl_segments() - before == set()
