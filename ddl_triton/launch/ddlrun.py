"""ddlrun: start a ddl_triton job under ``mpiexec``, after checking what usually goes wrong first.

Usage::

    ddlrun -n N [--topology XxY[xZ]] [--timeout SECONDS] [--mpiexec PATH] [--dry-run] [--] COMMAND [ARGS...]

    ddlrun -n 4 --topology 2x2 -- python train.py --epochs 3
    ddlrun -n 2 --dry-run python train.py          # check and print the command, run nothing

``ddlrun`` runs ``mpiexec -n N COMMAND ARGS...`` and exits with its status. The ``--``
is optional: the first word that is not one of ddlrun's own options starts COMMAND, and
everything after it belongs to COMMAND.

mpiexec is, in order: ``--mpiexec PATH`` (a path, or a name looked up on PATH), the
``mpiexec`` beside the running interpreter (the ``mpich`` wheel's, in a venv), ``mpiexec``
on PATH.

Environment given to every rank (on top of ddlrun's own):

    --topology XxY[xZ]   DDL_TOPOLOGY   the layout of the ranks, e.g. 2x2 = 2 nodes x 2 ranks
    --timeout SECONDS    DDL_TIMEOUT    seconds any single collective wait may last (Options.timeout)

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
rank's 137 beside survivors' 3 makes 139); 128 + N when mpiexec itself was killed by signal N.

Signals: Ctrl-C in a terminal reaches mpiexec directly (it runs in ddlrun's process group),
so ddlrun then only waits for the job to wind down; SIGINT sent to ddlrun alone, and
SIGTERM, are passed on to mpiexec. SIGUSR2 sent to ddlrun goes to every rank, which dumps
its flight recorder (ddl_triton/observability/flight.py); ddlrun sends it itself before ending a job
whose ranks are still running long after one was lost.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

_PROG = "ddlrun"
_CHECK_FAILED = 2
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


class _CheckFailed(Exception):
    """A pre-launch check failed; the message is the one line the user sees."""


@dataclass(frozen=True)
class _Job:
    command: list[str]             # the full mpiexec command line
    env_vars: dict[str, str]       # the variables ddlrun sets for the ranks
    env: dict[str, str]            # the whole environment mpiexec runs in


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ddlrun`` console script; returns the exit status."""
    try:
        args = _parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as stop:              # argparse: usage error (2) or --help (0)
        return stop.code if isinstance(stop.code, int) else _CHECK_FAILED
    try:
        job = _prepare(args)
    except _CheckFailed as failure:
        _say(str(failure))
        return _CHECK_FAILED
    _say(_command_line(job))
    if args.dry_run:
        return 0
    with tempfile.TemporaryDirectory(prefix="ddlrun-status-") as folder:
        env = dict(job.env, DDL_STATUS_DIR=folder)  # the ranks record start, errors and exit there
        failed_pids: list[int] = []
        grace = _survivor_grace(job.env)
        returncode = _run(job.command, env, failed_pids, status_folder=folder, grace=grace)
        if returncode != 0:
            ranks = _read_status(folder)
            _report_ranks(ranks, failed_pids)
            return _report(returncode, _job_status(ranks))
    return _report(returncode)


def _read_status(folder: str) -> dict[int, dict[str, str]]:
    """{rank: {event: text}} from the files ddl_triton/launch/status.py writes (rank<r>.<event>)."""
    out: dict[int, dict[str, str]] = {}
    for name in os.listdir(folder):
        stem, _, event = name.partition(".")
        if stem.startswith("rank") and stem[4:].isdigit():
            with open(os.path.join(folder, name)) as f:
                out.setdefault(int(stem[4:]), {})[event] = f.read()
    return out


def _rank_and_pid(rank: int, ranks: dict[int, dict[str, str]]) -> str:
    return f"rank {rank} (pid {ranks[rank]['start']})"


