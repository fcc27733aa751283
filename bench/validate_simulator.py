"""Validate the simulator where we can measure: predicted against measured, per case.

Run (no launcher: it starts its own jobs):  python bench/validate_simulator.py [--quick] [--calibration fresh|cached]
                                            [--json out.json]

Part 1, allreduce per schedule (fp32, 4 KiB to 64 MiB) at 2 ranks, 4 ranks, 4 ranks as 2x2
emulated nodes, and 2x2 with the inter-node link emulated slower (``DDL_LINK_EMULATION``,
default ``mpi:bw=1GB/s,lat=50us``). Measured: each schedule forced (default options, no
tuning table), interleaved rounds after a barrier, the slowest rank's time per call, the
median. Predicted: ``python -m ddl_triton.simulate allreduce --cluster local`` (the cost
model ddl-tune fitted on this host for those ranks and topology, with the emulated link
added), i.e. ``simulate.local_allreduce``. By default each layout's model is probed afresh
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
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
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
    folder = world.bcast(os.path.join("/tmp", f"ddl_val_{os.getpid()}") if world.rank == 0 else None, root=0)
    os.makedirs(folder, exist_ok=True)
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


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


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
    p.add_argument("--worker", choices=("allreduce", "train"))
    p.add_argument("--schedules", default="")
    p.add_argument("--sizes", default="")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    p.add_argument("--emulation", default=EMULATION)
    p.add_argument("--part", choices=("all", "allreduce", "training"), default="all")
    p.add_argument("--calibration", choices=("fresh", "cached"), default="fresh",
                   help="fresh: probe this host again (a quick ddl-tune) right before measuring each layout, "
                   "since its memory speed drifts over minutes; cached: use the tables in the cache")
    p.add_argument("--json")
    args = p.parse_args()
    if args.worker == "allreduce":
        worker_allreduce(args.schedules.split(","), [int(s) for s in args.sizes.split(",")], args.rounds)
        return 0
    if args.worker == "train":
        worker_train(args.steps, args.blocks)
        return 0

    import torch

    from ddl_triton.simulation import iteration as scale, cli as simulate
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
            predicted, _ = simulate.local_allreduce(ranks, topology, row["bytes"], row["schedule"],
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
            return simulate.local_allreduce(2, "1x2", nbytes, choice, link_emulation=emulation)[0]
        it = scale.iteration(cluster, layers, 2, "ring", batch=32, compute=got["compute_s"], bucket_mb=0.1,
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
