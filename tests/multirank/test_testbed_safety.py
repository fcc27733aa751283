"""The testbed's root commands on real namespaces (issue 41, row 6): a folder name full of shell
metacharacters is only a folder name, a failed ``up`` removes exactly what it made and leaves a
namespace it did not make alone, each host has its own PID namespace, and the ssh relay serves only
this testbed's hosts. Skipped, with the reason, where the machine cannot build hosts."""
from __future__ import annotations

import os
import secrets
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ddl_triton import testbed
from ddl_triton.testbed import hosts as hosts_mod, state
from support.real_hosts import UNAVAILABLE as _UNAVAILABLE, namespaces as _namespaces

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.skipif(bool(_UNAVAILABLE), reason=_UNAVAILABLE or "")


def _ours(name: str) -> set[str]:
    return {ns for ns in _namespaces() if ns.startswith(f"{name}-")}


def test_a_shared_folder_named_with_shell_metacharacters_is_bound_literally_and_nothing_runs(tmp_path, monkeypatch):
    tag = secrets.token_hex(3)
    folder = f"/tmp/ddlB-{tag};touch pwned-{tag}"
    os.makedirs(folder)
    (Path(folder) / "seen").write_text("yes")
    monkeypatch.chdir(tmp_path)  # where an injected `touch` would land (the holder's working directory)
    try:
        with testbed.Testbed(hosts=1, rate="", shared=(folder,)) as bed:
            assert folder in bed.shared
            seen = bed.run("h1", ["cat", f"{folder}/seen"])
            assert seen.stdout == "yes", seen.stderr
        assert not list(tmp_path.glob("pwned-*")) and not list(Path(folder).glob("pwned-*"))
        assert not Path(f"pwned-{tag}").exists()
    finally:
        subprocess.run(["rm", "-rf", "--", folder], check=True)


def test_a_failed_up_removes_exactly_what_it_made(monkeypatch):
    name = f"df{secrets.token_hex(2)}"
    real_add = hosts_mod.Testbed._add_host

    def add_host(self, host):
        if host == "h2":  # midway: the switch and h1 are up, h1's holder running
            raise RuntimeError("injected failure")
        real_add(self, host)

    monkeypatch.setattr(hosts_mod.Testbed, "_add_host", add_host)
    bed = testbed.Testbed(hosts=2, rate="", name=name)
    with pytest.raises(RuntimeError, match="injected failure"):
        bed.up()
    assert not _ours(name)
    assert not (state.STATE_DIR / name).exists() and not state.state_path(name).exists()


def test_a_failed_up_leaves_a_namespace_it_did_not_make_alone():
    name = f"dn{secrets.token_hex(2)}"
    theirs = f"{name}-h2"  # someone else's namespace, named as this testbed's h2 would be
    subprocess.run(["ip", "netns", "add", theirs], check=True)
    try:
        with pytest.raises(RuntimeError, match=f"netns add {theirs}"):
            testbed.Testbed(hosts=2, rate="", name=name).up()
        assert _ours(name) == {theirs}  # the switch and h1, which it made, are gone; h2 stays
        assert not state.state_path(name).exists()
    finally:
        subprocess.run(["ip", "netns", "del", theirs], check=True)


def test_each_host_has_its_own_pid_namespace_and_the_relay_serves_only_its_hosts():
    ssh = str(BIN / "ddl-testbed-ssh")
    with testbed.Testbed(hosts=2, rate="") as bed:
        pids = [bed.run(h, ["sh", "-c", "echo $$; cat /proc/1/comm; ls /proc | grep -c '^[0-9]'"]).stdout.split()
                for h in bed.hosts]
        for pid, init, count in pids:
            assert init.startswith("python") and int(count) < 10, pids  # the holder is pid 1; few processes
        outer = bed.process("h2", int(pids[1][0]))
        assert outer is None  # that shell has ended
        sleeper = bed.popen("h2", ["sleep", "30"])
        inner = bed.run("h2", ["pgrep", "-x", "sleep"]).stdout.split()
        assert len(inner) == 1 and bed.process("h2", int(inner[0])) not in (None, int(inner[0]))
        sleeper.terminate()  # reaches sleep inside h2, not only the nsenter above it
        assert sleeper.wait(10) == -15
        # From h1, h2 is reached through the relay; a host that is not the testbed's is refused.
        there = bed.run("h1", [ssh, "-x", "h2", "hostname; echo $$"])
        assert there.returncode == 0 and there.stdout.split()[0] == "h2", there.stderr
        refused = bed.run("h1", [ssh, "h9", "hostname"])
        assert refused.returncode == 255 and "'h9' is not a host of testbed" in refused.stderr
        # A client that is not on one of the testbed's hosts (this process) is refused.
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(state.STATE_DIR / bed.name / "ssh.sock"))
        socket.send_fds(conn, [struct.pack("!Q", 2)], [0, 1, 2])
        conn.sendall(b"{}")
        assert conn.recv(4096).startswith(b"Epeer pid")
        conn.close()
    assert not _ours(bed.name)
