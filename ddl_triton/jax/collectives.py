"""``allreduce``, ``allgather``, ``broadcast``, ``alltoall``, ``barrier`` for JAX arrays: eager, inside
``jax.jit``, under ``jax.grad`` (the first three).

Inside ``jax.jit`` or under a transformation (``jax.grad``), each call is one ordered
``jax.experimental.io_callback`` (host.py runs the collective on the host) under a
``jax.custom_vjp``; called eagerly on values, it runs at once on the calling thread, after every
collective already dispatched (``concrete``), with no callback to dispatch. Ordered effects are what make a collective safe inside a
compiled program: XLA may neither drop it (its result unused), nor repeat it, nor move it past
another ordered effect, so a jitted function called N times runs its collectives exactly N times,
in program order, on every rank, as the other ranks' matching calls need. (``pure_callback``
promises none of that: a skipped or reordered collective deadlocks the peers until the deadline.)

Semantics (n ranks, x_r rank r's array; the same shape and dtype on every rank, else the call
check raises on every rank, naming it; eager allgather excepted):

    allreduce(x, op)      every rank: sum_r x_r (op "sum"), its mean ("avg": the sum times fp32(1/n),
                          floats only), elementwise min or max; bitwise identical on every rank.
                          ``op`` has no default, as in mpi4jax (whose spelling, mpi4py's MPI.SUM, MPI.MIN,
                          MPI.MAX, it takes too): Horovod averages by default, mpi4jax has none, and a
                          default of either would silently give the other's users wrong numbers
    allgather(x)          concat(x_0, ..., x_{n-1}) along axis 0, Horovod's (mpi4jax's allgather stacks
                          on a new axis: pass x[None] for that); a 0-d x: the vector of the n values;
                          eagerly the first dimensions may differ
    broadcast(tree, root) the pytree as rank ``root`` holds it, every leaf bit for bit (any dtype);
                          ``root`` has no default, as in Horovod (root_rank) and mpi4jax (bcast's root)
    alltoall(x)           mpi4jax's: ``x.shape[0]`` must be n; rank r gets y with y[q] = x_q[r], bit
                          for bit (any dtype); not differentiable
    barrier()             mpi4jax's: returns (None) once every rank has entered it

docs/jax.md has the table of each name against Horovod's and mpi4jax's.

Gradients (the data-parallel convention, Horovod's: the loss is the sum of the ranks' losses):

    allreduce "sum"       the cotangent's allreduce-sum;  "avg": its allreduce-avg
    allreduce min/max     not defined: NotImplementedError when differentiated (the argmin's rank
                          would have to be agreed on; reduce the value, not its gradient)
    allgather             the cotangent's reduce_scatter-sum: rank r gets the sum of block r
    broadcast             the cotangent's allreduce-sum on the root, zeros elsewhere

Forward-mode (``jax.jvp``, ``jax.jacfwd``) is JAX's custom_vjp rule: refused by JAX. ``jax.vmap``
is refused by JAX ("Cannot `vmap` ordered IO callback"): a batched collective would need every
rank to batch alike; loop instead, or stack the batch into one array. docs/jax.md has the costs.
"""
from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from . import host, world
from ..errors import say_first

__all__ = ["allgather", "allreduce", "alltoall", "barrier", "broadcast"]

try:  # JAX's own test of "no trace active"; private, so a JAX without it takes the callback path always
    from jax._src.core import trace_state_clean as _no_trace
except ImportError:  # pragma: no cover - other JAX releases
    def _no_trace() -> bool:
        return False

OPS = ("sum", "avg", "min", "max")
_LINEAR = ("sum", "avg")


def allreduce(x, op, *, comm=None, token=world.NO_TOKEN):
    """The reduction of ``x`` over the ranks with ``op`` (required: "sum", "avg", "min", "max", or
    mpi4py's MPI.SUM, MPI.MIN, MPI.MAX; module doc); a new JAX array on every rank.
    ``x``: a JAX or NumPy array (or scalar) of float32, float16, bfloat16, float64, int32 or int64.
    Example (2 ranks): rank r passes jnp.full(3, r + 1.0) -> op "sum": both [3., 3., 3.]; "avg": [1.5, 1.5, 1.5]."""
    world.no_token(token, "allreduce")
    comm = world.resolve(comm)
    x = jnp.asarray(x)
    op = op_name(comm, "allreduce", op)
    check_reduced(comm, "allreduce", [x], op)
    if concrete([x]):
        return jnp.asarray(host.allreduce(comm, op, [np.asarray(x)])[0])
    return _allreduce_fn(comm, op, host.BUCKET_BYTES)((x,))[0]


def allgather(x, *, comm=None, token=world.NO_TOKEN):
    """The ranks' ``x`` concatenated along axis 0 in rank order (module doc); any dtype. Eagerly
    the first dimensions may differ across ranks (Horovod's rule; one more collective per call
    to learn them); inside jit every rank's shape must be the same.
    Example (2 ranks): rank r passes jnp.array([r, r]) -> both [0, 0, 1, 1]."""
    world.no_token(token, "allgather")
    comm = world.resolve(comm)
    x = jnp.asarray(x)
    if concrete([x]):
        return jnp.asarray(host.allgather(comm, np.asarray(x), varying=True))
    return _allgather_fn(comm)(x)


