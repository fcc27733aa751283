"""How well the fitted cost model predicts sizes the sweep skipped (the table's ``model.validation``).

At the geometric midpoint between every two swept sizes (every other one with ``--quick``),
the runtime's own choice under the new table is timed (one finalist, the race's interleaved
rounds) and compared with the fitted model's prediction of that same choice. Every rank
runs this (it communicates); rank 0 keeps the rows.
"""
from __future__ import annotations

import math
import statistics

from .race import Race, calls_for, forced


def validate(args, world, comm, table, rows: list[dict]) -> list[dict]:
    """One row per midpoint size: the plan chosen, its measured and predicted time, and
    the relative error (predicted - measured) / measured."""
    import torch

    from .. import schedules
    from ..planning.planner import Planner

    planner = Planner(rank=comm.rank, size=comm.size, topology=comm.topology, link_of=comm.placement.link,
                      forced="", slot_bytes=comm.options.chunk_bytes, table=table, table_source="this sweep",
                      wire_chunk_bytes=comm.options.wire_chunk_bytes)
    planner.small_path = comm.planner.small_path
    race = Race(world, args.target_ms / 1e3, args.rounds, 1)
    out = []
    swept = sorted({(r["collective"], r["dtype"], r["bytes"]) for r in rows if "depth" in r})
    by_shape: dict = {}
    for c, d, b in swept:
        by_shape.setdefault((c, d), []).append(b)
    for (collective, dtype_name), sizes in by_shape.items():
        mids = [int(math.sqrt(a * b)) for a, b in zip(sizes, sizes[1:])]
        if args.quick:
            mids = mids[::2]
        dtype = getattr(torch, dtype_name)
        elem = dtype.itemsize
        for nbytes in mids:
            made = calls_for(collective, nbytes // elem, comm.size, dtype)
            if made is None:
                continue
            call, numel = made
            plan = planner.plan(collective, numel * elem, dtype)
            count = schedules.count_for(collective, numel, comm.size)
            small = collective == "allreduce" and plan.schedule == "one_shot" and planner.small_path(numel * elem, dtype)
            predicted = planner.model_time(plan.schedule, collective, count, plan.chunk_elems, elem, plan.grid,
                                           plan.algos, small=small)
            times, _ = race.run({"plan": forced(comm, call, plan)})
            measured = statistics.median(times["plan"])
            out.append({"collective": collective, "dtype": dtype_name, "bytes": numel * elem,
                        "schedule": plan.schedule, "measured_us": round(measured * 1e6, 3),
                        "predicted_us": round(predicted * 1e6, 3),
                        "error": round((predicted - measured) / measured, 4)})
    return out
