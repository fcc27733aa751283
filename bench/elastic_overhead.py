"""No cost when nothing fails: the training step with elastic on, against the same job without it.

Run (from the repository root)::

    python bench/elastic_overhead.py --ranks 2 --rounds 5                 # one host, env:// processes
    python bench/elastic_overhead.py --hosts 2 --rounds 5                 # 2 testbed hosts x 1 rank (root)

The job is examples/elastic_train.py's: the digits CNN of examples/train_cnn.py (``build_model``,
``load_data``), DDP on the "ddl" backend, SGD (lr 0.05, momentum 0.9), global batch 120 split over
the ranks (``batch_rows``). Two variants of it, each a fresh job of ``--ranks`` processes:

    elastic  ``elastic.init_process_group("ddl")``, ``TorchState``, ``@elastic.run``, ``state.commit()``
             after every step (a copy of model + optimizer, then rank 0's joiner check broadcast)
    plain    ``dist.init_process_group("ddl")`` (env://) and the same loop, no state, no commit

Each round runs both, in alternating order (ABBA), so a drift of the machine's load hits both
alike. Per job: ``--warmup`` steps, then ``--steps`` timed steps; a step's time is rank 0's wall
time from one step's start to the next (forward, backward with DDP's allreduce, ``opt.step`` and,
elastic, the commit). The elastic job also times its commits, and after its steps ``--steps``
calls of ``state.save()`` alone (the copy without the broadcast). Reported: per variant the median
over rounds of each job's median step, their ratio, the commit, and the load average (uptime)
before each round. Both variants must end with the same parameters' hash (the same steps, the
same sums), else the run fails (exit 1): elastic must change nothing in the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_JOB_LIMIT_S = 300.0   # one job (imports, data, steps) never runs longer than this


# -- the job (one rank) --------------------------------------------------------------------------
def _worker(args) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(ROOT / "examples"))
    from elastic_train import batch_rows, params_hash
    from train_cnn import build_model, load_data

    import ddl_triton.torch  # noqa: F401 - registers the backend "ddl"
    from ddl_triton.torch import elastic

    torch.set_num_threads(1)
    if args.worker == "elastic":
        elastic.init_process_group("ddl")
    else:
        dist.init_process_group("ddl")
    x_train, y_train, _, _ = load_data()
    net = build_model(seed=0)
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    total = args.warmup + args.steps
    starts: list[float] = []
    commits: list[float] = []

    def step(i: int, rank: int, size: int) -> None:
        per = 120 // size
        rows = batch_rows(i, len(y_train), 120)[rank * per: (rank + 1) * per]
        loss = F.cross_entropy(model(x_train[rows]), y_train[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()

    saves: list[float] = []
    if args.worker == "elastic":
        state = elastic.TorchState(model, opt, step=0)

        @elastic.run
        def train(state):
            while state.step < total:
                starts.append(time.perf_counter())
                step(state.step, elastic.rank(), elastic.size())
                state.step += 1
                t = time.perf_counter()
                state.commit()
                commits.append(time.perf_counter() - t)
            starts.append(time.perf_counter())
            for _ in range(args.steps):  # the copy alone, without the joiner check
                t = time.perf_counter()
                state.save()
                saves.append(time.perf_counter() - t)

        train(state)
        rank, changes = elastic.rank(), len(elastic.recoveries())
    else:
        rank, size = dist.get_rank(), dist.get_world_size()
        for i in range(total):
            starts.append(time.perf_counter())
            step(i, rank, size)
        starts.append(time.perf_counter())
        changes = 0
    steps = [b - a for a, b in zip(starts[args.warmup:], starts[args.warmup + 1:])]
    digest = params_hash(net)
    if rank == 0:
        out = {"variant": args.worker, "step_s": statistics.median(steps), "hash": digest, "changes": changes,
               "commit_s": statistics.median(commits[args.warmup:]) if commits else None,
               "save_s": statistics.median(saves) if saves else None}
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()
    return 0


# -- the driver ----------------------------------------------------------------------------------
def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(variant: str, args, bed, scratch: Path, n: int) -> dict:
    """One job of ``variant``: its processes started (locally, or one per testbed host), waited for
    (bounded), rank 0's result read back."""
    out = scratch / f"{variant}-{n}.json"
    hosts = [f"h{i + 1}" for i in range(args.hosts)] if bed is not None else []
    size = args.hosts if bed is not None else args.ranks
    addr, port = ("h1", 29500 + n % 200) if bed is not None else ("127.0.0.1", _free_port())
    procs, logs = [], []
    for rank in range(size):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR=addr, MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", DDL_TUNING_FILE="off", PYTHONFAULTHANDLER="1", DDL_TIMEOUT=str(args.timeout), PYTHONUNBUFFERED="1")
        if bed is not None:
            env["GLOO_SOCKET_IFNAME"] = "eth0"
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--out", str(out)]
        log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would stall a rank
        logs.append(log)
        if bed is not None:
            procs.append(bed.popen(hosts[rank], argv, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT))
        else:
            procs.append(subprocess.Popen(argv, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL))
    deadline = time.monotonic() + _JOB_LIMIT_S
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    codes = [p.returncode for p in procs]
    text = ""
    for rank, log in enumerate(logs):
        log.seek(0)
        text += f"--- rank {rank}: exit {codes[rank]}\n{log.read()[-4000:]}"
        log.close()
    if not out.exists():
        raise RuntimeError(f"{variant} job {n}: exit codes {codes}, no result\n{text}")
    got = json.loads(out.read_text())
    got["codes"] = codes
    if any(codes):  # the steps were timed, but a job that did nothing wrong must exit 0: shown, and fails the run
        print(f"{variant} job {n}: exit codes {codes} after its result was written\n{text}", file=sys.stderr)
    return got