def broadcast(tree, root: int, *, comm=None):
    """The pytree ``tree`` as rank ``root`` holds it, on every rank (module doc); leaves fused into
    buckets of bytes (host.py), so a model's parameters take a few collectives, not one per leaf.
    Example: broadcast({"w": w, "step": jnp.int32(k)}, root=0) -> rank 0's w and k everywhere."""
    comm = world.resolve(comm)
    root = check_root(comm, root)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    leaves = tuple(jnp.asarray(v) for v in leaves)
    if concrete(leaves):
        out = [jnp.asarray(v) for v in host.broadcast(comm, root, [np.asarray(v) for v in leaves])]
    else:
        out = _broadcast_fn(comm, root, host.BUCKET_BYTES)(leaves)
    return jax.tree_util.tree_unflatten(treedef, list(out))


def alltoall(x, *, comm=None, token=world.NO_TOKEN):
    """mpi4jax's ``alltoall``: ``x`` of shape (size, ...) on every rank; block q goes to rank q, and
    block q of the new array came from rank q (module doc). ValueError naming the rank when
    ``x.shape[0]`` is not the number of ranks. Example (2 ranks): rank r passes [[10r], [10r + 1]]
    -> rank 0 gets [[0], [10]], rank 1 gets [[1], [11]]."""
    world.no_token(token, "alltoall")
    comm = world.resolve(comm)
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[0] != comm.size:
        raise ValueError(f"rank {comm.rank}: ddl_triton.jax.alltoall: input must have shape (nproc, ...) with "
                         f"nproc = {comm.size}, got {tuple(x.shape)}")
    if concrete([x]):
        return jnp.asarray(_alltoall_on_host(comm, np.asarray(x)))
    return ordered(lambda v: _alltoall_on_host(comm, np.asarray(v)), (x,), like([x]))[0]


def barrier(*, comm=None, token=world.NO_TOKEN):
    """mpi4jax's ``barrier``: returns (None) once every rank of ``comm`` has entered it; inside
    ``jax.jit`` an ordered effect like the collectives. Deadline-bounded (Options.timeout)."""
    world.no_token(token, "barrier")
    comm = world.resolve(comm)
    if _no_trace():
        jax.effects_barrier()
        comm.barrier()
        return None
    ordered(lambda: (comm.barrier(), [])[1], (), [])
    return None


def _alltoall_on_host(comm, x: np.ndarray) -> np.ndarray:
    """The exchange as bytes (any dtype), in 4-byte words: block q of ``x`` to rank q."""
    x = np.ascontiguousarray(x)
    n, block = comm.size, x.nbytes // comm.size
    words = -(-block // 4)
    send = np.zeros((n, 4 * words), dtype=np.uint8)
    send[:, :block] = x.reshape(n, -1).view(np.uint8).reshape(n, block)
    got = np.empty(n * words, dtype=np.int32)
    comm.all_to_all(got, send.view(np.int32).reshape(-1))
    out = np.ascontiguousarray(got.view(np.uint8).reshape(n, 4 * words)[:, :block])
    return out.view(x.dtype).reshape(x.shape)


# -- shared with gradients.py ----------------------------------------------------------------
_MPI_OPS = ("SUM", "MIN", "MAX", "PROD", "LAND", "BAND", "LOR", "BOR", "LXOR", "BXOR", "MAXLOC", "MINLOC",
            "REPLACE", "NO_OP")


def op_name(comm, what: str, op) -> str:
    """``op`` as the core names it: "sum", "avg", "min", "max" pass; mpi4py's MPI.SUM, MPI.MIN and
    MPI.MAX (mpi4jax's spelling) become "sum", "min", "max"; any other MPI op is refused by name."""
    if type(op).__module__ != "mpi4py.MPI":
        return op
    mpi = sys.modules["mpi4py.MPI"]
    name = next((n for n in _MPI_OPS if getattr(mpi, n, None) is not None and op == getattr(mpi, n)), repr(op))
    if name not in ("SUM", "MIN", "MAX"):
        raise ValueError(f"rank {comm.rank}: ddl_triton.jax.{what}: MPI.{name} is not a reduction ddl_triton "
                         "implements; use MPI.SUM, MPI.MIN, MPI.MAX or 'sum', 'avg', 'min', 'max'")
    return name.lower()


def check_reduced(comm, what: str, leaves, op: str) -> None:
    """Refuse, at trace time (so on every rank alike, before anything is sent), an op the core
    does not know, a dtype it does not reduce, or "avg" of integers (a truncating mean)."""
    if op not in OPS:
        raise ValueError(f"rank {comm.rank}: ddl_triton.jax.{what}: op must be one of {', '.join(OPS)}, got {op!r}")
    for leaf in leaves:
        name = np.dtype(leaf.dtype).name
        if name not in host.REDUCED_DTYPES:
            raise TypeError(f"rank {comm.rank}: ddl_triton.jax.{what}: dtype {name} is not reduced by ddl_triton "
                            f"(it reduces {', '.join(host.REDUCED_DTYPES)}); cast it first")
        if op == "avg" and not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(f"rank {comm.rank}: ddl_triton.jax.{what}: op 'avg' of {name} would truncate; "
                            "use op='sum' and divide, or cast to a float first")


def check_root(comm, root) -> int:
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or not 0 <= root < comm.size:
        raise ValueError(f"rank {comm.rank}: ddl_triton.jax.broadcast: root must be a rank in [0, {comm.size}), "
                         f"got {root!r}")
    return int(root)


def concrete(leaves) -> bool:
    """Whether the call is eager: no trace is active (not inside jit, grad, ...; an array closed
    over by a jitted function is a value, not a tracer, yet the collective must still run at every
    call of the program, so the trace state decides) and every leaf is a value. The call then runs
    at once on the calling thread, after the ordered effects already dispatched
    (``jax.effects_barrier``: the collectives of earlier jitted calls come first)."""
    if not _no_trace() or any(isinstance(v, jax.core.Tracer) for v in leaves):
        return False
    jax.effects_barrier()
    return True


def ordered(fn, args, shapes):
    """``fn(*args)`` on the host as an ordered effect: once per execution, in program order. An error
    of ``fn`` reaches the user as JAX's own runtime error, after JAX has logged its trace, the cause its
    last line: so its one-line cause is said on stderr first (errors.say_first)."""
    def said_first(*values):
        try:
            return fn(*values)
        except Exception as e:
            say_first(e, "inside jax.jit: JAX's report of it follows")
            raise
    return tuple(io_callback(said_first, list(shapes), *args, ordered=True))


def like(xs):
    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]


