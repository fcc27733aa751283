"""ddlrun: start a ddl_triton job under ``mpiexec``, after checking what usually goes wrong first.

Usage::

    ddlrun -n N [-H HOSTS | --hostfile FILE] [--topology XxY[xZ]] [--timeout SECONDS] [--mpiexec PATH]
           [--dry-run] [--] COMMAND [ARGS...]

    ddlrun -n 4 --topology 2x2 -- python train.py --epochs 3
    ddlrun -n 4 -H h1:2,h2:2 -- python train.py    # 2 ranks on each of two hosts, started over ssh
    ddlrun -n 2 --dry-run python train.py          # check and print the command, run nothing

Hosts (host_list.py): ``-H NAME[:SLOTS],...`` or ``--hostfile FILE`` (lines ``NAME``, ``NAME:SLOTS`` or
``NAME slots=SLOTS``) place the ranks on those hosts in order, SLOTS at a time; N may not exceed the
slots. Under MPICH the remote ranks start through hydra's ssh launcher (``-launcher ssh``), unless
``HYDRA_LAUNCHER`` chooses another; ``HYDRA_LAUNCHER_EXEC`` (an ssh stand-in, such as the testbed's
``ddl-testbed-ssh``) is honoured, since mpiexec inherits ddlrun's environment. Every host must see
the same paths (the interpreter, the script and the working directory), as on a cluster with a shared
file system: ddlrun keeps the ranks' status files in the working directory then, so that ranks on
every host can write them, and its report names the host of each rank that is not on this one, and
each host where no rank ever started ("could not reach host h2", and whether its name resolves).

``ddlrun`` runs ``mpiexec -n N COMMAND ARGS...`` and exits with its status. The ``--``
is optional: the first word that is not one of ddlrun's own options starts COMMAND, and
everything after it belongs to COMMAND.

mpiexec is, in order: ``--mpiexec PATH`` (a path, or a name looked up on PATH), the
``mpiexec`` beside the running interpreter (the ``mpich`` wheel's, in a venv), ``mpiexec``
on PATH.

Environment given to every rank (on top of ddlrun's own):

    --topology XxY[xZ]   DDL_TOPOLOGY   the layout of the ranks, e.g. 2x2 = 2 nodes x 2 ranks
    --timeout SECONDS    DDL_TIMEOUT    seconds any single collective wait may last (Options.timeout)
    (always)             DDL_JOB_SECRET the job's credential (Options.job_secret): drawn afresh for each
                                        job unless ddlrun's own environment sets it; never printed

Before anything is launched ddlrun checks, failing with one line on stderr and exit
status 2 (``--dry-run`` stops after the checks, exit status 0):

- ``-n`` is at least 1: mpiexec's own complaint about ``-n 0`` is cryptic.
- ``--topology`` has the form XxY or XxYxZ (positive integers) and covers exactly N ranks:
  a layout with ranks missing or left over would make the job build the wrong groups.
- ``--timeout`` is a positive number: every rank would otherwise fail the same way in
  ``ddl.init()`` (Options rejects it), N tracebacks for one typo.
- The script exists (``python [options] script.py`` or ``./script.py``; not checked for
  ``python -m module`` or ``python -c code``) and the command is found: otherwise each of
  the N ranks prints the same "can't open file" or "execvp error", interleaved.
- mpiexec exists.
- mpi4py's MPI library and mpiexec are the same MPI (MPICH, Open MPI or Intel MPI): under
  another implementation's launcher every process starts as a singleton, rank 0 of 1, and
  the job either hangs or "succeeds" as N independent copies. The library is asked for in a
  subprocess (with MPI left uninitialised) run by the interpreter the command names, else
  by this one, with the ranks' environment, so ddlrun itself never loads MPI.

Before running, ddlrun prints on stderr the exact command, prefixed "ddlrun: ", as one
shell-quoted line whose ``VAR=value`` words are the variables it sets, so that the line
can be pasted into a shell. A job that fails makes ddlrun print each rank's exit status,
then "ddlrun: job failed with exit code X (why)", and exit with X: the first killed rank's
128 + N when a rank was killed by signal N, else the lowest failing rank's own status
(MPICH's mpiexec returns the bitwise OR of the ranks' statuses, which names nobody: a killed
rank's 137 beside survivors' 3 makes 139), even when mpiexec itself then died of a signal; with no
failing rank recorded, 128 + N when mpiexec was killed by signal N. When every rank recorded exit
status 0, the job succeeded and ddlrun exits 0 whatever mpiexec's status: across hosts, hydra can
fail after the fact (it notifies a host's proxy that has already finished, gets EPIPE, exits 255).

Signals: Ctrl-C in a terminal reaches mpiexec directly (it runs in ddlrun's process group),
so ddlrun then only waits for the job to wind down; SIGINT sent to ddlrun alone, and
SIGTERM, are passed on to mpiexec. SIGUSR2 sent to ddlrun goes to every rank, which dumps
its flight recorder (ddl_triton/observability/flight.py); ddlrun sends it itself before ending a job
whose ranks are still running long after one was lost. It signals a pid only when the rank's
identity record proves it is that rank, on this host; another host's rank gets it from its own
rank guard (supervision.py, ddl_triton/status_files.py).

The parts: checks.py (the pre-launch checks), command.py (the mpiexec command and the ranks'
environment), supervision.py (the running job: output, signals, survivors' grace), report.py
(each rank's end and the job's exit status), ddl_triton/status_files.py (the per-rank status files), and
rank_guard.py (the parent of each MPICH rank). This file keeps the command line and ``main``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Sequence

from .. import status_files
from .checks import (CheckFailed, check_ranks, check_same_mpi, check_script, check_timeout, check_topology,
                     find_mpiexec, find_program, probe_interpreter)
from .command import Job, child_env, command_line, ddl_env_vars, mpiexec_command
from .host_list import as_spec, check_slots, parse_hosts, read_hostfile, unreached, why_unreachable
from .report import PROG, every_rank_exited_zero, job_status, report, report_ranks, say
from .supervision import run, survivor_grace

_CHECK_FAILED = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ddlrun`` console script; returns the exit status."""
    try:
        args = _parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as stop:              # argparse: usage error (2) or --help (0)
        return stop.code if isinstance(stop.code, int) else _CHECK_FAILED
    try:
        job = _prepare(args)
    except CheckFailed as failure:
        say(str(failure))
        return _CHECK_FAILED
    say(command_line(job))
    if args.dry_run:
        return 0
    # Across hosts the status files must be where every host can write: the (shared) working directory.
    with tempfile.TemporaryDirectory(prefix=".ddlrun-status-", dir="." if job.across_hosts else None) as folder:
        folder = os.path.abspath(folder)
        env = dict(job.env, DDL_STATUS_DIR=folder)  # the ranks record start, errors and exit there
        failed_pids: list[int] = []
        grace = survivor_grace(job.env)
        returncode = run(job.command, env, failed_pids, status_folder=folder, grace=grace, ranks=args.ranks)
        if returncode != 0:
            ranks = status_files.settle(folder, args.ranks)
            if every_rank_exited_zero(ranks, args.ranks):
                # Across hosts hydra may fail after the fact: notifying a host's proxy that has
                # already finished that another rank ended, it gets EPIPE and exits 255 (the rank
                # guards outlast the job to prevent it: rank_guard.py; this is the fallback).
                say(f"every rank exited 0; mpiexec's own exit status {returncode} came after (hydra could not "
                    "reach a host's proxy that had already finished): the job succeeded")
                return 0
            report_ranks(ranks, failed_pids, status_files.silent_ranks(folder, ranks))
            lost = unreached(list(job.hosts), args.ranks, ranks) if job.guarded else {}
            for host, on_it in lost.items():
                say(f"could not reach host {host}: none of its ranks ({', '.join(map(str, on_it))}) started there; "
                    f"{why_unreachable(host)}")
            cause = f"could not reach host {', '.join(lost)}" if lost else ""
            return report(returncode, job_status(ranks), cause)
    return report(returncode)


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run a ddl_triton job under mpiexec after pre-launch checks.",
        usage="%(prog)s -n N [-H HOSTS | --hostfile FILE] [--topology XxY[xZ]] [--timeout SECONDS] "
              "[--mpiexec PATH] [--dry-run] [--] COMMAND [ARGS...]")
    parser.add_argument("-n", dest="ranks", type=int, required=True, metavar="N", help="number of ranks")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", metavar="HOSTS", help="NAME[:SLOTS],... the hosts to run on, in order")
    where.add_argument("--hostfile", metavar="FILE", help="a file of NAME[:SLOTS] or 'NAME slots=N' lines")
    parser.add_argument("--topology", help="rank layout XxY or XxYxZ whose product is N (sets DDL_TOPOLOGY)")
    parser.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="seconds any single collective wait may last (sets DDL_TIMEOUT)")
    parser.add_argument("--mpiexec", metavar="PATH", help="the mpiexec to use")
    parser.add_argument("--dry-run", action="store_true", help="check and print the command, run nothing")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program each rank runs, with its arguments")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command to run (e.g. ddlrun -n 2 -- python script.py)")
    return args


