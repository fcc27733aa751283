"""What the per-level compressed allreduce keeps between calls: torch's adapter of ddl_triton/gradients/.

The groups, the choices and the residuals are the framework-neutral reducer's
(ddl_triton/gradients/reducer.py, with named methods run per level); what is torch's own here is
the place of a call in backward (backward_position.py), fed to the reducer as ``behind_us``.

A :class:`LevelCompression` serves both ways in: ``hooks.auto_compress_hook`` (residuals keyed by
DDP's bucket index, in ``HookState``) and the "ddl" process group's allreduce under
``Options.compression`` (residuals keyed by the tensor's buffer, here: DDP's bucket buffers
persist across steps). For a call of ``nbytes`` it decides the inter-host method:

    setting   method between hosts
    a method  that method's row of ddl_triton/compression_methods.py (int8, int4, onebit, fp16, bf16, or
              one registered), with error feedback where the row keeps it (full precision on one
              host: nothing to save)
    "auto"    what ddl_triton/tuning/auto_compression.py decides for this size: the tuning table's
              ``compression`` section if the communicator's table has one, else the cost model
              on the link probed at first use

and runs ``ddl_triton.runtime.compression.per_level.allreduce``, or the communicator's own fp32 allreduce
when the method is "none". Its first use is collective (every rank, same point, as the first
compressed call always is): it builds the per-level groups (``per_level.Levels``) and, for
"auto" without a table, probes the link. Every rank then makes the same choices, because the
probe's figures (or the table) are the same everywhere.

Under "auto", an allreduce made from inside backward (a DDP bucket) is decided by its place in
backward too: once a backward pass with a call of that place and size has completed, the
backward time that followed it (ddl_triton/torch/backward_position.py; the smallest over the
ranks, by one collective 8-byte allreduce per place, made at the same call everywhere) goes to
the rule as ``behind_us``. A bucket whose link time hides behind the rest of backward then
stays in full precision, since compressing it would only add kernel time to the step; the last
bucket, with nothing behind it, is compressed where that pays. Until then (the first step, or the first
after DDP rebuilds its buckets) the call is decided by its size alone. A bucket that moves from a
compressed method to "none" drops its residual: one call's quantization error, once.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from .. import compression_methods
from ..gradients.reducer import Reducer
from ..runtime.compression import per_level
from .backward_position import BackwardPositions

# The option path compresses only tensors of at least this many bytes: DDP's buckets are 1 MiB
# and up (but for a small model's only or last one), while the small allreduces an application
# makes itself (losses, metrics, batch-norm statistics) expect exact results; and below it the
# link time int8 can save (~0.4 ms of 64 KiB at 1 Gbit/s) shrinks toward what compressing costs
# per call (and, beyond two hosts, the two-shot's extra latency-bound steps).
MIN_BYTES = 64 * 1024
# Residuals kept at most (least recently used dropped first): DDP's buckets are a few hundred at
# the most, while buffers an application allreduces once and frees would otherwise pile up.
MAX_KEYS = 256


class LevelCompression:
    """Per-level compression of one communicator's allreduces under ``setting`` (module doc): an
    adapter of the framework-neutral ``ddl_triton.gradients.Reducer`` (named methods per level),
    which adds the call's place in backward.

    ``block``: the int8 quantization block; ``error_feedback``: keep what compression lost
    and send it with the next call of the same key. ``decisions``: every size decided so far
    ({nbytes: tuning.auto_compression.Decision}); ``positioned``: the calls decided by their place in
    backward ({(place, nbytes): Decision}, module doc); ``residual_resets``: keys whose residual
    was dropped because the tensor under them changed size or method."""

    def __init__(self, comm, setting: str, *, block: int = 256, error_feedback: bool = True):
        compression_methods.check_choice(setting, f"rank {comm.rank}: compression")
        self.comm, self.setting = comm, setting
        self.reducer = Reducer(comm, setting, named="levels", block=block, error_feedback=error_feedback,
                               max_keys=MAX_KEYS, who="compression")
        self.block, self.error_feedback = self.reducer.block, self.reducer.error_feedback
        self.decisions = self.reducer.decisions
        self.positioned: OrderedDict = OrderedDict()
        self._positions = BackwardPositions()

    @property
    def levels(self) -> per_level.Levels:
        """The per-level groups (built at first use: collective)."""
        return self.reducer.levels

    @property
    def residual_resets(self) -> int:
        return self.reducer.residuals.resets

    @property
    def _speeds(self):
        """The probed link and compressors (None until "auto" probes)."""
        return self.reducer._speeds

    def takes(self, tensor: torch.Tensor, op: str) -> bool:
        """Whether the option path compresses this allreduce: a setting other than "none", an
        "avg" or "sum" of a float CPU tensor of at least MIN_BYTES."""
        return (self.setting != compression_methods.NONE and op in ("avg", "sum") and tensor.is_cpu
                and tensor.dtype in (torch.float32, torch.float16, torch.bfloat16)
                and tensor.numel() * tensor.element_size() >= MIN_BYTES)

    @property
    def groups(self) -> list:
        """The communicators the per-level groups added (none before first use, or where the groups
        are ``comm`` itself): their ``transport_bytes`` count the bytes of per-level calls."""
        return self.reducer.groups

    def decide(self, nbytes: int, calling: bool = False):
        """The inter-host method for an ``nbytes`` (fp32) allreduce, as a Decision with its reason.
        ``calling``: this is an allreduce being made (once per call): inside backward, "auto" then
        weighs its place there (module doc). Collective on first use, and at a place's first
        positioned decision."""
        place, behind = self._positions.observe(nbytes) if calling and self.setting == compression_methods.AUTO \
            else (None, None)
        if behind is not None and self.levels.hosts > 1 and self.levels.uniform:
            held = self.positioned.get(place)
            if held is None:
                held = self.positioned[place] = self.reducer.decide_auto(nbytes, self._agreed(behind))
                while len(self.positioned) > MAX_KEYS:
                    self.positioned.popitem(last=False)
            self.positioned.move_to_end(place)
            return held
        return self.reducer.decide(nbytes)

    def explain(self, nbytes: int) -> str:
        """One line: what an ``nbytes`` allreduce sends between hosts, and why (and, for calls
        decided by their place in backward, what each of that size sent)."""
        placed = [d for (_, n), d in self.positioned.items() if n == nbytes]
        if placed:
            return "; ".join(f"{nbytes} B: {d.method} between hosts ({d.reason})" for d in placed)
        d = self.decide(nbytes)
        return f"{nbytes} B: {d.method} between hosts ({d.reason})"

    def allreduce(self, tensor: torch.Tensor, key, method: str, op: str = "avg", async_op: bool = True):
        """Allreduce ``tensor`` in place with ``method``, as ``decide`` chose it for this call on
        the calling thread; residuals under ``key``."""
        return self.reducer.reduce(tensor, key, method, op=op, async_op=async_op)

    def residuals(self, key, method: str, numel: int):
        """(worker, server) error-feedback residuals under ``key``: zeros when new, or when the size or
        method under the key changed (counted in ``residual_resets``). At most MAX_KEYS are kept."""
        w, s = per_level.residual_sizes(self.levels, method, numel, block=self.block)
        return self.reducer.residuals.get(key, "per-level " + method, w, s)

    def _agreed(self, behind_us: float) -> float:
        """The smallest ``behind_us`` over the ranks (collective): every rank decides alike."""
        t = torch.tensor([behind_us], dtype=torch.float64)
        self.comm.allreduce(t, op="min")
        return float(t[0])

    def reset_residuals(self) -> None:
        self.reducer.reset_residuals()

    def close(self, *how) -> None:
        """Close the level communicators (``how``: how this rank leaves them, farewell.py's Leaving)."""
        self.reducer.close(*how)


def buffer_key(tensor: torch.Tensor) -> tuple:
    """The option path's residual key: the memory under the tensor, its size and dtype. DDP's
    bucket buffers live across steps, so each keeps its own residual; a different tensor that
    later occupies the same memory with the same size would inherit it (one call's worth of
    error, then corrected), which is why only DDP-sized tensors (MIN_BYTES) take this path."""
    return tensor.data_ptr(), tensor.numel(), tensor.dtype
