"""MPI's start where this process's world is not MPI's: as a world of one, as under torchrun.

Semantics. MPI starts (MPI_Init) at the first import of ``mpi4py.MPI``, wherever it comes from:
many of ddl_triton's modules import it at their top. Where the launcher is one the MPI library
cannot speak to (Open MPI's mpirun or ``srun --mpi=pmix`` under the project's MPICH), MPICH would
start as a world of one, or abort on the PMIx variables ("unsupported PMI version PMIx").
``import ddl_triton`` installs a one-shot import hook (``install_mpi_start``) that runs that first
import inside ``mpi_environment``: where launchers.py's detectors say the world is not MPI's
(``mpi_launched``), the process manager's variables are hidden while MPI starts and put back
right after. An application that imported mpi4py.MPI before ddl_triton started MPI as it did.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import os
import sys

from .launchers import mpi_launched

__all__ = ["install_mpi_start", "mpi_environment"]

# The process manager's variables an MPI library reads at MPI_Init (OMPI_COMM_WORLD_* only for mpi4py's
# check that the launcher and the library agree, which warns here)
_PROCESS_MANAGER_PREFIXES = ("PMI_", "PMIX_", "OMPI_COMM_WORLD_")


@contextlib.contextmanager
def mpi_environment(environ=None, launcher: str | None = None, modules=sys.modules):
    """Around MPI's initialisation (the first ``from mpi4py import MPI``): where this process's world
    is not MPI's, hide the PMI, PMIx and OMPI_COMM_WORLD_* variables so that MPI starts as a world
    of one (as under torchrun) instead of joining a launcher it cannot speak to (MPICH aborts on
    PMIx's: "unsupported PMI version PMIx"); they are back as they were afterwards. Nothing changes
    under an MPI launcher, nor once MPI is imported (``modules``: sys.modules)."""
    env = os.environ if environ is None else environ
    hidden = {}
    if "mpi4py.MPI" not in modules and not mpi_launched(env, launcher):
        hidden = {k: env.pop(k) for k in list(env) if k.startswith(_PROCESS_MANAGER_PREFIXES)}
    try:
        yield
    finally:
        env.update(hidden)


class _MpiStart(importlib.abc.MetaPathFinder):
    """Finds the first import of ``mpi4py.MPI`` (which runs MPI_Init), wraps it in
    ``mpi_environment``, and leaves ``sys.meta_path``: one shot."""

    def find_spec(self, name, path=None, target=None):
        if name != "mpi4py.MPI":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:  # the finder that would have found it (mpi4py adds its own, per MPI ABI)
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _StartingLoader(spec.loader)
                return spec
        return None


class _StartingLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        with mpi_environment(modules={}):
            return self.inner.create_module(spec)

    def exec_module(self, module):
        with mpi_environment(modules={}):
            self.inner.exec_module(module)


def install_mpi_start() -> None:
    """Have MPI start under ``mpi_environment`` whichever module of ddl_triton (or of the user)
    imports mpi4py.MPI first; ``import ddl_triton`` calls it. A no-op once MPI is imported (an
    application that imported mpi4py.MPI before ddl_triton started MPI as its launcher said)."""
    if "mpi4py.MPI" not in sys.modules and not any(isinstance(f, _MpiStart) for f in sys.meta_path):
        sys.meta_path.insert(0, _MpiStart())
