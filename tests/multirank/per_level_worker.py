"""Per-level compression under mpiexec (tests/multirank/test_per_level.py): ddl_triton/runtime/compression/per_level.py,
hooks.auto_compress_hook and Options.compression, on emulated hosts (DDL_TOPOLOGY) or one host.

With more than one host (H hosts of L ranks):

1. exactness: integer inputs built so that int8 blocks are exact at both quantizations (each
   256-element block of a shard starts with a host sum of 127 and holds even host sums in
   [-62, 62], so the scales are 1 and H and every value is a multiple of them): the per-level
   int8 allreduce ("avg" and "sum") equals the exact result, ``==``, for sizes 0, 1, 2, 3, 255,
   256, 257, primes 1021 and 4099, and 100003, sync and async;
2. identical: every rank holds the same bits after each call (int8 and 1-bit, random data);
3. bytes, per level, as ``transport_bytes`` counts them: the host's shm carries fp32,
   2(L-1) * 4C bytes received (C = ceil(N / L)), its inter-node transport nothing; the cross
   group's inter-node transport exactly ``compressed.wire_bytes(method, C, H)``; the world
   communicator nothing;
4. error feedback: T calls of 1-bit ("sum") on fixed inputs: the sum of the outputs over the
   shard == T * the exact sum - the cross group's worker residuals - its server residuals, up
   to fp32 rounding;
5. DDP: ``auto_compress_hook`` with compression "int8" and DDP on the "ddl" backend with
   ``DDL_COMPRESSION=int8`` (no hook) give bitwise the same gradients (the same algorithm,
   residuals kept by bucket index or by buffer), within the int8 bound of the lossless ones,
   identical on every rank; a small tensor (< MIN_BYTES) and an int64 one stay exact on the
   option path; ``auto`` decides alike on every rank;
6. DDP under ``auto_compress_hook`` with compression "auto", buckets decided by their place in
   backward (ddl_triton/torch/backward_position.py): from the second step on every bucket has
   a positioned decision, the same method on every rank, the last bucket's with no backward
   behind it; the gradients are identical on every rank and within the int8 bound of lossless.
   The same on the option path (a "ddl" group with ``DDL_COMPRESSION=auto``) with two models in
   turn, rank 0 keeping the first alive and the others not, so that only some ranks' allocators
   may hand the second model's buckets the first one's addresses: the decisions go by place in
   backward, never by address, so every rank makes the same collectives.

On one host: it never compresses: ``per_level.allreduce`` is bitwise ``comm.allreduce``,
residuals are (0, None), ``auto`` and ``int8`` both decide "none" without probing anything.
``--quick`` (the real-host test): checks 1-4 on fewer sizes, and auto, without DDP.
Prints "per_level_worker: N ranks, M checks, 0 failures" on rank 0.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddl_triton as ddl
from ddl_triton import compression_methods
import ddl_triton.torch  # noqa: F401 - registers the "ddl" backend
from ddl_triton.runtime.compression import compressed, per_level
from ddl_triton.torch import hooks
from ddl_triton.torch.level_compression import MIN_BYTES, LevelCompression
from support.checker import Checker

SIZES = (0, 1, 2, 3, 255, 256, 257, 1021, 4099, 100003)
QUICK_SIZES = (0, 1, 257, 4099, 100003)  # --quick (the real-host test): checks 1-4 and auto, not DDP


def host_sums(n: int, h: int, shard: int) -> torch.Tensor:
    """Host h's sum for every element (see the module doc, check 1)."""
    j = torch.arange(n)
    s = 2 * ((j * 7 + 5 * h) % 63) - 62
    s[(j % shard) % 256 == 0] = 127
    return s.to(torch.float32)


