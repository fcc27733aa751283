"""Which launcher started this process, and where its world is: one small detector per launcher.

Semantics. ``detect(environ)`` tries the detectors below in this order and returns the first
one's ``FoundWorld`` (this rank, the world's size, this rank's index on its host, and either
"MPI's world" or the host and port of the store every rank meets at), or ``None`` when no
launcher's variables are there (a world of one). A detector claims a process by the variables
its launcher always sets; once it has claimed it, a variable it needs that is missing or
malformed raises ``LauncherError`` naming the variable, the launcher it looked like and the rank
(when known): a half-set environment never falls through to another detector, nor waits.

  1. torchrun          TORCHELASTIC_RUN_ID: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT (torchrun
                       inside a Slurm allocation, a PyTorchJob or a Trainer v2 pod: torchrun's RANK wins)
  2. kubeflow-pytorchjob  Kubeflow training-operator's PyTorchJob: RANK with PET_NODE_RANK. Its RANK is
                       the pod's index and its WORLD_SIZE counts pods (operator <= 1.6) or pods x
                       PET_NPROC_PER_NODE (>= 1.7): read as such, never as a process's rank
  3. jobset            a Kubernetes Indexed Job (JobSet's Jobs are): JOB_COMPLETION_INDEX, no RANK
  4. mpi               PMI_RANK/PMI_SIZE (hydra's mpiexec, ddlrun, Intel MPI, srun --mpi=pmi2) or
                       MV2_COMM_WORLD_SIZE (MVAPICH): MPI's world, as ddl_triton always did (a
                       RANK/WORLD_SIZE beside them must agree with MPI's: torch/rendezvous.py)
  5. env               env:// as torch reads it: RANK or WORLD_SIZE (mp.spawn, hand-set, wrappers)
  6. open-mpi          OMPI_COMM_WORLD_RANK/SIZE (Open MPI's mpirun): a store at the launcher's
                       host, read from OMPI_MCA_orte_hnp_uri (ORTE) or PMIX_SERVER_URI* (PRRTE)
  7. slurm             SLURM_PROCID in a job step (plain srun, srun --mpi=pmix): a store on the first
                       host of SLURM_STEP_NODELIST
  8. kubeflow-trainer  Kubeflow Trainer v2: PET_NNODES / PET_NODE_RANK (torchrun's options), no RANK

Why this order: a launcher started inside another sees both's variables, and the inner one
(the one that started this very process) must win: torchrun sets RANK over a pod's or a Slurm
task's; a PyTorchJob pod also holds env://'s names with other meanings, so it comes before env://;
explicit RANK/WORLD_SIZE (a user's wrapper) beat a scheduler's, but not an MPI launch's (MPI's
ranks are the ranks, as always); an MPI launcher inside a Slurm allocation beats Slurm's
SLURM_PROCID (which mpirun's daemons inherit).

MPI only where MPI's library speaks the launcher's protocol: the project's MPI (the MPICH wheel)
speaks PMI, which hydra, Intel MPI and srun --mpi=pmi2 serve. Under Open MPI's mpirun or
``srun --mpi=pmix`` it would start as a world of one, or abort on the PMIx variables ("unsupported
PMI version PMIx"); so those worlds meet at a store found from the variables, and
mpi_start.py hides the PMI/PMIx variables while MPI initialises as a world of one, as under
torchrun (``import ddl_triton`` has the first import of mpi4py.MPI, whoever makes it, run so).
``Options.launcher`` (DDL_LAUNCHER) names one detector to use instead of the order: "mpi" for an
mpi4py built on Open MPI under its mpirun, say. Nothing here imports mpi4py.

Store addresses. Rank 0 serves the store; the others connect. MASTER_ADDR and MASTER_PORT, where
set, override the host and the port a detector derives. A port derived from a job id lies in
61440-65535, outside Linux's default ephemeral range (32768-60999), 2048 away from the port
jax.distributed derives from the same id (both can run in one job).
"""
from __future__ import annotations

import os

from ..options import LAUNCHERS, launcher_from_env
from .launcher_detectors import (EnvInit, FoundWorld, JobSet, KubeflowPyTorchJob, KubeflowTrainer, LauncherError, Mpi,
                                 OpenMpi, Slurm, Torchrun)

__all__ = ["DETECTORS", "FoundWorld", "LauncherError", "claiming", "detect", "mpi_launched"]

DETECTORS = (Torchrun(), KubeflowPyTorchJob(), JobSet(), Mpi(), EnvInit(), OpenMpi(), Slurm(), KubeflowTrainer())


def detect(environ=None, launcher: str = "") -> FoundWorld | None:
    """The world the first claiming detector finds (module doc), or None: no launcher's variables.
    ``launcher`` (Options.launcher, DDL_LAUNCHER) names the one detector to use instead."""
    env = os.environ if environ is None else environ
    if launcher:
        chosen = [d for d in DETECTORS if d.name == launcher]
        if not chosen:
            raise LauncherError(f"DDL_LAUNCHER={launcher!r} is not a launcher; one of {', '.join(LAUNCHERS)}")
        return chosen[0].world(env)
    for detector in DETECTORS:
        if detector.claims(env):
            return detector.world(env)
    if env.get("MASTER_ADDR") or env.get("MASTER_PORT"):
        return EnvInit().world(env)  # names RANK and WORLD_SIZE as missing
    return None


def claiming(environ=None, launcher: str = ""):
    """The detector that would claim this process (nothing read, nothing raised), or None."""
    env = os.environ if environ is None else environ
    if launcher:
        return next((d for d in DETECTORS if d.name == launcher), None)
    return next((d for d in DETECTORS if d.claims(env)), None)


def mpi_launched(environ=None, launcher: str | None = None) -> bool:
    """Whether this process's world is MPI's (the "mpi" detector claims it, or DDL_LAUNCHER=mpi)."""
    env = os.environ if environ is None else environ
    if launcher is None:
        try:
            launcher = launcher_from_env(env)
        except ValueError:
            launcher = ""  # ddl_triton.init refuses it, by name (Options)
    detector = claiming(env, launcher)
    return detector is not None and detector.name == "mpi"

