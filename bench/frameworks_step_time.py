"""Step time of Accelerate and Lightning on "ddl" beside gloo in the same framework, on one host and across hosts.

Run (from the repository root; results: bench/results/frameworks_step_time.md):

    .venv/bin/python bench/frameworks_step_time.py [--rounds 3] [--steps 12] [--lock /tmp/ddl_bench.lock]
    .venv/bin/python bench/frameworks_step_time.py --hosts 2 --rate 1gbit --lock /tmp/ddl_bench.lock   # testbed

The workload is bench/train_scaling.py's ResNet-style CNN (0.89M parameters, 3.5 MB of fp32
gradients per step), batch 32 per rank of synthetic 3x32x32 images, SGD with momentum 0.9, one
torch thread per rank, 2 ranks. Four jobs per round, in an order that rotates every round:

- ``accelerate ddl``: ``Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="ddl")])``
  after ``ddl_triton.torch.accelerate.use_ddl_on_cpu()``; ``accelerate gloo``: the same kwargs, gloo;
- ``lightning ddl`` / ``lightning gloo``: ``Trainer(strategy=DDPStrategy(process_group_backend=...))``.

Each job is one torchrun (a backend cannot be initialised twice in one torchrun process: the
agent's store keeps the first group's keys), so a job's figure is its own median: ``--warmup``
untimed steps, then ``--steps`` timed ones, a step's time being the slowest rank's interval from
one step's start to the next's (the framework's whole loop: forward, backward with DDP's
allreduces, optimizer). The table quotes, per framework, the median over rounds of each backend's
figure and the median of the per-round ratios ddl / gloo (below 1: "ddl" is faster).

``--hosts 1``: ``torchrun --standalone --nproc-per-node 2`` (shm between the ranks under "ddl").
``--hosts 2``: a testbed of two hosts whose links are shaped to ``--rate`` (docs/testbed.md; needs
root), one rank per host, one ``torchrun --nnodes 2 --node-rank i`` per host meeting at h1 (c10d
rendezvous), GLOO_SOCKET_IFNAME=eth0 ("ddl" goes between the hosts over its gloo transport).
DDL_TUNING_FILE=off. ``--lock F`` holds an exclusive flock on F during each job.
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

from _host_jobs import locked, wait_for_every_host  # bench/ is on the path when run as a script

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
JOBS = (("accelerate", "ddl"), ("accelerate", "gloo"), ("lightning", "ddl"), ("lightning", "gloo"))
_MARK = "frameworks_step_time: result "


# -- one rank of one job (under torchrun) --------------------------------------------------------

def _data(rank: int, count: int = 4):
    import torch

    from train_scaling import BATCH  # bench/ is on the path when run as a script
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own images, as in train_scaling.py
    return torch.randn(count * BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (count * BATCH,), generator=g)


def _accelerate(backend: str, total: int) -> list[float]:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from train_scaling import BATCH, build_cnn
    if backend == "ddl":
        from ddl_triton.torch.accelerate import use_ddl_on_cpu
        use_ddl_on_cpu()
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend=backend)])
    torch.manual_seed(0)
    model = build_cnn()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    x, y = _data(acc.process_index)
    starts = []
    for step in range(total + 1):
        starts.append(time.perf_counter())
        if step == total:
            break
        i = step % (len(x) // BATCH)
        loss = torch.nn.functional.cross_entropy(model(x[i * BATCH:(i + 1) * BATCH]), y[i * BATCH:(i + 1) * BATCH])
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
    return [b - a for a, b in zip(starts, starts[1:])]


def _lightning(backend: str, total: int) -> list[float]:
    import lightning.pytorch as pl
    import torch

    from train_scaling import BATCH, build_cnn
    if backend == "ddl":
        import ddl_triton.torch  # noqa: F401  (registers the backend "ddl")

    class Cnn(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_cnn()
            self.starts: list[float] = []

        def on_train_batch_start(self, batch, batch_idx):
            self.starts.append(time.perf_counter())

        def on_train_end(self):
            self.starts.append(time.perf_counter())

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    torch.manual_seed(0)
    module = Cnn()
    x, y = _data(int(os.environ["RANK"]))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = pl.Trainer(accelerator="cpu", devices=local, num_nodes=int(os.environ["WORLD_SIZE"]) // local,
                         strategy=pl.strategies.DDPStrategy(process_group_backend=backend), max_steps=total,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    trainer.fit(module, loader)
    return [b - a for a, b in zip(module.starts, module.starts[1:])]


def _rank_job(framework: str, backend: str, warmup: int, steps: int) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    times = (_accelerate if framework == "accelerate" else _lightning)(backend, warmup + steps)[warmup:]
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # after the timed steps: a step lasts as long as its slowest rank
    if dist.get_rank() == 0:
        print(_MARK + json.dumps({"framework": framework, "backend": backend, "world": dist.get_world_size(),
                                  "ms": statistics.median(slowest.tolist()) * 1e3}), flush=True)
    dist.destroy_process_group()
    return 0


# -- the driver ------------------------------------------------------------------------------------

def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT", "PMI_RANK", "PMI_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DDL_TUNING_FILE=os.environ.get("DDL_TUNING_FILE", "off"),
               PYTHONWARNINGS="ignore")
    return env


def _job_argv(args, framework: str, backend: str) -> list[str]:
    return [str(Path(__file__).resolve()), "--rank-job", framework, backend, "--warmup", str(args.warmup),
            "--steps", str(args.steps)]


def _parse(text: str, what: str) -> float:
    for line in text.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])["ms"]
    raise RuntimeError(f"frameworks_step_time: {what} printed no result:\n{text[-4000:]}")


def _one_host(args, framework: str, backend: str) -> float:
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", *_job_argv(args, framework, backend)]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=args.timeout,
                          stdin=subprocess.DEVNULL)
    if done.returncode:
        raise RuntimeError(f"frameworks_step_time: {framework} {backend} exit {done.returncode}:\n{done.stdout[-3000:]}"
                           f"{done.stderr[-3000:]}")
    return _parse(done.stdout, f"{framework} {backend}")


def _two_hosts(args, bed, job: int, framework: str, backend: str) -> float:
    import tempfile

    env = dict(_env(), GLOO_SOCKET_IFNAME="eth0", UCX_NET_DEVICES="eth0")
    env.pop("DDL_TOPOLOGY", None)  # the grid must come from the hosts
    cmd = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "h1:29400", "--rdzv-id", f"frameworks-{job}", *_job_argv(args, framework, backend)]
    outs = [tempfile.TemporaryFile("w+") for _ in bed.hosts]  # files, not pipes: a full pipe would stall a host
    procs = [bed.popen(h, cmd, cwd=str(ROOT), env=env, stdout=out, stderr=subprocess.STDOUT)
             for h, out in zip(bed.hosts, outs)]
    codes = wait_for_every_host(procs, args.timeout)
    texts = []
    for out in outs:
        out.seek(0)
        texts.append(out.read())
        out.close()
    if any(codes):
        raise RuntimeError(f"frameworks_step_time: {framework} {backend} exits {codes}:\n" +
                           "\n".join(t[-3000:] for t in texts))
    return _parse("\n".join(texts), f"{framework} {backend}")


def _rounds(args, run) -> dict[tuple[str, str], list[float]]:
    figures: dict[tuple[str, str], list[float]] = {job: [] for job in JOBS}
    for r in range(args.rounds):
        order = JOBS[r % len(JOBS):] + JOBS[:r % len(JOBS)]  # rotating: no job always first after a pause
        for k, (framework, backend) in enumerate(order):
            with locked(args.lock):
                ms = run(r * len(JOBS) + k, framework, backend)
            figures[(framework, backend)].append(ms)
            print(f"# round {r + 1}: {framework} {backend} {ms:.1f} ms/step", flush=True)
    return figures


def _table(figures: dict[tuple[str, str], list[float]], title: str) -> str:
    lines = [f"### {title}", "", "| framework | ddl ms/step | gloo ms/step | ddl / gloo (paired median) | rounds |",
             "|---|---|---|---|---|"]
    for framework in ("accelerate", "lightning"):
        ddl, gloo = figures[(framework, "ddl")], figures[(framework, "gloo")]
        ratio = statistics.median(d / g for d, g in zip(ddl, gloo))
        lines.append(f"| {framework} | {statistics.median(ddl):.1f} | {statistics.median(gloo):.1f} | {ratio:.3f} "
                     f"| {len(ddl)} |")
    lines += ["", "Per round (ms/step): " + "; ".join(
        f"{f} {b} {', '.join(f'{v:.1f}' for v in vs)}" for (f, b), vs in figures.items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, choices=(1, 2), default=1, help="1: shm on this host; 2: a testbed")
    p.add_argument("--rate", default="1gbit", help="with --hosts 2: each host's link rate")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--timeout", type=float, default=300, help="seconds per job")
    p.add_argument("--lock", default="", help="hold an exclusive flock on this file during each job")
    p.add_argument("--md", default="", help="also write the table to this file")
    p.add_argument("--rank-job", nargs=2, metavar=("FRAMEWORK", "BACKEND"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_job:
        return _rank_job(*args.rank_job, args.warmup, args.steps)
    if args.hosts == 1:
        title = "One host, 2 ranks (shm under \"ddl\")"
        table = _table(_rounds(args, lambda job, f, b: _one_host(args, f, b)), title)
    else:
        from ddl_triton.testbed import Testbed, reap
        reap()
        title = f"Two testbed hosts at {args.rate}, one rank each (torchrun, c10d rendezvous at h1)"
        with Testbed(hosts=2, rate=args.rate) as bed:
            table = _table(_rounds(args, lambda job, f, b: _two_hosts(args, bed, job, f, b)), title)
    print(table, flush=True)
    if args.md:
        Path(args.md).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
