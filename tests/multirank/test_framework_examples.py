"""The README's JAX and TensorFlow lines, as a user runs them: ``ddlrun -n 2 -- python examples/jax_train.py``
and ``examples/tf_train.py``, at one epoch with int8 compression (the README shows the flag), so that a
broken example cannot land. Each must exit 0 and report replicas bitwise identical and a test accuracy
that only training gives (the digits have 10 classes: a guess scores about 0.1)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DDLRUN = Path(sys.executable).parent / "ddlrun"
LEARNED = 0.5  # one epoch of the digits reaches ~0.9; 0.5 is far above chance and far below that


def _ddlrun(*command: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(DDLRUN), "-n", "2", "--", sys.executable, *command], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2"),
                          capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.parametrize("example,extra", [("jax", "jax_train.py"), ("tensorflow", "tf_train.py")],
                         ids=["jax", "tensorflow"])
def test_the_readme_example_trains_with_identical_replicas(example, extra):
    if importlib.util.find_spec(example) is None:  # looked up, not imported (see test_tensorflow.py)
        pytest.skip(f"{example} is not installed (pip install '.[{example}]')")
    proc = _ddlrun(f"examples/{extra}", "--epochs", "1", "--compression", "int8")
    out = proc.stdout
    found = re.search(r"test accuracy ([\d.]+); replicas bitwise identical: (\w+)", out)
    assert found, out
    assert found.group(2) == "True" and float(found.group(1)) > LEARNED, out
    if example == "jax":  # rank 0's progress bar, on stderr: shown once the first step (its compile) outlasts the bar's delay
        assert "training: 100%" in proc.stderr and proc.stderr.count("training: 100%") == 1, proc.stderr[-3000:]
