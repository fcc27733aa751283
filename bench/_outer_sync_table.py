"""The arithmetic of bench/outer_sync_across_hosts.py, apart from any rank or host (so a unit test
can check it): configuration names, time to a target loss, the rows of the results table, the best
configuration per link rate and the measured crossover.

Configuration names (``parse_config``):

    no-comm                     every rank trains alone at once: the layout's compute, no communication
    no-comm again               the same, later in the job: utilisation is against the no-comm rows' mean,
                                and their spread is the job's drift
    gloo fp32                   DDP on torch's gloo, full precision, every step
    ddl <c>                     DDP on "ddl" with Options.compression = c (fp32 = "none", auto, int8, ...)
    diloco H=<h>                ddl_triton.torch.DiLoCo, sync_every h, one fragment, fp32 pseudo-gradients
    streaming <c> H=<h> F=<f>   DiLoCo with f fragments, fragment_sync_delay h/f - 1, pseudo-gradients in c
    planner                     what plan_sync chose (``planner_config`` names it)

The target loss of a workload is ``TARGET_SLACK`` times the final eval loss of per-step fp32 on gloo
(the same math at every link rate: the same seeds, the same batches); time to target is the
training time (evaluation excluded) at the first evaluation from which the eval loss stays at or
below it to the end of the run.
"""
from __future__ import annotations

import re

TARGET_SLACK = 1.05
_LOCAL = ("no-comm", "no-comm again")
_OUTER = re.compile(r"^(diloco|streaming (\w+)) H=(\d+)(?: F=(\d+))?$")


def parse_config(name: str) -> dict:
    """A configuration's name as a dict (module doc); ValueError for a name that is none of them."""
    if name in _LOCAL:
        return {"kind": "local"}
    if name == "gloo fp32":
        return {"kind": "per-step", "backend": "gloo", "compression": "none"}
    if name.startswith("ddl ") and " " not in name[4:] and name[4:]:
        method = name[4:]
        return {"kind": "per-step", "backend": "ddl", "compression": "none" if method == "fp32" else method}
    m = _OUTER.match(name)
    if m and (m.group(1) == "diloco") == (m.group(4) is None):
        h, f = int(m.group(3)), int(m.group(4) or 1)
        if h < 1 or f < 1 or h % f:
            raise ValueError(f"configuration {name!r}: H must be a positive multiple of F")
        method = m.group(2) or "fp32"
        return {"kind": "outer", "sync_every": h, "fragments": f, "delay": h // f - 1 if f > 1 else 0,
                "compression": None if method == "fp32" else method}
    raise ValueError(f"unknown configuration {name!r}: no-comm, gloo fp32, ddl <method>, diloco H=<h>, "
                     f"streaming <method> H=<h> F=<f>, planner")


def planner_config(mode: str, compression: str, sync_every: int, fragments: int) -> str:
    """The configuration name of a ``SyncPlan``'s choice."""
    method = "fp32" if compression in (None, "none") else compression
    if mode == "per-step":
        return f"ddl {method}"
    if fragments == 1 and method == "fp32":
        return f"diloco H={sync_every}"
    return f"streaming {method} H={sync_every} F={fragments}"


def time_to_target(curve: list, target: float) -> float | None:
    """Training seconds at the first ``[step, seconds, eval_loss]`` point from which the eval loss
    stays at or below ``target`` to the end (a dip between two outer syncs, or a run that reaches
    the target and then diverges, has not reached it); None where the last point is above it."""
    reached = None
    for _, seconds, loss in reversed(curve):
        if loss > target:
            break
        reached = seconds
    return reached


