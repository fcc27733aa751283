"""Bucket packing: copy many tensors into one flat buffer (``pack``) and back (``unpack``), one launch each.

Semantics (what every path computes):
    pack(tensors)       -> flat = cat([t.view(-1) for t in tensors])     # tensors in list order
    unpack(flat, tensors): for t, start in zip(tensors, starts): t.view(-1)[:] = flat[start:start + t.numel()]
where starts are the exclusive prefix sums of the numels. All tensors share one dtype and device
and are contiguous; ``flat`` may not overlap any tensor, nor the tensors one another (the Triton
path raises; on the torch path torch.cat raises for pack, and unpack copies in list order).

Worked example:
    a = tensor([1., 2., 3.]); b = tensor([[4., 5.], [6., 7.]]); c = tensor([])
    pack([a, b, c])                     -> tensor([1., 2., 3., 4., 5., 6., 7.])
    unpack(tensor([9., 8., 7., 6., 5., 4., 3.]), [a, b, c])
                                        -> a = [9., 8., 7.], b = [[6., 5.], [4., 3.]]

How one launch reaches every tensor: an int64 table of ``data_ptr()`` values, cast back to typed
pointers in the kernel (``tl.load(table + t).to(tl.pointer_type(...))``, the grouped-GEMM
tutorial's pattern). This works under ``TRITON_INTERPRET=1`` for CPU tensors: the interpreter
dereferences raw host addresses (checked by tests/unit/test_kernels.py). It cannot work for CUDA
tensors under the interpreter, which copies only the kernel's own arguments to the host; that
combination raises. The grid is 1-D over the blocks of all tensors (not tensors x max blocks),
so one large tensor among many small ones launches no idle programs; a per-program table maps
program -> (tensor, block). Both tables live in one int64 device tensor, built once per distinct
(pointers, sizes) list and cached, because a DDP bucket packs the same tensors every step; the
cache key determines the table's contents, so a reused address can never see a stale entry.
BLOCK is fixed rather than autotuned because the program table depends on it.

Memory traffic: one read and one write of the total number of bytes.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from ._dispatch import interpreting, use_triton
from ._lazy_kernels import LazyKernels

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
           torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_GPU_BLOCK, _GPU_WARPS = 4096, 8
_INTERPRETER_BLOCK = 1024
_TABLE_CACHE: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_TABLE_CACHE_SIZE = 64


_KERNELS = LazyKernels(__name__, "._pack_jit", ["_pack_kernel"])
__getattr__ = _KERNELS.module_getattr  # pack._pack_kernel: the @triton.jit kernel, loaded on first use


def pack_reference(tensors: Sequence[torch.Tensor], *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Torch-ops implementation of :func:`pack`; also the CPU fast path."""
    flats = [t.view(-1) for t in tensors]
    if out is None:
        return torch.cat(flats)
    torch.cat(flats, out=out.view(-1))
    return out


