"""``distributed(tx)``: an optax GradientTransformation that averages the gradients over the ranks first.

Horovod's ``DistributedOptimizer``, for optax::

    tx = ddl_triton.jax.distributed(optax.adam(1e-3), compression="int8")
    opt_state = tx.init(params)
    updates, opt_state = tx.update(grads, opt_state, params)    # grads: this rank's; averaged inside

``update`` calls ``allreduce_gradients(grads, op, compression)`` and hands the average to the
wrapped transformation, so every rank applies the same update (bitwise: every rank receives the
same bits, and runs the same optax arithmetic on them). It works eagerly and inside ``jax.jit``.
``init`` is the wrapped one's: the optimizer state is the wrapped state, unchanged, so
checkpoints stay optax's. With compression, a :class:`GradientCompression` made here keeps the
error feedback on the host (``tx.compression`` is it; gradients.py says why it is not in the
optax state).

``broadcast_params(params, root)`` is every rank's copy of rank ``root``'s parameters, bit for bit:
call it once before training so that the replicas start equal (or after restoring on one rank).
``root`` has no default, as Horovod's ``broadcast_parameters(params, root_rank)`` has none.
"""
from __future__ import annotations

import optax

from . import world
from .collectives import broadcast
from .gradients import GradientCompression, allreduce_gradients
from .host import BUCKET_BYTES
from .. import compression_methods

__all__ = ["broadcast_params", "distributed"]


def distributed(tx, *, op: str = "avg", compression="none", comm=None, bucket_bytes: int = BUCKET_BYTES,
                block: int = 256, error_feedback: bool = True):
    """``tx`` with its gradients first reduced over the ranks (module doc).

    op: "avg" (the data-parallel mean) or "sum". compression: "none", a method of
    ddl_triton/compression_methods.py, "auto", or a GradientCompression (``block`` and
    ``error_feedback`` then come from it). Returns an ``optax.GradientTransformation`` (with
    ``.compression`` set to its GradientCompression, or None)."""
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(f"ddl_triton.jax.distributed: tx must be an optax GradientTransformation, "
                        f"got {type(tx).__name__}")
    comm = world.resolve(comm)
    state = compression
    if isinstance(compression, str):
        compression_methods.check_choice(compression, f"rank {comm.rank}: ddl_triton.jax.distributed compression")
        state = None if compression == compression_methods.NONE else \
            GradientCompression(compression, comm=comm, block=block, error_feedback=error_feedback)
    elif not isinstance(compression, GradientCompression):
        raise TypeError(f"rank {comm.rank}: ddl_triton.jax.distributed: compression must be a name or a "
                        f"GradientCompression, got {type(compression).__name__}")
    reduce_with = state if state is not None else compression_methods.NONE

    def update(updates, opt_state, params=None, **extra):
        updates = allreduce_gradients(updates, op=op, compression=reduce_with, comm=comm if state is None else None,
                                      bucket_bytes=bucket_bytes)
        return tx.update(updates, opt_state, params, **extra)

    wrapped = _Distributed(tx.init, update)
    wrapped.compression = state
    return wrapped


def broadcast_params(params, root: int, *, comm=None):
    """Rank ``root``'s ``params`` (any pytree of arrays) on every rank, bit for bit (module doc)."""
    return broadcast(params, root, comm=comm)


class _Distributed(optax.GradientTransformation):
    """An optax GradientTransformation (optax sees its named tuple of init, update) that also names
    its GradientCompression as ``.compression`` (None uncompressed)."""
