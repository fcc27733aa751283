"""Arrays from any framework through the Communicator (ddl_triton/runtime/arrays.py), on an
in-process world: N ranks as threads, each with the real Communicator methods over its real call
path (issue path, runner, plan cache, executor, call check) on loopback transports
(tests/support/inprocess_world.py). Only the small-message path is absent: the multi-rank tier
(tests/multirank/test_arrays_across_ranks.py) runs numpy and JAX arrays through shm and MPI.

Every collective x numpy / JAX / torch x every supported dtype x sizes 0, 1, primes (none a
multiple of the world sizes): exact integer-valued results, bitwise the torch path's for the same
data, bitwise identical on every rank; in place where the array is mutable (``out is x``), a new
array of the caller's type where it is not (and the caller's JAX array untouched); the errors
name the rank and the problem. Arrays that differ in shape or dtype across ranks are the
multi-rank tier's (the loopback double refuses the mismatched read before the call check can).
"""
from __future__ import annotations

import re
import types

import numpy as np

import pytest
import torch

from ddl_triton.kernels import load_triton
from ddl_triton.observability import flight
from ddl_triton.planning.planner import Planner
from ddl_triton.planning.topology import detect
from ddl_triton.runtime.arrays import ArrayWork
from ddl_triton.runtime.calls import issue as issue_module
from ddl_triton.runtime.calls.executor import Executor
from ddl_triton.runtime.calls.issue import IssuePath
from ddl_triton.runtime.calls.plan_cache import PlanCache
from ddl_triton.runtime.calls.running import CallRunner
from ddl_triton.runtime.communicator import Communicator
from ddl_triton.runtime.lanes.call_check import CallChecker
from support.inprocess_world import ThreadWorld

jax = pytest.importorskip("jax", reason="the JAX cases need jax (the [jax] extra)")
jnp = jax.numpy
ml_dtypes = pytest.importorskip("ml_dtypes", reason="numpy bfloat16 arrays come from ml_dtypes (installed with jax)")

TIMEOUT_S = 10.0
SIZES = (0, 1, 7, 13)  # 0, 1, primes: none divisible by 2 or 3 ranks
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64")
COLLECTIVES = ("allreduce", "broadcast", "reduce_scatter", "all_gather", "all_to_all")
KINDS = ("torch", "numpy", "jax")


@pytest.fixture(autouse=True)
def _process_state(monkeypatch, tmp_path):
    """A mismatch dumps the flight recorder and a lost peer is remembered: keep both to the test."""
    monkeypatch.setattr(issue_module, "_LOST_PEERS", [])
    monkeypatch.setattr(flight.RECORDER, "dump_dir", str(tmp_path))


def _communicators(n: int) -> tuple[ThreadWorld, list[Communicator]]:
    """A Communicator per rank, composed as Communicator.__init__ composes one, on loopback transports."""
    world = ThreadWorld(n)
    comms = []
    for r in range(n):
        planner = Planner(rank=r, size=n, topology=detect([0] * n), link_of=lambda a, b: "shm", forced="",
                          slot_bytes=1 << 16)
        checker = CallChecker(None, r, n, world.transport(r), TIMEOUT_S)
        world.transport(r).wait_hook = checker.look_for_mismatch
        runner = CallRunner(r, n, executor=Executor(r, n, world.route(r), timeout=TIMEOUT_S, depth=2),
                            plans=PlanCache(planner, r, n, False), small=None, checker=checker, gpu=None,
                            control=None, timeout=TIMEOUT_S, describe=None)
        comm = object.__new__(Communicator)
        comm.rank, comm.size, comm._runner = r, n, runner
        comm._bootstrap = types.SimpleNamespace(launcher="")  # explain's world line: no launcher found these
        comm._issuer = IssuePath(r, 1, runner.attach, timeout=TIMEOUT_S)
        comms.append(comm)
    return world, comms


def _values(rank: int, numel: int) -> np.ndarray:
    """Rank ``rank``'s integer values: small enough that sums over 4 ranks stay exact in bfloat16."""
    return (np.arange(numel, dtype=np.int64) % 7) + 3 * rank + 1


