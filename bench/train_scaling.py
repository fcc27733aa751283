"""Data-parallel training scaling: ddl_triton against gloo, the host's ceiling and, across hosts, the link's bound.

Run:  ddlrun -n 2 -- python bench/train_scaling.py [--model cnn|mlp|both] [--steps 5] [--rounds 10]
                                                  [--warmup 2] [--gradient-as-bucket-view] [--json F]
Across hosts (docs/testbed.md; bench/train_scaling_across_hosts.py runs both launchers and layouts):
      ddlrun -n 4 -H h1:2,h2:2 -- python bench/train_scaling.py --link-rate 1gbit
      torchrun --nnodes 2 --node-rank I --nproc-per-node 2 --master-addr h1 --master-port P \
          bench/train_scaling.py --link-rate 1gbit                                  (on each host I)

Any launcher that ``dist.init_process_group("ddl")`` follows will do (an MPI launcher: MPI's
ranks and ddl's own store; torchrun: torch's store, and ddl over its gloo transport between
hosts); the benchmark's own coordination (barriers, the gathered step times) goes over a gloo
group beside the groups it times, so it needs no MPI. Any world size from 2.

Workloads (synthetic data, batch 32 per rank, SGD with momentum 0.9, one torch thread per rank):
- ``cnn``: a ResNet-style CNN on 3x32x32 images: stem conv 3->32, basic blocks 32->32, 32->64,
  64->128 and 128->192 (stride-2 downsampling, BatchNorm), global average pool, linear to 10
  classes; about 0.89M parameters (3.5 MB of fp32 gradients per step).
- ``mlp``: 3072 -> 1536 -> 768 -> 10 with ReLU on flattened 3x32x32 images; about 5.9M
  parameters (23.6 MB of gradients per step), so communication matters more.

Modes, timed in interleaved rounds (every mode once per round, the order rotating); N is the
world size:
- ``1 rank``: one rank trains alone, without DDP, while the others sleep (the baseline); rank
  r % N in round r, since the cores (and hosts) need not be equally fast;
- ``N independent``: every rank trains without any communication: the ceiling this machine
  allows (the cores share memory bandwidth and caches, so it is below N times the baseline;
  with more ranks than cores, they also share the cores);
- ``ddp no-comm``: DDP on "ddl" with a comm hook that communicates nothing and no buffer
  broadcast: DDP's own work (autograd hooks, copies into and out of its buckets), the best
  any backend can do under DDP; its replicas diverge, so they are not compared;
- ``ddp lockstep``: DDP on "ddl" with a comm hook that allreduces 4 bytes per bucket
  (asynchronously, as a real bucket) and leaves the gradients alone, buffer broadcast on:
  everything "ddl" does but move the gradients, so ``ddl`` against it is the cost of the
  gradient bytes, and it against ``ddp no-comm`` the cost of keeping the ranks in step (the
  slower rank of each step sets the pace; the ranks compute the same phase at once);
  its replicas diverge, so they are not compared;
- ``gloo``: DDP on torch's gloo, through torch's stock ``allreduce_hook`` (default_hooks.py);
- ``ddl``: DDP on the "ddl" backend, through the same stock hook (so the two differ only in the
  backend; a hook called from Python is not the reducer's own call, which the backend's
  ``_called_from_cpp_backward`` treats apart);
- ``ddl+<hook>``: DDP on "ddl" with a comm hook from ddl_triton.torch.hooks (``ddl+auto``:
  ``auto_compress_hook``: full precision inside a host, compressed between hosts where it pays);
- ``ddl[<setting>]``: DDP on a "ddl" process group made with ``DDL_COMPRESSION=<setting>`` (the
  ``compression`` option of the default path: int8, onebit or auto), through the stock hook. Where a mode
  compresses per level, the table's notes say what each bucket size sent between hosts, and why.

"cpu ms" is the CPU time one rank's process spends per step, every thread included (the
busiest rank's): what communication costs the cores beside the time it adds. A step's time
is, for each step, the slowest rank's; a round's figure is the median over its steps; the
table quotes the median over rounds. The ratios are paired: each round's ratio of two
modes' figures, then the median over rounds, so the machine's drift, which every mode of a
round shares, cancels. Efficiency = 1-rank step / step (img/s over N times the 1-rank img/s);
"of ceiling" = N-independent step / step; "of no-comm" = ddp-no-comm step / step, the share of
what DDP itself allows. After the last round, every DDP mode's replicas that communicate are
compared across ranks, bit for bit.

Across hosts (ranks on more than one hostname) with ``--link-rate`` (the rate each host's link
is shaped to), the table adds the link:
- ``link MB``: bytes through the busiest host's interface (``--link-iface``, default eth0; its
  kernel counters, headers and every flow included, the larger of sent and received) per step;
- ``bound``: the share of the no-comm step the mode could reach at best on that link. DDP issues
  its last bucket when backward ends, so nothing hides that bucket's time on the link; every
  earlier bucket is assumed hidden. bound = no-comm / (no-comm + t_last), t_last = the mode's
  link bytes per step, times the last bucket's share of the gradient bytes, over the rate.
The header states the same bound for fp32 from DDP's bucket layout alone (its logged bucket
sizes after the rebuild; the last bucket carries 2(H-1)/H * S_last through each of the H hosts'
links): the figure no full-precision mode can pass, but for what the shaper lets through at
once (the testbed's tbf burst: about 2 ms of traffic, when the link was idle before).

The exposed communication (a second table; bench/_exposure.py): every DDP mode's comm hook is
wrapped to record, per bucket, its hand-off and the completion of the future it returned (a
done-callback: the time the collective ended, in the thread that ended it, not when someone
waited). Per step and rank, exposed = the last completion - the last hand-off: from the end of
backward to the end of every bucket's collective. Per step the smallest over the ranks (the last
rank to end backward: what the step pays for communication beyond the slowest backward; "skew
incl.": the largest, the first rank's, which also waits for the others' backward); per round
the median over its steps; the table quotes the median and p25-p75 over rounds. Beside it,
across hosts, the wire bound: the last bucket's bytes through a host's link (2(H-1)/H * S in
fp32; for per-level compression, what its notes say that bucket sent, in compressed bytes), over
the shaped rate, and the exposed time in multiples of it; and the share of no-comm, p25-p75 of
its rounds, as information (the VM's speed and the ranks' skew move it by several points).
``--gradient-as-bucket-view`` passes DDP's option of that name to every DDP mode
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
from torch.nn.parallel import DistributedDataParallel as DDP

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook as stock_allreduce_hook

from _exposure import Exposure, per_step as exposure_per_step, quartiles, wire_bytes_last  # bench/ is on the path
from _train_scaling_table import print_result
from _timing import ddl_group_with_compression, unchanged_bucket_hook
from ddl_triton.testbed.hosts import parse_rate  # the standard library only: no testbed is needed

BATCH = 32
HOOKS = ("allreduce", "fp16", "bf16", "int8", "onebit", "auto")  # "auto" where the hooks module has it
COMPRESSION_MODES = ("auto",)  # ddl[<setting>] in the default modes; int8 and onebit by name
ONE_RANK = "1 rank"
NO_COMM = "ddp no-comm"
LOCKSTEP = "ddp lockstep"


def independent(n: int) -> str:
    """The name of the ceiling mode at world size n ("2 independent")."""
    return f"{n} independent"


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


def available_hooks() -> list[str]:
    """The names in HOOKS whose hook ddl_triton.torch.hooks defines (``auto`` may not exist yet)."""
    from ddl_triton.torch import hooks
    return [h for h in HOOKS if hasattr(hooks, _hook_name(h))]


def _hook_name(short: str) -> str:
    return "allreduce_hook" if short == "allreduce" else f"{short}_compress_hook"


def compression_settings() -> list[str]:
    """The settings of Options.compression other than "none" (ddl_triton/compression_methods.py)."""
    from ddl_triton import compression_methods
    return [c for c in compression_methods.choices() if c != compression_methods.NONE]


class _Control:
    """The benchmark's own coordination, on a gloo group of its own beside the timed ones (the
    control path: whatever launched the ranks, MPI or torchrun, and whatever is being timed)."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def barrier(self) -> None:
        """Every rank here. gloo waits in the kernel, so a rank sitting a mode out leaves its core free."""
        dist.barrier(group=self.group)

    def allgather(self, obj) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def _link_counters(iface: str) -> tuple[int, int]:
    """(bytes sent, bytes received) so far through this host's interface ``iface``: the kernel's
    counters of this network namespace (headers and every flow included, as the shaper sees them)."""
    with open("/proc/self/net/dev") as f:
        for line in f.read().splitlines()[2:]:
            name, _, fields = line.partition(":")
            if name.strip() == iface:
                values = fields.split()
                return int(values[8]), int(values[0])
    raise SystemExit(f"train_scaling.py: rank {dist.get_rank()} on {socket.gethostname()}: no interface "
                     f"{iface!r} in /proc/self/net/dev (--link-iface names the link between hosts)")


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
        self.hook_state = None
        self.group = group
        self.exposure = Exposure()  # every DDP mode's hook goes through it: hand-offs and completions
        if name == NO_COMM:
            state, hook = None, unchanged_bucket_hook
        elif name == LOCKSTEP:
            state, hook = comm, _lockstep_hook
        elif name.startswith("ddl+"):
            from ddl_triton.torch import hooks
            self.hook_state = hooks.HookState(comm)
            state, hook = self.hook_state, getattr(hooks, _hook_name(name[4:]))
        else:  # gloo, ddl, ddl[<setting>]: torch's stock allreduce_hook on the mode's process group
            state, hook = group, stock_allreduce_hook
        if self.ddp:
            self.model.register_comm_hook(state, self.exposure.wrap(hook))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.data = _batches(rank)
        self.i = 0

    def step(self) -> float:
        """One training step; returns its wall time in seconds."""
        x, y = self.data[self.i % len(self.data)]
        self.i += 1
        self.exposure.begin_step()
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

    def bucket_sizes(self) -> list[int]:
        """DDP's bucket sizes in bytes, in the order DDP reduces them (the last is issued when
        backward ends), as DDP logs them: once it has rebuilt its buckets in the order the first
        step's gradients arrived (``rebuilt_bucket_sizes``), those."""
        data = self.model._get_ddp_logging_data()
        logged = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", ""))
        return [int(x) for x in logged.replace(" ", "").split(",") if x]

    def _explain(self):
        """The explain(nbytes) of this mode's per-level compression, or None where it has none."""
        if self.name == "ddl+auto":
            return self.hook_state.explain
        if self.name.startswith("ddl[") and self.group.compression is not None:
            return self.group.compression.explain
        return None

    def compression_notes(self) -> list[str]:
        """Where this mode compresses per level: what each of its bucket sizes sent between hosts,
        and why (decided during training, so asking again is not collective)."""
        explain = self._explain()
        return [explain(b) for b in self.bucket_sizes()] if explain is not None else []

    def last_bucket_link_bytes(self, hosts: int, per_host: int) -> float | None:
        """The bytes the bucket issued when backward ends puts through each host's link (module
        doc, "exposed"): None for the modes that send no gradients, and for the flat compressed hooks."""
        buckets = self.bucket_sizes() if self.ddp else []
        if not buckets or self.name == NO_COMM:
            return None
        if self.name == LOCKSTEP:
            return wire_bytes_last(4, "none", hosts, per_host)
        if self.name not in ("gloo", "ddl", "ddl+allreduce", "ddl+auto") and not self.name.startswith("ddl["):
            return None
        explain = self._explain()  # per level: the method its notes name for the last bucket
        return wire_bytes_last(buckets[-1], explain(buckets[-1]) if explain else "none", hosts, per_host)

    def close(self) -> None:
        if self.hook_state is not None and hasattr(self.hook_state, "close"):
            self.hook_state.close()  # the per-level groups auto_compress_hook made