def _prepare(args: argparse.Namespace) -> Job:
    """Run every pre-launch check (checks.py) and build the job (command.py); raises CheckFailed
    on the first failure."""
    check_ranks(args.ranks)
    if args.topology is not None:
        check_topology(args.topology, args.ranks)
    if args.timeout is not None:
        check_timeout(args.timeout)
    env_vars = ddl_env_vars(args)
    env = child_env(args)
    program = find_program(args.command[0], env)
    check_script(args.command)
    hosts = None
    if args.hosts is not None or args.hostfile is not None:
        hosts = parse_hosts(args.hosts) if args.hosts is not None else read_hostfile(args.hostfile)
        check_slots(hosts, args.ranks, f"-H {args.hosts}" if args.hosts is not None else f"--hostfile {args.hostfile}")
    mpiexec = find_mpiexec(args.mpiexec)
    family = check_same_mpi(mpiexec, probe_interpreter(args.command[0], program), env)
    command = mpiexec_command(mpiexec, family, args.ranks, env_vars, args.command,
                              hosts=as_spec(hosts) if hosts else None, launcher_chosen="HYDRA_LAUNCHER" in env)
    return Job(command, env_vars, env, across_hosts=hosts is not None, hosts=tuple(hosts or ()),
               guarded=family == "MPICH")


if __name__ == "__main__":
    sys.exit(main())