def _report_ranks(ranks: dict[int, dict[str, str]], failed_pids: list[int]) -> None:
    """Say how each rank that did not simply exit ended, the pid the launcher's banner names,
    what the ranks' collectives reported (a survivor names the rank it lost), and every
    recorded exit status. Each rank is described once, by the most certain record:

    - ``killed``: the rank guard saw it die of a signal (and said so as it happened);
    - ``returncode`` without ``exit``: it exited by itself, skipping its exit handlers
      (``os._exit``, or the interpreter died of a fatal error);
    - ``start`` alone: nothing saw it end (its guard was killed too, or there is no guard:
      Open MPI's launcher runs the ranks directly).
    """
    rank_of_pid = {int(e["start"]): r for r, e in ranks.items() if e.get("start", "").isdigit()}
    unseen = [r for r in sorted(ranks)
              if "start" in ranks[r] and not {"exit", "killed", "returncode"} & ranks[r].keys()]
    if unseen:
        _say(f"ranks whose end nobody recorded (killed by a signal, crashed, or ended by the launcher's "
             f"cleanup): {', '.join(_rank_and_pid(r, ranks) for r in unseen)}")
    skipped = [r for r in sorted(ranks) if "start" in ranks[r] and "returncode" in ranks[r]
               and not {"exit", "killed"} & ranks[r].keys()]
    for r in skipped:
        _say(f"{_rank_and_pid(r, ranks)} exited with status {ranks[r]['returncode']} without running its exit "
             f"handlers (os._exit, or a fatal error in the interpreter)")
    for pid in failed_pids:
        if pid in rank_of_pid:
            _say(f"mpiexec reported rank {rank_of_pid[pid]} (pid {pid}) as failed")
    for r in sorted(ranks):
        if "error" in ranks[r]:
            _say(f"rank {r} reported: {ranks[r]['error']}")
    codes = _exit_codes(ranks)
    if codes:
        _say("exit status per rank: " + ", ".join(f"{r}: {codes[r]}" for r in sorted(codes)))


def _exit_codes(ranks: dict[int, dict[str, str]]) -> dict[int, int]:
    """{rank: exit status} as the rank guards recorded them (128 + N: killed by signal N)."""
    return {r: int(e["returncode"]) for r, e in ranks.items() if e.get("returncode", "").lstrip("-").isdigit()}


def _job_status(ranks: dict[int, dict[str, str]]) -> tuple[int, str] | None:
    """The job's exit status from the ranks' own, with the reason; None when none is known.

    mpiexec's own status cannot serve: MPICH's hydra ORs the ranks' statuses bitwise, so a
    rank killed by SIGKILL (137) beside survivors that exit 3 makes 139, which is neither.
    The status is the first (lowest) killed rank's 128 + N, since a killed rank is the
    cause the others report; else the lowest failing rank's own status.
    """
    codes = _exit_codes(ranks)
    failing = [r for r in sorted(codes) if codes[r] != 0]
    if not failing:
        return None
    killed = [r for r in failing if "killed" in ranks[r]]
    rank = (killed or failing)[0]
    how = f"was killed by {ranks[rank]['killed'].split()[-1]}" if killed else f"exited with status {codes[rank]}"
    return codes[rank], f"rank {rank} {how}"


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=_PROG, description="Run a ddl_triton job under mpiexec after pre-launch checks.",
        usage="%(prog)s -n N [--topology XxY[xZ]] [--timeout SECONDS] [--mpiexec PATH] [--dry-run] "
              "[--] COMMAND [ARGS...]")
    parser.add_argument("-n", dest="ranks", type=int, required=True, metavar="N", help="number of ranks")
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


def _prepare(args: argparse.Namespace) -> _Job:
    """Run every pre-launch check and build the job; raises _CheckFailed on the first failure."""
    _check_ranks(args.ranks)
    if args.topology is not None:
        _check_topology(args.topology, args.ranks)
    if args.timeout is not None:
        _check_timeout(args.timeout)
    env_vars = _ddl_env_vars(args)
    env = _child_env(args)
    program = _find_program(args.command[0], env)
    _check_script(args.command)
    mpiexec = _find_mpiexec(args.mpiexec)
    family = _check_same_mpi(mpiexec, _probe_interpreter(args.command[0], program), env)
    return _Job(_mpiexec_command(mpiexec, family, args.ranks, env_vars, args.command), env_vars, env)


