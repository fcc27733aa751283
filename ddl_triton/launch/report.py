"""How ddlrun says what happened to a job: each rank's end and exit status (from the status files
of ddl_triton/status_files.py), and the job's own exit status with its reason.

Every line goes to stderr prefixed "ddlrun: " (``say``). The job's status is the first killed
rank's 128 + N, else the lowest failing rank's own status (even when mpiexec itself then died of a
signal); else mpiexec's, or 128 + N when mpiexec was killed by signal N.
"""
from __future__ import annotations

import signal
import socket
import sys

PROG = "ddlrun"


def say(message: str) -> None:
    """One line on stderr, as ddlrun."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _rank_and_pid(rank: int, ranks: dict[int, dict[str, str]]) -> str:
    host = ranks[rank].get("host", "")
    elsewhere = f" on {host}" if host and host != socket.gethostname() else ""  # a job across hosts
    return f"rank {rank} (pid {ranks[rank]['start']}{elsewhere})"


def report_ranks(ranks: dict[int, dict[str, str]], failed_pids: list[int], silent: list[int] = ()) -> None:
    """Say how each rank that did not simply exit ended, the pid the launcher's banner names,
    what the ranks' collectives reported (a survivor names the rank it lost), and every
    recorded exit status. Each rank is described once, by the most certain record:

    - ``killed``: the rank guard saw it die of a signal (and said so as it happened);
    - ``returncode`` without ``exit``: it exited by itself, skipping its exit handlers
      (``os._exit``, or the interpreter died of a fatal error);
    - ``start`` alone: nothing saw it end (its guard was killed too, or there is no guard:
      Open MPI's launcher runs the ranks directly); among them, ``silent``: ranks whose guard's
      heartbeat stopped (status.silent_ranks), as when their host died or lost its link.
    """
    rank_of_pid = {int(e["start"]): r for r, e in ranks.items() if e.get("start", "").isdigit()}
    unseen = [r for r in sorted(ranks)
              if "start" in ranks[r] and not {"exit", "killed", "returncode"} & ranks[r].keys() and r not in silent]
    gone = [r for r in silent if "start" in ranks.get(r, {})]
    if gone:
        hosts = sorted({ranks[r].get("host", "") for r in gone} - {""})
        say(f"ranks whose guard fell silent, their host gone or cut off{' (' + ', '.join(hosts) + ')' if hosts else ''}: "
            f"{', '.join(_rank_and_pid(r, ranks) for r in gone)}")
    if unseen:
        say(f"ranks whose end nobody recorded (killed by a signal, crashed, or ended by the launcher's "
            f"cleanup): {', '.join(_rank_and_pid(r, ranks) for r in unseen)}")
    skipped = [r for r in sorted(ranks) if "start" in ranks[r] and "returncode" in ranks[r]
               and not {"exit", "killed"} & ranks[r].keys()]
    for r in skipped:
        say(f"{_rank_and_pid(r, ranks)} exited with status {ranks[r]['returncode']} without running its exit "
            f"handlers (os._exit, or a fatal error in the interpreter)")
    for pid in failed_pids:
        if pid in rank_of_pid:
            say(f"mpiexec reported rank {rank_of_pid[pid]} (pid {pid}) as failed")
    for r in sorted(ranks):
        if "error" in ranks[r]:
            say(f"rank {r} reported: {ranks[r]['error']}")
    codes = _exit_codes(ranks)
    if codes:
        say("exit status per rank: " + ", ".join(f"{r}: {codes[r]}" for r in sorted(codes)))


def _exit_codes(ranks: dict[int, dict[str, str]]) -> dict[int, int]:
    """{rank: exit status} as the rank guards recorded them (128 + N: killed by signal N)."""
    return {r: int(e["returncode"]) for r, e in ranks.items() if e.get("returncode", "").lstrip("-").isdigit()}


def every_rank_exited_zero(ranks: dict[int, dict[str, str]], size: int) -> bool:
    """Whether each of ranks 0..size-1 has a recorded exit status of 0 (and none was killed)."""
    codes = _exit_codes(ranks)
    return size > 0 and all(codes.get(r) == 0 and "killed" not in ranks.get(r, {}) for r in range(size))


def job_status(ranks: dict[int, dict[str, str]]) -> tuple[int, str] | None:
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


def report(returncode: int, ranks_status: tuple[int, str] | None = None, cause: str = "") -> int:
    """Say how a failed job ended; returns ddlrun's exit status.

    ``returncode`` is mpiexec's (negative: killed by that signal); ``ranks_status`` (from
    ``job_status``) is the status the ranks' own records give, with its reason, and wins when
    there is one; ``cause``, what ddlrun found itself ("could not reach host h2"), is said with
    mpiexec's status otherwise."""
    if returncode == 0:
        return 0
    if ranks_status is not None:
        # The ranks' records win even over mpiexec's own death: hydra can die of SIGPIPE writing to
        # the proxy of a host whose rank has just failed, after every rank recorded its end.
        status, reason = ranks_status
        if returncode < 0:
            note = f"; mpiexec was then killed by {_signal_name(-returncode)}"
        else:
            note = "" if status == returncode else f"; mpiexec's {returncode} is the bitwise OR of the ranks' statuses"
        say(f"job failed with exit code {status} ({reason}{note})")
        return status
    why = f"{cause}; " if cause else ""
    if returncode < 0:
        say(f"job failed with exit code {128 - returncode} ({why}mpiexec was killed by {_signal_name(-returncode)})")
        return 128 - returncode
    say(f"job failed with exit code {returncode}" + (f" ({cause})" if cause else ""))
    return returncode


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
