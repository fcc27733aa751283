"""Which hosts a ddlrun job runs on: ``-H h1:2,h2:2`` or ``--hostfile FILE``, as horovodrun takes them.

A host list is ``NAME[:SLOTS]`` entries separated by commas (SLOTS defaults to 1). A hostfile has
one host per line, as ``NAME``, ``NAME:SLOTS`` or ``NAME slots=SLOTS`` (MPICH's and Open MPI's/
Horovod's spellings); ``#`` starts a comment. Either becomes one normalised list, handed to
mpiexec as ``-hosts h1:2,h2:2`` (MPICH) or ``--host h1:2,h2:2`` (Open MPI), which places ranks in
host order, SLOTS at a time.

Example: parse_hosts("h1:2,h2") -> [("h1", 2), ("h2", 1)]; as_spec(...) -> "h1:2,h2:1".
"""
from __future__ import annotations

import re
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
