"""One rank of bench/outer_sync_across_hosts.py: every configuration of one workload, in turn, in one
job (one torchrun per host), so that every row of a link rate shares the job's start-up and drift.

    torchrun ... bench/_outer_sync_rank.py --workload cnn|lm --steps 256 --link-rate 100mbit \\
        --configs "no-comm,gloo fp32,ddl auto,diloco H=32,streaming int4 H=32 F=4,planner" --json F

Per configuration (bench/_outer_sync_table.py parses the names): the same initial weights (seed 0)
on every rank, the same batches (each rank its own shard of the training split, drawn with a seeded
generator), ``--steps`` inner steps, each rank's model evaluated on the held-out split every
``--eval-every`` steps (both ranks at once, so neither waits for the other; evaluation time is not
counted in the training time). Recorded: each step's wall time, the eval curve, the bytes this host
sent through ``--link-iface`` (the kernel's counters of its network namespace), and a sha256 of
the replica's parameters (for a streaming DiLoCo, whose fragments sync at staggered steps, of its
global parameters: the outer optimizer's results every replica holds), gathered on every rank.
Rank 0 writes the JSON. The benchmark's own coordination goes over a gloo group of its own, with
tensors only (no pickled objects).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))
from _outer_sync_table import parse_config, planner_config  # noqa: E402
from _timing import ddl_group_with_compression  # noqa: E402

TESTBED_GOODPUT = 0.9564  # payload share of a tbf rate (ddl_triton/simulation/clusters/testbed.toml)
TESTBED_ALPHA = 8.5e-6    # one-way latency between testbed hosts (the same file)


# -- workloads -------------------------------------------------------------------------------------
class _TinyLM(nn.Module):
    """A byte-level causal transformer: embedding 256 -> d, ``layers`` pre-norm blocks (``heads``
    heads, MLP 4d), a tied output head."""

    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, context: int = 64):
        super().__init__()
        self.embed = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.zeros(context, d))
        block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x):
        t = x.shape[1]
        h = self.blocks(self.embed(x) + self.pos[:t], mask=self.mask[:t, :t], is_causal=True)
        return self.norm(h) @ self.embed.weight.T


def _stdlib_text(limit: int = 1_500_000) -> bytes:
    """The standard library's own .py sources, in sorted order, up to ``limit`` bytes."""
    base = Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for path in sorted(base.glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= limit:
            break
    return b"".join(out)[:limit]


class Workload:
    """The model, the loss and the batches of one workload; ``batch(rank, g)`` draws one training
    batch of this rank's shard, ``eval_loss(model)`` the mean loss on the held-out split."""

    def __init__(self, name: str, batch: int):
        self.name, self.batch_size = name, batch
        if name == "cnn":
            from train_cnn import build_model, load_data
            self.build = lambda: build_model(0)
            self.x, self.y, self.x_eval, self.y_eval = load_data(seed=0)
            self.tokens_per_sample = 1
        elif name == "lm":
            self.context = 64
            text = torch.frombuffer(bytearray(_stdlib_text()), dtype=torch.uint8).to(torch.int64)
            cut = int(len(text) * 0.9)
            self.train_text, self.eval_text = text[:cut], text[cut:]
            g = torch.Generator().manual_seed(1)
            starts = torch.randint(0, len(self.eval_text) - self.context - 1, (64,), generator=g)
            self.eval_batch = torch.stack([self.eval_text[s: s + self.context + 1] for s in starts])
            self.build = lambda: (torch.manual_seed(0), _TinyLM(context=self.context))[1]
            self.tokens_per_sample = self.context
        else:
            raise SystemExit(f"_outer_sync_rank.py: unknown workload {name!r} (cnn, lm)")

    def optimizer(self, params):
        if self.name == "cnn":
            return torch.optim.SGD(params, lr=0.02, momentum=0.9)
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)

    def batch(self, rank: int, size: int, g: torch.Generator):
        if self.name == "cnn":
            shard = torch.arange(rank, len(self.x), size)
            idx = shard[torch.randint(0, len(shard), (self.batch_size,), generator=g)]
            return self.x[idx], self.y[idx]
        half = len(self.train_text) // size
        lo = rank * half
        starts = lo + torch.randint(0, half - self.context - 1, (self.batch_size,), generator=g)
        seq = torch.stack([self.train_text[s: s + self.context + 1] for s in starts])
        return seq[:, :-1], seq[:, 1:]

    def loss(self, model, x, y):
        out = model(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def eval_loss(self, model) -> float:
        model.eval()
        try:
            if self.name == "cnn":
                return float(self.loss(model, self.x_eval, self.y_eval))
            return float(self.loss(model, self.eval_batch[:, :-1], self.eval_batch[:, 1:]))
        finally:
            model.train()


# -- coordination (tensors only) ------------------------------------------------------------------
class _Control:
    def __init__(self):
        self.group = dist.new_group(backend="gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        mine = torch.tensor(values, dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.group)
        return [t.tolist() for t in out]

    def gather_digest(self, digest: bytes) -> list[str]:
        mine = torch.tensor(list(digest), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.group)
        return [bytes(t.tolist()).hex() for t in out]


def _tx_bytes(iface: str) -> int:
    with open("/proc/self/net/dev") as f:
        for line in f.read().splitlines()[2:]:
            name, _, fields = line.partition(":")
            if name.strip() == iface:
                return int(fields.split()[8])
    raise SystemExit(f"_outer_sync_rank.py: rank {dist.get_rank()}: no interface {iface!r} in /proc/self/net/dev")


def _digest(tensors) -> bytes:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).numpy().tobytes())
    return h.digest()


