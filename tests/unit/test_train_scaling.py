"""bench/train_scaling.py, as its README line runs it, at the smallest size: every mode trains,
the paired ratios are computed, and the replicas of the modes that communicate end bitwise
identical (the bench's own check, which a broken backend or hook fails)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DDLRUN = Path(sys.executable).parent / "ddlrun"
MODES = ["1 rank", "2 independent", "ddp no-comm", "ddp lockstep", "gloo", "ddl", "ddl+allreduce", "ddl+int8"]


@pytest.mark.slow  # seconds: make check, the inner loop, leaves it out
def test_train_scaling_runs_every_kind_of_mode(tmp_path):
    out = tmp_path / "ts.json"
    proc = subprocess.run([str(DDLRUN), "-n", "2", "--", sys.executable, "bench/train_scaling.py", "--model", "cnn",
                           "--rounds", "2", "--steps", "1", "--modes", ",".join(MODES), "--json", str(out)],
                          cwd=ROOT, env=dict(os.environ, DDL_TUNING_FILE="off"), capture_output=True, text=True,
                          timeout=240, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (result,) = json.loads(out.read_text())["results"]
    rows = {row["mode"]: row for row in result["rows"]}
    assert list(rows) == MODES
    assert rows["1 rank"]["efficiency"] is None and rows["1 rank"]["identical"] is None
    assert rows["2 independent"]["of_ceiling"] == 1.0  # its own paired ratio, round by round
    for mode in MODES[1:]:
        assert rows[mode]["step_ms"] > 0 and rows[mode]["efficiency"] > 0, rows[mode]
        assert len(rows[mode]["of_ceiling_rounds"]) == 2, rows[mode]
    assert rows["ddp no-comm"]["identical"] is None  # it communicates nothing: replicas diverge
    assert rows["ddp lockstep"]["identical"] is None  # it communicates no gradients: the same
    for mode in ("gloo", "ddl", "ddl+allreduce", "ddl+int8"):
        assert rows[mode]["identical"] is True, rows[mode]
    assert "ddp no-comm" in proc.stdout and "NO" not in proc.stdout.split(), proc.stdout
    # the exposed communication per step, measured through every DDP mode's (wrapped) comm hook
    for mode in MODES[:2]:
        assert rows[mode]["exposed_ms_quartiles"] is None, rows[mode]
    for mode in MODES[2:]:
        p25, median, p75 = rows[mode]["exposed_ms_quartiles"]
        assert 0 <= p25 <= median <= p75 and len(rows[mode]["exposed_ms_rounds"]) == 2, rows[mode]
        assert rows[mode]["wire_bound_ms"] is None  # one host: no link
