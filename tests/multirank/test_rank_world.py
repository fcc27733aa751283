"""The reused rank worlds (tests/support/rank_world.py) give a test what a launch of its own would:
every rank's output and exit status, a deadline, and a fresh world after anything that could leak
into the next test. Each check here fails if the world gets it wrong."""
from __future__ import annotations

import os
import subprocess
import textwrap

import pytest

from support import rank_world
from support.launch import mpiexec


def _script(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _run(script: str, *args: str, n: int = 2, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DDL_TIMEOUT": "20", **env}
    return rank_world.run_in_world(mpiexec(), n, script, args, full, timeout)


PIDS = """
    import os, sys
    from mpi4py import MPI
    w = MPI.COMM_WORLD
    print(f"rank {w.Get_rank()} of {w.Get_size()} pid {os.getpid()} argv {sys.argv[1:]} "
          f"timeout={os.environ['DDL_TIMEOUT']} name={__name__}", flush=True)
    print(f"err from rank {w.Get_rank()}", file=sys.stderr, flush=True)
"""


def _pids(out: str) -> list[str]:
    return [line.split(" pid ")[1].split()[0] for line in out.splitlines() if " pid " in line]


def test_a_world_is_reused_and_each_job_gets_its_own_arguments_environment_and_output(tmp_path):
    script = _script(tmp_path, "pids.py", PIDS)
    first = _run(script, "a", DDL_TIMEOUT="7")  # a DDL_* variable is the job's: the same world serves both
    second = _run(script, "b", "c")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert [line.split(" pid ")[0] for line in first.stdout.splitlines()] == ["rank 0 of 2", "rank 1 of 2"]
    assert "argv ['a'] timeout=7 name=__main__" in first.stdout, first.stdout
    assert "argv ['b', 'c'] timeout=20 name=__main__" in second.stdout, second.stdout
    assert first.stderr.splitlines() == ["err from rank 0", "err from rank 1"]
    assert _pids(first.stdout) == _pids(second.stdout), "the second job did not run in the same world"


def test_a_failing_rank_gives_its_exit_status_and_a_fresh_world(tmp_path):
    pids = _script(tmp_path, "pids.py", PIDS)
    fail = _script(tmp_path, "fail.py", """
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 1:
            raise ValueError("rank 1 says no")
    """)
    before = _pids(_run(pids).stdout)
    proc = _run(fail)
    assert proc.returncode == 1
    assert "ValueError: rank 1 says no" in proc.stderr
    after = _pids(_run(pids).stdout)
    assert len(after) == 2 and not set(after) & set(before), "a failed job's world was reused"


def test_a_job_that_patches_the_library_or_leaves_a_communicator_gets_a_fresh_world_after_it(tmp_path):
    pids = _script(tmp_path, "pids.py", PIDS)
    patch = _script(tmp_path, "patch.py", """
        from ddl_triton.transports import table as transport_table
        transport_table.nvshmem_importable = lambda: True
    """)
    leave = _script(tmp_path, "leave.py", """
        import ddl_triton
        ddl_triton.init()
    """)
    for script, said in ((patch, "ddl_triton.transports.table.nvshmem_importable"), (leave, "world communicator")):
        before = _pids(_run(pids).stdout)
        proc = _run(script)
        assert proc.returncode == 0 and said in proc.stderr, proc.stderr
        after = _pids(_run(pids).stdout)
        assert not set(after) & set(before), f"the world was reused after a job that left {said}"


def test_a_hung_job_is_killed_at_its_deadline_and_named(tmp_path):
    hang = _script(tmp_path, "hang.py", """
        import time
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 0:
            time.sleep(600)
    """)
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        _run(hang, timeout=3)
    assert "ranks [0] of 2 had not finished" in caught.value.stderr
    assert _run(_script(tmp_path, "pids.py", PIDS)).returncode == 0  # a new world serves the next job


def test_a_rank_that_dies_ends_the_job_with_a_failure(tmp_path):
    die = _script(tmp_path, "die.py", """
        import os
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 1:
            os._exit(7)
        MPI.COMM_WORLD.Barrier()
    """)
    proc = _run(die, timeout=60)
    assert proc.returncode != 0
    assert "rank 1 ended during" in proc.stderr or "rank 0 ended during" in proc.stderr, proc.stderr
