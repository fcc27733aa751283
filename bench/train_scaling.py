"""Data-parallel training scaling at 2 ranks: ddl_triton against gloo and against the host's ceiling.

Run:  ddlrun -n 2 -- python bench/train_scaling.py [--model cnn|mlp|both] [--steps 5] [--rounds 10]
                                                  [--gradient-as-bucket-view] [--json F]

Workloads (synthetic data, batch 32 per rank, SGD with momentum 0.9, one torch thread per rank):
- ``cnn``: a ResNet-style CNN on 3x32x32 images: stem conv 3->32, basic blocks 32->32, 32->64,
  64->128 and 128->192 (stride-2 downsampling, BatchNorm), global average pool, linear to 10
  classes; about 0.89M parameters (3.5 MB of fp32 gradients per step).
- ``mlp``: 3072 -> 1536 -> 768 -> 10 with ReLU on flattened 3x32x32 images; about 5.9M
  parameters (23.6 MB of gradients per step), so communication matters more.

Modes, timed in interleaved rounds (every mode once per round, the order rotating):
- ``1 rank``: one rank trains alone, without DDP, while the other sleeps (the baseline); rank 0
  in even rounds and rank 1 in odd ones, since the two cores of a host need not be equally fast;
- ``2 independent``: both ranks train without any communication: the ceiling this host allows
  (the two cores share memory bandwidth and caches, so it is below 100%);
- ``ddp no-comm``: DDP on "ddl" with a comm hook that communicates nothing and no buffer
  broadcast: DDP's own work (autograd hooks, copies into and out of its buckets), the best
  any backend can do under DDP; its replicas diverge, so they are not compared;
- ``ddp lockstep``: DDP on "ddl" with a comm hook that allreduces 4 bytes per bucket
  (asynchronously, as a real bucket) and leaves the gradients alone, buffer broadcast on:
  everything "ddl" does but move the gradients, so ``ddl`` against it is the cost of the
  gradient bytes, and it against ``ddp no-comm`` the cost of keeping the ranks in step (the
  slower rank of each step sets the pace; the two ranks compute the same phase at once);
  its replicas diverge, so they are not compared;
- ``gloo``: DDP on torch's gloo;
- ``ddl``: DDP on the "ddl" backend (DDP's own allreduce through the process group);
- ``ddl+<hook>``: DDP on "ddl" with a comm hook from ddl_triton.torch.hooks.

"cpu ms" is the CPU time one rank's process spends per step, every thread included (the
busiest rank's): what communication costs the cores beside the time it adds. A step's time
is, for each step, the slowest rank's; a round's figure is the median over its steps; the
table quotes the median over rounds. The ratios are paired: each round's ratio of two
modes' figures, then the median over rounds, so the host's drift, which every mode of a
round shares, cancels. Efficiency = 1-rank step / step (img/s over twice the 1-rank img/s);
"of ceiling" = 2-independent step / step. After the last round, every DDP mode's replicas
that communicate are compared across ranks, bit for bit.
``--gradient-as-bucket-view`` passes DDP's own option of that name to every DDP mode
(gradients live in DDP's buckets: no copy into or out of them).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

from _timing import unchanged_bucket_hook  # bench/ is on the path when run as a script

BATCH = 32
HOOKS = ("allreduce", "fp16", "bf16", "int8", "onebit")
NO_COMM = "ddp no-comm"
LOCKSTEP = "ddp lockstep"


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def build_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        _BasicBlock(32, 32, 1), _BasicBlock(32, 64, 2), _BasicBlock(64, 128, 2), _BasicBlock(128, 192, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(192, 10))


def build_mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3072, 1536), nn.ReLU(), nn.Linear(1536, 768), nn.ReLU(),
                         nn.Linear(768, 10))


MODELS = {"cnn": build_cnn, "mlp": build_mlp}


def _idle_barrier(world) -> None:
    """A barrier that sleeps while it waits, so a rank sitting a mode out leaves its core free."""
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def _batches(rank: int, count: int = 4):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(count)]


class _Trainer:
    """One mode's replica: its own model and optimizer, trained across all rounds."""

    def __init__(self, name: str, build, group, comm, rank: int, bucket_cap_mb: float | None, bucket_view: bool):
        torch.manual_seed(0)  # the same initial weights on every rank and in every mode
        net = build()
        self.name, self.rank = name, rank
        self.ddp = group is not None
        # Identical replicas are checked where the mode communicates gradients.
        self.synced = self.ddp and name not in (NO_COMM, LOCKSTEP)
        ddp_options = {"process_group": group, "bucket_cap_mb": bucket_cap_mb,
                       "gradient_as_bucket_view": bucket_view}
        if name == NO_COMM:
            ddp_options["forward_sync_buffers"] = False  # DDP's only communication besides gradients
        self.model = DDP(net, **ddp_options) if self.ddp else net
        if name == NO_COMM:
            self.model.register_comm_hook(None, unchanged_bucket_hook)
        elif name == LOCKSTEP:
            self.model.register_comm_hook(comm, _lockstep_hook)
        elif name.startswith("ddl+"):
            from ddl_triton.torch import hooks
            hook = {"allreduce": hooks.allreduce_hook, "fp16": hooks.fp16_compress_hook,
                    "bf16": hooks.bf16_compress_hook, "int8": hooks.int8_compress_hook,
                    "onebit": hooks.onebit_compress_hook}[name[4:]]
            self.model.register_comm_hook(hooks.HookState(comm), hook)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.data = _batches(rank)
        self.i = 0

    def step(self) -> float:
        """One training step; returns its wall time in seconds."""
        x, y = self.data[self.i % len(self.data)]
        self.i += 1
        t0 = time.perf_counter()
        loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.opt.step()
        return time.perf_counter() - t0

    def digest(self) -> str:
        h = hashlib.sha256()
        for p in self.model.parameters():
            h.update(p.detach().contiguous().numpy().tobytes())
        return h.hexdigest()


