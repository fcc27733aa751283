"""The framework-neutral gradient floor through torch's, JAX's and TensorFlow's rooms: the same decisions, the same bits.

One mpiexec launch of 2 ranks on two emulated hosts (DDL_TOPOLOGY=1x2, so that "auto" and torch's
per-level named methods cross a host boundary), TensorFlow imported once per process. For each
setting ("none", every method of the registry, "auto" following a tuning table's compression
section), the same gradients go through

    torch  ``LevelCompression`` (the hooks' and Options.compression's adapter): its ``decide``
           per bucket and its ``allreduce``, on the buckets of ``ddl_triton.gradients.buckets.plan``
    JAX    ``allreduce_gradients`` with a ``GradientCompression`` (or "none")
    TF     ``GradientReducer.reduce``

for two steps (error feedback carries between them), and the worker checks that each room decides
the same method for every bucket size (fp32-equivalent bytes), that the reduced bytes are equal
(==, bit for bit) across the rooms and across the ranks, and, uncompressed, equal to the exact
mean (the gradients are small integers). The sizes: 0 (a bucket of its own), 1, primes (7, 1031,
262147: not divisible by the world size or the int8 block) and a float16 leaf of 20000 elements,
whose real bytes (40000) and fp32-equivalent bytes (80000) fall on either side of the table's
boundary (65536 B): the room that decides on real bytes, or ignores the table, disagrees.

Run: DDL_TOPOLOGY=1x2 mpiexec -n 2 python tests/multirank/gradients_worker.py
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)  # float64 leaves stay float64 (JAX's default narrows them)

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import ddl_triton  # noqa: E402
import ddl_triton.jax as ddj  # noqa: E402
from ddl_triton import compression_methods  # noqa: E402
from ddl_triton.gradients import buckets  # noqa: E402
from ddl_triton.torch.level_compression import LevelCompression  # noqa: E402
from support.checker import Checker  # noqa: E402
from support.report import print_line  # noqa: E402

import tensorflow as tf  # noqa: E402  (last: its import costs seconds)

import ddl_triton.tensorflow as dtf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)  # 2 ranks on 2 cores: one thread each
tf.config.threading.set_inter_op_parallelism_threads(2)

BUCKET_BYTES = 64 * 1024
# (numel, dtype): a float32 bucket of 0 + 1 + 7 + 1031 elements, a float32 bucket of a prime of
# ~1 MiB alone, a float16 bucket of 20000, a float64 one (never compressed), an empty bfloat16 one.
LEAVES = [(0, "float32"), (1, "float32"), (7, "float32"), (1031, "float32"), (262147, "float32"),
          (20000, "float16"), (13, "float64"), (0, "bfloat16")]
# The table's compression section: full precision wins at 4 KiB, int8 at 1 MiB; a size takes the
# entry nearest in log size, so the boundary is 64 KiB of fp32-equivalent bytes.
SECTION = {"levels": {"inter": {"what": "inter-host", "ranks": 2, "latency_us": 50.0, "bytes_per_s": 1e8}},
           "entries": [{"bytes": 4096, "by_method": {"none": 10.0, "int8": 20.0, "onebit": 30.0}},
                       {"bytes": 1 << 20, "by_method": {"none": 1000.0, "int8": 100.0, "onebit": 90.0}}]}
NP = {"float32": np.float32, "float16": np.float16, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16}


class Tabled:
    """The world communicator as one that was given a tuning table with SECTION as its compression
    section (what the reducers read: ``comm.planner.table.compression``); everything else is the world's."""

    def __init__(self, comm):
        self._comm = comm
        self.planner = SimpleNamespace(table=SimpleNamespace(compression=SECTION), link=None)

    def __getattr__(self, name):
        return getattr(self._comm, name)


def gradients(r: int, step: int) -> list[np.ndarray]:
    """Small integers, exact in every dtype and in their mean over 2 ranks: ((i + step) % 7) - 3 + r."""
    return [((np.arange(n) + step) % 7 - 3 + r).astype(NP[d]) for n, d in LEAVES]


def raw(arrays) -> np.ndarray:
    """The arrays' bytes, in order: what == compares across rooms and ranks."""
    return np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]) \
        if arrays else np.empty(0, np.uint8)


