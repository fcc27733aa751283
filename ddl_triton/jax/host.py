"""What runs on the host inside JAX's callbacks: leaves fused into buckets, handed to the communicator.

JAX hands a callback its arguments as NumPy arrays it owns (read-only); these functions copy them
into fresh C-contiguous buffers (a copy is needed anyway: a JAX array is immutable, and a
collective writes its result in place), run one collective per bucket on each buffer (the
communicator takes NumPy arrays in place, zero copy: ddl_triton/runtime/arrays.py), and return the
leaves as views of the buffers, which JAX then copies into its own. The compressed allreduces
take torch tensors: ``ddl_triton.runtime.arrays.torch_view`` gives them the same memory.

Buckets (``buckets``): the leaves in pytree order, each joining the open bucket of its dtype
until that would pass ``bucket_bytes`` (25 MiB, DDP's default); a leaf larger than that is a
bucket of its own. The layout depends only on the leaves' shapes and dtypes, so every rank builds
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

__all__ = ["BUCKET_BYTES", "REDUCED_DTYPES", "allgather", "allreduce", "broadcast", "buckets", "reduce_scatter"]

BUCKET_BYTES = 25 * 1024 * 1024
# What the core reduces (docs/api.md, "dtypes"), as NumPy / ml_dtypes name them.
REDUCED_DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64")
_ALIGN = 8  # bytes: a leaf's offset in a byte bucket, so that its view keeps the dtype's alignment


def buckets(leaves, bucket_bytes: int = BUCKET_BYTES, by_dtype: bool = True) -> list[list[int]]:
    """The leaves' indices grouped into buckets (module doc), in the order of each bucket's first
    leaf. ``leaves``: objects with ``shape``, ``dtype`` (arrays or ShapeDtypeStructs).
    ``by_dtype`` False (bytes moved, not reduced): one sequence of buckets for every dtype.
    Example: float32 leaves of 10, 20 and 30 MiB, bucket_bytes 25 MiB -> [[0], [1], [2]];
             float32 (3,), int32 (2,), float32 (4,) -> [[0, 2], [1]]."""
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    open_: dict = {}
    done: list[list[int]] = []
    for i, leaf in enumerate(leaves):
        dt = np.dtype(leaf.dtype)
        key = dt if by_dtype else None
        nbytes = int(np.prod(leaf.shape, dtype=np.int64)) * dt.itemsize
        held = open_.get(key)
        if held is not None and held[1] + nbytes > bucket_bytes:
            done.append(held[0])
            held = None
        if held is None:
            held = open_[key] = ([], 0)
        held[0].append(i)
        open_[key] = (held[0], held[1] + _padded(nbytes) if not by_dtype else held[1] + nbytes)
    done.extend(b for b, _ in open_.values())
    return sorted(done, key=lambda b: b[0])


def allreduce(comm, op: str, arrays, bucket_bytes: int = BUCKET_BYTES, reduce=None) -> list[np.ndarray]:
    """The allreduce of every array (same shapes and dtypes on every rank), one collective per
    bucket. ``reduce(buf, index)``, when given, runs a bucket's collective instead of
    ``comm.allreduce(buf, op)`` (compressed methods: gradients.py); ``index`` is the bucket's."""
    out: list = [None] * len(arrays)
    for index, bucket in enumerate(buckets(arrays, bucket_bytes)):
        buf = _concatenate([arrays[i] for i in bucket])
        if reduce is None:
            comm.allreduce(buf, op=op)
        else:
            reduce(buf, index)
        _split(buf, [arrays[i] for i in bucket], bucket, out)
    return out


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


def _concatenate(leaves) -> np.ndarray:
    """One fresh, writable, C-contiguous flat buffer holding the leaves in order."""
    if len(leaves) == 1:
        return np.array(leaves[0], order="C", copy=True).reshape(-1)
    return np.concatenate([np.ravel(a) for a in leaves])


def _split(buf: np.ndarray, leaves, indices, out: list) -> None:
    o = 0
    for i, leaf in zip(indices, leaves):
        n = int(np.prod(leaf.shape, dtype=np.int64))
        out[i] = buf[o: o + n].reshape(leaf.shape)
        o += n
