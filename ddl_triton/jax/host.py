"""What runs on the host inside JAX's callbacks: leaves fused into buckets, handed to the communicator.

JAX hands a callback its arguments as NumPy arrays it owns (read-only); these functions copy them
into fresh C-contiguous buffers (a copy is needed anyway: a JAX array is immutable, and a
collective writes its result in place), run one collective per bucket on each buffer (the
communicator takes NumPy arrays in place, zero copy: ddl_triton/runtime/arrays.py), and return the
leaves as views of the buffers, which JAX then copies into its own. The compressed allreduces
take torch tensors: ``ddl_triton.runtime.arrays.torch_view`` gives them the same memory.

Buckets (``buckets``, the planner of ddl_triton/gradients/buckets.py): the leaves in pytree
order, each joining the open bucket of its dtype until that would pass ``bucket_bytes`` (25 MiB,
DDP's default); a leaf larger than that is a bucket of its own. The layout depends only on the leaves' shapes and dtypes, so every rank builds
the same buckets, and the call check of each collective catches ranks whose pytrees differ.
A fused allreduce gives bitwise what per-leaf allreduces give: the reduction of an element
does not depend on where it sits in the buffer (tests/multirank/jax_worker.py checks it on
random floats at 3 ranks).

Broadcast and allgather move bytes, not values: their buffers are the leaves' bytes, packed at
8-byte offsets and viewed as int32 words, so every dtype JAX has (bool, uint8, PRNG key data)
travels, bit for bit.
"""
from __future__ import annotations

import numpy as np

from ..compression_methods import NONE
from ..gradients.buckets import plan
from ..gradients.reducer import Reducer

__all__ = ["BUCKET_BYTES", "REDUCED_DTYPES", "allgather", "allreduce", "broadcast", "buckets", "reduce_scatter"]

BUCKET_BYTES = 25 * 1024 * 1024
# What the core reduces (docs/api.md, "dtypes"), as NumPy / ml_dtypes name them.
REDUCED_DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64")
_ALIGN = 8  # bytes: a leaf's offset in a byte bucket, so that its view keeps the dtype's alignment


def buckets(leaves, bucket_bytes: int = BUCKET_BYTES, by_dtype: bool = True) -> list[list[int]]:
    """The leaves' indices grouped into buckets (module doc: ddl_triton/gradients/buckets.py's
    planner), in the order of each bucket's first leaf. ``leaves``: objects with ``shape``,
    ``dtype`` (arrays or ShapeDtypeStructs). ``by_dtype`` False (bytes moved, not reduced): one
    sequence of buckets for every dtype, each leaf taking its bytes padded to 8.
    Example: float32 leaves of 10, 20 and 30 MiB, bucket_bytes 25 MiB -> [[0], [1], [2]];
             float32 (3,), int32 (2,), float32 (4,) -> [[0, 2], [1]]."""
    dtypes = [np.dtype(leaf.dtype) for leaf in leaves]
    nbytes = [int(np.prod(leaf.shape, dtype=np.int64)) * dt.itemsize for leaf, dt in zip(leaves, dtypes)]
    if by_dtype:
        return plan(dtypes, nbytes, bucket_bytes)
    return plan([None] * len(nbytes), [_padded(n) for n in nbytes], bucket_bytes)


def allreduce(comm, op: str, arrays, bucket_bytes: int = BUCKET_BYTES) -> list[np.ndarray]:
    """The allreduce of every array (same shapes and dtypes on every rank), one collective per
    bucket, in full precision: the framework-neutral reducer's fused list with nothing compressed
    (ddl_triton/gradients/reducer.py, ``Reducer.reduce_list``)."""
    return Reducer(comm, NONE, who="allreduce").reduce_list(arrays, op, bucket_bytes)[0]


def broadcast(comm, root: int, arrays, bucket_bytes: int = BUCKET_BYTES) -> list[np.ndarray]:
    """Every array as rank ``root`` holds it, bit for bit, one broadcast per bucket of bytes."""
    out: list = [None] * len(arrays)
    for bucket in buckets(arrays, bucket_bytes, by_dtype=False):
        leaves = [np.ascontiguousarray(arrays[i]) for i in bucket]
        offsets, total = _byte_offsets(leaves)
        words = np.zeros(-(-total // 4), dtype=np.int32)
        raw = words.view(np.uint8)
        for leaf, o in zip(leaves, offsets):
            raw[o: o + leaf.nbytes] = leaf.reshape(-1).view(np.uint8)
        comm.broadcast(words, root=root)
        for i, leaf, o in zip(bucket, leaves, offsets):
            out[i] = raw[o: o + leaf.nbytes].view(leaf.dtype).reshape(leaf.shape)
    return out


def allgather(comm, x: np.ndarray, varying: bool = False) -> np.ndarray:
    """The ranks' ``x`` (same dtype on every rank) concatenated along axis 0 in rank order (a 0-d
    ``x``: a vector of ``comm.size``), bit for bit: an all_gather of its bytes. The shapes must be
    equal, unless ``varying``: then the first dimensions may differ (one all_gather of them first,
    each rank's rows padded to the longest, as Horovod allows; eager calls only: a jitted program
    needs its result's shape before it runs)."""
    x = np.ascontiguousarray(x)
    if varying and x.ndim:
        rows = np.empty(comm.size, dtype=np.int64)
        comm.all_gather(rows, np.array([x.shape[0]], dtype=np.int64))
        if (rows != x.shape[0]).any():
            longest = int(rows.max())
            padded = np.zeros((longest, *x.shape[1:]), dtype=x.dtype)
            padded[: x.shape[0]] = x
            every = allgather(comm, padded).reshape(comm.size, longest, *x.shape[1:])
            return np.concatenate([every[q, : rows[q]] for q in range(comm.size)])
    nb, n = x.nbytes, comm.size
    w = -(-nb // 4)
    mine = np.zeros(w, dtype=np.int32)
    mine.view(np.uint8)[:nb] = x.reshape(-1).view(np.uint8)
    got = np.empty(n * w, dtype=np.int32)
    comm.all_gather(got, mine)
    blocks = got.view(np.uint8).reshape(n, 4 * w)[:, :nb]
    shape = (n * x.shape[0], *x.shape[1:]) if x.ndim else (n,)
    return np.ascontiguousarray(blocks).view(x.dtype).reshape(shape)


def reduce_scatter(comm, g: np.ndarray, shape) -> np.ndarray:
    """Block ``comm.rank`` of the sum over ranks of ``g`` (``comm.size`` blocks along axis 0), of
    ``shape``: the transpose of ``allgather`` (its VJP)."""
    inp = np.array(g, dtype=g.dtype, order="C", copy=True)
    out = np.empty(shape, dtype=g.dtype)
    comm.reduce_scatter(out.reshape(-1), inp.reshape(-1), op="sum")
    return out


# -- private ----------------------------------------------------------------------------------
def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _byte_offsets(leaves) -> tuple[list[int], int]:
    offsets, o = [], 0
    for leaf in leaves:
        offsets.append(o)
        o += _padded(leaf.nbytes)
    return offsets, o
