"""Transports: how messages move between ranks.

table.py: which transport connects two ranks, first preferred (NCCL's transport table); the
placement, the CPU wiring and the GPU path choose from it. protocol.py: the calls every transport
answers; waits.py: how any of them waits for a peer. The transports, one module each: shm (same
node, host memory, one-sided), mpi (any rank, two-sided), gloo (any rank, when MPI did not launch
the ranks), self_transport (a world of one), nvshmem (same node, CUDA memory), mpi_device (any
rank, CUDA memory through MPI). A new transport is its module and one row of the table
(docs/design.md, "Adding a transport").

Importing the package loads nothing heavy: the names below load their modules on first use.
"""
from __future__ import annotations

__all__ = ["PeerTimeout", "Transport", "wait_until"]


def __getattr__(name: str):
    if name == "Transport":
        from .protocol import Transport
        return Transport
    if name in ("PeerTimeout", "wait_until"):
        from . import waits
        return getattr(waits, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
