"""Draw a tuning table's sweep: bus bandwidth against size, one line per schedule, per collective.

For each collective (one panel each), every schedule's best measured time at each size
becomes a busbw point (nccl-tests' definition: algbw = bytes / time, times 2(n-1)/n for
allreduce, (n-1)/n for reduce_scatter and all_gather, 1 for broadcast and all_to_all);
the table's chosen envelope is the thick line; MPICH and gloo are dashed when the sweep
timed them (``ddl-tune --peers``). Crossovers are where the chosen schedule changes: they
are marked with vertical lines and listed in the title. Needs matplotlib (``.[plot]``).
"""
from __future__ import annotations

from .._private_files import save_figure
from ..schedules import bus_factor
from ..planning.tuning_table import TuningTable


def crossovers(rows: list[dict]) -> list[tuple[int, str, str]]:
    """[(bytes, before, after)] where the chosen schedule changes between measured sizes."""
    return [(b["bytes"], a["schedule"], b["schedule"]) for a, b in zip(rows, rows[1:]) if a["schedule"] != b["schedule"]]


def plot(table: TuningTable, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("ddl-tune --plot needs matplotlib: pip install 'ddl_triton[plot]'") from None
    n = table.key.get("world_size", 2)
    panels = [(c, d, rows) for c, by_dtype in table.entries.items() for d, rows in by_dtype.items() if rows]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.6 * len(panels)), squeeze=False)
    for ax, (collective, dtype, rows) in zip(axes[:, 0], panels):
        f = bus_factor(collective, n)
        schedules = sorted({s for r in rows for s in r["by_schedule"]})
        for name in schedules:
            pts = [(r["bytes"], r["bytes"] / (r["by_schedule"][name] * 1e-6) / 1e9 * f) for r in rows
                   if name in r["by_schedule"] and r["bytes"] > 0]
            if pts:
                ax.plot(*zip(*pts), marker=".", linewidth=1, alpha=0.8, label=name)
        chosen = [(r["bytes"], r["bytes"] / (r["time_us"] * 1e-6) / 1e9 * f) for r in rows if r["bytes"] > 0]
        ax.plot(*zip(*chosen), color="black", linewidth=3, alpha=0.35, label="chosen (table)")
        if collective == "allreduce":
            for peer, times in table.peers.items():
                pts = sorted((int(b), int(b) / (t * 1e-6) / 1e9 * f) for b, t in times.items() if int(b) > 0)
                if pts:
                    ax.plot(*zip(*pts), linestyle="--", linewidth=1.5, label=peer)
        marks = crossovers(rows)
        for b, _, _ in marks:
            ax.axvline(b, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("busbw GB/s")
        where = "; ".join(f"{a}->{b} at {size} B" for size, a, b in marks[:3]) or "no crossover"
        where += f"; {len(marks) - 3} more" if len(marks) > 3 else ""
        ax.set_title(f"{collective} {dtype}, {n} ranks, topology {table.key.get('topology')}: {where}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    save_figure(fig, path, dpi=90)
    plt.close(fig)
