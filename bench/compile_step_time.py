"""torch.compile on DDP: training step time on "ddl" beside gloo, eager and compiled, in one interleaved run.

    torchrun --nproc-per-node 2 bench/compile_step_time.py             # one host: ddl over shm
    ddlrun -n 2 -- python bench/compile_step_time.py                   # the same under MPI
    python bench/compile_step_time.py --testbed --rate 1gbit           # 2 testbed hosts x 1 rank (ddlrun)

Four replicas train side by side on every rank, from the same weights on the same batches:
DDP on a gloo group and on the "ddl" group, each eager and under ``torch.compile`` (inductor by
default). The model is the CNN of ``bench/train_scaling.py`` inside a module class of its own
(Dynamo compiles user code from the top; DDP calls the module from code Dynamo skips). Each round
times ``--steps`` steps of every mode in turn (modes in a rotated order, after two untimed steps);
figures are medians over rounds, and "ddl / gloo" the median of the per-round ratios. The first
compiled step of each backend is timed apart: compilation, once per process.

Also printed: Dynamo's graph breaks and graphs and the DDPOptimizer's pieces for each compiled
mode (counted while it compiled), and whether each mode's replicas hold the same bytes on every
rank and the same weights as the other backend's (gloo and "ddl" sum two ranks' gradients to the
same bits, so eager gloo == eager ddl, and compiled gloo == compiled ddl).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "bench"))
BATCH = 32


class _Net(nn.Module):
    """train_scaling.py's CNN, called from a module of this script (so Dynamo compiles it whole)."""

    def __init__(self):
        super().__init__()
        from train_scaling import build_cnn

        self.body = build_cnn()

    def forward(self, x):
        return self.body(x)