def _drive(args) -> int:
    scratch = ROOT / "build" / "elastic-bench"
    scratch.mkdir(parents=True, exist_ok=True)
    os.chmod(scratch, 0o700)
    scratch = Path(tempfile.mkdtemp(prefix="overhead-", dir=scratch))  # every host sees it (shared file system)
    bed = None
    if args.hosts:
        from ddl_triton.testbed import Testbed
        bed = Testbed(hosts=args.hosts, rate=args.rate).up()
    where = (f"{args.hosts} testbed hosts x 1 rank, {args.rate}" if bed is not None else
             f"one host, {args.ranks} ranks (env://)")
    results: dict[str, list[dict]] = {"elastic": [], "plain": []}
    try:
        print(f"# elastic on vs off: {where}, {args.steps} timed steps after {args.warmup}, {args.rounds} rounds "
              f"(ABBA), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
        print("| round | load before | plain step ms | elastic step ms | elastic/plain | elastic step less commit ms | commit ms | save ms |")
        print("|---|---|---|---|---|---|---|---|")
        for n in range(args.rounds):
            load = _load()
            order = ("elastic", "plain") if n % 2 == 0 else ("plain", "elastic")
            got = {v: _job(v, args, bed, scratch, 2 * n + i) for i, v in enumerate(order)}
            for v in order:
                results[v].append(got[v])
            e, p = got["elastic"], got["plain"]
            print(f"| {n} | {load} | {p['step_s'] * 1e3:.2f} | {e['step_s'] * 1e3:.2f} | "
                  f"{e['step_s'] / p['step_s']:.3f} | {(e['step_s'] - e['commit_s']) * 1e3:.2f} | {e['commit_s'] * 1e3:.3f} | {e['save_s'] * 1e3:.3f} |", flush=True)
    finally:
        if bed is not None:
            bed.down()
    med = {v: statistics.median(r["step_s"] for r in rs) for v, rs in results.items()}
    commit = statistics.median(r["commit_s"] for r in results["elastic"])
    save = statistics.median(r["save_s"] for r in results["elastic"])
    low = {v: min(r["step_s"] for r in rs) for v, rs in results.items()}  # the least disturbed job
    print(f"\nfastest job's step: plain {low['plain'] * 1e3:.2f} ms, elastic {low['elastic'] * 1e3:.2f} ms "
          f"(x{low['elastic'] / low['plain']:.3f}); median over rounds of each round's ratio: "
          f"{statistics.median(e['step_s'] / p['step_s'] for e, p in zip(results['elastic'], results['plain'])):.3f}")
    print(f"median step: plain {med['plain'] * 1e3:.2f} ms, elastic {med['elastic'] * 1e3:.2f} ms "
          f"(x{med['elastic'] / med['plain']:.3f}); commit {commit * 1e3:.3f} ms (save {save * 1e3:.3f} ms + "
          f"joiner check {max(commit - save, 0) * 1e3:.3f} ms); load after: {_load()}")
    hashes = {r["hash"] for rs in results.values() for r in rs}
    changes = sum(r["changes"] for r in results["elastic"])
    print(f"parameters' hash of every job: {sorted(hashes)}; world changes: {changes}")
    crashed = [f"{v} {r['codes']}" for v, rs in results.items() for r in rs if any(r["codes"])]
    print(f"jobs that exited non-zero after their result: {len(crashed)} of {2 * args.rounds} {crashed}")
    if len(hashes) != 1 or changes or crashed:
        print("FAILED: the jobs did not end with identical parameters, a world changed, or a job exited non-zero",
              file=sys.stderr)
        return 1
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=("elastic", "plain"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=2, help="ranks on this host (without --hosts)")
    p.add_argument("--hosts", type=int, default=0, help="testbed hosts, one rank each (needs root); 0: this host")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--timeout", type=float, default=30.0, help="DDL_TIMEOUT of the jobs")
    args = p.parse_args()
    if args.worker:
        return _worker(args)
    if args.rounds < 1 or args.steps < 1 or args.ranks < 1 or args.hosts < 0:
        p.error("--rounds, --steps and --ranks must be >= 1, --hosts >= 0")
    return _drive(args)


if __name__ == "__main__":
    sys.exit(main())
