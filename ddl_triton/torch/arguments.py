"""torch.distributed's arguments, as the "ddl" ProcessGroup receives them: unpacked and checked.

Semantics: each helper either returns the argument in the one form the group works with (an
options object, one tensor, a list of ``size`` tensors, output/input pairs, rows per rank) or
raises ValueError/TypeError beginning "ddl backend: <operation>", before anything is sent.
"""
from __future__ import annotations

import torch
from torch.distributed import ReduceOp

from ..runtime.calls import gpu_path

_RED = ReduceOp.RedOpType


def reduce_opts(opts, kind):
    """Accept an options object, a ReduceOp, or None (torch's pybind overloads allow all three)."""
    if opts is None:
        return kind()
    if isinstance(opts, (ReduceOp, _RED)):
        o = kind()
        o.reduceOp = opts
        return o
    return opts


def plain_opts(opts, kind):
    return kind() if opts is None else opts


def async_opts(opts, kind):
    o = kind()
    o.asyncOp = getattr(opts, "asyncOp", True)
    return o


def one_tensor(tensors, what: str) -> torch.Tensor:
    if isinstance(tensors, torch.Tensor):
        return tensors
    tensors = list(tensors)
    if len(tensors) != 1:
        raise ValueError(f"ddl backend: {what} takes exactly one tensor per rank, got {len(tensors)}")
    return tensors[0]


def one_list(lists, what: str, size: int) -> list[torch.Tensor]:
    lists = list(lists)
    if len(lists) != 1:
        raise ValueError(f"ddl backend: {what} takes one tensor list per rank, got {len(lists)}")
    tensors = list(lists[0])
    if len(tensors) != size:
        raise ValueError(f"ddl backend: {what} needs a list of {size} tensors (the group size), got {len(tensors)}")
    return tensors


def pairs(outputs, inputs, what: str):
    outputs, inputs = list(outputs), list(inputs)
    if len(outputs) != len(inputs):
        raise ValueError(f"ddl backend: {what} got {len(outputs)} outputs for {len(inputs)} inputs")
    return list(zip(outputs, inputs))


def check_same(what: str, ref: torch.Tensor, others) -> None:
    for t in others:
        if t.numel() != ref.numel() or t.dtype != ref.dtype:
            raise ValueError(f"ddl backend: {what} needs every tensor to match {ref.numel()} x {ref.dtype}, "
                             f"got {t.numel()} x {t.dtype} (uneven sizes are not supported)")


def check_device(what: str, *tensors, gpu: bool = True) -> None:
    """Tensors on the CPU, or on CUDA when this process has the GPU path and ``what`` runs on it
    (the collectives do; point-to-point and uneven all-to-all move host memory)."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ddl backend: {what} expects tensors, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"ddl backend: {what} got a tensor of layout {t.layout}; only dense (strided) tensors "
                            "are supported (sparse all-reduce: use gloo)")
        if t.device.type == "cpu":
            continue
        if t.is_cuda and gpu and gpu_path.available():
            continue
        where = ("it runs on CPU tensors only" if t.is_cuda and not gpu else
                 "this process has no GPU path" if t.is_cuda else "only CPU and CUDA tensors are supported")
        raise ValueError(f"ddl backend: {what} got a tensor on {t.device}; {where}: move the tensor to the CPU")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"ddl backend: {what} got tensors on several devices: {sorted(map(str, devices))}")


def root_rank(root: int, size: int, what: str) -> int:
    if not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"ddl backend: {what} rank {root!r} is not a rank of this group (size {size})")
    return root


def split_rows(split_sizes, t: torch.Tensor, size: int, what: str) -> list[int]:
    """Rows per rank along dim 0; an empty list means ``size`` equal slices."""
    rows = t.shape[0] if t.dim() else 1
    if not split_sizes:
        if rows % size:
            raise ValueError(f"ddl backend: all_to_all_single {what} has {rows} rows, not divisible "
                             f"by the group size {size}; pass split sizes")
        return [rows // size] * size
    splits = [int(s) for s in split_sizes]
    if len(splits) != size or sum(splits) != rows:
        raise ValueError(f"ddl backend: all_to_all_single {what} splits {splits} must be {size} sizes "
                         f"summing to {rows}")
    return splits


def chain(fns):
    fns = [f for f in fns if f is not None]
    if not fns:
        return None

    def run():
        for f in fns:
            f()
    return run
