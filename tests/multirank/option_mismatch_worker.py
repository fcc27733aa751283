"""Ranks given different options, and a rank that never arrives at init (test_option_mismatch.py).

Each scenario named on the command line sets this rank's ``DDL_*`` variable from its rank (as a
per-rank environment would), calls ``ddl_triton.init()`` and prints one line per rank:
``INIT scenario=S rank=R error=E seconds=T msg=M``. Every scenario but the last catches its
error; the last lets it end the process, as an application would (the exit code is the test's).

Scenarios: ``chunk_bytes``, ``pipeline_depth``, ``schedule`` (mismatched values), ``absent``
(the last rank never calls init; the others must give up within DDL_TIMEOUT), ``fails_in_shm``
(the last rank fails init while opening shared memory, as with /dev/shm full; the others must
give up within DDL_TIMEOUT, naming it), and ``slow_exit``
(init passes; the last rank then stays busy past DDL_TIMEOUT before it exits, and the others,
already at exit, must not wait for it longer than DDL_TIMEOUT).
"""
from __future__ import annotations

import os
import sys
import time

_PER_RANK = {"chunk_bytes": ("DDL_CHUNK_BYTES", ["1048576", "4194304"]),
             "pipeline_depth": ("DDL_PIPELINE_DEPTH", ["2", "4"]),
             "schedule": ("DDL_SCHEDULE", ["ring", "one_shot"])}


def _rank() -> tuple[int, int]:
    for rank, size in (("PMI_RANK", "PMI_SIZE"), ("RANK", "WORLD_SIZE")):
        if rank in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    raise SystemExit("option_mismatch_worker: launch under mpiexec or with RANK/WORLD_SIZE")


def _say(scenario: str, rank: int, error: str, seconds: float, msg: str) -> None:
    line = f"INIT scenario={scenario} rank={rank} error={error} seconds={seconds:.2f} msg={msg}\n"
    os.write(1, line.encode())  # one write: the ranks share the pipe


def main() -> None:
    import torch  # imported before the clock starts: only init is timed

    import ddl_triton as ddl

    rank, size = _rank()
    scenarios = sys.argv[1:]
    for i, scenario in enumerate(scenarios):
        last = i == len(scenarios) - 1
        if scenario == "absent" and rank == size - 1:
            from mpi4py import MPI  # noqa: F401  (MPI_Init is collective: every rank is in MPI, this one not at init)

            from ddl_triton.runtime.setup.mpich_segment import release_init_segment
            release_init_segment()  # as init does first: mpiexec ends this rank once the others fail
            time.sleep(float(os.environ["DDL_TIMEOUT"]) + 3)  # alive, but never at init, past the deadline
            _say(scenario, rank, "none", 0.0, "stayed away")
            return
        if scenario == "subgroup_absent":  # every rank in the default group; rank 1 never makes the subgroup
            _subgroup_absent(scenario, rank, size)
            return
        if scenario == "fails_in_shm" and rank == size - 1:
            from ddl_triton.transports.shm import ShmTransport

            def no_space(*_args, **_kwargs):
                raise OSError(28, "No space left on device (simulated: /dev/shm is full)")
            ShmTransport.__init__ = no_space
        if scenario in _PER_RANK:
            name, values = _PER_RANK[scenario]
            os.environ[name] = values[rank % len(values)]
        t0 = time.monotonic()
        try:
            comm = ddl.init()
        except Exception as e:  # noqa: BLE001
            _say(scenario, rank, type(e).__name__, time.monotonic() - t0, str(e).replace("\n", " "))
            if last:
                raise
        else:
            _say(scenario, rank, "none", time.monotonic() - t0, f"init passed as rank {comm.rank} of {comm.size}")
            if scenario == "slow_exit":
                ones = torch.ones(8, dtype=torch.int64)
                assert comm.allreduce(ones).tolist() == [size] * 8
                if rank == size - 1:
                    time.sleep(float(os.environ["DDL_TIMEOUT"]) * 4)  # a checkpoint that takes too long
                os.write(1, f"EXIT rank={rank} at={time.time():.3f}\n".encode())
                return  # no finalize: the exit guard's rendezvous is what is tested
            ddl.finalize()
        for name, _ in _PER_RANK.values():
            os.environ.pop(name, None)


def _subgroup_absent(scenario: str, rank: int, size: int) -> None:
    """A "ddl" subgroup of every rank that rank ``size - 1`` never creates (it stays busy past the
    deadline): the others must raise at the deadline naming it, not wait in MPI's Create_group."""
    import torch.distributed as dist

    import ddl_triton.torch  # noqa: F401  (registers "ddl")

    dist.init_process_group("ddl")
    if rank == size - 1:
        time.sleep(float(os.environ["DDL_TIMEOUT"]) + 3)
        _say(scenario, rank, "none", 0.0, "stayed away")
        return
    t0 = time.monotonic()
    try:
        dist.new_group(list(range(size)), backend="ddl")
    except Exception as e:  # noqa: BLE001
        _say(scenario, rank, type(e).__name__, time.monotonic() - t0, str(e).replace("\n", " "))
        raise
    _say(scenario, rank, "none", time.monotonic() - t0, "the subgroup was made")


if __name__ == "__main__":
    main()
