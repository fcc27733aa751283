"""One rank of a reused rank world (tests/support/rank_world.py): started once under mpiexec, it
imports torch, MPI and ddl_triton once, then runs test worker scripts, one job at a time, as
``python <script> <args>`` would, until told to leave.

Usage (by rank_world.py only): ``python world_rank.py <socket path> <world token> <keys file>``,
the last naming a JSON list of the environment variables the world was started with (what mpiexec
added besides, PMI_RANK and the like, is kept under every job's environment).

Each job is one JSON line from the test process on this rank's connection: the script, its
arguments, the whole environment it runs under, and the files its stdout and stderr go to. The
rank sets ``os.environ``, ``sys.argv`` and ``sys.path[0]`` as a fresh interpreter would, points
file descriptors 1 and 2 at the job's files, runs the script with ``runpy`` as ``__main__``, then
answers one JSON line: the exit status (``SystemExit``'s code; 1 and a traceback on stderr for an
exception) and whether the rank is still fit for another job. It is not when the script left a
ddl_triton world communicator, a torch process group or a thread behind (each is finalized,
destroyed or named on the job's stderr first), or failed: a failed collective may leave messages
in flight on ``MPI.COMM_WORLD``, so the test process replaces the whole world.

Nothing here is read from anyone but the test process that started the world: the socket lives in
its private (0700) folder and the first line each rank sends back is the world token it was given.
"""
from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
import threading
import warnings

# What every job would import first, imported once: the point of the world. The frameworks a job
# imports itself (JAX, TensorFlow) stay imported for the jobs after it.
from mpi4py import MPI
import torch
import torch.distributed as dist
import ddl_triton
from ddl_triton.runtime import world as ddl_world


# Process-wide settings a script may change (ddl_triton's errors-first hooks, a worker's signal
# handler, warning filters, torch's threads): put back after each job, as a fresh process has them.
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)


def _process_settings() -> dict:
    umask = os.umask(0o077)
    os.umask(umask)
    return {"excepthook": sys.excepthook, "threading_excepthook": threading.excepthook,
            "signals": {s: signal.getsignal(s) for s in _SIGNALS}, "warnings": list(warnings.filters),
            "threads": torch.get_num_threads(), "dtype": torch.get_default_dtype(), "umask": umask}


def _put_back(settings: dict) -> None:
    sys.excepthook, threading.excepthook = settings["excepthook"], settings["threading_excepthook"]
    for s, handler in settings["signals"].items():
        signal.signal(s, handler)
    signal.alarm(0)
    warnings.filters[:] = settings["warnings"]
    torch.set_num_threads(settings["threads"])
    torch.set_default_dtype(settings["dtype"])
    os.umask(settings["umask"])


_OURS = ("ddl_triton", "transports", "schedules")


def _patchable() -> dict[tuple[str, str], object]:
    """Every function, class and module that the library's modules hold, and every module in
    ``sys.modules``: what a worker monkeypatches (a stand-in transport, a fake module) and a fresh
    process would not have. The objects themselves, not their ids: a freed object's id is reused."""
    seen: dict[tuple[str, str], object] = {("sys.modules", name): m for name, m in list(sys.modules.items())}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in _OURS and module is not None:
            for attr, value in list(vars(module).items()):
                if callable(value) or isinstance(value, type(sys)):
                    seen[(name, attr)] = value
    return seen


def _run_job(job: dict, launcher_env: dict[str, str]) -> tuple[int, list[str]]:
    """Run one job; returns its exit status and what it left behind (empty when nothing)."""
    saved_argv, saved_path0 = list(sys.argv), sys.path[0]
    threads_before = set(threading.enumerate())
    patchable = _patchable()
    settings = _process_settings()
    os.environ.clear()
    os.environ.update(job["env"])
    os.environ.update(launcher_env)  # this rank's PMI_RANK and the like, as mpiexec set them
    os.chdir(job["cwd"])
    sys.argv = [job["script"], *job["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(job["script"]))
    code = 0
    try:
        runpy.run_path(job["script"], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 -- what an interpreter does before exiting 1
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        sys.argv, sys.path[0] = saved_argv, saved_path0
    left = _left_behind(threads_before)
    replaced = sorted(f"{m}.{a}" for (m, a), obj in _patchable().items() if patchable.get((m, a), obj) is not obj)
    if replaced:
        left.append(f"replaced objects in the library's modules or sys.modules: {', '.join(replaced[:8])}"
                    f"{' and more' if len(replaced) > 8 else ''} (the world is replaced, not patched back)")
    _put_back(settings)
    return code, left


def _left_behind(threads_before: set[threading.Thread]) -> list[str]:
    """What the job left that its process's exit would have ended: a world communicator
    (finalized now), a torch default group (destroyed now), threads still running."""
    left = []
    if ddl_world.current() is not None:
        left.append("a ddl_triton world communicator (finalized by the world)")
        try:
            ddl_triton.finalize()
        except Exception as e:  # noqa: BLE001 -- said, and the world is replaced
            left.append(f"whose finalize failed: {e}")
    if dist.is_available() and dist.is_initialized():
        left.append("a torch default process group (destroyed by the world)")
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001
            left.append(f"whose destruction failed: {e}")
    alive = [t.name for t in threading.enumerate() if t not in threads_before and t.is_alive() and not t.daemon]
    if alive:
        left.append(f"non-daemon threads {alive} (they would keep a process from exiting)")
    return left


def _redirect(path: str, fd: int) -> int:
    """Point ``fd`` at ``path`` (created 0600); returns a duplicate of what it was."""
    saved = os.dup(fd)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.dup2(target, fd)
    os.close(target)
    return saved


def _restore(saved: int, fd: int) -> None:
    os.dup2(saved, fd)
    os.close(saved)


def main() -> int:
    socket_path, token, base_keys = sys.argv[1], sys.argv[2], sys.argv[3]
    world = MPI.COMM_WORLD
    # What mpiexec added to the environment the world was started with: kept under every job's.
    with open(base_keys, encoding="utf-8") as f:
        started_with = set(json.load(f))
    launcher_env = {k: v for k, v in os.environ.items() if k not in started_with}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(socket_path)
    hello = {"token": token, "rank": world.Get_rank(), "size": world.Get_size(), "pid": os.getpid(),
             "library": MPI.Get_library_version().splitlines()[0]}
    conn.sendall((json.dumps(hello) + "\n").encode())
    lines = conn.makefile("r", encoding="utf-8")
    base_cwd = os.getcwd()
    for line in lines:
        job = json.loads(line)
        if job.get("leave"):
            break
        sys.stdout.flush()
        sys.stderr.flush()
        saved_out, saved_err = _redirect(job["stdout"], 1), _redirect(job["stderr"], 2)
        try:
            code, left = _run_job(job, launcher_env)
            for what in left:
                print(f"rank world: rank {world.Get_rank()}: the job left {what}", file=sys.stderr)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            _restore(saved_out, 1)
            _restore(saved_err, 2)
            os.chdir(base_cwd)
        conn.sendall((json.dumps({"code": code, "fit": code == 0 and not left}) + "\n").encode())
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
