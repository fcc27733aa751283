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
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "bench"))


class _Net(nn.Module):
    """train_scaling.py's CNN, called from a module of this script (so Dynamo compiles it whole)."""

    def __init__(self):
        super().__init__()
        from train_scaling import build_cnn

        self.body = build_cnn()

    def forward(self, x):
        return self.body(x)


def _replica(backend: str, group, compiled: bool, compiler: str):
    """train_scaling.py's trainer of one mode (the same weights, batches and optimizer in every
    mode), its DDP model compiled for a compiled mode."""
    from train_scaling import _Trainer

    trainer = _Trainer(f"{backend} {'compiled' if compiled else 'eager'}", _Net, group, None, dist.get_rank(),
                       None, False)
    trainer.backend, trainer.compiled, trainer.dynamo = backend, compiled, {}
    if compiled:
        trainer.model = torch.compile(trainer.model, backend=compiler)  # parameters() are the DDP model's
    return trainer


def count_ddp_pieces() -> list[int]:
    """How many pieces the DDPOptimizer splits each graph it compiles into, appended as it does
    (tests/multirank/compile_worker.py counts with it too)."""
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

    size = dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    control = dist.new_group(backend="gloo")
    pieces = count_ddp_pieces()
    replicas = [_replica(b, gloo if b == "gloo" else dist.group.WORLD, c, args.compiler)
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
        first_step[r.name] = r.step()
        r.dynamo = {"graph_breaks": sum(counters["graph_break"].values()),
                    "graphs": counters["stats"]["unique_graphs"], "ddp_pieces": list(pieces)}
    for r in replicas:  # and one more, untimed: a replica whose graphs the reset dropped gets them back
        dist.barrier(group=control)
        r.step()
    times = {r.name: [] for r in replicas}
    for rnd in range(args.rounds):
        order = replicas[rnd % len(replicas):] + replicas[:rnd % len(replicas)]
        for r in order:
            dist.barrier(group=control)
            times[r.name].append(statistics.median(r.step() for _ in range(args.steps)))
    digests = {r.name: r.digest()[:16] for r in replicas}
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
          f"median of {result['rounds']} rounds x {result['steps']} steps (train_scaling.py's CNN and batches)")
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
