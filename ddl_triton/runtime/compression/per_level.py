"""Per-level compression: full precision over shm inside a host, compressed bytes only between hosts.

``allreduce(levels, tensor, method=...)`` averages (or sums) a float tensor over every rank of a
communicator in three phases, the middle one lossy:

    1. reduce_scatter inside the host, fp32 over shm   rank (h, l) holds shard l of host h's sum
    2. compressed allreduce of shard l among the ranks   int8 blocks or 1-bit, with error feedback:
       with local index l on every host (h = 0..H-1)     ``compressed.allreduce_int8`` / ``_onebit``
    3. all_gather inside the host, fp32 over shm         every rank holds every (reduced) shard

(H hosts of L ranks each; a "host" is a node of ``comm.placement``, so ``DDL_TOPOLOGY=2x2``
emulates two.) Only phase 2 loses precision, and it loses it once per shard: the result is the
same on every rank, bit for bit, because the ranks of a host gather the same fp32 shards and the
H ranks of each cross group decompress the same bytes (compressed.py). For op "avg", phase 2
averages over hosts and the shard is then multiplied by fp32(1/L), before the gather.

Bytes each rank sends, N elements (S = 4N fp32 bytes), shard C = ceil(N / L) elements:

    phase   link              bytes (payload, ``comm.transport_bytes``)
    1       shm (intra-host)  (L-1) * 4C  ~ (L-1)/L * S      } fp32: 2(L-1)/L * S over shm,
    3       shm (intra-host)  (L-1) * 4C  ~ (L-1)/L * S      } as a full-precision allreduce's
    2       inter-host        ``compressed.wire_bytes(method, C, H)``:
                              int8   ~ 2(H-1)/H * C * (1 + 4/block)   (3.94x fewer than fp32 at block 256)
                              onebit ~ 2(H-1)/H * C / 8               (~32x fewer)

against 2(H-1)/H * 4C for the same phase in fp32: the slow link carries a quarter (int8) or a
thirty-second (1-bit) of its fp32 bytes, while shm, where compression only costs time, carries
fp32. Error feedback lives at phase 2: the worker residual holds C elements (1/L of the tensor),
the 1-bit server residual the cross rank's chunk of the shard (``residual_sizes``).

Edge cases:
- one host (H = 1): no link to save bytes on, so it never compresses: a plain fp32
  ``comm.allreduce``, and ``residual_sizes`` is (0, None);
- one rank per host (L = 1): phase 2 alone, over the world (``compressed`` on ``comm`` itself);
- hosts holding unequal rank counts: ``Levels`` builds no groups and ``allreduce`` raises
  ValueError naming the rank and the counts (the cross groups would pair shards of different
  sizes); callers that choose for themselves (``auto``) fall back to full precision.

Asynchrony: with ``async_op=True`` it returns a Work once phases 1 and 3 are issued on the host's
communicator. Phase 2 runs (synchronously, on the cross communicator) in phase 1's done-callback,
which the host communicator's queue runs before it starts phase 3, so phase 3 always gathers the
reduced shards. Issue the calls on one Levels in the same order on every rank, as any
collective. Phase 2 holds the host communicator's queue while it runs: a later call's phase 1
waits for it (the slow link is the bottleneck either way).

Example (2 hosts x 2 ranks: ranks 0, 1 on host 0; op "avg", int8, no residual): rank r holds
[r, -r, 2r]. Phase 1: host sums [1, -1, 2] and [5, -5, 10]; rank (h, 0) holds shard [x0, x1],
rank (h, 1) shard [x2, 0] (padded). Phase 2 averages each shard over the hosts in int8:
[3, -3] and [6, 0], times 1/L = 1/2 -> [1.5, -1.5] and [3.0, 0]. Phase 3: every rank
[1.5, -1.5, 3.0] (exact here; in general each element within compressed.py's int8 bound).
"""
from __future__ import annotations

import torch

from . import compressed
from .layout import chunk_bounds
from ... import compression_methods
from ..calls.work import Work

__all__ = ["Levels", "allreduce", "residual_sizes", "wire_bytes"]


