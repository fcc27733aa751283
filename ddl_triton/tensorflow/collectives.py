"""Collectives on TensorFlow tensors, with Horovod's names, signatures and defaults: eager and
inside ``tf.function``.

    init()                        the world communicator, ``ddl_triton.init(**options)`` (idempotent)
    rank(), size(), local_rank(), local_size()   this rank, the world size, this rank among its host's
    is_initialized(), shutdown(), barrier()      Horovod's: whether init ran, finalize, a barrier (eager)
    allreduce(t, op=None)         op: Average (None: Horovod's default), Sum, Min, Max; a new tensor,
                                  every rank the same; Horovod's average=, compression=,
                                  prescale_factor= and postscale_factor= too (horovod_args.py)
    broadcast(t, root_rank)       root_rank's tensor on every rank
    allgather(t)                  every rank's tensor concatenated along axis 0 in rank order (the
                                  first dimension may differ across ranks, the others may not)
    broadcast_variables(vs, root_rank)   each variable assigned root_rank's value (fused: one
                                  broadcast per dtype bucket)

Horovod's arguments that ddl_triton does not honour (devices, process sets) are refused unless
they hold Horovod's default, naming the argument (horovod_args.only_defaults).

Each call is one stateful op (bridge.py): inside ``tf.function`` it runs exactly once per call of
the function, in program order with the function's other collectives, never pruned even when its
result is unused. Every rank must make the same calls in the same order, as with any collective.

Gradients: ``allreduce`` with Sum has the gradient ``allreduce(dy, op=Sum)``, with Average
``allreduce(dy, op=Average)`` (Horovod's), computed by a collective too, so every rank must take it;
"min"/"max" have none (asking raises). ``allgather``'s gradient is this rank's rows of
``allreduce(dy, "sum")``. ``broadcast`` is not differentiable (None), like an assignment.

Errors: a dtype the core does not reduce (bool, int8, complex, string, ...), an unknown op, an
"avg" of integers or a root out of range raise TypeError/ValueError naming the rank before any
communication; a mismatch across ranks (shapes, dtypes) is the core's call check
(``ddl_triton.errors.CollectiveMismatch`` eagerly; inside ``tf.function`` a ``tf.errors.OpError``
carrying its message).
"""
from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from . import bridge
from ..runtime import world
from .fusion import plan_buckets
from .horovod_args import Compression, compressor, only_defaults, reduce_op

_MAX_DIMS = 8  # allgather sends each rank's shape in a fixed-size vector
_NO_DEVICES = "ddl_triton's TensorFlow ops run on the host; TensorFlow places their inputs"
_NO_SETS = "ddl_triton has no process sets: every call runs on the world"


def init(comm=None, process_sets=None, **options):
    """The world communicator: ``ddl_triton.init(**options)`` (ddlrun/mpiexec, or the world the
    launcher's variables describe: torchrun/env://, plain srun, Open MPI's mpirun, Kubeflow, JobSet;
    ddl_triton/launch/launchers.py; no torch.distributed call needed). Idempotent. Horovod's
    ``comm`` (an MPI sub-communicator) and ``process_sets`` are refused unless None."""
    if comm is not None or process_sets is not None:
        raise ValueError("ddl_triton.tensorflow.init: Horovod's comm= and process_sets= are not supported (this "
                         "room runs on the world communicator; ddl_triton.init(sub_comm) makes others for the core)")
    return world.init(**options)


def is_initialized() -> bool:
    """Whether the world communicator exists (``init`` has run and ``shutdown`` has not), as Horovod's."""
    return world.current() is not None


def shutdown() -> None:
    """Horovod's ``shutdown``: release the world communicator (``ddl_triton.finalize()``); a later call
    of this room makes a new one. Every rank calls it, as every rank called ``init``."""
    world.finalize()


def barrier(process_set=None) -> None:
    """Horovod's ``barrier``: returns once every rank has entered it (deadline-bounded); eagerly, or
    as one stateful op in program order inside ``tf.function``. ``process_set`` refused unless None
    (Horovod's global_process_set)."""
    comm = bridge.comm()
    only_defaults(comm.rank, "barrier", process_set=(process_set, None, _NO_SETS))

    def run(value):
        comm.barrier()
        return [np.asarray(value)]

    bridge.call(run, [tf.constant(0, tf.int32)], [tf.int32], [tf.TensorShape([])], "ddl_barrier")


