"""``allreduce_gradients``: a pytree of gradients averaged over the ranks, fused into buckets, optionally compressed.

    grads = allreduce_gradients(grads)                                  # fp32 average, lossless
    grads = allreduce_gradients(grads, compression="int8")              # int8 on the wire, error feedback
    gc = GradientCompression("onebit"); grads = allreduce_gradients(grads, compression=gc)

The leaves are fused into buckets (host.py: per dtype, up to ``bucket_bytes``, 25 MiB as DDP's)
and each bucket is one collective, run by one ordered ``io_callback`` for the whole pytree: once
per call, in program order, eager or inside ``jax.jit``. Uncompressed, the result is bitwise what
``allreduce`` of each leaf gives, and differentiable like it (the cotangents are averaged).

Compression is a choice of ddl_triton/compression_methods.py (``compression_methods.choices()``):

    "none"            full precision (the default)
    a method's name   that method's allreduce over the whole communicator for every float32 /
                      float16 / bfloat16 bucket (int8: block quantization; onebit: sign + scale;
                      fp16 / bf16: 16-bit on the wire), as the DDP hooks run it (docs/compression.md);
                      other dtypes (float64, integers) stay in full precision
    "auto"            per bucket, what ddl_triton/tuning/auto_compression.py decides for its size
                      (fp32-equivalent bytes: elements x 4, whatever the dtype; the communicator's
                      tuning table's compression section where it has one, else the probed link):
                      full precision inside a host (shm), a method between hosts only where it pays,
                      per level (runtime/compression/per_level.py); on one host, always "none"

The choice, the buckets and the residuals are the framework-neutral floor's (ddl_triton/gradients/:
``Reducer``, ``buckets.plan``, ``Residuals``); what is JAX's own here is the pytree, the ordered
callback and the custom VJP.

Error feedback is state, and this module keeps it explicitly, on the host: a
:class:`GradientCompression` holds, per bucket, what compression lost (fp32, the bucket's size; for
1-bit also the server's chunk) and adds it to that bucket's next gradient. The callback updates it
in place, once per executed call, so it works unchanged inside ``jax.jit`` (a jitted step's
optimizer state need not carry it). Hold one per gradient pytree (a model): buckets are keyed by
their index and checked by size, and one whose size changed restarts from zero (``residual_resets``).
A string names the communicator's shared default state for that method (``GradientCompression.
shared``); ``distributed(tx, compression=...)`` makes its own. Compressed calls are not
differentiable (NotImplementedError under ``jax.grad``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import host, world
from .collectives import _allreduce_fn, check_reduced, concrete, like, op_name, ordered
from .. import compression_methods
from ..gradients.reducer import Reducer

__all__ = ["GradientCompression", "allreduce_gradients"]


def allreduce_gradients(grads, op: str = "avg", compression="none", *, comm=None,
                        bucket_bytes: int = host.BUCKET_BYTES):
    """The ranks' ``grads`` (a pytree of arrays, alike on every rank) reduced with ``op`` ("avg" or
    "sum"; "min"/"max" uncompressed only), as a pytree of the same structure (module doc).
    ``compression``: "none", a method's name, "auto", or a :class:`GradientCompression`.
    Example (2 ranks): {"w": jnp.full(3, r)} on rank r -> {"w": [0.5, 0.5, 0.5]} on both."""
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    if not leaves:
        return grads
    state = compression if isinstance(compression, GradientCompression) else None
    comm = state.comm if state is not None else world.resolve(comm)
    leaves = tuple(jnp.asarray(v) for v in leaves)
    op = op_name(comm, "allreduce_gradients", op)
    check_reduced(comm, "allreduce_gradients", leaves, op)
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"rank {comm.rank}: ddl_triton.jax.allreduce_gradients: bucket_bytes must be a positive "
                         f"int, got {bucket_bytes!r}")
    if state is None:
        if not isinstance(compression, str):
            raise TypeError(f"rank {comm.rank}: ddl_triton.jax.allreduce_gradients: compression must be a name "
                            f"({', '.join(compression_methods.choices())}) or a GradientCompression, "
                            f"got {type(compression).__name__}")
        compression_methods.check_choice(compression, f"rank {comm.rank}: ddl_triton.jax compression")
        if compression == compression_methods.NONE:
            out = [jnp.asarray(v) for v in host.allreduce(comm, op, [np.asarray(v) for v in leaves], bucket_bytes)] \
                if concrete(leaves) else _allreduce_fn(comm, op, bucket_bytes)(leaves)
            return jax.tree_util.tree_unflatten(treedef, list(out))
        state = GradientCompression.shared(comm, compression)
    if op not in ("avg", "sum"):
        raise ValueError(f"rank {comm.rank}: ddl_triton.jax.allreduce_gradients: compression "
                         f"{state.method!r} averages or sums (op 'avg' or 'sum'), got op {op!r}")
    out = [jnp.asarray(v) for v in state._reduce(op, [np.asarray(v) for v in leaves], bucket_bytes)] \
        if concrete(leaves) else _compressed_fn(state, op, bucket_bytes)(leaves)
    return jax.tree_util.tree_unflatten(treedef, list(out))


class GradientCompression:
    """Error feedback and choices of compressed ``allreduce_gradients`` calls (module doc): JAX's
    adapter of the framework-neutral ``ddl_triton.gradients.Reducer`` (named methods over the
    whole communicator).

    method: a method of ddl_triton/compression_methods.py, or "auto" ("none": nothing to keep).
    block: the int8 quantization block (a power of two in [4, 65536]). error_feedback: keep
    what compression lost and send it with the bucket's next gradient. ``calls``: buckets
    compressed so far; ``decisions``: the choice per bucket size ({nbytes: Decision}, nbytes
    fp32-equivalent: the element count times 4, whatever the dtype).
    Building the per-level groups and probing the link ("auto") is collective: it happens inside
    the first call, at the same point on every rank."""

    def __init__(self, method: str = compression_methods.DEFAULT, *, comm=None, block: int = 256,
                 error_feedback: bool = True):
        self.comm = world.resolve(comm)
        compression_methods.check_choice(method, f"rank {self.comm.rank}: GradientCompression method")
        if method == compression_methods.NONE:
            raise ValueError(f"rank {self.comm.rank}: GradientCompression: method 'none' keeps no state; "
                             "call allreduce_gradients(grads) without compression")
        self.reducer = Reducer(self.comm, method, named="world", block=block, error_feedback=error_feedback,
                               who="GradientCompression")
        self.method, self.block, self.error_feedback = method, block, self.reducer.error_feedback
        self.calls = 0
        self.decisions = self.reducer.decisions
        self._fns: dict = {}

    @property
    def residual_resets(self) -> int:
        """Buckets whose residual restarted from zero because their size or method changed."""
        return self.reducer.residuals.resets

    @staticmethod
    def shared(comm, method: str) -> "GradientCompression":
        """The communicator's default state for ``method`` (what a string ``compression=`` uses)."""
        return _shared(comm, method)

    def reset(self) -> None:
        """Forget every residual (e.g. after restoring a checkpoint, or a world change)."""
        self.reducer.reset_residuals()

    def close(self) -> None:
        """Close the per-level groups "auto" made (never ``comm``)."""
        self.reducer.close()

    def __repr__(self) -> str:
        return (f"GradientCompression({self.method!r}, rank={self.comm.rank}, size={self.comm.size}, "
                f"calls={self.calls}, residual_resets={self.residual_resets})")

    # -- on the host, inside the callback ---------------------------------------------------------
    def _reduce(self, op: str, arrays, bucket_bytes: int):
        out, methods = self.reducer.reduce_list(arrays, op, bucket_bytes)
        self.calls += sum(m != compression_methods.NONE for m in methods)
        return out


@functools.lru_cache(maxsize=64)
def _shared(comm, method: str) -> GradientCompression:
    return GradientCompression(method, comm=comm)


def _compressed_fn(state: GradientCompression, op: str, bucket_bytes: int):
    """The compressed allreduce of a tuple of leaves with ``state`` (one ordered callback per call),
    kept on the state (so jit's cache sees the same function, and it goes when the state goes)."""
    held = state._fns.get((op, bucket_bytes))
    if held is None:
        held = state._fns[(op, bucket_bytes)] = _make_compressed_fn(state, op, bucket_bytes)
    return held


def _make_compressed_fn(state: GradientCompression, op: str, bucket_bytes: int):
    def run(xs):
        return ordered(lambda *arrays: state._reduce(op, arrays, bucket_bytes), xs, like(xs))

    f = jax.custom_vjp(run)

    def fwd(xs):
        raise NotImplementedError(f"rank {state.comm.rank}: ddl_triton.jax.allreduce_gradients: a compressed "
                                  f"allreduce ({state.method!r}) has no gradient; differentiate before averaging, "
                                  "or use compression='none'")

    f.defvjp(fwd, lambda res, gs: gs)
    return f
