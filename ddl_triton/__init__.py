"""ddl_triton: synchronous data-parallel collectives whose communication cost almost disappears.

    import ddl_triton as ddl
    comm = ddl.init()                       # the world communicator (idempotent): MPI's, or torchrun's (see init)
    comm.allreduce(t, op="avg")             # in place; sum | avg | min | max or torch ReduceOp
    w = comm.allreduce(t, async_op=True); w.wait()
    comm.reduce_scatter(out, inp); comm.all_gather(out, inp); comm.broadcast(t, root=0); comm.barrier()
    ddl.finalize()

Importing the package loads nothing heavy: each public name is imported on first use, so
``import ddl_triton`` (and ``ddlrun``, which imports only ``ddl_triton.launch``) neither imports
torch nor starts MPI. ``ddl_triton.init`` does both.
"""
from __future__ import annotations

import importlib

__all__ = ["CollectiveTimeout", "Communicator", "CommunicatorPoisoned", "DDLError", "Options", "Plan", "Work",
           "finalize", "init"]
__version__ = "0.1.0"

# public name -> the module that defines it (imported on first use)
_HOMES = {
    "CollectiveTimeout": "ddl_triton.errors",
    "CommunicatorPoisoned": "ddl_triton.errors",
    "DDLError": "ddl_triton.errors",
    "Options": "ddl_triton.options",
    "Communicator": "ddl_triton.runtime.communicator",
    "Plan": "ddl_triton.planning.planner",
    "Work": "ddl_triton.runtime.calls.work",
    "init": "ddl_triton.runtime.world",
    "finalize": "ddl_triton.runtime.world",
}
# subpackages reachable as attributes (``ddl.schedules.register``) without their own import
_SUBPACKAGES = {"kernels", "launch", "observability", "planning", "runtime", "schedules", "simulation",
                "torch", "transports", "tuning"}


# MPI starts at the first import of mpi4py.MPI: as the launcher's world, or as a world of one where
# the world comes from elsewhere (ddl_triton/launch/launchers.py; light: no torch, no MPI).
from .launch.mpi_start import install_mpi_start  # noqa: E402

install_mpi_start()


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'ddl_triton' has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _SUBPACKAGES)
