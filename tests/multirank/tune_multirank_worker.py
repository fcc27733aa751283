"""Runtime use of tuning tables on several ranks (run by tests/multirank/test_tune_multirank.py under mpiexec).

    python tune_multirank_worker.py TABLE BAD_DIR

TABLE is a table ddl-tune made for this world; BAD_DIR holds broken variants written by the
test. Each case prints one line "CASE name rank=R ok=1|0 detail=..." and the job exits 0
when every case behaved as documented on this rank.
"""
from __future__ import annotations

import sys
import warnings

import torch
from mpi4py import MPI

import ddl_triton as ddl
from ddl_triton.planning import tuning_table
from support.report import print_line

world = MPI.COMM_WORLD
failures = 0


def report(name: str, ok: bool, detail: str) -> None:
    global failures
    failures += not ok
    print_line(f"CASE {name} rank={world.rank} ok={int(ok)} detail={detail}")


def expect_error(name: str, kind, needle: str, **options) -> None:
    try:
        ddl.init(world.Dup(), **options).close()
    except kind as e:
        report(name, needle in str(e) and f"rank {world.rank}" in str(e), str(e)[:300])
    else:
        report(name, False, "no error")


def main() -> int:
    table_path, bad = sys.argv[1], sys.argv[2]
    table = tuning_table.load(table_path)
    measured = table.entries["allreduce"]["float32"]

    # The table is used: explain names it, the chosen schedule runs exactly.
    comm = ddl.init(world.Dup(), tuning_file=table_path)
    plan = comm.explain("allreduce", measured[-1]["bytes"])
    report("tuned-explain", plan.reason.startswith(f"tuned ({table_path}): measured ")
           and plan.schedule == measured[-1]["schedule"], str(plan))
    beyond = comm.explain("allreduce", measured[-1]["bytes"] * 64)
    report("beyond-range", f"cost model fitted from {table_path}" in beyond.reason, str(beyond))
    report("slot-layout", (comm.options.chunk_bytes, comm.options.pipeline_depth)
           == (table.options["chunk_bytes"], table.options["pipeline_depth"]), str(comm.options))
    exact = True
    for e in measured:
        n = max(1, e["bytes"] // 8)
        x = torch.arange(n, dtype=torch.int64) + world.rank
        comm.allreduce(x)
        want = torch.arange(n, dtype=torch.int64) * world.size + sum(range(world.size))
        exact &= torch.equal(x, want)
    report("tuned-exact", exact, f"{len(measured)} sizes")
    comm.close()

    # Bad tables: a corrupt named file refuses on every rank; one from elsewhere is ignored
    # with a warning naming the key; unknown schedules are dropped with their names.
    expect_error("corrupt", tuning_table.TuningTableError, "not valid JSON", tuning_file=f"{bad}/corrupt.json")
    expect_error("missing", tuning_table.TuningTableError, "no such file", tuning_file=f"{bad}/missing.json")
    for name, needle in (("elsewhere", "world_size: table 99"), ("unknown-schedule", "mystery")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = ddl.init(world.Dup(), tuning_file=f"{bad}/{name}.json")
            reason = c.explain("allreduce", measured[0]["bytes"]).reason
            c.close()
        said = [str(w.message) for w in caught]
        if world.rank == 0:
            report(name, any(needle in s for s in said), "; ".join(said)[:300] + f" | {reason}")
        else:
            report(name, not said, "warns on rank 0 only")

    # Ranks that loaded different tables refuse, all of them, saying who had what.
    mine = table_path if world.rank == 0 else "off"
    expect_error("different-tables", ValueError, "loaded different tuning tables", tuning_file=mine)

    # The init trap: options that the existing world communicator cannot honour raise.
    ddl.init(tuning_file=table_path)
    try:
        ddl.init(MPI.COMM_WORLD, schedule="ring")
    except ValueError as e:
        report("init-trap", "already exists and cannot take schedule='ring'" in str(e), str(e)[:200])
    else:
        report("init-trap", False, "no error")
    report("init-same", ddl.init() is ddl.init(MPI.COMM_WORLD), "")
    ddl.finalize()
    return 1 if world.allreduce(failures) else 0


if __name__ == "__main__":
    sys.exit(main())
