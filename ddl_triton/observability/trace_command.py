"""Read what a job recorded: merge timelines, summarise them, diagnose a hang, draw a picture.

    python -m ddl_triton.trace merge DIR -o job.json      # one Chrome trace for every rank
    python -m ddl_triton.trace summary DIR                # per-collective totals
    python -m ddl_triton.trace why DIR                    # diagnosis from one job's flight-recorder dumps
    python -m ddl_triton.trace plot DIR -o timeline.png   # the timeline as a picture (matplotlib)

``DIR`` holds ``trace-rank<R>.json`` files (``DDL_TRACE=DIR``, ddl_triton/observability/tracer.py) or
``flight-rank<R>.json`` dumps (``DDL_DUMP_DIR``, ddl_triton/observability/flight.py; by default a
folder per job in ``$TMPDIR/ddl_triton-flight-<uid>``, which ``why`` also takes: its newest job).

merge: every rank's events on rank 0's clock (each file's measured offset added); the
output's metadata, and the command, state the alignment error bound (the largest half
round trip of the ping-pongs that measured the offsets).

summary, per collective (all ranks, all calls): calls, mean time per call, bytes per call,
bus bandwidth (nccl-tests' busbw from the mean time), and the share of the traced wall
time the ranks spent in the collective and waiting inside it (the steps' ``wait``
phases: for a slot to send from, or for a peer's message). Calls on the small-message
path have no step spans, so their waiting is counted in the collective's time only.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

from .._private_files import save_figure, write_private_file
from ..schedules import bus_factor


def load_traces(folder: str) -> dict[int, dict]:
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "trace-rank*.json"))):
        with open(path) as f:
            data = json.load(f)
        out[int(data["metadata"]["rank"])] = data
    if not out:
        raise SystemExit(f"no trace-rank<R>.json files in {folder} (was DDL_TRACE set to it?)")
    return out


def merge(folder: str) -> dict:
    """One trace of every rank, on rank 0's clock (see the module doc)."""
    traces = load_traces(folder)
    events, bounds, dropped = [], {}, 0
    for rank, data in sorted(traces.items()):
        meta = data["metadata"]
        offset = meta.get("clock_offset_us", 0.0)
        bounds[rank] = meta.get("offset_bound_us", 0.0)
        dropped += meta.get("dropped_events", 0)
        for e in data["traceEvents"]:
            if "ts" in e:
                e = dict(e, ts=e["ts"] + offset)
            events.append(e)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "metadata": {"format": "ddl_triton-trace-merged", "ranks": sorted(traces),
                         "clock_alignment_bound_us": max(bounds.values()) if bounds else 0.0,
                         "offset_bound_us_per_rank": bounds, "dropped_events": dropped}}


def summary(folder: str) -> list[dict]:
    """Per-collective totals over every rank (see the module doc)."""
    traces = load_traces(folder)
    nranks = max(d["metadata"].get("size", len(traces)) for d in traces.values())
    rows: dict[str, dict] = {}
    wall = 0.0
    for data in traces.values():
        events = [e for e in data["traceEvents"] if e.get("ph") == "X"]
        if not events:
            continue
        wall += max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
        calls = sorted((e for e in events if e.get("cat") == "ddl.collective"), key=lambda e: e["ts"])
        waits = sorted((e for e in events if e.get("cat") == "ddl.phase" and e["name"] == "wait"), key=lambda e: e["ts"])
        for e in calls:
            name = e["name"].split(" #")[0]
            row = rows.setdefault(name, {"collective": name, "calls": 0, "durations": [], "bytes": 0, "wait_us": 0.0})
            row["calls"] += 1
            row["durations"].append(e["dur"])
            row["bytes"] += e.get("args", {}).get("bytes", 0)
            row["wait_us"] += sum(w["dur"] for w in waits if w["tid"] == e["tid"] and e["ts"] <= w["ts"] < e["ts"] + e["dur"])
    out = []
    for name, row in sorted(rows.items()):
        mean_us = statistics.fmean(row["durations"])
        per_call = row["bytes"] / row["calls"]
        out.append({"collective": name, "calls": row["calls"], "mean_us": mean_us, "total_ms": sum(row["durations"]) / 1e3,
                    "bytes_per_call": per_call,
                    "busbw_gbps": per_call / (mean_us * 1e-6) / 1e9 * bus_factor(name, nranks) if mean_us else 0.0,
                    "time_share": sum(row["durations"]) / wall if wall else 0.0,
                    "wait_share": row["wait_us"] / wall if wall else 0.0})
    return out


