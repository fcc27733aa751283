"""ddl_triton.tensorflow at 2 ranks: tests/multirank/tf_worker.py in ONE mpiexec launch (TensorFlow's
import costs seconds per process), each mode with its own report; skipped without TensorFlow.

Each test reads its mode's report (every rank, 0 failures, the same number of checks on each)
and the launch's own verdict: exit 0 and no shared-memory segment left behind."""
from __future__ import annotations

import functools
import importlib.util

import pytest

from support.launch import ddl_segments, run_ranks
from support.report import read_report

# Looked up, not imported: TensorFlow's import costs seconds, and Triton loaded after it in this
# process (a later test module's kernels) would abort pytest (ddl_triton/kernels/_lazy_kernels.py).
if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed (pip install '.[tensorflow]')", allow_module_level=True)

N = 2


@functools.cache
def _launch():
    before = ddl_segments()
    proc = run_ranks(N, "multirank/tf_worker.py", "--modes", "collectives,training,errors", timeout=240,
                     env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    return proc, ddl_segments() - before


def _read(mode: str) -> None:
    proc, leaked = _launch()
    read_report(proc.stdout, f"tf_worker: {N} ranks, {mode}", N)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-6000:]}"
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"


def test_collectives_exact_in_order_and_differentiable_eager_and_in_tf_function():
    # every dtype and size, bitwise the torch path and across ranks; 3N collectives in order; gradients; fusion
    _read("collectives")


def test_training_equals_full_batch_and_replicas_stay_identical():
    # custom loop (eager, tf.function) and model.fit with the callback + DistributedOptimizer (and int8)
    _read("training")


def test_bad_input_is_refused_on_every_rank():
    # dtypes the core does not reduce, bad op/root/compression, shapes that differ across ranks
    _read("errors")