def rank() -> int:
    """This process's rank in the world communicator (made now if need be)."""
    return bridge.comm().rank


def size() -> int:
    """The number of ranks in the world communicator (made now if need be)."""
    return bridge.comm().size


def local_rank() -> int:
    """This process's index among the ranks of its host."""
    comm = bridge.comm()
    return comm.placement.on_node.index(comm.rank)


def local_size() -> int:
    """The number of ranks on this process's host."""
    return len(bridge.comm().placement.on_node)


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=None, ignore_name_scope=False):
    """``tensor`` reduced over every rank, as a new tensor: Horovod's signature and defaults (op None
    is Average; module doc). ``postscale(decompress(reduce(compress(prescale * tensor))))``.
    Example (2 ranks): allreduce(tf.constant([1., 2.]) * (rank() + 1)) -> [1.5, 3.0] on both;
    with op=Sum -> [3., 6.]."""
    comm = bridge.comm()
    op = reduce_op(op, average, comm.rank, "allreduce")
    only_defaults(comm.rank, "allreduce", device_dense=(device_dense, "", _NO_DEVICES),
                  device_sparse=(device_sparse, "", _NO_DEVICES), process_set=(process_set, None, _NO_SETS))
    compression = compressor(compression, comm.rank, "allreduce")
    t = tf.convert_to_tensor(tensor)
    dtype = bridge.check_dtype(t.dtype, "allreduce", comm.rank)
    if op == "avg" and not dtype.is_floating:
        raise TypeError(f"rank {comm.rank}: ddl_triton.tensorflow.allreduce: op Average (the default) needs a float "
                        f"tensor, got {dtype.name} (a mean that truncates is rarely meant; pass op=Sum)")
    if (prescale_factor != 1.0 or postscale_factor != 1.0) and not dtype.is_floating:
        raise TypeError(f"rank {comm.rank}: ddl_triton.tensorflow.allreduce: prescale_factor/postscale_factor "
                        f"need a float tensor, got {dtype.name}")
    if prescale_factor != 1.0:
        t = t * tf.cast(prescale_factor, dtype)
    wire, ctx = compression.compress(t)
    out = compression.decompress(_allreduce(wire, op, wire.dtype, comm, name or "ddl_allreduce"), ctx)
    return out * tf.cast(postscale_factor, dtype) if postscale_factor != 1.0 else out


def _allreduce(t, op, dtype, comm, name):
    return _differentiable(op, name)(t)


@functools.lru_cache(maxsize=256)  # per (op, name): a few in practice
def _differentiable(op: str, name: str):
    """The allreduce of ``op`` with its gradient, decorated once: ``tf.custom_gradient`` costs
    ~100 us of Python per decoration (signature inspection), which a per-call decoration paid."""

    @tf.custom_gradient
    def reduced(x):
        comm = bridge.comm()
        dtype = x.dtype

        def run(value):
            buf = bridge.writable(value, dtype)
            comm.allreduce(buf, op=op)
            return [buf]

        y = bridge.call(run, [x], [dtype], [x.shape], name)[0]

        def grad(dy):
            if op not in ("sum", "avg"):
                raise ValueError(f"rank {comm.rank}: ddl_triton.tensorflow.allreduce: op {op!r} has no gradient")
            return _allreduce(tf.convert_to_tensor(dy), op, dtype, comm, name + "_grad")
        return y, grad

    return reduced


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=None):
    """Rank ``root_rank``'s ``tensor`` on every rank, as a new tensor (not differentiable); Horovod's
    signature (root_rank has no default there either).
    Example (2 ranks): broadcast(tf.fill([2], rank()), 1) -> [1, 1] on both."""
    comm = bridge.comm()
    only_defaults(comm.rank, "broadcast", process_set=(process_set, None, _NO_SETS))
    root = root_rank
    t = tf.convert_to_tensor(tensor)
    dtype = bridge.check_dtype(t.dtype, "broadcast", comm.rank)
    _check_root(comm, root, "broadcast")

    def run(value):
        buf = bridge.writable(value, dtype)
        comm.broadcast(buf, root=root)
        return [buf]

    return tf.stop_gradient(bridge.call(run, [t], [dtype], [t.shape], name or "ddl_broadcast")[0])


