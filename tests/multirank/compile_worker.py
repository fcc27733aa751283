"""torch.compile on a DDP model, one process group backend, under torchrun: test_compile.py runs it.

    torchrun --standalone --nproc-per-node 2 compile_worker.py BACKEND MODE [MODE ...]

BACKEND: "ddl" or "gloo". Each MODE trains the same small MLP from the same initial weights on the
same batches (different per rank) for ``STEPS`` SGD steps, under DDP with buckets small enough
for several (so Dynamo's DDPOptimizer splits the compiled graph at their boundaries):

    eager               no compilation
    aot_eager           torch.compile(ddp, backend="aot_eager"): the same aten ops as eager
    inductor            torch.compile(ddp): inductor's CPU kernels
    compiled_autograd   aot_eager forward, and backward through compiled autograd
                        (torch._dynamo.config.optimize_ddp = "python_reducer")
    aot_eager+hook      aot_eager, with ddl_triton's allreduce_hook registered on DDP
    aot_eager+int8      aot_eager, with ddl_triton's int8_compress_hook (lossy: its own weights)

Rank 0 prints one line per mode, ``RESULT {json}``: the weights' SHA-256, the loss, whether every
rank holds the same weight bytes, Dynamo's graph breaks and graphs, and the DDPOptimizer's
buckets (the pieces the graph was split into). Any failure raises: the process exits non-zero.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from compile_step_time import count_ddp_pieces  # noqa: E402 - the benchmark's own counter of the DDPOptimizer's pieces

STEPS = 4
BUCKET_CAP_MB = 1  # one of the MLP's four 1 MiB layers per bucket (the DDPOptimizer needs caps >= 1 MiB)
WIDTH = 512


class MLP(nn.Module):
    """Four layers of one size (the DDPOptimizer wants its first bucket no larger than the others).
    A module class of the user's own, as in any real model: Dynamo compiles a forward of
    torch.nn's own classes (nn.Sequential) only when it inlines it from user code, and DDP calls
    the module from code Dynamo skips."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = torch.relu(x) if i < len(self.layers) - 1 else x
        return x


def _model() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def _weights_bytes(model: nn.Module) -> bytes:
    return b"".join(p.detach().contiguous().view(torch.uint8).numpy().tobytes() for p in model.parameters())


def _same_on_every_rank(blob: bytes) -> bool:
    mine = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return all(torch.equal(every[0], other) for other in every[1:])


def train(mode: str, buckets_seen: list[int]) -> dict:
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    dynamo.reset()
    counters.clear()
    del buckets_seen[:]
    # DDP chooses its reducer when it is built: compiled autograd needs the Python one.
    dynamo.config.optimize_ddp = "python_reducer" if mode == "compiled_autograd" else True
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    if mode.endswith("+hook") or mode.endswith("+int8"):
        from ddl_triton.torch import hooks

        ddp.register_comm_hook(hooks.HookState(), hooks.int8_compress_hook if mode.endswith("+int8")
                               else hooks.allreduce_hook)
    run = ddp
    if mode != "eager":
        run = torch.compile(ddp, backend="inductor" if mode == "inductor" else "aot_eager")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        x = torch.randn(16, WIDTH, generator=g)
        y = torch.randn(16, WIDTH, generator=g)
        loss = (run(x) - y).square().mean()
        opt.zero_grad()
        if mode == "compiled_autograd":
            with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
                loss.backward()
        else:
            loss.backward()
        opt.step()
        losses.append(float(loss))
    dynamo.config.optimize_ddp = True
    blob = _weights_bytes(model)
    return {"mode": mode, "sha": hashlib.sha256(blob).hexdigest()[:16], "losses": losses,
            "identical": _same_on_every_rank(blob),
            "graph_breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"],
            "ddp_buckets": list(buckets_seen)}


def main() -> int:
    backend, modes = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    if backend == "ddl":
        import ddl_triton.torch  # noqa: F401 - registers "ddl"
    dist.init_process_group(backend)
    buckets_seen = count_ddp_pieces()
    for mode in modes:
        result = train(mode, buckets_seen)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({"backend": backend, **result}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
