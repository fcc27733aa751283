"""ddl-tune: measure what is fast on this machine, remember it in a tuning table, use it.

Run it on the ranks and topology to tune (it is an MPI program, like any job)::

    ddlrun -n 2 -- ddl-tune --quick --out t.json
    ddlrun -n 4 --topology 2x2 -- python -m ddl_triton.tune --out t2x2.json --plot sweep.png --peers
    ddl-tune --kernels                      # Triton launch configurations (needs CUDA; else says so)

What it sweeps, per collective (all five by default), dtype (float32) and size (8 B to
256 MiB in steps of 4x; ``--quick``: to 16 MiB): every candidate = a schedule that
implements the collective (the grid schedules on multi-level topologies, ``multidim`` once
per per-dimension algorithm choice) x the communicator layout: ``--chunks`` (shm slot
bytes, which are also the pipeline chunk) x ``--depths`` (slots per rank), one
communicator per layout, since a layout is fixed when a communicator is made.

How it times (ddl_triton/tuning/race.py, on the harness of ddl_triton/tuning/timing.py):
every measurement starts with every rank passing a barrier, runs a candidate back to back
long enough to be timed (at least ``--target-ms``), and takes the slowest rank's time per
call (an allreduce MAX). Successive halving prunes the candidates: all survivors are timed
once, in turn, and the slower half dropped (anything within 25% of the best stays), until
``--finalists`` remain; those are timed in ``--rounds`` interleaved rounds, after a
warm-up, and each gets its median and p20/p80 spread. Rank 0 decides every pruning and the
final table and broadcasts them, so every rank holds the same table.

What it writes: the table (ddl_triton/planning/tuning_table.py documents the schema) to ``--out`` and
to the cache folder where ``ddl_triton.init`` finds it by itself (unless ``--no-cache``).
The table keeps the winner per (collective, dtype, size) within the layout that is best
overall (``choose_layout``), every candidate's measured time, and the cost model's
parameters fitted by least squares to every finalist's median (ddl_triton/tuning/decisions.py
and fit.py), checked against sizes the sweep skipped (``model.validation``,
ddl_triton/tuning/model_check.py: measured and predicted time of the plan the runtime would
choose between two swept sizes).

Progress: rank 0 shows a bar with an ETA. ``--budget SECONDS`` stops the sweep at the next
task boundary once spent; Ctrl-C does the same (every rank catches SIGINT and the ranks
agree to stop together: ddl_triton/tuning/sweep.py), and either way what was measured is
fitted and written.

This module is the command line: its arguments, the run from them to a written table, the
progress bar and the printed summary, and ``--kernels``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime, timezone

from .decisions import build_table
from .sweep import geometric_sizes, sweep
from .timing import start_gloo
from .model_check import validate

_SIZE_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """ "8", "64K", "256M" -> bytes (binary multiples)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in _SIZE_SUFFIX else ""
    try:
        value = int(t[: len(t) - len(unit)]) * _SIZE_SUFFIX[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 8, 64K, 256M)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _csv(kind):
    def parse(text: str) -> list:
        return [kind(word) for word in text.split(",") if word]
    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    from .. import schedules

    p = argparse.ArgumentParser(prog="ddl-tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="where to write the table (default: only the cache folder)")
    p.add_argument("--quick", action="store_true",
                   help="sizes to 16 MiB, pipeline depth 4 only: seconds to minutes on 2 cores")
    p.add_argument("--collectives", type=_csv(str), default=list(schedules.COLLECTIVES))
    p.add_argument("--dtypes", type=_csv(str), default=["float32"])
    p.add_argument("--min-bytes", type=parse_bytes, default=8)
    p.add_argument("--max-bytes", type=parse_bytes, default=None, help="default 256M (16M with --quick)")
    p.add_argument("--factor", type=int, default=4, help="ratio of successive sizes")
    p.add_argument("--chunks", type=_csv(parse_bytes), default=None, help="pipeline chunks (default 256K,1M,2M,4M)")
    p.add_argument("--depths", type=_csv(int), default=None, help="shm slots per rank (default 2,4,8)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved final rounds (default 7)")
    p.add_argument("--finalists", type=int, default=3, help="candidates left for the final rounds")
    p.add_argument("--target-ms", type=float, default=None, help="least time per measurement (default 10)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS", help="stop the sweep after this long")
    p.add_argument("--no-validate", action="store_true", help="skip timing the sizes between swept ones")
    p.add_argument("--no-cache", action="store_true", help="do not store the table in the cache folder")
    p.add_argument("--plot", metavar="PNG", help="draw busbw against size per candidate (needs matplotlib)")
    p.add_argument("--peers", action="store_true", help="also time MPICH's MPI_Allreduce and gloo (allreduce)")
    p.add_argument("--kernels", action="store_true", help="tune the Triton kernels' launch configurations (CUDA)")
    p.add_argument("--compression", action="store_true",
                   help="also time the per-level int8 / 1-bit allreduce against fp32 from 4 KiB up, per level's link "
                        "(what Options.compression=auto follows: ddl_triton/tuning/auto_compression.py)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    unknown = [c for c in args.collectives if c not in schedules.COLLECTIVES]
    if unknown:
        p.error(f"unknown collective(s) {', '.join(unknown)}; valid: {', '.join(schedules.COLLECTIVES)}")
    args.max_bytes = args.max_bytes if args.max_bytes is not None else (16 << 20 if args.quick else 256 << 20)
    args.chunks = args.chunks or [256 << 10, 1 << 20, 2 << 20, 4 << 20]  # 2 MiB: Options' default
    args.depths = args.depths or ([4] if args.quick else [2, 4, 8])
    args.rounds = args.rounds or 7
    args.target_ms = args.target_ms or 10.0
    if any(c < 64 or c % 64 for c in args.chunks):
        p.error("--chunks must be positive multiples of 64 bytes")
    if any(d < 2 for d in args.depths):
        p.error("--depths must be >= 2")
    if args.factor < 2 or args.min_bytes > args.max_bytes:
        p.error("need --factor >= 2 and --min-bytes <= --max-bytes")
    return args


def main(argv: list[str] | None = None) -> int:
    """``ddl-tune``: sweep, decide, validate, write the table (or ``--kernels``); the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.kernels:
        return _tune_kernels(args)
    from mpi4py import MPI

    import ddl_triton as ddl
    from ..planning import tuning_table
    from ..runtime.setup.bootstrap_values import mpi_bcast
    from ..options import Options

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        print("ddl-tune: a single rank has nothing to tune; run it under ddlrun/mpiexec with the ranks to tune "
              "(e.g. ddlrun -n 2 -- ddl-tune --quick)", file=sys.stderr)
        return 2
    import torch
    torch.set_num_threads(1)
    base = Options.from_env(tuning_file="off", schedule="")
    # One communicator per layout: its shm slots hold exactly one pipeline chunk, as at run time.
    comms = {(c, d): ddl.init(world.Dup(), base.replace(chunk_bytes=c, pipeline_depth=d))
             for c in args.chunks for d in args.depths}
    any_comm = next(iter(comms.values()))
    if args.peers:
        start_gloo(world, base.timeout)
    sizes = geometric_sizes(args.min_bytes, args.max_bytes, args.factor)
    n_tasks = len(args.collectives) * len(args.dtypes) * len(sizes)
    if rank == 0:
        print(f"# ddl-tune: {size} ranks, topology {any_comm.topology.signature}, {len(args.collectives)} "
              f"collective(s) x {len(args.dtypes)} dtype(s) x {len(sizes)} sizes ({sizes[0]} B to {sizes[-1]} B), "
              f"chunks {','.join(str(c >> 10) + 'K' for c in args.chunks)}, depths "
              f"{','.join(map(str, args.depths))}", flush=True)
    bar = _progress_bar(rank, args, n_tasks)
    t0 = time.monotonic()
    rows, stopped = sweep(args, world, comms, bar)
    bar.close()
    elapsed = time.monotonic() - t0
    table = None
    if rank == 0:
        table = build_table(args, rows, any_comm, size)
    # Every rank holds the same table: its JSON form crosses, and every rank (rank 0 too) rebuilds it.
    table = tuning_table.from_json(mpi_bcast(world, table.to_json() if rank == 0 else None, 0, base.timeout,
                                       "the tuned table"), "built by rank 0")
    table.path = ""
    layout = (table.options["chunk_bytes"], table.options["pipeline_depth"])
    if not args.no_validate and rows:
        validation = validate(args, world, comms[layout], table, rows)
        if rank == 0:
            table.model_info["validation"] = validation
    if args.compression:
        table.compression = _sweep_compression(args, comms[layout], sizes)  # the same on every rank
    if rank == 0:
        table.created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        written = []
        if args.out:
            table.save(args.out)
            written.append(args.out)
        if not args.no_cache:
            path = tuning_table.cache_path(table.key, base.tuning_dir)
            table.save(path)
            written.append(str(path))
        _print_summary(table, elapsed, stopped, written)
        if args.plot:
            from .plot import plot
            plot(table, args.plot)
            print(f"# plot: {args.plot}")
    for comm in comms.values():
        comm.close()
    if args.peers:
        import torch.distributed as dist
        dist.destroy_process_group()
    return 0


def _print_summary(table, elapsed: float, stopped: bool, written: list[str]) -> None:
    print(f"# swept in {elapsed:.1f} s{' (stopped early: what was measured is kept)' if stopped else ''}; "
          f"best layout: pipeline depth {table.options['pipeline_depth']}, slot {table.options['chunk_bytes']} B")
    print(f"{'collective':>14} {'bytes':>10} {'winner':>28} {'us':>10} {'p20-p80':>17} {'runner-up':>22} {'x':>6}")
    for collective, by_dtype in table.entries.items():
        for dtype, rows in by_dtype.items():
            for e in rows:
                win = e["schedule"] + (f"[{'/'.join(e['algos'])}]" if e.get("algos") else "") + \
                    f" {e['chunk_bytes'] >> 10}K"
                ru = e.get("runner_up")
                ratio = f"{ru['time_us'] / e['time_us']:.2f}" if ru else "-"
                print(f"{collective:>14} {e['bytes']:>10} {win:>28} {e['time_us']:>10.1f} "
                      f"{e['p20_us']:>8.1f}-{e['p80_us']:<8.1f} {(ru['schedule'] if ru else '-'):>22} {ratio:>6}")
    fit = table.model_info.get("fit")
    if fit:
        params = ", ".join(f"{k} {v:.3g}" for k, v in _flat_params(table.model.to_dict()).items())
        print(f"# fitted cost model ({fit['samples']} samples, median |error| {fit['median_abs_rel_error']:.1%}, "
              f"not fitted: {', '.join(fit['not_fitted']) or 'none'}): {params}")
    val = table.model_info.get("validation")
    if val:
        errs = sorted(abs(v["error"]) for v in val)
        print(f"# model on {len(val)} sizes the sweep skipped: median |error| {statistics.median(errs):.1%}, "
              f"within 25%: {sum(e <= 0.25 for e in errs)}/{len(errs)}")
    for path in written:
        print(f"# wrote {path}")


def _sweep_compression(args, comm, sizes: list[int]) -> dict:
    """--compression: the table's ``compression`` section, printed on rank 0 (tuning/auto_compression.py)."""
    from ..runtime.compression.per_level import Levels
    from .auto_compression import from_table, sweep_compression

    levels = Levels(comm)
    try:
        section = sweep_compression(levels, [b for b in sizes if b >= 4096], rounds=max(3, args.rounds // 2))
    finally:
        levels.close()
    if comm.rank == 0:
        for name, link in section["levels"].items():
            print(f"# {name} link ({link['ranks']} ranks): {link['bytes_per_s'] / 1e9:.3f} GB/s, "
                  f"{link['latency_us']:.0f} us per step")
        for e in section["entries"]:
            print(f"# compression at {e['bytes']:>10} B: {from_table(section, e['bytes'], levels.hosts).method:>5}  "
                  + ", ".join(f"{m} {t:.0f} us" for m, t in e["by_method"].items()))
    return section


def _flat_params(d: dict) -> dict:
    """The cost model's parameters one level deep: {"alpha": {"shm": x}} -> {"alpha_shm": x}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update({f"{k}_{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out


def _progress_bar(rank: int, args, total: int):
    """rank 0's bar (tqdm, with an ETA); a silent stand-in elsewhere."""
    if rank != 0 or args.quiet:
        class _Silent:
            def __call__(self, *a, **k):
                pass

            def close(self):
                pass
        return _Silent()
    from tqdm import tqdm

    bar = tqdm(total=total, unit="size", dynamic_ncols=True, desc="ddl-tune", mininterval=0.5)

    def advance(collective: str, nbytes: int, skipped: bool = False) -> None:
        bar.set_postfix_str(f"{collective} {nbytes} B" + (" (skipped)" if skipped else ""), refresh=False)
        bar.update()
    advance.close = bar.close
    return advance


def _tune_kernels(args) -> int:
    """--kernels: sweep the Triton kernels' launch configurations on CUDA (ddl_triton/kernels/config_sweep.py)
    and store the winners in the table named by --out (created if needed); without CUDA, say so."""
    import torch

    if not torch.cuda.is_available():
        print("ddl-tune --kernels: no GPU: kernel launch configurations are tuned on CUDA "
              "(torch.cuda.is_available() is False); nothing to do", flush=True)
        return 0
    from ..kernels import config_sweep
    from ..planning import tuning_table

    result = config_sweep.sweep()
    winners = config_sweep.winners_to_table(result)
    for name, r in result.items():
        print(f"{name:>16}: {r['config']} {r['us']:.1f} us")
    if args.out:
        path = args.out
        table = tuning_table.load(path) if os.path.exists(path) else tuning_table.TuningTable(
            key={}, options={"chunk_bytes": 2 << 20, "pipeline_depth": 4}, entries={})
        table.kernels = winners
        table.save(path)
        print(f"# wrote kernel winners to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
