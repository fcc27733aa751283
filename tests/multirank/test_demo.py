"""`make demo`'s two commands, at a reduced size, so that a broken demo cannot land.

The Makefile runs, at 4 ranks under ddlrun, ``examples/demo.py`` (a benchmark table and a
few training steps) and ``examples/train_cnn.py --hook int8``; here the same commands run
with ``--quick`` and two epochs, and must exit 0 with their summaries intact.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DDLRUN = Path(sys.executable).parent / "ddlrun"


def _ddlrun(*command: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(DDLRUN), "-n", "4", "--", sys.executable, *command], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_demo_benchmark_and_training():
    out = _ddlrun("examples/demo.py", "--quick").stdout
    assert "mpi/ddl = MPICH's MPI_Allreduce time / ddl_triton's" in out, out
    assert out.count("# allreduce fp32 sum on 4 ranks:") == 1, out  # one world of the 4 ranks asked for
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert [int(r[0]) for r in rows] == [256, 65536], out
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows), out
    assert "replicas bit-identical after training: yes" in out, out


def test_demo_cnn_training_with_the_int8_hook():
    proc = _ddlrun("examples/train_cnn.py", "--hook", "int8", "--epochs", "2")
    result = re.search(r"^RESULT hook=int8 backend=ddl ranks=4 accuracy=([\d.]+) .* identical=1$", proc.stdout, re.M)
    assert result, proc.stdout
    assert float(result.group(1)) > 0.3, proc.stdout  # 10 classes: chance is 0.1; two epochs reach ~0.7
    # Rank 0's progress bar (shown once the run outlasts its 0.3 s delay), not 20 lines per epoch.
    assert "training:" not in proc.stderr or "training: 100%" in proc.stderr, proc.stderr
    assert "step    0" not in proc.stdout, proc.stdout
