"""Validate the simulator where we can measure: predicted against measured, per case.

Run (no launcher: it starts its own jobs):  python bench/validate_simulator.py [--quick] [--calibration fresh|cached]
                                            [--json out.json]
Across the testbed's hosts (root; the testbed of docs/testbed.md):
                                            python bench/validate_simulator.py --hosts 2 [--rate 1gbit]
                                            [--per-host 1,2] [--part all|allreduce|training]

Part 1, allreduce per schedule (fp32, 4 KiB to 64 MiB) at 2 ranks, 4 ranks, 4 ranks as 2x2
emulated nodes, and 2x2 with the inter-node link emulated slower (``DDL_LINK_EMULATION``,
default ``mpi:bw=1GB/s,lat=50us``). Measured: each schedule forced (default options, no
tuning table), interleaved rounds after a barrier, the slowest rank's time per call, the
median. Predicted: ``python -m ddl_triton.simulate allreduce --cluster local`` (the cost
model ddl-tune fitted on this host for those ranks and topology, with the emulated link
added), i.e. ``ddl_triton.simulation.cli.local_allreduce``. By default each layout's model is probed afresh
(a quick ddl-tune, about a minute) right before its measurements: this host's memory speed
drifts by up to 3x over minutes at 1-16 MiB, and a model fitted in another state predicts
that state (``--calibration cached`` uses the cached tables instead).

Part 2, a training iteration at 2 ranks as two emulated nodes (``DDL_TOPOLOGY=1x2``, so the
gradients cross the MPI link), with and without emulation: examples/train_cnn.py's CNN
under DDP through the ``allreduce`` comm hook (0.1 MB buckets: several allreduces overlap
backward). Measured: the median step of the slowest rank. Predicted: ddl_triton/simulation/iteration.py's
iteration model with the compute time measured in the same job, the layers traced from the
model on the meta device, and each bucket's allreduce from the fitted model plus the bucket's
overhead. "Compute" is everything but the communication: the same DDP model stepped with a
comm hook that returns the bucket unchanged (both ranks computing, DDP's bucket copies and
bookkeeping included, no allreduce). DDP's ``no_sync`` steps, which skip the buckets
altogether, are shown beside it. A bucket's overhead is measured apart, in the two conditions
a bucket meets in training (``_bucket_overheads``): the hook path (scale, hand-off to the
communicator's thread, a future waited on) issued right after the thread has computed (the
last bucket), or issued with more computing to follow (a bucket mid-backward, whose exchange
shares the core with that computing), each minus the same allreduce called directly back to
back, at two bucket sizes, interpolated in bytes.

``--hosts 2``: the same comparison across the testbed's hosts (``Testbed(hosts=2, rate=--rate)``,
one job per layout under ``ddlrun -H h1:K,h2:K`` inside h1), predicted from
``clusters/testbed.toml`` (ddl_triton/simulation/across_hosts.py: this machine's fitted model for
the same grid of emulated nodes, probed afresh before each layout, its MPI link moved onto the
testbed's, every message between hosts through the hosts' token buckets). First the link itself
as bench/testbed_link.py measures it today, beside the file's numbers (the prediction uses the
file's). Allreduce, fp32, 8 B to 16 MiB, at 2 x 1 and 2 x 2: the planner's choice (with no tuning
table, as ``DDL_TUNING_FILE=off`` runs; each row names the schedule it chose) and each schedule
forced; interleaved rounds, each measurement a warm call, a barrier and at least 3 calls back to
back (the warm call spends the bucket's burst, so the calls timed meet the link's steady state,
which is what is predicted), the slowest rank's time per call, the median over rounds. Training:
bench/train_scaling.py's CNN (imported from it), batch 32 per rank, DDP with its default buckets
(a first bucket of 1 MiB, then 25 MB: about 1.4 MB issued mid-backward and 2.1 MB when backward
ends) over ddl_triton through the ``allreduce`` comm hook (DDP's own group is gloo, for its
bookkeeping); measured and predicted as in part 2, the compute time measured in the same job
(the same DDP stepped with a hook that moves nothing), each bucket's allreduce from the planner's
choice in the run (its unshaped time), the buckets' bytes through the hosts' token bucket in issue
order (simulation/iteration.py), and each bucket's overhead measured apart on the same hosts in a
job of its own with the shaping off (a bucket's hook path is CPU time; the burst would blur it).
Prints the median |error| per kind.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
EMULATION = "mpi:bw=1GB/s,lat=50us"
OVERHEAD_SIZES = [16 << 10, 512 << 10]  # where a bucket's overhead is measured (train_cnn's buckets: ~20, ~530 KB)


# -- workers (run under ddlrun) ---------------------------------------------------------------------
def _time(world, run, target_s: float, rounds: int) -> float:
    """Median over ``rounds`` of bench/_timing.py's measurement, each about ``target_s`` long."""
    from _timing import time_per_call
    iters = max(1, min(500, int(target_s / max(time_per_call(world, run, 1), 1e-7))))
    return statistics.median(time_per_call(world, run, iters) for _ in range(rounds))


