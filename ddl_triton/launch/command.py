"""The command ddlrun builds: the mpiexec (hydra) arguments, the environment the ranks get, and
the one shell line ddlrun prints before running it.

The ranks' environment is ddlrun's own plus the ``DDL_*`` variables its options set
(``--topology`` → ``DDL_TOPOLOGY``, ``--timeout`` → ``DDL_TIMEOUT``), and the job's credential
``DDL_JOB_SECRET``, drawn afresh for the job unless ddlrun's environment sets one (Horovod's runner
does the same with its secret key). The credential is in the environment only, never in the printed
command line. Under MPICH each rank runs below the rank guard (rank_guard.py, run as a file so that it
imports no torch).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

RANK_GUARD = str(Path(__file__).with_name("rank_guard.py"))  # run as a file: no torch import


@dataclass(frozen=True)
class Job:
    """A checked job, ready to run."""
    command: list[str]             # the full mpiexec command line
    env_vars: dict[str, str]       # the variables ddlrun sets for the ranks
    env: dict[str, str]            # the whole environment mpiexec runs in
    across_hosts: bool = False     # -H or --hostfile: ranks on other hosts too
    hosts: tuple = ()              # those hosts, (name, slots) in order
    guarded: bool = False          # each rank runs below a rank guard (MPICH), which records its start


def ddl_env_vars(args: argparse.Namespace) -> dict[str, str]:
    """The DDL_* variables this launch sets for the ranks."""
    env_vars = {}
    if args.topology is not None:
        env_vars["DDL_TOPOLOGY"] = args.topology
    if args.timeout is not None:
        env_vars["DDL_TIMEOUT"] = _format_seconds(args.timeout)
    return env_vars


def _format_seconds(seconds: float) -> str:
    return str(int(seconds)) if seconds.is_integer() else repr(seconds)


SECRET_VARIABLE = "DDL_JOB_SECRET"


def child_env(args: argparse.Namespace, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment mpiexec (and so every rank) runs in: ``base`` (default os.environ) plus DDL_*,
    and the job's credential: ``base``'s, else a fresh one."""
    env = dict(os.environ if base is None else base)
    env.update(ddl_env_vars(args))
    if not env.get(SECRET_VARIABLE):
        from ..job_secret import draw
        env[SECRET_VARIABLE] = draw()
    return env


def mpiexec_command(mpiexec: str, family: str, ranks: int, env_vars: dict[str, str],
                    command: list[str], *, hosts: str | None = None, launcher_chosen: bool = False) -> list[str]:
    """``mpiexec -n N command``; Open MPI forwards variables to other nodes only when named with -x.

    ``hosts`` ("h1:2,h2:2", host_list.py) places the ranks: MPICH's ``-hosts`` with hydra's ssh launcher
    (unless ``launcher_chosen``: HYDRA_LAUNCHER names another), Open MPI's ``--host``.

    Under MPICH each rank runs below a guard (``rank_guard.py``) and hydra runs with
    ``-disable-auto-cleanup``: a rank killed by a signal then ends its guard with an ordinary
    exit status, so hydra does not SIGKILL the survivors, and they detect the loss, say
    which rank they lost and exit non-zero by themselves (ddlrun ends any that do not).
    """
    if family == "MPICH":
        where = ["-hosts", hosts] + ([] if launcher_chosen else ["-launcher", "ssh"]) if hosts else []
        return [mpiexec, "-disable-auto-cleanup", *where, "-n", str(ranks), sys.executable, RANK_GUARD, *command]
    exported = [word for name in [*env_vars, SECRET_VARIABLE] for word in ("-x", name)] if family == "Open MPI" else []
    where = ["--host", hosts] if hosts else []
    return [mpiexec, *where, "-n", str(ranks), *exported, *command]


def command_line(job: Job) -> str:
    """The command as one shell line, led by the variables ddlrun sets (VAR=value mpiexec ...)."""
    return shlex.join([f"{name}={value}" for name, value in job.env_vars.items()] + job.command)
