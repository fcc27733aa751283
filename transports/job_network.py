"""Where ddl_triton's own listeners bind: this host's addresses on the job's network, never every
interface, so that a stranger on another network of this host reaches none of them.

Semantics:
- ``host_addresses()`` lists this host's IPv4 addresses in the order peers should try them: those
  of the interfaces ``GLOO_SOCKET_IFNAME`` names (a comma-separated list, as gloo reads it), else
  every interface's but loopback's, else 127.0.0.1 alone. The call lane listens on each of them and
  nowhere else (ddl_triton/runtime/lanes/lane_sockets.py).
- ``serve_store(address, port, size, timeout)`` starts a torch ``TCPStore`` server that accepts
  connections only on the local address the job reaches it by, where torch's own server binds the
  wildcard address. The store holds the call lane's secret and the job's membership
  (docs/security.md). The listening socket is made and bound here and handed to torch
  (``master_listen_fd``). Which local address: one that ``address`` (MASTER_ADDR, or what
  ``job_address`` chose) resolves to, if it is this host's own (127.0.0.1 for a job that stays on
  this host); else the address of this host's interface on the route to it (a name that resolves
  elsewhere, such as a Kubernetes service's virtual IP, whose traffic arrives at this pod's own
  address). Port 0 picks a free port. It returns the store, and the address and port it listens
  on; ``OSError`` names the address and why when it cannot listen (the port taken, no interface).
- ``job_address(all_local)``: where to serve a store that ddl_triton places itself (``ddl://``):
  127.0.0.1 for a job on one host; else the host's name, when it resolves to one of
  ``host_addresses()``, else the first of them (``GLOO_SOCKET_IFNAME``'s first, when set).
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct
from datetime import timedelta

_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str | None:
    """The IPv4 address of the interface ``name``, or None (no such interface, or no IPv4 address)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None  # no IPv4 address (or no such interface)
    finally:
        probe.close()


def host_addresses() -> list[str]:
    """This host's IPv4 addresses to publish, in the order peers should try them (see the module doc)."""
    named = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    names = named or [n for _, n in socket.if_nameindex()]
    found = [a for a in (interface_address(n) for n in names) if a and (named or not a.startswith("127."))]
    return list(dict.fromkeys(found)) or ["127.0.0.1"]


def serve_store(address: str, port: int, size: int, timeout: float):
    """(TCPStore server, the address it listens on, its port): see the module doc."""
    import torch.distributed as dist

    listener, bound = _listen(address, port)
    host, actual_port = bound[0], bound[1]
    store = dist.TCPStore(host, actual_port, size, True, timedelta(seconds=timeout), wait_for_workers=False,
                          master_listen_fd=listener.detach())  # torch owns the socket from here on
    return store, host, actual_port


def job_address(all_local: bool) -> str:
    """Where to serve a store that ddl_triton places itself (see the module doc)."""
    if all_local:
        return "127.0.0.1"
    ours = host_addresses()
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return ours[0]
    try:
        named = socket.gethostbyname(socket.gethostname())
    except OSError:
        named = ""
    return named if named in ours else ours[0]


def _listen(address: str, port: int) -> tuple[socket.socket, tuple]:
    try:
        resolved = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise OSError(f"cannot resolve {address!r} ({e.strerror or e})") from None
    tried = []
    for family, _, _, _, where in sorted(resolved, key=lambda r: r[0] != socket.AF_INET):  # IPv4 first
        sock = _bound(family, where, tried)
        if sock is not None:
            return sock, sock.getsockname()
    # Not an address of this host: the interface this host would reach it through.
    family, _, _, _, where = resolved[0]
    route = socket.socket(family, socket.SOCK_DGRAM)
    try:
        route.connect(where)  # a UDP "connection" sends nothing: it only picks the route
        local = (route.getsockname()[0], port) + tuple(where[2:])
    except OSError as e:
        tried.append(f"no route to {where[0]} ({e.strerror or e})")
        local = None
    finally:
        route.close()
    tried_already = local is not None and local[0] in (r[4][0] for r in resolved)
    sock = _bound(family, local, tried) if local is not None and not tried_already else None
    if sock is None:
        raise OSError("; ".join(dict.fromkeys(tried)))
    return sock, sock.getsockname()


def _bound(family: int, where: tuple, tried: list[str]) -> socket.socket | None:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server: a restart may reuse it
        sock.bind(where)
        sock.listen(socket.SOMAXCONN)
        return sock
    except OSError as e:
        tried.append(f"{where[0]}:{where[1]} ({e.strerror or e})")
        sock.close()
        return None
