"""Scale-out simulator CLI: predicted training efficiency and allreduce times, from the schedule IR.

    python -m ddl_triton.simulate train --cluster minsky --model resnet50 --gpus 8,16,32,64,128,256,512,1024 \\
        --schedule multidim [--compress int8] [--baseline 4] [--plot curves.png]
    python -m ddl_triton.simulate allreduce --cluster local --ranks 2 --bytes 4194304 --schedule ring \\
        [--topology 2x2] [--link-emulation mpi:bw=1GB/s,lat=50us]
    python -m ddl_triton.simulate allreduce --cluster testbed --ranks 4 --topology 2x2 --bytes 4194304 \\
        --schedule hierarchical [--rate 1gbit]
    python -m ddl_triton.simulate outer-sync --params 1M --step-ms 4 --hosts 2 --rate 100mbit [--fragments 4]
    python -m ddl_triton.simulate crossover --params 1M --step-ms 4 --hosts 2

train: per GPU count, the iteration time, the communication not hidden behind backward,
and the scaling efficiency against one GPU (and against ``--baseline`` GPUs, a paper's own
baseline), for each schedule given (``--schedule`` accepts a comma-separated list; ``all``
= ring, rhd, tree, hierarchical, multidim). ddl_triton/simulation/iteration.py documents the model;
ddl_triton/clusters/*.toml hold the hardware numbers, each with its source.

allreduce: one allreduce on this host (``--cluster local``: the cost model ddl-tune fitted
here for these ranks and topology, else the built-in defaults), across the testbed's hosts
(``--cluster testbed --topology XxH [--rate 1gbit]``: the same fitted model, its MPI link moved
onto the testbed's shaped one), or on any cluster.
``--link-emulation`` adds the emulated link (transports/link_emulation.py) to the MPI
link's latency and per-byte time, to predict a ``DDL_LINK_EMULATION`` run.

outer-sync, crossover: per-step allreduce or outer sync (DiLoCo) for a model size, step time and
link (planning/outer_sync.py's plan, as ``DiLoCo(sync_every="auto")`` prints it), and the link rate
where outer sync starts to win (ddl_triton/simulation/outer_sync_crossover.py).

No side effects unless asked: a prediction only reads (the cluster file, the cached ddl-tune
tables) and says which figures it used. ``--tune`` (local and testbed) runs a quick ddl-tune of
this host where no table fits (about a minute per layout, with ddl-tune's progress bar) and caches
its table, which later jobs' ``init`` then plans with (docs/tuning.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from . import iteration
from .._private_files import save_figure
from ..runtime.lanes import small_allreduce
from .cluster import load, local_model
from ..planning.costmodel import Link


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _schedules(text: str) -> list[str]:
    names = list(iteration.SCHEDULES) if text == "all" else [x for x in text.split(",") if x]
    bad = [n for n in names if n not in iteration.SCHEDULES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown schedule(s) {', '.join(bad)}; valid: {', '.join(iteration.SCHEDULES)}, all")
    return names


def train(args) -> int:
    from .workload import load_layers

    cluster = load(args.cluster)
    layers = load_layers(args.model)
    reference = load_layers(cluster.model) if cluster.model and cluster.model != args.model else None
    compute = iteration.compute_seconds(cluster, layers, args.batch, args.img_per_s,
                                    sum(l.fwd_macs for l in reference) if reference and not args.img_per_s else None)
    params = sum(l.params for l in layers)
    print(f"# {cluster.name}: {cluster.description}")
    print(f"# figures: {cluster.file}")
    print(f"# {args.model}: {params / 1e6:.1f}M parameters ({params * 4 / 1e6:.0f} MB fp32), batch {args.batch} per GPU, "
          f"compute {compute * 1e3:.1f} ms per iteration per GPU; buckets {args.bucket_mb:g} MB; compression "
          f"{args.compress}")
    curves = {}
    for schedule in args.schedule:
        rows = [iteration.iteration(cluster, layers, g, schedule, batch=args.batch, compute=compute,
                                bucket_mb=args.bucket_mb, compress=args.compress) for g in args.gpus]
        base = next((r for r in rows if r.gpus == args.baseline), None) if args.baseline else None
        if base is None and args.baseline:
            base = iteration.iteration(cluster, layers, args.baseline, schedule, batch=args.batch, compute=compute,
                                   bucket_mb=args.bucket_mb, compress=args.compress)
        print(f"\n{schedule}:")
        print(f"{'gpus':>6} {'grid':>9} {'iter ms':>9} {'exposed ms':>11} {'allreduce ms':>13} {'eff vs 1':>9}"
              + (f" {'eff vs ' + str(args.baseline):>10}" if base else ""))
        for r in rows:
            line = (f"{r.gpus:>6} {'x'.join(map(str, cluster.grid(r.gpus))):>9} {r.iteration * 1e3:>9.1f} "
                    f"{r.exposed * 1e3:>11.2f} {r.allreduce_total * 1e3:>13.2f} {r.efficiency:>8.1%}")
            if base:
                line += f" {base.iteration / r.iteration:>9.1%}"
            print(line)
        curves[schedule] = rows
    if args.plot:
        _plot(curves, args, cluster.name)
        print(f"\n# plot: {args.plot}")
    return 0


def _plot(curves: dict, args, cluster_name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in curves.items():
        ax.plot([r.gpus for r in rows], [100 * r.efficiency for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("scaling efficiency vs 1 GPU (%)")
    ax.set_title(f"{args.model} on {cluster_name}, batch {args.batch}/GPU, compression {args.compress}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, args.plot, dpi=90)
    plt.close(fig)


def allreduce(args) -> int:
    if args.cluster != "local" and load(args.cluster).calibrated:
        return _allreduce_across_hosts(args)
    if args.cluster != "local":
        cluster = load(args.cluster)
        seconds, how = iteration.allreduce_time(cluster, args.ranks, args.bytes, args.schedule[0],
                                                compress=args.compress)
        print(f"{args.schedule[0]} allreduce of {args.bytes} B on {args.ranks} GPUs of {args.cluster}: "
              f"{seconds * 1e6:.1f} us ({how}; figures: {cluster.file})")
        return 0
    seconds, source = local_allreduce(args.ranks, args.topology, args.bytes, args.schedule[0],
                                      link_emulation=args.link_emulation, chunk_bytes=args.chunk_bytes,
                                      probe=args.tune)
    where = f"topology {args.topology or args.ranks}" + (f", link {args.link_emulation}" if args.link_emulation else "")
    print(f"{args.schedule[0]} allreduce of {args.bytes} B on {args.ranks} ranks ({where}): {seconds * 1e6:.1f} us "
          f"predicted (model: {source})")
    return 0


def _allreduce_across_hosts(args) -> int:
    """A calibrated cluster of hosts (the testbed): this host's fitted model for the same grid of
    emulated nodes, its MPI link moved onto the cluster's (ddl_triton/simulation/across_hosts.py)."""
    from . import across_hosts

    cluster = load(args.cluster)
    if args.rate:
        cluster = across_hosts.with_rate(cluster, args.rate)
    dims = [int(d) for d in (args.topology or f"1x{args.ranks}").lower().split("x")]
    if len(dims) != 2 or dims[0] * dims[1] != args.ranks:
        raise SystemExit(f"--cluster {args.cluster}: --topology must be XxH (X ranks on each of H hosts) for "
                         f"{args.ranks} ranks, got {args.topology!r}")
    model, source = across_hosts.hosts_model(cluster, dims[0], dims[1], probe=args.tune)
    p = across_hosts.hosts_allreduce(cluster, model, dims[0], dims[1], args.bytes, args.schedule[0],
                                     chunk_bytes=args.chunk_bytes)
    print(f"{args.schedule[0]} allreduce of {args.bytes} B on {dims[1]} hosts x {dims[0]} of {args.cluster}"
          f"{' at ' + args.rate if args.rate else ''}: {p.seconds * 1e6:.1f} us predicted (unshaped "
          f"{p.unshaped * 1e6:.1f} us; {p.link_bytes:.0f} B on the busiest host link; model: {source}; "
          f"link figures: {cluster.file})")
    return 0


