"""DDP's bucket-sized allreduces through torch.distributed under torchrun, across two testbed hosts:
torch's gloo against "ddl" (which goes between hosts over its gloo transport), in wall time and in
CPU time. Needs root (the testbed); run from the repository root:

    .venv/bin/python bench/buckets_across_hosts.py --rate 1gbit [--sizes 1436200,2115712,8388608]

(``DDL_*`` variables set in the shell reach every rank, so ``DDL_WIRE_CHUNK_BYTES=1048576 ...``
times "ddl" with 1 MiB chunks.)

Why CPU: with one core per rank, every millisecond a collective spends on the CPU during backward
is a millisecond backward does not get. So beside each median wall time the table gives the CPU
the whole rank process spent per call (``cpu``: every thread, gloo's included) and the calling
thread's share (``caller``).

The peers, each on the same prebuilt tensor, called the way a DDP user calls them:
- ``gloo``: ``dist.all_reduce`` on a torch gloo group;
- ``ddl``: ``dist.all_reduce`` on a "ddl" group;
- ``p2p ring`` (2 ranks only): a 2-rank ring written directly on torch's gloo ``send``/``recv``
  (every receive posted first, chunks of ``--ring-chunk`` bytes): what any schedule built on
  gloo's point-to-point API can reach, which is the floor of ddl's gloo transport.

Each of ``--rounds`` rounds times every peer once per size, in turn (``--calls`` calls, after one
untimed call and a barrier); a call's time is the slowest rank's. ``bound`` is the least time the
allreduce needs on a host's link: across H hosts each host must send 2(H-1)/H x bytes, however
many ranks it has (ranks of a host can reduce among themselves first); ``of bound`` is bound /
median (``tbf``'s burst lets a share pass 100% by a point or two).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DDP_BUCKETS = "1436200,2115712,8388608"  # bench/train_scaling.py's CNN: DDP's two buckets, then 8 MiB


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--per-host", type=int, default=1, help="ranks per host (2 hosts)")
    p.add_argument("--sizes", default=DDP_BUCKETS, help="bytes per allreduce, a comma list")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--ring-chunk", type=int, default=1 << 20, help="bytes per chunk of the p2p ring")
    p.add_argument("--json", default="")
    p.add_argument("--lock", default="", help="hold an flock on this file while timing")
    p.add_argument("--port", type=int, default=29471)
    p.add_argument("--rank-body", action="store_true", help=argparse.SUPPRESS)  # what torchrun runs
    args = p.parse_args(argv)
    if args.rank_body:
        return _rank_body(args)
    return _drive(args)


def _drive(args) -> int:
    from ddl_triton.testbed import Testbed
    from ddl_triton.testbed.hosts import parse_rate
    sys.path.insert(0, str(ROOT / "bench"))
    from _host_jobs import ddl_options_from_shell, locked, torchrun_on_every_host

    env = {"GLOO_SOCKET_IFNAME": "eth0", "DDL_TUNING_FILE": "off", "OMP_NUM_THREADS": "1",
           "BUCKETS_LINK_BPS": str(parse_rate(args.rate)), **ddl_options_from_shell()}
    json_path = str(Path(args.json).resolve()) if args.json else ""
    flags = ["--rank-body", "--sizes", args.sizes, "--rounds", str(args.rounds), "--calls", str(args.calls),
             "--ring-chunk", str(args.ring_chunk), "--json", json_path]
    with locked(args.lock), Testbed(hosts=2, rate=args.rate) as bed:
        def start(host: str, torchrun: list[str], out) -> subprocess.Popen:
            return bed.popen(host, ["env", *(f"{k}={v}" for k, v in env.items()), *torchrun], cwd=str(ROOT),
                             stdout=out, stderr=subprocess.STDOUT)

        codes, outs = torchrun_on_every_host(start, ["h1", "h2"], args.per_host, args.port,
                                             [str(ROOT / "bench" / "buckets_across_hosts.py"), *flags], timeout=1800)
    print(f"# 2 hosts x {args.per_host}, links {args.rate}, torchrun: {shlex.join(sys.argv)}")
    print("\n".join(ln for ln in outs[0].splitlines() if not ln.startswith("[W")))
    for i, code in enumerate(codes):
        if code:
            print(f"# torchrun on h{i + 1}: exit {code}\n{outs[i][-4000:]}", file=sys.stderr)
    return max(codes)


def _ring(dist, group, tensor, peer: int, rank: int, chunk_elems: int):
    """A 2-rank ring allreduce (sum) in place on torch's gloo send/recv: for each chunk, send the
    peer's half, add the peer's copy of ours, send our sum back, take the peer's sum of its half."""
    import torch

    n = tensor.numel()
    spans = []
    for a in range(0, n, chunk_elems):
        b = min(n, a + chunk_elems)
        h = a + (b - a) // 2
        spans.append(((a, h), (h, b)) if rank == 0 else ((h, b), (a, h)))
    posted = []
    for c, (mine, theirs) in enumerate(spans):  # every receive first: gloo sends only once it is posted
        partial, summed = torch.empty(mine[1] - mine[0]), torch.empty(theirs[1] - theirs[0])
        posted.append((group.recv([partial], peer, 2 * c), partial, group.recv([summed], peer, 2 * c + 1), summed))
    sends = []
    for c, (mine, theirs) in enumerate(spans):
        sends.append(group.send([tensor[theirs[0]:theirs[1]].clone()], peer, 2 * c))
        got_partial, partial, got_summed, summed = posted[c]
        got_partial.wait()
        tensor[mine[0]:mine[1]].add_(partial)
        sends.append(group.send([tensor[mine[0]:mine[1]].clone()], peer, 2 * c + 1))
        got_summed.wait()
        tensor[theirs[0]:theirs[1]].copy_(summed)
    for s in sends:
        s.wait()


