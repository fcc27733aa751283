"""Gradient fusion: a list of tensors averaged in buckets, one collective per bucket, compressed or not.

``GradientReducer(compression=..., bucket_bytes=...)`` is what ``DistributedGradientTape`` and
``DistributedOptimizer`` share (Horovod's tensor fusion, DDP's buckets): ``reduce(grads)`` takes
a list of gradients (None kept as None, ``tf.IndexedSlices`` made dense) and returns them
averaged over the ranks (``op="sum"`` sums), as ONE TF op (bridge.py) that, inside, packs the
tensors in order into buckets of one dtype of at most ``bucket_bytes`` each (a tensor larger than
that is a bucket alone), reduces each bucket with one collective, and unpacks. Every rank packs
the same tensors the same way, so the buckets, and so the collectives, match.

Uncompressed ("none", the default): each bucket is ``comm.allreduce(bucket, op)``; an element's
result is what the same call on its own tensor gives (the core reduces elementwise; checked
bitwise at 2 ranks by tests/multirank/tf_worker.py). Compressed, a name of
``compression_methods.choices()``: float32/float16/bfloat16 buckets go through that method's
allreduce (ddl_triton/runtime/compression/compressed.py, on torch views of the NumPy buckets;
uncompressed buckets go to the core as NumPy arrays),
with its error feedback when the row keeps it: residuals are kept here, per bucket (its index,
method and size; a bucket that changes size starts again from zero). float64 and integer buckets
stay exact, and so does everything on one rank (no wire, nothing to save). "auto" is per level (ddl_triton/runtime/compression/per_level.py): fp32 over shared
memory inside a host, and between hosts what ddl_triton/tuning/auto_compression.py decides per
bucket size (fp32-equivalent bytes; the communicator's tuning table's compression section where
it has one, else the probed link; on one host: never compressed). Its first call is collective,
as every call is. The planner, the choice and the residuals are the framework-neutral floor's
(ddl_triton/gradients/); what is TensorFlow's own here is the op (bridge.py) and Horovod's names.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from . import bridge, horovod_args
from .. import compression_methods
from ..gradients import buckets
from ..gradients.reducer import Reducer, check_block

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's bucket_cap_mb default (Horovod fuses up to 128 MiB)


def plan_buckets(shapes: list, dtypes: list, bucket_bytes: int) -> list[tuple]:
    """``[(dtype, [(index, start, numel), ...], total), ...]``: the planner of
    ddl_triton/gradients/buckets.py in TensorFlow's terms: tensors in order, each dtype's bucket
    closed when the next tensor would take it past ``bucket_bytes`` (a tensor larger than that
    has a bucket of its own). Pure: the same shapes give the same buckets on every rank.
    Example: float32 shapes [(3,), (2, 2), (5,)] with bucket_bytes 32 -> [(f32, [(0, 0, 3), (1, 3, 4)], 7),
             (f32, [(2, 0, 5)], 5)]"""
    numels = [int(np.prod([int(d) for d in shape], dtype=np.int64)) for shape in shapes]
    out = []
    for members in buckets.plan(dtypes, [n * d.size for n, d in zip(numels, dtypes)], bucket_bytes):
        placed, total = [], 0
        for i in members:
            placed.append((i, total, numels[i]))
            total += numels[i]
        out.append((dtypes[members[0]], placed, total))
    return out


class GradientReducer:
    """Averages (``op="avg"``) or sums (``op="sum"``) lists of gradients over the ranks of ``comm``
    (default: the world), fused into buckets (module doc): TensorFlow's adapter of the
    framework-neutral ``ddl_triton.gradients.Reducer`` (named methods over the whole communicator).
    ``compression``: "none" (default), "auto"
    or a method of ddl_triton/compression_methods.py, or Horovod's ``Compression.none``/``.fp16``; ``error_feedback``: keep what compression
    lost and send it with the bucket's next call (default True); ``block``: the int8
    quantization block. Counters: ``calls`` (reduce calls run), ``collectives`` (buckets reduced),
    ``residual_resets``; ``decisions``: the choice per bucket size ({nbytes: Decision}, nbytes
    fp32-equivalent).
    Example (2 ranks): GradientReducer().reduce([tf.constant([1., 2.]) * (rank + 1)]) -> [[1.5, 3.0]]
    """

    def __init__(self, compression: str = compression_methods.NONE, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 op: str = "avg", error_feedback: bool = True, block: int = 256, comm=None):
        self.comm = comm if comm is not None else bridge.comm()
        rank = self.comm.rank
        compression = horovod_args.method(compression, rank, "GradientReducer")  # Horovod's Compression too
        self.compression = compression_methods.check_choice(compression, f"rank {rank}: compression")
        if op not in ("avg", "sum"):
            raise ValueError(f"rank {rank}: GradientReducer: op must be 'avg' or 'sum', got {op!r}")
        buckets.check_bucket_bytes(bucket_bytes, "GradientReducer", rank)
        check_block(block, "GradientReducer", rank)
        self.reducer = Reducer(self.comm, compression, named="world", block=block, error_feedback=error_feedback,
                               who="GradientReducer")
        self.op, self.bucket_bytes, self.block, self.error_feedback = op, bucket_bytes, block, bool(error_feedback)
        self.calls = self.collectives = 0
        self.decisions = self.reducer.decisions

    @property
    def residual_resets(self) -> int:
        """Buckets whose residual restarted from zero because their size or method changed."""
        return self.reducer.residuals.resets

    def reduce(self, grads) -> list:
        """``grads`` (a list of tensors, ``tf.IndexedSlices`` or None) reduced over the ranks, in
        one op: eager, or inside ``tf.function`` (bridge.py)."""
        grads = list(grads)
        dense = [(i, tf.convert_to_tensor(g)) for i, g in enumerate(grads) if g is not None]
        for _, g in dense:
            bridge.check_dtype(g.dtype, "gradient reduction", self.comm.rank)
            if self.op == "avg" and not g.dtype.is_floating:
                raise TypeError(f"rank {self.comm.rank}: GradientReducer: cannot average a {g.dtype.name} "
                                "gradient (use op='sum')")
        tensors = [g for _, g in dense]
        dtypes = [g.dtype for g in tensors]
        outs = bridge.call(lambda *values: self._run(values), tensors, dtypes,
                           [g.shape for g in tensors], "ddl_fused_allreduce")
        result = list(grads)
        for (i, _), o in zip(dense, outs):
            result[i] = o
        return result

    def reset_residuals(self) -> None:
        """Forget the error-feedback residuals (e.g. after loading a checkpoint, or a world change)."""
        self.reducer.reset_residuals()

    def close(self) -> None:
        """Close the per-level groups "auto" made (never ``comm``)."""
        self.reducer.close()

    def __repr__(self) -> str:
        return (f"GradientReducer(rank={self.comm.rank}, size={self.comm.size}, compression={self.compression!r}, "
                f"calls={self.calls}, collectives={self.collectives})")

    # -- private: runs inside the op, on NumPy values ------------------------------------------
    def _run(self, values) -> list:
        out, methods = self.reducer.reduce_list(values, self.op, self.bucket_bytes)
        self.calls += 1
        self.collectives += len(methods)
        return out
