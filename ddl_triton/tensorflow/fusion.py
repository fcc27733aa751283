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
bucket size (on one host: never compressed). Its first call is collective, as every call is.
"""
from __future__ import annotations

import tensorflow as tf
import torch

from . import bridge, horovod_args
from .. import compression_methods
from ..runtime.arrays import torch_view
from ..runtime.compression import per_level
from ..runtime.compression.layout import chunk_bounds
from ..tuning import auto_compression

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's bucket_cap_mb default (Horovod fuses up to 128 MiB)


def plan_buckets(shapes: list, dtypes: list, bucket_bytes: int) -> list[tuple]:
    """``[(dtype, [(index, start, numel), ...], total), ...]``: tensors in order, each dtype's
    bucket closed when the next tensor would take it past ``bucket_bytes`` (a tensor larger than
    that has a bucket of its own). Pure: the same shapes give the same buckets on every rank.
    Example: float32 shapes [(3,), (2, 2), (5,)] with bucket_bytes 32 -> [(f32, [(0, 0, 3), (1, 3, 4)], 7),
             (f32, [(2, 0, 5)], 5)]"""
    order: list = []   # the buckets, in the order of their first tensor
    current: dict = {}  # dtype -> its open bucket, [dtype, members, total]
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        numel = 1
        for d in shape:
            numel *= int(d)
        bucket = current.get(dtype)
        if bucket is not None and bucket[2] and (bucket[2] + numel) * dtype.size > bucket_bytes:
            bucket = None
        if bucket is None:
            bucket = current[dtype] = [dtype, [], 0]
            order.append(bucket)
        bucket[1].append((i, bucket[2], numel))
        bucket[2] += numel
    return [tuple(b) for b in order]


class GradientReducer:
    """Averages (``op="avg"``) or sums (``op="sum"``) lists of gradients over the ranks of ``comm``
    (default: the world), fused into buckets (module doc). ``compression``: "none" (default), "auto"
    or a method of ddl_triton/compression_methods.py, or Horovod's ``Compression.none``/``.fp16``; ``error_feedback``: keep what compression
    lost and send it with the bucket's next call (default True); ``block``: the int8
    quantization block. Counters: ``calls`` (reduce calls run), ``collectives`` (buckets reduced),
    ``residual_resets``.
    Example (2 ranks): GradientReducer().reduce([tf.constant([1., 2.]) * (rank + 1)]) -> [[1.5, 3.0]]
    """

    def __init__(self, compression: str = compression_methods.NONE, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 op: str = "avg", error_feedback: bool = True, block: int = 256, comm=None):
        self.comm = comm if comm is not None else bridge.comm()
        compression = horovod_args.method(compression, self.comm.rank, "GradientReducer")  # Horovod's Compression too
        self.compression = compression_methods.check_choice(compression, f"rank {self.comm.rank}: compression")
        if op not in ("avg", "sum"):
            raise ValueError(f"rank {self.comm.rank}: GradientReducer: op must be 'avg' or 'sum', got {op!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"rank {self.comm.rank}: GradientReducer: bucket_bytes must be a positive int, "
                             f"got {bucket_bytes!r}")
        if not isinstance(block, int) or block < 4 or block > (1 << 16) or block & (block - 1):
            raise ValueError(f"rank {self.comm.rank}: GradientReducer: block must be a power of two in [4, 65536], "
                             f"got {block!r}")
        self.op, self.bucket_bytes, self.block, self.error_feedback = op, bucket_bytes, block, bool(error_feedback)
        self.calls = self.collectives = self.residual_resets = 0
        self._residuals: dict = {}
        self._plans: dict = {}
        self._levels = None
        self._speeds = None
        self._decided: dict = {}

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
        outs = bridge.call(lambda *values: self._run(values, dtypes), tensors, dtypes,
                           [g.shape for g in tensors], "ddl_fused_allreduce")
        result = list(grads)
        for (i, _), o in zip(dense, outs):
            result[i] = o
        return result

    def reset_residuals(self) -> None:
        """Forget the error-feedback residuals (e.g. after loading a checkpoint)."""
        self._residuals.clear()

    def close(self) -> None:
        """Close the per-level groups "auto" made (never ``comm``)."""
        if self._levels is not None:
            self._levels.close()
            self._levels = None

    def __repr__(self) -> str:
        return (f"GradientReducer(rank={self.comm.rank}, size={self.comm.size}, compression={self.compression!r}, "
                f"calls={self.calls}, collectives={self.collectives})")

    # -- private: runs inside the op, on NumPy values ------------------------------------------
    def _run(self, values, dtypes) -> list:
        shapes = [tuple(v.shape) for v in values]
        key = (tuple(shapes), tuple(dtypes))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 64:  # shapes that change every call (dynamic dimensions): keep few
                self._plans.clear()
            plan = self._plans[key] = plan_buckets(shapes, dtypes, self.bucket_bytes)
        out = [None] * len(values)
        for index, (dtype, members, total) in enumerate(plan):
            buf = bridge.empty((total,), dtype)
            for i, start, numel in members:  # the call's one copy: into the bucket, which becomes the result
                buf[start: start + numel] = values[i].reshape(-1)
            self._reduce_bucket(index, buf, dtype)
            for i, start, numel in members:
                out[i] = buf[start: start + numel].reshape(shapes[i])
        self.calls += 1
        self.collectives += len(plan)
        return out

    def _reduce_bucket(self, index: int, buf, dtype) -> None:
        method = self._method(buf.size, dtype)
        if method == compression_methods.NONE:
            self.comm.allreduce(buf, op=self.op)
            return
        t = torch_view(self.comm.rank, buf)  # the compressed allreduces take torch: a view of the same memory
        if self.compression == compression_methods.AUTO:
            worker = server = None
            if self.error_feedback:
                w, s = per_level.residual_sizes(self._levels, method, t.numel(), block=self.block)
                worker, server = self._residual(index, "per-level " + method, w, s)
            per_level.allreduce(self._levels, t, method=method, op=self.op, block=self.block, residual=worker,
                                server_residual=server)
            return
        row = compression_methods.get(method)
        worker = server = None
        if self.error_feedback and row.worker_residual:
            server_n = None
            if row.server_residual:  # it covers this rank's chunk (compressed.chunk_bounds)
                a, b = chunk_bounds(t.numel(), self.comm.size, row.align(self.block))[self.comm.rank]
                server_n = b - a
            worker, server = self._residual(index, method, t.numel(), server_n)
        row.run(self.comm, t, op=self.op, block=self.block, residual=worker, server_residual=server)

    def _method(self, numel: int, dtype) -> str:
        if self.compression == compression_methods.NONE or dtype not in (tf.float32, tf.float16, tf.bfloat16) \
                or self.comm.size == 1 or numel == 0:
            return compression_methods.NONE
        if self.compression != compression_methods.AUTO:
            return self.compression
        nbytes = numel * 4
        held = self._decided.get(nbytes)
        if held is None:
            if self._levels is None:  # collective: every rank's first compressed bucket, the same point
                self._levels = per_level.Levels(self.comm)
            lv = self._levels
            if lv.hosts > 1 and lv.uniform and self._speeds is None:
                self._speeds = auto_compression.probe(lv)
            link, speed = self._speeds or (None, None)
            held = self._decided[nbytes] = auto_compression.decide(
                nbytes, lv.hosts, lv.local_size, link, speed, uniform=lv.uniform, block=self.block).method
        return held

    def _residual(self, index: int, kind: str, numel: int, server_numel):
        held = self._residuals.get(index)
        if held is not None and held[0] == (kind, numel) and (server_numel is None or held[2].numel() == server_numel):
            return held[1], held[2]
        if held is not None:
            self.residual_resets += 1
        worker = torch.zeros(numel, dtype=torch.float32)
        server = None if server_numel is None else torch.zeros(server_numel, dtype=torch.float32)
        self._residuals[index] = ((kind, numel), worker, server)
        return worker, server
