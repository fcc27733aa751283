"""One communicator's gradient allreduces, compressed or not: the choice, the residuals, the checks.

Every room's gradient averaging runs here (torch's ``LevelCompression``, JAX's
``GradientCompression``, TensorFlow's ``GradientReducer``: thin adapters). A :class:`Reducer`
is made with a ``setting``, one of ``compression_methods.choices()``:

    setting   a bucket of float32 / float16 / bfloat16 is sent
    "none"    in full precision (the communicator's own allreduce)
    a method  with that method's row of ddl_triton/compression_methods.py (int8, int4, onebit, fp16, bf16,
              or one registered), with error feedback where the row keeps it. Where it runs is the
              adapter's ``named`` scope: "world" (JAX, TensorFlow: the method's allreduce over the
              whole communicator) or "levels" (torch's ``Options.compression`` and
              ``auto_compress_hook``: per level, shm inside a host and the method between hosts;
              on one host full precision: nothing to save)
    "auto"    per level, between hosts what ddl_triton/tuning/auto_compression.py decides for the
              bucket: the tuning table's ``compression`` section if the communicator's table has
              one, else the cost model on the link probed at first use; on one host, "none"

Other dtypes (float64, integers), an empty bucket and a communicator of one rank are always
sent in full precision (a decision of "none" with its reason).

**One byte rule.** A bucket is decided by its fp32-equivalent bytes, ``numel * 4``, whatever its
dtype: the table and the cost model are measured and modelled on fp32 tensors, and the
compressed wire bytes depend on the element count, not on the input's width. (JAX decided on
real bytes before this floor, so a float16 bucket of N elements was decided as one of N/2.)

Decisions are cached per size (``decisions``: {nbytes: Decision}); a caller that knows how much
backward follows a call (torch: ddl_triton/torch/backward_position.py) asks ``decide_auto(nbytes,
behind_us)``, uncached. The first decision that needs the per-level groups builds them, and
"auto" without a table probes the link: both collective, at the same point on every rank (the
first compressed call always is). Every rank then decides alike: the probe's figures and the
table are the same everywhere.

Error feedback (``error_feedback``): residuals per key in a ``Residuals`` store (residuals.py:
reset on a size or method change, ``reset_residuals`` after a world change or a checkpoint).
"""
from __future__ import annotations

import numpy as np
import torch

from .. import compression_methods
from ..runtime.arrays import torch_view
from ..runtime.compression import per_level
from ..runtime.compression.layout import chunk_bounds
from ..tuning import auto_compression
from ..tuning.auto_compression import Decision
from . import buckets
from .residuals import Residuals

__all__ = ["FLOAT_DTYPES", "Reducer", "check_block", "fp32_bytes"]

# What a compressed allreduce takes, as torch and NumPy (ml_dtypes) name them.
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
SCOPES = ("world", "levels")


def fp32_bytes(numel: int) -> int:
    """The byte rule (module doc): the bytes of ``numel`` fp32 elements."""
    return int(numel) * 4


def check_block(block, who: str, rank: int | None = None) -> int:
    """``block`` if it is a power of two in [4, 65536] (the int8 quantization block), else
    ValueError naming ``rank`` (when given) and ``who``."""
    if not isinstance(block, int) or block < 4 or block > (1 << 16) or block & (block - 1):
        where = f"rank {rank}: " if rank is not None else ""
        raise ValueError(f"{where}{who}: block must be a power of two in [4, 65536], got {block!r}")
    return block