class _Replica:
    def __init__(self, backend: str, group, compiled: bool, compiler: str):
        torch.manual_seed(0)
        self.name = f"{backend} {'compiled' if compiled else 'eager'}"
        self.backend, self.compiled = backend, compiled
        self.net = _Net()
        self.ddp = nn.parallel.DistributedDataParallel(self.net, process_group=group)
        self.run = torch.compile(self.ddp, backend=compiler) if compiled else self.ddp
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=0.01, momentum=0.9)
        self.dynamo: dict = {}

    def step(self, x, y) -> float:
        t0 = time.perf_counter()
        loss = F.cross_entropy(self.run(x), y)
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.opt.step()
        return time.perf_counter() - t0

    def digest(self) -> str:
        h = hashlib.sha256()
        for p in self.net.parameters():
            h.update(p.detach().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


def _ddp_pieces() -> list[int]:
    """How many pieces the DDPOptimizer splits each graph it compiles into, appended as it does."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    seen: list[int] = []
    original = DDPOptimizer.compile_fn

    def compile_fn(self, gm, example_inputs):
        out = original(self, gm, example_inputs)
        seen.append(len(self.buckets))
        return out

    DDPOptimizer.compile_fn = compile_fn
    return seen


def run(args) -> dict:
    from torch._dynamo.utils import counters

    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    control = dist.new_group(backend="gloo")
    pieces = _ddp_pieces()
    g = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
               for _ in range(4)]
    replicas = [_Replica(b, gloo if b == "gloo" else None, c, args.compiler)
                for c in (False, True) for b in ("gloo", "ddl")]
    first_step = {}
    for r in replicas:  # one untimed step each; a compiled one compiles here, from a clean cache
        dist.barrier(group=control)
        if r.compiled:
            # Both compiled replicas run the same code: without a reset the second would reuse the
            # first's graphs, and Dynamo's counts would say nothing about its backend.
            torch._dynamo.reset()
        counters.clear()
        del pieces[:]
        first_step[r.name] = r.step(*batches[0])
        r.dynamo = {"graph_breaks": sum(counters["graph_break"].values()),
                    "graphs": counters["stats"]["unique_graphs"], "ddp_pieces": list(pieces)}
    for r in replicas:  # and one more, untimed: a replica whose graphs the reset dropped gets them back
        dist.barrier(group=control)
        r.step(*batches[1])
    i = 2
    times = {r.name: [] for r in replicas}
    for rnd in range(args.rounds):
        order = replicas[rnd % len(replicas):] + replicas[:rnd % len(replicas)]
        for r in order:
            dist.barrier(group=control)
            ts = [r.step(*batches[(i + k) % 4]) for k in range(args.steps)]
            times[r.name].append(statistics.median(ts))
        i += args.steps
    digests = {r.name: r.digest() for r in replicas}
    every = [None] * size
    dist.all_gather_object(every, digests, group=control)
    rows = []
    for r in replicas:
        peer = f"{'ddl' if r.backend == 'gloo' else 'gloo'} {'compiled' if r.compiled else 'eager'}"
        ratios = [a / b for a, b in zip(times[r.name], times[peer])] if r.backend == "ddl" else []
        rows.append({"mode": r.name, "step_ms": 1e3 * statistics.median(times[r.name]),
                     "ddl_over_gloo": statistics.median(ratios) if ratios else None,
                     "first_step_s": first_step[r.name], **r.dynamo,
                     "identical": all(d[r.name] == digests[r.name] for d in every),
                     "same_as_other_backend": digests[r.name] == digests[peer]})
    return {"ranks": size, "rounds": args.rounds, "steps": args.steps, "compiler": args.compiler,
            "torch": torch.__version__, "rows": rows}


def _print(result: dict) -> None:
    print(f"# compile_step_time: {result['ranks']} ranks, torch {result['torch']}, compiler {result['compiler']}, "
          f"median of {result['rounds']} rounds x {result['steps']} steps (CNN, batch {BATCH} per rank)")
    print("| mode | step ms | ddl / gloo | first step s | graph breaks | graphs | DDP pieces | replicas identical "
          "| same weights as the other backend |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        ratio = f"{row['ddl_over_gloo']:.3f}" if row["ddl_over_gloo"] is not None else "–"
        dyn = (f"{row['graph_breaks']} | {row['graphs']} | {row['ddp_pieces']}" if "compiled" in row["mode"]
               else "– | – | –")
        print(f"| {row['mode']} | {row['step_ms']:.1f} | {ratio} | {row['first_step_s']:.2f} | {dyn} | "
              f"{row['identical']} | {row['same_as_other_backend']} |", flush=True)


def _on_testbed(args) -> int:
    """Run this script under ddlrun on 2 testbed hosts x 1 rank, links shaped to ``args.rate``."""
    from ddl_triton.testbed import Testbed

    env = ["env", "UCX_NET_DEVICES=eth0", "GLOO_SOCKET_IFNAME=eth0", f"HYDRA_LAUNCHER_EXEC={BIN / 'ddl-testbed-ssh'}",
           "DDL_TUNING_FILE=off", "OMP_NUM_THREADS=1"]
    command = [*env, str(BIN / "ddlrun"), "-n", "2", "-H", "h1:1,h2:1", "--", sys.executable, str(Path(__file__)),
               "--rounds", str(args.rounds), "--steps", str(args.steps), "--compiler", args.compiler]
    if args.json:
        command += ["--json", str(Path(args.json).resolve())]
    with Testbed(hosts=2, rate=args.rate) as bed:
        return bed.run("h1", command, cwd=str(ROOT), capture_output=False, timeout=1800).returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode per round")
    p.add_argument("--compiler", default="inductor", help="torch.compile's backend")
    p.add_argument("--testbed", action="store_true", help="2 testbed hosts x 1 rank, under ddlrun")
    p.add_argument("--rate", default="1gbit", help="with --testbed: the rate each host's link is shaped to")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.testbed:
        return _on_testbed(args)
    torch.set_num_threads(1)
    os.environ.setdefault("DDL_TUNING_FILE", "off")
    import ddl_triton.torch  # noqa: F401 - registers "ddl"
    dist.init_process_group("ddl")
    result = run(args)
    if dist.get_rank() == 0:
        _print(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