def rows(result: dict) -> list[dict]:
    """One job's results (one workload at one link rate) as table rows: per configuration its time to
    the target, final eval loss and its change against per-step fp32, compute utilisation against
    no-comm, MB sent between hosts (every host's interface together), whether the replicas' hashes
    agree (None for no-comm, whose replicas train apart)."""
    by = {r["config"]: r for r in result["results"]}
    reference = by.get("gloo fp32")
    target = reference["final_eval_loss"] * TARGET_SLACK if reference else None
    local = [r["train_s"] for r in result["results"] if r["config"] in _LOCAL]
    base = sum(local) / len(local) if local else None
    out = []
    for r in result["results"]:
        name = r["config"]
        is_local = name in _LOCAL
        out.append({
            "config": name if name != "planner" else f"planner: {r.get('planned', '?')}",
            "time_to_target_s": time_to_target(r["curve"], target) if target is not None else None,
            "train_s": r["train_s"],
            "final_eval_loss": r["final_eval_loss"],
            "vs_per_step": r["final_eval_loss"] / reference["final_eval_loss"] - 1 if reference else None,
            "utilisation": base / r["train_s"] if base and not is_local else None,
            "mb_sent": sum(r["tx_bytes_per_host"]) / 1e6,
            "identical": None if is_local else len(set(r["digests"])) == 1,
        })
    return out


def best(table: list[dict]) -> dict | None:
    """The communicating row of least time to target (None where none reached it)."""
    reached = [r for r in table if r["time_to_target_s"] is not None and r["identical"] is not None]
    return min(reached, key=lambda r: r["time_to_target_s"], default=None)


def measured_crossover(per_rate: dict[float, list[dict]]) -> str:
    """Where outer sync starts to win, from {link bits per second: table rows}: the best per-step row's
    time to target against the best outer row's at each rate, as "between A and B" (outer wins at A,
    per-step at B, the next rate up), or what held at every rate measured."""
    def family(row: dict) -> str:
        name = row["config"].removeprefix("planner: ")
        return "outer" if name.startswith(("diloco", "streaming")) else "per-step"

    winners = []
    for rate in sorted(per_rate):
        table = [r for r in per_rate[rate] if r["identical"] is not None]
        top = {f: min((r["time_to_target_s"] for r in table if family(r) == f and r["time_to_target_s"] is not None),
                      default=None) for f in ("per-step", "outer")}
        if top["outer"] is not None and (top["per-step"] is None or top["outer"] < top["per-step"]):
            winners.append((rate, "outer"))
        elif top["per-step"] is not None:
            winners.append((rate, "per-step"))
    if not winners:
        return "no configuration reached the target"
    if all(w == "outer" for _, w in winners):
        return f"outer sync wins at every rate measured (up to {_rate(winners[-1][0])})"
    if all(w == "per-step" for _, w in winners):
        return f"per-step wins at every rate measured (down to {_rate(winners[0][0])})"
    for (low, a), (high, b) in zip(winners, winners[1:]):
        if a == "outer" and b == "per-step":
            return f"between {_rate(low)} (outer wins) and {_rate(high)} (per-step wins)"
    return "no single crossover: " + ", ".join(f"{_rate(r)} {w}" for r, w in winners)


def _rate(bits_per_s: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g} {unit}"
    return f"{bits_per_s:g} bit/s"


def markdown(table: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = ["| configuration | time to target s | train s | final eval loss | vs per-step fp32 | utilisation "
             "| MB between hosts | replicas identical |", "|---|---|---|---|---|---|---|---|"]
    for r in table:
        def f(x, fmt):
            return "-" if x is None else format(x, fmt)
        lines.append(f"| {r['config']} | {f(r['time_to_target_s'], '.2f') if r['identical'] is not None else '-'}"
                     f"{' (not reached)' if r['time_to_target_s'] is None and r['identical'] is not None else ''} "
                     f"| {r['train_s']:.2f} | {r['final_eval_loss']:.4f} | {f(r['vs_per_step'], '+.1%')} "
                     f"| {f(r['utilisation'], '.1%')} | {r['mb_sent']:.2f} "
                     f"| {'-' if r['identical'] is None else ('yes' if r['identical'] else 'NO')} |")
    return "\n".join(lines)
