"""Argument checks of the collectives, run before any communication.

Semantics: each check raises TypeError or ValueError naming the rank and the problem, or
returns None. The communicator checks before it issues the call, so a refused call sends
nothing, is not recorded, and leaves the communicator usable.
"""
from __future__ import annotations

import torch

from ...ops import DTYPES
from . import gpu_path


def check_tensor(rank: int, t, name: str, writable: bool = False) -> None:
    """``t`` is a tensor ddl_triton can move: a supported dtype, on the CPU (or CUDA with a GPU
    path); when ``writable`` (a result lands in it), free of autograd and of overlapping elements."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"rank {rank}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise TypeError(f"rank {rank}: {name} has unsupported dtype {t.dtype}; "
                        f"supported: {', '.join(str(d).replace('torch.', '') for d in DTYPES)}")
    if not t.is_cpu and not (t.is_cuda and gpu_path.available()):
        raise ValueError(f"rank {rank}: {name} is on {t.device}, but this process has no GPU path "
                         f"({gpu_path.unavailable_reason(t)}); move it to the CPU")
    if writable and t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"rank {rank}: {name} requires grad; collectives are not autograd operations "
                         "and write in place: pass tensor.detach() or run under torch.no_grad()")
    # Only a non-contiguous tensor can have a stride of 0 over a dimension longer than 1.
    if writable and not t.is_contiguous() and any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        raise ValueError(f"rank {rank}: {name} has overlapping elements (a stride of 0, e.g. "
                         "from expand()); writing a result into it is ambiguous: pass a .clone()")


def check_output_input(rank: int, size: int, collective: str, output, input) -> None:
    """``output`` and ``input`` of a two-buffer collective: each a valid tensor, alike in dtype
    and device, sharing no memory, with the block sizes ``collective`` needs."""
    check_tensor(rank, output, "output", writable=True)
    check_tensor(rank, input, "input")
    _check_pair(rank, output, input)
    if collective == "reduce_scatter" and input.numel() != size * output.numel():
        raise ValueError(f"rank {rank}: reduce_scatter needs input.numel() == size * output.numel() "
                         f"({size} * {output.numel()}), got {input.numel()}")
    if collective == "all_gather" and output.numel() != size * input.numel():
        raise ValueError(f"rank {rank}: all_gather needs output.numel() == size * input.numel() "
                         f"({size} * {input.numel()}), got {output.numel()}")
    if collective == "all_to_all" and (output.numel() != input.numel() or input.numel() % size):
        raise ValueError(f"rank {rank}: all_to_all needs output.numel() == input.numel(), divisible by "
                         f"size {size}; got {output.numel()} and {input.numel()}")


def check_root(rank: int, size: int, root) -> None:
    """``root`` is a rank of a communicator of ``size`` ranks."""
    if not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"rank {rank}: broadcast root {root!r} is not a rank of this "
                         f"communicator (size {size})")


def _check_pair(rank: int, output: torch.Tensor, input: torch.Tensor) -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"rank {rank}: output is {output.dtype} but input is {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"rank {rank}: output is on {output.device} but input is on {input.device}")
    if output.numel() and input.numel():
        o0 = output.data_ptr()
        o1 = o0 + output.untyped_storage().nbytes()
        i0 = input.data_ptr()
        i1 = i0 + input.untyped_storage().nbytes()
        if output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr() or (o0 < i1 and i0 < o1):
            raise ValueError(f"rank {rank}: output and input share memory; pass separate tensors")
