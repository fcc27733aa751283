"""Communication hidden behind backward across hosts: does DDP's first bucket, issued mid-backward,
move on the link while backward still computes?

Run (root: a testbed, docs/testbed.md), from the repository root:

    .venv/bin/python bench/overlap_across_hosts.py [--rate 1gbit] [--steps 5] [--launchers ddlrun,torchrun]
        [--figure bench/figures/overlap_across_hosts.png] [--lock /tmp/ddl_bench.lock]

On a ``Testbed(hosts=2, rate=RATE)``, 2 hosts x 1 rank train bench/train_scaling.py's CNN under DDP on
"ddl" (default buckets, one torch thread per rank, batch 32), once under ddlrun (ddl between the
hosts over MPI) and once under torchrun (over ddl's gloo transport), with the timeline on
(``DDL_TRACE``). After a few warm-up steps (DDP rebuilds its buckets after the first), ``--steps``
steps are measured. For each, three independent records on one clock:

- the training script's marks: backward start (``loss.backward()`` called) and backward's end (the
  last gradient accumulated: a post-accumulate-grad hook on every parameter; DDP issues its last
  bucket right there);
- the timeline: when the first bucket was issued (its async span's start on the training thread),
  where it ran, and when its bytes were on the wire as the executor saw them: from its first send
  posted (the first step's ``send`` phase ends with the Isend / gloo send) to its last receive done
  (the last ``wait`` phase's end);
- the link: h1's eth0 byte counters (``/proc/self/net/dev`` inside h1, headers included, as the
  shaper lets them through), sampled every ``--sample-us`` by a separate process in h1, so that
  sampling takes no GIL from the ranks. h1's sent bytes are rank 0's sends, its received bytes
  rank 1's. Between the first bucket's issue and its end the link carries that bucket alone
  (collectives run one at a time, in issue order, and the last bucket is issued only at
  backward's end), so the bytes counted there are the bucket's.

Per step and rank: the share of the first bucket's wire time (timeline) that falls inside the
rank's backward, and, from the counters, the share of the bucket's bytes each direction carried
before its sender's backward ended. Times are milliseconds from rank 0's backward start. The
compact table comes last; ``--figure`` draws one step of each launcher (the training threads'
backward, the buckets' spans and wire time, the link's rate in each direction). The raw files
(traces, marks, link samples, a JSON summary) stay in ``--out``.

Inside a job this script is also the rank (``--worker``) and the link sampler (``--sample-link``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _host_jobs import locked as _locked, wait_for_every_host  # bench/ is on the path when run as a script

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WARMUP_STEPS = 3  # DDP rebuilds its buckets after the first step; the next two settle caches and pools


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="1gbit", help="the rate the testbed shapes each host's link to")
    p.add_argument("--steps", type=int, default=5, help="measured steps per launcher")
    p.add_argument("--launchers", default="ddlrun,torchrun")
    p.add_argument("--sample-us", type=float, default=500, help="the link counters' sampling period")
    p.add_argument("--out", default="build/overlap-across-hosts", help="traces, marks and samples, per launcher")
    p.add_argument("--figure", default="", help="a PNG of one measured step per launcher")
    p.add_argument("--label", default="", help="what this run is, in the table's and the figure's titles")
    p.add_argument("--lock", default="", help="hold an exclusive flock on this file during each job "
                   "(/tmp/ddl_bench.lock for timed runs on a shared machine)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per job")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="more environment for every rank (repeatable): e.g. PYTHONPATH=<a patched tree> to measure "
                   "a change beside the installed code, or UCX_* settings")
    p.add_argument("--analyse-only", action="store_true", help="no testbed: analyse the files an earlier run "
                   "left in --out")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sample-link", default="", help=argparse.SUPPRESS)
    p.add_argument("--iface", default="eth0", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sample_link:
        return _sample_link(args.sample_link, args.iface, args.sample_us)
    if args.worker:
        return _worker(args)
    launchers = args.launchers.split(",")
    if set(launchers) - {"ddlrun", "torchrun"} or not launchers:
        p.error(f"--launchers: ddlrun and/or torchrun, not {args.launchers!r}")
    bad = [e for e in args.env if "=" not in e or not e.partition("=")[0]]
    if bad:
        p.error(f"--env: NAME=VALUE, not {bad[0]!r}")
    return _drive(args, launchers)


# -- the driver: a testbed, one job per launcher, the analysis ------------------------------------

def _drive(args, launchers: list[str]) -> int:
    out = (ROOT / args.out).resolve()
    results, worst = {}, 0
    if args.analyse_only:
        results = {name: analyse(out / name) for name in launchers}
    else:
        worst = _run_jobs(args, launchers, out, results)
    for launcher, result in results.items():
        _print_steps(launcher, result)
        (out / launcher / "overlap.json").write_text(json.dumps(result, indent=1))
    _print_table(results, args.rate, args.label)
    if args.figure and results:
        draw(results, {name: out / name for name in results}, args.figure, args.label)
        print(f"# figure: {args.figure}")
    return worst


def _run_jobs(args, launchers: list[str], out: Path, results: dict) -> int:
    """One job per launcher on a fresh testbed; each job's analysis into ``results``; the worst exit."""
    from ddl_triton.testbed import Testbed

    worst = 0
    with Testbed(hosts=2, rate=args.rate) as bed:
        for i, launcher in enumerate(launchers):
            folder = out / launcher
            shutil.rmtree(folder, ignore_errors=True)  # an older run's files must not pass for this one's
            folder.mkdir(parents=True)
            flags = ["--worker", "--out", str(folder), "--steps", str(args.steps), "--sample-us", str(args.sample_us)]
            env = {"UCX_NET_DEVICES": "eth0", "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1",
                   "PYTHONUNBUFFERED": "1", "DDL_TUNING_FILE": os.environ.get("DDL_TUNING_FILE", "off"),
                   "DDL_TRACE": str(folder), **dict(e.split("=", 1) for e in args.env)}
            print(f"# {launcher}: 2 hosts x 1 rank, links {args.rate}", flush=True)
            with _locked(args.lock):
                code = (_ddlrun if launcher == "ddlrun" else _torchrun)(bed, env, flags, args.timeout, 29400 + i)
            worst = max(worst, code)
            if code == 0:
                results[launcher] = analyse(folder)
    return worst


