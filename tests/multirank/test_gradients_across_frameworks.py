"""The framework-neutral gradient floor (ddl_triton/gradients/) through torch's, JAX's and TensorFlow's rooms.

tests/multirank/gradients_worker.py in ONE mpiexec launch of 2 ranks on two emulated hosts
(TensorFlow's import costs seconds per process): for "none", every registered method and "auto"
(following a tuning table's compression section), the same integer-valued gradients give the
same decision per bucket and the same reduced bytes (==) in every room and on every rank; sizes
0, 1, primes and a float16 bucket whose real and fp32-equivalent bytes fall on either side of the
table's boundary. Skipped without JAX or TensorFlow."""
from __future__ import annotations

import importlib.util

import pytest

from support.launch import ddl_segments, run_ranks
from support.report import read_report

# Looked up, not imported: TensorFlow's import costs seconds (and tests/multirank/test_tensorflow.py says why not here).
for _name in ("tensorflow", "jax"):
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"{_name} is not installed", allow_module_level=True)

N = 2


def test_torch_jax_and_tensorflow_decide_alike_and_reduce_to_the_same_bytes():
    before = ddl_segments()
    proc = run_ranks(N, "multirank/gradients_worker.py", timeout=300,
                     env={"DDL_TOPOLOGY": "1x2", "DDL_TUNING_FILE": "off", "TF_CPP_MIN_LOG_LEVEL": "2"})
    out = proc.stdout + proc.stderr
    read_report(proc.stdout, f"gradients_worker: {N} ranks", N)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-6000:]}"
    leaked = ddl_segments() - before
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
