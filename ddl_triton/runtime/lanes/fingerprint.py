"""A call's fingerprint: the 6 integers by which ranks compare the collective they are about to run.

Semantics: ``encode`` maps a call (collective, op, dtype, element count, root, on CUDA) to 6
integers; two calls that may run together have equal fingerprints, and any difference in those
fields makes them differ. ``describe`` turns a fingerprint back into the words an error lists
("allreduce(sum, 4 x float32)"); ``describe_posted`` also words "no fingerprint yet". The call
check (call_check.py) compares them, the call lane (call_lane.py) carries them in its headers and
the plan cache (calls/plan_cache.py) keeps them per call shape: the format lives here, below all
three, so that none of them imports another for it.
"""
from __future__ import annotations

import torch

from ...ops import DTYPES, OPS

CALLS = ("allreduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "barrier")


def encode(collective: str, op: str | None, dtype: torch.dtype | None, numel: int, root: int,
           on_gpu: bool = False) -> tuple[int, ...]:
    """The 6 integers: collective, op, dtype, element count, root, and 1 for CUDA tensors
    (a rank on the CPU path and one on the GPU path would wait on different transports)."""
    return (CALLS.index(collective), -1 if op is None else OPS.index(op),
            -1 if dtype is None else DTYPES.index(dtype), numel, root, int(on_gpu))


def describe(fp) -> str:
    """The call a fingerprint stands for, in words; None: a call this rank has not issued."""
    if fp is None:
        return "a later call (this rank issued more collectives)"
    coll, op, dtype, numel, root, on_gpu = (int(v) for v in fp[:6])
    # A fingerprint read off the wire may hold any bits: each field is named, never indexed blindly.
    name = CALLS[coll] if 0 <= coll < len(CALLS) else f"call#{coll}"
    args = []
    if op >= 0:
        args.append(OPS[op] if op < len(OPS) else f"op#{op}")
    if dtype >= 0:
        kind = str(DTYPES[dtype]).replace("torch.", "") if dtype < len(DTYPES) else f"dtype#{dtype}"
        args.append(f"{numel} x {kind}")
    if name == "broadcast":
        args.append(f"root {root}")
    if on_gpu:
        args.append("on CUDA")
    return f"{name}({', '.join(args)})"


def describe_posted(fp) -> str:
    """``describe``, where False means the peer has posted nothing for this call yet."""
    if fp is False:
        return "(has not reached this call yet)"
    return describe(fp)