def unpack_reference(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Torch-ops implementation of :func:`unpack`; also the CPU fast path."""
    chunks = flat.view(-1).split([t.numel() for t in tensors])
    for t, chunk in zip(tensors, chunks):
        t.view(-1).copy_(chunk)


def pack(tensors: Sequence[torch.Tensor], *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate the flattened ``tensors`` into ``out`` (1-D, new if None) in one launch. Returns it.

    Example: pack([tensor([1., 2., 3.]), tensor([[4., 5.], [6., 7.]])]) -> tensor([1., 2., 3., 4., 5., 6., 7.])
    """
    total = _validate("pack", tensors)
    if out is None:
        out = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
    else:
        _validate_flat("pack", out, tensors, total)
    if not use_triton(out, *tensors):
        return pack_reference(tensors, out=out)
    _check_overlaps("pack", out, tensors)
    if total:
        _launch(out, tensors, unpack=False)
    return out


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (in place) in one launch.

    Example: unpack(tensor([9., 8., 7.]), [a, b]) with a.numel() == 1, b.numel() == 2
             -> a = [9.], b = [8., 7.]
    """
    total = _validate("unpack", tensors)
    _validate_flat("unpack", flat, tensors, total)
    if not use_triton(flat, *tensors):
        unpack_reference(flat, tensors)
        return
    _check_overlaps("unpack", flat, tensors)
    if total:
        _launch(flat, tensors, unpack=True)


def _validate(name: str, tensors: Sequence[torch.Tensor]) -> int:
    if len(tensors) == 0:
        raise ValueError(f"{name}: needs at least one tensor")
    dtype, device = tensors[0].dtype, tensors[0].device
    if dtype not in _DTYPES:
        raise TypeError(f"{name}: unsupported dtype {dtype}")
    for i, t in enumerate(tensors):
        if t.dtype != dtype:
            raise TypeError(f"{name}: tensors[{i}] is {t.dtype}, tensors[0] is {dtype}")
        if t.device != device:
            raise ValueError(f"{name}: tensors[{i}] is on {t.device}, tensors[0] on {device}")
        if not t.is_contiguous():
            # The Triton interpreter silently misreads strided memory, and a data_ptr table
            # assumes dense tensors: refuse it.
            raise ValueError(f"{name}: tensors[{i}] must be contiguous")
    return sum(t.numel() for t in tensors)


def _validate_flat(name: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor], total: int) -> None:
    what = "out" if name == "pack" else "flat"
    if flat.dtype != tensors[0].dtype:
        raise TypeError(f"{name}: {what} is {flat.dtype}, tensors are {tensors[0].dtype}")
    if flat.numel() != total:
        raise ValueError(f"{name}: {what} has {flat.numel()} elements, the tensors {total}")
    if flat.device != tensors[0].device:
        raise ValueError(f"{name}: {what} is on {flat.device}, tensors on {tensors[0].device}")
    if not flat.is_contiguous():
        raise ValueError(f"{name}: {what} must be contiguous")


def _check_overlaps(name: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Overlaps would make the kernel's result depend on the order its programs run in.

    Only the Triton path pays for this (O(T log T) in Python, ~0.1 ms for 48 tensors): torch.cat
    refuses an out that overlaps its inputs itself, and the reference unpack copies in list order.
    """
    what = "out" if name == "pack" else "flat"
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
                   for i, t in enumerate(tensors) if t.numel())
    f0, f1 = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    for a0, a1, i in spans:
        if f0 < a1 and a0 < f1:
            raise ValueError(f"{name}: {what} overlaps tensors[{i}]")
    if name == "unpack":
        for (_, a1, i), (b0, _, j) in zip(spans, spans[1:]):
            if b0 < a1:
                raise ValueError(f"unpack: tensors[{i}] and tensors[{j}] overlap")


def _launch(flat: torch.Tensor, tensors: Sequence[torch.Tensor], *, unpack: bool) -> None:
    if flat.is_cuda and interpreting():
        raise RuntimeError("pack/unpack: TRITON_INTERPRET=1 cannot follow CUDA pointer tables; use CPU tensors")
    compiled = flat.is_cuda
    block = _GPU_BLOCK if compiled else _INTERPRETER_BLOCK
    meta, num_programs = _meta_table(tensors, flat.device, block)
    kwargs = dict(num_warps=_GPU_WARPS) if compiled else {}
    kernel = _KERNELS["_pack_kernel"]
    kernel[(num_programs,)](flat, meta, len(tensors), num_programs, UNPACK=unpack, BLOCK=block, **kwargs)


def _meta_table(tensors: Sequence[torch.Tensor], device: torch.device, block: int) -> tuple[torch.Tensor, int]:
    ptrs = [t.data_ptr() for t in tensors]
    sizes = [t.numel() for t in tensors]
    key = (device, block, tuple(ptrs), tuple(sizes))
    meta = _TABLE_CACHE.get(key)
    if meta is None:
        sizes_t = torch.tensor(sizes, dtype=torch.int64)
        starts = torch.cumsum(sizes_t, 0) - sizes_t
        blocks = (sizes_t + block - 1) // block
        prog_tensor = torch.repeat_interleave(torch.arange(len(tensors)), blocks)
        first = torch.cumsum(blocks, 0) - blocks
        prog_block = torch.arange(prog_tensor.numel()) - first[prog_tensor]
        meta = torch.cat([torch.tensor(ptrs, dtype=torch.int64), starts, sizes_t, prog_tensor, prog_block])
        meta = meta.to(device)
        _TABLE_CACHE[key] = meta
        if len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
            _TABLE_CACHE.popitem(last=False)
    else:
        _TABLE_CACHE.move_to_end(key)
    return meta, (meta.numel() - 3 * len(tensors)) // 2