def _rank_body(args) -> int:
    import torch
    import torch.distributed as dist

    import ddl_triton.torch  # noqa: F401 - registers the "ddl" backend

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    if float(size) ** (args.calls + 1) > 2.0 ** 120:
        raise SystemExit(f"rank {rank}: --calls {args.calls} at {size} ranks: the checked sum of ones, "
                         f"{size}^{args.calls + 1}, would overflow float32; give fewer calls")
    ranks = list(range(size))
    control = dist.new_group(ranks, backend="gloo")
    peers = {"gloo": dist.new_group(ranks, backend="gloo"), "ddl": dist.new_group(ranks, backend="ddl")}
    calls = {name: (lambda t, g=g: dist.all_reduce(t, group=g)) for name, g in peers.items()}
    if size == 2:
        ring_group = dist.new_group(ranks, backend="gloo")
        chunk = max(2, args.ring_chunk // 4)
        calls["p2p ring"] = lambda t: _ring(dist, ring_group, t, 1 - rank, rank, chunk)
    sizes = [int(s) for s in args.sizes.split(",")]
    samples: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
    for _ in range(args.rounds):
        for nbytes in sizes:
            for name, call in calls.items():
                tensor = torch.ones(nbytes // 4)
                call(tensor)
                dist.barrier(group=control)
                t0, cpu0, caller0 = time.perf_counter(), time.process_time(), time.thread_time()
                for _ in range(args.calls):
                    call(tensor)
                own = torch.tensor([time.perf_counter() - t0, time.process_time() - cpu0, time.thread_time() - caller0])
                dist.all_reduce(own, op=dist.ReduceOp.MAX, group=control)
                samples.setdefault((nbytes, name), []).append(tuple((own / args.calls).tolist()))
                if not bool((tensor == float(size) ** (args.calls + 1)).all()):  # ones, summed once per call
                    raise SystemExit(f"rank {rank}: {name}'s allreduce of {nbytes} B gave a wrong sum")
    if rank == 0:
        _report(samples, sizes, list(calls), size, 2, int(os.environ.get("BUCKETS_LINK_BPS", "0")), args.json)
    dist.destroy_process_group()
    return 0


def _report(samples, sizes, names, size: int, hosts: int, link_bps: int, json_path: str) -> None:
    rows = []
    print(f"{'bytes':>10} {'peer':>9} {'median':>9} {'of bound':>9} {'cpu':>8} {'caller':>8}  vs gloo")
    for nbytes in sizes:
        gloo_wall = statistics.median(s[0] for s in samples[(nbytes, "gloo")])
        bound = 2 * (hosts - 1) / hosts * nbytes * 8 / link_bps if link_bps else None
        for name in names:
            got = samples[(nbytes, name)]
            wall, cpu, caller = (statistics.median(s[i] for s in got) for i in range(3))
            share = bound / wall if bound else None
            rows.append({"bytes": nbytes, "peer": name, "ms": wall * 1e3, "of_bound": share, "cpu_ms": cpu * 1e3,
                         "caller_cpu_ms": caller * 1e3, "vs_gloo": wall / gloo_wall, "rounds": [s[0] for s in got]})
            print(f"{nbytes:>10} {name:>9} {wall * 1e3:7.2f}ms {share * 100 if share else float('nan'):8.1f}% "
                  f"{cpu * 1e3:6.2f}ms {caller * 1e3:6.2f}ms  {wall / gloo_wall:5.3f}x", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps({"ranks": size, "hosts": hosts, "link_bps": link_bps, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
