"""mpi4jax's names in ddl_triton.jax, in one process (a world of one): their signatures and defaults
are mpi4jax's (>= 0.8, token-free), its spellings (MPI ops, comm=MPI.COMM_WORLD) map to the same
calls, and what ddl_triton does not do is refused by name, naming the rank and the alternative. The
values across real ranks are tests/multirank/test_jax_across_ranks.py's (jax_worker.py)."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
MPI = pytest.importorskip("mpi4py.MPI")
import jax.numpy as jnp  # noqa: E402

import ddl_triton.jax as ddj  # noqa: E402

_REQUIRED = inspect.Parameter.empty
_P, _K = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
# mpi4jax 0.8's signatures (mpi4jax/_src/collective_ops/*.py) without token=: (name, kind, default)
MPI4JAX = {
    "send": [("x", _P, _REQUIRED), ("dest", _P, _REQUIRED), ("tag", _K, 0), ("comm", _K, None)],
    "recv": [("x", _P, _REQUIRED), ("source", _P, MPI.ANY_SOURCE), ("tag", _K, MPI.ANY_TAG), ("comm", _K, None),
             ("status", _K, None)],
    "sendrecv": [("sendbuf", _P, _REQUIRED), ("recvbuf", _P, _REQUIRED), ("source", _P, _REQUIRED),
                 ("dest", _P, _REQUIRED), ("sendtag", _K, 0), ("recvtag", _K, MPI.ANY_TAG), ("comm", _K, None),
                 ("status", _K, None)],
    "bcast": [("x", _P, _REQUIRED), ("root", _P, _REQUIRED), ("comm", _K, None)],
    "alltoall": [("x", _P, _REQUIRED), ("comm", _K, None)],
    "barrier": [("comm", _K, None)],
    "allreduce": [("x", _P, _REQUIRED), ("op", _P, _REQUIRED), ("comm", _K, None)],
    "allgather": [("x", _P, _REQUIRED), ("comm", _K, None)],
    "gather": [("x", _P, _REQUIRED), ("root", _P, _REQUIRED), ("comm", _K, None)],
    "reduce": [("x", _P, _REQUIRED), ("op", _P, _REQUIRED), ("root", _P, _REQUIRED), ("comm", _K, None)],
    "scatter": [("x", _P, _REQUIRED), ("root", _P, _REQUIRED), ("comm", _K, None)],
    "scan": [("x", _P, _REQUIRED), ("op", _P, _REQUIRED), ("comm", _K, None)],
}


@pytest.mark.parametrize("name", sorted(MPI4JAX))
def test_mpi4jaxs_names_have_its_signatures_and_defaults(name):
    *got, token = [(q.name, q.kind, q.default) for q in inspect.signature(getattr(ddj, name)).parameters.values()]
    assert got == MPI4JAX[name]
    assert token[:2] == ("token", _K)  # mpi4jax's last keyword, refused as mpi4jax refuses it
    with pytest.raises(RuntimeError, match=f"ddl_triton.jax.{name}: explicit token management is not supported"):
        getattr(ddj, name)(*[jnp.ones(1)] * sum(k == _P and d is _REQUIRED for _, k, d in got), token=None)


def test_what_mpi4jax_has_and_ddl_triton_does_not_is_refused_by_name():
    for name in ("has_cuda_support", "has_sycl_support"):
        with pytest.raises(AttributeError, match=f"ddl_triton.jax has no {name}: ddl_triton.jax stages every array"):
            getattr(ddj, name)
    with pytest.raises(AttributeError, match="has no attribute 'nonesuch'"):
        ddj.nonesuch  # noqa: B018


def test_comm_mpi_world_is_the_world_and_other_comms_are_refused():
    world = ddj.init()
    x = jnp.arange(5, dtype=jnp.int32)
    assert ddj.rank(MPI.COMM_WORLD) == world.rank and ddj.size(MPI.COMM_WORLD) == world.size
    np.testing.assert_array_equal(ddj.allreduce(x, MPI.SUM, comm=MPI.COMM_WORLD), x)
    np.testing.assert_array_equal(ddj.allreduce(x, MPI.SUM, comm=MPI.COMM_WORLD.Clone()), x)  # mpi4jax's default
    with pytest.raises(TypeError, match="comm must be a ddl_triton.Communicator"):
        ddj.allreduce(x, MPI.SUM, comm="world")


def test_world_of_one_results_and_point_to_point_to_oneself():
    ddj.init()
    x = jnp.arange(7, dtype=jnp.int32)
    for f in (lambda v: ddj.bcast(v, 0), lambda v: ddj.scan(v, MPI.SUM), lambda v: ddj.reduce(v, MPI.MAX, 0),
              lambda v: ddj.scatter(v[None], 0), lambda v: ddj.alltoall(v[None])[0], lambda v: ddj.gather(v, 0)[0],
              lambda v: ddj.sendrecv(v, jnp.zeros_like(v), 0, 0)):
        np.testing.assert_array_equal(f(x), x)
        np.testing.assert_array_equal(jax.jit(f)(x), x)
    assert ddj.barrier() is None
    status = MPI.Status()
    np.testing.assert_array_equal(ddj.sendrecv(x, x, 0, 0, sendtag=4, recvtag=4, status=status), x)
    assert (status.Get_source(), status.Get_tag()) == (0, 4)


def test_bad_point_to_point_input_is_named_with_the_rank():
    ddj.init()
    x = jnp.ones(3)
    cases = [
        (lambda: ddj.send(x, 1), "rank 0: ddl_triton.jax.send: dest must be a rank in [0, 1), got 1"),
        (lambda: ddj.send(x, MPI.ANY_SOURCE), "dest must be a rank in [0, 1), got"),
        (lambda: ddj.send(x, True), "got True"),
        (lambda: ddj.send(x, 0), "rank 0: ddl_triton.jax.send: dest=0 is this rank"),
        (lambda: ddj.recv(x, 3), "rank 0: ddl_triton.jax.recv: source must be a rank in [0, 1) or MPI.ANY_SOURCE"),
        (lambda: ddj.recv(x, 0, tag=-3), "rank 0: ddl_triton.jax.recv: tag must be in [0, "),
        (lambda: ddj.sendrecv(x, x, 0, 0, sendtag=MPI.ANY_TAG), "sendtag must be in [0, "),
        (lambda: ddj.sendrecv(jnp.arange(5), jnp.zeros(4, jnp.float32), 0, 0),
         "rank 0: ddl_triton.jax.sendrecv: recv from rank 0 (tag any): rank 0 sent int32[5] with tag 0, but this "
         "rank's template is float32[4]"),
        (lambda: ddj.alltoall(jnp.ones((2, 3))), "rank 0: ddl_triton.jax.alltoall: input must have shape (nproc, ...)"),
        (lambda: ddj.scatter(jnp.ones((2, 3)), 0), "rank 0: ddl_triton.jax.scatter: Scatter input must have shape"),
        (lambda: ddj.bcast(x, 1), "rank 0: ddl_triton.jax.broadcast: root must be a rank in [0, 1)"),
        (lambda: ddj.scan(x, MPI.PROD), "MPI.PROD is not a reduction ddl_triton implements"),
        (lambda: ddj.scan(x, "avg"), "rank 0: ddl_triton.jax.scan: op must be MPI.SUM, MPI.MIN, MPI.MAX"),
        (lambda: ddj.reduce(x, MPI.LAND, 0), "MPI.LAND is not a reduction"),
    ]
    for fn, says in cases:
        with pytest.raises(ValueError) as e:
            fn()
        assert says in str(e.value), str(e.value)
    with pytest.raises(TypeError, match="status must be an mpi4py.MPI.Status"):
        ddj.recv(x, 0, status="s")