def _ddlrun(bed, env: dict, flags: list[str], timeout: float, port: int) -> int:
    """``ddlrun -n 2 -H h1:1,h2:1`` inside h1; hydra reaches h2 through ddl-testbed-ssh."""
    env = dict(env, HYDRA_LAUNCHER_EXEC=str(BIN / "ddl-testbed-ssh"))
    command = ["env", *(f"{k}={v}" for k, v in env.items()), str(BIN / "ddlrun"), "-n", "2", "-H", "h1:1,h2:1",
               "--", sys.executable, str(Path(__file__).resolve()), *flags]
    try:
        done = bed.run("h1", command, cwd=str(ROOT), timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"# ddlrun: past {timeout:g} s, stopped", flush=True)
        return 124
    if done.returncode:
        print(f"# ddlrun: exit {done.returncode}\n{(done.stdout + done.stderr)[-4000:]}", flush=True)
    return done.returncode


def _torchrun(bed, env: dict, flags: list[str], timeout: float, port: int) -> int:
    """One torchrun per host at once, a c10d rendezvous at h1. Bounded: past ``timeout``, or 10 s
    after one host's torchrun failed, the others are stopped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "MPI", "HYDRA", "OMPI"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")} | env
    command = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"h1:{port}", "--rdzv-id", f"overlap{port}", str(Path(__file__).resolve()), *flags]
    outs = [tempfile.TemporaryFile("w+") for _ in bed.hosts]  # files, not pipes: a full pipe stalls a host
    procs = [bed.popen(h, command, cwd=str(ROOT), env=env, stdout=o, stderr=subprocess.STDOUT)
             for h, o in zip(bed.hosts, outs)]
    codes = wait_for_every_host(procs, timeout)
    for host, o, code in zip(bed.hosts, outs, codes):
        o.seek(0)
        text = o.read()
        o.close()
        if any(codes):
            print(f"# torchrun on {host}: exit {code}\n{text[-4000:]}", flush=True)
    return max(abs(c) for c in codes)


# -- inside the job: the rank and the link sampler --------------------------------------------------

def _worker(args) -> int:
    """One rank: DDP on "ddl" with train_scaling.py's CNN; marks per step on the tracer's clock."""
    import socket

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(ROOT / "bench"))
    from train_scaling import BATCH, build_cnn

    torch.set_num_threads(1)
    import ddl_triton.torch  # noqa: F401 - registers "ddl"
    from ddl_triton.observability.tracer import TRACERS

    dist.init_process_group("ddl")
    rank, size = dist.get_rank(), dist.get_world_size()
    if size != 2:
        raise SystemExit(f"overlap_across_hosts.py: rank {rank}: 2 ranks (one per host), not {size}")
    if not TRACERS:
        raise SystemExit(f"overlap_across_hosts.py: rank {rank}: no timeline (DDL_TRACE must name a folder)")
    tracer = next(iter(TRACERS.values()))
    torch.manual_seed(0)
    model = DDP(build_cnn())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    data = [(torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(4)]
    grads: list[float] = []  # the trace clock each gradient of this backward was accumulated at
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda _: grads.append(tracer.now()))

    def step(i: int) -> dict:
        x, y = data[i % len(data)]
        marks = {"step_start": tracer.now()}
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=False)
        grads.clear()
        marks["backward_start"] = tracer.now()
        loss.backward()
        marks["backward_return"] = tracer.now()
        marks["first_grad"], marks["last_grad"] = min(grads), max(grads)
        opt.step()
        marks["step_end"] = tracer.now()
        return marks

    for i in range(WARMUP_STEPS):
        step(i)
    sampler = None
    if rank == 0:  # h1's link: rank 0's sends out, rank 1's in
        sampler = subprocess.Popen([sys.executable, __file__, "--sample-link", os.path.join(args.out, "link-h1.json"),
                                    "--iface", args.iface, "--sample-us", str(args.sample_us)],
                                   stdout=subprocess.PIPE, text=True)
        sampler.stdout.readline()  # "sampling": it has its first sample
    # The sampler stamps wall time; the marks are on the trace clock: their difference, to convert.
    wall_minus_trace = statistics.median(time.time() * 1e6 - tracer.now() for _ in range(9))
    import ddl_triton as ddl
    comm = ddl.init()  # the world communicator the "ddl" group runs on (idempotent)
    moved0 = _payload(comm)
    dist.barrier()
    steps = [step(WARMUP_STEPS + i) for i in range(args.steps)]
    dist.barrier()
    moved = {k: (v - moved0.get(k, 0)) / args.steps for k, v in _payload(comm).items()}
    if sampler is not None:
        sampler.send_signal(signal.SIGTERM)
        sampler.wait(30)
    logged = model._get_ddp_logging_data()
    buckets = [int(b) for b in str(logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes", "")).split(",")
               if b.strip()]
    marks = {"rank": rank, "host": socket.gethostname(), "wall_minus_trace_us": wall_minus_trace,
             "bucket_bytes": buckets, "payload_bytes_per_step": moved, "steps": steps,
             "launcher": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "ddlrun"}
    with open(os.path.join(args.out, f"marks-rank{rank}.json"), "w") as f:
        json.dump(marks, f)
    dist.destroy_process_group()  # closes the communicator: the tracer writes its file
    tracer.flush()
    return 0


def _payload(comm) -> dict[str, int]:
    """Payload bytes this rank's transports sent and received so far, per transport ("mpi sent": n)."""
    return {f"{name} {what}": n for name, moved in comm.transport_bytes.items() for what, n in moved.items()}


