"""The stores ddl_triton serves itself listen on the job's interface only (transports/job_network.py),
never on every interface as torch's own server does: under MASTER_ADDR=127.0.0.1 the store, which
holds the call lane's secret, is not reachable through this host's other addresses."""
from __future__ import annotations

import socket

import pytest

from ddl_triton.runtime.setup.bootstrap import BootstrapError, store_from_env
from ddl_triton.transports import job_network


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> set[str]:
    """The local addresses some socket listens on at ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for name, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(address if len(address) == width else "?")
    return found


def _other_address() -> str | None:
    others = [a for a in job_network.host_addresses() if not a.startswith("127.")]
    return others[0] if others else None


def test_rank_0s_store_listens_on_master_addr_only():
    port = _free_port()
    store, rank, size = store_from_env(5.0, {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                             "MASTER_PORT": str(port)})
    store.set("lane-secret", "only for the job")
    assert _listening(port) == {"0100007F"}, _listening(port)  # 127.0.0.1, not 0.0.0.0 nor ::
    other = _other_address()
    if other is not None:  # the host's external address does not reach it
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.settimeout(2)
            s.connect((other, port))
    del store


def test_a_name_that_is_not_this_hosts_serves_on_the_interface_towards_it():
    # A Kubernetes service name resolves to a virtual IP no interface has: the store then listens on
    # the address of the interface on the route there (here, the default route's), still not everywhere.
    foreign = "198.51.100.1"  # TEST-NET-2: documentation only, never an address of this host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((foreign, 9))  # sends nothing: asks the kernel for the route
            towards = probe.getsockname()[0]
        except OSError as e:
            pytest.skip(f"this host has no route to a foreign address ({e.strerror}): nothing to follow")
    store, host, port = job_network.serve_store(foreign, 0, 1, 5.0)
    assert host == towards and _listening(port) == {socket.inet_aton(towards)[::-1].hex().upper()}
    del store


def test_a_taken_port_is_named_with_the_rank_the_address_and_why():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BootstrapError, match=rf"^rank 0: ddl_triton.init: cannot serve the store on "
                                                 rf"127.0.0.1:{port} \(127.0.0.1:{port} \(Address already in use\)\)"):
            store_from_env(1.0, {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def test_the_address_ddl_serves_on_when_it_chooses():
    assert job_network.job_address(True) == "127.0.0.1"
    assert job_network.job_address(False) in job_network.host_addresses()
