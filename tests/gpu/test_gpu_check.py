"""bench/gpu_check.py on a machine without a CUDA GPU: it must skip every section, quickly and cleanly;
and its multi-rank worker (tests/gpu/cuda_ranks_worker.py) must pass on CPU tensors.

Runs the script in a child process with CUDA_VISIBLE_DEVICES="" and checks: exit status 0, the last
non-empty line of its output is exactly ``no GPU: skipped``, the JSON it writes says ``"gpu": false``,
and the run takes under 30 s (the script imports triton, ddl_triton and nvshmem only on a GPU).

    python -m pytest -q tests/gpu/test_gpu_check.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a CUDA GPU is visible: this test covers gpu_check.py's no-GPU path only; on a GPU machine run "
           "`python bench/gpu_check.py` itself (it takes minutes)")


def run_gpu_check(cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
    return proc, time.monotonic() - start


def check_skipped_run(proc: subprocess.CompletedProcess, seconds: float, json_path: Path) -> None:
    output = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, output
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines and lines[-1] == "no GPU: skipped", output
    assert json.loads(json_path.read_text())["gpu"] is False
    assert seconds < 30, f"took {seconds:.1f} s\n{output}"


def test_skips_without_a_gpu(tmp_path):
    json_path = tmp_path / "results" / "gpu.json"
    proc, seconds = run_gpu_check(tmp_path, "--json", str(json_path))
    check_skipped_run(proc, seconds, json_path)
    doc = json.loads(json_path.read_text())
    assert doc["exit_status"] == 0
    assert {row["verdict"] for row in doc["rows"]} == {"SKIP"}


def test_default_json_lands_in_the_working_directory(tmp_path):
    proc, seconds = run_gpu_check(tmp_path, "--quick")
    check_skipped_run(proc, seconds, tmp_path / "gpu_check.json")


def test_cuda_ranks_worker_logic_on_cpu_tensors():
    """The worker gpu_check.py runs on a GPU at 2 ranks, here on CPU tensors at 3 ranks (the
    two-shot compressed path, the one_shot/two_shot split of an odd world): every check runs and
    passes, so a failure on the GPU is the GPU path's, not the worker's."""
    from support.launch import assert_clean_run, ddl_segments, run_ranks
    before = ddl_segments()
    proc = run_ranks(3, "gpu/cuda_ranks_worker.py", "--device", "cpu", env={"DDL_TUNING_FILE": "off"})
    assert_clean_run(proc, before)
    summary = [line for line in proc.stdout.splitlines() if line.startswith("cuda ranks:")]
    assert summary and summary[-1].endswith(" 0 failures"), proc.stdout[-3000:]
    checks = int(summary[-1].split(", ")[-2].split()[0])
    assert checks > 2000, summary  # every stage ran: schedules, others, compressed, DDP
