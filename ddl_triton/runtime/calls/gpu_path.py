"""The GPU path of a communicator: executors and transports for CUDA tensors.

Semantics: a collective on CUDA tensors computes exactly what the CPU path computes (same
schedules, same reduction order, same kernels' semantics) and returns once its result is
in the tensors, like the CPU path. Within the call everything is stream-ordered on the
current torch stream: the reductions are the Triton kernels, the chunk steps are queued
without a host synchronisation per chunk, and the only host wait is the transports'
end-of-collective check (an event polled against the deadline, see transports/nvshmem.py),
plus what MPI staging needs (transports/mpi_device.py).

Transports, per peer, for CUDA tensors:
- same node: NVSHMEM (peers' symmetric buffers read in place by the kernels) when
  nvshmem4py is importable, the communicator spans every rank of its node, and
  ``Options.transport`` is not "mpi"; otherwise MPI.
- other nodes: MPI, host-staged through pinned buffers, or with the device buffers
  themselves when ``Options.mpi_cuda_aware`` is set.

Built on the first CUDA collective (a collective step: every rank reaches it at the same
call, which the call fingerprint, carrying "on CUDA", has just checked), for the device of
that tensor; a later CUDA tensor on another device is refused.
"""
from __future__ import annotations

import importlib.util

import torch

from ... import schedules
from .executor import Executor
from ...transports import waits
from ...transports.mpi_device import DeviceMpiTransport
from ...transports.self_transport import SelfTransport


def available() -> bool:
    """Whether CUDA tensors can be used at all in this process."""
    return torch.cuda.is_available()


def unavailable_reason(t: torch.Tensor) -> str:
    if t.is_cuda:
        return "torch.cuda.is_available() is False"
    return f"only CPU and CUDA tensors are supported, not {t.device.type}"


def nvshmem_importable() -> bool:
    return importlib.util.find_spec("nvshmem") is not None


class GpuPath:
    """Lazily built executor and transports of one communicator for one CUDA device.

    ``placement``: the communicator's (placement.py); ``options``: its options in force;
    ``control``: its private MPI communicator, which the device transports duplicate and split."""

    def __init__(self, placement, options, control):
        self._placement = placement
        self._options = options
        self._control = control
        self.device: torch.device | None = None
        self.transports: list = []
        self.intra_node = ""     # "nvshmem", "mpi" or "" (no peer on the node)
        self.why = ""            # why intra-node traffic takes MPI, when it does
        self._executor: Executor | None = None

    def executor(self, device: torch.device) -> Executor:
        if self._executor is None:
            self._build(device)
        elif device != self.device:
            raise ValueError(f"rank {self._placement.rank}: this communicator runs on {self.device}; "
                             f"a tensor on {device} needs its own communicator")
        return self._executor  # type: ignore[return-value]

    def run(self, schedule, inbuf: torch.Tensor, outbuf: torch.Tensor, run_dtype: torch.dtype, ctx, seq: int,
            record, tracer) -> None:
        """Run ``schedule`` on CUDA tensors (``Executor.run_widened``), labelling ``record``'s steps.
        With a ``tracer``, the call is also a span timed by CUDA events, resolved when the trace
        is written (no host synchronisation added). The tracer's span has not yet run on a GPU."""
        executor = self.executor(inbuf.device)
        executor.record, executor.tracer = record, tracer
        if schedule.native:
            # The GPU transports have no allreduce engine of their own: rather than the group steps'
            # stand-in, run hierarchical, which pipelines the same phases across the levels.
            schedule = schedules.build("hierarchical", schedule.collective, schedule.nranks, schedule.in_count,
                                       chunk_elems=schedule.params["chunk_elems"], grid=schedule.params["dims"])
        if tracer is None:
            executor.run_widened(schedule, inbuf, outbuf, ctx, seq, run_dtype)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        executor.run_widened(schedule, inbuf, outbuf, ctx, seq, run_dtype)
        end.record()
        info = record.to_json()
        tracer.cuda_span(f"{info['collective']} #{record.seq} (GPU)", start, end,
                         {"schedule": schedule.name, "bytes": info["bytes"]})

    def _build(self, device: torch.device) -> None:
        place, opts = self._placement, self._options
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        size, rank = place.size, place.rank
        nvshmem = None
        if size == 1 and opts.transport != "nvshmem":
            loop = SelfTransport()
            self.transports = [loop]
            self._executor = Executor(rank, size, [loop], timeout=opts.timeout, depth=opts.pipeline_depth)
            return
        mpi = DeviceMpiTransport(self._control.Dup(), device, cuda_aware=opts.mpi_cuda_aware)
        self.transports.append(mpi)
        on_node = list(place.on_node)
        if opts.transport == "mpi":
            self.why = "Options.transport is 'mpi'"
        elif not nvshmem_importable():
            self.why = "nvshmem4py is not installed"
        elif place.max_ranks_per_node == 1 and opts.transport != "nvshmem":
            # Decided from the whole layout, not this node alone: opening NVSHMEM is collective.
            self.why = "no node holds more than one rank"
        else:
            nvshmem = self._open_nvshmem(on_node, device)
        if nvshmem is None and opts.transport == "nvshmem":
            raise ValueError(f"rank {rank}: DDL_TRANSPORT=nvshmem but NVSHMEM cannot be used: {self.why}")
        if nvshmem is not None:
            self.transports.append(nvshmem)
            # Every wait (the NVSHMEM stream's in flush included) posts the MPI sends whose copies
            # are done: a peer whose stream waits for one holds back the NVSHMEM signal we wait for.
            waits.progress_hooks.append(mpi.post_ready_sends)
        self.intra_node = "" if len(on_node) == 1 else ("nvshmem" if nvshmem is not None else "mpi")
        intra = nvshmem or mpi
        route = [SelfTransport()] if size == 1 else \
            [None if p == rank else intra if p in on_node else mpi for p in range(size)]
        self._executor = Executor(rank, size, route, timeout=opts.timeout, depth=opts.pipeline_depth,
                                  transports=self.transports)

    def _open_nvshmem(self, on_node: list[int], device: torch.device):
        """NVSHMEM over this node's ranks, or None (with ``why``) where it cannot serve.
        Collective over the communicator: every rank takes the same branch."""
        from mpi4py import MPI
        from ...transports.nvshmem import NvshmemTransport
        from ..setup.bootstrap_values import checked, mpi_allgather
        place, opts = self._placement, self._options
        node = self._control.Split(place.node_of_rank[place.rank], place.rank)
        try:
            world_of_node = [checked(w, int, f"node rank {i}'s world rank", place.rank) for i, w in
                             enumerate(mpi_allgather(node, MPI.COMM_WORLD.Get_rank(), opts.timeout, "NVSHMEM's node"))]
            return NvshmemTransport(node, on_node, slot_bytes=opts.chunk_bytes,
                                    depth=opts.pipeline_depth, device=device,
                                    world_ranks=world_of_node)
        except ValueError as e:  # e.g. a sub-communicator that does not span its node
            self.why = str(e)
            return None
        finally:
            node.Free()

    def close(self) -> None:
        for t in self.transports:
            hook = getattr(t, "post_ready_sends", None)
            if hook is not None and hook in waits.progress_hooks:
                waits.progress_hooks.remove(hook)
            t.close()
        self.transports = []
        self._executor = None
