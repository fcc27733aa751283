"""The shm transport's segment hygiene: private mode, unguessable per-job name, unlinked at set-up."""
from __future__ import annotations

import os
import stat

import pytest
import torch

from ddl_triton.transports import shm as shm_module


@pytest.fixture
def self_comm():
    from mpi4py import MPI

    from ddl_triton.runtime.setup.bootstrap import as_bootstrap
    return as_bootstrap(MPI.COMM_SELF)  # the transport takes the node's ranks as a bootstrap


def test_segment_is_0600_and_unlinked_once_mapped(self_comm, monkeypatch):
    seen = {}
    real_unlink = os.unlink

    def spy_unlink(path):
        if os.path.basename(path).startswith("ddl_triton-"):  # not MPICH's (runtime/setup/mpich_segment.py)
            seen[path] = stat.S_IMODE(os.stat(path).st_mode)
        real_unlink(path)

    monkeypatch.setattr(shm_module.os, "unlink", spy_unlink)
    t = shm_module.ShmTransport(self_comm, [0], slot_bytes=4096, depth=2)
    try:
        (path, mode), = seen.items()
        assert mode == 0o600
        name = os.path.basename(path)
        _, pid, token, local = name.split("-")
        assert int(pid) == os.getpid() and len(token) == 32 and local == "0"  # 128 random bits per job
        assert not os.path.exists(path), "segment must be unlinked once every peer has mapped it"
        assert t.segment_bytes == shm_module._HEADER_BYTES + 2 * 4096
    finally:
        t.close()


def test_two_transports_never_share_a_name(self_comm, monkeypatch):
    names = []
    real_open = os.open

    def spy_open(path, flags, *args):
        if "ddl_triton-" in str(path):
            names.append(path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(shm_module.os, "open", spy_open)
    a = shm_module.ShmTransport(self_comm, [0], slot_bytes=4096, depth=2)
    b = shm_module.ShmTransport(self_comm, [0], slot_bytes=4096, depth=2)
    a.close()
    b.close()
    assert len(names) == 2 and names[0] != names[1]


def test_oversized_message_is_refused(self_comm):
    t = shm_module.ShmTransport(self_comm, [0], slot_bytes=4096, depth=2)
    try:
        with pytest.raises(ValueError, match="exceeds the 4096 B slot"):
            t.acquire(0, (), 4097, torch.uint8, timeout=1.0)
    finally:
        t.close()


def test_start_up_sweeps_segments_of_dead_jobs_only(self_comm):
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = f"/dev/shm/ddl_triton-{dead}-{'ab' * 16}-0"
    live = f"/dev/shm/ddl_triton-{os.getpid()}-{'cd' * 16}-1"
    for path in (stale, live):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        t = shm_module.ShmTransport(self_comm, [0], slot_bytes=4096, depth=2)
        t.close()
        assert os.path.basename(stale) in t.swept and not os.path.exists(stale)
        assert os.path.exists(live), "a live job's segment must never be swept"
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


def test_a_peer_segment_is_mapped_only_when_it_is_this_users_file_of_the_agreed_size(tmp_path):
    """/dev/shm is every user's: what sits at a peer's segment name is checked before it is mapped."""
    path = tmp_path / "segment"
    path.write_bytes(b"\0" * 8192)
    shm_module._check_peer_segment(os.stat(path), 8192, 0, 1)  # ours, the agreed size: mapped
    with pytest.raises(ValueError, match=r"local rank 1's segment holds 8192 B, this rank expects 4096 B"):
        shm_module._check_peer_segment(os.stat(path), 4096, 0, 1)
    os.chown(path, 65534, 65534)  # another user's (the suite runs as root, as CI does)
    with pytest.raises(PermissionError, match="local rank 1's segment is not a file of this user"):
        shm_module._check_peer_segment(os.stat(path), 8192, 0, 1)
    with pytest.raises(PermissionError, match="not a file of this user"):
        shm_module._check_peer_segment(os.stat(tmp_path), 8192, 0, 1)  # a folder

