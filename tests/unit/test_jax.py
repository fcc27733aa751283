"""ddl_triton.jax in one process: the bucket layout, the VJP rules, the ordering guarantee, the
refusals, and the import error without JAX. The VJP rules run over a stand-in communicator of two
ranks whose peer mirrors this one (``Mirror``: the peer passes what this rank passes), so each rule
has a value to get right; the real ranks are tests/multirank/test_jax_across_ranks.py's."""
from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import ddl_triton.jax as ddj  # noqa: E402
from ddl_triton.jax import host  # noqa: E402


class Mirror:
    """A communicator of ``size`` ranks whose every peer passes the same arrays as this rank:
    allreduce sum multiplies by ``size``, all_gather repeats, reduce_scatter sums block ``rank``."""

    def __init__(self, rank=0, size=2):
        self.rank, self.size, self.log = rank, size, []

    def allreduce(self, buf, op="sum"):
        self.log.append("allreduce")
        if op == "sum":
            buf *= self.size
        elif op == "avg":
            pass  # the mean of equal arrays
        return buf

    def all_gather(self, out, inp):
        self.log.append("all_gather")
        out[:] = np.tile(inp, self.size)
        return out

    def reduce_scatter(self, out, inp, op="sum"):
        self.log.append("reduce_scatter")
        out[:] = inp.reshape(self.size, -1)[self.rank] * self.size
        return out

    def broadcast(self, buf, root=0):
        self.log.append("broadcast")
        return buf


def test_buckets_group_by_dtype_up_to_the_cap_in_first_leaf_order():
    f32, i32 = (lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)), (lambda *s: jax.ShapeDtypeStruct(s, jnp.int32))
    assert host.buckets([f32(3), i32(2), f32(4)]) == [[0, 2], [1]]
    mib = 1 << 18  # float32 elements in 1 MiB
    assert host.buckets([f32(10 * mib), f32(20 * mib), f32(30 * mib)], 25 << 20) == [[0], [1], [2]]
    assert host.buckets([f32(10 * mib), f32(10 * mib), f32(10 * mib)], 25 << 20) == [[0, 1], [2]]
    assert host.buckets([f32(0), f32(1)], 4) == [[0, 1]]  # an empty leaf rides along
    assert host.buckets([f32(3), i32(2)], by_dtype=False) == [[0, 1]]
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
        host.buckets([f32(1)], 0)


def test_world_of_one_every_call_is_the_identity_and_exact():
    ddj.init()
    x = jnp.arange(7, dtype=jnp.float32)
    for op in ("sum", "avg", "min", "max"):
        np.testing.assert_array_equal(ddj.allreduce(x, op), x)
    np.testing.assert_array_equal(ddj.allgather(x), x)
    tree = {"a": x, "flag": jnp.array([True, False]), "k": jax.random.PRNGKey(3)}
    got = jax.jit(lambda t: ddj.broadcast(t, 0))(tree)
    assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in
               zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(tree)))
    grads = {"w": jnp.ones((3, 4)), "b": jnp.arange(4, dtype=jnp.bfloat16), "empty": jnp.zeros((0,))}
    from ddl_triton import compression_methods
    for compression in compression_methods.choices():
        out = ddj.allreduce_gradients(grads, compression=compression)
        assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(grads)
        for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(grads)):
            assert a.dtype == b.dtype and a.shape == b.shape
    assert (ddj.rank(), ddj.size(), ddj.local_rank(), ddj.local_size()) == (0, 1, 0, 1)


def test_vjp_rules_over_two_mirrored_ranks():
    comm = Mirror()
    x, c = jnp.arange(4.0), jnp.array([1.0, 2.0, 3.0, 4.0])
    # allreduce sum: y = 2x, the cotangent's allreduce-sum is 2c; avg: y = x, the cotangent's avg is c
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(c * ddj.allreduce(x, "sum", comm=comm)))(x), 2 * c)
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(c * ddj.allreduce(x, "avg", comm=comm)))(x), c)
    # allgather: y = [x, x]; rank 0's gradient is block 0 of the cotangents' sum: 2 * c2[:4]
    c2 = jnp.arange(8.0)
    np.testing.assert_array_equal(jax.jit(jax.grad(lambda x: jnp.sum(c2 * ddj.allgather(x, comm=comm))))(x),
                                  2 * c2[:4])
    # broadcast: the root gets the cotangents' sum, the others zeros
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(c * ddj.broadcast(x, 0, comm=comm)))(x), 2 * c)
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(c * ddj.broadcast(x, 0, comm=Mirror(rank=1))))(x),
                                  jnp.zeros(4))
    # an integer leaf beside a float one: its float0 cotangent passes through, no collective for it
    tree = {"w": x, "n": jnp.arange(3)}
    g = jax.grad(lambda t: jnp.sum(ddj.allreduce_gradients(t, "sum", comm=comm)["w"]), allow_int=True)(tree)
    np.testing.assert_array_equal(g["w"], jnp.full(4, 2.0))
    with pytest.raises(NotImplementedError, match="rank 0: ddl_triton.jax.allreduce: no gradient is defined for op 'max'"):
        jax.grad(lambda x: jnp.sum(ddj.allreduce(x, "max", comm=comm)))(x)
    with pytest.raises(TypeError, match="custom_vjp"):  # forward mode: JAX's own refusal, documented
        jax.jvp(lambda x: ddj.allreduce(x, "sum", comm=comm), (x,), (x,))