def _check_ranks(ranks: int) -> None:
    if ranks < 1:
        raise _CheckFailed(f"-n must be at least 1, got {ranks}")


def _check_topology(topology: str, ranks: int) -> None:
    if not _TOPOLOGY.match(topology) or 0 in _topology_dims(topology):
        raise _CheckFailed(f"--topology {topology!r} is not XxY[xZ] (positive integers, e.g. 2x2 or 2x2x2)")
    size = 1
    for dim in _topology_dims(topology):
        size *= dim
    if size != ranks:
        raise _CheckFailed(f"--topology {topology} has {size} ranks but -n is {ranks}")


def _topology_dims(topology: str) -> list[int]:
    return [int(dim) for dim in topology.split("x")]


def _check_timeout(seconds: float) -> None:
    if not 0 < seconds < float("inf"):
        raise _CheckFailed(f"--timeout must be a positive number of seconds, got {seconds:g}")


def _ddl_env_vars(args: argparse.Namespace) -> dict[str, str]:
    """The DDL_* variables this launch sets for the ranks."""
    env_vars = {}
    if args.topology is not None:
        env_vars["DDL_TOPOLOGY"] = args.topology
    if args.timeout is not None:
        env_vars["DDL_TIMEOUT"] = _format_seconds(args.timeout)
    return env_vars


def _format_seconds(seconds: float) -> str:
    return str(int(seconds)) if seconds.is_integer() else repr(seconds)