class Reducer:
    """Compressed-or-not gradient allreduces over ``comm`` under ``setting`` (module doc).

    ``named``: where a named method runs, "world" or "levels"; ``block``: the int8 quantization
    block; ``error_feedback``: keep what compression lost and send it with the key's next call;
    ``max_keys``: residuals kept at most (None: no bound). ``who`` names the API in errors."""

    def __init__(self, comm, setting: str, *, named: str = "world", block: int = 256, error_feedback: bool = True,
                 max_keys: int | None = None, who: str = "compression"):
        rank = comm.rank
        compression_methods.check_choice(setting, f"rank {rank}: {who}")
        if named not in SCOPES:
            raise ValueError(f"rank {rank}: {who}: named must be one of {', '.join(SCOPES)}, got {named!r}")
        self.comm, self.setting, self.named, self.who = comm, setting, named, who
        self.block = check_block(block, who, rank)
        self.error_feedback = bool(error_feedback)
        self.decisions: dict = {}
        self.residuals = Residuals(max_keys)
        self._levels: per_level.Levels | None = None
        self._speeds = None

    # -- the groups ------------------------------------------------------------------------------
    @property
    def levels(self) -> per_level.Levels:
        """The per-level groups (built at first use: collective)."""
        if self._levels is None:
            self._levels = per_level.Levels(self.comm)
        return self._levels

    @property
    def groups(self) -> list:
        """The communicators the per-level groups added (none before first use, or where the
        groups are ``comm`` itself)."""
        return list(self._levels.owned) if self._levels is not None else []

    # -- the choice ------------------------------------------------------------------------------
    def decide(self, nbytes: int) -> Decision:
        """The method for a float bucket of ``nbytes`` fp32-equivalent bytes, with its reason
        (cached per size; collective on first use, module doc)."""
        held = self.decisions.get(nbytes)
        if held is None:
            held = self.decisions[nbytes] = self._decide(nbytes)
        return held

    def decide_bucket(self, numel: int, dtype) -> Decision:
        """The method for a bucket of ``numel`` elements of ``dtype`` (a torch, NumPy or TF dtype,
        or its name): "none" for other dtypes, an empty bucket or one rank, else ``decide`` of its
        fp32-equivalent bytes."""
        if self.setting == compression_methods.NONE:
            return self.decide(fp32_bytes(numel))
        if _dtype_name(dtype) not in FLOAT_DTYPES:
            return Decision(compression_methods.NONE, f"{_dtype_name(dtype)} is reduced in full precision")
        if numel == 0:
            return Decision(compression_methods.NONE, "an empty bucket: nothing to send")
        if self.comm.size == 1:
            return Decision(compression_methods.NONE, "one rank: nothing to send")
        return self.decide(fp32_bytes(numel))

    def decide_auto(self, nbytes: int, behind_us: float = 0.0) -> Decision:
        """auto's Decision for ``nbytes`` with ``behind_us`` of backward known to follow the call
        (uncached): the table's if the communicator's has a compression section, else the cost
        model's on the link probed at first use (collective)."""
        lv = self.levels
        table = getattr(getattr(self.comm, "planner", None), "table", None)
        section = getattr(table, "compression", None) if table is not None else None
        d = auto_compression.from_table(section, nbytes, lv.hosts, behind_us=behind_us) if section else None
        if d is None:
            if lv.hosts > 1 and lv.uniform and self._speeds is None:
                self._speeds = auto_compression.probe(lv)
            link, speed = self._speeds or (None, None)
            d = auto_compression.decide(nbytes, lv.hosts, lv.local_size, link, speed, uniform=lv.uniform,
                                        block=self.block, behind_us=behind_us)
        return d

    def explain(self, nbytes: int) -> str:
        """One line: what an ``nbytes`` bucket is sent with, and why."""
        d = self.decide(nbytes)
        return f"{nbytes} B: {d.method} between hosts ({d.reason})" if self._per_level(d.method) \
            else f"{nbytes} B: {d.method} ({d.reason})"

    # -- the allreduce ---------------------------------------------------------------------------
    def reduce(self, tensor, key, method: str, op: str = "avg", async_op: bool = False):
        """Allreduce ``tensor`` (a CPU torch tensor, or a writable C-contiguous NumPy array) in
        place with ``method`` (as ``decide`` chose it), residuals under ``key``. Returns what the
        collective returns (a Work when ``async_op``)."""
        if method == compression_methods.NONE:  # async_op passed only when asked: a blocking call's signature
            return self.comm.allreduce(tensor, op=op, async_op=True) if async_op else self.comm.allreduce(tensor, op=op)
        if op not in ("avg", "sum"):
            raise ValueError(f"rank {self.comm.rank}: {self.who}: a compressed allreduce ({method!r}) averages or "
                             f"sums (op 'avg' or 'sum'), got op {op!r}")
        t = tensor if isinstance(tensor, torch.Tensor) else torch_view(self.comm.rank, tensor)
        if self._per_level(method):
            worker = server = None
            if self.error_feedback:
                w, s = per_level.residual_sizes(self.levels, method, t.numel(), block=self.block)
                worker, server = self.residuals.get(key, "per-level " + method, w, s)
            return per_level.allreduce(self.levels, t, method=method, op=op, block=self.block, residual=worker,
                                       server_residual=server, async_op=async_op)
        row = compression_methods.get(method)
        worker = server = None
        if self.error_feedback and row.worker_residual:
            server_n = None
            if row.server_residual:  # it covers this rank's chunk (compressed.chunk_bounds)
                a, b = chunk_bounds(t.numel(), self.comm.size, row.align(self.block))[self.comm.rank]
                server_n = b - a
            worker, server = self.residuals.get(key, method, t.numel(), server_n)
        return row.run(self.comm, t, op=op, block=self.block, residual=worker, server_residual=server,
                       async_op=async_op)

    def reduce_list(self, arrays, op: str, bucket_bytes: int, empty=None) -> tuple[list[np.ndarray], list[str]]:
        """Every NumPy array of ``arrays`` (the same shapes and dtypes on every rank) reduced with
        ``op``, fused into buckets (buckets.py), one collective per bucket, decided by
        ``decide_bucket``; residuals keyed by the bucket's index. ``empty(n, dtype)`` allocates a
        bucket (default NumPy's). Returns (the results, views of the buckets, in order; each
        bucket's method)."""
        out: list = [None] * len(arrays)
        arrays = [np.asarray(a) for a in arrays]
        plan = buckets.plan([a.dtype for a in arrays], [a.nbytes for a in arrays], bucket_bytes)
        methods = []
        for index, members in enumerate(plan):
            total = sum(arrays[i].size for i in members)
            dtype = arrays[members[0]].dtype
            buf = np.empty(total, dtype=dtype) if empty is None else empty(total, dtype)
            o = 0
            for i in members:  # the call's one copy: into the bucket, which becomes the result
                buf[o: o + arrays[i].size] = arrays[i].reshape(-1)
                o += arrays[i].size
            method = self.decide_bucket(total, dtype).method
            self.reduce(buf, index, method, op=op)
            methods.append(method)
            o = 0
            for i in members:
                out[i] = buf[o: o + arrays[i].size].reshape(arrays[i].shape)
                o += arrays[i].size
        return out, methods

    # -- state -----------------------------------------------------------------------------------
    def reset_residuals(self) -> None:
        """Forget every residual (a world change, a checkpoint load)."""
        self.residuals.clear()

    def close(self, *how) -> None:
        """Close the per-level groups (never ``comm``; ``how``: farewell.py's Leaving)."""
        if self._levels is not None:
            self._levels.close(*how)
            self._levels = None

    # -- private ---------------------------------------------------------------------------------
    def _per_level(self, method: str) -> bool:
        return method != compression_methods.NONE and (self.setting == compression_methods.AUTO
                                                       or self.named == "levels")

    def _decide(self, nbytes: int) -> Decision:
        if self.setting == compression_methods.NONE:
            return Decision(compression_methods.NONE, "compression is off (none)")
        if self.setting == compression_methods.AUTO:
            return self.decide_auto(nbytes, 0.0)
        if self.named == "world":
            return Decision(self.setting, f"named: {self.setting}")
        lv = self.levels
        if lv.hosts == 1 or not lv.uniform:  # the rule's reason: one host, or no per-level groups
            return auto_compression.decide(nbytes, lv.hosts, lv.local_size, None, None, uniform=lv.uniform)
        return Decision(self.setting, f"named: {self.setting}")


def _dtype_name(dtype) -> str:
    """A torch, NumPy (ml_dtypes) or TensorFlow dtype, a NumPy scalar type, or a name, as its name."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str):
        return dtype
    name = getattr(dtype, "name", None)
    if isinstance(name, str):  # np.dtype, tf.DType
        return name
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)