def _make(kind: str, dtype: str, values: np.ndarray):
    if kind == "torch":
        return torch.from_numpy(values.copy()).to(getattr(torch, dtype))
    if kind == "numpy":
        return values.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))
    return jnp.asarray(values, dtype=getattr(jnp, dtype))


def _bytes(x) -> bytes:
    if isinstance(x, torch.Tensor):
        return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if x.numel() else b""
    return np.asarray(x).tobytes()


def _as_float64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64).numpy()
    return np.asarray(x).astype(np.float64)


def _run(comm: Communicator, collective: str, kind: str, dtype: str, numel: int, async_op: bool = False):
    """(what was passed, what the call returned) for ``collective`` on rank ``comm.rank``'s data."""
    n, r = comm.size, comm.rank
    if collective in ("allreduce", "broadcast"):
        x = _make(kind, dtype, _values(r, numel))
        out = comm.allreduce(x, async_op=async_op) if collective == "allreduce" else \
            comm.broadcast(x, root=n - 1, async_op=async_op)
        return x, out.wait() if async_op else out
    whole = numel * n if collective in ("reduce_scatter", "all_to_all") else numel
    x = _make(kind, dtype, _values(r, whole))
    # The output: the kind itself where it is writable; a JAX input writes into numpy.
    out_kind = "numpy" if kind == "jax" else kind
    out = _make(out_kind, dtype, np.full(numel * n if collective == "all_gather" else whole
                                         if collective == "all_to_all" else numel, -5))
    got = getattr(comm, collective)(out, x, async_op=async_op)
    got = got.wait() if async_op else got
    assert got is out, f"rank {r}: {collective} returned {type(got)}, not its output"
    return x, got


def _expected(collective: str, rank: int, n: int, numel: int) -> np.ndarray:
    whole = numel * n if collective in ("reduce_scatter", "all_to_all") else numel
    inputs = [_values(q, whole) for q in range(n)]
    if collective == "allreduce":
        return sum(inputs)
    if collective == "broadcast":
        return inputs[n - 1]
    if collective == "reduce_scatter":
        return sum(inputs)[rank * numel:(rank + 1) * numel]
    if collective == "all_gather":
        return np.concatenate(inputs)
    return np.concatenate([inputs[q][rank * numel:(rank + 1) * numel] for q in range(n)])


@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_collective_on_every_kind_is_exact_bitwise_the_torch_path_and_alike_on_every_rank(n):
    world, comms = _communicators(n)
    cases = [(c, k, d, s) for c in COLLECTIVES for d in DTYPES for s in SIZES for k in KINDS]

    def rank_body(rank: int):
        comm, failures, results = comms[rank], [], {}
        for collective, kind, dtype, numel in cases:
            with jax.enable_x64(True):  # JAX's 64-bit dtypes, on this thread only (JAX makes 32-bit by default)
                x, got = _run(comm, collective, kind, dtype, numel)
            case = f"rank {rank}: {collective} of {numel} x {dtype} ({kind})"
            results[(collective, kind, dtype, numel)] = _bytes(got)
            if collective in ("allreduce", "broadcast"):
                if kind == "jax":
                    if type(got) is not type(x) or got is x:
                        failures.append(f"{case}: returned {type(got)} (the same object: {got is x}), want a new "
                                        f"{type(x)}")
                    if not np.array_equal(np.asarray(x).astype(np.float64), _values(rank, numel)):
                        failures.append(f"{case}: the caller's JAX array changed")
                elif got is not x:
                    failures.append(f"{case}: returned {type(got)}, not the array passed (in place)")
            if got.dtype != x.dtype and kind != "jax" or tuple(got.shape) != tuple(_expected(
                    collective, rank, n, numel).shape):
                failures.append(f"{case}: result {got.dtype} {tuple(got.shape)}")
            if not np.array_equal(_as_float64(got), _expected(collective, rank, n, numel).astype(np.float64)):
                failures.append(f"{case}: got {_as_float64(got)}, want {_expected(collective, rank, n, numel)}")
        comm._issuer.close()
        return failures, results

    out = world.run(rank_body, timeout=120.0)
    failures = [f for fs, _ in out for f in fs]
    for rank, (_, results) in enumerate(out):
        for (collective, kind, dtype, numel), got in results.items():
            if kind != "torch" and got != results[(collective, "torch", dtype, numel)]:
                failures.append(f"rank {rank}: {collective} of {numel} x {dtype} ({kind}): not bitwise the torch path's")
            if collective in ("allreduce", "broadcast", "all_gather") and got != out[0][1][(collective, kind, dtype,
                                                                                               numel)]:
                failures.append(f"rank {rank}: {collective} of {numel} x {dtype} ({kind}): differs from rank 0's")
    assert not failures, "\n".join(failures[:40])
    assert world.unreleased() == []


