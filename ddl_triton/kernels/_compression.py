"""What the compression launchers (int8.py, onebit.py) share: the dtypes they take and write, when
the compiled kernels apply, the contiguity check, and the look-up of a kernel's autotuned wrapper."""
from __future__ import annotations

import torch

from . import launch_configs
from ._dispatch import interpreting
from ._lazy_kernels import LazyKernels

QUANT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)                 # what a compressor takes
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)    # what a decompressor writes


def compiled(t: torch.Tensor) -> bool:
    """True when the autotuned, compiled kernels apply (a GPU, not the interpreter)."""
    return t.is_cuda and not interpreting()


def tuned(jit_kernels: LazyKernels, autotune: dict, kernel: str):
    """The autotuned wrapper of ``kernel`` over its launch configurations as they are now.

    ``autotune`` maps each kernel's name in launch_configs.py to the name of its ``@triton.jit``
    function in ``jit_kernels`` and its autotuning arguments (key, restore_value)."""
    jit_name, autotune_args = autotune[kernel]
    return launch_configs.autotuned(kernel, jit_kernels[jit_name], **autotune_args)


def check_contiguous(name: str, **tensors: torch.Tensor) -> None:
    for what, t in tensors.items():
        if not t.is_contiguous():
            # The Triton interpreter silently misreads strided memory: refuse it.
            raise ValueError(f"{name}: {what} must be contiguous")
