"""``ddl-testbed``: build hosts from namespaces, run commands on them, take them down.

    ddl-testbed up --hosts 2 --rate 1gbit      # prints the testbed's name, e.g. dt3fa2, and its hosts
    ddl-testbed exec h1 -- hostname            # on the only testbed up (else --name NAME)
    ddl-testbed cut h2 [--direction up|down]   # h2's link carries nothing (both ways, or one); mend h2
    ddl-testbed shape h2 --rate 10mbit         # h2's link turns slow; kill h2 ends the host (a power cut)
    ddl-testbed list
    ddl-testbed down                           # the only one up; --name NAME; --all

Under MPICH, ``HYDRA_LAUNCHER_EXEC=$(which ddl-testbed-ssh)`` with ``-launcher ssh`` starts the
ranks of a remote host inside it (ddl_triton/testbed/ssh.py); run mpiexec (or ddlrun) inside h1.
"""
from __future__ import annotations

import argparse
import sys

from .hosts import Testbed, TestbedUnavailable, live_names, reap


def _one(name: str | None) -> Testbed:
    if name:
        return Testbed.attach(name)
    names = live_names()
    if len(names) != 1:
        raise ValueError("ddl-testbed: " + ("no testbed is up" if not names else
                                            f"{len(names)} testbeds are up ({', '.join(names)}): pass --name"))
    return Testbed.attach(names[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ddl-testbed", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="build hosts h1..hN on a shared bridge")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--rate", default="1gbit", help="tbf rate of every link, both directions ('' for none)")
    up.add_argument("--name", help="1-6 lowercase letters and digits (default: a random dtXXXX)")
    ex = sub.add_parser("exec", help="run a command on a host")
    ex.add_argument("--name")
    ex.add_argument("host")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    faults = {}
    for verb, help_ in (("cut", "stop a host's link carrying anything"), ("mend", "bring a cut link back"),
                        ("shape", "shape a host's link to a new rate"), ("kill", "end a host, as a power cut")):
        faults[verb] = sub.add_parser(verb, help=help_)
        faults[verb].add_argument("--name")
        faults[verb].add_argument("host")
    faults["cut"].add_argument("--direction", choices=("both", "up", "down"), default="both",
                               help="up: what the host sends; down: what it is sent (default both)")
    faults["shape"].add_argument("--rate", required=True, help="tbf rate, e.g. 10mbit ('' for none)")
    sub.add_parser("list", help="the testbeds that are up")
    down = sub.add_parser("down", help="take a testbed down (every process, namespace and link)")
    down.add_argument("--name")
    down.add_argument("--all", action="store_true")
    args = p.parse_args(argv)
    try:
        if args.verb == "up":
            bed = Testbed(args.hosts, args.rate, name=args.name, persistent=True).up()
            print(f"{bed.name}: " + ", ".join(f"{h} {a}" for h, a in bed.address.items())
                  + (f"; links {bed.rate}" if bed.rate else "; links unshaped"))
            return 0
        if args.verb == "exec":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                raise ValueError("ddl-testbed exec: no command (ddl-testbed exec h1 -- CMD ...)")
            return _one(args.name).run(args.host, command, capture_output=False, timeout=None).returncode
        if args.verb in faults:
            bed = _one(args.name)
            if args.verb == "cut":
                bed.cut(args.host, args.direction)
            elif args.verb == "shape":
                bed.shape(args.host, args.rate)
            else:
                getattr(bed, args.verb)(args.host)
            return 0
        if args.verb == "list":
            reap()
            for name in live_names():
                bed = Testbed.attach(name)
                print(f"{name}: {', '.join(bed.holders)}; links {bed.rate or 'unshaped'}")
            return 0
        beds = [Testbed.attach(n) for n in live_names()] if args.all else [_one(args.name)]
        for bed in beds:
            bed.down()
            print(f"{bed.name}: down")
        return 0
    except (TestbedUnavailable, ValueError, RuntimeError) as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
