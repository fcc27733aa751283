"""bench/gpu_check.py on a machine without a CUDA GPU: it must skip every section, quickly and cleanly,
and say INCOMPLETE; its verdicts (a skipped section is never a PASS) and its check of the ranks'
report; and its multi-rank worker (tests/gpu/cuda_ranks_worker.py) must pass on CPU tensors.

Runs the script in a child process with CUDA_VISIBLE_DEVICES="" and checks: exit status 3
(INCOMPLETE), the last non-empty line of its output is exactly ``no GPU: skipped``, the JSON it
writes says ``"gpu": false``, and the run takes under 30 s (the script imports triton, ddl_triton
and nvshmem only on a GPU).

    python -m pytest -q tests/gpu/test_gpu_check.py
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support.report import rank_lines

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"

no_gpu_only = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a CUDA GPU is visible: this test covers gpu_check.py's no-GPU path only; on a GPU machine run "
           "`python bench/gpu_check.py` itself (it takes minutes)")


def run_gpu_check(cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
    return proc, time.monotonic() - start


def _gpu_check():
    """bench/gpu_check.py as a module (it imports only torch and the standard library at the top)."""
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_skipped_run(proc: subprocess.CompletedProcess, seconds: float, json_path: Path) -> None:
    output = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 3, output  # INCOMPLETE: nothing was checked
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines and lines[-1] == "no GPU: skipped", output
    assert json.loads(json_path.read_text())["gpu"] is False
    assert seconds < 30, f"took {seconds:.1f} s\n{output}"


@no_gpu_only
def test_skips_without_a_gpu(tmp_path):
    json_path = tmp_path / "results" / "gpu.json"
    proc, seconds = run_gpu_check(tmp_path, "--json", str(json_path))
    check_skipped_run(proc, seconds, json_path)
    doc = json.loads(json_path.read_text())
    assert (doc["verdict"], doc["exit_status"]) == ("INCOMPLETE", 3)
    assert {row["verdict"] for row in doc["rows"]} == {"SKIP"}


def test_a_skipped_section_is_incomplete_never_pass():
    gc = _gpu_check()
    report = gc.Report(quick=False)
    report.row("install", "nvshmem.core", "not importable (no module)", "SKIP")  # says why, below
    report.row("cuda tests", "tests/gpu/test_gpu.py", "12 passed", "PASS")
    assert report.verdict()[:2] == ("PASS", gc.EXIT_PASS)
    report.skip("nvshmem smoke", "nvshmem4py not importable")
    verdict, status, why = report.verdict()
    assert (verdict, status) == ("INCOMPLETE", gc.EXIT_INCOMPLETE) and "nvshmem smoke" in why, why
    assert len({gc.EXIT_PASS, gc.EXIT_FAIL, gc.EXIT_INCOMPLETE, 2}) == 4  # 2: argparse's usage error
    report.row("bandwidth", "reduce fp32", "running late: 9 s left", "SKIP")  # a measurement, not a section
    assert "bandwidth: reduce fp32" in report.verdict()[2]
    report.row("cuda ranks", "2 ranks", "1 failure", "FAIL", failure=True)
    assert report.verdict()[:2] == ("FAIL", gc.EXIT_FAIL)


def test_ranks_pass_only_with_every_rank_of_the_world_asked_for():
    """gpu_check's ``passed``: two singletons (each "rank 0 of 1") are not two ranks."""
    gc = _gpu_check()
    heading = "cuda ranks: 2 ranks on cuda, DDL_TRANSPORT=mpi"
    world = "\n".join(rank_lines(heading, [(0, 2, 900, 0), (1, 2, 900, 0)]) + [f"{heading}, 1800 checks, 0 failures"])
    assert gc.passed({"rc": 0, "output": world, "ranks": 2})
    lone = "\n".join(rank_lines("cuda ranks: 1 ranks on cuda, DDL_TRANSPORT=mpi", [(0, 1, 900, 0)])
                     + ["cuda ranks: 1 ranks on cuda, DDL_TRANSPORT=mpi, 900 checks, 0 failures"])
    run = {"rc": 0, "output": lone + "\n" + lone, "ranks": 2}
    assert not gc.passed(run) and "found 2" in run["problem"], run
    assert not gc.passed({"rc": 0, "output": world, "ranks": 3})


@no_gpu_only
def test_default_json_lands_in_the_working_directory(tmp_path):
    proc, seconds = run_gpu_check(tmp_path, "--quick")
    check_skipped_run(proc, seconds, tmp_path / "gpu_check.json")


def test_cuda_ranks_worker_logic_on_cpu_tensors():
    """The worker gpu_check.py runs on a GPU at 2 ranks, here on CPU tensors at 3 ranks (the
    two-shot compressed path, the one_shot/two_shot split of an odd world): every check runs and
    passes, so a failure on the GPU is the GPU path's, not the worker's."""
    from support.launch import assert_clean_run, ddl_segments, run_ranks
    from support.report import read_report
    before = ddl_segments()
    proc = run_ranks(3, "gpu/cuda_ranks_worker.py", "--device", "cpu", env={"DDL_TUNING_FILE": "off"})
    assert_clean_run(proc, before)
    checks = read_report(proc.stdout, "cuda ranks: 3 ranks on cpu", 3)  # every rank of the 3, each of 3
    assert checks[0] > 700, checks  # every stage ran: schedules, others, compressed, DDP
