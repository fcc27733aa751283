"""ddlrun's pre-launch checks: each raises ``CheckFailed`` with the one line the user sees.

The list of checks, and why each runs before anything is launched, is in ``ddlrun``'s
docstring (ddl_triton/launch/ddlrun.py). Nothing here loads MPI: which MPI mpi4py uses is
asked of a subprocess.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

_PROBE_TIMEOUT_S = 30.0
_TOPOLOGY = re.compile(r"^[0-9]+(x[0-9]+){1,2}$")
_LIBRARY_PROBE = ("import mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False; "
                  "from mpi4py import MPI; print(MPI.Get_library_version())")
# Which MPI a version text names. Order matters: Intel MPI's and MVAPICH's texts may mention
# MPICH or HYDRA, from which they derive. MVAPICH uses MPICH's launcher, so it counts as MPICH.
_MPI_FAMILIES = (
    ("Open MPI", ("Open MPI", "OpenRTE")),
    ("Intel MPI", ("Intel(R) MPI",)),
    ("MPICH", ("MPICH", "MVAPICH", "HYDRA")),
)
# Interpreter options that take the next word as their value (python -W ignore script.py).
_PYTHON_OPTIONS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")


class CheckFailed(Exception):
    """A pre-launch check failed; the message is the one line the user sees."""


def check_ranks(ranks: int) -> None:
    if ranks < 1:
        raise CheckFailed(f"-n must be at least 1, got {ranks}")


def check_topology(topology: str, ranks: int) -> None:
    if not _TOPOLOGY.match(topology) or 0 in _topology_dims(topology):
        raise CheckFailed(f"--topology {topology!r} is not XxY[xZ] (positive integers, e.g. 2x2 or 2x2x2)")
    size = 1
    for dim in _topology_dims(topology):
        size *= dim
    if size != ranks:
        raise CheckFailed(f"--topology {topology} has {size} ranks but -n is {ranks}")


def _topology_dims(topology: str) -> list[int]:
    return [int(dim) for dim in topology.split("x")]


def check_timeout(seconds: float) -> None:
    if not 0 < seconds < float("inf"):
        raise CheckFailed(f"--timeout must be a positive number of seconds, got {seconds:g}")


def find_program(word: str, env: dict[str, str]) -> str:
    """Where the command's first word resolves to; it must exist for the ranks to start."""
    if os.sep in word:
        if not Path(word).is_file():
            raise CheckFailed(f"command {word!r} does not exist")
        return word
    found = shutil.which(word, path=env.get("PATH"))
    if found is None:
        hint = f" (did you mean ./{word}?)" if Path(word).is_file() else ""
        raise CheckFailed(f"command {word!r} is not found on PATH{hint}")
    return found


def check_script(command: list[str]) -> None:
    script = _script_of(command)
    if script is not None and not Path(script).is_file():
        raise CheckFailed(f"script {script!r} does not exist (looked in {os.getcwd()})")


def _script_of(command: list[str]) -> str | None:
    """The Python script the command runs, or None when there is none to check."""
    first = command[0]
    if _is_python(first):
        return _python_script(command[1:])
    if first.endswith(".py"):
        return first
    return None


def _is_python(word: str) -> bool:
    return Path(word).name.startswith("python")


def _python_script(interpreter_args: list[str]) -> str | None:
    """The first non-option word after ``python``; None for ``-m module``, ``-c code`` and ``-`` (stdin)."""
    words = iter(interpreter_args)
    for word in words:
        if word == "-":
            return None
        if word in _PYTHON_OPTIONS_WITH_VALUE:
            next(words, None)
            continue
        if word.startswith("--"):
            continue
        if word.startswith("-"):
            flags = word[1:]                  # a cluster such as -u, -uc, -Wignore
            for index, flag in enumerate(flags):
                if flag in "cm":
                    return None
                if flag in "WX":
                    if index == len(flags) - 1:
                        next(words, None)     # the value is the next word
                    break
            continue
        return word
    return None


def find_mpiexec(requested: str | None) -> str:
    """``--mpiexec PATH`` (a path, or a name on PATH), else the one beside this interpreter, else PATH's."""
    if requested is not None:
        found = requested if os.sep in requested else shutil.which(requested)
        if found is None or not Path(found).is_file():
            raise CheckFailed(f"--mpiexec {requested} does not exist")
        return found
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise CheckFailed(f"no mpiexec beside {sys.executable} nor on PATH "
                          "(pip install mpich, or pass --mpiexec PATH)")
    return found


def probe_interpreter(first_word: str, program: str) -> str:
    """The Python whose mpi4py the ranks will load: the command's interpreter if it is one, else ours."""
    return program if _is_python(first_word) else sys.executable


def check_same_mpi(mpiexec: str, python: str, env: dict[str, str]) -> str:
    """Fail unless mpi4py's library and mpiexec are the same MPI; returns that MPI's name."""
    library = _mpi_family(_mpi4py_library_version(python, env))
    if library is None:
        raise CheckFailed(f"cannot tell which MPI mpi4py uses under {python} (not MPICH, Open MPI or Intel MPI)")
    launcher = _mpi_family(_mpiexec_version(mpiexec, env))
    if launcher is None:
        raise CheckFailed(f"cannot tell which MPI {mpiexec} belongs to from its --version output")
    if launcher != library:
        raise CheckFailed(f"mpi4py under {python} uses {library} but {mpiexec} is {launcher}'s; "
                          f"pass --mpiexec with {library}'s mpiexec")
    return library


def _mpi4py_library_version(python: str, env: dict[str, str]) -> str:
    probe = _probe([python, "-c", _LIBRARY_PROBE], env)
    if probe.returncode != 0:
        last_line = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CheckFailed(f"mpi4py cannot load MPI under {python}: {last_line}")
    return probe.stdout


def _mpiexec_version(mpiexec: str, env: dict[str, str]) -> str:
    probe = _probe([mpiexec, "--version"], env)
    return probe.stdout + probe.stderr


def _probe(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"{shlex.join(command)!r} did not finish within {_PROBE_TIMEOUT_S:g} s") from None
    except OSError as error:
        raise CheckFailed(f"cannot run {command[0]}: {error.strerror}") from None


def _mpi_family(version_text: str) -> str | None:
    for family, markers in _MPI_FAMILIES:
        if any(marker in version_text for marker in markers):
            return family
    return None