def exact_input(n: int, lv, h: int, l: int) -> torch.Tensor:
    """Rank (h, l)'s part of host sum h: the first rank of the host takes what the others do not."""
    shard = max(1, -(-n // lv.local_size)) if lv.local_size > 1 else max(n, 1)
    t = (torch.arange(n) % 5 - 2).to(torch.float32)
    return host_sums(n, h, shard) - (lv.local_size - 1) * t if l == 0 else t


def moved(comm) -> dict:
    return {name: dict(v) for name, v in comm.transport_bytes.items()}


def delta(after: dict, before: dict, name: str, what: str) -> int:
    return after.get(name, {}).get(what, 0) - before.get(name, {}).get(what, 0)


def across_hosts(ck: Checker, comm, lv, sizes=SIZES) -> None:
    H, L, h, l = lv.hosts, lv.local_size, lv.host_index, lv.local_rank
    between = "mpi" if comm.bootstrap.kind == "mpi" else "gloo"
    for n in sizes:
        for op in ("avg", "sum"):
            for async_op in (False, True):
                x = exact_input(n, lv, h, l)
                shard = max(1, -(-n // L)) if L > 1 else max(n, 1)
                total = sum(host_sums(n, g, shard).double() for g in range(H)) if n else torch.zeros(0).double()
                expect = (total / (H * L) if op == "avg" else total).to(torch.float32)
                w, _ = per_level.residual_sizes(lv, "int8", n)
                res = torch.zeros(w)
                out = per_level.allreduce(lv, x, method="int8", op=op, residual=res, async_op=async_op)
                out = out.wait() if async_op else out
                ck.equal(f"int8 {op} exact, {n} elements, async {async_op}", x, expect)
                ck.true(f"int8 {op} {n}: the call returns the tensor", out is x)
                ck.equal(f"int8 {op} {n}: nothing lost, so the residual stays zero", res, torch.zeros(w))
    g = torch.Generator().manual_seed(comm.rank)
    for n in sizes:
        for method in compression_methods.names():
            x = torch.randn(n, generator=g)
            before = [moved(c) for c in (lv.node or comm, lv.cross, comm)]
            w, s = per_level.residual_sizes(lv, method, n)
            per_level.allreduce(lv, x, method=method, residual=torch.zeros(w),
                                server_residual=None if s is None else torch.zeros(s), async_op=True).wait()
            after = [moved(c) for c in (lv.node or comm, lv.cross, comm)]
            ck.identical(f"{method} {n}: every rank holds the same bits", x)
            c = max(1, -(-n // L)) if n else 0
            inter = compressed.wire_bytes(method, c if L > 1 else n, H)
            if L > 1:
                ck.true(f"{method} {n}: shm carries fp32 2(L-1)*4C",
                        delta(after[0], before[0], "shm", "received") == 2 * (L - 1) * 4 * c,
                        f"{delta(after[0], before[0], 'shm', 'received')} != {2 * (L - 1) * 4 * c}")
                ck.true(f"{method} {n}: the host group sends nothing between hosts",
                        delta(after[0], before[0], between, "sent") == 0)
                ck.true(f"{method} {n}: the world communicator moves nothing",
                        all(delta(after[2], before[2], t, "sent") == 0 for t in after[2]))
            ck.true(f"{method} {n}: the link carries exactly the compressed bytes",
                    delta(after[1], before[1], between, "sent") == inter
                    and delta(after[1], before[1], between, "received") == inter,
                    f"sent {delta(after[1], before[1], between, 'sent')}, expected {inter}")
            ck.true(f"{method} {n}: per_level.wire_bytes says so",
                    per_level.wire_bytes(lv, method, n)["inter"] == inter)
    error_feedback_identity(ck, comm, lv)
    ck.raises("unknown method", ValueError, lambda: per_level.allreduce(lv, torch.ones(4), method="int2"),
              f"rank {comm.rank}")
    ck.raises("integer tensor", TypeError, lambda: per_level.allreduce(lv, torch.ones(4, dtype=torch.int64)),
              f"rank {comm.rank}")
    ck.raises("wrong residual size", ValueError,
              lambda: per_level.allreduce(lv, torch.ones(1000), residual=torch.zeros(3)), f"rank {comm.rank}")


def error_feedback_identity(ck: Checker, comm, lv, steps: int = 4) -> None:
    """Check 4 (module doc): 1-bit, op "sum", the same input every call."""
    n, H, L = 1000, lv.hosts, lv.local_size
    cross = lv.cross
    x0 = torch.randint(-8, 9, (n,), generator=torch.Generator().manual_seed(7 + comm.rank)).to(torch.float32)
    truth = x0.clone()
    comm.allreduce(truth, op="sum")  # integers: exact in fp32
    w, s = per_level.residual_sizes(lv, "onebit", n)
    res, srv = torch.zeros(w), torch.zeros(s)
    acc = torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        x = x0.clone()
        per_level.allreduce(lv, x, method="onebit", op="sum", residual=res, server_residual=srv)
        acc += x.double()
    a, b = lv.shard_bounds(n) if L > 1 else (0, n)
    c = w
    workers = torch.empty(H * c)
    cross.all_gather(workers, res)
    mine = torch.zeros(c)
    ca, cb = compressed.chunk_bounds(c, H, 32)[lv.cross_rank]
    mine[ca:cb] = srv
    servers = torch.empty(H * c)
    cross.all_gather(servers, mine)
    lost = workers.view(H, c).double().sum(0) + servers.view(H, c).double().sum(0)
    expect = steps * truth[a:b].double() - lost[: b - a]
    err = (acc[a:b] - expect).abs().max().item() if b > a else 0.0
    ck.true("1-bit error feedback: sum of outputs == T * exact sum - residuals", err < 1e-3 * steps * 8 * H * L,
            f"max |error| {err}")


def ddp_paths(ck: Checker, comm) -> None:
    """Check 5: the hook and the option path agree bitwise, and both near the lossless gradients."""
    rank = comm.rank
    models, states = {}, []
    for name in ("lossless", "hook", "option"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 10))
        models[name] = DDP(net)
    lossless = hooks.HookState(comm, compression="none")
    models["lossless"].register_comm_hook(lossless, hooks.allreduce_hook)
    hook_state = hooks.HookState(comm, compression="int8")
    models["hook"].register_comm_hook(hook_state, hooks.auto_compress_hook)
    states += [lossless, hook_state]
    for step in range(3):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank * 100 + step))
        grads = {}
        for name, m in models.items():
            m.zero_grad()
            m(x).square().sum().backward()
            grads[name] = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
        ck.equal(f"step {step}: hook == option path, bitwise", grads["hook"], grads["option"])
        if step == 0:
            # DDP rebuilds its buckets after the first step: the option path's new buffer may start
            # from a zero residual (a new address) while the hook keeps bucket 0's. Reset both.
            hook_state.reset_residuals()
            models["option"].process_group.compression.reset_residuals()
        ck.identical(f"step {step}: hook replicas identical", grads["hook"])
        bound = 2 * 2 / 254 * grads["lossless"].abs().max().item() + 1e-6
        ck.true(f"step {step}: int8 within the bound of lossless",
                (grads["hook"] - grads["lossless"]).abs().max().item() <= bound)
    pg = models["option"].process_group
    ck.true("the option path took int8", [d.method for d in pg.compression.decisions.values()] == ["int8"],
            str(pg.compression.decisions))
    small = torch.arange(10, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(small)
    ck.equal("a small tensor stays exact on the option path", small,
             torch.arange(10, dtype=torch.float32) * sum(range(1, comm.size + 1)))
    big = torch.full((MIN_BYTES,), rank, dtype=torch.int64)
    dist.all_reduce(big)
    ck.equal("an int64 tensor stays exact", big, torch.full((MIN_BYTES,), sum(range(comm.size)), dtype=torch.int64))
    for s in states:
        s.close()


def auto_in_backward(ck: Checker, comm) -> None:
    """Check 6 (module doc)."""
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                              torch.nn.ReLU(), torch.nn.Linear(256, 10))
    model = DDP(net, bucket_cap_mb=0.25)  # several buckets: some mid-backward, one last
    torch.manual_seed(1)
    reference = DDP(torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                                        torch.nn.ReLU(), torch.nn.Linear(256, 10)), bucket_cap_mb=0.25)
    state, lossless = hooks.HookState(comm, compression="auto"), hooks.HookState(comm, compression="none")
    model.register_comm_hook(state, hooks.auto_compress_hook)
    reference.register_comm_hook(lossless, hooks.allreduce_hook)
    lc = state._levels
    for step in range(4):
        x = torch.randn(16, 128, generator=torch.Generator().manual_seed(comm.rank * 100 + step))
        grads = []
        for m in (model, reference):
            m.zero_grad()
            m(x).square().sum().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
        ck.identical(f"auto, step {step}: replicas identical", grads[0])
        bound = 2 * 2 / 254 * grads[1].abs().max().item() + 1e-6
        ck.true(f"auto, step {step}: within the int8 bound of lossless", (grads[0] - grads[1]).abs().max().item() <= bound)
    placed = list(lc.positioned.values())
    ck.true("auto: every bucket of the later steps decided by its place", len(placed) >= 2, str(lc.positioned))
    codes = torch.tensor([("none", "int8", "onebit").index(d.method) for d in placed] + [len(placed)])
    ck.identical("auto: the same positioned decisions on every rank", codes)
    ck.true("auto: one bucket is last, with no backward behind it",
            sum("of backward behind it" not in d.reason for d in placed) == 1, str([d.reason for d in placed]))
    for s in (state, lossless):
        s.close()
    before = os.environ.get("DDL_COMPRESSION")
    os.environ["DDL_COMPRESSION"] = "auto"  # a new group reads the DDL_* variables when it is made
    try:
        group = dist.new_group(backend="ddl")
    finally:
        os.environ["DDL_COMPRESSION"] = before if before is not None else ""
        if before is None:
            del os.environ["DDL_COMPRESSION"]
    kept = []
    for turn in range(2):
        torch.manual_seed(2)
        m = DDP(torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)),
                process_group=group, bucket_cap_mb=0.25)
        for step in range(3):
            m.zero_grad()
            m(torch.randn(8, 128, generator=torch.Generator().manual_seed(comm.rank + step))).square().sum().backward()
            ck.identical(f"auto option path, model {turn}, step {step}: replicas identical",
                         torch.cat([q.grad.reshape(-1) for q in m.parameters()]))
        if comm.rank == 0:
            kept.append(m)  # its buffers stay allocated on rank 0 only
        del m
    del kept
    placed = list(group.compression.positioned.values())
    codes = torch.tensor([("none", "int8", "onebit").index(d.method) for d in placed] + [len(placed)])
    ck.true("auto option path: buckets decided by their place", len(placed) >= 2, str(group.compression.positioned))
    ck.identical("auto option path: the same positioned decisions on every rank", codes)
    dist.destroy_process_group(group)


