"""train_scaling.py's tables: the run's result (train_scaling.run's dict) printed as rank 0 ends.

``print_result(result)``: the header (model, layout, rounds; across hosts, the links and fp32's
bound from DDP's buckets), one row per mode (step and CPU time, img/s, the paired shares, link
bytes and bound, identical replicas), then the exposed communication per mode (median [p25-p75]
over rounds, skew included, the wire bound and its multiple, the share of no-comm with its
spread), then the per-level compression notes.
"""
from __future__ import annotations

def _pct(x: float | None) -> str:
    return f"{x:.1%}" if x else "-"


def print_result(result: dict) -> None:
    view = ", gradient_as_bucket_view" if result["gradient_as_bucket_view"] else ""
    view += f", bucket cap {result['bucket_cap_mb']} MB" if result["bucket_cap_mb"] is not None else ""
    layout = f"{result['hosts']} hosts x {'/'.join(map(str, result['ranks_per_host']))} ranks" \
        if result["hosts"] > 1 else f"{result['ranks']} ranks"
    print(f"# {result['model']}: {result['params'] / 1e6:.2f}M parameters, batch {result['batch_per_rank']} per "
          f"rank, {layout}, median of {result['rounds']} rounds x {result['steps']} steps{view}")
    across = result["link_rate"] is not None
    if across:
        sizes = ", ".join(f"{b / 1e6:.2f}" for b in result["bucket_sizes"])
        print(f"# links {result['link_rate']}; DDP buckets (MB, in reduction order) {sizes}: the last needs "
              f"{result['fp32_last_bucket_link_ms']:.1f} ms on the link in fp32 (2(H-1)/H*S), so fp32 is bound at "
              f"{_pct(result['fp32_bound'])} of no-comm")
    print(f"{'mode':>16} {'step ms':>9} {'cpu ms':>8} {'img/s':>8} {'efficiency':>10} {'of ceiling':>10} "
          f"{'of no-comm':>10}" + (f" {'link MB':>8} {'bound':>7}" if across else "") + f" {'identical':>9}")
    for row in result["rows"]:
        same = {None: "-", True: "yes", False: "NO"}[row["identical"]]
        link = ""
        if across:
            mb = f"{row['link_bytes_per_step'] / 1e6:.2f}" if row["link_bytes_per_step"] is not None else "-"
            link = f" {mb:>8} {_pct(row['bound']):>7}"
        print(f"{row['mode']:>16} {row['step_ms']:>9.2f} {row['cpu_ms']:>8.2f} {row['img_per_s']:>8.1f} "
              f"{_pct(row['efficiency']):>10} {_pct(row['of_ceiling']):>10} {_pct(row['of_no_comm']):>10}{link} "
              f"{same:>9}", flush=True)
    print(f"# exposed: from the last bucket's hand-off to every bucket's completion, per step (the last rank "
          f"to end backward; 'skew incl.': the first), median [p25-p75] of {result['rounds']} rounds")
    print(f"{'mode':>16} {'exposed ms':>22} {'skew incl. ms':>14}" + (f" {'wire ms':>8} {'x wire':>7}" if across
                                                                        else "") + f" {'of no-comm [p25-p75]':>22}")
    for row in result["rows"]:
        q, skew, wire = row["exposed_ms_quartiles"], row["exposed_skew_ms_quartiles"], row["wire_bound_ms"]
        if q is None:
            continue
        share = row["of_no_comm_quartiles"]
        share = f"{share[1]:.1%} [{share[0]:.1%}-{share[2]:.1%}]" if share else "-"
        bound = ""
        if across:
            ratio = f"{q[1] / wire:.2f}" if wire and wire >= 0.01 else "-"  # not of lockstep's 4 bytes
            bound = f" {wire:>8.2f} {ratio:>7}" if wire is not None else f" {'-':>8} {'-':>7}"
        print(f"{row['mode']:>16} {q[1]:>7.2f} [{q[0]:>5.2f}-{q[2]:>6.2f}] {skew[1]:>14.2f}{bound} {share:>22}",
              flush=True)
    for row in result["rows"]:
        for note in row["compression"]:
            print(f"# {row['mode']}: {note}")
