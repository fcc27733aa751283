"""dtype staging: how any torch tensor travels through ddl_triton, which moves a fixed set of dtypes.

Semantics: the result is bit-for-bit what a backend moving the dtype natively would give.

- Copy-only collectives (broadcast, all-gather, all-to-all, scatter) carry any dtype as its
  raw bytes: viewed as int64/int32 when the element size allows, else widened byte by
  byte into int32 (``copy_stage``). Example: 6 x complex64 (48 bytes) travel as 12 x int64.
- Reductions take ddl_triton's dtypes as they are, and bool/int8/uint8/int16 widened to
  int64, reduced exactly, and narrowed back (wrapping like native overflow) by the copy-back
  (``reduce_stage``). Others (complex, float8) are refused by name.

Each stage returns ``(wire tensor, finish)``: the tensor to hand to the communicator, and
the copy-back to run once the collective is done (None when the wire is the tensor).
"""
from __future__ import annotations

import torch

from ..ops import DTYPES

WIDENED = (torch.bool, torch.int8, torch.uint8, torch.int16)  # reduced in int64, exactly


def copy_stage(t: torch.Tensor, fresh: bool = False, copy: bool = False):
    """(wire tensor, finish) for a copy-only collective. Supported dtypes go as they are (a copy when
    ``copy``); others as their raw bytes, widened into int32 (or viewed as int32/int64 when the
    element size allows). ``fresh``: an output whose current contents do not matter."""
    if t.dtype in DTYPES:
        return (t.detach().clone() if copy else t.detach()), None  # c10d moves data, never autograd history
    item = t.element_size()
    flat = t.detach().contiguous().reshape(-1)
    if fresh:
        flat = torch.empty(flat.shape, dtype=t.dtype, device=t.device)
    raw = as_bytes(flat)
    wire = raw.view(torch.int64) if item % 8 == 0 else raw.view(torch.int32) if item % 4 == 0 else raw.to(torch.int32)

    def finish():
        back = wire.view(torch.uint8) if item % 4 == 0 else wire.to(torch.uint8)
        t.copy_(back.view(t.dtype).view(t.shape))

    return wire, finish


def reduce_stage(t: torch.Tensor, op: str, what: str, fresh: bool = False, copy: bool = False):
    """(wire tensor, finish) for a reduction: supported dtypes as they are (a copy when ``copy``),
    bool/int8/uint8/int16 widened to int64 (exact; narrowing back wraps like native overflow)."""
    if t.dtype in DTYPES:
        return (t.detach().clone() if copy else t.detach()), None  # c10d moves data, never autograd history
    if t.dtype not in WIDENED:
        raise TypeError(f"ddl backend: {what} cannot reduce dtype {t.dtype}; supported: "
                        f"{', '.join(str(d).replace('torch.', '') for d in DTYPES + WIDENED)}")
    wire = torch.empty(t.shape, dtype=torch.int64, device=t.device) if fresh else t.to(torch.int64)

    def finish():
        t.copy_(wire)

    return wire, finish


def shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share storage (an in-place collective: the input is a slice of the output)."""
    return a.numel() > 0 and b.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of contiguous ``t``."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def byte_counts(tensors, splits, per_tensor: bool) -> list[int]:
    if per_tensor:
        return [nbytes(t) for t in tensors]
    t = tensors[0]
    row = nbytes(t) // max(1, t.shape[0] if t.dim() else 1)
    return [s * row for s in splits[0]]


def displs(counts: list[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


def unflatten_into(tensors, flat: torch.Tensor) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view(t.shape))
        offset += n