class Levels:
    """The two groups of a communicator's ranks the per-level allreduce runs on.

    ``hosts`` (H) and ``local_size`` (L): nodes of ``comm.placement`` and ranks per node;
    ``uniform``: every node holds L ranks. With H > 1 and L > 1 (and uniform), ``node`` is a
    Communicator of this rank's node (shm) and ``cross`` one of the ranks with this rank's local
    index on every node (the inter-node transport only: ``transport="mpi"``, which is gloo on a
    store bootstrap); with H == 1, ``node`` is ``comm`` and ``cross`` None; with L == 1, ``cross``
    is ``comm`` and ``node`` None. Building it is collective over ``comm`` (every rank, same
    point): it drains ``comm``'s queue with a barrier, then splits ``comm.bootstrap`` twice.
    ``close()`` closes the communicators it made (never ``comm``).
    Example: 4 ranks, DDL_TOPOLOGY=2x2 -> rank 3: hosts 2, local_size 2, host_index 1,
             local_rank 1, node = ranks {2, 3}, cross = ranks {1, 3}.
    """

    def __init__(self, comm):
        # The groups are communicators of comm's own kind: made through its type, so that this room
        # never imports the communicator that composes it (runtime/__init__.py: rooms import downwards).
        Communicator = type(comm)
        self.comm = comm
        p = comm.placement
        nodes = sorted(set(p.node_of_rank))
        counts = [p.node_of_rank.count(n) for n in nodes]
        self.hosts = len(nodes)
        self.local_size = len(p.on_node)
        self.host_index = nodes.index(p.node_of_rank[comm.rank])
        self.local_rank = p.on_node.index(comm.rank)
        self.uniform = len(set(counts)) == 1
        self.counts = tuple(counts)
        self.node = self.cross = None
        self._owned: list = []
        if not self.uniform:
            return
        if self.hosts == 1:
            self.node = comm
        elif self.local_size == 1:
            self.cross = comm
        else:
            comm.barrier()  # nothing of comm's may run on its control channel while the bootstrap splits
            # A table named by DDL_TUNING_FILE was measured for comm's shape, not these groups': they
            # would only warn that it does not fit. The cache still serves them where it has their shape.
            tuning = "off" if comm.options.tuning_file else ""
            node_boot = comm.bootstrap.split(self.host_index)
            cross_boot = comm.bootstrap.split(self.local_rank)
            self.node = Communicator(node_boot, comm.options.replace(topology="", tuning_file=tuning))
            self._owned.append(self.node)
            self.cross = Communicator(cross_boot, comm.options.replace(topology="", transport="mpi",
                                                                       tuning_file=tuning))
            self._owned.append(self.cross)

    @property
    def cross_rank(self) -> int:
        """This rank's index among the ranks of its cross group (its host's index)."""
        return self.host_index if self.local_size > 1 else self.comm.rank

    def shard_bounds(self, numel: int) -> tuple[int, int]:
        """[start, stop) of the tensor this rank's shard covers (phase 2 compresses it)."""
        c = _shard(numel, self.local_size)
        return min(self.local_rank * c, numel), min((self.local_rank + 1) * c, numel)

    @property
    def owned(self) -> tuple:
        """The communicators this Levels made (``node`` and ``cross`` when it split ``comm``; none
        when they are ``comm`` itself): their ``transport_bytes`` count the per-level calls' bytes."""
        return tuple(self._owned)

    def close(self, *how) -> None:
        """Close the level communicators made here (``how``: how this rank leaves them, farewell.py)."""
        for c in self._owned:
            c.close(*how)
        self._owned.clear()

    def __repr__(self) -> str:
        return (f"Levels(rank={self.comm.rank}, hosts={self.hosts}, local_size={self.local_size}, "
                f"uniform={self.uniform})")


def residual_sizes(levels: Levels, method: str, numel: int, *, block: int = 256) -> tuple[int, int | None]:
    """(worker, server) residual elements ``allreduce`` needs for ``method`` on ``numel`` elements:
    the worker residual covers the shard (C = ceil(numel / L) elements, padded) for a method that
    keeps one (its row's ``worker_residual``; else 0), the server residual (a row with
    ``server_residual``, as 1-bit; else None) the cross rank's chunk of it. (0, None) on one host.
    Example: 2x2 hosts, onebit, 1000 elements -> C = 500, chunks of 512: (500, 500) on host 0,
             (500, 0) on host 1."""
    row = _check_method(levels, method)
    if levels.hosts == 1 or numel == 0 or not row.worker_residual:
        return 0, None
    c = _shard(numel, levels.local_size) if levels.local_size > 1 else numel
    if not row.server_residual:
        return c, None
    a, b = chunk_bounds(c, levels.hosts, row.align(block))[levels.cross_rank]  # the server residual is chunk-sized
    return c, b - a


