"""What observability costs: the flight recorder on the 8-byte allreduce, tracing on training.

Run: ddlrun -n 2 -- python bench/observability.py [--json out.json]

Part 1 times an 8-byte fp32 allreduce back to back, in interleaved rounds of one run:
with the flight recorder as it always is; with the recorder replaced by a stub that keeps
nothing (what the recorder costs); and with the timeline on (``DDL_TRACE``). Each round
starts after a barrier and takes the slowest rank's time per call; medians are quoted.

Part 2 trains examples/train_cnn.py's CNN under DDP (gradients through the ``allreduce``
comm hook, 0.1 MB buckets so the allreduces overlap backward), alternating blocks of
steps with the timeline off and on, and quotes the median step time (slowest rank) and
img/s of each.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from mpi4py import MPI

import ddl_triton as ddl
from _timing import time_per_call
from ddl_triton.observability import flight
from ddl_triton.observability import tracer as tracer_mod


class _NoRecord:
    """A flight record that keeps nothing (the recorder switched off, for comparison)."""
    __slots__ = ("seq", "call", "schedule", "state", "step", "t_issue", "t_start", "t_end", "error", "waiting", "site",
                 "comm")

    def __init__(self, seq, call):
        self.seq, self.call, self.site, self.t_issue = seq, call, None, 0.0  # the fast path reads t_issue


def _stub_issue(comm, seq, call):
    return _NoRecord(seq, call)


def latency(world, comm, tracer, rounds: int, iters: int) -> dict:
    x = torch.ones(2)
    real_issue = flight.RECORDER.issue
    modes = {}

    def recorder_on():
        flight.RECORDER.issue = real_issue
        comm.tracer = None

    def recorder_off():
        flight.RECORDER.issue = _stub_issue
        comm.tracer = None

    def tracing_on():
        flight.RECORDER.issue = real_issue
        comm.tracer = tracer

    modes = {"recorder on (default)": recorder_on, "recorder off": recorder_off, "recorder + trace on": tracing_on}
    times = {k: [] for k in modes}
    for r in range(rounds):
        for name, enter in modes.items():
            enter()
            times[name].append(time_per_call(world, lambda: comm.allreduce(x), iters))
    recorder_on()
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def training(world, comm, tracer, blocks: int, steps: int) -> dict:
    from ddl_triton.examples import train_cnn as cnn
    from ddl_triton.torch import hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    x_train, y_train, _, _ = cnn.load_data(0, mpi_comm=world)
    model = DDP(cnn.build_model(0), bucket_cap_mb=0.1)
    state = hooks.HookState(comm)
    model.register_comm_hook(state, hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batch = 32
    g = torch.Generator().manual_seed(1)
    times = {"trace off": [], "trace on": []}

    def step():
        idx = torch.randint(0, len(y_train), (batch,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()

    for _ in range(5):
        step()
    for b in range(2 * blocks):
        name = "trace on" if b % 2 else "trace off"
        comm.tracer = tracer if name == "trace on" else None
        for _ in range(steps):
            world.Barrier()
            t0 = time.perf_counter()
            step()
            times[name].append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    comm.tracer = None
    out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"step_ms": med * 1e3, "img_per_s": batch * world.size / med}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    folder = world.bcast(tempfile.mkdtemp(prefix="ddl_obs_") if world.rank == 0 else None, root=0)
    comm = ddl.init(world.Dup(), trace=folder)      # measures the clock offset, makes the tracer
    tracer = comm.tracer
    comm.tracer = None
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=world.rank, world_size=world.size)
    lat = latency(world, comm, tracer, args.rounds, args.iters)
    train = training(world, comm, tracer, args.blocks, args.steps)
    if world.rank == 0:
        print(f"# 8-byte allreduce, {world.size} ranks, median of {args.rounds} interleaved rounds of {args.iters} calls")
        base = lat["recorder off"]
        for name, us in lat.items():
            print(f"{name:>24}: {us:7.2f} us  ({us - base:+.2f} us vs recorder off)")
        print(f"# DDP training (train_cnn's CNN, batch 32 per rank, 0.1 MB buckets), {2 * args.blocks} alternating "
              f"blocks of {args.steps} steps; median step of the slowest rank")
        off = train["trace off"]["step_ms"]
        for name, r in train.items():
            print(f"{name:>24}: {r['step_ms']:7.3f} ms/step, {r['img_per_s']:8.0f} img/s ({r['step_ms'] / off - 1:+.1%})")
        if args.json:
            Path(args.json).write_text(json.dumps({"latency_us": lat, "training": train}, indent=1))
    dist.destroy_process_group()
    tracer_mod.TRACERS.clear()
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