def _child_env(args: argparse.Namespace, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment mpiexec (and so every rank) runs in: ``base`` (default os.environ) plus DDL_*."""
    env = dict(os.environ if base is None else base)
    env.update(_ddl_env_vars(args))
    return env


def _find_program(word: str, env: dict[str, str]) -> str:
    """Where the command's first word resolves to; it must exist for the ranks to start."""
    if os.sep in word:
        if not Path(word).is_file():
            raise _CheckFailed(f"command {word!r} does not exist")
        return word
    found = shutil.which(word, path=env.get("PATH"))
    if found is None:
        hint = f" (did you mean ./{word}?)" if Path(word).is_file() else ""
        raise _CheckFailed(f"command {word!r} is not found on PATH{hint}")
    return found


def _check_script(command: list[str]) -> None:
    script = _script_of(command)
    if script is not None and not Path(script).is_file():
        raise _CheckFailed(f"script {script!r} does not exist (looked in {os.getcwd()})")


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


def _find_mpiexec(requested: str | None) -> str:
    if requested is not None:
        found = requested if os.sep in requested else shutil.which(requested)
        if found is None or not Path(found).is_file():
            raise _CheckFailed(f"--mpiexec {requested} does not exist")
        return found
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise _CheckFailed(f"no mpiexec beside {sys.executable} nor on PATH "
                           "(pip install mpich, or pass --mpiexec PATH)")
    return found


def _probe_interpreter(first_word: str, program: str) -> str:
    """The Python whose mpi4py the ranks will load: the command's interpreter if it is one, else ours."""
    return program if _is_python(first_word) else sys.executable


def _check_same_mpi(mpiexec: str, python: str, env: dict[str, str]) -> str:
    """Fail unless mpi4py's library and mpiexec are the same MPI; returns that MPI's name."""
    library = _mpi_family(_mpi4py_library_version(python, env))
    if library is None:
        raise _CheckFailed(f"cannot tell which MPI mpi4py uses under {python} (not MPICH, Open MPI or Intel MPI)")
    launcher = _mpi_family(_mpiexec_version(mpiexec, env))
    if launcher is None:
        raise _CheckFailed(f"cannot tell which MPI {mpiexec} belongs to from its --version output")
    if launcher != library:
        raise _CheckFailed(f"mpi4py under {python} uses {library} but {mpiexec} is {launcher}'s; "
                           f"pass --mpiexec with {library}'s mpiexec")
    return library


def _mpi4py_library_version(python: str, env: dict[str, str]) -> str:
    probe = _probe([python, "-c", _LIBRARY_PROBE], env)
    if probe.returncode != 0:
        last_line = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise _CheckFailed(f"mpi4py cannot load MPI under {python}: {last_line}")
    return probe.stdout


def _mpiexec_version(mpiexec: str, env: dict[str, str]) -> str:
    probe = _probe([mpiexec, "--version"], env)
    return probe.stdout + probe.stderr


def _probe(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise _CheckFailed(f"{shlex.join(command)!r} did not finish within {_PROBE_TIMEOUT_S:g} s") from None
    except OSError as error:
        raise _CheckFailed(f"cannot run {command[0]}: {error.strerror}") from None


def _mpi_family(version_text: str) -> str | None:
    for family, markers in _MPI_FAMILIES:
        if any(marker in version_text for marker in markers):
            return family
    return None


_RANK_GUARD = str(Path(__file__).with_name("rank_guard.py"))  # run as a file: no torch import


def _mpiexec_command(mpiexec: str, family: str, ranks: int, env_vars: dict[str, str],
                     command: list[str]) -> list[str]:
    """``mpiexec -n N command``; Open MPI forwards variables to other nodes only when named with -x.

    Under MPICH each rank runs below a guard (``rank_guard.py``) and hydra runs with
    ``-disable-auto-cleanup``: a rank killed by a signal then ends its guard with an ordinary
    exit status, so hydra does not SIGKILL the survivors, and they detect the loss, say
    which rank they lost and exit non-zero by themselves (ddlrun ends any that do not).
    """
    if family == "MPICH":
        return [mpiexec, "-disable-auto-cleanup", "-n", str(ranks), sys.executable, _RANK_GUARD, *command]
    exported = [word for name in env_vars for word in ("-x", name)] if family == "Open MPI" else []
    return [mpiexec, "-n", str(ranks), *exported, *command]


def _command_line(job: _Job) -> str:
    """The command as one shell line, led by the variables ddlrun sets (VAR=value mpiexec ...)."""
    return shlex.join([f"{name}={value}" for name, value in job.env_vars.items()] + job.command)


_FAILED_PID = re.compile(r"PID (\d+) RUNNING AT")  # MPICH hydra's "BAD TERMINATION" banner


def _survivor_grace(env: dict[str, str]) -> float:
    """Seconds the other ranks get, once one rank is lost, to notice and exit by themselves:
    one collective deadline (DDL_TIMEOUT, else Options' default) plus time to report."""
    try:
        timeout = float(env.get("DDL_TIMEOUT", _DEFAULT_TIMEOUT))
    except ValueError:
        timeout = _DEFAULT_TIMEOUT
    return timeout + _REPORT_SECONDS


# launcher.py runs without importing the package (no torch), so it keeps its own copy of
# Options.timeout's default; tests/multirank/test_ddlrun.py checks that the two agree.
_DEFAULT_TIMEOUT = 300.0
_REPORT_SECONDS = 15.0


def _end_stragglers(process: subprocess.Popen, folder: str, grace: float) -> None:
    """Once a rank was lost (its guard recorded its death, or it exited non-zero), give the
    others ``grace`` seconds to exit; then ask every rank still running to dump its flight
    recorder (SIGUSR2), and SIGTERM mpiexec, which passes it to every rank (the last resort:
    a survivor that never calls another collective, or that is stuck in MPI_Finalize,
    would otherwise run forever)."""
    first_loss = None
    while process.poll() is None:
        if first_loss is None:
            try:
                if _a_rank_was_lost(folder):
                    first_loss = time.monotonic()
            except OSError:
                return
        elif time.monotonic() - first_loss > grace:
            _say(f"a rank was lost {grace:g} s ago and the job is still running: asking the ranks left for their "
                 "flight recorders (SIGUSR2), then ending the job")
            _signal_ranks(folder, signal.SIGUSR2)
            time.sleep(_DUMP_SECONDS)
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            return
        time.sleep(0.2)


_DUMP_SECONDS = 2.0


def _a_rank_was_lost(folder: str) -> bool:
    for name in os.listdir(folder):
        if name.endswith(".killed"):
            return True
        if name.endswith(".returncode"):
            with open(os.path.join(folder, name)) as f:
                if f.read().strip() not in ("", "0"):
                    return True
    return False


def _signal_ranks(folder: str, signum: int) -> None:
    """Send ``signum`` to every rank that recorded its start and no end (same host only)."""
    for rank, events in _read_status(folder).items():
        if "start" in events and "returncode" not in events and events["start"].isdigit():
            with contextlib.suppress(OSError):
                os.kill(int(events["start"]), signum)


def _run(command: list[str], env: dict[str, str], failed_pids: list[int] | None = None,
         status_folder: str = "", grace: float = 0.0) -> int:
    """Run the job to its end and return mpiexec's exit status (negative: killed by that signal).

    The ranks' stderr goes straight to ddlrun's; their stdout (and mpiexec's) is relayed line
    by line, noting the pids that MPICH's launcher names as the first to fail. With a
    ``status_folder``, a watcher ends the job ``grace`` seconds after a rank was lost.
    """
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, bufsize=1,
                               errors="replace")
    if status_folder:
        threading.Thread(target=_end_stragglers, args=(process, status_folder, grace), daemon=True).start()
    with _signals_passed_to(process, status_folder):
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            match = _FAILED_PID.search(line)
            if match and failed_pids is not None:
                failed_pids.append(int(match.group(1)))
        return process.wait()


@contextlib.contextmanager
def _signals_passed_to(process: subprocess.Popen, status_folder: str = "") -> Iterator[None]:
    """While the job runs, pass SIGTERM and (unless the terminal delivered it to mpiexec too) SIGINT on;
    pass SIGUSR2 (dump the flight recorders) straight to every rank.

    A second Ctrl-C makes MPICH's mpiexec abort at once instead of letting the ranks wind
    down, so a Ctrl-C that the terminal sent to the whole process group is not repeated.
    """
    if threading.current_thread() is not threading.main_thread():
        yield                                  # signal handlers can only be set in the main thread
        return

    def pass_on(signum, _frame) -> None:
        if signum == signal.SIGUSR2:
            if status_folder:
                _signal_ranks(status_folder, signum)
            return
        if process.poll() is None and not (signum == signal.SIGINT and _in_terminal_foreground()):
            process.send_signal(signum)

    previous = {signum: signal.signal(signum, pass_on) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _in_terminal_foreground() -> bool:
    """Whether ddlrun's process group owns the terminal (so a Ctrl-C reached mpiexec as well)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def _report(returncode: int, ranks_status: tuple[int, str] | None = None) -> int:
    """Say how a failed job ended; returns ddlrun's exit status.

    ``returncode`` is mpiexec's; ``ranks_status`` (from ``_job_status``) is the status the
    ranks' own records give, with its reason, and wins when there is one."""
    if returncode == 0:
        return 0
    if returncode < 0:
        _say(f"job failed with exit code {128 - returncode} (mpiexec was killed by {_signal_name(-returncode)})")
        return 128 - returncode
    if ranks_status is not None:
        status, reason = ranks_status
        note = "" if status == returncode else f"; mpiexec's {returncode} is the bitwise OR of the ranks' statuses"
        _say(f"job failed with exit code {status} ({reason}{note})")
        return status
    _say(f"job failed with exit code {returncode}")
    return returncode


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _say(message: str) -> None:
    print(f"{_PROG}: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
