"""What the measurements decide: the tuning table ``ddl-tune`` writes.

From the sweep's rows (ddl_triton/tuning/sweep.py): the communicator layout best overall
(``choose_layout``), the winner, runner-up and every schedule's best time per (collective,
dtype, size) within that layout (``entries``), the peers' times, and the cost model's
parameters fitted by least squares to every timed candidate's median (``fit_model``,
ddl_triton/tuning/fit.py). ``build_table`` puts them together (ddl_triton/planning/tuning_table.py
documents the schema); rank 0 builds it and broadcasts it, so every rank holds the same.
"""
from __future__ import annotations

import dataclasses
import math


def choose_layout(rows: list[dict]) -> tuple[int, int]:
    """The communicator layout (slot bytes = pipeline chunk, pipeline depth) whose best times
    are best overall: the smallest geometric mean, over call shapes, of (best time with that
    layout / best time with any). One layout serves every call at run time (the shm
    segment is sized once), so it is chosen as a whole."""
    best: dict = {}
    for r in rows:
        if "depth" in r:
            d = best.setdefault((r["collective"], r["dtype"], r["bytes"]), {})
            layout = (r["chunk_bytes"], r["depth"])
            d[layout] = min(d.get(layout, math.inf), r["median_us"])
    layouts = sorted({lay for d in best.values() for lay in d})
    scores = {}
    for layout in layouts:
        logs = [math.log(d[layout] / min(d.values())) for d in best.values() if layout in d]
        scores[layout] = sum(logs) / len(logs) if logs else math.inf
    return min(layouts, key=lambda lay: (scores[lay], lay))


def entries(rows: list[dict], layout: tuple[int, int]) -> dict:
    """Per (collective, dtype, size): the winner with ``layout`` (slot bytes, depth), the
    runner-up, and each schedule's best measured time (the tuning table's "entries")."""
    groups: dict = {}
    for r in rows:
        if (r.get("chunk_bytes"), r.get("depth")) == tuple(layout):
            groups.setdefault((r["collective"], r["dtype"], r["bytes"]), []).append(r)
    out: dict = {}
    for (collective, dtype, nbytes), rs in sorted(groups.items()):
        # Finalists' medians come from every interleaved round; the others' from the pruning
        # rounds only, so a finalist's time is preferred wherever there is one.
        ranked = sorted(rs, key=lambda r: (not r["finalist"], r["median_us"]))
        win = ranked[0]
        by_schedule: dict = {}
        for r in ranked:
            by_schedule.setdefault(r["schedule"], round(r["median_us"], 3))
        # The runner-up: the best other schedule (what explain compares), else another chunk.
        others = [r for r in ranked[1:] if r["schedule"] != win["schedule"]] or ranked[1:]
        entry = {"bytes": nbytes, "schedule": win["schedule"], "chunk_bytes": win["chunk_bytes"],
                 "algos": win["algos"], "time_us": round(win["median_us"], 3), "p20_us": round(win["p20_us"], 3),
                 "p80_us": round(win["p80_us"], 3), "by_schedule": by_schedule}
        if others:
            ru = others[0]
            entry["runner_up"] = {"schedule": ru["schedule"], "chunk_bytes": ru["chunk_bytes"], "algos": ru["algos"],
                                  "time_us": round(ru["median_us"], 3)}
        out.setdefault(collective, {}).setdefault(dtype, []).append(entry)
    return out


def fit_model(rows: list[dict], comm) -> tuple:
    """Least-squares cost model from every timed candidate's median (ddl_triton/tuning/fit.py):
    finalists and pruned candidates alike, so that the model has seen every schedule and
    chunking, not only the winners (the simulator predicts forced, untuned choices too)."""
    import torch

    from .. import schedules
    from ..planning.costmodel import last_level_cache_bytes
    from .fit import Sample, fit

    planner = comm.planner
    samples = []
    for r in rows:
        if "depth" not in r or r["bytes"] == 0:
            continue
        elem = getattr(torch, r["dtype"]).itemsize
        count = schedules.count_for(r["collective"], r["bytes"] // elem, comm.size)
        chunk = max(1, r["chunk_bytes"] // elem)  # each layout's slot holds exactly its chunk
        grid = comm.topology.dims if schedules.uses_grid(r["schedule"]) else None
        algos = tuple(r["algos"]) if r["algos"] else None

        small = r["collective"] == "allreduce" and r["schedule"] == "one_shot" and \
            planner.small_path(r["bytes"], getattr(torch, r["dtype"]))

        def terms(model, r=r, count=count, chunk=chunk, grid=grid, algos=algos, elem=elem, small=small):
            return planner.model_terms(r["schedule"], r["collective"], count, chunk, elem, grid, algos, model, small)
        samples.append(Sample(terms, r["median_us"] / 1e6, f"{r['collective']} {r['bytes']} B {r['schedule']}"))
    start = dataclasses.replace(planner.model, cache_bytes=last_level_cache_bytes())
    return fit(samples, start)


def build_table(args, rows: list[dict], comm, size: int):
    """The tuning table of this sweep (no validation yet, no creation time: the command adds them)."""
    from ..planning import tuning_table

    key = tuning_table.machine_key(world_size=size, topology=comm.topology.signature, transport=comm.options.transport)
    layout = choose_layout(rows) if any("depth" in r for r in rows) else (max(args.chunks), args.depths[0])
    table = tuning_table.TuningTable(key=key, options={"chunk_bytes": layout[0], "pipeline_depth": layout[1]},
                               entries=entries(rows, layout), measurements=rows)
    table.peers = _peer_times(rows)
    if any("depth" in r for r in rows):
        report = fit_model(rows, comm)
        table.model = report.model
        table.model_info = {"fit": {"samples": report.samples, "median_abs_rel_error": round(report.median_abs_rel_error, 4),
                                    "max_abs_rel_error": round(report.max_abs_rel_error, 4),
                                    "not_fitted": list(report.not_fitted), "rounds": report.rounds}}
    return table


def _peer_times(rows: list[dict]) -> dict:
    """{peer: {size: median us}} for MPICH's and gloo's rows."""
    out: dict = {}
    for r in rows:
        if "peer" in r:
            out.setdefault(r["peer"], {})[str(r["bytes"])] = round(r["median_us"], 3)
    return out
