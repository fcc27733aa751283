"""transports/mpi_retired.py: an active request keeps its buffers alive after its owner lets go;
once it completes, a sweep frees it and the buffers go (one process, MPI.COMM_SELF)."""
from __future__ import annotations

import gc
import weakref

import numpy as np
from mpi4py import MPI

from ddl_triton.transports import mpi_retired


def test_an_active_receive_keeps_its_buffer_until_it_completes():
    comm = MPI.COMM_SELF.Dup()
    try:
        buf = np.zeros(64, dtype=np.uint8)
        alive = weakref.ref(buf)
        req = comm.Irecv([buf, MPI.BYTE], source=0, tag=5)
        before = mpi_retired.sweep()
        mpi_retired.retire([req], buf)
        del buf, req
        gc.collect()
        assert alive() is not None, "the buffer of an active receive was let go"
        assert mpi_retired.sweep() == before + 1
        comm.Send([np.full(64, 7, dtype=np.uint8), MPI.BYTE], dest=0, tag=5)  # the receive completes
        assert mpi_retired.sweep() == before
        gc.collect()
        assert alive() is None, "a completed request's buffer was kept"
    finally:
        comm.Free()


def test_complete_and_null_requests_are_let_go_at_once():
    comm = MPI.COMM_SELF.Dup()
    try:
        before = mpi_retired.sweep()
        buf = np.zeros(8, dtype=np.uint8)
        alive = weakref.ref(buf)
        persistent = comm.Recv_init([buf, MPI.BYTE], source=0, tag=1)  # never started: inactive
        mpi_retired.retire([persistent, MPI.REQUEST_NULL], buf)
        assert not persistent, "an inactive persistent request was not freed"
        del buf, persistent  # (mpi4py's request object holds its buffer while it lives)
        gc.collect()
        assert alive() is None and mpi_retired.sweep() == before
    finally:
        comm.Free()
