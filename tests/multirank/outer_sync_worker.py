"""Outer-sync training across ranks (tests/multirank/test_outer_sync.py): ddl_triton.torch.DiLoCo on the
framework-neutral core (ddl_triton/outer_sync/), on N ranks, on one host or emulated hosts (DDL_TOPOLOGY).

Checks (integer-valued data compared with ==, bits compared across ranks as raw bytes):

1. per-step averaging: sync_every=1, inner SGD, outer SGD lr 1.0 without momentum: after every
   step the parameters equal (==) a reference model trained alike whose parameters are averaged
   over the ranks after each step (integer data whose rank offsets sum to zero, so every sum
   and mean is exact, 1/3 included: fl(3k * fl(1/3)) == k);
2. the pseudo-gradient mean: the core's average of integer-valued deltas (backup - local) equals
   the exact mean, compression none;
3. identical replicas: random data, outer SGD lr 0.7 with Nesterov momentum 0.9 (DiLoCo's), with
   fragments=2 and fragment_sync_delay=1, and with int8 and int4 compression
   (where there are hosts to compress between): after every fragment's sync its parameters and every backup hold the same
   bits on every rank;
4. with DDL_TOPOLOGY giving several ranks per host: replicas="hosts", DDP over
   ``ddl_triton.torch.host_group()``: the same bits on every rank after each sync, and the cross-host
   group sends at most one shard (4 * ceil(numel / L) bytes) per rank per sync, fp32; without
   the DDP the ranks of a host disagree and DiLoCo raises ValueError naming the rank;
5. sync_every="auto" (the planner's choice, ddl_triton/torch/diloco_auto.py): the same plan on every
   rank; while measuring and under a per-step plan the parameters are identical after every step;
6. the contract's errors across ranks (a bad sync_every on every rank: ValueError naming the rank).

Prints "outer_sync_worker: N ranks, M checks, 0 failures" on rank 0.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ddl_triton as ddl  # noqa: E402
import ddl_triton.torch as ddt  # noqa: E402
from ddl_triton import compression_methods  # noqa: E402
from ddl_triton.outer_sync import OuterSync  # noqa: E402
from ddl_triton.runtime.compression import per_level  # noqa: E402
from support.checker import Checker  # noqa: E402


def int_model() -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_((torch.arange(p.numel()) % 5 - 2 + i % 2).float().view_as(p))
    return m


def int_batch(t: int, rank: int, n: int) -> torch.Tensor:
    """Integer inputs: a base shared by every rank plus (2 rank - (n - 1)) times a step's delta, so
    that the rank offsets sum to zero and the gradients' sum is n times the base's."""
    base = (torch.arange(12).view(3, 4) * (t + 1)) % 3 - 1
    delta = (torch.arange(12).view(3, 4) + t) % 2
    return (base + (2 * rank - (n - 1)) * delta).float()


def per_step_averaging(ck: Checker, comm) -> None:
    n, r = comm.size, comm.rank
    m, ref = int_model(), int_model()
    inner = torch.optim.SGD(m.parameters(), lr=1.0)
    ref_inner = torch.optim.SGD(ref.parameters(), lr=1.0)
    outer = torch.optim.SGD(m.parameters(), lr=1.0)
    d = ddt.DiLoCo(m, inner, outer, sync_every=1, comm=comm)
    with d:
        for t in range(4):
            for model, opt in ((m, inner), (ref, ref_inner)):
                opt.zero_grad()
                model(int_batch(t, r, n)).sum().backward()
                opt.step()
            with torch.no_grad():
                for p in ref.parameters():
                    comm.allreduce(p.data, op="avg")
            for i, (a, b) in enumerate(zip(m.parameters(), ref.parameters())):
                ck.equal(f"sync_every=1 step {t} param {i} == per-step averaging", a.detach(), b.detach())
                ck.true(f"step {t} param {i} integer-friendly", bool(torch.all(a.abs() < 2 ** 20)))
    d.close()


def pseudo_gradient_mean(ck: Checker, comm) -> None:
    n, r = comm.size, comm.rank
    numel = 1031  # a prime: not a multiple of the ranks or hosts
    core = OuterSync(comm, [numel * 4], sync_every=1, compression=None)
    backup = (torch.arange(numel) % 7 - 3).float()
    core.set_backup(0, backup)
    delta = ((torch.arange(numel) * 3) % 11 - 5).float()
    wiggle = (torch.arange(numel) % 3 - 1).float()
    local = backup - (delta + (2 * r - (n - 1)) * wiggle)  # the deltas' mean is `delta`, exactly
    core.advance()
    core.start(0, local)
    ck.equal("the pseudo-gradient mean is exact (none)", core.finish(0), delta)
    core.close()


def identical_replicas(ck: Checker, comm, compression: str | None, fragments: int, delay: int,
                       replicas: str = "ranks", host_ddp: bool = False) -> None:
    torch.manual_seed(1234 + comm.rank)  # every rank its own data (and, before the broadcast, its own init)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8), torch.nn.Linear(8, 4))
    model = DDP(net, process_group=ddt.host_group(comm)) if host_ddp else net
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    d = ddt.DiLoCo(model, inner, outer, sync_every=4, fragments=fragments, fragment_sync_delay=delay,
                   compression=compression, replicas=replicas, comm=comm)
    what = f"{compression or 'fp32'}, fragments={fragments}, delay={delay}, replicas={replicas}"
    cross = d.core.average.levels.cross if replicas == "hosts" and d.core.average.levels is not None else None
    synced = 0
    with d:
        for t in range(12):
            before = _sent(cross) if cross is not None else 0
            inner.zero_grad()
            x = torch.randn(8, 16)
            torch.nn.functional.mse_loss(model(x), torch.zeros(8, 4)).backward()
            inner.step()
            f = d.core.schedule.syncs_at(d.step)
            if f is None:
                continue
            synced += 1
            for i, p in enumerate(d.fragments[f]):
                ck.identical(f"{what}: step {d.step} fragment {f} param {i}", p.detach())
            for g, b in enumerate(d.core.backups):
                ck.identical(f"{what}: step {d.step} backup {g}", b)
            if cross is not None and compression is None and delay == 0:
                lv = d.core.average.levels
                numel = d.core.backups[f].numel()
                shard = 4 * -(-numel // lv.local_size)
                ck.true(f"{what}: the cross-host group sends one shard per rank per sync",
                        0 < _sent(cross) - before <= shard, f"{_sent(cross) - before} B sent, shard {shard} B")
    ck.true(f"{what}: synced", synced == 12 // (4 // fragments))
    d.close()


def _sent(comm) -> int:
    return sum(v["sent"] for v in comm.transport_bytes.values())


def hosts_must_agree(ck: Checker, comm) -> None:
    torch.manual_seed(99 + comm.rank)
    net = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = torch.optim.SGD(net.parameters(), lr=0.7)
    d = ddt.DiLoCo(net, inner, outer, sync_every=1, replicas="hosts", comm=comm)

    def step():
        with d:
            inner.zero_grad()
            net(torch.randn(3, 4)).sum().backward()  # no DDP inside the host: the host's ranks diverge
            inner.step()

    ck.raises("replicas='hosts' without per-step reduction inside the host", ValueError, step,
              f"rank {comm.rank}: outer sync with replicas='hosts'")
    d.core._pending.clear()  # the failed sync never started
    d.close()


def auto(ck: Checker, comm) -> None:
    """sync_every="auto": the same plan on every rank, printed once by rank 0's process; per-step
    averaging keeps the parameters identical after every step, outer sync the backups."""
    torch.manual_seed(5 + comm.rank)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    inner = torch.optim.SGD(net.parameters(), lr=0.05)
    outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    d = ddt.DiLoCo(net, inner, outer, "auto", max_sync_every=8, comm=comm)
    with d:
        for t in range(12):
            inner.zero_grad()
            torch.nn.functional.mse_loss(net(torch.randn(8, 16)), torch.zeros(8, 4)).backward()
            inner.step()
            if d.plan is None or d.plan.mode == "per-step":
                for i, p in enumerate(net.parameters()):
                    ck.identical(f"auto ({d.plan.mode if d.plan else 'measuring'}): step {t + 1} param {i}", p.detach())
    ck.true("auto: a plan", d.plan is not None)
    mine = torch.tensor([d.plan.sync_every, len(d.plan.why)], dtype=torch.int64)
    ck.identical("auto: the same plan on every rank", mine)
    if d.core is not None:
        for g, b in enumerate(d.core.backups):
            ck.identical(f"auto (outer H={d.sync_every}): backup {g}", b)
    d.close()


def errors(ck: Checker, comm) -> None:
    net = torch.nn.Linear(2, 2)
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = torch.optim.SGD(net.parameters(), lr=0.7)
    ck.raises("sync_every 0", ValueError, lambda: ddt.DiLoCo(net, inner, outer, 0, comm=comm),
              f"rank {comm.rank}: outer sync: sync_every must be an int >= 1")
    ck.raises("fragments > params", ValueError, lambda: ddt.DiLoCo(net, inner, outer, 4, fragments=4, comm=comm),
              f"rank {comm.rank}: outer sync: fragments=4 is more than the 2 parameters")


def main() -> int:
    comm = ddl.init()
    ck = Checker()
    lv = per_level.Levels(comm)
    hosts, local = lv.hosts, lv.local_size
    lv.close()
    int8 = compression_methods.DEFAULT  # the registry's default compressed method

    def body() -> None:
        dist.init_process_group("ddl")
        per_step_averaging(ck, comm)
        pseudo_gradient_mean(ck, comm)
        identical_replicas(ck, comm, None, 2, 1)
        identical_replicas(ck, comm, int8, 1, 0)
        identical_replicas(ck, comm, int8, 2, 1)
        identical_replicas(ck, comm, "int4", 2, 1)  # Streaming DiLoCo's 4-bit pseudo-gradients
        if hosts > 1 and local > 1:
            identical_replicas(ck, comm, None, 1, 0, replicas="hosts", host_ddp=True)
            identical_replicas(ck, comm, int8, 2, 1, replicas="hosts", host_ddp=True)
            hosts_must_agree(ck, comm)
        auto(ck, comm)
        errors(ck, comm)
        dist.destroy_process_group()

    ck.run(body)
    status = ck.report(f"outer_sync_worker: {comm.size} ranks")
    ddl.finalize()
    return status


if __name__ == "__main__":
    sys.exit(main())