def _lockstep_hook(comm, bucket):
    """A DDP comm hook that waits for every rank's same bucket (a 4-byte allreduce, issued
    asynchronously like a real bucket's) and returns the bucket unchanged."""
    future = torch.futures.Future()
    comm.allreduce(torch.zeros(1), async_op=True).add_done_callback(lambda _: future.set_result(bucket.buffer()))
    return future


def _check_modes(modes: list[str], n: int) -> None:
    known = [ONE_RANK, independent(n), NO_COMM, LOCKSTEP, "gloo", "ddl"] + [f"ddl+{h}" for h in available_hooks()] \
        + [f"ddl[{c}]" for c in compression_settings()]
    unknown = [m for m in modes if m not in known]
    if unknown:
        raise SystemExit(f"train_scaling.py: rank {dist.get_rank()}: unknown mode(s) {unknown} at {n} ranks; "
                         f"known: {', '.join(known)}")


def run(model: str, steps: int, rounds: int, modes: list[str], ctl: _Control, bucket_cap_mb: float | None = None,
        bucket_view: bool = False, link_rate: str = "", link_iface: str = "eth0", warmup: int = 2) -> dict:
    import ddl_triton as ddl
    rank, n = ctl.rank, ctl.size
    comm = ddl.init()
    gloo = dist.new_group(backend="gloo")
    groups = {ONE_RANK: None, independent(n): None, "gloo": gloo}
    groups.update({m: ddl_group_with_compression(m[4:-1]) for m in modes if m.startswith("ddl[")})
    trainers = {m: _Trainer(m, MODELS[model], groups.get(m, dist.group.WORLD), comm, rank, bucket_cap_mb,
                            bucket_view)
                for m in modes}
    hostnames = ctl.allgather(socket.gethostname())
    hosts = len(set(hostnames))
    link_bits = parse_rate(link_rate) if link_rate and hosts > 1 else 0
    reads_link = bool(link_bits) and hostnames.index(hostnames[rank]) == rank  # one rank per host reads
    times: dict[str, list[float]] = {m: [] for m in modes}  # per round: the median step, seconds
    cpu_times: dict[str, list[float]] = {m: [] for m in modes}  # CPU seconds per step, all threads
    link_bytes: dict[str, list[float]] = {m: [] for m in modes}  # per round: the busiest host's, per step
    exposed: dict[str, list[float]] = {m: [] for m in modes}  # per round: the median step's, the last rank's
    exposed_max: dict[str, list[float]] = {m: [] for m in modes}  # the same, the first rank's (skew included)
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for m in order:
            t = trainers[m]
            ctl.barrier()
            active = m != ONE_RANK or rank == r % n
            steps_taken, cpu, link, exposure = [], 0.0, None, []
            if active:
                for _ in range(warmup):
                    t.step()  # warm-up: caches, buckets rebuilt, the allocator's pools
                t.exposure.take()
            if link_bits:
                ctl.barrier()  # every rank's link window holds this mode's timed steps and nothing else
            if active:
                link0 = _link_counters(link_iface) if reads_link else None
                cpu0 = time.process_time()
                steps_taken = [t.step() for _ in range(steps)]
                cpu = (time.process_time() - cpu0) / steps
                if link0 is not None:
                    link = max(b - a for a, b in zip(link0, _link_counters(link_iface))) / steps
                exposure = t.exposure.take()  # read after the steps: nothing added to them
            per_rank = ctl.allgather((steps_taken, cpu, link, exposure))  # control path
            slowest = [max(s[i] for s, *_ in per_rank if s) for i in range(steps)]
            times[m].append(statistics.median(slowest))
            cpu_times[m].append(max(c for _, c, *_ in per_rank if c))
            if any(x is not None for _, _, x, _ in per_rank):
                link_bytes[m].append(max(x for _, _, x, _ in per_rank if x is not None))
            lows, highs = exposure_per_step([e for *_, e in per_rank if e])
            if lows:
                exposed[m].append(statistics.median(lows))
                exposed_max[m].append(statistics.median(highs))
    digests = {m: ctl.allgather(trainers[m].digest()) for m in modes if trainers[m].synced}
    params = sum(p.numel() for p in trainers[modes[0]].model.parameters())
    ddp_trainers = [t for t in trainers.values() if t.ddp]
    buckets = ddp_trainers[0].bucket_sizes() if ddp_trainers else []
    notes = {m: trainers[m].compression_notes() for m in modes}
    per_host = n // hosts if n % hosts == 0 else 0
    last_link = {m: trainers[m].last_bucket_link_bytes(hosts, per_host) if per_host else None for m in modes}
    for t in trainers.values():
        t.close()

    def paired(numerator: str, m: str) -> list[float]:
        """Per round: that round's ``numerator`` step / mode m's step (none for the baseline itself)."""
        if numerator not in times or m == ONE_RANK:
            return []
        return [a / b for a, b in zip(times[numerator], times[m])]

    # The link's bound: what the last bucket, issued when backward ends, needs on the link.
    no_comm = statistics.median(times[NO_COMM]) if NO_COMM in times else None
    last_share = buckets[-1] / sum(buckets) if buckets else None

    def bound(seconds_on_link: float) -> float | None:
        return no_comm / (no_comm + seconds_on_link) if no_comm else None

    fp32_last_s = 2 * (hosts - 1) / hosts * buckets[-1] * 8 / link_bits if link_bits and buckets else None
    rows = []
    for m in modes:
        ranks = 1 if m == ONE_RANK else n
        step = statistics.median(times[m])
        per_step = statistics.median(link_bytes[m]) if link_bytes[m] else None
        mode_bound = None
        if per_step is not None and last_share is not None and trainers[m].ddp and m not in (NO_COMM, LOCKSTEP):
            mode_bound = bound(per_step * last_share * 8 / link_bits)
        rows.append({"mode": m, "step_ms": step * 1e3, "step_ms_rounds": [x * 1e3 for x in times[m]],
                     "cpu_ms": statistics.median(cpu_times[m]) * 1e3,
                     "img_per_s": ranks * BATCH / step,
                     "efficiency": _median_or_none(paired(ONE_RANK, m)),
                     "of_ceiling": _median_or_none(paired(independent(n), m)),
                     "of_ceiling_rounds": paired(independent(n), m),
                     "of_no_comm": _median_or_none(paired(NO_COMM, m)),
                     "of_no_comm_rounds": paired(NO_COMM, m),
                     "of_no_comm_quartiles": quartiles(paired(NO_COMM, m)),
                     "exposed_ms_quartiles": _ms(quartiles(exposed[m])),
                     "exposed_ms_rounds": [x * 1e3 for x in exposed[m]],
                     "exposed_skew_ms_quartiles": _ms(quartiles(exposed_max[m])),
                     "last_bucket_link_bytes": last_link[m],
                     "wire_bound_ms": last_link[m] * 8 / link_bits * 1e3
                     if link_bits and last_link[m] is not None else None,
                     "link_bytes_per_step": per_step, "bound": mode_bound, "compression": notes[m],
                     "identical": (len(set(digests[m])) == 1) if m in digests else None})
    return {"model": model, "params": params, "batch_per_rank": BATCH, "steps": steps, "rounds": rounds,
            "warmup": warmup,
            "ranks": n, "hosts": hosts, "ranks_per_host": [hostnames.count(h) for h in dict.fromkeys(hostnames)],
            "gradient_as_bucket_view": bucket_view, "bucket_cap_mb": bucket_cap_mb, "bucket_sizes": buckets,
            "link_rate": link_rate if link_bits else None,
            "fp32_last_bucket_link_ms": fp32_last_s * 1e3 if fp32_last_s is not None else None,
            "fp32_bound": bound(fp32_last_s) if fp32_last_s is not None else None, "rows": rows}