def allgather(tensor, name=None, ignore_name_scope=False, process_set=None):
    """Every rank's ``tensor`` concatenated along axis 0, in rank order (two collectives: the
    shapes, then the data padded to the longest). Ranks whose tensors differ beyond the first
    dimension, or in rank, raise ValueError on every rank.
    Example (2 ranks): allgather(tf.fill([rank() + 1], rank())) -> [0, 1, 1] on both."""
    comm = bridge.comm()
    only_defaults(comm.rank, "allgather", process_set=(process_set, None, _NO_SETS))
    t = tf.convert_to_tensor(tensor)
    dtype = bridge.check_dtype(t.dtype, "allgather", comm.rank)
    if t.shape.rank is None or t.shape.rank == 0 or t.shape.rank > _MAX_DIMS:
        raise ValueError(f"rank {comm.rank}: ddl_triton.tensorflow.allgather: needs a tensor of known rank 1.."
                         f"{_MAX_DIMS}, got shape {t.shape}")

    def run(value):
        value = np.asarray(value)
        mine = np.full(_MAX_DIMS + 1, -1, dtype=np.int64)
        mine[0], mine[1: 1 + value.ndim] = value.ndim, value.shape
        shapes = np.empty(comm.size * (_MAX_DIMS + 1), dtype=np.int64)
        comm.all_gather(shapes, mine)
        shapes = shapes.reshape(comm.size, _MAX_DIMS + 1)
        if any((s[0], *s[2: 1 + s[0]]) != (mine[0], *mine[2: 1 + mine[0]]) for s in shapes):
            raise ValueError(f"rank {comm.rank}: ddl_triton.tensorflow.allgather: the ranks' shapes differ beyond "
                             f"the first dimension: {[tuple(s[1: 1 + s[0]]) for s in shapes]}")
        rows = shapes[:, 1].copy()
        longest, inner = int(rows.max()), value.shape[1:]
        send = bridge.empty((longest, *inner), dtype)
        send[: value.shape[0]] = value
        got = bridge.empty((comm.size * longest, *inner), dtype)
        comm.all_gather(got, send)
        got = got.reshape(comm.size, longest, *inner)
        out = np.concatenate([got[r, : rows[r]] for r in range(comm.size)]) if comm.size else got
        return [np.ascontiguousarray(out), rows]

    @tf.custom_gradient
    def gathered(x):
        y, rows = bridge.call(run, [x], [dtype, tf.int64], [tf.TensorShape([None]).concatenate(x.shape[1:]),
                                                              tf.TensorShape([comm.size])], name or "ddl_allgather")

        def grad(dy):
            summed = _allreduce(tf.convert_to_tensor(dy), "sum", dtype, comm, "ddl_allgather_grad")
            start = tf.reduce_sum(rows[: comm.rank])
            return summed[start: start + rows[comm.rank]]
        return y, grad

    return gathered(t)


def broadcast_variables(variables, root_rank, process_set=None, inplace=False) -> None:
    """Assign rank ``root_rank``'s value to each of ``variables`` (tf.Variable or Keras variables), on
    every rank: one broadcast per bucket of one dtype (fusion.plan_buckets), eager or inside
    ``tf.function``. Horovod's signature; ``inplace`` either way: the variables are assigned."""
    comm = bridge.comm()
    only_defaults(comm.rank, "broadcast_variables", process_set=(process_set, None, _NO_SETS))
    root = root_rank
    _check_root(comm, root, "broadcast_variables")
    variables = list(variables)
    values = [tf.convert_to_tensor(v) for v in variables]
    dtypes = [bridge.check_dtype(v.dtype, "broadcast_variables", comm.rank) for v in values]

    def run(*arrays):
        shapes = [np.shape(a) for a in arrays]
        out = [None] * len(arrays)
        for dtype, members, total in plan_buckets(shapes, dtypes, 64 * 1024 * 1024):
            buf = bridge.empty((total,), dtype)
            for i, start, numel in members:
                buf[start: start + numel] = np.asarray(arrays[i]).reshape(-1)
            comm.broadcast(buf, root=root)
            for i, start, numel in members:
                out[i] = buf[start: start + numel].reshape(shapes[i])
        return out

    for v, new in zip(variables, bridge.call(run, values, dtypes, [x.shape for x in values], "ddl_broadcast_vars")):
        v.assign(new)


def _check_root(comm, root, what: str) -> None:
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or not 0 <= root < comm.size:
        raise ValueError(f"rank {comm.rank}: ddl_triton.tensorflow.{what}: root_rank must be a rank in "
                         f"[0, {comm.size}), got {root!r}")
