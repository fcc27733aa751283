"""torch.distributed on ddl_triton: ``import ddl_triton.torch`` registers the backend "ddl".

    import torch.distributed as dist
    import ddl_triton.torch                     # registers backend "ddl" (CPU and CUDA tensors)
    dist.init_process_group("ddl")              # torchrun, mp.spawn, env://, file://, or mpiexec/ddlrun
    model = torch.nn.parallel.DistributedDataParallel(model)   # or fully_shard(model), unchanged

Any launcher works (ddl_triton/torch/backend.py says how each bootstraps):

- torchrun, ``torch.multiprocessing.spawn``, SLURM with ``env://``, torch's test harnesses:
  torch's rank, size and store; shared memory within a host, gloo between hosts.
- ``mpiexec``/``ddlrun`` (or ``srun`` with PMI): MPI's ranks; shared memory within a host,
  MPI between hosts. No MASTER_ADDR is needed: where ``env://`` would fail for want of it,
  the store is set up over MPI (``init_method="ddl://"`` asks for that explicitly).
  Explicit ``rank=``/``world_size=`` or RANK/WORLD_SIZE must agree with MPI's, else init
  raises ValueError.

DDL_* variables configure the communicator as for ``ddl_triton.init()``; the default group
is the world communicator, so ``ddl_triton.init()`` (the hooks' default) returns it.

The only import-time effect is that registration (idempotent). Gradient compression hooks
live in ``ddl_triton.torch.hooks`` (imported on demand). Outer-sync training across slow links:
``DiLoCo`` (diloco.py) and ``host_group()`` (hosts.py), loaded on first use.
"""
from __future__ import annotations

from .backend import BACKEND_NAME, create_process_group, register
from .process_group import DdlProcessGroup
from .rendezvous import RENDEZVOUS_SCHEME

__all__ = ["BACKEND_NAME", "DdlProcessGroup", "DiLoCo", "RENDEZVOUS_SCHEME", "create_process_group", "host_group",
           "init_process_group", "register"]

_LAZY = {"DiLoCo": ".diloco", "host_group": ".hosts"}


def __getattr__(name: str):
    """``DiLoCo`` and ``host_group``, imported on first use (the outer-sync floor is not every job's)."""
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'ddl_triton.torch' has no attribute {name!r}")

register()


def init_process_group(**kwargs) -> None:
    """``torch.distributed.init_process_group`` with backend "ddl" and, under an MPI launcher
    with no ``init_method``, ``store`` or MASTER_ADDR, the ``ddl://`` (MPI) rendezvous."""
    import os

    import torch.distributed as dist

    from ..runtime.setup.bootstrap import launched_by_mpi

    kwargs.setdefault("backend", BACKEND_NAME)
    if ("init_method" not in kwargs and "store" not in kwargs and not os.environ.get("MASTER_ADDR")
            and launched_by_mpi()):
        kwargs["init_method"] = f"{RENDEZVOUS_SCHEME}://"
    dist.init_process_group(**kwargs)
