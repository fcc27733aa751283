"""Elastic Keras training on one host (examples/elastic_train_tf.py, ddl_triton/tensorflow/elastic/), in
one TensorFlow job (TensorFlow's import costs seconds per process): 3 ranks started with env://,
rank 2 SIGKILLed mid-run, then a fourth process joining (DDL_ELASTIC_JOIN=1); the world goes
3 -> 2 -> 3 without a restart, ``model.fit``'s traced step following each world. What must hold:

- every rank's weights are bitwise identical after every batch of every generation (the records of
  one commit count, the batch's identity across ranks) and after every world change;
- each generation trains at its own size; the job ends at the last epoch (UpdateEpochStateCallback);
- the survivors and the joiner exit 0, the killed rank's status is -SIGKILL; no shared memory left."""
from __future__ import annotations

import importlib.util
import signal

import pytest

from support.elastic_drill import lose_one_then_join, record_lines
from support.launch import TESTS, ddl_segments

if importlib.util.find_spec("tensorflow") is None:  # found, not imported: TensorFlow in the suite's
    # process makes a later Triton load there abort (tests/unit/test_suite_guards.py)
    pytest.skip("the Keras elastic room needs tensorflow (the [tensorflow] extra)", allow_module_level=True)

EXAMPLE = TESTS.parent / "examples" / "elastic_train_tf.py"
EPOCHS, KILL_AT = 40, 15  # batches enough for a joiner to import TensorFlow and be admitted


def test_a_keras_rank_lost_then_a_joiner_world_3_2_3(tmp_path):
    before = ddl_segments()
    record = tmp_path / "record.jsonl"
    args = [str(EXAMPLE), "--epochs", str(EPOCHS), "--record", str(record), "--step-seconds", "0.05"]
    codes, out = lose_one_then_join(  # rank 2 dies once it has committed 15 batches
        tmp_path, args, lambda x: x.get("commits") == KILL_AT and "loss" in x, lambda x: "loss" in x, 300,
        DDL_TIMEOUT="30", TF_CPP_MIN_LOG_LEVEL="2")
    assert codes == {0: 0, 1: 0, 2: -signal.SIGKILL, 3: 0}, out
    lines = record_lines(record)
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