def _lockstep_hook(comm, bucket):
    """A DDP comm hook that waits for every rank's same bucket (a 4-byte allreduce, issued
    asynchronously like a real bucket's) and returns the bucket unchanged."""
    future = torch.futures.Future()
    comm.allreduce(torch.zeros(1), async_op=True).add_done_callback(lambda _: future.set_result(bucket.buffer()))
    return future


def _setup(world) -> None:
    """torch.distributed on "ddl" (the default group) with a gloo group beside it, both over
    torch's TCP store on a port rank 0 picks."""
    import ddl_triton.torch  # noqa: F401 - registers "ddl"
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    else:
        port = None
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(world.bcast(port, root=0))
    dist.init_process_group("ddl", rank=world.rank, world_size=world.size)


def run(model: str, steps: int, rounds: int, modes: list[str], world, bucket_cap_mb: float | None = None,
        bucket_view: bool = False) -> dict:
    import ddl_triton as ddl
    rank = world.rank
    comm = ddl.init()
    gloo = dist.new_group(backend="gloo")
    groups = {"1 rank": None, "2 independent": None, "gloo": gloo}
    trainers = {m: _Trainer(m, MODELS[model], groups.get(m, dist.group.WORLD), comm, rank, bucket_cap_mb,
                            bucket_view)
                for m in modes}
    times: dict[str, list[float]] = {m: [] for m in modes}  # per round: the median step, seconds
    cpu_times: dict[str, list[float]] = {m: [] for m in modes}  # CPU seconds per step, all threads
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for m in order:
            t = trainers[m]
            _idle_barrier(world)
            active = m != "1 rank" or rank == r % world.size
            steps_taken = []
            cpu = 0.0
            if active:
                for _ in range(2):
                    t.step()  # warm-up: caches, buckets rebuilt, the allocator's pools
                cpu0 = time.process_time()
                steps_taken = [t.step() for _ in range(steps)]
                cpu = (time.process_time() - cpu0) / steps
            per_rank = world.allgather((steps_taken, cpu))  # control path
            slowest = [max(s[i] for s, _ in per_rank if s) for i in range(steps)]
            times[m].append(statistics.median(slowest))
            cpu_times[m].append(max(c for _, c in per_rank if c))
    digests = {m: world.allgather(trainers[m].digest()) for m in modes if trainers[m].synced}
    params = sum(p.numel() for p in trainers[modes[0]].model.parameters())

    def paired(numerator: str, m: str) -> list[float]:
        """Per round: that round's ``numerator`` step / mode m's step (none for the baseline itself)."""
        if numerator not in times or m == "1 rank":
            return []
        return [a / b for a, b in zip(times[numerator], times[m])]

    rows = []
    for m in modes:
        ranks = 1 if m == "1 rank" else world.size
        step = statistics.median(times[m])
        rows.append({"mode": m, "step_ms": step * 1e3, "step_ms_rounds": [x * 1e3 for x in times[m]],
                     "cpu_ms": statistics.median(cpu_times[m]) * 1e3,
                     "img_per_s": ranks * BATCH / step,
                     "efficiency": _median_or_none(paired("1 rank", m)),
                     "of_ceiling": _median_or_none(paired("2 independent", m)),
                     "of_ceiling_rounds": paired("2 independent", m),
                     "identical": (len(set(digests[m])) == 1) if m in digests else None})
    return {"model": model, "params": params, "batch_per_rank": BATCH, "steps": steps, "rounds": rounds,
            "ranks": world.size, "gradient_as_bucket_view": bucket_view, "bucket_cap_mb": bucket_cap_mb, "rows": rows}


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _print(result: dict) -> None:
    view = ", gradient_as_bucket_view" if result["gradient_as_bucket_view"] else ""
    view += f", bucket cap {result['bucket_cap_mb']} MB" if result["bucket_cap_mb"] is not None else ""
    print(f"# {result['model']}: {result['params'] / 1e6:.2f}M parameters, batch {result['batch_per_rank']} per "
          f"rank, {result['ranks']} ranks, median of {result['rounds']} rounds x {result['steps']} steps{view}")
    print(f"{'mode':>16} {'step ms':>9} {'cpu ms':>8} {'img/s':>8} {'efficiency':>10} {'of ceiling':>10} "
          f"{'identical':>9}")
    for row in result["rows"]:
        eff = f"{row['efficiency']:.1%}" if row["efficiency"] else "-"
        ofc = f"{row['of_ceiling']:.1%}" if row["of_ceiling"] else "-"
        same = {None: "-", True: "yes", False: "NO"}[row["identical"]]
        print(f"{row['mode']:>16} {row['step_ms']:>9.2f} {row['cpu_ms']:>8.2f} {row['img_per_s']:>8.1f} {eff:>10} "
              f"{ofc:>10} {same:>9}",
              flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("cnn", "mlp", "both"), default="both")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode per round")
    p.add_argument("--rounds", type=int, default=10, help="short rounds, many of them: the host's noise "
                   "drifts over seconds, and every mode should see the same drift")
    p.add_argument("--modes", default="", help="comma list (default: every mode)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP's bucket cap (default: DDP's own, 25 MB after a first bucket of 1 MiB; a cap given "
                   "explicitly applies to the first bucket too)")
    p.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="DDP's option: gradients live in its buckets (no copies into or out of them)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    if world.size != 2:
        raise SystemExit("train_scaling.py: run it on 2 ranks (ddlrun -n 2 -- python bench/train_scaling.py)")
    modes = args.modes.split(",") if args.modes else ["1 rank", "2 independent", NO_COMM, LOCKSTEP, "gloo", "ddl"] + \
        [f"ddl+{h}" for h in HOOKS]
    _setup(world)
    results = []
    for model in (("cnn", "mlp") if args.model == "both" else (args.model,)):
        result = run(model, args.steps, args.rounds, modes, world, args.bucket_cap_mb,
                     args.gradient_as_bucket_view)
        results.append(result)
        if world.rank == 0:
            _print(result)
    if world.rank == 0 and args.json:
        meta = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
                "python": sys.version.split()[0]}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