def overlap(folder: str) -> dict:
    """How much async collective time ran while the issuing thread was still issuing.

    The async collectives a thread issues between two of its synchronous collectives form a
    burst (in DDP, one backward pass: one per gradient bucket, then the loop's own sync
    call). A collective's run time counts as overlapped where it falls between the burst's
    first and last issue, when the issuing thread was demonstrably still working (DDP's
    backward producing the next buckets). Also: per burst, each rank's time spent waiting
    inside its collectives (the steps' wait phases): the critical path between the ranks.
    """
    traces = load_traces(folder)
    run_total = run_overlapped = 0.0
    bursts = 0
    waits: dict[int, list[float]] = {}

    def key(e: dict) -> tuple[int, int]:  # (communicator, sequence number)
        return e.get("args", {}).get("comm", 0), int(e["name"].rsplit("#", 1)[1])

    for rank, data in traces.items():
        events = data["traceEvents"]
        issued = {key(e): e for e in events if e.get("ph") == "b"}
        spans = {key(e): e for e in events if e.get("cat") == "ddl.collective"}
        wait_phases = [e for e in events if e.get("cat") == "ddl.phase" and e["name"] == "wait"]
        groups: list[list[tuple[int, int]]] = []
        previous = None
        for k in sorted(spans):
            if k not in issued:
                previous = None           # a synchronous call ends the burst
                continue
            if previous is None or previous[0] != k[0]:
                groups.append([])
            groups[-1].append(k)
            previous = k
        for group in groups:
            first, last = issued[group[0]]["ts"], issued[group[-1]]["ts"]
            burst_wait = 0.0
            for k in group:
                span = spans[k]
                start, end = span["ts"], span["ts"] + span["dur"]
                run_total += span["dur"]
                run_overlapped += max(0.0, min(end, last) - max(start, first))
                burst_wait += sum(w["dur"] for w in wait_phases if w["tid"] == span["tid"] and start <= w["ts"] < end)
            waits.setdefault(rank, []).append(burst_wait)
            bursts += 1
    return {"bursts": bursts, "async_run_us": run_total, "overlapped_us": run_overlapped,
            "share": run_overlapped / run_total if run_total else 0.0,
            "wait_per_burst_us": {r: statistics.median(w) for r, w in sorted(waits.items()) if w}}


