"""Unlink the shared-memory segment MPICH's MPI_Init made for this host's ranks, as soon as
every one of them has it mapped, so that a job whose ranks never reach MPI_Finalize leaves
nothing behind in /dev/shm.

What MPICH does (5.0's ch4 posix shm, ``posix_init.c`` and ``mpl_shm_posix.c``): at MPI_Init the
ranks of a host open one segment by name, ``/dev/shm/mpich_shm_<world id>_<node id>``, and map it.
Only the last of them to leave MPI_Finalize unlinks it. A rank killed, or one that leaves with an
error (as a rank that lost a peer does), never gets there, and the segment (1-3 MB) stays in
/dev/shm until the machine reboots (632 of them, 1.5 GB, after a day of fault tests here, before
the exit guard unlinked them; a rank that is killed, or leaves by ``os._exit``, runs no exit code
at all, so the unlink now happens when the process's first communicator is made, over MPI or
over a torch store: ddl_triton initializes MPI in both, and under torchrun each rank is an MPI
singleton with a segment of its own, ``mpich_shm_<its pid in hex>_0``).

Why unlinking it early is safe: MPI_Init returns only once every rank of the host has mapped the
segment (``MPIDI_POSIX_comm_bootstrap`` waits for each one's ready flag in it), and afterwards
MPICH uses the mapping, never the name; the last rank's ``shm_unlink`` at MPI_Finalize then finds
nothing, and MPICH does not check its result. The memory itself lives until the last rank unmaps
it, as for any unlinked file. Other MPIs, and MPICH builds that name their segment otherwise, are
left alone: only a mapping of this process whose path has MPICH's exact form is unlinked.
"""
from __future__ import annotations

import os
import re

_MPICH_INIT_SEGMENT = re.compile(r"^/dev/shm/mpich_shm_[0-9a-f]+_\d+$")
_released = False


def release_init_segment(maps_path: str = "/proc/self/maps") -> list[str]:
    """Unlink the MPICH init segments this process maps (call only after MPI_Init); returns the
    paths unlinked here. Another rank of the host may have unlinked them first: not an error.
    Does its work once per process."""
    global _released
    if _released:
        return []
    _released = True
    try:
        with open(maps_path) as f:
            fields = [line.split(None, 5) for line in f]
    except OSError:
        return []  # not Linux: MPICH's segments live elsewhere, if anywhere
    paths = {f[5].strip() for f in fields if len(f) == 6}  # an anonymous mapping has no sixth field
    unlinked = []
    for path in sorted(p for p in paths if _MPICH_INIT_SEGMENT.match(p)):  # "(deleted)": already unlinked
        try:
            os.unlink(path)
            unlinked.append(path)
        except OSError:
            pass  # a host mate unlinked it first, or /dev/shm refuses: MPICH's own finalize remains
    return unlinked
