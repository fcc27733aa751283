"""The pseudo-gradient average over the outer group: what crosses the slow link, and how.

Two ways to say what a replica is (``replicas``):

``"ranks"`` (the default): every rank is a replica (no per-step reduction inside a host). The
  fragment's pseudo-gradient is averaged over every rank of ``comm`` by the gradient floor's
  per-level path (``gradients.Reducer`` with named methods run per level,
  ddl_triton/runtime/compression/per_level.py): reduce_scatter inside each host over shm, the
  shard averaged across hosts by the ranks of one local index (compressed there when
  ``compression`` names a method), all_gather inside the host. So each host moves about one
  pseudo-gradient across the slow link, not one per rank. On one host it is a full-precision
  allreduce (no link to save bytes on); on one rank per host, the method over the world.
``"hosts"``: the ranks of a host are one replica, kept identical between syncs by per-step
  gradient reduction inside the host (DDP over ``ddl_triton.torch.host_group()``). Local rank l
  averages shard l of the pseudo-gradient across hosts with the ranks of local index l (the
  per-level groups' ``cross`` communicator; compressed when ``compression`` names a method), then
  the host's ranks all_gather the shards over shm: the same link bytes as above, and no
  reduce_scatter. Before that, the host's ranks compare a CRC32 of their pseudo-gradient (one
  8-byte shm allreduce): ranks of one host that are not identical get a ValueError naming the rank
  (DDP over the host group was left out), instead of a silently mixed average.

Every rank ends with the same bits: the floor's collectives give every rank the same result, and
the host's all_gather copies the same shards. Error feedback (a method's residual) is kept per
fragment (the key) in the reducer's ``gradients.Residuals``.

A call is split in two, ``start`` (issued asynchronously, so that it overlaps the inner steps of
``fragment_sync_delay``) and ``finish`` (waits, gathers, returns the average).
"""
from __future__ import annotations

import zlib

import torch

from .. import compression_methods
from ..gradients import Reducer
from ..runtime.compression import per_level

__all__ = ["REPLICAS", "OuterAverage"]

REPLICAS = ("ranks", "hosts")


class _Pending:
    """One fragment's average in flight: the work, the tensor it fills, the shard to gather."""

    def __init__(self, flat, work, shard=None):
        self.flat, self.work, self.shard = flat, work, shard


class OuterAverage:
    """Averages of fp pseudo-gradients over ``comm``'s replicas (module doc). ``setting``: "none" or
    a method of ddl_triton/compression_methods.py; ``block``, ``error_feedback``: the reducer's."""

    def __init__(self, comm, setting: str, replicas: str = "ranks", *, block: int = 256, error_feedback: bool = True):
        rank = comm.rank
        if replicas not in REPLICAS:
            raise ValueError(f"rank {rank}: outer sync: replicas must be one of {', '.join(REPLICAS)}, "
                             f"got {replicas!r}")
        compression_methods.check_choice(setting, f"rank {rank}: outer sync compression")
        self.comm, self.setting, self.replicas = comm, setting, replicas
        self.levels = None
        self.reducer = None
        if replicas == "ranks":
            self.reducer = Reducer(comm, setting, named="levels", block=block, error_feedback=error_feedback,
                                   who="outer sync compression")
        else:
            self.levels = per_level.Levels(comm)  # collective: every rank builds it here
            if not self.levels.uniform:
                self.levels.close()
                raise ValueError(f"rank {rank}: outer sync: replicas='hosts' needs the same number of ranks on every "
                                 f"host, got {list(self.levels.counts)}")
            if self.levels.cross is not None:
                self.reducer = Reducer(self.levels.cross, setting, named="world", block=block,
                                       error_feedback=error_feedback, who="outer sync compression")

    @property
    def residuals(self):
        """The per-fragment error-feedback store (a ``gradients.Residuals``), or None where no
        average crosses hosts (one host with replicas='hosts')."""
        return self.reducer.residuals if self.reducer is not None else None

    @property
    def group_size(self) -> int:
        """How many replicas the average is over."""
        return self.comm.size if self.replicas == "ranks" else self.levels.hosts

    def start(self, flat: torch.Tensor, key) -> _Pending:
        """Begin averaging ``flat`` (a contiguous CPU float tensor, the same size on every rank) in
        place, error feedback under ``key``; collective, in the same order on every rank."""
        if self.replicas == "ranks":
            method = self.reducer.decide_bucket(flat.numel(), flat.dtype).method
            return _Pending(flat, self.reducer.reduce(flat, key, method, op="avg", async_op=True))
        self._check_host_identical(flat)
        lv = self.levels
        if self.reducer is None:  # one host: its ranks hold the one replica's pseudo-gradient
            return _Pending(flat, None)
        a, b = lv.shard_bounds(flat.numel())
        chunk = -(-flat.numel() // lv.local_size)
        shard = torch.zeros(chunk, dtype=flat.dtype)
        shard[: b - a] = flat[a:b]
        method = self.reducer.decide_bucket(shard.numel(), shard.dtype).method
        return _Pending(flat, self.reducer.reduce(shard, key, method, op="avg", async_op=True), shard)

    def finish(self, pending: _Pending) -> torch.Tensor:
        """Wait for ``pending`` and return its tensor, now the average (the same bits on every rank)."""
        if pending.work is not None:
            pending.work.wait()
        if pending.shard is None:
            return pending.flat
        lv = self.levels
        if lv.node is None:  # one rank per host: the shard is the whole tensor
            pending.flat.copy_(pending.shard[: pending.flat.numel()])
            return pending.flat
        every = torch.empty(pending.shard.numel() * lv.local_size, dtype=pending.shard.dtype)
        lv.node.all_gather(every, pending.shard)
        pending.flat.copy_(every[: pending.flat.numel()])
        return pending.flat

    def close(self) -> None:
        """Close the groups made here (never ``comm``)."""
        if self.reducer is not None:  # the groups its first use built, if any (never its communicator)
            self.reducer.close()
        if self.levels is not None:
            self.levels.close()
        self.reducer = self.levels = None

    def _check_host_identical(self, flat: torch.Tensor) -> None:
        node = self.levels.node
        if node is None or node.size == 1:
            return
        crc = zlib.crc32(flat.contiguous().view(torch.uint8).numpy()) if flat.numel() else 0
        both = torch.tensor([crc, -crc], dtype=torch.int64)
        node.allreduce(both, op="max")
        if int(both[0]) != -int(both[1]):
            raise ValueError(f"rank {self.comm.rank}: outer sync with replicas='hosts': the ranks of this host hold "
                             "different pseudo-gradients; keep them identical with per-step gradient reduction "
                             "inside the host (DDP over ddl_triton.torch.host_group())")