def test_a_jitted_function_called_n_times_makes_n_collectives_in_order_even_unused():
    comm = Mirror()
    f = jax.jit(lambda x: (ddj.allreduce(x, "sum", comm=comm), ddj.allgather(x, comm=comm)))
    g = jax.jit(lambda x: (ddj.allreduce(x, "sum", comm=comm), x + 1)[1])  # the collective's result is dropped
    const = jnp.arange(3.0)  # closed over: a value inside the trace, not a tracer
    h = jax.jit(lambda: ddj.allreduce(const, "sum", comm=comm))
    for i in range(4):
        f(jnp.full(3, float(i)))
        g(jnp.full(3, float(i)))
        np.testing.assert_array_equal(h(), 2 * const)
    jax.effects_barrier()
    assert comm.log == ["allreduce", "all_gather", "allreduce", "allreduce"] * 4
    comm.log.clear()  # control flow: every scan iteration makes its collective; grad adds the backward ones
    scan = jax.jit(jax.grad(lambda xs: jax.lax.scan(lambda c, x: (c + ddj.allreduce(x, "sum", comm=comm), None),
                                                    jnp.zeros(2), xs)[0].sum()))
    np.testing.assert_array_equal(scan(jnp.ones((3, 2))), jnp.full((3, 2), 2.0))
    jax.effects_barrier()
    assert comm.log == ["allreduce"] * 6


def test_bad_input_is_refused_at_trace_time_naming_the_rank():
    comm = Mirror()
    x = jnp.ones(3)
    with pytest.raises(TypeError, match="rank 0: ddl_triton.jax.allreduce: dtype int8 is not reduced"):
        ddj.allreduce(jnp.ones(3, jnp.int8), "sum", comm=comm)
    with pytest.raises(TypeError, match="op 'avg' of int32 would truncate"):
        ddj.allreduce(jnp.ones(3, jnp.int32), "avg", comm=comm)
    with pytest.raises(ValueError, match="op must be one of sum, avg, min, max, got 'prod'"):
        ddj.allreduce(x, "prod", comm=comm)
    with pytest.raises(ValueError, match=r"root must be a rank in \[0, 2\), got 2"):
        ddj.broadcast(x, 2, comm=comm)
    with pytest.raises(ValueError, match="rank 0: ddl_triton.jax compression"):
        ddj.allreduce_gradients({"w": x}, compression="zip", comm=comm)
    with pytest.raises(ValueError, match="averages or sums"):
        ddj.allreduce_gradients({"w": x}, "max", compression="auto", comm=comm)
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
        ddj.allreduce_gradients({"w": x}, comm=comm, bucket_bytes=0)
    with pytest.raises(ValueError, match="method 'none' keeps no state"):
        ddj.GradientCompression("none", comm=comm)
    with pytest.raises(TypeError, match="comm must be a ddl_triton.Communicator"):
        ddj.allreduce(x, "sum", comm=object())
    with pytest.raises(TypeError, match="tx must be an optax GradientTransformation"):
        ddj.distributed(lambda g: g, comm=comm)
    with pytest.raises(NotImplementedError, match="a compressed allreduce .* has no gradient"):
        jax.grad(lambda x: ddj.allreduce_gradients(x, compression=ddj.GradientCompression(comm=comm)).sum())(x)
    with pytest.raises(ValueError, match="Cannot `vmap` ordered IO callback"):  # JAX's own, documented
        jax.vmap(lambda v: ddj.allreduce(v, "sum", comm=comm))(jnp.ones((2, 3)))


# The anchors' signatures (mpi4jax's collectives without their token=; Horovod's torch and TF ones): a name
# borrowed brings its parameters' names, order and defaults. docs/jax.md has the table.
_REQUIRED = object()
ANCHORS = {
    "allreduce": [("x", _REQUIRED), ("op", _REQUIRED), ("comm", None)],          # mpi4jax.allreduce(x, op, *, comm)
    "allgather": [("x", _REQUIRED), ("comm", None)],                             # mpi4jax.allgather(x, *, comm)
    "broadcast": [("tree", _REQUIRED), ("root", _REQUIRED), ("comm", None)],     # Horovod root_rank / mpi4jax root
    "broadcast_params": [("params", _REQUIRED), ("root", _REQUIRED), ("comm", None)],  # Horovod broadcast_parameters
    "allreduce_gradients": [("grads", _REQUIRED), ("op", "avg")],                # Horovod's gradients: Average
    "distributed": [("tx", _REQUIRED), ("op", "avg")],                           # Horovod's DistributedOptimizer
}


