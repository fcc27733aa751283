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

How it times (``_Race``): every measurement starts with every rank passing a barrier, runs
a candidate back to back long enough to be timed (at least ``--target-ms``), and takes the
slowest rank's time per call (an allreduce MAX). Successive halving prunes the
candidates: all survivors are timed once, in turn, and the slower half dropped (anything
within 25% of the best stays), until ``--finalists`` remain; those are timed in ``--rounds`` interleaved rounds, after a warm-up, and each gets
its median and p20/p80 spread. Rank 0 decides every pruning and the final table and
broadcasts them, so every rank holds the same table.

What it writes: the table (ddl_triton/tuning/table.py documents the schema) to ``--out`` and to
the cache folder where ``ddl_triton.init`` finds it by itself (unless ``--no-cache``). The
table keeps the winner per (collective, dtype, size) within the layout that is best
overall (``choose_layout``), every candidate's measured time, and the cost model's parameters fitted by least
squares to every finalist's median (ddl_triton/tuning/fit.py), checked against sizes the
sweep skipped (``model.validation``: measured and predicted time of the plan the runtime
would choose between two swept sizes).

Progress: rank 0 shows a bar with an ETA. ``--budget SECONDS`` stops the sweep at the next
task boundary once spent; Ctrl-C does the same (every rank catches SIGINT and the ranks
agree to stop together), and either way what was measured is fitted and written.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import math
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone

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


def geometric_sizes(low: int, high: int, factor: int) -> list[int]:
    """low, low*factor, ... below high, then high itself: 8, 32, ..., 134217728, 268435456."""
    out, n = [], max(1, low)
    while n <= high:
        out.append(n)
        n *= factor
    if out and out[-1] != high:
        out.append(high)  # the top of the range is always measured
    return out


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


# -- candidates ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    depth: int
    schedule: str
    chunk_bytes: int
    algos: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        algos = f"[{'/'.join(self.algos)}]" if self.algos else ""
        return f"{self.schedule}{algos} chunk {self.chunk_bytes >> 10}K depth {self.depth}"

    def to_json(self) -> dict:
        return {"schedule": self.schedule, "chunk_bytes": self.chunk_bytes,
                "algos": list(self.algos) if self.algos else None, "depth": self.depth}


def candidates(collective: str, count: int, elem: int, dims: tuple[int, ...], chunks: list[int],
               depths: list[int]) -> list[Candidate]:
    """Every candidate for one call shape: a schedule (and, for multidim, its per-dimension
    algorithms) on each communicator layout (slot bytes = pipeline chunk, depth). Layouts
    are timed even where they cut the call alike: the slot size changes what stays cached."""
    from .. import schedules
    from ..schedules import grid as grid_mod

    out = []
    for name in schedules.names():
        if not schedules.supports(name, collective) or (schedules.uses_grid(name) and len(dims) < 2):
            continue
        variants = [None]
        if name == "multidim":
            choices = [grid_mod.PHASE_ALGORITHMS if d > 1 else (grid_mod.default_algorithms(dims)[i],)
                       for i, d in enumerate(dims)]
            variants = list(itertools.product(*choices))
        for depth in depths:
            for chunk in sorted(chunks):
                for algos in variants:
                    out.append(Candidate(depth, name, chunk, tuple(algos) if algos else None))
    return out


# -- the sweep ------------------------------------------------------------------------------------
class _Stop:
    """Ctrl-C and the budget: a flag set by SIGINT, read by every rank at task boundaries."""

    def __init__(self, budget: float | None):
        self.deadline = None if budget is None else time.monotonic() + budget
        self.interrupted = False
        self._previous = None

    def __enter__(self):
        with contextlib.suppress(ValueError):  # not the main thread: no handler, no Ctrl-C
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, _signum, _frame):
        self.interrupted = True

    def wanted(self, world) -> bool:
        from mpi4py import MPI
        mine = self.interrupted or (self.deadline is not None and time.monotonic() > self.deadline)
        return bool(world.allreduce(int(mine), op=MPI.MAX))