def torch_room(lc: LevelCompression | None, comm, grads) -> list[np.ndarray]:
    """torch's way: the planner's buckets, each decided by LevelCompression (float buckets with
    elements; others, as the hooks leave them, in full precision) and reduced by it."""
    out = [None] * len(grads)
    plan = buckets.plan([g.dtype for g in grads], [g.nbytes for g in grads], BUCKET_BYTES)
    for index, members in enumerate(plan):
        flat = np.concatenate([grads[i].reshape(-1) for i in members])
        t = torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16) if flat.dtype == NP["bfloat16"] \
            else torch.from_numpy(flat)
        floating = t.dtype in (torch.float32, torch.float16, torch.bfloat16) and t.numel() > 0
        method = lc.decide(t.numel() * 4).method if lc is not None and floating else compression_methods.NONE
        if lc is None:
            comm.allreduce(t, op="avg")
        else:
            lc.allreduce(t, index, method, op="avg", async_op=False)
        o = 0
        for i in members:
            out[i] = flat[o: o + grads[i].size].reshape(grads[i].shape)
            o += grads[i].size
    return out


def jax_room(gc, comm, grads) -> list[np.ndarray]:
    leaves = [jnp.asarray(g) for g in grads]
    out = ddj.allreduce_gradients(leaves, compression=gc if gc is not None else "none", comm=comm,
                                  bucket_bytes=BUCKET_BYTES)
    return [np.asarray(o) for o in out]


def tf_room(reducer, grads) -> list[np.ndarray]:
    tensors = [tf.constant(g) if g.dtype != NP["bfloat16"] else tf.cast(tf.constant(g.astype(np.float32)),
                                                                         tf.bfloat16) for g in grads]
    return [np.asarray(o.numpy()) for o in reducer.reduce(tensors)]


def methods_of(state) -> dict | str:
    """{bucket bytes: (method, reason)} of a room's state, or what is missing."""
    decisions = getattr(state, "decisions", None)
    if decisions is None:
        return f"{type(state).__name__} keeps no decisions"
    return {n: (d.method, d.reason) for n, d in decisions.items()}


def check_setting(ck: Checker, comm, r: int, w: int, setting: str) -> None:
    tabled = Tabled(comm)
    named = setting != compression_methods.NONE
    lc = LevelCompression(tabled, setting) if named else None
    gc = ddj.GradientCompression(setting, comm=tabled) if named else None
    reducer = dtf.GradientReducer(setting, bucket_bytes=BUCKET_BYTES, comm=tabled)
    for step in range(2):
        grads = gradients(r, step)
        got = {"torch": torch_room(lc, tabled, grads), "jax": jax_room(gc, tabled, grads),
               "tensorflow": tf_room(reducer, grads)}
        for room, out in got.items():
            ck.true(f"{setting} step {step}: {room} keeps shapes and dtypes",
                    [(o.shape, o.dtype) for o in out] == [(g.shape, g.dtype) for g in grads])
            ck.identical(f"{setting} step {step}: {room}'s bytes across ranks", torch.from_numpy(raw(out)))
        for room in ("jax", "tensorflow"):
            ck.true(f"{setting} step {step}: {room}'s bytes == torch's", np.array_equal(raw(got[room]), raw(got["torch"])),
                    f"{room} differs from torch")
        if not named:
            exact = [((gradients(0, step)[i].astype(np.float64) + gradients(1, step)[i].astype(np.float64)) / 2)
                     .astype(grads[i].dtype) for i in range(len(grads))]
            ck.true(f"none step {step}: the exact mean", np.array_equal(raw(got["torch"]), raw(exact)))
    if named:
        want = methods_of(lc)
        ck.true(f"{setting}: jax decides as torch", methods_of(gc) == want, f"jax {methods_of(gc)} torch {want}")
        ck.true(f"{setting}: tensorflow decides as torch", methods_of(reducer) == want,
                f"tf {methods_of(reducer)} torch {want}")
        if setting == compression_methods.AUTO:  # the table's verdicts: 1 MiB and the float16 bucket's 80000 B
            ck.true("auto: the table decides", {n: m for n, (m, _) in want.items()} == {
                4156: "none", 262147 * 4: "int8", 80000: "int8"}, str(want))
        else:
            ck.true(f"{setting}: every float bucket sends {setting}",
                    {m for m, _ in want.values()} == {setting}, str(want))
        for state in (lc, gc, reducer):
            state.close()
    else:
        reducer.close()


def main() -> int:
    world = MPI.COMM_WORLD
    r, w = world.Get_rank(), world.Get_size()
    comm = ddl_triton.init()
    ck = Checker(world)
    for setting in compression_methods.choices():
        ck.run(lambda: check_setting(ck, comm, r, w, setting))
    status = ck.report(f"gradients_worker: {w} ranks")
    ddl_triton.finalize()
    return status


if __name__ == "__main__":
    sys.exit(main())