def plot(folder: str, path: str, first_ms: float = 0.0, span_ms: float | None = None) -> None:
    """Draw the merged timeline (collectives, steps and wait phases per rank and thread)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    merged = merge(folder)
    events = [e for e in merged["traceEvents"] if e.get("ph") == "X"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in merged["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    t0 = min(e["ts"] for e in events) + first_ms * 1e3
    t1 = t0 + span_ms * 1e3 if span_ms else max(e["ts"] + e["dur"] for e in events)
    lanes = sorted({(e["pid"], e["tid"]) for e in events}, key=lambda k: (k[0], str(k[1])))
    colours = {"ddl.collective": "#4c72b0", "ddl.step": "#55a868", "ddl.phase": "#c44e52", "torch": "#8172b2"}
    height = {"ddl.collective": 0.8, "ddl.step": 0.55, "ddl.phase": 0.3}
    fig, ax = plt.subplots(figsize=(11, 0.8 + 0.7 * len(lanes)))
    layer = {"ddl.collective": 0, "ddl.step": 1, "ddl.phase": 2}  # draw nested spans on top of their parents
    events.sort(key=lambda e: layer.get(e.get("cat", ""), 0))
    for i, lane in enumerate(lanes):
        for e in events:
            if (e["pid"], e["tid"]) != lane or e["ts"] + e["dur"] < t0 or e["ts"] > t1:
                continue
            cat = e.get("cat", "")
            if cat == "ddl.phase" and e["name"] != "wait":
                continue
            h = height.get(cat, 0.8)
            ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 0.002))], (i - h / 2, h),
                           facecolors=colours.get(cat, "#999999"))
        issues = [(e["ts"] - t0) / 1e3 for e in merged["traceEvents"]
                  if e.get("ph") == "b" and (e["pid"], e["tid"]) == lane and t0 <= e["ts"] <= t1]
        if issues:
            ax.plot(issues, [i] * len(issues), "|", color="black", markersize=14)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"rank {p} {names.get((p, t), t)}" for p, t in lanes], fontsize=8)
    ax.set_xlabel("ms (rank 0's clock)")
    ax.set_xlim(0, (t1 - t0) / 1e3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#4c72b0", "#55a868", "#c44e52")]
    handles.append(plt.Line2D([], [], color="black", marker="|", linestyle="", markersize=10))
    ax.legend(handles, ["collective", "step", "wait (inside a step)", "async issue (e.g. a DDP bucket)"], fontsize=8,
              loc="upper right")
    bound = merged["metadata"]["clock_alignment_bound_us"]
    ax.set_title(f"ddl_triton timeline ({len(merged['metadata']['ranks'])} ranks; clocks aligned within {bound:.0f} us)",
                 fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddl_triton.trace", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge the ranks' timelines onto rank 0's clock")
    m.add_argument("folder")
    m.add_argument("-o", "--out", required=True)
    s = sub.add_parser("summary", help="per-collective totals: time, bytes, busbw, waiting")
    s.add_argument("folder")
    w = sub.add_parser("why", help="diagnose a hang or failure from flight-recorder dumps")
    w.add_argument("folder")
    g = sub.add_parser("plot", help="draw the merged timeline as a PNG (matplotlib)")
    g.add_argument("folder")
    g.add_argument("-o", "--out", required=True)
    g.add_argument("--from-ms", type=float, default=0.0, help="start this long after the first event")
    g.add_argument("--span-ms", type=float, default=None, help="draw this many milliseconds")
    args = p.parse_args(argv)
    if args.command == "merge":
        merged = merge(args.folder)
        write_private_file(args.out, json.dumps(merged))
        meta = merged["metadata"]
        print(f"merged {len(meta['ranks'])} ranks ({len(merged['traceEvents'])} events) into {args.out}; clocks "
              f"aligned to rank 0 within {meta['clock_alignment_bound_us']:.1f} us"
              + (f"; {meta['dropped_events']} events were dropped (buffer full)" if meta["dropped_events"] else ""))
    elif args.command == "summary":
        rows = summary(args.folder)
        print(f"{'collective':>14} {'calls':>7} {'mean us':>9} {'total ms':>9} {'bytes/call':>11} {'busbw GB/s':>10} "
              f"{'time %':>7} {'wait %':>7}")
        for r in rows:
            print(f"{r['collective']:>14} {r['calls']:>7} {r['mean_us']:>9.1f} {r['total_ms']:>9.2f} "
                  f"{r['bytes_per_call']:>11.0f} {r['busbw_gbps']:>10.2f} {100 * r['time_share']:>6.1f}% "
                  f"{100 * r['wait_share']:>6.1f}%")
        print("# time %: share of the ranks' traced wall time inside the collective; wait %: inside it, waiting "
              "for a slot or a peer's message")
        o = overlap(args.folder)
        if o["bursts"]:
            print(f"# async collectives: {o['bursts']} bursts (e.g. DDP backward passes); {100 * o['share']:.0f}% of "
                  f"their run time ({o['overlapped_us'] / 1e3:.1f} of {o['async_run_us'] / 1e3:.1f} ms) overlapped "
                  "the issuing thread's work between a burst's first and last issue")
            per_rank = ", ".join(f"rank {r} {w:.0f} us" for r, w in o["wait_per_burst_us"].items())
            print(f"# waiting inside the collectives per burst (median): {per_rank}")
    elif args.command == "why":
        from .diagnose import diagnose, load_job
        dumps, notes = load_job(args.folder)
        for line in diagnose(dumps) + notes:
            print(line)
    else:
        plot(args.folder, args.out, args.from_ms, args.span_ms)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
