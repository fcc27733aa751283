"""Launch a script under mpiexec from a test, with a hard time limit and a /dev/shm leak check."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/: scripts are named relative to it
_SHM_PREFIX = "ddl_triton-"


def mpiexec() -> str:
    """The mpiexec beside this interpreter (the mpich wheel's), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def ddl_segments(prefix: str = _SHM_PREFIX) -> set[str]:
    """The shared-memory segments in /dev/shm whose names start with ``prefix`` (ddl_triton's by default)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def run_ranks(n: int, script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 240,
              extra_mpiexec: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``python tests/<script> args`` on ``n`` ranks (``script`` relative to tests/, e.g.
    ``"multirank/multirank_worker.py"``); returns the finished process (never hangs past ``timeout``)."""
    full_env = dict(os.environ)
    full_env.update({"DDL_TIMEOUT": "60", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    full_env.update(env or {})
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
