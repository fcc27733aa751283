"""Transports: how messages move between ranks.

protocol.py: the calls every transport answers; waits.py: how any of them waits for a peer.
shm: same node, host memory, one-sided. mpi: any rank, two-sided. gloo: any rank, when MPI did not
launch the ranks. self_transport: a world of one. nvshmem: same node, CUDA memory. mpi_device: any
rank, CUDA memory through MPI.
"""
from .protocol import Transport
from .waits import PeerTimeout, wait_until

__all__ = ["PeerTimeout", "Transport", "wait_until"]