def _ms(q: tuple[float, float, float] | None) -> list[float] | None:
    return [x * 1e3 for x in q] if q is not None else None


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


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
    p.add_argument("--link-rate", default="", help="across hosts: the rate each host's link is shaped to "
                   "(e.g. 1gbit); adds each mode's bytes on the link and its bound")
    p.add_argument("--link-iface", default="eth0", help="across hosts: the interface of the link (default eth0)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode per round, before its timed ones")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.steps < 1 or args.rounds < 1 or args.warmup < 1:
        p.error("--steps, --rounds and --warmup: 1 or more (the first step of a mode rebuilds DDP's buckets)")
    if args.link_rate:
        parse_rate(args.link_rate)  # a bad rate fails here, before any rank starts training
    torch.set_num_threads(1)
    import ddl_triton.torch  # noqa: F401 - registers "ddl"
    # The launcher's rendezvous: ddl:// over MPI under ddlrun/mpiexec, torch's store under torchrun.
    dist.init_process_group("ddl")
    ctl = _Control()
    if ctl.size < 2:
        raise SystemExit(f"train_scaling.py: rank {ctl.rank}: run it on 2 ranks or more "
                         "(ddlrun -n 2 -- python bench/train_scaling.py), not on 1")
    modes = args.modes.split(",") if args.modes else \
        [ONE_RANK, independent(ctl.size), NO_COMM, LOCKSTEP, "gloo", "ddl"] + [f"ddl+{h}" for h in available_hooks()] \
        + [f"ddl[{c}]" for c in COMPRESSION_MODES if c in compression_settings()]
    _check_modes(modes, ctl.size)
    results = []
    for model in (("cnn", "mlp") if args.model == "both" else (args.model,)):
        result = run(model, args.steps, args.rounds, modes, ctl, args.bucket_cap_mb, args.gradient_as_bucket_view,
                     args.link_rate, args.link_iface, args.warmup)
        results.append(result)
        if ctl.rank == 0:
            print_result(result)
    if ctl.rank == 0 and args.json:
        meta = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
                "python": sys.version.split()[0], "launcher": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ
                else "mpi"}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