def reduced_cotangents(run, gs):
    """``run`` (an ordered collective over a tuple) applied to the cotangents that carry values;
    float0 cotangents (of integer leaves) pass through untouched."""
    real = [i for i, g in enumerate(gs) if g.dtype != jax.dtypes.float0]
    out = list(gs)
    if real:
        for i, r in zip(real, run(tuple(gs[i] for i in real))):
            out[i] = r
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _allreduce_fn(comm, op: str, bucket_bytes: int):
    """The custom_vjp allreduce of a tuple of arrays over ``comm`` (one function per comm, op and
    bucket size, so jit's cache sees the same function every call)."""
    def on_host(*xs):
        return host.allreduce(comm, op, xs, bucket_bytes)

    def run(xs):
        return ordered(on_host, xs, like(xs))

    f = jax.custom_vjp(run)

    def fwd(xs):
        if op not in _LINEAR:
            raise NotImplementedError(f"rank {comm.rank}: ddl_triton.jax.allreduce: no gradient is defined for "
                                      f"op {op!r} (only 'sum' and 'avg'); reduce the value under "
                                      "jax.lax.stop_gradient")
        return f(xs), None

    def bwd(_, gs):
        return (reduced_cotangents(run, gs),)

    f.defvjp(fwd, bwd)
    return f


@functools.lru_cache(maxsize=256)
def _allgather_fn(comm):
    def gather(x):
        shape = (comm.size * x.shape[0], *x.shape[1:]) if x.ndim else (comm.size,)
        return ordered(lambda v: host.allgather(comm, v), (x,), [jax.ShapeDtypeStruct(shape, x.dtype)])[0]

    f = jax.custom_vjp(gather)

    def fwd(x):
        return f(x), (x.shape,)

    def bwd(res, g):
        (shape,) = res
        if g.dtype == jax.dtypes.float0:
            return (np.zeros(shape, dtype=jax.dtypes.float0),)
        out = ordered(lambda v: host.reduce_scatter(comm, v, shape), (g,), [jax.ShapeDtypeStruct(shape, g.dtype)])
        return (out[0],)

    f.defvjp(fwd, bwd)
    return f


@functools.lru_cache(maxsize=256)
def _broadcast_fn(comm, root: int, bucket_bytes: int):
    def on_host(*xs):
        return host.broadcast(comm, root, xs, bucket_bytes)

    def run(xs):
        return ordered(on_host, xs, like(xs))

    f = jax.custom_vjp(run)

    def fwd(xs):
        return f(xs), None

    def to_root(*gs):  # the cotangents' sum lands on the root; the others' inputs did not count
        summed = host.allreduce(comm, "sum", gs, bucket_bytes)
        return summed if comm.rank == root else [np.zeros_like(s) for s in summed]

    def bwd(_, gs):
        check_reduced(comm, "broadcast (its gradient)", [g for g in gs if g.dtype != jax.dtypes.float0], "sum")
        return (reduced_cotangents(lambda ts: ordered(to_root, ts, like(ts)), gs),)

    f.defvjp(fwd, bwd)
    return f
