"""torch.distributed on ddl_triton: ``import ddl_triton.torch`` registers the backend "ddl".

    import torch.distributed as dist
    import ddl_triton.torch                     # registers backend "ddl" (CPU and CUDA tensors)
    dist.init_process_group("ddl")              # under mpiexec/ddlrun: ranks and size come from MPI
    model = torch.nn.parallel.DistributedDataParallel(model)   # or fully_shard(model), unchanged

Ranks are MPI's: launch with ``ddlrun``/``mpiexec``. No MASTER_ADDR is needed:
where ``env://`` (torch's default init method) would fail for want of it, the
store is set up over MPI instead (``init_method="ddl://"`` asks for that
explicitly). Explicit ``rank=``/``world_size=`` or RANK/WORLD_SIZE must agree
with MPI's, else init raises ValueError. With MASTER_ADDR/MASTER_PORT set,
``env://`` is torch's own, so gloo groups (``dist.new_group(backend="gloo")``)
can share the default store. DDL_* variables configure the communicator as
for ``ddl_triton.init()``; the group reuses the world communicator when one
exists. See ``ddl_triton.torch.backend`` for the supported operations.

The only import-time effect is that registration (idempotent). Gradient
compression hooks live in ``ddl_triton.torch.hooks`` (imported on demand).
"""
from __future__ import annotations

from .backend import BACKEND_NAME, RENDEZVOUS_SCHEME, DdlProcessGroup, register

__all__ = ["BACKEND_NAME", "DdlProcessGroup", "RENDEZVOUS_SCHEME", "init_process_group", "register"]

register()


def init_process_group(**kwargs) -> None:
    """``torch.distributed.init_process_group`` with backend "ddl" and, unless an ``init_method``
    or ``store`` is given or MASTER_ADDR is set, the ``ddl://`` (MPI) rendezvous."""
    import os

    import torch.distributed as dist

    kwargs.setdefault("backend", BACKEND_NAME)
    if "init_method" not in kwargs and "store" not in kwargs and not os.environ.get("MASTER_ADDR"):
        kwargs["init_method"] = f"{RENDEZVOUS_SCHEME}://"
    dist.init_process_group(**kwargs)
