"""Triton is imported when a Triton kernel is first needed, not with the launchers every rank imports
(ddl_triton/kernels/_lazy_kernels.py). Each check runs in a fresh interpreter, where sys.modules
shows what an import or a call loaded."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter per check: make check, the inner loop, leaves them out

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, **env: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_rank_on_the_cpu_fast_path_never_imports_triton():
    out = _run("""
import sys
import torch
import ddl_triton.runtime.communicator
import ddl_triton.kernels as K
print("import:", "triton" in sys.modules)
a, b, c = (torch.arange(7, dtype=torch.float32) * k for k in (1, 2, 3))
out = torch.empty(7)
K.reduce(out, [a, b, c])
assert out.tolist() == [6.0 * i for i in range(7)]
q, s = K.quantize_int8(a, block=4)
K.dequantize_int8(q, s, block=4)
bits, scale = K.sign_compress(a, torch.zeros(7))
K.sign_decompress(bits, scale, 7)
K.unpack(K.pack([a, b]), [a, b])
K.launch_configs.pin("reduce", {"BLOCK": 256})
print("torch ops:", "triton" in sys.modules)
""", DDL_KERNELS="auto", TRITON_INTERPRET="0")
    assert out.split("\n")[:2] == ["import: False", "torch ops: False"], out


def test_the_first_triton_launch_or_the_sweep_imports_it():
    out = _run("""
import importlib, sys
import torch
import ddl_triton.kernels as K
from ddl_triton.kernels import _reduce_jit
reduce_module = importlib.import_module("ddl_triton.kernels.reduce")  # K.reduce is the function
a, b, c = (torch.arange(7, dtype=torch.float32) * k for k in (1, 2, 3))
out = torch.empty(7)
K.reduce(out, [a, b, c])
print("interpreted launch:", "triton" in sys.modules, out.tolist() == [6.0 * i for i in range(7)])
print("same kernel:", reduce_module._reduce_kernel is _reduce_jit._reduce_kernel)
print("sweep:", callable(K.config_sweep.sweep), K.config_sweep.NoGpu.__name__)
""", DDL_KERNELS="triton", TRITON_INTERPRET="1")
    assert out.split("\n")[:3] == ["interpreted launch: True True", "same kernel: True", "sweep: True NoGpu"], out


def test_a_kernel_needed_after_tensorflow_is_refused_by_name_not_an_abort():
    """Triton loaded after TensorFlow aborts the process (their LLVMs clash: SIGABRT, no Python error).
    A stand-in module named tensorflow (the real import costs seconds) makes the first kernel load
    raise ImportError naming the fix; the rank lives on. ddl_triton.tensorflow loads triton first."""
    out = _run("""
import sys, types
import torch
import ddl_triton.kernels as K
sys.modules["tensorflow"] = types.ModuleType("tensorflow")
a = torch.arange(7, dtype=torch.float32)
out = torch.empty(7)
try:
    K.reduce(out, [a, a])
except ImportError as e:
    print("refused:", "triton" in sys.modules, "before tensorflow" in str(e))
del sys.modules["tensorflow"]
K.load_triton()
K.reduce(out, [a, a])
print("after load_triton:", out.tolist() == [2.0 * i for i in range(7)])
""", DDL_KERNELS="triton", TRITON_INTERPRET="1")
    assert out.split("\n")[:2] == ["refused: False True", "after load_triton: True"], out


def test_without_triton_a_kernel_is_refused_naming_the_package_and_the_cpu_path_runs():
    """Triton is not in the default install (a CPU rank never needs it; CUDA builds of torch bring
    it). Where it is missing (``sys.modules["triton"] = None`` makes ``import triton`` fail, as an
    absent package does), the torch path runs, a Triton kernel asked for raises ImportError naming
    the package to install, and ddl_triton.tensorflow's early load (``if_installed``) is a no-op."""
    out = _run("""
import sys
sys.modules["triton"] = None
import torch
import ddl_triton.kernels as K
a = torch.arange(7, dtype=torch.float32)
out = torch.empty(7)
K.set_backend("torch")
K.reduce(out, [a, a])
print("torch path:", out.tolist() == [2.0 * i for i in range(7)])
K.load_triton(if_installed=True)
K.set_backend("triton")
try:
    K.reduce(out, [a, a])
    print("no error")
except ImportError as e:
    print("refused:", "triton is not installed: pip install triton" in str(e))
""", TRITON_INTERPRET="1")
    assert out.split("\n")[:2] == ["torch path: True", "refused: True"], out
