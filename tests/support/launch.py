"""Launch a script under mpiexec from a test, with a hard time limit and a /dev/shm leak check.

The suite runs only the mpich wheel's mpiexec, beside this interpreter, and checks once per process
that it starts one world: another MPI's launcher starts each rank of mpi4py's MPICH as a singleton
(rank 0 of 1), and a multi-rank test would then pass while testing one rank.
"""
from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/: scripts are named relative to it
_SHM_PREFIX = "ddl_triton-"
# One write per line: ranks share the pipe, and print's text and newline could be split by another rank's line.
_PROBE = ("import os; from mpi4py import MPI; w = MPI.COMM_WORLD; os.write(1, (f'world probe: rank {w.Get_rank()} "
          "of {w.Get_size()}: {MPI.Get_library_version().splitlines()[0]}' + chr(10)).encode())")


def mpiexec() -> str:
    """The mpiexec beside this interpreter, the mpich wheel's, once checked to start one world
    of mpi4py's MPICH (``_verified_mpiexec``); RuntimeError, naming what was found and what was
    expected, for anything else. Never the one on PATH."""
    return _verified_mpiexec(sys.executable)


@functools.cache
def _verified_mpiexec(python: str) -> str:
    here = Path(python).parent / "mpiexec"
    on_path = shutil.which("mpiexec")
    why = ("the suite runs only the mpiexec of the mpich wheel (pip install -e '.[test]'), beside the "
           f"interpreter: {here}; ")
    if not here.exists():
        raise RuntimeError(f"{why}there is none (on PATH: {on_path or 'no mpiexec'}, not used: another MPI's "
                           "launcher starts mpi4py's ranks as singletons)")
    if not _from_mpich_wheel(here):
        raise RuntimeError(f"{why}{here} is not one of the files the installed mpich wheel provides")
    assert_world(_probe(str(here), python, 2), 2)
    return str(here)


def _from_mpich_wheel(path: Path) -> bool:
    """Whether ``path`` is one of the files the installed mpich distribution put in place."""
    try:
        files = importlib.metadata.distribution("mpich").files or []
    except importlib.metadata.PackageNotFoundError:
        return False
    target = path.resolve()
    return any(Path(f.locate()).resolve() == target for f in files if f.name == path.name)


def _probe(launcher: str, python: str, n: int) -> str:
    """The output of ``launcher -n n python -c _PROBE``: each rank's line ``world probe: rank R of N: <MPI library>``."""
    proc = subprocess.run([launcher, "-n", str(n), python, "-c", _PROBE], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"{launcher} -n {n} failed to run a probe of mpi4py (exit {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-2000:]}")
    return proc.stdout


def assert_world(out: str, n: int) -> None:
    """``out``, a probe's output (``_probe``), shows one world of ``n`` MPICH ranks: ranks 0..n-1
    each once, each of world size ``n``. RuntimeError naming what the ranks reported otherwise."""
    seen = re.findall(r"^world probe: rank (\d+) of (\d+): (.*)$", out, re.M)
    ranks = sorted((int(r), int(size)) for r, size, _ in seen)
    if ranks != [(r, n) for r in range(n)]:
        raise RuntimeError(f"mpiexec -n {n} did not start one world of {n} ranks: the ranks reported "
                           f"(rank, world size) {ranks}; its MPI is not mpi4py's\n{out[-2000:]}")
    libraries = sorted({lib for _, _, lib in seen})
    if not all("MPICH" in lib for lib in libraries):
        raise RuntimeError(f"mpi4py's MPI library is {libraries}, expected the mpich wheel's MPICH")


def ddl_segments(prefix: str = _SHM_PREFIX) -> set[str]:
    """The shared-memory segments in /dev/shm whose names start with ``prefix`` (ddl_triton's by default)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def run_ranks(n: int, script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 240,
              extra_mpiexec: tuple[str, ...] = (), own_launch: bool = False) -> subprocess.CompletedProcess:
    """Run ``python tests/<script> args`` on ``n`` ranks (``script`` relative to tests/, e.g.
    ``"multirank/multirank_worker.py"``); returns the finished process (never hangs past ``timeout``).

    By default on a reused world of ``n`` ranks (tests/support/rank_world.py), which gives the
    same result a launch of its own would; ``own_launch`` (and any ``extra_mpiexec``) starts a
    world for this script alone: for scripts that kill or lose ranks, exit on purpose, or test
    interpreter exit. ``TEST_RANK_WORLDS=0`` launches every script on its own (to compare)."""
    full_env = dict(os.environ)
    full_env.update({"DDL_TIMEOUT": "60", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    full_env.update(env or {})
    if not own_launch and not extra_mpiexec and os.environ.get("TEST_RANK_WORLDS", "1") != "0":
        from .rank_world import run_in_world
        return run_in_world(mpiexec(), n, str(TESTS / script), args, full_env, timeout)
    cmd = [mpiexec(), "-n", str(n), *extra_mpiexec, sys.executable, str(TESTS / script), *args]
    # No stdin: mpiexec forwards it to rank 0, and a launcher outside the foreground can be stopped by it.
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def assert_clean_run(proc: subprocess.CompletedProcess, before: set[str]) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-6000:]}"
    leaked = ddl_segments() - before
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"


TORCHRUN = str(Path(sys.executable).parent / "torchrun")
_MPI_VARS = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK",
             "MV2_COMM_WORLD_SIZE", "HYDRA_CONTROL_FD")


def torch_launcher_env(**extra) -> dict[str, str]:
    """The environment for ranks that torch's launchers start: this one without MPI's, PMI's and
    torch's own rank variables (a test may itself run under mpiexec or torchrun), plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in _MPI_VARS and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DDL_TIMEOUT": "60"})
    env.update(extra)
    return env


# torch's gloo, not ddl_triton: DDP's reducer keeps its gloo group alive until interpreter exit (a
# reference cycle through autograd hooks that gc cannot see), and a gloo worker that drops its last
# collective's tensors after finalization has begun takes the GIL and dies in std::terminate. Seen
# about once in 40 runs on a loaded 2-core machine (CI: 2026-12-02, Accelerate on gloo); an
# atexit fix in torch (pytorch/pytorch#179291) was abandoned. transports/gloo.py frees its own groups.
_GLOO_EXIT_ABORT = "terminate called without an active exception"


def gloo_exit_abort(code: int, out: str, done_marker: str) -> bool:
    """Whether a torch job failed only by torch's gloo abort at exit: its last line of work
    (``done_marker``) printed, then a rank killed by SIGABRT with that message."""
    return code != 0 and done_marker in out and _GLOO_EXIT_ABORT in out and ("exitcode  : -6" in out or code == -6)
