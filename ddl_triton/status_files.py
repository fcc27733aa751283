"""Per-rank status files, so a launcher can say which rank died and what the others saw.

When ``Options.status_dir`` (``DDL_STATUS_DIR``, set by ``ddlrun``) names a folder, each
rank of the world communicator writes there:

    rank<r>.start   its pid, at init
    rank<r>.host    its host name, at init (ddlrun names the host of a rank on another host)
    rank<r>.identity  JSON, at init: who that pid is (``identity``): host, boot id, PID namespace,
                    the process's start time and command line; ddlrun signals a rank only when
                    this still describes a live process of its own host (``signallable``)
    rank<r>.error   the message of a collective error (timeout, lost peer, mismatch)
    rank<r>.exit    at interpreter exit, however it ends short of being killed

A rank with a ``start`` file and no ``exit`` file was killed (SIGKILL, OOM, a crash).
The rank guard (ddl_triton/launch/rank_guard.py) adds ``rank<r>.killed`` and ``rank<r>.returncode``, and rewrites
``rank<r>.alive`` every second while the rank runs; ddlrun writes ``rank<r>.signal`` (``SIGUSR2``)
for a rank it cannot signal itself, and that rank's guard passes it on (``request_signal``) (``silent_ranks``: whose guard fell silent,
as when its host died); ``ddlrun`` reads them all back with ``read``. The rank guard loads this file by path (it imports no package),
so it imports nothing beyond the standard library. It sits at the top of the package, below every
room, because the ranks (ddl_triton/runtime/), ddlrun and its guard (ddl_triton/launch/) and
observability all use it.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import time

_folder = ""
_rank = -1
SILENT_SECONDS = 5.0  # a guard that has not rewritten its heartbeat for this long is gone (it beats every 1 s)


def start(folder: str, rank: int) -> None:
    """Begin recording for ``rank`` into ``folder`` (no-op when ``folder`` is empty)."""
    global _folder, _rank
    if not folder:
        return
    _folder, _rank = folder, rank
    _write("host", socket.gethostname())
    _write("identity", json.dumps(identity(os.getpid())))
    _write("start", str(os.getpid()))
    atexit.register(lambda: _write("exit", "") if _folder else None)


def error(message: str) -> None:
    if _folder:
        _write("error", message)


def exiting() -> None:
    """Mark a deliberate exit that skips atexit handlers (the exit guard's os._exit)."""
    if _folder:
        _write("exit", "")


def _write(event: str, text: str) -> None:
    record(_folder, _rank, event, text)


def record(folder: str, rank: int, event: str, text: str) -> None:
    """Write ``rank<rank>.<event>`` in ``folder``; also used by the rank guard (rank_guard.py)."""
    # 0600 and never through a link planted at the name (the folder is ddlrun's own 0700 one; this is
    # the second line of defence). Not ddl_triton._private_files: the rank guard loads this file alone.
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(os.path.join(folder, f"rank{rank}.{event}"), flags, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError:
        pass  # status is advisory: never fail a job over it


def identity(pid: int) -> dict:
    """Who process ``pid`` of this host is, as far as another process can check it later: this
    host's name and boot id, the PID namespace the pid is counted in, and from ``/proc/<pid>``
    its start time (``stat`` field 22, in clock ticks since boot: a reused pid gets a later one)
    and command line. Values that cannot be read are empty, and then match nothing."""
    return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id").strip(),
            "pid_ns": _link("/proc/self/ns/pid"), "pid": pid, "start_time": _start_time(pid),
            "cmdline": _read(f"/proc/{pid}/cmdline")}


def signallable(events: dict[str, str]) -> int | None:
    """The pid to signal for a rank whose records are ``events`` (``read``'s), or None: only
    when its ``identity`` record says this host, this boot and this PID namespace, and the
    process now at that pid has the recorded start time and command line. A pid recorded on
    another host means some unrelated process here; one recorded here may have been reused."""
    try:
        claimed = json.loads(events.get("identity", ""))
    except ValueError:
        return None
    if not isinstance(claimed, dict) or not isinstance(claimed.get("pid"), int) or claimed["pid"] <= 0:
        return None
    pid = claimed["pid"]
    if not all(claimed.get(key) for key in ("host", "boot_id", "pid_ns", "start_time", "cmdline")):
        return None  # a field that could not be read proves nothing
    if identity(pid) != claimed or events.get("start", "").strip() != str(pid):
        return None
    return pid


def request_signal(folder: str, rank: int, name: str = "SIGUSR2") -> None:
    """Ask ``rank``'s guard (rank_guard.py) to pass signal ``name`` to its rank: how ddlrun
    reaches a rank on another host, whose pid means nothing here."""
    record(folder, rank, "signal", name)


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """Field 22 of ``/proc/<pid>/stat`` (after the command name, which may hold spaces and parentheses)."""
    fields = _read(f"/proc/{pid}/stat").rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else ""


def read(folder: str) -> dict[int, dict[str, str]]:
    """{rank: {event: text}} from the files in ``folder`` (``rank<r>.<event>``); other names are ignored."""
    out: dict[int, dict[str, str]] = {}
    for name in os.listdir(folder):
        stem, _, event = name.partition(".")
        if stem.startswith("rank") and stem[4:].isdigit():
            with open(os.path.join(folder, name)) as f:
                out.setdefault(int(stem[4:]), {})[event] = f.read()
    return out


def silent_ranks(folder: str, ranks: dict[int, dict[str, str]]) -> list[int]:
    """The ranks of ``ranks`` (``read``'s) that started, recorded no end, and whose guard has not
    rewritten its heartbeat (``rank<r>.alive``) for ``SILENT_SECONDS``: its host, or the host's
    link, is gone."""
    now = time.time()
    silent = []
    for r, events in sorted(ranks.items()):
        if "alive" in events and "start" in events and "returncode" not in events:
            try:
                if now - os.stat(os.path.join(folder, f"rank{r}.alive")).st_mtime > SILENT_SECONDS:
                    silent.append(r)
            except OSError:
                pass
    return silent


def ended(folder: str, records: dict[int, dict[str, str]]) -> set[int]:
    """The ranks of ``records`` (``read``'s) that recorded their end (``returncode``, written by
    their guard) or whose guard fell silent (``silent_ranks``): none of them will write again."""
    return {r for r, events in records.items() if "returncode" in events} | set(silent_ranks(folder, records))


def settle(folder: str, ranks: int, patience: float = 3.0) -> dict[int, dict[str, str]]:
    """``read(folder)`` once each of ranks 0..ranks-1 has ``ended``, or ``patience`` seconds have
    passed: mpiexec can end a moment before a remote rank guard writes its last record."""
    deadline = time.monotonic() + patience
    while True:
        records = read(folder)
        if ended(folder, records) >= set(range(ranks)) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)
