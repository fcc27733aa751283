"""Which hosts a ddlrun job runs on: ``-H h1:2,h2:2`` or ``--hostfile FILE``, as horovodrun takes them.

A host list is ``NAME[:SLOTS]`` entries separated by commas (SLOTS defaults to 1). A hostfile has
one host per line, as ``NAME``, ``NAME:SLOTS`` or ``NAME slots=SLOTS`` (MPICH's and Open MPI's/
Horovod's spellings); ``#`` starts a comment. Either becomes one normalised list, handed to
mpiexec as ``-hosts h1:2,h2:2`` (MPICH) or ``--host h1:2,h2:2`` (Open MPI), which places ranks in
host order, SLOTS at a time.

After a failed job, ``unreached`` names the hosts none of whose ranks ever started (no rank guard
there wrote a record), and ``why_unreachable`` adds what can be said from here: whether the name
resolves at all. ssh's own words ("Could not resolve hostname") never say which job host it was.

Example: parse_hosts("h1:2,h2") -> [("h1", 2), ("h2", 1)]; as_spec(...) -> "h1:2,h2:1".
"""
from __future__ import annotations

import re
import socket
import threading
from pathlib import Path

from .checks import CheckFailed

_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
_LINE = re.compile(r"^(?P<name>\S+?)(?::(?P<colon>\d+)|\s+slots\s*=\s*(?P<slots>\d+))?$")


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """``"h1:2,h2:2"`` -> [("h1", 2), ("h2", 2)]; raises CheckFailed naming the bad entry."""
    hosts = []
    for entry in spec.split(","):
        name, _, slots = entry.strip().partition(":")
        hosts.append(_host(name, slots or "1", f"-H {spec!r}: entry {entry.strip()!r}"))
    return _checked(hosts, f"-H {spec!r}")


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """The hosts of a hostfile (see the module doc); raises CheckFailed naming the file and line."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise CheckFailed(f"--hostfile {path}: cannot read it ({e.strerror})") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        m = _LINE.match(text)
        if m is None:
            raise CheckFailed(f"--hostfile {path}, line {number}: {text!r} is not NAME, NAME:SLOTS or "
                              "NAME slots=SLOTS")
        hosts.append(_host(m["name"], m["colon"] or m["slots"] or "1", f"--hostfile {path}, line {number}"))
    return _checked(hosts, f"--hostfile {path}")


def check_slots(hosts: list[tuple[str, int]], ranks: int, where: str) -> None:
    """N ranks must fit the slots: more would stack ranks on hosts the user did not size for."""
    slots = sum(n for _, n in hosts)
    if ranks > slots:
        raise CheckFailed(f"-n {ranks} needs {ranks} slots, but {where} gives {slots} "
                          f"({as_spec(hosts)})")


def ranks_on(hosts: list[tuple[str, int]], ranks: int) -> dict[str, list[int]]:
    """Where the launcher places ``ranks`` ranks: in host order, SLOTS at a time; hosts past the last
    rank get none. Example: ranks_on([("h1", 2), ("h2", 2)], 3) -> {"h1": [0, 1], "h2": [2]}."""
    placed, first = {}, 0
    for name, slots in hosts:
        placed[name] = list(range(first, min(first + slots, ranks)))
        first += slots
    return {name: rs for name, rs in placed.items() if rs}


def unreached(hosts: list[tuple[str, int]], ranks: int, records: dict[int, dict[str, str]]) -> dict[str, list[int]]:
    """The hosts of a failed job where none of their ranks left a record (``records``: status_files.read):
    the launcher never started a rank guard there, so the host was not reached."""
    return {name: rs for name, rs in ranks_on(hosts, ranks).items() if not any(records.get(r) for r in rs)}


_RESOLVE_WAIT_S = 3.0  # a resolver that does not answer by then says nothing either way


def why_unreachable(name: str) -> str:
    """What this host can tell about reaching ``name``: that its name does not resolve, else that the
    launcher could not start the ranks there (its own message says how)."""
    answer: list = []

    def resolve() -> None:
        try:
            socket.getaddrinfo(name, None)
            answer.append("")
        except OSError as e:
            answer.append(f"its name does not resolve ({e.strerror or e})")

    probe = threading.Thread(target=resolve, name="ddlrun-resolve", daemon=True)
    probe.start()
    probe.join(_RESOLVE_WAIT_S)
    return (answer[0] if answer else "") or "the launcher could not start them there (its own message is above: ssh's, " \
        "or HYDRA_LAUNCHER's)"


def as_spec(hosts: list[tuple[str, int]]) -> str:
    return ",".join(f"{name}:{slots}" for name, slots in hosts)


def _host(name: str, slots: str, where: str) -> tuple[str, int]:
    if not _NAME.match(name):
        raise CheckFailed(f"{where}: {name!r} is not a host name")
    if not slots.isdigit() or int(slots) < 1:
        raise CheckFailed(f"{where}: slots must be a positive integer, got {slots!r}")
    return name, int(slots)


def _checked(hosts: list[tuple[str, int]], where: str) -> list[tuple[str, int]]:
    if not hosts:
        raise CheckFailed(f"{where}: no hosts")
    names = [name for name, _ in hosts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CheckFailed(f"{where}: {', '.join(twice)} named twice (give one entry with its slots)")
    return hosts
