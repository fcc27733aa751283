"""Add a schedule in 30 lines: write it, check it, force it, tune it, watch explain choose.

Run: ddlrun -n 2 -- python examples/custom_schedule.py [--max-bytes 64K] [--table t.json]

The schedule is a *star* allreduce: per chunk, every rank sends its data to the root, the
root reduces all n operands in rank order (one pass, so 16-bit data is rounded once) and
sends the result back. Two message latencies (one_shot has one) but the root alone
reduces, and the others only copy: a shape worth trying where reading is cheap and
reducing is not.

    chunk k:  r != root: send in[k] to root   ->  root: out[k] = in_0[k] + ... + in_{n-1}[k], send it
              r != root: out[k] = what the root sent
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch
from mpi4py import MPI

import ddl_triton as ddl
from ddl_triton import schedules
from ddl_triton.tuning import cli as tune
from ddl_triton.schedules import IN, OUT, Recv, Span, Step, assemble
from ddl_triton.schedules.partition import chunk_of, rounds


# -- 1. write it: a pure function (collective, nranks, count, chunk) -> Schedule ------------------
def build_star(collective, nranks, count, *, chunk_elems, root=0):
    drafts = [[] for _ in range(nranks)]
    others = tuple(r for r in range(nranks) if r != root)
    for k in range(rounds(count, chunk_elems)):
        start, size = chunk_of((0, count), k, chunk_elems)
        here, out = Span(IN, start, size), Span(OUT, start, size)
        for r in others:
            drafts[r].append(Step(size, src=here, send=(root,), label=f"to root chunk {k}"))
        drafts[root].append(Step(size, src=here, dst=out, recv=tuple(Recv(p, 0) for p in others),
                                 reduce=bool(others), local_pos=root, send=others, final=True,
                                 label=f"reduce chunk {k}"))
        for r in others:
            drafts[r].append(Step(size, dst=out, recv=(Recv(root, 0),), label=f"from root chunk {k}"))
    return assemble("star", collective, nranks, count, count, drafts, single_pass=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-bytes", default="64K", help="largest size the mini-sweep times")
    p.add_argument("--table", help="where to write the tuning table (default: a temporary file)")
    args = p.parse_args()
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    say = print if world.rank == 0 else (lambda *a, **k: None)

    # -- 2. register it and check it: IR validator + simulator, exact on integers -----------
    schedules.register("star", build_star, ["allreduce"])
    say(f"1-2. registered 'star'; schedules.check proved {schedules.check('star')} cases exact")

    # -- 3. force it: every allreduce of this communicator runs the star ------------------------
    forced = ddl.init(world.Dup(), schedule="star", tuning_file="off")
    for n in (0, 1, 7, 1000, 100_003):
        x = torch.arange(n, dtype=torch.int64) * (forced.rank + 1)
        forced.allreduce(x)
        assert torch.equal(x, torch.arange(n, dtype=torch.int64) * sum(range(1, forced.size + 1))), n
    say(f"3. forced: exact on {forced.size} ranks; explain: {forced.explain('allreduce', 4096)}")
    forced.close()

    # -- 4. tune it: ddl-tune's sweep knows every registered schedule ---------------------------
    # A table in a private folder of rank 0's making (mkdtemp: 0700, a fresh name), its path sent as bytes.
    folder = tempfile.mkdtemp(prefix="ddl_star_") if world.rank == 0 and not args.table else ""
    path = args.table or _bcast_text(world, os.path.join(folder, "star.json") if folder else "")
    tune.main(["--quick", "--collectives", "allreduce", "--max-bytes", args.max_bytes, "--out", path,
               "--no-cache", "--no-validate", "--quiet"])

    # -- 5. explain: where the table says it wins, the planner picks it -------------------------
    comm = ddl.init(world.Dup(), tuning_file=path)
    picked = 0
    for nbytes in tune.geometric_sizes(8, tune.parse_bytes(args.max_bytes), 4):
        plan = comm.explain("allreduce", nbytes)
        picked += plan.schedule == "star"
        say(f"5. {nbytes:>8} B: {plan.schedule:<9} {plan.reason}")
    say(f"# star chosen at {picked} size(s); table {path}")
    comm.close()
    if folder:
        shutil.rmtree(folder)
    return 0


def _bcast_text(world, text: str) -> str:
    """Rank 0's ``text`` on every rank, as bytes over MPI's buffer ``Bcast`` (nothing pickled)."""
    raw = torch.zeros(1024, dtype=torch.uint8)
    if world.rank == 0:
        data = text.encode()[:1024]
        raw[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    world.Bcast(raw.numpy(), root=0)
    return bytes(raw.numpy()).rstrip(b"\0").decode()


if __name__ == "__main__":
    sys.exit(main())