def local_allreduce(ranks: int, topology: str, nbytes: int, schedule: str, *, link_emulation: str = "",
                    chunk_bytes: int = 2 << 20, probe: bool = False) -> tuple[float, str]:
    """(predicted seconds, model source) of one fp32 allreduce on this host: the planner's own
    costing (the whole schedule walked) with the model ddl-tune fitted here for these ranks
    and topology (``probe``: run a quick ddl-tune for one where none is cached: cluster.local_model),
    the emulated link added to the MPI link when given."""
    from ..planning.planner import Planner
    from ..planning.topology import Topology, parse
    from ..transports.link_emulation import parse as parse_link

    model, source = local_model(ranks, topology, probe=probe)
    spec = parse_link(link_emulation)
    if spec is not None:
        model = dataclasses.replace(model, mpi=Link(model.mpi.alpha + spec.latency, model.mpi.beta + 1 / spec.bandwidth))
    grid_of = parse(topology, ranks, 0) if topology else Topology((ranks,), "flat")
    x = grid_of.dims[0]
    link_of = lambda a, b: "shm" if a // x == b // x else "mpi"  # noqa: E731
    planner = Planner(rank=0, size=ranks, topology=grid_of, link_of=link_of, forced="", slot_bytes=chunk_bytes)
    planner.model = model
    elem = 4
    count, chunk = nbytes // elem, chunk_bytes // elem
    grid, algos = planner.grid_params(schedule, count, chunk, elem)
    # the small-message lane (every peer on shm, one_shot, up to its limit: ddl_triton/runtime/lanes/small_allreduce.py)
    small = schedule == "one_shot" and x == ranks and 0 < nbytes <= small_allreduce.LIMIT_BYTES
    return planner.model_time(schedule, "allreduce", count, chunk, elem, grid, algos, small=small), source


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddl_triton.simulate", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="predicted iteration time and scaling efficiency per GPU count")
    t.add_argument("--cluster", default="minsky")
    t.add_argument("--model", default="resnet50")
    t.add_argument("--gpus", type=_ints, default=[8, 16, 32, 64, 128, 256, 512, 1024])
    t.add_argument("--schedule", type=_schedules, default=["multidim"])
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--bucket-mb", type=float, default=25.0)
    t.add_argument("--compress", choices=iteration.compression_choices(), default="none")
    t.add_argument("--img-per-s", type=float, default=None, help="measured single-GPU rate for --model (default: "
                   "the cluster's, scaled by multiply-adds)")
    t.add_argument("--baseline", type=int, default=0, help="also report efficiency against this many GPUs")
    t.add_argument("--plot", help="PNG of efficiency against GPUs, one curve per schedule")
    a = sub.add_parser("allreduce", help="predicted time of one allreduce")
    a.add_argument("--cluster", default="local")
    a.add_argument("--ranks", type=int, required=True)
    a.add_argument("--bytes", type=int, required=True)
    a.add_argument("--schedule", type=lambda s: [s], default=["ring"])
    a.add_argument("--topology", default="")
    a.add_argument("--chunk-bytes", type=int, default=2 << 20, help="pipeline chunk (default: Options' 2 MiB)")
    a.add_argument("--link-emulation", default="")
    a.add_argument("--rate", default="", help="a shaped cluster's tbf rate (--cluster testbed), e.g. 100mbit")
    a.add_argument("--compress", choices=iteration.compression_choices(), default="none")
    a.add_argument("--tune", action="store_true", help="where no ddl-tune table fits this layout here, run a quick "
                   "ddl-tune (about a minute per layout, progress shown) and cache its table, which later jobs' init "
                   "uses too; without it the built-in model stands in, said so")
    from . import outer_sync_crossover
    outer_sync_crossover.add_parsers(sub)
    args = p.parse_args(argv)
    if args.command in ("outer-sync", "crossover"):
        return outer_sync_crossover.run(args)
    return train(args) if args.command == "train" else allreduce(args)


if __name__ == "__main__":
    sys.exit(main())
