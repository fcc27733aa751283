"""Does the tuned default pick the fastest schedule? The tuned allreduce against every forced one, in one run.

Run under the launcher, on the topology the table was made for:

    ddlrun -n 2 -- python bench/tuned_vs_forced.py --table t.json [--json out.json]
    ddlrun -n 4 --topology 2x2 -- python bench/tuned_vs_forced.py --table t2x2.json

For every allreduce size the table measured (fp32), it times, in interleaved rounds of
one run: the default communicator with ``DDL_TUNING_FILE`` = the table (whatever the
planner chooses, with the table's slot layout), and one communicator per schedule forced
with ``Options.schedule`` (default chunking, no table). Each measurement starts after a
barrier and takes the slowest rank's time per call; the table quotes medians. ``ratio`` =
fastest forced / tuned (>= 0.9 means the tuned default is within 10% of the best forced
schedule; above 1, the table's chunk or depth beats every forced default).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from mpi4py import MPI

import ddl_triton as ddl
from ddl_triton import schedules
from ddl_triton.planning import tuning_table
from ddl_triton.tuning.timing import iterations, time_per_call


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", required=True)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--target-ms", type=float, default=5.0)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    table = tuning_table.load(args.table)
    sizes = [e["bytes"] for e in table.entries.get("allreduce", {}).get("float32", [])]
    tuned = ddl.init(world.Dup(), tuning_file=args.table)
    multi_level = len(tuned.topology.dims) > 1
    names = [n for n in schedules.names() if schedules.supports(n, "allreduce")
             and (multi_level or not schedules.uses_grid(n))]
    forced = {n: ddl.init(world.Dup(), schedule=n, tuning_file="off") for n in names}
    rows = []
    if world.rank == 0:
        print(f"# tuned (table {args.table}) vs every forced schedule, allreduce fp32, {world.size} ranks, topology "
              f"{tuned.topology.signature}; medians of {args.rounds} interleaved rounds, slowest rank per call")
        print(f"{'bytes':>10} {'tuned picks':>13} {'tuned us':>10} {'best forced':>13} {'forced us':>10} "
              f"{'ratio':>6} ok")
    for nbytes in sizes:
        buf = torch.ones(max(1, nbytes // 4))
        comms = {"tuned": tuned, **forced}
        iters = {k: iterations(args.target_ms / 1e3, time_per_call(world, lambda c=c: c.allreduce(buf), 1))
                 for k, c in comms.items()}
        times = {k: [] for k in comms}
        for r in range(args.rounds):
            order = list(comms)
            order = order[r % len(order):] + order[: r % len(order)]
            for k in order:
                times[k].append(time_per_call(world, lambda k=k: comms[k].allreduce(buf), iters[k]))
        med = {k: statistics.median(v) for k, v in times.items()}
        best = min(forced, key=lambda n: med[n])
        ratio = med[best] / med["tuned"]
        picked = tuned.explain("allreduce", nbytes).schedule
        rows.append({"bytes": nbytes, "tuned_schedule": picked, "tuned_us": med["tuned"] * 1e6, "best_forced": best,
                     "best_forced_us": med[best] * 1e6, "ratio": ratio,
                     "forced_us": {n: med[n] * 1e6 for n in forced}})
        if world.rank == 0:
            print(f"{nbytes:>10} {picked:>13} {med['tuned'] * 1e6:>10.1f} {best:>13} {med[best] * 1e6:>10.1f} "
                  f"{ratio:>6.2f} {'yes' if ratio >= 0.9 else 'NO'}", flush=True)
    if world.rank == 0:
        ok = sum(r["ratio"] >= 0.9 for r in rows)
        print(f"# within 10% of the fastest forced schedule at {ok} of {len(rows)} sizes; "
              f"median ratio {statistics.median(r['ratio'] for r in rows):.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": world.size, "topology": tuned.topology.signature, "table": args.table,
                           "rows": rows}, f, indent=1)
    for c in forced.values():
        c.close()
    tuned.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
