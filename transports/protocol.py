"""The transport protocol: the calls every transport answers, whatever moves its bytes.

A transport moves numbered messages between ranks. The executor calls, for a
message ``msg_id`` (numbered per sender, increasing for the communicator's life):

    sender                                      receiver
    buf = acquire(msg_id, peers, count, dtype)  prefetch(peer, msg_id, count, dtype)  # optional, early
    ...fill buf (reduce straight into it)...    view = recv(peer, msg_id, count, dtype, timeout,
                                                            offset, size)   # waits; [offset, offset+count)
    publish(msg_id)                             ...read view...
                                                release(peer, msg_id)             # the slot may be reused
    flush()        at the end of a collective: every send complete

One-sided transports (shm) hand out views of a peer-readable slot, so a
reduction can write straight into what the peer reads. Two-sided ones (MPI)
hand out pooled staging buffers and post Isend/Irecv. Waits inside these calls follow
waits.py; which transport serves which pair of ranks is table.py.
"""
from __future__ import annotations

from typing import Protocol

import torch


class Transport(Protocol):
    name: str
    spin: float  # seconds a wait spins before yielding (see wait_until)
    # What the executor does for this transport (ddl_triton/runtime/calls/executor.py), by capability:
    completes_sends: bool  # its sends finish after publish: flush at the end of every collective
    posts_receives_early: bool  # a receive posted ahead lets data land sooner: prefetch a window ahead
    # It runs group steps (schedules/native.py) with an allreduce engine of its own: then
    # ``allreduce_group`` exists. Transports without the attribute have none; the executor runs
    # the group steps' point-to-point stand-in on them instead (native.expand).
    has_group_allreduce: bool
    bytes_sent: int
    bytes_received: int

    def acquire(self, msg_id: int, peers: tuple[int, ...], count: int, dtype: torch.dtype,
                timeout: float) -> torch.Tensor: ...

    def publish(self, msg_id: int) -> None: ...

    def prefetch(self, peer: int, msg_id: int, size: int, dtype: torch.dtype) -> None: ...

    def recv(self, peer: int, msg_id: int, count: int, dtype: torch.dtype, timeout: float,
             offset: int = 0, size: int = 0) -> torch.Tensor: ...

    def release(self, peer: int, msg_id: int) -> None: ...

    def flush(self, timeout: float) -> None: ...

    def allreduce_group(self, group: tuple[int, ...], tensor: torch.Tensor, op: str, timeout: float) -> None:
        """Reduce ``tensor`` in place among the ranks of ``group`` (sorted, this one included) with
        ``op`` ("sum", "min", "max"); every member gets the same bits. PeerTimeout past ``timeout``
        seconds, or at once when a member is known dead."""

    def close(self) -> None: ...