def test_borrowed_names_bring_their_anchors_signatures_and_defaults():
    import inspect
    for name, params in ANCHORS.items():
        ours = list(inspect.signature(getattr(ddj, name)).parameters.values())
        got = [(q.name, _REQUIRED if q.default is inspect.Parameter.empty else q.default) for q in ours]
        assert [g for g in got if g[0] in dict(params)] == params, (name, got)
    comm = Mirror()
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'op'"):
        ddj.allreduce(jnp.ones(3), comm=comm)  # no default: Horovod's (Average) is not mpi4jax's (none)
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'root'"):
        ddj.broadcast(jnp.ones(3), comm=comm)


def test_mpi4jaxs_op_spelling_means_the_same_and_other_mpi_ops_are_refused_by_name():
    MPI = pytest.importorskip("mpi4py.MPI")
    comm = Mirror()
    x = jnp.arange(3.0)
    for op, same in ((MPI.SUM, "sum"), (MPI.MIN, "min"), (MPI.MAX, "max")):
        np.testing.assert_array_equal(ddj.allreduce(x, op, comm=comm), ddj.allreduce(x, same, comm=comm))
        np.testing.assert_array_equal(jax.jit(lambda v, op=op: ddj.allreduce(v, op=op, comm=comm))(x),
                                      ddj.allreduce(x, same, comm=comm))
    with pytest.raises(ValueError, match=r"rank 0: ddl_triton.jax.allreduce: MPI.PROD is not a reduction ddl_triton "
                                         r"implements"):
        ddj.allreduce(x, MPI.PROD, comm=comm)
    with pytest.raises(ValueError, match="MPI.LAND is not a reduction"):
        ddj.allreduce_gradients({"w": x}, MPI.LAND, comm=comm)


class Disagreeing(Mirror):
    """A communicator whose peer called something else: the call check's CollectiveMismatch."""

    def allreduce(self, buf, op="sum"):
        from ddl_triton.errors import calls_disagree
        raise calls_disagree(self.rank, 3, {0: "allreduce(sum, 3 x float32)", 1: "allreduce(sum, 4 x float32)"},
                             self.size)


def test_a_mismatch_inside_jit_is_said_first_before_jaxs_own_report(capsys):
    """JAX reports a callback's error as its own runtime error, the cause the last of ~15 lines (and
    logs that trace before it): the mismatch line must come first on stderr."""
    import logging

    handler = logging.StreamHandler(sys.stderr)  # JAX's log of the failed callback, where a user sees it
    logging.getLogger("jax").addHandler(handler)
    try:
        with pytest.raises(Exception, match="ranks disagree on collective #3") as raised:
            jax.block_until_ready(jax.jit(lambda x: ddj.allreduce(x, "sum", comm=Disagreeing()))(jnp.ones(3)))
    finally:
        logging.getLogger("jax").removeHandler(handler)
    err = capsys.readouterr().err
    first = err.splitlines()[0] if err else ""
    assert first.startswith("ddl_triton.errors.CollectiveMismatch: rank 0: ranks disagree on collective #3: "
                            "rank 0: allreduce(sum, 3 x float32); rank 1: allreduce(sum, 4 x float32)"), err
    assert "inside jax.jit" in first and "CollectiveMismatch" in str(raised.value)  # JAX's report still carries it
    assert "jax.io_callback failed" in err  # JAX's logged trace came, after it


def test_distributed_averages_before_the_wrapped_transformation_in_jit():
    comm = Mirror()
    tx = ddj.distributed(optax.sgd(0.5), op="sum", comm=comm)
    assert isinstance(tx, optax.GradientTransformation) and tx.compression is None
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)({"w": jnp.full(3, 2.0)}, state, params)
    np.testing.assert_array_equal(updates["w"], jnp.full(3, -2.0))  # -0.5 * (2 + 2): the mirrored peer's too
    int8 = ddj.distributed(optax.sgd(0.5), compression="auto", comm=ddj.init())
    assert isinstance(int8.compression, ddj.GradientCompression)


def test_importing_without_jax_names_the_extra(monkeypatch):
    saved = {k: v for k, v in sys.modules.items() if k == "ddl_triton.jax" or k.startswith("ddl_triton.jax.")}
    for k in saved:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "jax", None)  # "import jax" now raises ImportError
    try:
        with pytest.raises(ImportError, match=r"pip install 'ddl_triton\[jax\]'"):
            importlib.import_module("ddl_triton.jax")
    finally:
        for k in [k for k in sys.modules if k == "ddl_triton.jax" or k.startswith("ddl_triton.jax.")]:
            del sys.modules[k]
        sys.modules.update(saved)
