"""The process that holds one testbed host's namespaces: the first process of the host's own PID
namespace (its init), run by ``Testbed`` (hosts.py) as a file, below ``unshare``, never by hand.

    unshare --uts --ipc --mount --pid --fork --propagation private --kill-child \\
        python -I holder.py --testbed NAME --host HOST --run-dir DIR --inside-state FILE [--shared DIR ...]

It makes the host what it is, then waits until SIGKILLed (``Testbed.down`` or ``kill``; as the
PID namespace's init it ignores every other signal from inside, and its death ends every process
of the host). In order:

1. mounts a /proc of the host's own PID namespace, as a real host's;
2. sets the hostname, binds ``DIR/HOST.boot_id`` over the boot id and ``DIR/hosts`` over /etc/hosts;
3. mounts private tmpfs on /dev/shm and /tmp, keeping each ``--shared`` folder under /tmp (the
   interpreter's, the package's, the working directory's: a cluster's shared file system) bound
   from the machine's /tmp;
4. writes ``FILE`` (the host's testbed and name, for the ssh stand-in) inside the new /tmp, then
   ``DIR/HOST.ready`` (Testbed then finds the holder as the pid 1 of a PID namespace in the host's
   network namespace);
5. reaps the host's orphans for ever, as an init must.

Every step is an argument list (no shell); a step that fails ends the holder with its message on
stderr, which ``Testbed`` reports. Standard library only: it runs without the package on the path.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

_REAP_IDLE_S = 1.0  # with no child to wait for, how long to sleep before looking again


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"mount {' '.join(args)}: {done.stderr.strip()}")


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)  # whole, or not at all: Testbed polls for it


def make_host(args: argparse.Namespace) -> None:
    run_dir = args.run_dir
    _mount("-t", "proc", "proc", "/proc")
    socket.sethostname(args.host)
    _mount("--bind", os.path.join(run_dir, f"{args.host}.boot_id"), "/proc/sys/kernel/random/boot_id")
    _mount("--bind", os.path.join(run_dir, "hosts"), "/etc/hosts")
    _mount("-t", "tmpfs", "tmpfs", "/dev/shm")
    outer_tmp = os.path.join(run_dir, f"{args.host}.outer_tmp")  # the machine's /tmp, seen from inside
    _mount("--bind", "/tmp", outer_tmp)
    _mount("-t", "tmpfs", "tmpfs", "/tmp")
    for folder in args.shared:
        os.makedirs(folder, exist_ok=True)
        _mount("--bind", outer_tmp + folder[len("/tmp"):], folder)
    _write(args.inside_state, json.dumps({"testbed": args.testbed, "host": args.host}))
    _write(os.path.join(run_dir, f"{args.host}.ready"), "")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="holder.py")
    p.add_argument("--testbed", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--inside-state", required=True)
    p.add_argument("--shared", action="append", default=[])
    args = p.parse_args(argv)
    if os.getpid() != 1:
        print("holder.py: must be the first process of a new PID namespace (unshare --pid --fork)", file=sys.stderr)
        return 2
    try:
        make_host(args)
    except (OSError, RuntimeError) as e:
        print(f"ddl-testbed: host {args.host}: {e}", file=sys.stderr, flush=True)
        return 1
    sys.stderr.close()
    while True:  # until SIGKILL: an init reaps whatever is orphaned in its namespace
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(_REAP_IDLE_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