def _sample_link(path: str, iface: str, period_us: float) -> int:
    """Until SIGTERM: (wall time in us, bytes sent, bytes received) of ``iface`` every ``period_us``,
    from this network namespace's /proc/self/net/dev; then write them to ``path`` as JSON."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    fd = os.open("/proc/self/net/dev", os.O_RDONLY)
    key = f"{iface}:".encode()
    samples = []

    def sample() -> None:
        text = os.pread(fd, 16384, 0)  # a /proc file: each read from offset 0 is a fresh snapshot
        fields = text[text.index(key) + len(key):].split(maxsplit=9)
        samples.append((time.time() * 1e6, int(fields[8]), int(fields[0])))

    sample()
    print("sampling", flush=True)
    period = period_us * 1e-6
    while not stop:
        time.sleep(period)
        sample()
    with open(path, "w") as f:
        json.dump({"iface": iface, "period_us": period_us, "samples": samples}, f)
    return 0


# -- the analysis -----------------------------------------------------------------------------------

def analyse(folder: Path) -> dict:
    """Per measured step and rank: backward, the first bucket's issue, run and wire time (timeline),
    its sends' bytes on the link (counters), and the shares that overlapped backward. Everything is
    put on rank 0's trace clock first; each rank's times are then quoted from its own backward start."""
    traces, marks = {}, {}
    for r in (0, 1):
        traces[r] = json.loads((folder / f"trace-rank{r}.json").read_text())
        marks[r] = json.loads((folder / f"marks-rank{r}.json").read_text())
    offset = {r: traces[r]["metadata"].get("clock_offset_us", 0.0) for r in traces}
    link = json.loads((folder / "link-h1.json").read_text())
    # h1's counters (wall time, taken on rank 0's host) onto rank 0's trace clock.
    samples = [(t - marks[0]["wall_minus_trace_us"], tx, rx) for t, tx, rx in link["samples"]]
    columns = {0: 1, 1: 2}  # rank 0's sends leave h1 (sent bytes); rank 1's arrive there (received bytes)
    per_rank = {r: _rank_view(traces[r], offset[r]) for r in traces}
    steps = []
    for i in range(len(marks[0]["steps"])):
        m = {r: {k: v + offset[r] for k, v in marks[r]["steps"][i].items()} for r in marks}
        last_end = max(m[r]["last_grad"] for r in m)  # backward computes somewhere until here
        found = {}
        for r in m:
            b0 = m[r]["backward_start"]
            view = per_rank[r]
            # Every bucket of this backward: the last is issued right after b1, always before backward returns.
            issued = [e for e in view["issues"] if b0 <= e["ts"] <= m[r]["backward_return"]]
            if not issued:
                raise SystemExit(f"{folder}: rank {r}, step {i}: no bucket issued during backward")
            span = view["spans"][issued[0]["key"]]
            found[r] = (issued, span)
        # Between the first bucket's earliest issue and its latest end the link carries that bucket alone.
        w0 = min(found[r][0][0]["ts"] for r in m)
        w1 = max(found[r][1]["ts"] + found[r][1]["dur"] for r in m)
        ranks = {}
        for r in m:
            issued, span = found[r]
            b0, b1 = m[r]["backward_start"], m[r]["last_grad"]
            start, end = span["ts"], span["ts"] + span["dur"]
            within = [e for e in per_rank[r]["phases"] if e["tid"] == span["tid"] and start <= e["ts"] < end]
            sends = [e["ts"] + e["dur"] for e in within if e["name"] == "send"]
            waits = [e["ts"] + e["dur"] for e in within if e["name"] == "wait"]
            wire0, wire1 = (min(sends) if sends else start), (max(waits) if waits else end)
            total = _bytes_between(samples, columns[r], w0, w1)
            on = _active(samples, columns[r], w0, w1)
            # The last bucket, issued when backward ends, for comparison: the link's rate with nothing computing.
            last = per_rank[r]["spans"][issued[-1]["key"]] if len(issued) > 1 else None
            last_rate = None
            if last is not None:
                l0 = max(found[q][0][-1]["ts"] for q in m)
                l1 = max(per_rank[q]["spans"][found[q][0][-1]["key"]]["ts"] + per_rank[q]["spans"][found[q][0][-1]["key"]]["dur"]
                         for q in m)
                last_rate = _rate(samples, columns[r], l0, l1)
            rel = lambda t, b0=b0: (t - b0) / 1e3  # noqa: E731 - ms from this rank's backward start
            ranks[r] = {
                "t0_us": b0, "backward_ms": rel(b1), "backward_return": rel(m[r]["backward_return"]),
                "last_backward_end": rel(last_end), "buckets": len(issued),
                "first_issued": rel(issued[0]["ts"]), "last_issued": rel(issued[-1]["ts"]),
                "first_bytes": span["args"]["bytes"], "first_schedule": span["args"].get("schedule"),
                "ran_on": per_rank[r]["threads"].get(span["tid"], str(span["tid"])),
                "run": [rel(start), rel(end)], "wire": [rel(wire0), rel(wire1)],
                "wire_in_backward": _share_inside((wire0, wire1), (b0, b1)),
                "wire_hidden": _share_inside((wire0, wire1), (w0, last_end)),
                "link_bytes": total, "link_on": [rel(x) for x in on] if on else None,
                "link_gbps": _rate(samples, columns[r], w0, w1), "last_link_gbps": last_rate,
                "link_in_backward": _bytes_between(samples, columns[r], w0, min(w1, b1)) / total if total else None,
                "link_hidden": _bytes_between(samples, columns[r], w0, min(w1, last_end)) / total if total else None,
            }
        for r in ranks:  # the peer's bytes had crossed the link this long before this rank's last receive was done
            peer = ranks[1 - r]
            arrived = peer["link_on"][1] + (peer["t0_us"] - ranks[r]["t0_us"]) / 1e3 if peer["link_on"] else None
            ranks[r]["receive_lag"] = ranks[r]["wire"][1] - arrived if arrived is not None else None
        steps.append({"step": i, "t0_us": m[0]["backward_start"], "ranks": ranks})
    return {"folder": str(folder), "launcher": marks[0]["launcher"], "hosts": [marks[r]["host"] for r in (0, 1)],
            "bucket_bytes": marks[0]["bucket_bytes"], "payload_bytes_per_step": marks[0]["payload_bytes_per_step"],
            "sample_us": link["period_us"], "clock_bound_us": traces[1]["metadata"].get("offset_bound_us", 0.0),
            "steps": steps}


def _rank_view(trace: dict, offset: float) -> dict:
    """One rank's timeline on rank 0's clock: async issues on the training thread (in order), the
    collectives' spans by (communicator, name), the step phases, thread names."""
    events = trace["traceEvents"]
    shift = lambda e: dict(e, ts=e["ts"] + offset)  # noqa: E731
    issues = sorted((shift(e) for e in events if e.get("ph") == "b"), key=lambda e: e["ts"])
    for e in issues:
        e["key"] = (e.get("args", {}).get("comm", 0), e["name"])
    spans = {(e["args"].get("comm", 0), e["name"]): shift(e) for e in events if e.get("cat") == "ddl.collective"}
    phases = [shift(e) for e in events if e.get("cat") == "ddl.phase"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return {"issues": issues, "spans": spans, "phases": phases, "threads": threads}


def _share_inside(interval: tuple[float, float], window: tuple[float, float]) -> float | None:
    """The share of ``interval`` that falls inside ``window`` (None for an empty interval)."""
    a, b = interval
    if b <= a:
        return None
    return max(0.0, min(b, window[1]) - max(a, window[0])) / (b - a)


def _counter_at(samples: list, column: int, t: float) -> float:
    """A counter at time ``t``, linear between the samples around it."""
    lo, hi = 0, len(samples) - 1
    if t <= samples[0][0]:
        return samples[0][column]
    if t >= samples[hi][0]:
        return samples[hi][column]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if samples[mid][0] <= t:
            lo = mid
        else:
            hi = mid
    (ta, *a), (tb, *b) = samples[lo], samples[hi]
    return a[column - 1] + (b[column - 1] - a[column - 1]) * (t - ta) / (tb - ta)


def _bytes_between(samples: list, column: int, t0: float, t1: float) -> float:
    return max(0.0, _counter_at(samples, column, t1) - _counter_at(samples, column, t0)) if t1 > t0 else 0.0


def _active(samples: list, column: int, t0: float, t1: float) -> tuple[float, float] | None:
    """When the window's bytes were on the link: the times its 2% and 98% had passed (linear
    between samples; a counter's own resolution is one sampling period)."""
    total = _bytes_between(samples, column, t0, t1)
    if total <= 0:
        return None
    base = _counter_at(samples, column, t0)

    def when(share: float) -> float:
        target = base + share * total
        lo, hi = t0, t1
        for _ in range(40):
            mid = (lo + hi) / 2
            if _counter_at(samples, column, mid) < target:
                lo = mid
            else:
                hi = mid
        return hi
    return when(0.02), when(0.98)


def _rate(samples: list, column: int, t0: float, t1: float) -> float | None:
    """Gbit/s while the window's bytes were on the link (between its 2% and 98%, see _active)."""
    on = _active(samples, column, t0, t1)
    if not on or on[1] <= on[0]:
        return None
    return 0.96 * _bytes_between(samples, column, t0, t1) * 8 / (on[1] - on[0]) / 1e3


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _print_steps(launcher: str, result: dict) -> None:
    sizes = ", ".join(f"{b / 1e6:.2f}" for b in result["bucket_bytes"])
    print(f"\n# {launcher}: DDP buckets (MB, in reduction order) {sizes}; per step and rank, ms from that rank's "
          f"backward start; link: that rank's sends through h1's eth0")
    print(f"{'step':>4} {'rank':>4} {'bwd end':>7} {'last bwd end':>12} {'1st issued':>10} {'ran on':>17} "
          f"{'run':>13} {'wire (trace)':>13} {'on link':>13} {'Gbit/s':>6} {'last':>5} {'lag':>5} {'wire in bwd':>11} {'bytes in bwd':>12} "
          f"{'bytes hidden':>12}")
    for row in result["steps"]:
        for r, v in row["ranks"].items():
            print(f"{row['step']:>4} {r:>4} {v['backward_ms']:>7.1f} {v['last_backward_end']:>12.1f} "
                  f"{v['first_issued']:>10.1f} {v['ran_on']:>17} {_span(v['run']):>13} {_span(v['wire']):>13} "
                  f"{_span(v['link_on']):>13} {_num(v['link_gbps']):>6} {_num(v['last_link_gbps']):>5} "
                  f"{_num(v['receive_lag'], 1):>5} "
                  f"{_pct(v['wire_in_backward']):>11} {_pct(v['link_in_backward']):>12} "
                  f"{_pct(v['link_hidden']):>12}")


def _span(interval) -> str:
    return f"{interval[0]:.1f}-{interval[1]:.1f}" if interval else "-"


def summarise(result: dict) -> dict:
    """Medians over the measured steps and both ranks."""
    views = [v for row in result["steps"] for v in row["ranks"].values()]
    out = {k: _median(v[k] for v in views) for k in ("backward_ms", "first_issued", "wire_in_backward",
                                                      "wire_hidden", "link_in_backward", "link_hidden",
                                                      "link_gbps", "last_link_gbps", "receive_lag")}
    for k in ("wire", "link_on"):
        out[k] = [_median(v[k][j] for v in views if v[k]) for j in (0, 1)]
    out["first_mb"] = _median(v["first_bytes"] for v in views) / 1e6
    out["ran_on"] = sorted({v["ran_on"].split("-rank")[0] for v in views})
    return out


def _print_table(results: dict, rate: str, label: str = "") -> None:
    print(f"\n# {label + ': ' if label else ''}the first DDP bucket against backward, 2 hosts x 1 rank, links {rate}: "
          f"medians over steps and "
          f"ranks, ms from the rank's backward start; in bwd: inside the rank's own backward; hidden: before the "
          f"later rank's backward ended")
    print(f"{'launcher':>9} {'bwd ms':>7} {'1st MB':>6} {'issued':>7} {'wire (trace)':>13} {'on link':>13} "
          f"{'Gbit/s':>6} {'last':>5} {'lag':>5} {'wire in bwd':>11} {'bytes in bwd':>12} {'wire hidden':>11} {'bytes hidden':>12}")
    for launcher, result in results.items():
        s = summarise(result)
        print(f"{launcher:>9} {s['backward_ms']:>7.1f} {s['first_mb']:>6.2f} {s['first_issued']:>7.1f} "
              f"{_span(s['wire']):>13} {_span(s['link_on'] if s['link_on'][0] is not None else None):>13} "
              f"{_num(s['link_gbps']):>6} {_num(s['last_link_gbps']):>5} {_num(s['receive_lag'], 1):>5} "
              f"{_pct(s['wire_in_backward']):>11} {_pct(s['link_in_backward']):>12} {_pct(s['wire_hidden']):>11} "
              f"{_pct(s['link_hidden']):>12}")


def _num(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def draw(results: dict, folders: dict, path: str, label: str = "") -> None:
    """One measured step per launcher (the median step by the share of bytes hidden): per rank,
    backward and the buckets' issue ticks on the training thread, the collectives' spans and the
    first bucket's wire time on the thread that ran them; below, h1's link rate each way."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2 * len(results), 1, figsize=(13, 3.6 * len(results)),
                             gridspec_kw={"height_ratios": [3, 1.4] * len(results)})
    for k, (launcher, result) in enumerate(results.items()):
        ordered = sorted(result["steps"], key=lambda row: _median(v["link_hidden"] for v in row["ranks"].values()) or 0)
        row = ordered[len(ordered) // 2]
        t0 = row["t0_us"]
        folder = folders[launcher]
        views = {int(r): v for r, v in row["ranks"].items()}
        shift = {r: (v["t0_us"] - t0) / 1e3 for r, v in views.items()}  # a rank's own times onto the axis
        end = max(v["run"][1] + shift[r] for r, v in views.items()) + 5
        begin = min(shift.values()) - 5
        ax, lx = axes[2 * k], axes[2 * k + 1]
        for r, v in views.items():
            trace = json.loads((folder / f"trace-rank{r}.json").read_text())
            view = _rank_view(trace, trace["metadata"].get("clock_offset_us", 0.0))
            y = 2 * (1 - r) + 1
            ax.broken_barh([(shift[r], v["backward_ms"])], (y - 0.3, 0.6), facecolors="#cccccc",
                           label="backward computing" if r == 0 else None)
            ticks = [(e["ts"] - t0) / 1e3 for e in view["issues"] if begin <= (e["ts"] - t0) / 1e3 <= end]
            ax.plot(ticks, [y] * len(ticks), "|", color="black", markersize=14, label="bucket issued" if r == 0 else None)
            for span in view["spans"].values():
                a, b = (span["ts"] - t0) / 1e3, (span["ts"] + span["dur"] - t0) / 1e3
                if b >= begin and a <= end:
                    ax.broken_barh([(a, b - a)], (y - 1 - 0.3, 0.6), facecolors="#4c72b0",
                                   label="collective running" if r == 0 and a > 0 else None)
            ax.broken_barh([(v["wire"][0] + shift[r], v["wire"][1] - v["wire"][0])], (y - 1 - 0.12, 0.24),
                           facecolors="#c44e52", label="1st bucket: first send posted to last receive done"
                           if r == 0 else None)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.set_yticks([0, 1, 2, 3])
        ax.set_yticklabels(["rank 1 (h2) ddl thread", "rank 1 (h2) training", "rank 0 (h1) ddl thread",
                            "rank 0 (h1) training"], fontsize=8)
        ax.set_xlim(begin, end)
        ends = " and ".join(f"{v['backward_ms'] + shift[r]:.0f}" for r, v in sorted(views.items()))
        ax.set_title(f"{launcher}{', ' + label if label else ''}: step {row['step']}, ms from rank 0's backward start "
                     f"(backward ends at {ends} ms on ranks 0 and 1)", fontsize=9)
        marks0 = json.loads((folder / "marks-rank0.json").read_text())
        samples = json.loads((folder / "link-h1.json").read_text())["samples"]
        to_axis = -marks0["wall_minus_trace_us"] - t0
        for column, name, colour in ((1, "h1 out: rank 0's sends", "#4c72b0"), (2, "h1 in: rank 1's sends", "#dd8452")):
            xs, ys = [], []
            for (ta, *a), (tb, *b) in zip(samples, samples[1:]):
                x = ((ta + tb) / 2 + to_axis) / 1e3
                if begin <= x <= end:
                    xs.append(x)
                    ys.append((b[column - 1] - a[column - 1]) * 8 / (tb - ta) / 1e3)  # bits per us / 1e3: Gbit/s
            lx.plot(xs, ys, color=colour, label=name, linewidth=1)
        for r, v in views.items():
            lx.axvline(v["backward_ms"] + shift[r], color="#555555", linestyle=":", linewidth=1)
        lx.set_xlim(begin, end)
        lx.set_ylabel("Gbit/s", fontsize=8)
        lx.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1].set_xlabel("ms from rank 0's backward start (h1's eth0 counters, sampled every 0.5 ms)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