def worker_allreduce(schedules: list[str], sizes: list[int], rounds: int) -> None:
    import torch
    from mpi4py import MPI

    import ddl_triton as ddl
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comms = {s: ddl.init(world.Dup(), schedule=s, tuning_file="off") for s in schedules}
    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        for s, comm in comms.items():
            rows.append({"schedule": s, "bytes": nbytes, "measured_us": 1e6 * _time(world, lambda: comm.allreduce(x),
                                                                                    0.01, rounds)})
    if world.rank == 0:
        print("ROWS " + json.dumps(rows), flush=True)
    for comm in comms.values():
        comm.close()


def worker_train(steps: int, blocks: int) -> None:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddl_triton as ddl
    from ddl_triton.examples import train_cnn as cnn
    from ddl_triton.torch import hooks
    from ddl_triton.simulation.workload import layers_from_module
    from _timing import unchanged_bucket_hook
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comm = ddl.init(world.Dup(), tuning_file="off")
    # mkdtemp: a fresh 0700 folder, where a predictable /tmp name could be a link another user planted.
    folder = world.bcast(tempfile.mkdtemp(prefix="ddl_val_") if world.rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=world.rank, world_size=world.size)
    x_train, y_train, _, _ = cnn.load_data(0, mpi_comm=world)
    net = cnn.build_model(0)
    layers = layers_from_module(net, (1, 8, 8))
    model = DDP(net, bucket_cap_mb=0.1)
    model.register_comm_hook(hooks.HookState(comm), hooks.allreduce_hook)
    local = DDP(cnn.build_model(0), bucket_cap_mb=0.1)  # the same DDP, minus the communication
    local.register_comm_hook(None, unchanged_bucket_hook)
    opts = {m: torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, local)}
    g = torch.Generator().manual_seed(1)

    def step(kind: str):
        net_ = local if kind == "local" else model
        idx = torch.randint(0, len(y_train), (32,), generator=g)
        with model.no_sync() if kind == "no_sync" else _null():
            loss = torch.nn.functional.cross_entropy(net_(x_train[idx]), y_train[idx])
            opts[net_].zero_grad(set_to_none=False)
            loss.backward()
        opts[net_].step()

    kinds = ("sync", "local", "no_sync")
    times = {k: [] for k in kinds}
    for k in kinds:
        for _ in range(5):
            step(k)
    for b in range(len(kinds) * blocks):
        kind = kinds[b % len(kinds)]
        for _ in range(steps):
            world.Barrier()
            t0 = time.perf_counter()
            step(kind)
            times[kind].append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    grads = [p.numel() * 4 for p in net.parameters()]
    overheads = [(nbytes, *_bucket_overheads(world, comm, nbytes)) for nbytes in OVERHEAD_SIZES]
    if world.rank == 0:
        print("TRAIN " + json.dumps({"step_s": statistics.median(times["sync"]),
                                     "compute_s": statistics.median(times["local"]),
                                     "no_sync_s": statistics.median(times["no_sync"]),
                                     "layers": [[l.name, l.params, l.fwd_macs] for l in layers],
                                     "grad_bytes": sum(grads), "bucket_overhead_s": overheads}), flush=True)
    dist.destroy_process_group()
    comm.close()
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


