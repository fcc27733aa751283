"""``ddl-testbed-ssh HOST COMMAND``: what ssh would do between testbed hosts, for MPICH's launcher.

Hydra's ssh launcher calls its launcher executable as ``EXEC [-x] HOST "COMMAND"``; with
``HYDRA_LAUNCHER_EXEC`` (or ``-launcher-exec``) set to this program, COMMAND runs through ``sh -c``
(as ssh hands it to the remote shell) inside HOST's namespaces, its PID namespace included, in the
same working directory and environment, on this program's stdin, stdout and stderr; it exits with
COMMAND's status. Options before HOST (``-x``, ``-q``, ``-o X``) are accepted and ignored, as ssh's
would be for this purpose. SIGINT, SIGTERM and SIGHUP sent to it are passed on to COMMAND.

It must run inside a testbed host (mpiexec does: hydra hands out its own hostname as the control
address). Each host has its own PID namespace, and the kernel lets no process enter a sibling's, so
the stand-in asks its testbed's relay (relay.py: the testbed's sshd, in the machine's namespaces)
to start COMMAND, over the relay's socket in the testbed's own folder. It trusts only what the
testbed wrote: this host's ``INSIDE_STATE`` (in the host's private /tmp, written by its holder)
names the testbed, and that name must pass the testbed's name pattern (state.check_name) before
it becomes part of a path; HOST must pass it too, and the relay checks it is one of its running
hosts. Anything else is refused with one line on stderr and status 255 (ssh's own failure
status), and nothing runs.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

from .hosts import INSIDE_STATE
from .relay import SOCKET
from .state import STATE_DIR, check_name

_REFUSED = 255
_PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    while args and args[0].startswith("-"):
        flag = args.pop(0)
        if flag in ("-o", "-p", "-l", "-i") and args:  # ssh options that take a value
            args.pop(0)
    if len(args) < 2:
        print("usage: ddl-testbed-ssh [-x] HOST COMMAND", file=sys.stderr)
        return _REFUSED
    host, command = args[0], " ".join(args[1:])
    try:
        with open(INSIDE_STATE) as f:
            inside = json.load(f)
    except (OSError, ValueError):
        print(f"ddl-testbed-ssh: not inside a testbed host (no readable {INSIDE_STATE})", file=sys.stderr)
        return _REFUSED
    try:
        name = check_name(inside.get("testbed") if isinstance(inside, dict) else None, "testbed")
        check_name(host, "host")
        return _run(STATE_DIR / name / SOCKET, {"host": host, "command": command, "cwd": os.getcwd(),
                                                "env": dict(os.environ)})
    except (ValueError, OSError) as e:
        print(f"ddl-testbed-ssh: {host}: {e}", file=sys.stderr)
        return _REFUSED


def _run(path, request: dict) -> int:
    """Send ``request`` and this process's stdin, stdout and stderr to the relay at ``path``; pass
    on signals meanwhile; return the command's exit status (255 with a line when refused)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(path))
    body = json.dumps(request).encode()
    socket.send_fds(conn, [struct.pack("!Q", len(body))], [0, 1, 2])
    conn.sendall(body)
    for signum in _PASSED_ON:
        signal.signal(signum, lambda s, _f: conn.send(bytes([s])))
    answer = b""
    while len(answer) < 5:
        chunk = conn.recv(4096)
        if not chunk:
            break
        answer += chunk
        if answer[:1] == b"E":
            answer += _rest(conn)
            break
    if answer[:1] == b"S" and len(answer) >= 5:
        return struct.unpack("!i", answer[1:5])[0]
    why = answer[1:].decode(errors="replace") if answer[:1] == b"E" else "the relay closed the connection"
    print(f"ddl-testbed-ssh: {request['host']}: {why}", file=sys.stderr)
    return _REFUSED


def _rest(conn: socket.socket) -> bytes:
    data = b""
    while chunk := conn.recv(4096):
        data += chunk
    return data


if __name__ == "__main__":
    sys.exit(main())