def auto_agrees(ck: Checker, comm) -> None:
    lc = LevelCompression(comm, "auto")
    codes = torch.tensor([("none", "int8", "onebit").index(lc.decide(b).method) for b in (4096, 4 << 20)])
    ck.identical("auto decides alike on every rank", codes)
    ck.true("auto says why", all(d.reason for d in lc.decisions.values()), str(lc.decisions))
    if comm.rank == 0:
        print(lc.explain(4 << 20), flush=True)
    lc.close()


def one_host(ck: Checker, comm, lv) -> None:
    ck.true("one host: no groups built", lv.node is comm and lv.cross is None)
    for n in SIZES:
        for method in compression_methods.names():
            ck.true(f"one host: no residual ({method}, {n})", per_level.residual_sizes(lv, method, n) == (0, None))
            x = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank + n))
            y = x.clone()
            per_level.allreduce(lv, x, method=method)
            comm.allreduce(y, op="avg")
            ck.equal(f"one host: plain fp32 ({method}, {n})", x, y)
    for setting in ("auto", "int8", "onebit"):
        lc = LevelCompression(comm, setting)
        ck.true(f"one host: {setting} never compresses", lc.decide(8 << 20).method == "none", lc.explain(8 << 20))
        ck.true(f"one host: {setting} probed nothing", lc._speeds is None)
        lc.close()


def main() -> int:
    comm = ddl.init()
    ck = Checker()
    lv = per_level.Levels(comm)

    quick = "--quick" in sys.argv[1:]

    def body() -> None:
        if lv.hosts > 1 and quick:
            across_hosts(ck, comm, lv, QUICK_SIZES)
            auto_agrees(ck, comm)
        elif lv.hosts > 1:
            across_hosts(ck, comm, lv)
            dist.init_process_group("ddl")
            ddp_paths(ck, comm)
            auto_in_backward(ck, comm)
            auto_agrees(ck, comm)
            dist.destroy_process_group()
        else:
            one_host(ck, comm, lv)

    ck.run(body)
    lv.close()
    status = ck.report(f"per_level_worker: {comm.size} ranks")
    ddl.finalize()
    return status


if __name__ == "__main__":
    sys.exit(main())
