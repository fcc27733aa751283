"""``ddl-testbed-ssh HOST COMMAND``: what ssh would do between testbed hosts, for MPICH's launcher.

Hydra's ssh launcher calls its launcher executable as ``EXEC [-x] HOST "COMMAND"``; with
``HYDRA_LAUNCHER_EXEC`` (or ``-launcher-exec``) set to this program, the command runs through
``sh -c`` inside HOST's namespaces, in the same working directory. It must run inside a testbed
host (mpiexec does: hydra hands out its own hostname as the control address), where it finds its
testbed in that host's private /tmp. Options before HOST (``-x``, ``-q``, ``-o X``) are accepted
and ignored, as ssh's would be for this purpose.
"""
from __future__ import annotations

import json
import os
import sys

from .hosts import INSIDE_STATE, Testbed


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    while args and args[0].startswith("-"):
        flag = args.pop(0)
        if flag in ("-o", "-p", "-l", "-i") and args:  # ssh options that take a value
            args.pop(0)
    if len(args) < 2:
        print("usage: ddl-testbed-ssh [-x] HOST COMMAND", file=sys.stderr)
        return 255
    host, command = args[0], " ".join(args[1:])
    try:
        with open(INSIDE_STATE) as f:
            name = json.load(f)["testbed"]
    except OSError:
        print(f"ddl-testbed-ssh: not inside a testbed host (no {INSIDE_STATE})", file=sys.stderr)
        return 255
    bed = Testbed.attach(name)
    argv_inside = bed.command(host, ["sh", "-c", command], cwd=os.getcwd())
    os.execvp(argv_inside[0], argv_inside)
    return 255  # not reached


if __name__ == "__main__":
    sys.exit(main())