def _bucket_overheads(world, comm, nbytes: int, compute_s: float = 1e-3, calls: int = 60) -> tuple[float, float]:
    """What a DDP bucket of ``nbytes`` costs beside its allreduce on this host, measured apart in
    the two conditions a bucket meets in training, as (tail, overlapped) seconds: the allreduce
    comm hook's path (scale, async issue to the communicator's thread, a future waited on) issued
    by a thread that has just computed (the last bucket: the communicator's thread asleep, the
    GIL and the core to hand over), or issued before about ``compute_s`` more of computing (a
    bucket mid-backward: the communicator's thread and the computing one share the core, and
    each hop of the exchange waits for the peer's thread to be scheduled). Each is the step's
    added time against the same computing alone (the same work on every rank, so the ranks
    drift apart as in training), minus the same allreduce called directly back to back. The
    slowest rank per call, the median over calls, never below zero. What it leaves out: caches
    a real backward has cooled (a pass through 64 MB before each call instead made the
    prediction 2-39% long; how cold a backward leaves them is not measured)."""
    import torch
    from mpi4py import MPI

    from ddl_triton.torch import hooks
    state = hooks.HookState(comm)

    class Bucket:
        def __init__(self, t):
            self.t = t

        def buffer(self):
            return self.t

    t = torch.ones(nbytes // 4)
    a = torch.randn(128, 128)

    def compute(n: int) -> None:
        for _ in range(n):
            torch.mm(a, a)

    start = time.perf_counter()
    compute(200)
    n = max(1, int(world.allreduce(compute_s * 200 / (time.perf_counter() - start), op=MPI.MIN)))
    direct = _time(world, lambda: comm.allreduce(t), 0.02, 7)
    steps = {"alone": [], "tail": [], "overlapped": []}
    for _ in range(calls):
        for kind, times in steps.items():
            world.Barrier()
            compute(2 * n)  # the communicator's thread falls asleep, as during a forward pass
            t0 = time.perf_counter()
            if kind == "overlapped":
                future = hooks.allreduce_hook(state, Bucket(t))
            compute(n)
            if kind == "tail":
                future = hooks.allreduce_hook(state, Bucket(t))
            if kind != "alone":
                future.wait()
            times.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    alone = statistics.median(steps["alone"])
    return tuple(max(0.0, statistics.median(steps[kind]) - alone - direct) for kind in ("tail", "overlapped"))


def _interpolated(points: list[tuple[int, float]], nbytes: int) -> float:
    """Linear in bytes through ``points`` ((bytes, seconds), two or more), held flat outside them."""
    points = sorted(points)
    if nbytes <= points[0][0]:
        return points[0][1]
    for (b0, s0), (b1, s1) in zip(points, points[1:]):
        if nbytes <= b1:
            return s0 + (s1 - s0) * (nbytes - b0) / (b1 - b0)
    return points[-1][1]


def _time_calls(world, run, target_s: float) -> tuple[float, int]:
    """(seconds per call, calls): one measurement of at least 3 calls and about ``target_s``."""
    from _timing import time_per_call
    iters = max(3, min(500, int(target_s / max(time_per_call(world, run, 1), 1e-7))))
    return time_per_call(world, run, iters), iters


def _plan_of(comm, nbytes: int) -> dict:
    plan = comm.explain("allreduce", nbytes)
    return {"schedule": plan.schedule, "chunk_elems": plan.chunk_elems, "grid": plan.grid, "algos": plan.algos,
            "small": "runs the small-message path" in plan.reason}


def worker_hosts_allreduce(schedules: list[str], sizes: list[int], rounds: int) -> None:
    """Across hosts: per round, per size, per schedule ("" = the planner's choice), one measurement
    (``_time_calls``); prints the median over rounds with the plan each communicator ran."""
    import torch
    from mpi4py import MPI

    import ddl_triton as ddl
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comms = {s: ddl.init(world.Dup(), schedule=s, tuning_file="off") for s in schedules}
    tensors = {n: torch.ones(n // 4) for n in sizes}
    times: dict = {(s, n): [] for s in schedules for n in sizes}
    for r in range(rounds):
        for n in sizes:
            for s in schedules[r % len(schedules):] + schedules[:r % len(schedules)]:
                x, comm = tensors[n], comms[s]
                times[(s, n)].append(_time_calls(world, lambda: comm.allreduce(x), 0.02))
    rows = [{"schedule": s or "planner", "bytes": n, "plan": _plan_of(comms[s], n),
             "measured_us": 1e6 * statistics.median(t for t, _ in times[(s, n)]),
             "calls": min(c for _, c in times[(s, n)])} for n in sizes for s in schedules]
    if world.rank == 0:
        print("ROWS " + json.dumps(rows), flush=True)
    for comm in comms.values():
        comm.close()


def worker_hosts_train(steps: int, blocks: int) -> None:
    """Across hosts: bench/train_scaling.py's CNN under DDP (default buckets) through ddl_triton's
    allreduce hook, against the same DDP with a hook that moves nothing, in interleaved blocks."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddl_triton as ddl
    from ddl_triton.simulation.workload import layers_from_module
    from ddl_triton.torch import hooks
    from ddl_triton.tuning.timing import start_gloo
    from _timing import unchanged_bucket_hook
    from train_scaling import BATCH, build_cnn
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comm = ddl.init(world.Dup(), tuning_file="off")
    start_gloo(world)
    torch.manual_seed(0)
    net = build_cnn()
    layers = layers_from_module(net, (3, 32, 32))
    model = DDP(net)
    state = hooks.HookState(comm)
    buckets: dict[int, int] = {}  # DDP's bucket index -> bytes, as the hook saw them

    def hook(state, bucket):
        buckets[bucket.index()] = bucket.buffer().numel() * bucket.buffer().element_size()
        return hooks.allreduce_hook(state, bucket)
    model.register_comm_hook(state, hook)
    torch.manual_seed(0)
    local = DDP(build_cnn())  # the same DDP, minus the communication
    local.register_comm_hook(None, unchanged_bucket_hook)
    opts = {m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (model, local)}
    g = torch.Generator().manual_seed(100 + world.rank)
    data = [(torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(4)]

    def step(kind: str, i: int):
        net_ = local if kind == "local" else model
        x, y = data[i % len(data)]
        with model.no_sync() if kind == "no_sync" else _null():
            loss = torch.nn.functional.cross_entropy(net_(x), y)
            opts[net_].zero_grad(set_to_none=False)
            loss.backward()
        opts[net_].step()

    kinds = ("sync", "local", "no_sync")
    times = {k: [] for k in kinds}
    for k in kinds:
        for i in range(3):
            step(k, i)
    for b in range(len(kinds) * blocks):
        kind = kinds[(b + b // len(kinds)) % len(kinds)]  # the order rotates from block to block
        for i in range(steps):
            world.Barrier()
            t0 = time.perf_counter()
            step(kind, i)
            times[kind].append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    sizes = [buckets[i] for i in sorted(buckets)]
    if world.rank == 0:
        print("TRAIN " + json.dumps({"step_s": statistics.median(times["sync"]),
                                     "compute_s": statistics.median(times["local"]),
                                     "no_sync_s": statistics.median(times["no_sync"]),
                                     "layers": [[l.name, l.params, l.fwd_macs] for l in layers],
                                     "buckets": sizes, "plans": {str(n): _plan_of(comm, n) for n in sizes}}),
              flush=True)
    dist.destroy_process_group()
    comm.close()


def worker_hosts_overheads(sizes: list[int]) -> None:
    """Across hosts: what a DDP bucket costs beside its allreduce (``_bucket_overheads``) at ``sizes``.
    The driver runs it with the hosts' shaping off: the cost is CPU time on the ranks' cores, and a
    token bucket that is full after computing but not in a stream of calls would blur it."""
    import torch
    from mpi4py import MPI

    import ddl_triton as ddl
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comm = ddl.init(world.Dup(), tuning_file="off")
    overheads = [(nbytes, *_bucket_overheads(world, comm, nbytes)) for nbytes in sizes]
    if world.rank == 0:
        print("OVERHEADS " + json.dumps(overheads), flush=True)
    comm.close()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# -- the driver across hosts -----------------------------------------------------------------------------
HOST_SIZES = [8, 2 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
HOST_OVERHEAD_SIZES = [256 << 10, 2 << 20]  # about the CNN's two DDP buckets (1.4 and 2.1 MB), and below
HOST_SCHEDULES = {1: ["", "ring", "one_shot", "rhd", "tree"], 2: ["", "ring", "one_shot", "hierarchical", "multidim"]}


def _on_hosts(bed, per_host: int, *args: str, python: tuple[str, ...] = (__file__,)) -> str:
    """``python args`` (default: this script) as a job of 2 x ``per_host`` ranks on ``bed``, under
    ddlrun inside h1; its stdout."""
    from testbed_link import ENV
    # A hang gives up in a minute, not the default five: the longest call here takes about 0.6 s.
    command = [*ENV, "DDL_TIMEOUT=60", str(BIN / "ddlrun"), "-n", str(2 * per_host), "-H", f"h1:{per_host},h2:{per_host}",
               "--", sys.executable, *python, *args]
    done = bed.run("h1", command, cwd=str(Path(__file__).resolve().parents[1]), timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def _probe_on_hosts(bed, per_host: int, rate: str):
    """(the cost model a quick ddl-tune of allreduce fits across ``bed``'s hosts, 2 x ``per_host``
    ranks, with the links' shaping off; where it came from). The shaping is what is predicted, so
    the fit never sees it; the probe's table goes nowhere near the tuning cache."""
    from ddl_triton.planning import tuning_table
    out = Path(__file__).resolve().parents[1] / "build" / f"validate-simulator-probe-2x{per_host}-{os.getpid()}.json"
    out.parent.mkdir(exist_ok=True)
    for host in bed.hosts:
        bed.shape(host, "")
    try:
        print(f"# probing 2 hosts x {per_host} with the shaping off: a quick ddl-tune of allreduce", flush=True)
        _on_hosts(bed, per_host, "--quick", "--max-bytes", "64M", "--collectives", "allreduce", "--quiet",
                  "--no-validate", "--no-cache", "--out", str(out), python=("-m", "ddl_triton.tune"))
        fitted = tuning_table.load(str(out)).model
    finally:
        for host in bed.hosts:
            bed.shape(host, rate)
        out.unlink(missing_ok=True)
    if fitted is None:
        raise SystemExit(f"validate_simulator.py: the probe across hosts (2 x {per_host}) fitted no model")
    return fitted, f"fitted by ddl-tune across the testbed's 2 x {per_host}, its shaping off (probed afresh)"


def _default_plan(per_host: int, nbytes: int) -> dict:
    """The plan a communicator of 2 hosts x ``per_host`` ranks makes for an fp32 allreduce of
    ``nbytes`` with no tuning table (``_plan_of``'s form)."""
    import torch

    from ddl_triton.planning.planner import Planner
    from ddl_triton.planning.topology import parse
    planner = Planner(rank=0, size=2 * per_host, topology=parse(f"{per_host}x2", 2 * per_host, 0),
                      link_of=lambda a, b: "shm" if a // per_host == b // per_host else "mpi", forced="",
                      slot_bytes=2 << 20)
    plan = planner.plan("allreduce", nbytes, torch.float32)
    return {"schedule": plan.schedule, "chunk_elems": plan.chunk_elems, "grid": plan.grid, "algos": plan.algos,
            "small": False}


def _median_abs(rows: list[dict]) -> str:
    errs = sorted(abs(r["error"]) for r in rows)
    return (f"{len(errs)} cases, median |error| {statistics.median(errs):.1%}, within 10%: "
            f"{sum(e <= 0.1 for e in errs)}/{len(errs)}, worst {errs[-1]:.1%}") if errs else "no cases"


def hosts_main(args) -> int:
    """``--hosts``: the simulator against the testbed (see the module doc)."""
    import testbed_link
    from ddl_triton.simulation import across_hosts, iteration
    from ddl_triton.simulation.cluster import load
    from ddl_triton.simulation.workload import Layer
    from ddl_triton.testbed import Testbed

    if args.hosts != 2:
        raise SystemExit("validate_simulator.py: --hosts 2 is the layout measured (2 x 1 and 2 x 2)")
    cluster = across_hosts.with_rate(load("testbed"), args.rate)
    shaped = cluster.links["inter"]["shaped"]
    layouts = [int(k) for k in args.per_host.split(",")]
    sizes = HOST_SIZES[:5] if args.quick else HOST_SIZES
    rounds = 3 if args.quick else args.rounds
    results: dict = {"link": None, "allreduce": [], "training": []}
    inter = cluster.links["inter"]
    print(f"# the testbed, 2 hosts, links {args.rate}: clusters/testbed.toml says latency {inter['alpha'] * 1e6:.1f} us, "
          f"unshaped {1 / inter['beta'] / 1e9:.2f} GB/s, shaped {shaped.rate * 8 / 1e9:.3f} Gbit/s of payload, "
          f"burst {shaped.burst / 1e3:.0f} KB", flush=True)
    with Testbed(hosts=2, rate=args.rate) as bed:
        link = testbed_link.measure(bed, args.rate)
        results["link"] = link
        print(f"# measured today (not used by the prediction): {testbed_link.describe(link)}", flush=True)
        for per_host in layouts:
            fitted = _probe_on_hosts(bed, per_host, args.rate) if args.calibration == "fresh" else None
            model, source = across_hosts.hosts_model(cluster, per_host, 2, refresh=args.calibration == "emulated",
                                                     fitted=fitted)
            print(f"\n# 2 hosts x {per_host}: model {source}", flush=True)
            results.setdefault("models", {})[f"2x{per_host}"] = {"source": source, "model": model.to_dict()}
            if args.part in ("all", "allreduce"):
                names = HOST_SCHEDULES[per_host]
                out = _on_hosts(bed, per_host, "--worker", "hosts_allreduce", "--schedules", ",".join(names),
                                "--sizes", ",".join(map(str, sizes)), "--rounds", str(rounds))
                rows = json.loads(next(line[5:] for line in out.splitlines() if line.startswith("ROWS ")))
                print(f"{'layout':>6} {'schedule':>22} {'bytes':>9} {'measured us':>12} {'predicted us':>13} "
                      f"{'unshaped us':>12} {'link bytes':>11} {'error':>7}")
                for row in rows:
                    plan = row["plan"]
                    p = across_hosts.hosts_allreduce(
                        cluster, model, per_host, 2, row["bytes"], plan["schedule"], chunk_bytes=plan["chunk_elems"] * 4,
                        grid=tuple(plan["grid"]) if plan["grid"] else None,
                        algos=tuple(plan["algos"]) if plan["algos"] else None, small=plan.get("small", False))
                    name = row["schedule"] if row["schedule"] != "planner" else f"planner: {plan['schedule']}"
                    row.update(layout=f"2x{per_host}", predicted_us=p.seconds * 1e6, unshaped_us=p.unshaped * 1e6,
                               link_bytes=p.link_bytes, error=(p.seconds * 1e6 - row["measured_us"]) / row["measured_us"])
                    results["allreduce"].append(row)
                    print(f"{row['layout']:>6} {name:>22} {row['bytes']:>9} {row['measured_us']:>12.1f} "
                          f"{row['predicted_us']:>13.1f} {row['unshaped_us']:>12.1f} {p.link_bytes:>11.0f} "
                          f"{row['error']:>+7.1%}", flush=True)
                print(f"# allreduce 2x{per_host}: {_median_abs([r for r in results['allreduce'] if r['layout'] == f'2x{per_host}'])}")
            if args.part in ("all", "training"):
                for host in bed.hosts:
                    bed.shape(host, "")
                try:
                    out = _on_hosts(bed, per_host, "--worker", "hosts_overheads", "--sizes",
                                    ",".join(map(str, HOST_OVERHEAD_SIZES)))
                finally:
                    for host in bed.hosts:
                        bed.shape(host, args.rate)
                measured = json.loads(next(line[10:] for line in out.splitlines() if line.startswith("OVERHEADS ")))
                out = _on_hosts(bed, per_host, "--worker", "hosts_train", "--steps", str(args.steps),
                                "--blocks", str(args.blocks))
                got = json.loads(next(line[6:] for line in out.splitlines() if line.startswith("TRAIN ")))
                layers = [Layer(n, p, m) for n, p, m in got["layers"]]
                tail = [(b, t) for b, t, _ in measured]
                overlapped = [(b, o) for b, _, o in measured]
                plans = got["plans"]

                def prediction(nbytes: int, plans=plans, per_host=per_host, model=model):
                    # the plan the run had for this bucket; for a bucket it did not have, the one its
                    # planner would make (no tuning table: the built-in cost model)
                    plan = plans.get(str(nbytes)) or _default_plan(per_host, nbytes)
                    return across_hosts.hosts_allreduce(
                        cluster, model, per_host, 2, nbytes, plan["schedule"], chunk_bytes=plan["chunk_elems"] * 4,
                        grid=tuple(plan["grid"]) if plan["grid"] else None,
                        algos=tuple(plan["algos"]) if plan["algos"] else None, small=plan.get("small", False))
                it = iteration.iteration(cluster, layers, 2 * per_host, "ring", batch=32, compute=got["compute_s"],
                                     bucket_mb=25.0, first_bucket_mb=(1 << 20) / 1e6,
                                     allreduce=lambda n: prediction(n).unshaped,
                                     link=shaped, link_bytes=lambda n: prediction(n).link_bytes,
                                     bucket_overhead=lambda n, tail=tail: _interpolated(tail, n),
                                     overlapped_overhead=lambda n, o=overlapped: _interpolated(o, n))
                err = (it.iteration - got["step_s"]) / got["step_s"]
                row = {"layout": f"2x{per_host}", "measured_ms": got["step_s"] * 1e3, "compute_ms": got["compute_s"] * 1e3,
                       "no_sync_ms": got["no_sync_s"] * 1e3, "buckets": got["buckets"], "plans": plans,
                       "bucket_overhead_us": [[b, t * 1e6, o * 1e6] for b, t, o in measured],
                       "predicted_ms": it.iteration * 1e3, "predicted_buckets": it.buckets, "error": err}
                results["training"].append(row)
                apart = ", ".join(f"{b >> 10} KiB {t * 1e6:.0f}/{o * 1e6:.0f} us" for b, t, o in measured)
                print(f"training 2x{per_host}: measured {row['measured_ms']:.2f} ms/step (compute alone "
                      f"{row['compute_ms']:.2f} ms, no_sync {row['no_sync_ms']:.2f} ms; DDP's buckets "
                      f"{', '.join(f'{b / 1e6:.2f} MB' for b in got['buckets'])} by "
                      f"{', '.join(p['schedule'] for p in plans.values())}; bucket overhead measured apart, "
                      f"last/overlapped: {apart}), predicted {row['predicted_ms']:.2f} ms ({it.buckets} buckets), "
                      f"error {err:+.1%}", flush=True)
    if results["allreduce"]:
        print(f"\n# allreduce across hosts: {_median_abs(results['allreduce'])}")
    if results["training"]:
        print(f"# training iteration across hosts: {_median_abs(results['training'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


# -- the driver ---------------------------------------------------------------------------------------
def _launch(ranks: int, topology: str, emulation: str, *args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", DDL_LINK_EMULATION=emulation, DDL_TUNING_FILE="off")
    command = [str(BIN / "ddlrun"), "-n", str(ranks)] + (["--topology", topology] if topology else []) + \
        ["--", sys.executable, __file__, *args]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=("allreduce", "train", "hosts_allreduce", "hosts_train", "hosts_overheads"))
    p.add_argument("--schedules", default="")
    p.add_argument("--sizes", default="")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=None, help="training steps per block (default 20; 5 with --hosts)")
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    p.add_argument("--emulation", default=EMULATION)
    p.add_argument("--part", choices=("all", "allreduce", "training"), default="all")
    p.add_argument("--calibration", choices=("fresh", "cached", "emulated"), default="fresh",
                   help="fresh: probe this host again (a quick ddl-tune) right before measuring each layout, "
                   "since its memory speed drifts over minutes (with --hosts: across the hosts, their shaping "
                   "off); cached: use the tables in the cache; emulated (--hosts): this host's fit for the "
                   "same grid of emulated nodes, its MPI link moved onto the testbed's")
    p.add_argument("--hosts", type=int, default=0, help="validate against the testbed's hosts (2) instead of this host")
    p.add_argument("--rate", default="1gbit", help="with --hosts: the testbed's tbf rate")
    p.add_argument("--per-host", default="1,2", help="with --hosts: ranks per host, a comma list")
    p.add_argument("--json")
    args = p.parse_args()
    if args.steps is None:
        args.steps = 5 if args.hosts else 20
    if args.worker == "allreduce":
        worker_allreduce(args.schedules.split(","), [int(s) for s in args.sizes.split(",")], args.rounds)
        return 0
    if args.worker == "train":
        worker_train(args.steps, args.blocks)
        return 0
    if args.worker == "hosts_allreduce":
        worker_hosts_allreduce(args.schedules.split(","), [int(s) for s in args.sizes.split(",")], args.rounds)
        return 0
    if args.worker == "hosts_train":
        worker_hosts_train(args.steps, args.blocks)
        return 0
    if args.worker == "hosts_overheads":
        worker_hosts_overheads([int(s) for s in args.sizes.split(",")])
        return 0
    if args.hosts:
        return hosts_main(args)

    import torch

    from ddl_triton.simulation import iteration, cli
    from ddl_triton.simulation.cluster import load, local_model
    from ddl_triton.planning.planner import Planner
    from ddl_triton.planning.topology import parse
    from ddl_triton.simulation.workload import Layer

    sizes = SIZES[:4] if args.quick else SIZES
    rounds = 5 if args.quick else args.rounds
    flat = ["ring", "one_shot", "two_shot", "rhd", "tree"]
    configs = [(2, "", ""), (4, "", ""), (4, "2x2", ""), (4, "2x2", args.emulation)]
    results = {"allreduce": [], "training": []}
    print("# allreduce: predicted (fitted model of this host) against measured (forced schedule), fp32")
    print(f"{'ranks':>5} {'topology':>8} {'link':>22} {'schedule':>13} {'bytes':>10} {'measured us':>12} "
          f"{'predicted us':>13} {'error':>7}")
    calibrated = set()

    def calibrate(ranks: int, topology: str) -> None:
        """A fresh fitted model for this layout, measured just before the measurements it predicts."""
        if args.calibration == "fresh" and (ranks, topology) not in calibrated:
            local_model(ranks, topology, refresh=True)
            calibrated.add((ranks, topology))

    for ranks, topology, emulation in configs if args.part != "training" else []:
        calibrate(ranks, topology)
        names = flat + (["hierarchical", "multidim"] if topology else [])
        out = _launch(ranks, topology, emulation, "--worker", "allreduce", "--schedules", ",".join(names),
                      "--sizes", ",".join(map(str, sizes)), "--rounds", str(rounds))
        rows = json.loads(next(line[5:] for line in out.splitlines() if line.startswith("ROWS ")))
        for row in rows:
            predicted, _ = cli.local_allreduce(ranks, topology, row["bytes"], row["schedule"],
                                                    link_emulation=emulation)
            row.update(ranks=ranks, topology=topology or str(ranks), link=emulation or "-",
                       predicted_us=predicted * 1e6, error=(predicted * 1e6 - row["measured_us"]) / row["measured_us"])
            results["allreduce"].append(row)
            print(f"{ranks:>5} {row['topology']:>8} {row['link']:>22} {row['schedule']:>13} {row['bytes']:>10} "
                  f"{row['measured_us']:>12.1f} {row['predicted_us']:>13.1f} {row['error']:>+7.1%}", flush=True)
    errs = sorted(abs(r["error"]) for r in results["allreduce"])
    if errs:
        print(f"# allreduce cases: {len(errs)}; median |error| {statistics.median(errs):.1%}; within 20%: "
              f"{sum(e <= 0.2 for e in errs)}/{len(errs)}")
    if args.part == "allreduce":
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return 0

    print("\n# training iteration at 2 ranks as two emulated nodes (1x2), train_cnn's CNN, 0.1 MB buckets")
    cluster = load("local")
    planner = Planner(rank=0, size=2, topology=parse("1x2", 2, 0), link_of=lambda a, b: "mpi", forced="",
                      slot_bytes=2 << 20)
    calibrate(2, "1x2")
    for emulation in ("", args.emulation):
        out = _launch(2, "1x2", emulation, "--worker", "train", "--steps", str(args.steps), "--blocks", str(args.blocks))
        got = json.loads(next(line[6:] for line in out.splitlines() if line.startswith("TRAIN ")))
        layers = [Layer(n, p, m) for n, p, m in got["layers"]]
        measured = got["bucket_overhead_s"]  # [bytes, tail seconds, overlapped seconds] per size
        tail = [(b, t) for b, t, _ in measured]
        overlapped = [(b, o) for b, _, o in measured]

        def cost(nbytes: int, emulation=emulation) -> float:
            # the schedule the planner picks for this bucket with no table, as the run had
            choice = planner.plan("allreduce", nbytes, torch.float32).schedule
            return cli.local_allreduce(2, "1x2", nbytes, choice, link_emulation=emulation)[0]
        it = iteration.iteration(cluster, layers, 2, "ring", batch=32, compute=got["compute_s"], bucket_mb=0.1,
                             allreduce=cost, bucket_overhead=lambda nbytes, tail=tail: _interpolated(tail, nbytes),
                             overlapped_overhead=lambda nbytes, o=overlapped: _interpolated(o, nbytes))
        err = (it.iteration - got["step_s"]) / got["step_s"]
        results["training"].append({"link": emulation or "-", "measured_ms": got["step_s"] * 1e3,
                                    "compute_ms": got["compute_s"] * 1e3, "no_sync_ms": got["no_sync_s"] * 1e3,
                                    "bucket_overhead_us": [[b, t * 1e6, o * 1e6] for b, t, o in measured],
                                    "predicted_ms": it.iteration * 1e3, "error": err})
        measured_apart = ", ".join(f"{b >> 10} KiB {t * 1e6:.0f}/{o * 1e6:.0f} us" for b, t, o in measured)
        print(f"link {emulation or '-':>22}: measured {got['step_s'] * 1e3:.3f} ms/step (compute alone "
              f"{got['compute_s'] * 1e3:.3f} ms, no_sync {got['no_sync_s'] * 1e3:.3f} ms; {it.buckets} buckets, "
              f"bucket overhead measured apart, last/overlapped: {measured_apart}), predicted "
              f"{it.iteration * 1e3:.3f} ms, error {err:+.1%}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
