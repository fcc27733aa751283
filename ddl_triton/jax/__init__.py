"""JAX on ddl_triton: Horovod's and mpi4jax's names for collectives, gradients and optax, over a ddl
Communicator. A borrowed name brings its anchor's defaults: ``allreduce``'s ``op`` and ``broadcast``'s
``root`` have none (mpi4jax has none; Horovod's default op, Average, is not mpi4jax's), and
``allgather`` concatenates as Horovod's does; docs/jax.md has the table of each name against both.

What lives here (one concept per file):

    world.py        ``init``, ``rank``, ``size``, ``local_rank``, ``local_size``: the communicator
                    ``ddl_triton.init()`` gives (MPI under ddlrun/mpiexec, else env://), used by
                    default by every function below (each also takes ``comm=``)
    host.py         what runs on the host inside JAX's callbacks: leaves fused into buckets, numpy
                    buffers handed to the communicator, the results split back (never seen by users)
    collectives.py  ``allreduce``, ``allgather``, ``broadcast``: eager and inside ``jax.jit``, each an
                    ordered ``io_callback`` under ``jax.custom_vjp`` (once per call, in program order),
                    differentiable where the rule is defined; mpi4jax's ``alltoall`` and ``barrier``
    point_to_point.py  mpi4jax's ``send``, ``recv``, ``sendrecv`` (under an MPI world), eager and in jit
    mpi4jax_names.py   mpi4jax's ``bcast``, ``gather``, ``reduce``, ``scatter``, ``scan`` built on the
                    collectives, with mpi4jax's signatures and results
    gradients.py    ``allreduce_gradients`` (a pytree in, a pytree out, one collective per bucket) and
                    ``GradientCompression``, the host-held error feedback of int8 / 1-bit / auto
    optimizer.py    ``distributed(tx)`` (Horovod's DistributedOptimizer, for optax) and ``broadcast_params``
    diloco.py       ``DiLoCo``: outer-sync training (DiLoCo, Streaming DiLoCo) with an optax outer
                    optimizer, on the framework-neutral core ddl_triton/outer_sync/

Example (run under ``ddlrun -n 2 -- python train.py``, ``mpiexec``, or with RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT set)::

    import jax, optax
    import ddl_triton.jax as ddj

    ddj.init()
    params = ddj.broadcast_params(params, root=0)
    tx = ddj.distributed(optax.adam(1e-3))               # gradients averaged (and optionally compressed)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

This room may import the runtime, tuning (``compression="auto"``'s rule), the core modules
(``compression_methods``, ``errors``) and ``ddl_triton.init``; never ``ddl_triton.torch`` or
``ddl_triton.tensorflow``. docs/jax.md says what each call costs and what does not work (``vmap``).
"""
from __future__ import annotations

try:
    import jax as _jax  # noqa: F401
    import optax as _optax  # noqa: F401
except ImportError as _missing:  # the extra is not installed: say which one
    raise ImportError(f"ddl_triton.jax needs JAX and optax ({_missing}); install them with "
                      "pip install 'ddl_triton[jax]'") from _missing

from .collectives import allgather, allreduce, alltoall, barrier, broadcast
from .diloco import DiLoCo
from .gradients import GradientCompression, allreduce_gradients
from .mpi4jax_names import NOT_HERE as _NOT_HERE
from .mpi4jax_names import bcast, gather, reduce, scan, scatter
from .optimizer import broadcast_params, distributed
from .point_to_point import init, recv, send, sendrecv
from .world import local_rank, local_size, rank, size

__all__ = ["DiLoCo", "GradientCompression", "allgather", "allreduce", "allreduce_gradients", "alltoall", "barrier",
           "bcast", "broadcast", "broadcast_params", "distributed", "gather", "init", "local_rank", "local_size", "rank",
           "recv", "reduce", "scan", "scatter", "send", "sendrecv", "size"]


def __getattr__(name: str):
    """mpi4jax's names this room does not implement: an AttributeError saying what to do instead."""
    if name in _NOT_HERE:
        raise AttributeError(f"ddl_triton.jax has no {name}: {_NOT_HERE[name]}")
    raise AttributeError(f"module 'ddl_triton.jax' has no attribute {name!r}")
