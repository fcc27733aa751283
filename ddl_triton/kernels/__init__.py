"""Triton kernels of ddl_triton: reduction.

Each launcher takes keyword-only options, validates its tensors, and runs the
private ``@triton.jit`` kernel on CUDA tensors (or on CPU tensors when
``DDL_KERNELS=triton`` under ``TRITON_INTERPRET=1``); CPU tensors otherwise run
the torch reference that sits beside each kernel.
"""
from ._dispatch import get_backend, set_backend
from .reduce import REDUCE_OPS, reduce, reduce_reference

__all__ = ["REDUCE_OPS", "get_backend", "reduce", "reduce_reference", "set_backend"]
