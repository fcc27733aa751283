"""The processes of testbed hosts, seen from the machine: each host has its own PID namespace, so
a pid a host reports means nothing outside it, and a command entered with ``nsenter`` runs as the
child of the ``nsenter`` process the caller holds.

- ``HostProcess``: what ``Testbed.popen`` returns; a signal sent to it reaches the command inside
  the host (nsenter passes none on), through a pidfd, never a reused pid.
- ``init_in_netns(netns_file)``: the machine's pid of a host's holder, its PID namespace's init.
- ``in_pid_namespace(holder, pid)``: the machine's pid of the process numbered ``pid`` in the PID
  namespace of ``holder``.
- ``nsenter_argv(proc, holder, cwd, argv)``: the command line that runs ``argv`` inside a host.
- ``start_time(proc, pid)``: ``/proc/<pid>/stat`` field 22, which pins a pid to one process.
- ``kill_netns(ns)``: SIGKILL every process in a network namespace until none is left (bounded).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time


class HostProcess(subprocess.Popen):
    """A command started inside a host (``Testbed.popen``): ``nsenter`` forks to enter the PID
    namespace and waits for its child, the command, passing on nothing; so a signal sent here goes
    to that child, through a pidfd taken while it is still nsenter's child (never a reused pid)."""

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        child = _only_child(self.pid)
        if child is not None:
            try:
                fd = os.pidfd_open(child)
            except OSError:
                fd = None
            if fd is not None:
                try:
                    if _parent(child) == self.pid:  # checked after the pidfd pinned the process
                        signal.pidfd_send_signal(fd, sig)
                        return
                except OSError:
                    pass
                finally:
                    os.close(fd)
        super().send_signal(sig)  # nsenter has not forked yet (or its child is gone)


def nsenter_argv(proc: str, holder: int, cwd: str, argv: list[str]) -> list[str]:
    """``argv`` entered into every namespace of the host held by ``holder`` (its pid as seen through
    ``proc``), PID namespace included: nsenter then forks, and the command is its child."""
    ns = f"{proc}/{holder}/ns"
    return ["nsenter", f"--net={ns}/net", f"--uts={ns}/uts", f"--ipc={ns}/ipc", f"--mount={ns}/mnt",
            f"--pid={ns}/pid", f"--wd={cwd}", "--", *argv]


def init_in_netns(netns_file: str) -> int | None:
    """The machine's pid of the one process in the network namespace ``netns_file`` that is the
    first process (pid 1) of a PID namespace below the machine's; None if there is none."""
    net = os.stat(netns_file).st_ino
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry.name}/ns/net").st_ino != net:
                continue
            with open(f"/proc/{entry.name}/status") as f:
                spaces = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
        except OSError:
            continue
        if len(spaces) == 2 and spaces[1] == "1":
            return int(entry.name)
    return None


def in_pid_namespace(holder: int, pid: int) -> int | None:
    """The machine's pid of the process that ``holder``'s PID namespace numbers ``pid``; None if none."""
    holder_ns = os.stat(f"/proc/{holder}/ns/pid").st_ino
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry.name}/ns/pid").st_ino != holder_ns:
                continue
            with open(f"/proc/{entry.name}/status") as f:
                spaces = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
        except OSError:
            continue  # it ended meanwhile
        if spaces and spaces[-1] == str(pid):
            return int(entry.name)
    return None


def start_time(proc: str, pid: int) -> str:
    """Field 22 of ``<proc>/<pid>/stat`` (clock ticks since boot): a reused pid has a later one;
    "" when there is no such process."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return ""
    return fields[19] if len(fields) > 19 else ""


def _only_child(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
    except OSError:
        return None
    return int(children[0]) if len(children) == 1 else None


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def kill_pinned(pid: int) -> None:
    """SIGKILL ``pid`` through a pidfd (the caller has just checked its start time) and wait, at
    most a second, for it to be gone."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        deadline = time.monotonic() + 1.0
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
    except OSError:
        pass
    finally:
        os.close(fd)


def _gone(pid: int) -> bool:
    """No process ``pid``, or only its zombie (it has ended; its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _pids_in_netns(netns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def kill_netns(netns: str) -> None:
    """SIGKILL every process in ``netns``, again while any remain (one may fork as it dies); bounded."""
    for _ in range(50):
        pids = _pids_in_netns(netns)
        if not pids:
            return
        for pid in pids:
            _kill(pid)
        time.sleep(0.02)
    raise RuntimeError(f"ddl-testbed: processes in {netns} survive SIGKILL: {_pids_in_netns(netns)}")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
