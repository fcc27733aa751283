"""The one bucket planner: which tensors are fused into which collective.

Tensors are taken in order; each joins the open bucket of its key (its dtype, or one key for
all when bytes are moved rather than reduced) unless that would take the bucket past
``bucket_bytes``: then the bucket is closed and a new one opened. A tensor larger than
``bucket_bytes`` is a bucket of its own; an empty bucket is never closed (a zero-size tensor
rides along with the next). The plan depends only on the keys and sizes, so every rank that
holds the same shapes builds the same buckets, and so the same collectives. Buckets are listed
in the order of their first tensor.

Example: sizes 12, 16, 20 bytes of one dtype, bucket_bytes 32 -> [[0, 1], [2]];
         float32 (12 B), int32 (8 B), float32 (16 B), bucket_bytes 64 -> [[0, 2], [1]].
"""
from __future__ import annotations

__all__ = ["check_bucket_bytes", "plan"]


def plan(keys, nbytes, bucket_bytes: int) -> list[list[int]]:
    """The tensors' indices grouped into buckets (module doc). ``keys``: one hashable per tensor
    (its dtype: a bucket holds one key); ``nbytes``: each tensor's bytes; ``bucket_bytes``: a
    positive int."""
    check_bucket_bytes(bucket_bytes)
    open_: dict = {}   # key -> [indices, bytes] of its open bucket
    done: list[list[int]] = []
    for i, (key, n) in enumerate(zip(keys, nbytes)):
        held = open_.get(key)
        if held is not None and held[1] and held[1] + n > bucket_bytes:
            done.append(held[0])
            held = None
        if held is None:
            held = open_[key] = [[], 0]
        held[0].append(i)
        held[1] += n
    done.extend(indices for indices, _ in open_.values())
    return sorted(done, key=lambda b: b[0])


def check_bucket_bytes(bucket_bytes, who: str = "", rank: int | None = None) -> int:
    """``bucket_bytes`` if it is a positive int, else ValueError naming ``rank`` (when given) and
    ``who`` (the API called, e.g. "GradientReducer")."""
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        where = (f"rank {rank}: " if rank is not None else "") + (f"{who}: " if who else "")
        raise ValueError(f"{where}bucket_bytes must be a positive int, got {bucket_bytes!r}")
    return bucket_bytes
