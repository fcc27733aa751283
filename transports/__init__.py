"""Transports: how messages move between ranks (see base.py for the protocol).

shm: same node, host memory, one-sided. mpi: any rank, two-sided. self: a world of one.
"""
from .base import PeerTimeout, Transport, wait_until

__all__ = ["PeerTimeout", "Transport", "wait_until"]
