"""The supervision of a running ddlrun job: relaying its output, passing signals on, and ending
the ranks left running long after one was lost.

- Output: the ranks' stderr goes straight to ddlrun's; their stdout (and mpiexec's) is relayed
  line by line, noting the pids MPICH's "BAD TERMINATION" banner names as the first to fail.
- Signals: Ctrl-C in a terminal reaches mpiexec directly (it runs in ddlrun's process group),
  so ddlrun then only waits for the job to wind down; SIGINT sent to ddlrun alone, and SIGTERM,
  are passed on to mpiexec. SIGUSR2 goes to every rank, which dumps its flight recorder: to a
  rank of this host directly, once its start record proves the pid is still that rank (host,
  boot id, PID namespace, start time, command line: status_files.signallable); to a rank of another
  host through that host's rank guard (status_files.request_signal), never by a pid from there.
- Survivors' grace: once a rank is lost, the others get one collective deadline (DDL_TIMEOUT,
  else Options' default) plus time to report, to notice and exit by themselves; then ddlrun asks
  those still running for their flight recorders and ends the job.
- Every rank ended: once a rank was lost and every rank has recorded its end (or its guard fell
  silent: a host that died records nothing), nothing is left for mpiexec to wait for but its
  proxies; a proxy on a host it can no longer reach (a cut link, a dead host) would keep it
  waiting for minutes, so ddlrun ends mpiexec a moment later.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator

from ..options import Options
from .. import status_files
from .report import say

_FAILED_PID = re.compile(r"PID (\d+) RUNNING AT")  # MPICH hydra's "BAD TERMINATION" banner
_REPORT_SECONDS = 15.0                              # for a survivor to report the loss and exit
_DUMP_SECONDS = 2.0                                 # for the ranks to dump their flight recorders
_SETTLE_SECONDS = 2.0   # after every rank ended, for mpiexec to finish by itself before it is ended
_KILL_SECONDS = 5.0     # after SIGTERM, for mpiexec to go before SIGKILL


def survivor_grace(env: dict[str, str]) -> float:
    """Seconds the other ranks get, once one rank is lost, to notice and exit by themselves:
    one collective deadline (DDL_TIMEOUT, else Options' default) plus time to report."""
    try:
        timeout = float(env.get("DDL_TIMEOUT", Options.timeout))
    except ValueError:
        timeout = Options.timeout
    return timeout + _REPORT_SECONDS


def run(command: list[str], env: dict[str, str], failed_pids: list[int] | None = None,
        status_folder: str = "", grace: float = 0.0, ranks: int = 0) -> int:
    """Run the job to its end and return mpiexec's exit status (negative: killed by that signal).

    The ranks' stderr goes straight to ddlrun's; their stdout (and mpiexec's) is relayed line
    by line, noting the pids that MPICH's launcher names as the first to fail. With a
    ``status_folder``, a watcher ends the job ``grace`` seconds after a rank was lost, or as soon
    as all ``ranks`` ranks have ended after one was lost.
    """
    # restore_signals=False: mpiexec keeps this interpreter's ignored SIGPIPE. Across hosts, hydra
    # notifies a host's proxy that has already finished that a rank ended, and died of SIGPIPE
    # (exit 141 after every rank exited 0); ignored, the write fails with EPIPE and hydra exits
    # 255, which ddlrun's report sees through (ddlrun.py). The rank guard restores the default for
    # the ranks (Popen's restore_signals).
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, bufsize=1,
                               errors="replace", restore_signals=False)
    if status_folder:
        threading.Thread(target=_end_stragglers, args=(process, status_folder, grace, ranks), daemon=True).start()
    with _signals_passed_to(process, status_folder):
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            match = _FAILED_PID.search(line)
            if match and failed_pids is not None:
                failed_pids.append(int(match.group(1)))
        return process.wait()


def _end_stragglers(process: subprocess.Popen, folder: str, grace: float, ranks: int = 0) -> None:
    """Once a rank was lost (its guard recorded its death, or it exited non-zero), give the
    others ``grace`` seconds to exit; then ask every rank still running to dump its flight
    recorder (SIGUSR2), and SIGTERM mpiexec, which passes it to every rank (the last resort:
    a survivor that never calls another collective, or that is stuck in MPI_Finalize,
    would otherwise run forever). When instead all ``ranks`` have recorded their end, end
    mpiexec ``_SETTLE_SECONDS`` later: it can only be waiting for a proxy it cannot reach."""
    first_loss = all_ended = None
    while process.poll() is None:
        if first_loss is None:
            try:
                if _a_rank_was_lost(folder):
                    first_loss = time.monotonic()
            except OSError:
                return
        elif all_ended is None and ranks and _every_rank_ended(folder, ranks):
            all_ended = time.monotonic()
        elif all_ended is not None and time.monotonic() - all_ended > _SETTLE_SECONDS:
            say(f"every rank has ended or fallen silent, but mpiexec is still waiting {_SETTLE_SECONDS:g} s later "
                "(for a host it cannot reach?): ending it")
            _end(process, _SETTLE_SECONDS)  # no rank is left to wind down: SIGKILL soon
            return
        elif time.monotonic() - first_loss > grace:
            say(f"a rank was lost {grace:g} s ago and the job is still running: asking the ranks left for their "
                "flight recorders (SIGUSR2), then ending the job")
            _signal_ranks(folder, signal.SIGUSR2)
            time.sleep(_DUMP_SECONDS)
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            return
        time.sleep(0.2)


def _every_rank_ended(folder: str, ranks: int) -> bool:
    """Whether each of ranks 0..ranks-1 has a ``returncode`` record (its guard saw it end), or
    a guard that fell silent (status_files.silent_ranks: its host, or the host's link, is gone)."""
    try:
        return status_files.ended(folder, status_files.read(folder)) >= set(range(ranks))
    except OSError:
        return False


def _end(process: subprocess.Popen, patience: float = _KILL_SECONDS) -> None:
    """SIGTERM, then SIGKILL if it is still there ``patience`` seconds later (hydra, told to end,
    may still wait to pass the signal to a proxy it cannot reach)."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(patience)
    except subprocess.TimeoutExpired:
        process.kill()


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
    """Send ``signum`` to every rank that recorded its start and no end, only where it is provably
    that rank: a rank of this host whose identity record still matches the live process
    (status_files.signallable: host, boot id, PID namespace, start time, command line) is signalled
    here; any other (another host's, whose pid means an unrelated process here) is asked through
    its own host's rank guard (status_files.request_signal), which signals only its own child while it
    runs. A pid that is no longer the rank's (it ended, the pid was reused) is never signalled."""
    name = signal.Signals(signum).name
    for rank, events in status_files.read(folder).items():
        if "start" not in events or "returncode" in events:
            continue
        pid = status_files.signallable(events)
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, signum)
        else:  # its guard knows its own child; a rank that has ended is signalled by nobody
            status_files.request_signal(folder, rank, name)


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
