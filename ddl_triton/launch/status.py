"""Per-rank status files, so a launcher can say which rank died and what the others saw.

When ``Options.status_dir`` (``DDL_STATUS_DIR``, set by ``ddlrun``) names a folder, each
rank of the world communicator writes there:

    rank<r>.start   its pid, at init
    rank<r>.host    its host name, at init (ddlrun names the host of a rank on another host)
    rank<r>.error   the message of a collective error (timeout, lost peer, mismatch)
    rank<r>.exit    at interpreter exit, however it ends short of being killed

A rank with a ``start`` file and no ``exit`` file was killed (SIGKILL, OOM, a crash).
The rank guard (rank_guard.py) adds ``rank<r>.killed`` and ``rank<r>.returncode``, and rewrites
``rank<r>.alive`` every second while the rank runs (``silent_ranks``: whose guard fell silent,
as when its host died); ``ddlrun`` reads them all back with ``read``. The rank guard loads this file by path (it imports no package),
so it imports nothing beyond the standard library.
"""
from __future__ import annotations

import atexit
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
    try:
        with open(os.path.join(folder, f"rank{rank}.{event}"), "w") as f:
            f.write(text)
    except OSError:
        pass  # status is advisory: never fail a job over it


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