def test_async_calls_hand_back_the_callers_array_from_wait_and_result():
    world, comms = _communicators(2)

    def rank_body(rank: int):
        comm = comms[rank]
        x = _values(rank, 11).astype(np.float32)
        work = comm.allreduce(x, async_op=True)
        j = jnp.asarray(_values(rank, 11), dtype=jnp.float32)
        jwork = comm.broadcast(j, root=1, async_op=True)
        out = np.zeros(22, np.int32)
        gwork = comm.all_gather(out, jnp.asarray(_values(rank, 11), dtype=jnp.int32), async_op=True)
        got = (work.wait(), work.result(), jwork.wait(), jwork.result(), gwork.wait())
        comm._issuer.close()
        return x, j, out, work, got

    for rank, (x, j, out, work, got) in enumerate(world.run(rank_body)):
        assert isinstance(work, ArrayWork) and work.is_completed()
        assert got[0] is x and got[1] is x and got[4] is out
        assert np.array_equal(x, _values(0, 11) + _values(1, 11))
        assert type(got[2]) is type(j) and got[2] is got[3] and np.array_equal(np.asarray(got[2]), _values(1, 11))
        assert np.array_equal(out, np.concatenate([_values(0, 11), _values(1, 11)]))


def test_strided_numpy_arrays_work_in_place_through_a_copy_written_back():
    """As strided torch tensors do: the array's own elements get the result, the others stay."""
    world, comms = _communicators(3)

    def rank_body(rank: int):
        comm = comms[rank]
        a, b = _values(rank, 13).astype(np.float64), _values(rank, 13).astype(np.float64)
        c = np.tile(_values(rank, 13)[:, None], (1, 2)).astype(np.int32)        # 13 x 2
        every_other, backwards, column = a[::2], b[::-1], c[:, 0]   # torch views the first and third, not the second
        got = (comm.allreduce(every_other), comm.allreduce(backwards), comm.broadcast(column, root=2))
        comm._issuer.close()
        return (every_other, backwards, column), got, a, b, c

    total = sum(_values(r, 13) for r in range(3))
    for rank, (passed, got, a, b, c) in enumerate(world.run(rank_body)):
        assert all(g is p for g, p in zip(got, passed)), "in place: the same objects back"
        assert np.array_equal(a[::2], total[::2]) and np.array_equal(a[1::2], _values(rank, 13)[1::2])
        assert np.array_equal(b, total)
        assert np.array_equal(c[:, 0], _values(2, 13)) and np.array_equal(c[:, 1], _values(rank, 13))


def _errors(n: int, body) -> list[BaseException]:
    """Each rank's exception from ``body(comm)`` on a fresh world of ``n``: every one must raise."""
    world, comms = _communicators(n)
    results = world.run_all(lambda rank: body(comms[rank]), timeout=30.0)
    for rank, e in enumerate(results):
        assert isinstance(e, BaseException), f"rank {rank} did not raise: {e!r}"
        assert str(e).startswith(f"rank {rank}: "), f"rank {rank}: the error does not name it: {e}"
    return results


