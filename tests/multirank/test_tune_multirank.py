"""ddl-tune end to end on 2 ranks, and the runtime's use of what it wrote (tests/multirank/tune_multirank_worker.py)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.launch import run_ranks

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the repository
BIN = Path(sys.executable).parent
# A small, fast sweep: the suite checks the machinery, bench/ and the closing notes measure.
SMALL = ["--quick", "--collectives", "allreduce,broadcast", "--max-bytes", "16K", "--rounds", "2",
         "--target-ms", "0.5", "--no-cache", "--quiet"]


def _ddlrun(ranks: int, *command: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ddlrun"), "-n", str(ranks), "--", *command], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune")
    path, png = out / "t.json", out / "sweep.png"
    proc = _ddlrun(2, str(BIN / "ddl-tune"), *SMALL, "--out", str(path), "--plot", str(png))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return path, png, proc.stdout


def test_ddl_tune_writes_a_table_with_winners_a_fitted_model_and_a_plot(table):
    path, png, stdout = table
    data = json.loads(path.read_text())
    assert data["format"] == "ddl_triton-tuning" and data["key"]["world_size"] == 2
    for collective in ("allreduce", "broadcast"):
        rows = data["entries"][collective]["float32"]
        assert [r["bytes"] for r in rows] == [8, 32, 128, 512, 2048, 8192, 16384]
        for r in rows:
            assert r["by_schedule"][r["schedule"]] == r["time_us"] > 0
            assert r["p20_us"] <= r["time_us"] <= r["p80_us"]
    assert data["model"]["fit"]["samples"] > 10 and data["model"]["validation"]
    assert png.stat().st_size > 10_000
    assert re.search(r"# swept in [\d.]+ s; best layout: pipeline depth 4, slot \d+ B", stdout), stdout
    assert re.search(r"# model on \d+ sizes the sweep skipped: median \|error\|", stdout), stdout


def test_the_runtime_uses_the_table_and_handles_bad_ones(table, tmp_path):
    path = table[0]
    data = json.loads(path.read_text())
    (tmp_path / "corrupt.json").write_text(path.read_text()[:200])
    (tmp_path / "elsewhere.json").write_text(json.dumps(dict(data, key=dict(data["key"], world_size=99))))
    mystery = json.loads(path.read_text())
    for row in mystery["entries"]["allreduce"]["float32"]:
        row["schedule"] = "mystery"
    (tmp_path / "unknown-schedule.json").write_text(json.dumps(mystery))
    proc = run_ranks(2, "multirank/tune_multirank_worker.py", str(path), str(tmp_path), timeout=180)
    # The two ranks' lines may interleave mid-line: match the verdicts, not whole lines.
    cases = re.findall(r"CASE (\S+) rank=(\d) ok=(\d)", proc.stdout)
    assert proc.returncode == 0 and all(ok == "1" for *_, ok in cases), proc.stdout + proc.stderr
    assert len({(name, rank) for name, rank, _ in cases}) == 2 * 11, proc.stdout


def test_a_budget_stops_the_sweep_and_keeps_what_was_measured(tmp_path):
    path = tmp_path / "t.json"
    proc = _ddlrun(2, str(BIN / "ddl-tune"), *SMALL, "--budget", "0", "--out", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "stopped early: what was measured is kept" in proc.stdout
    assert json.loads(path.read_text())["entries"] == {}


def test_a_single_rank_is_told_how_to_launch_and_kernels_without_a_gpu_exit_zero():
    alone = subprocess.run([str(BIN / "ddl-tune"), "--quick"], capture_output=True, text=True, timeout=60)
    assert alone.returncode == 2 and "run it under ddlrun/mpiexec" in alone.stderr
    kernels = subprocess.run([str(BIN / "ddl-tune"), "--kernels"], capture_output=True, text=True, timeout=60)
    assert kernels.returncode == 0 and "no GPU" in kernels.stdout


def test_add_a_schedule_in_30_lines_example():
    proc = _ddlrun(2, sys.executable, "examples/custom_schedule.py", "--max-bytes", "16K")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert re.search(r"schedules.check proved \d+ cases exact", out) and "3. forced: exact on 2 ranks" in out
    explained = re.findall(r"^5\. +\d+ B: \S+ +tuned \(.*\): measured (.*)$", out, re.M)
    assert len(explained) == 7 and all("star" in e for e in explained), out  # star was measured at every size
