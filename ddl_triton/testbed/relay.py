"""The testbed's ssh daemon: runs a command inside a host on behalf of a process of another host.

Why it exists: each host has its own PID namespace, and the kernel lets a process enter only its
own PID namespace or one below it, never a sibling's; so a process inside h1 (hydra's ssh launcher,
calling the stand-in, ssh.py) cannot itself start anything inside h2. This daemon runs in the
machine's namespaces, where every host's namespaces can be entered, one per testbed: ``Testbed.up``
starts it, ``down`` ends it (its pid and start time are in the state file).

    python -m ddl_triton.testbed.relay --testbed NAME --run-dir DIR --holder h1:PID:START ...

Protocol, on the Unix socket ``DIR/ssh.sock`` (0600, in the testbed's 0700 folder): the client sends
8 bytes (the length of a JSON request, big-endian) carrying its stdin, stdout and stderr as
SCM_RIGHTS descriptors, then the request, ``{"host", "command", "cwd", "env"}``. The daemon:

- accepts only a peer that is root (SO_PEERCRED) and in the network namespace of one of this
  testbed's hosts, and a request whose fields have the right types, whose host passes the testbed's
  name pattern and is one of its hosts still running (its holder's pid has the start time given);
- runs ``sh -c COMMAND`` (as sshd hands a command to the user's shell) inside that host with
  ``nsenter`` (holder's namespace files, PID namespace included), in ``cwd``, with ``env``, on the
  client's own descriptors (so output goes where the client's goes, unbuffered, as with ssh);
- passes on SIGINT, SIGTERM or SIGHUP the client sends (one byte each), and SIGHUP when the client
  goes away before the command ends (a closed ssh session);
- answers ``S`` and the exit status (4 bytes: 128 + N for a death by signal N), or ``E`` and one
  line saying why it refused, and closes.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import struct
import sys
import threading

from .processes import HostProcess, nsenter_argv, start_time
from .state import check_name

SOCKET = "ssh.sock"
_MAX_REQUEST = 4 << 20   # bytes: a command line and an environment
_REQUEST_S = 10.0        # for a client to send its whole request
_PASSED_ON = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class _Refused(Exception):
    pass


class Relay:
    def __init__(self, testbed: str, holders: dict[str, tuple[int, str]]):
        self.testbed, self.holders = testbed, holders
        self.host_nets = {os.stat(f"/proc/{pid}/ns/net").st_ino for pid, _ in holders.values()}

    def handle(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            try:
                fds, request = self._request(conn)
                child = self._start(request, fds)
            except _Refused as e:
                conn.sendall(b"E" + str(e).encode()[:4000])
                return
            finally:
                for fd in fds:
                    os.close(fd)  # the command has its own copies
            threading.Thread(target=self._pass_signals, args=(conn, child), daemon=True).start()
            code = child.wait()
            conn.sendall(b"S" + struct.pack("!i", code if code >= 0 else 128 - code))
        except OSError:
            pass  # the client went away; _pass_signals has told the command
        finally:
            conn.close()

    def _request(self, conn: socket.socket) -> tuple[list[int], dict]:
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        conn.settimeout(_REQUEST_S)
        head, fds, _flags, _addr = socket.recv_fds(conn, 8, 3)
        try:
            return fds, self._checked_request(conn, pid, uid, fds, head)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _checked_request(self, conn: socket.socket, pid: int, uid: int, fds: list[int], head: bytes) -> dict:
        if uid != os.geteuid():
            raise _Refused(f"peer uid {uid} is not {os.geteuid()}")
        try:
            net = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            net = None
        if net not in self.host_nets:
            raise _Refused(f"peer pid {pid} is not on a host of testbed {self.testbed}")
        if len(fds) != 3:
            raise _Refused(f"expected 3 descriptors (stdin, stdout, stderr), got {len(fds)}")
        head += _exactly(conn, 8 - len(head))
        (length,) = struct.unpack("!Q", head)
        if length > _MAX_REQUEST:
            raise _Refused(f"request of {length} bytes (at most {_MAX_REQUEST})")
        try:
            request = json.loads(_exactly(conn, length))
        except ValueError as e:
            raise _Refused(f"request is not JSON: {e}") from None
        conn.settimeout(None)
        return request

    def _start(self, request: dict, fds: list[int]) -> HostProcess:
        if not isinstance(request, dict):
            raise _Refused("request is not an object")
        host, command, cwd, env = (request.get(k) for k in ("host", "command", "cwd", "env"))
        try:
            check_name(host, "host")
        except ValueError as e:
            raise _Refused(str(e)) from None
        if host not in self.holders:
            raise _Refused(f"{host!r} is not a host of testbed {self.testbed} ({', '.join(self.holders)})")
        if not isinstance(command, str) or not isinstance(cwd, str) or not os.path.isabs(cwd):
            raise _Refused("command must be a string and cwd an absolute path")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise _Refused("env must map strings to strings")
        holder, started = self.holders[host]
        if start_time("/proc", holder) != started:
            raise _Refused(f"host {host} is not running")
        try:
            return HostProcess(nsenter_argv("/proc", holder, cwd, ["sh", "-c", command]), stdin=fds[0],
                               stdout=fds[1], stderr=fds[2], env=env)
        except OSError as e:
            raise _Refused(f"cannot start nsenter: {e}") from None

    @staticmethod
    def _pass_signals(conn: socket.socket, child: HostProcess) -> None:
        while True:
            try:
                got = conn.recv(1)
            except OSError:
                got = b""
            if not got:  # the client is gone: as a closed ssh session, hang up
                child.send_signal(signal.SIGHUP)
                return
            if got[0] in _PASSED_ON:
                child.send_signal(got[0])


def _exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(min(n - len(data), 1 << 16))
        if not chunk:
            raise _Refused("the request ended early")
        data += chunk
    return data


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ddl_triton.testbed.relay")
    p.add_argument("--testbed", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--holder", action="append", default=[], help="HOST:PID:START")
    args = p.parse_args(argv)
    holders = {}
    for spec in args.holder:
        host, pid, started = spec.split(":")
        holders[check_name(host, "host")] = (int(pid), started)
    relay = Relay(check_name(args.testbed, "testbed"), holders)
    path = os.path.join(args.run_dir, SOCKET)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is created 0600
    try:
        server.bind(path + ".new")
    finally:
        os.umask(old)
    server.listen(64)
    os.replace(path + ".new", path)  # whole: Testbed.up waits for this name
    while True:  # until SIGKILL (Testbed.down); each connection is bounded by its command
        conn, _ = server.accept()
        threading.Thread(target=relay.handle, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
