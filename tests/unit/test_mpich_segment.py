"""ddl_triton/runtime/setup/mpich_segment.py: only MPICH's init segment, named exactly as MPICH names
it and mapped by this process, is unlinked; once per process; a segment already gone is no error."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from ddl_triton.runtime.setup import mpich_segment


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(mpich_segment, "_released", False)


def _name(suffix: str) -> str:
    """A /dev/shm path of MPICH's form that no MPICH job can own: its world id has 9 hex digits (MPICH
    prints a 32-bit one). A real segment's name (a singleton's world id is its pid) would be
    truncated by creating the file, and its process would die of SIGBUS at its next access."""
    return f"/dev/shm/mpich_shm_{os.urandom(5).hex()[:9]}_{suffix}"


def _create(path: str) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))  # never an existing file


def _maps(tmp_path, *paths: str):
    lines = [f"7f0000000000-7f0000001000 rw-s 00000000 00:1a {i} {p}" for i, p in enumerate(paths, 1)]
    lines.append("7f0000002000-7f0000003000 r-xp 00000000 00:00 0 ")  # anonymous: five fields
    maps = tmp_path / "maps"
    maps.write_text("\n".join(lines) + "\n")
    return str(maps)


def test_only_mpichs_init_segment_is_unlinked(tmp_path, fresh):
    mpich, other = _name("0"), _name("x")
    ours = f"/dev/shm/ddl_triton-{os.urandom(8).hex()}-test"
    for path in (mpich, other, ours):
        _create(path)
    try:
        maps = _maps(tmp_path, mpich, other, ours, _name("1") + " (deleted)")
        assert mpich_segment.release_init_segment(maps) == [mpich]
        assert not os.path.exists(mpich) and os.path.exists(other) and os.path.exists(ours)
    finally:
        for path in (mpich, other, ours):
            if os.path.exists(path):
                os.unlink(path)


def test_a_segment_a_host_mate_unlinked_first_is_no_error_and_it_runs_once(tmp_path, fresh):
    gone = _name("7")
    maps = _maps(tmp_path, gone)
    assert mpich_segment.release_init_segment(maps) == []
    _create(gone)
    try:
        assert mpich_segment.release_init_segment(maps) == []  # done once already: left alone
        assert os.path.exists(gone)
    finally:
        os.unlink(gone)


@pytest.mark.slow  # seconds: make check, the inner loop, leaves it out
def test_a_torchrun_style_rank_that_never_finalizes_leaves_no_segment():
    # A world over a torch store (RANK/WORLD_SIZE/MASTER_*), which makes the process an MPI
    # singleton too, then an exit that skips MPI_Finalize (as a survivor of a lost peer leaves).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import os, ddl_triton; c = ddl_triton.init(); "
            "print([l.split(None, 5)[5].strip() for l in open('/proc/self/maps') if '/mpich_shm_' in l][:1], os.getpid(), "
            "flush=True); "
            "os._exit(0)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI_", "HYDRA_", "OMPI_", "DDL_"))}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mapped, pid = proc.stdout.split("]")[0] + "]", int(proc.stdout.split()[-1])
    # It had one (the kind this would leak), unlinked already while the rank ran:
    assert f"/dev/shm/mpich_shm_{pid:x}_0 (deleted)" in mapped, proc.stdout
    assert not os.path.exists(f"/dev/shm/mpich_shm_{pid:x}_0")