def _read_only(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False
    return values


class _Immutable:
    """An array of a kind with ``__dlpack__`` but no way back (no namespace, no module from_dlpack)."""

    def __init__(self, data: np.ndarray):
        self._data = data

    def __dlpack__(self, **kwargs):
        return self._data.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._data.__dlpack_device__()


class _Backwards(_Immutable):
    strides = (-4,)  # as a reversed view's: torch.from_dlpack would abort the process on it


class _OnGpu(_Immutable):
    def __dlpack_device__(self):
        return (2, 0)  # DLPack's kDLCUDA


BAD_INPUT = {
    "read-only in place": (lambda c: c.allreduce(_read_only(np.ones(5, np.float32))),
                           ValueError, r"tensor is read-only \(a numpy array.*pass a writable array"),
    "read-only output": (lambda c: c.all_gather(_read_only(np.ones(5 * c.size)), np.ones(5)),
                         ValueError, "output is read-only"),
    "complex numpy": (lambda c: c.allreduce(np.ones(3, np.complex64)), TypeError,
                      r"tensor has unsupported dtype complex64 \(a numpy array\); supported: float32, float16, "
                      r"bfloat16"),
    "object numpy": (lambda c: c.broadcast(np.array([None, 1], dtype=object)), TypeError, "unsupported dtype object"),
    "strings": (lambda c: c.all_gather(np.zeros(2 * c.size), np.array(["ab", "c"])), TypeError,
                "input has unsupported dtype <U2"),
    "bool": (lambda c: c.allreduce(np.ones(3, bool)), TypeError, "unsupported dtype bool"),
    "int16": (lambda c: c.allreduce(np.ones(3, np.int16)), TypeError, "unsupported dtype int16"),
    "big-endian": (lambda c: c.allreduce(np.ones(3, ">f4")), TypeError, "non-native byte order"),
    "avg of integers": (lambda c: c.allreduce(np.ones(3, np.int32), op="avg"), ValueError,
                        "op 'avg' is not defined for integer dtype"),
    "numpy scalar": (lambda c: c.allreduce(np.float32(1)), TypeError, "numpy scalar"),
    "a list": (lambda c: c.allreduce([1.0, 2.0]), TypeError, r"must be a torch.Tensor, a numpy array or an array "
                                                            r"with __dlpack__ .*got builtins.list"),
    "complex jax": (lambda c: c.allreduce(jnp.ones(3, jnp.complex64)), TypeError,
                    r"unsupported dtype complex64 \(a jaxlib"),
    "bool jax": (lambda c: c.allreduce(jnp.ones(3, bool)), TypeError, "unsupported dtype bool"),
    "jax output": (lambda c: c.reduce_scatter(jnp.zeros(3), np.ones(3 * c.size, np.float32)), TypeError,
                   r"output is a jaxlib.*cannot be written in place.*pass a writable numpy array"),
    "no way back": (lambda c: c.allreduce(_Immutable(np.ones(3, np.float32))), TypeError,
                    "neither its __array_namespace__ nor its module has from_dlpack"),
    "negative strides through DLPack": (lambda c: c.allreduce(_Backwards(np.ones(3, np.float32))), ValueError,
                                        "with negative strides, which torch cannot take through DLPack"),
    "gpu array, no gpu path": (lambda c: c.allreduce(_OnGpu(np.ones(3, np.float32))), ValueError,
                               r"on a GPU \(DLPack device \(2, 0\)\), but this process has no GPU path"),
    "mismatched sizes": (lambda c: c.all_gather(np.zeros(5 * c.size, np.float32), np.ones(4, np.float32)),
                         ValueError, r"all_gather needs output.numel\(\) == size \* input.numel\(\)"),
    "mismatched dtypes": (lambda c: c.all_to_all(np.zeros(2 * c.size, np.float32), jnp.ones(2 * c.size, jnp.int32)),
                          TypeError, "output is torch.float32 but input is torch.int32"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_refused_with_an_error_naming_the_rank_and_the_problem(case):
    """Every rank passes the bad input; each raises before sending anything, naming itself."""
    call, kind, pattern = BAD_INPUT[case]
    for e in _errors(2, call):
        assert isinstance(e, kind), f"{type(e).__name__}: {e}"
        assert re.search(pattern, str(e)), f"{e!s} does not match {pattern!r}"


def test_a_read_only_array_is_read_where_the_collective_only_reads_it():
    world, comms = _communicators(2)

    def rank_body(rank: int):
        out, backwards = np.zeros(2 * 5, np.float32), np.zeros(2 * 5, np.float32)
        comms[rank].all_gather(out, _read_only(_values(rank, 5).astype(np.float32)))
        comms[rank].all_gather(backwards, _read_only(_values(rank, 5).astype(np.float32))[::-1])  # no torch view
        comms[rank]._issuer.close()
        return out, backwards

    for out, backwards in world.run(rank_body):
        assert np.array_equal(out, np.concatenate([_values(0, 5), _values(1, 5)]))
        assert np.array_equal(backwards, np.concatenate([_values(0, 5)[::-1], _values(1, 5)[::-1]]))


@pytest.mark.slow  # seconds: make check, the inner loop, leaves it out
def test_tensorflow_eager_tensors_come_in_through_dlpack_and_go_back_as_new_tensors():
    """The one test that imports TensorFlow (seconds): a tf.Tensor is immutable, like a JAX array."""
    load_triton()  # before TensorFlow, or a later test's first Triton kernel would abort pytest
    tf = pytest.importorskip("tensorflow", reason="the TensorFlow case needs tensorflow (the [tensorflow] extra)")
    world, comms = _communicators(2)

    def rank_body(rank: int):
        comm, got = comms[rank], []
        for dtype in (tf.float32, tf.bfloat16, tf.int64):
            x = tf.constant(_values(rank, 13), dtype=dtype)
            got.append((x, comm.allreduce(x), comm.broadcast(x, root=1)))
        out = np.zeros(2 * 7, np.int32)
        gathered = comm.all_gather(out, tf.constant(_values(rank, 7), dtype=tf.int32))
        comm._issuer.close()
        return got, out, gathered

    results = world.run(rank_body)
    total = _values(0, 13) + _values(1, 13)
    for rank, (got, out, gathered) in enumerate(results):
        for (x, summed, sent), dtype in zip(got, ("float32", "bfloat16", "int64")):
            assert type(summed) is type(x) and summed is not x and summed.dtype == x.dtype, (rank, dtype)
            assert np.array_equal(x.numpy().astype(np.float64), _values(rank, 13)), f"rank {rank}: {dtype} input changed"
            assert np.array_equal(summed.numpy().astype(np.float64), total), (rank, dtype, summed)
            assert np.array_equal(sent.numpy().astype(np.float64), _values(1, 13)), (rank, dtype, sent)
            assert summed.numpy().tobytes() == results[0][0][[g[0].dtype for g in got].index(x.dtype)][1].numpy().tobytes()
        assert gathered is out and np.array_equal(out, np.concatenate([_values(0, 7), _values(1, 7)]))
    with pytest.raises(TypeError, match=r"rank 0: output is a tensorflow.*cannot be written in place"):
        comms[0].all_gather(tf.zeros(2), np.ones(1, np.float32))


def test_explain_takes_every_dtype_spelling_the_collectives_take():
    """``comm.explain(collective, nbytes, dtype)`` with dtype spelt as any framework spells it plans as
    for the torch dtype; it crashed on "float32" and on np.float32 (an AttributeError on itemsize)."""
    _, (comm, _) = _communicators(2)
    comm._planner = comm._runner.plans._planner  # (TensorFlow's spelling: tests/multirank/tf_worker.py)
    spellings = {torch.float32: torch.float32, "float32": torch.float32, "torch.float32": torch.float32,
                 np.float32: torch.float32, np.dtype("float32"): torch.float32, jnp.float32: torch.float32,
                 "bfloat16": torch.bfloat16, ml_dtypes.bfloat16: torch.bfloat16, jnp.bfloat16: torch.bfloat16,
                 np.int64: torch.int64, "int32": torch.int32, "half": torch.float16, "double": torch.float64}
    for nbytes in (64, 1 << 20):
        for spelling, as_torch in spellings.items():
            assert comm.explain("allreduce", nbytes, spelling) == comm.explain("allreduce", nbytes, as_torch), spelling
    for bad, why in ((np.int8, "not one the collectives take"), ("complex64", "not one the collectives take"),
                     ("float", "ambiguous: float32 to torch, float64 to NumPy"), (object(), "not one")):
        with pytest.raises(TypeError, match=f"rank 0: dtype .*{why}"):
            comm.explain("allreduce", 64, bad)