class _Race:
    """Times the candidates of one call shape (see the module doc)."""

    def __init__(self, world, target_s: float, rounds: int, finalists: int):
        self.world, self.target_s, self.rounds, self.finalists = world, target_s, rounds, finalists

    def measure(self, runner: "_Runner", iters: int) -> float:
        """Seconds per call of ``runner``, the slowest rank's, after a barrier. The call made
        inside the plan before the barrier re-plans the shape (not timed)."""
        from mpi4py import MPI
        with runner.context():
            runner.call()
            self.world.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                runner.call()
            elapsed = time.perf_counter() - t0
        return self.world.allreduce(elapsed / iters, op=MPI.MAX)

    def run(self, runners: dict, peers: dict | None = None) -> tuple[dict, list]:
        """{candidate: [seconds per call, ...]} for every candidate, and the finalists."""
        times: dict = {c: [] for c in runners}
        iters = {}
        for c, run in runners.items():              # warm-up (plans, schedules, pages) and pace
            iters[c] = self._iterations(self.measure(run, 1))
        alive = list(runners)
        while len(alive) > self.finalists:
            for c in alive:
                times[c].append(self.measure(runners[c], iters[c]))
            ranked = sorted(alive, key=lambda c: statistics.median(times[c]))
            # The faster half goes on, and so does anything within 25% of the best: one noisy
            # measurement must not drop a close contender.
            best = statistics.median(times[ranked[0]])
            keep = max(self.finalists, math.ceil(len(alive) / 2))
            survivors = [c for i, c in enumerate(ranked) if i < keep or statistics.median(times[c]) <= 1.25 * best]
            if len(survivors) == len(alive):
                survivors = ranked[:keep]  # every candidate is close: halve anyway, or this never ends
            alive = self.world.bcast(survivors, root=0)
        extra = dict(peers or {})
        for name, run in extra.items():
            iters[name] = self._iterations(self.measure(run, 1))
            times[name] = []
        for r in range(self.rounds):
            order = alive + list(extra)
            order = order[r % len(order):] + order[: r % len(order)]  # rotate: no candidate always first
            for c in order:
                times[c].append(self.measure(runners.get(c) or extra[c], iters[c]))
        return times, alive

    def _iterations(self, seconds: float) -> int:
        return max(1, min(2000, math.ceil(self.target_s / max(seconds, 1e-7))))


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _buffers(collective: str, numel: int, size: int, dtype):
    """(call, numel actually used) for one collective, or None when the size cannot be formed
    (reduce_scatter and all_to_all need at least one element per rank).

    Every buffer is written before it is timed: a zero-filled allocation maps one shared zero
    page, and reading it is far faster than reading real memory. Sums of ones grow to inf
    over many calls, which costs the same as finite data (no denormals)."""
    import torch

    if collective in ("reduce_scatter", "all_to_all"):
        numel -= numel % size
        if numel == 0:
            return None
    inp = torch.ones(numel, dtype=dtype)
    if collective == "allreduce":
        return (lambda comm: comm.allreduce(inp)), numel
    if collective == "broadcast":
        return (lambda comm: comm.broadcast(inp, root=0)), numel
    if collective == "reduce_scatter":
        out = torch.ones(numel // size, dtype=dtype)
        return (lambda comm: comm.reduce_scatter(out, inp)), numel
    if collective == "all_gather":
        out = torch.ones(numel * size, dtype=dtype)
        return (lambda comm: comm.all_gather(out, inp)), numel
    out = torch.ones(numel, dtype=dtype)
    return (lambda comm: comm.all_to_all(out, inp)), numel


@dataclass(frozen=True)
class _Runner:
    """One timed thing: ``call()`` inside ``context()`` (a candidate's forced plan, or nothing)."""

    call: object
    context: object = contextlib.nullcontext


def _runner(comm, call, cand: Candidate, elem: int) -> _Runner:
    from .. import schedules
    from ..planning.planner import Plan

    dims = comm.topology.dims
    plan = Plan(cand.schedule, max(1, min(cand.chunk_bytes, comm.options.chunk_bytes) // elem), "tuner candidate",
                dims if schedules.uses_grid(cand.schedule) else None, cand.algos)
    return _Runner(lambda: call(comm), lambda: comm._with_plan(plan))


def sweep(args, world, comms: dict, progress) -> tuple[list[dict], bool]:
    """Time every task; returns (measurement rows, whether the sweep was stopped early)."""
    import torch

    from .. import schedules

    size = world.Get_size()
    any_comm = next(iter(comms.values()))
    dims = any_comm.topology.dims
    race = _Race(world, args.target_ms / 1e3, args.rounds, args.finalists)
    rows: list[dict] = []
    tasks = [(c, d, n) for c in args.collectives for d in args.dtypes
             for n in geometric_sizes(args.min_bytes, args.max_bytes, args.factor)]
    stopped = False
    _warm_up(comms.values(), size)
    with _Stop(args.budget) as stop:
        for collective, dtype_name, nbytes in tasks:
            if stop.wanted(world):
                stopped = True
                break
            dtype = getattr(torch, dtype_name)
            elem = dtype.itemsize
            made = _buffers(collective, nbytes // elem, size, dtype)
            if made is None or nbytes < elem:
                progress(collective, nbytes, skipped=True)
                continue
            call, numel = made
            count = schedules.count_for(collective, numel, size)
            cands = candidates(collective, count, elem, dims, args.chunks, args.depths)
            runners = {c: _runner(comms[(c.chunk_bytes, c.depth)], call, c, elem) for c in cands}
            peers = _peer_runners(args, world, numel, dtype) if collective == "allreduce" else {}
            times, finalists = race.run(runners, peers)
            for c, ts in times.items():
                if not ts:
                    continue
                row = {"collective": collective, "dtype": dtype_name, "bytes": numel * elem,
                       "median_us": statistics.median(ts) * 1e6, "p20_us": _quantile(ts, 0.2) * 1e6,
                       "p80_us": _quantile(ts, 0.8) * 1e6, "rounds": len(ts)}
                if isinstance(c, Candidate):
                    row.update(c.to_json(), finalist=c in finalists)
                else:
                    row.update(peer=c)
                rows.append(row)
            progress(collective, nbytes)
    return rows, stopped


def _warm_up(comms, size: int, seconds: float = 1.0) -> None:
    """Run every collective on every communicator for about ``seconds``, untimed, so that the
    first size measured is not the one that pays for cold caches, lazy imports and first
    page faults."""
    import torch

    from .. import schedules

    calls = [_buffers(c, 4096 * size, size, torch.float32)[0] for c in schedules.COLLECTIVES]
    for comm in comms:
        deadline = time.monotonic() + seconds / max(1, len(comms))
        while True:
            for call in calls:
                call(comm)
            # Every rank must run the same number of rounds: rank 0's clock decides.
            if comm._comm.bcast(time.monotonic() > deadline, root=0):
                break


def _peer_runners(args, world, numel: int, dtype) -> dict:
    """MPICH's MPI_Allreduce and gloo's allreduce on the same data, when --peers asks."""
    if not args.peers:
        return {}
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    buf = torch.ones(numel, dtype=dtype)
    arr = buf.numpy()
    out = {"MPICH MPI_Allreduce": _Runner(lambda: world.Allreduce(MPI.IN_PLACE, arr))}
    if dist.is_initialized():
        out["gloo allreduce"] = _Runner(lambda: dist.all_reduce(buf, group=_GLOO[0]))
    return out


_GLOO: list = []


def _start_gloo(world) -> None:
    """A gloo group over the same ranks (rank 0 picks the port and sends it over MPI)."""
    import socket

    import torch.distributed as dist

    port = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.Get_rank(),
                            world_size=world.Get_size())
    _GLOO.append(dist.group.WORLD)


# -- deciding ---------------------------------------------------------------------------------------
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
    from .fit import Sample, fit

    planner = comm._planner
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
    from ..planning.costmodel import last_level_cache_bytes
    start = dataclasses.replace(planner.model, cache_bytes=last_level_cache_bytes())
    return fit(samples, start)


# -- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.kernels:
        return _tune_kernels(args)
    from mpi4py import MPI

    import ddl_triton as ddl
    from . import table as tuning
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
        _start_gloo(world)
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
        table = _build_table(args, rows, any_comm, size)
    table = world.bcast(table, root=0)          # every rank holds the same table
    layout = (table.options["chunk_bytes"], table.options["pipeline_depth"])
    if not args.no_validate and rows:
        validation = _validate(args, world, comms[layout], table, rows)
        if rank == 0:
            table.model_info["validation"] = validation
    if rank == 0:
        table.created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        written = []
        if args.out:
            table.save(args.out)
            written.append(args.out)
        if not args.no_cache:
            path = tuning.cache_path(table.key, base.tuning_dir)
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


def _build_table(args, rows: list[dict], comm, size: int):
    from . import table as tuning

    key = tuning.machine_key(world_size=size, topology=comm.topology.signature, transport=comm.options.transport)
    layout = choose_layout(rows) if any("depth" in r for r in rows) else (max(args.chunks), args.depths[0])
    table = tuning.TuningTable(key=key, options={"chunk_bytes": layout[0], "pipeline_depth": layout[1]},
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
    out: dict = {}
    for r in rows:
        if "peer" in r:
            out.setdefault(r["peer"], {})[str(r["bytes"])] = round(r["median_us"], 3)
    return out


def _validate(args, world, comm, table, rows: list[dict]) -> list[dict]:
    """Time the runtime's own choice at sizes between the swept ones (geometric midpoints) and
    compare with the fitted model's prediction of that choice: how well the model predicts
    sizes the sweep skipped. Every rank runs this (it communicates); rank 0 keeps the rows."""
    import torch

    from .. import schedules
    from ..planning.planner import Planner

    planner = Planner(rank=comm.rank, size=comm.size, topology=comm.topology, link_of=comm._link, forced="",
                      slot_bytes=comm.options.chunk_bytes, table=table, table_source="this sweep")
    planner.small_path = comm._planner.small_path
    race = _Race(world, args.target_ms / 1e3, args.rounds, 1)
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
            made = _buffers(collective, nbytes // elem, comm.size, dtype)
            if made is None:
                continue
            call, numel = made
            plan = planner.plan(collective, numel * elem, dtype)
            count = schedules.count_for(collective, numel, comm.size)
            small = collective == "allreduce" and plan.schedule == "one_shot" and planner.small_path(numel * elem, dtype)
            predicted = planner.model_time(plan.schedule, collective, count, plan.chunk_elems, elem, plan.grid,
                                           plan.algos, small=small)

            runner = _Runner(lambda call=call: call(comm), lambda plan=plan: comm._with_plan(plan))
            times, _ = race.run({"plan": runner})
            measured = statistics.median(times["plan"])
            out.append({"collective": collective, "dtype": dtype_name, "bytes": numel * elem,
                        "schedule": plan.schedule, "measured_us": round(measured * 1e6, 3),
                        "predicted_us": round(predicted * 1e6, 3),
                        "error": round((predicted - measured) / measured, 4)})
    return out


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


def _flat_params(d: dict) -> dict:
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
    """--kernels: sweep the Triton kernels' launch configurations on CUDA (ddl_triton/kernels/sweep.py)
    and store the winners in the table named by --out (created if needed); without CUDA, say so."""
    import torch

    if not torch.cuda.is_available():
        print("ddl-tune --kernels: no GPU: kernel launch configurations are tuned on CUDA "
              "(torch.cuda.is_available() is False); nothing to do", flush=True)
        return 0
    from ..kernels import sweep as kernel_sweep
    from . import table as tuning

    result = kernel_sweep.sweep()
    winners = kernel_sweep.winners_to_table(result)
    for name, r in result.items():
        print(f"{name:>16}: {r['config']} {r['us']:.1f} us")
    if args.out:
        path = args.out
        table = tuning.load(path) if os.path.exists(path) else tuning.TuningTable(
            key={}, options={"chunk_bytes": 2 << 20, "pipeline_depth": 4}, entries={})
        table.kernels = winners
        table.save(path)
        print(f"# wrote kernel winners to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