def wire_bytes(levels: Levels, method: str, numel: int, *, block: int = 256) -> dict[str, int]:
    """Payload bytes one rank sends per level for one call: {"intra": ..., "inter": ...}, the
    intra figure as a bandwidth-optimal fp32 reduce_scatter + all_gather sends (the node's
    schedule may publish more on shm, see HookState.sent_bytes).
    Example: 2x2 hosts, int8, 1 << 20 elements -> intra 2 * 1 * 4 * 524288 = 4_194_304,
             inter compressed.wire_bytes("int8", 524288, 2) = 4 * (131072 + 2048) = 532_480."""
    _check_method(levels, method)
    L, H = levels.local_size, levels.hosts
    c = _shard(numel, L) if numel else 0
    intra = 2 * (L - 1) * 4 * c if H > 1 else 2 * (L - 1) * 4 * -(-numel // L)
    inter = compressed.wire_bytes(method, c, H, block=block) if H > 1 and numel else 0
    return {"intra": intra if L > 1 else 0, "inter": inter}


def allreduce(levels: Levels, tensor: torch.Tensor, *, method: str = compression_methods.DEFAULT, op: str = "avg",
              block: int = 256, residual: torch.Tensor | None = None, server_residual: torch.Tensor | None = None,
              async_op: bool = False):
    """Allreduce ``tensor`` in place: fp32 inside each host, ``method`` between hosts (module doc).

    tensor: float32/float16/bfloat16 on the CPU. method: a method of ddl_triton/compression_methods.py
    (``compression_methods.names()``; default its ``DEFAULT``, int8). op: "avg" or "sum".
    block: the int8 quantization block. residual / server_residual: fp32 error feedback of
    ``residual_sizes`` elements, updated in place (None: no error feedback on that side).
    Returns ``tensor``, or a Work resolving to it. On one host, a plain fp32 ``comm.allreduce``.
    Example (2x2 hosts, int8, "avg"): rank r holds [r, -r, 2r] -> every rank [1.5, -1.5, 3.0].
    """
    comm = levels.comm
    _check_method(levels, method)
    if not levels.uniform:
        raise ValueError(f"rank {comm.rank}: per-level allreduce needs the same number of ranks on every host, "
                         f"got {list(levels.counts)} ranks on the {levels.hosts} hosts")
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"rank {comm.rank}: per-level allreduce: tensor must be a float32, float16 or bfloat16 "
                        f"torch.Tensor, got {getattr(tensor, 'dtype', type(tensor).__name__)}")
    if not tensor.is_cpu:
        raise ValueError(f"rank {comm.rank}: per-level allreduce: tensor is on {tensor.device}; it runs on CPU "
                         "tensors (the shm phases are host memory)")
    if op not in ("avg", "sum"):
        raise ValueError(f"rank {comm.rank}: per-level allreduce: op must be 'avg' or 'sum', got {op!r}")
    if levels.hosts == 1:  # shm alone: nothing to save bytes on
        return comm.allreduce(tensor, op=op, async_op=async_op)
    worker_n, server_n = residual_sizes(levels, method, tensor.numel(), block=block)
    for name, res, n in (("residual", residual, worker_n), ("server_residual", server_residual, server_n)):
        if res is not None and (not isinstance(res, torch.Tensor) or res.dtype != torch.float32
                                or res.numel() != n or not res.is_contiguous()):
            raise ValueError(f"rank {comm.rank}: per-level allreduce: {name} must be a contiguous fp32 tensor "
                             f"of {n} elements (residual_sizes), got {getattr(res, 'shape', res)!r}")
    if worker_n == 0:  # the method keeps no error feedback: an empty residual stands for none
        residual = None
    if levels.local_size == 1:  # one rank per host: the compressed allreduce over the world
        return _compress(levels.cross, tensor, method, op, block, residual, server_residual, async_op)
    return _three_phases(levels, tensor, method, op, block, residual, server_residual, async_op)


# -- private ----------------------------------------------------------------------------------
def _three_phases(levels, tensor, method, op, block, residual, server_residual, async_op):
    n, L = tensor.numel(), levels.local_size
    result = Work(f"per-level allreduce({op}, {n} x {tensor.dtype}, {method} between {levels.hosts} hosts)")
    if n == 0:
        result.set_result(tensor)
        return result if async_op else tensor
    c = _shard(n, L)
    full = torch.zeros(L * c, dtype=torch.float32)  # fp32 on shm, whatever the tensor's dtype; zero padding
    full[:n].copy_(tensor.reshape(-1))
    shard = torch.empty(c, dtype=torch.float32)
    failed: list[BaseException] = []
    inv_local = torch.tensor(1.0 / L, dtype=torch.float32) if op == "avg" else None

    def between_hosts(work) -> None:  # on the node's queue thread, before it starts the all_gather
        try:
            work.wait()
            _compress(levels.cross, shard, method, op, block, residual, server_residual, False)
            if inv_local is not None:
                shard.mul_(inv_local)
        except BaseException as e:  # noqa: BLE001 - delivered through result; never raised into the queue
            failed.append(e)

    def finish(work) -> None:
        try:
            if failed:
                raise failed[0]
            work.wait()
            tensor.copy_(full[:n].view(tensor.shape))
        except BaseException as e:  # noqa: BLE001
            result.set_exception(e)
        else:
            result.set_result(tensor)

    levels.node.reduce_scatter(shard, full, op="sum", async_op=True).add_done_callback(between_hosts)
    levels.node.all_gather(full, shard, async_op=True).add_done_callback(finish)
    return result if async_op else result.wait()


def _compress(comm, tensor, method, op, block, residual, server_residual, async_op):
    return compression_methods.get(method).run(comm, tensor, op=op, block=block, residual=residual,
                                               server_residual=server_residual, async_op=async_op)


def _shard(numel: int, local_size: int) -> int:
    return max(1, -(-numel // local_size))


def _check_method(levels: Levels, method: str):
    """The row of ``method``; an unknown one raises naming the rank and the valid methods."""
    try:
        return compression_methods.get(method)
    except ValueError:
        raise ValueError(f"rank {levels.comm.rank}: per-level compression method must be one of "
                         f"{', '.join(compression_methods.names())}, got {method!r}") from None
