"""Which implementation a kernel launcher uses: Triton or torch ops.

CUDA tensors always go to the Triton kernels. CPU tensors go to torch ops (the
fast path on a CPU) unless ``DDL_KERNELS=triton`` (or ``set_backend("triton")``)
forces the Triton kernels, which then run under ``TRITON_INTERPRET=1``; that is
how the CI exercises the GPU kernels without a GPU.
"""
from __future__ import annotations

import os

import torch

_VALID_BACKENDS = ("auto", "torch", "triton")
_backend: str | None = None


def set_backend(name: str) -> None:
    """Select "auto" (CUDA→Triton, CPU→torch), "torch" or "triton" for every launcher."""
    global _backend
    if name not in _VALID_BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; valid: {', '.join(_VALID_BACKENDS)}")
    _backend = name


def get_backend() -> str:
    """The backend in force: the one ``init`` set (``Options.kernels``), else, on first use outside a
    communicator, the environment's (``DDL_KERNELS``, read through ``Options.from_env``)."""
    if _backend is None:
        from ..options import Options
        set_backend(Options.from_env().kernels)
    return _backend  # type: ignore[return-value]


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton kernel should run for these tensors."""
    backend = get_backend()
    if backend == "triton":
        return True
    if backend == "torch":
        return False
    return any(t.is_cuda for t in tensors)


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``, where autotuning (which needs a GPU timer) is skipped."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are carried in: fp32 for 16-bit floats, the dtype itself otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
