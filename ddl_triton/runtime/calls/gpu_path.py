"""The GPU path of a communicator: executors and transports for CUDA tensors.

Semantics: a collective on CUDA tensors computes exactly what the CPU path computes (same
schedules, same reduction order, same kernels' semantics) and returns once its result is
in the tensors, like the CPU path. Within the call everything is stream-ordered on the
current torch stream: the reductions are the Triton kernels, the chunk steps are queued
without a host synchronisation per chunk, and the only host wait is the transports'
end-of-collective check (an event polled against the deadline, see transports/nvshmem.py),
plus what MPI staging needs (transports/mpi_device.py).

Transports, per peer, for CUDA tensors: the transport table's choice (transports/table.py),
which as it stands gives
- same node: NVSHMEM (peers' symmetric buffers read in place by the kernels) when
  nvshmem4py is importable, the communicator spans every rank of its node, and
  ``Options.transport`` is not "mpi"; otherwise MPI (the next row: a transport that cannot
  open after all leaves its pairs to the next row that can connect them);
- other nodes: MPI, host-staged through pinned buffers, or with the device buffers
  themselves when ``Options.mpi_cuda_aware`` is set;
- a world of one: itself, unless ``Options.transport`` is "nvshmem".
MPI, the row between nodes, is opened on every communicator of several ranks. A transport
that ``Options.transport`` names (beside that row: "nvshmem") must serve: where it cannot,
the first CUDA collective raises a ValueError saying why, on every rank.

Built on the first CUDA collective (a collective step: every rank reaches it at the same
call, which the call fingerprint, carrying "on CUDA", has just checked), for the device of
that tensor; a later CUDA tensor on another device is refused.
"""
from __future__ import annotations

import torch

from ... import schedules
from .executor import Executor
from ...transports import table, waits


def available() -> bool:
    """Whether CUDA tensors can be used at all in this process."""
    return torch.cuda.is_available()


def unavailable_reason(t: torch.Tensor) -> str:
    if t.is_cuda:
        return "torch.cuda.is_available() is False"
    return f"only CPU and CUDA tensors are supported, not {t.device.type}"


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
        size, rank, kind = place.size, place.rank, place.bootstrap_kind
        nodes, hosts = place.node_of_rank, place.host_of_rank
        opening = table.Opening(place, opts, control=self._control, device=device, gather_ints=self._gather_ints)
        failed: dict[str, str] = {}  # rows opened that could not serve: why
        rows = table.to_open(rank, nodes, hosts, opts, kind, "cuda")
        # Options.transport naming a transport other than the row between nodes ("nvshmem"): it must
        # serve, a world of one included; the loopback of a world of one needs nothing else.
        required = table.named(opts.transport, "cuda")
        if required is not None and (required == rows[0] or rows[0].name == "self"):
            required = None
        mates = table.Pair.node_mates(size, place.max_ranks_per_node)
        if required is not None and required not in rows and required.can_connect(mates, opts, kind):
            rows.append(required)
        for row in rows:  # the row between nodes first; every rank opens the same rows, in one order
            try:
                opening.opened[row.name] = row.open(opening)
            except table.CannotOpen as e:
                failed[row.name] = str(e)
        self.transports = list(opening.opened.values())
        if rows[0].name == "self":  # a world of one, on the loopback
            self._executor = Executor(rank, size, self.transports, timeout=opts.timeout, depth=opts.pipeline_depth)
            return
        self.why = table.why_not_preferred(mates, opts, kind, "cuda", failed)
        if required is not None and required.name not in opening.opened:
            raise ValueError(f"rank {rank}: DDL_TRANSPORT={opts.transport} but "
                             f"{required.name.upper()} cannot be used: {self.why}")
        if len(self.transports) > 1:
            # Every wait (the NVSHMEM stream's in flush included) posts the MPI sends whose copies
            # are done: a peer whose stream waits for one holds back the NVSHMEM signal we wait for.
            for t in self.transports:
                if hasattr(t, "post_ready_sends"):
                    waits.progress_hooks.append(t.post_ready_sends)
        links = table.links(rank, nodes, hosts, opts, kind, "cuda", failed)
        intra = {links[p].name for p in place.on_node if p != rank}
        self.intra_node = intra.pop() if intra else ""  # "nvshmem", "mpi" or "" (no peer on the node)
        route = [table.named("self", "cuda").open(opening)] if size == 1 else \
            [None if p == rank else opening.opened[links[p].name] for p in range(size)]
        self._executor = Executor(rank, size, route, timeout=opts.timeout, depth=opts.pipeline_depth,
                                  transports=self.transports)

    def _gather_ints(self, comm, value: int, what: str) -> list[int]:
        """Every rank's int ``value`` over the MPI communicator ``comm``, bounded by the deadline and
        checked (an opener's collective: NVSHMEM's node ranks)."""
        from ..setup.bootstrap_values import checked, mpi_allgather
        rank = self._placement.rank
        return [checked(v, int, f"{what}: rank {i}'s value", rank)
                for i, v in enumerate(mpi_allgather(comm, value, self._options.timeout, what))]

    def close(self) -> None:
        for t in self.transports:
            hook = getattr(t, "post_ready_sends", None)
            if hook is not None and hook in waits.progress_hooks:
                waits.progress_hooks.remove(hook)
            t.close()
        self.transports = []
        self._executor = None