def _measured_terms(model_bytes: int, compression: str, ctl: _Control) -> dict:
    """What ``DiLoCo(sync_every="auto")`` measures in its warm-up (ddl_triton/torch/diloco_auto.py),
    measured here before the planner row, for ``plan_sync``'s keywords: ``per_step_fp32_s``, the
    median of 4 fp32 averages of the model's size on a "ddl" group with no compression (after one
    untimed), and ``codec_s_per_byte``, each compressed per-step candidate's ``roundtrip`` timed by
    the function DiLoCo auto times it with; every rank takes the slowest rank's figures."""
    from ddl_triton import compression_methods
    from ddl_triton.planning.outer_sync import per_step_methods
    from ddl_triton.torch.diloco_auto import _codec_seconds_per_byte

    numel = model_bytes // 4
    group = ddl_group_with_compression(compression_methods.NONE)
    flat = torch.ones(numel, dtype=torch.float32)
    times = []
    for i in range(5):
        t0 = time.perf_counter()
        dist.all_reduce(flat, group=group)
        flat.div_(ctl.size)
        if i:
            times.append(time.perf_counter() - t0)
    dist.destroy_process_group(group)
    methods = [m for m in per_step_methods(compression) if m != compression_methods.NONE]
    mine = [sorted(times)[len(times) // 2], *(_codec_seconds_per_byte(m, numel) for m in methods)]
    slowest = [max(column) for column in zip(*ctl.gather_floats(mine))]
    return {"per_step_fp32_s": slowest[0], "codec_s_per_byte": dict(zip(methods, slowest[1:]))}


# -- one configuration ----------------------------------------------------------------------------
def run_config(name: str, cfg: dict, work: Workload, ctl: _Control, args) -> dict:
    net = work.build()
    model, diloco, group = net, None, None
    inner = work.optimizer(net.parameters())
    if cfg["kind"] == "per-step":
        group = dist.new_group(backend="gloo") if cfg["backend"] == "gloo" else \
            ddl_group_with_compression(cfg["compression"])
        model = DDP(net, process_group=group)
    elif cfg["kind"] == "outer":
        from ddl_triton.torch import DiLoCo
        outer = torch.optim.SGD(net.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                                nesterov=args.outer_momentum > 0)
        diloco = DiLoCo(net, inner, outer, cfg["sync_every"], fragments=cfg["fragments"],
                        fragment_sync_delay=cfg["delay"], compression=cfg["compression"])
    g = torch.Generator().manual_seed(1000 + ctl.rank)
    batches = [work.batch(ctl.rank, ctl.size, g) for _ in range(args.steps)]
    step_s, curve = [], []
    ctl.barrier()
    tx0 = _tx_bytes(args.link_iface)
    trained = 0.0
    context = diloco if diloco is not None else _Nothing()
    with context:
        for i, (x, y) in enumerate(batches):
            t0 = time.perf_counter()
            loss = work.loss(model, x, y)
            inner.zero_grad(set_to_none=False)
            loss.backward()
            inner.step()
            dt = time.perf_counter() - t0
            step_s.append(dt)
            trained += dt
            if (i + 1) % args.eval_every == 0 or i + 1 == len(batches):
                curve.append([i + 1, trained, work.eval_loss(net)])
    if diloco is not None:
        diloco.close()  # waits for averages in flight
    ctl.barrier()
    tx = _tx_bytes(args.link_iface) - tx0
    if diloco is not None and cfg["fragments"] > 1:
        digest, what = _digest(diloco.core.backups), "global parameters"
    else:
        digest, what = _digest(net.parameters()), "parameters"
    digests = ctl.gather_digest(digest)
    totals = ctl.gather_floats([trained, float(tx)])
    if group is not None:
        dist.destroy_process_group(group)
    return {"config": name, "steps": args.steps, "train_s": max(t[0] for t in totals),
            "train_s_per_rank": [t[0] for t in totals], "tx_bytes_per_host": [int(t[1]) for t in totals],
            "median_step_ms": 1e3 * sorted(step_s)[len(step_s) // 2], "curve": curve,
            "final_eval_loss": curve[-1][2], "digests": digests, "hashed": what,
            "tokens": args.steps * work.batch_size * work.tokens_per_sample * ctl.size}


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("cnn", "lm"), required=True)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--batch", type=int, default=0, help="samples per rank per step (default: cnn 32, lm 8 "
                   "sequences of 64 bytes)")
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--configs", required=True, help="comma list (bench/_outer_sync_table.py's names)")
    p.add_argument("--link-rate", required=True, help="the tbf rate of each host's link (the planner's input)")
    p.add_argument("--link-iface", default="eth0")
    p.add_argument("--streaming-method", default="int8", help="the planner row's pseudo-gradient method")
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer SGD (the paper's: 0.7, Nesterov "
                   "momentum 0.9); 1.0 with momentum 0 is plain averaging of the replicas (local SGD)")
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--no-measured-terms", dest="measured_terms", action="store_false",
                   help="plan on the link alone (runs 1-3), without the codec and per-step fp32 call measured here")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    import ddl_triton.torch  # noqa: F401 - registers "ddl"
    dist.init_process_group("ddl")
    ctl = _Control()
    args.batch = args.batch or {"cnn": 32, "lm": 8}[args.workload]
    work = Workload(args.workload, args.batch)
    names = [c for c in args.configs.split(",") if c]
    results, model_bytes = [], sum(p.numel() * 4 for p in work.build().parameters())
    for name in names:
        if name == "planner":
            base = next((r for r in results if r["config"] == "no-comm"), None)
            if base is None:
                raise SystemExit("_outer_sync_rank.py: the planner row needs the no-comm row before it")
            from ddl_triton.planning.outer_sync import plan_sync
            from ddl_triton.testbed.hosts import parse_rate
            step_s = base["train_s"] / base["steps"]  # the slowest rank's mean: every rank plans alike
            measured = _measured_terms(model_bytes, args.streaming_method, ctl) if args.measured_terms else {}
            plan = plan_sync(model_bytes=model_bytes, step_s=step_s, hosts=ctl.size, ranks_per_host=1,
                             link_bytes_per_s=parse_rate(args.link_rate) / 8 * TESTBED_GOODPUT,
                             link_latency_s=TESTBED_ALPHA, max_sync_every=128, compression=args.streaming_method,
                             fragments=4, **measured)
            chosen = planner_config(plan.mode, plan.compression, plan.sync_every, plan.fragments)
            if ctl.rank == 0:
                print(f"# planner: {plan.why} -> {chosen}", flush=True)
            result = run_config("planner", parse_config(chosen), work, ctl, args)
            result.update(planned=chosen, why=plan.why, predicted_utilisation=plan.utilisation, measured_terms=measured)
        else:
            result = run_config(name, parse_config(name), work, ctl, args)
        results.append(result)
        if ctl.rank == 0:
            print(f"# {args.workload} {name}: {result['train_s']:.2f} s, eval {result['final_eval_loss']:.4f}, "
                  f"{sum(result['tx_bytes_per_host']) / 1e6:.2f} MB sent, identical "
                  f"{len(set(result['digests'])) == 1}", flush=True)
    if ctl.rank == 0:
        meta = {"workload": args.workload, "link_rate": args.link_rate, "hosts": ctl.size, "ranks_per_host": 1,
                "steps": args.steps, "batch": args.batch, "model_bytes": model_bytes, "torch": torch.__version__,
                "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
                "streaming_method": args.streaming_method}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
