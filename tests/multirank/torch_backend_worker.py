"""torch.distributed backend "ddl" test body: ``mpiexec -n N python tests/multirank/torch_backend_worker.py ops|train``.

ops    every backend operation on exact integer data (results compared with ==,
       except AVG, see check_avg), futures, errors, subgroups, and init with no
       MASTER_ADDR (plain ``dist.init_process_group("ddl")``).
train  differential training: a single-process reference run on the whole
       global batch, against DDP on "ddl", DDP on gloo (allreduce comm hook)
       and FSDP2 (fully_shard) on "ddl", each rank training on its own shard.
       Init is the explicit env:// form (MASTER_ADDR/PORT set here, for gloo).

Every rank runs the same sequence of calls whatever a check's outcome, so a
wrong result is reported instead of desynchronising the ranks. Exits 1 (after
printing every failure) if anything was wrong.
"""
from __future__ import annotations

import os
import socket
import sys
import warnings

for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
    os.environ.pop(var, None)  # "ddl" must need none of them; train mode sets its own for gloo

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

import ddl_triton.torch  # noqa: E402  (registers the backend)
from ddl_triton.runtime.calls.work import OrderedRunner  # noqa: E402
from support.checker import Checker  # noqa: E402  (torch_launchers_worker uses it as tw.Checker)

warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor & co. are "deprecated" in 2.13

R = dist.ReduceOp

# -- training setup: see check_training for the tolerance --------------------------------------------
GLOBAL_BATCH = 12           # divisible by 1, 2, 3, 4, 6: every rank gets an equal shard
STEPS = 5
LR = 0.1
RTOL = 1e-5                 # of the parameter scale (max |p|); derivation in check_training


# -- ops mode ----------------------------------------------------------------------------------------
def run_ops(ck: Checker) -> None:
    world = MPI.COMM_WORLD
    r, w = world.Get_rank(), world.Get_size()
    # Torch's rank/size must be MPI's: checked in the rendezvous and in the group creator.
    ck.raises("init with a rank that is not MPI's", ValueError,
              lambda: dist.init_process_group("ddl", rank=(r + 1) % w, world_size=w) if w > 1 else
              dist.init_process_group("ddl", rank=0, world_size=2), "MPI")
    # Only the last rank is wrong (w > 1): every rank must raise, none may hang.
    wrong = {"rank": 0, "world_size": 2} if w == 1 else {"rank": 0 if r == w - 1 else r, "world_size": w}
    ck.raises("init (store) where one rank's rank is not MPI's", ValueError,
              lambda: dist.init_process_group("ddl", store=dist.HashStore(), **wrong), "MPI")
    ck.true("no process group after failed inits", not dist.is_initialized())
    dist.init_process_group("ddl")  # plain: no MASTER_ADDR, no RANK, no WORLD_SIZE
    ck.true("rank and size from MPI", (dist.get_rank(), dist.get_world_size()) == (r, w),
            f"{dist.get_rank()}, {dist.get_world_size()}")
    ck.true("backend name", dist.get_backend() == "ddl", dist.get_backend())
    check_reductions(ck, r, w)
    check_copies(ck, r, w)
    check_alltoall(ck, r, w)
    check_point_to_point(ck, r, w)
    check_futures_and_errors(ck, r, w)
    check_subgroups(ck, r, w)
    dist.barrier()
    dist.destroy_process_group()
    # Again, through the helper (the ddl:// rendezvous): a destroyed group leaves nothing behind.
    ddl_triton.torch.init_process_group()
    t = ramp(r, 3)
    dist.all_reduce(t)
    ck.equal("all_reduce after re-init", t, sum(ramp(q, 3) for q in range(w)))
    dist.destroy_process_group()


def ramp(r: int, n: int, dtype=torch.float32) -> torch.Tensor:
    """Rank-specific integers (exact in every dtype used here)."""
    return (torch.arange(n) * (r + 1) + 3 * r - 4).to(dtype)


def check_reductions(ck: Checker, r: int, w: int) -> None:
    ranks = range(w)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64):
        for op, fn in ((R.SUM, lambda s: s.sum(0)), (R.MIN, lambda s: s.min(0).values),
                       (R.MAX, lambda s: s.max(0).values)):
            t = ramp(r, 7, dtype)
            dist.all_reduce(t, op=op)
            expected = fn(torch.stack([ramp(q, 7, torch.int64) for q in ranks])).to(dtype)
            ck.equal(f"all_reduce {op} {dtype}", t, expected)
    # AVG = sum / size; ddl multiplies by 1/size, so allow one rounding of the result (2**-23 relative).
    t = ramp(r, 9)
    dist.all_reduce(t, op=R.AVG)
    expected = torch.stack([ramp(q, 9) for q in ranks]).sum(0) / w
    ck.true("all_reduce AVG float32", torch.allclose(t, expected, rtol=2 ** -23, atol=0), f"{t} vs {expected}")
    # Non-contiguous (a transposed view), async, and through the widened int8 / bool paths.
    base = ramp(r, 12).view(3, 4)
    t = base.t()
    dist.all_reduce(t, async_op=True).wait()
    ck.equal("all_reduce non-contiguous", base, torch.stack([ramp(q, 12) for q in ranks]).sum(0).view(3, 4))
    t = torch.tensor([r, -r, 100], dtype=torch.int8)
    dist.all_reduce(t)
    s = sum(range(w))
    ck.equal("all_reduce int8 (wraps like native)", t, torch.tensor([s, -s, (100 * w + 128) % 256 - 128], dtype=torch.int8))
    t = torch.tensor([r == 0, False, True])
    dist.all_reduce(t, op=R.MAX)
    ck.equal("all_reduce bool MAX", t, torch.tensor([True, False, True]))
    t = ramp(r, 5)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    ck.equal("all_reduce PREMUL_SUM(0.5)", t, torch.stack([ramp(q, 5) for q in ranks]).sum(0) * 0.5)
    # PRODUCT and the bitwise ops: gathered, then folded in rank order (exact, the same bits everywhere).
    t = ramp(r, 4, torch.int64)
    dist.all_reduce(t, op=R.PRODUCT)
    ck.equal("all_reduce PRODUCT int64", t, torch.stack([ramp(q, 4, torch.int64) for q in ranks]).prod(0))
    t = ramp(r, 4, torch.float64)
    dist.all_reduce(t, op=R.PRODUCT)
    ck.equal("all_reduce PRODUCT float64", t, torch.stack([ramp(q, 4, torch.float64) for q in ranks]).prod(0))
    for op, fn in ((R.BAND, torch.bitwise_and), (R.BOR, torch.bitwise_or), (R.BXOR, torch.bitwise_xor)):
        t = torch.tensor([r + 1, 6, 1 << r], dtype=torch.int32)
        dist.all_reduce(t, op=op)
        expected = torch.tensor([1, 6, 1], dtype=torch.int32)
        for q in ranks[1:]:
            expected = fn(expected, torch.tensor([q + 1, 6, 1 << q], dtype=torch.int32))
        ck.equal(f"all_reduce {op}", t, expected)
    ck.raises("all_reduce BAND of floats", ValueError, lambda: dist.all_reduce(torch.ones(3), op=R.BAND), "BAND")
    ck.raises("all_reduce on a non-CPU tensor", ValueError,
              lambda: dist.all_reduce(torch.empty(3, device="meta")), "CPU")
    # reduce_scatter: tensor form (SUM, AVG, MAX) and list form.
    n = 5
    full = torch.stack([ramp(q, w * n) for q in ranks])
    for op, fn in ((R.SUM, lambda s: s.sum(0)), (R.MAX, lambda s: s.max(0).values)):
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, ramp(r, w * n), op=op)
        ck.equal(f"reduce_scatter_tensor {op}", out, fn(full)[r * n:(r + 1) * n])
    out = torch.empty(n)
    dist.reduce_scatter_tensor(out, ramp(r, w * n), op=R.AVG)
    ck.true("reduce_scatter_tensor AVG", torch.allclose(out, full.sum(0)[r * n:(r + 1) * n] / w, rtol=2 ** -23, atol=0))
    outs = [torch.empty(n), torch.empty(2, dtype=torch.int32)]
    with dist._coalescing_manager():
        dist.reduce_scatter_single(outs[0], ramp(r, w * n))
        dist.reduce_scatter_single(outs[1], ramp(r, w * 2, torch.int32))
    ck.equal("coalesced reduce_scatter #0", outs[0], full.sum(0)[r * n:(r + 1) * n])
    ck.equal("coalesced reduce_scatter #1", outs[1],
             sum(ramp(q, w * 2, torch.int32) for q in ranks)[r * 2:(r + 1) * 2])
    ck.raises("PREMUL_SUM of integers", ValueError, lambda: dist.all_reduce(
        torch.ones(2, dtype=torch.int64), op=dist._make_nccl_premul_sum(0.5)), "floating")
    out = torch.empty(n, dtype=torch.int64)
    dist.reduce_scatter(out, [ramp(r, n, torch.int64) + 100 * q for q in ranks])
    ck.equal("reduce_scatter list", out, sum(ramp(q, n, torch.int64) for q in ranks) + 100 * r * w)
    # reduce: only the root's tensor changes.
    root = w - 1
    t = ramp(r, 6)
    dist.reduce(t, dst=root)
    ck.equal("reduce", t, torch.stack([ramp(q, 6) for q in ranks]).sum(0) if r == root else ramp(r, 6))
    # allreduce_coalesced (mixed dtypes), through the coalescing manager.
    ts = [ramp(r, 3), ramp(r, 4, torch.int64), ramp(r, 2)]
    with dist._coalescing_manager():
        for t in ts:
            dist.all_reduce(t)
    for i, (t, n_, d) in enumerate(((ts[0], 3, torch.float32), (ts[1], 4, torch.int64), (ts[2], 2, torch.float32))):
        ck.equal(f"coalesced all_reduce #{i}", t, sum(ramp(q, n_, d) for q in ranks))


def check_copies(ck: Checker, r: int, w: int) -> None:
    ranks = range(w)
    root = w - 1
    base = ramp(r, 12).view(4, 3)
    dist.broadcast(base.t(), src=root)  # in place through a non-contiguous view
    ck.equal("broadcast non-contiguous", base, ramp(root, 12).view(4, 3))
    t = torch.tensor([r, 250, 7], dtype=torch.uint8)  # not a ddl dtype: moved as raw bytes
    dist.broadcast(t, src=root)
    ck.equal("broadcast uint8", t, torch.tensor([root, 250, 7], dtype=torch.uint8))
    outs = [torch.empty(4) for _ in ranks]
    dist.all_gather(outs, ramp(r, 4))
    for q in ranks:
        ck.equal(f"all_gather list [{q}]", outs[q], ramp(q, 4))
    out = torch.empty(w * 4, dtype=torch.int32)
    dist.all_gather_into_tensor(out, ramp(r, 4, torch.int32))
    ck.equal("all_gather_into_tensor", out, torch.cat([ramp(q, 4, torch.int32) for q in ranks]))
    out = torch.empty(w, 2, dtype=torch.complex64)
    dist.all_gather_into_tensor(out, torch.tensor([complex(r, -r), complex(2, r)], dtype=torch.complex64))
    ck.equal("all_gather_into_tensor complex64",
             out, torch.tensor([[complex(q, -q), complex(2, q)] for q in ranks], dtype=torch.complex64))
    outs = [torch.empty(w * 2), torch.empty(w * 3, dtype=torch.int64)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_single(outs[0], ramp(r, 2))
        dist.all_gather_single(outs[1], ramp(r, 3, torch.int64))
    cm.wait()
    ck.equal("coalesced all_gather #0", outs[0], torch.cat([ramp(q, 2) for q in ranks]))
    ck.equal("coalesced all_gather #1", outs[1], torch.cat([ramp(q, 3, torch.int64) for q in ranks]))
    out = torch.empty(w * 3, dtype=torch.float64)
    dist.all_gather_into_tensor(out, ramp(r, 6, torch.float64)[::2])  # non-contiguous input
    ck.equal("all_gather_into_tensor strided input", out, torch.cat([ramp(q, 6, torch.float64)[::2] for q in ranks]))
    gathered = [torch.empty(3) for _ in ranks] if r == 0 else None
    dist.gather(ramp(r, 3), gathered, dst=0)
    if r == 0:
        for q in ranks:
            ck.equal(f"gather [{q}]", gathered[q], ramp(q, 3))
    got = torch.empty(3)
    dist.scatter(got, [ramp(q, 3) + 50 for q in ranks] if r == root else None, src=root)
    ck.equal("scatter", got, ramp(r, 3) + 50)


def check_alltoall(ck: Checker, r: int, w: int) -> None:
    ranks = range(w)
    k = 3
    inp = torch.cat([torch.full((k,), 10.0 * r + q) for q in ranks])  # block q goes to rank q
    out = torch.empty(w * k)
    dist.all_to_all_single(out, inp)
    ck.equal("all_to_all_single even", out, torch.cat([torch.full((k,), 10.0 * q + r) for q in ranks]))
    # Uneven: rank s sends q + s + 1 rows of width 2 to rank q.
    rows = [q + r + 1 for q in ranks]
    inp = torch.cat([torch.full((n, 2), 100 * r + q, dtype=torch.int64) for q, n in zip(ranks, rows)])
    in_rows = [r + s + 1 for s in ranks]
    out = torch.empty(sum(in_rows), 2, dtype=torch.int64)
    dist.all_to_all_single(out, inp, output_split_sizes=in_rows, input_split_sizes=rows)
    expected = torch.cat([torch.full((n, 2), 100 * s + r, dtype=torch.int64) for s, n in zip(ranks, in_rows)])
    ck.equal("all_to_all_single uneven", out, expected)
    outs = [torch.empty(2) for _ in ranks]
    dist.all_to_all(outs, [torch.tensor([r, q], dtype=torch.float32) for q in ranks])
    for q in ranks:
        ck.equal(f"all_to_all list [{q}]", outs[q], torch.tensor([q, r], dtype=torch.float32))
    outs = [torch.empty(q + 1, dtype=torch.int32) for q in ranks]  # uneven list form
    dist.all_to_all(outs, [torch.full((r + 1,), 7 * r + q, dtype=torch.int32) for q in ranks])
    for q in ranks:
        ck.equal(f"all_to_all uneven list [{q}]", outs[q], torch.full((q + 1,), 7 * q + r, dtype=torch.int32))


def check_point_to_point(ck: Checker, r: int, w: int) -> None:
    if w == 1:
        return
    nxt, prv = (r + 1) % w, (r - 1) % w
    got = torch.empty(4)
    sends = [dist.isend(ramp(r, 4), nxt, tag=7), dist.isend(ramp(r, 4) * 2, nxt, tag=9)]
    got9 = torch.empty(4)
    dist.recv(got9, prv, tag=9)  # matched by tag, though sent second
    dist.recv(got, prv, tag=7)
    for s in sends:
        s.wait()
    ck.equal("send/recv tag 7", got, ramp(prv, 4))
    ck.equal("send/recv tag 9", got9, ramp(prv, 4) * 2)
    got = torch.empty(2, 3, dtype=torch.bfloat16).t()  # non-contiguous receive
    ops = [dist.P2POp(dist.irecv, got, prv), dist.P2POp(dist.isend, ramp(r, 6, torch.bfloat16).view(3, 2), nxt)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    ck.equal("batch_isend_irecv", got, ramp(prv, 6, torch.bfloat16).view(3, 2))
    # Receive from any source: rank 0 hears from every other rank, in whatever order they arrive.
    if r == 0:
        heard = {}
        for _ in range(w - 1):
            t = torch.empty(3, dtype=torch.int64)
            src = dist.recv(t, tag=11)
            heard[src] = t
        ck.true("recv from any source: every sender", sorted(heard) == list(range(1, w)), str(sorted(heard)))
        for src, t in heard.items():
            ck.equal(f"recv from any source: rank {src}'s message", t, ramp(src, 3, torch.int64))
    else:
        dist.send(ramp(r, 3, torch.int64), 0, tag=11)


def check_futures_and_errors(ck: Checker, r: int, w: int) -> None:
    t = ramp(r, 4)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    value = fut.wait()
    expected = sum(ramp(q, 4) for q in range(w))
    ck.true("future resolves to the output list", isinstance(value, list) and value[0] is t, repr(value))
    ck.equal("future value", value[0], expected)
    ck.equal("future.then", doubled.wait(), expected * 2)
    ck.true("work completed", work.is_completed() and work.wait())
    out = torch.empty(w * 2)
    work = dist.all_gather_into_tensor(out, ramp(r, 2), async_op=True)
    ck.equal("all_gather future", work.get_future().wait()[0], torch.cat([ramp(q, 2) for q in range(w)]))
    works = [dist.broadcast(torch.full((3,), float(r)), src=q, async_op=True) for q in range(w)]
    ck.equal("async broadcasts complete in order", torch.stack([wk.get_future().wait()[0] for wk in works]),
             torch.arange(w, dtype=torch.float32).repeat_interleave(3).view(w, 3))
    ck.true("barrier future", dist.barrier(async_op=True).get_future().wait() == [])
    ck.raises("avg of integers", ValueError, lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=R.AVG), "avg")
    # A collective that fails while running (ranks disagree on the size; ddl_triton's call checker
    # catches it on every rank) fails its Work and future. On a throwaway group: it stays unusable.
    doomed = dist.new_group(backend="ddl")
    if w > 1 and getattr(doomed.communicator.options, "check_calls", False):
        work = dist.all_reduce(torch.ones(3 + r), group=doomed, async_op=True)
        ck.raises("a failed async collective: Work.wait", Exception, work.wait, f"rank {r}")
        ck.raises("a failed async collective: its future", Exception, work.get_future().wait, f"rank {r}")
        ck.raises("the failed group refuses more work", Exception, lambda: dist.all_reduce(torch.ones(3), group=doomed))


def check_subgroups(ck: Checker, r: int, w: int) -> None:
    members = list(range(max(1, w - 1)))  # all ranks but the last (when w > 1)
    sub = dist.new_group(members, backend="ddl")
    t = ramp(r, 5)
    if r in members:
        dist.all_reduce(t, group=sub)
        ck.equal("subgroup all_reduce", t, sum(ramp(q, 5) for q in members))
        out = torch.empty(len(members) * 2)
        dist.all_gather_into_tensor(out, ramp(r, 2), group=sub)
        ck.equal("subgroup all_gather", out, torch.cat([ramp(q, 2) for q in members]))
    everyone = dist.new_group(backend="ddl")
    t = ramp(r, 3, torch.int64)
    dist.all_reduce(t, op=R.MAX, group=everyone)
    ck.equal("new_group(all) all_reduce", t, ramp(w - 1, 3, torch.int64).max(ramp(0, 3, torch.int64)))


# -- train mode ---------------------------------------------------------------------------------------
class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def make_model(seed: int) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def make_data():
    g = torch.Generator().manual_seed(1234)
    return torch.randn(STEPS, GLOBAL_BATCH, 8, generator=g), torch.randn(STEPS, GLOBAL_BATCH, 4, generator=g)


def train(model, xs, ys, shard=None) -> dict[str, torch.Tensor]:
    """SGD on the mean squared error over the batch (``shard``: this rank's rows of it)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in zip(xs, ys):
        if shard is not None:
            x, y = x[shard], y[shard]
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).sum(1).mean()  # a mean over the rows: equal shards make DDP's average exact
        loss.backward()
        opt.step()
    inner = getattr(model, "module", model)  # DDP's parameters are its module's
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def close(ck: Checker, what: str, got: dict, ref: dict) -> None:
    for k, v in ref.items():
        tol = RTOL * v.abs().max().item()
        err = (got[k] - v).abs().max().item()
        ck.true(f"{what} {k}", err <= tol, f"max |diff| {err:.3g} > tolerance {tol:.3g}")


def check_training(ck: Checker, r: int, w: int) -> None:
    """Tolerance: every variant computes the same gradients, only summed in another order (per-rank
    partial sums, then the allreduce) and scaled in another order (1/n per shard, then 1/w, against
    1/N), so each gradient element differs by a few fp32 roundings: |dg| <~ 4 eps |g| with eps = 2**-23.
    After STEPS=5 SGD steps with LR=0.1 (|g| <~ 10 |p| here) the parameters differ by <~ 5 * 0.1 * 4
    eps * 10 |p| = 2.4e-6 |p| before the differences feed back, which a few steps barely amplify;
    RTOL = 1e-5 of each tensor's max |p| covers that with margin while staying far below what a
    missing or wrong average produces (checked: training on the local shard alone must fail it)."""
    xs, ys = make_data()
    n = GLOBAL_BATCH // w
    shard = slice(r * n, (r + 1) * n)
    init = {k: v.clone() for k, v in make_model(0).state_dict().items()}
    ref = train(make_model(0), xs, ys)
    for k in ref:
        moved = (ref[k] - init[k]).abs().max().item()
        ck.true(f"reference moved {k}", moved > 100 * RTOL * ref[k].abs().max().item(), f"only {moved:.3g}")
    if w > 1:  # the data really differs across ranks, so skipping the average must be caught
        local = train(make_model(0), xs, ys, shard)
        worst = max(((local[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref)
        ck.true("local-only training differs from the reference", worst > 100 * RTOL, f"only {worst:.3g}")

    # DDP on "ddl": a rank-specific init (DDP broadcasts rank 0's), one bucket per parameter.
    # DDP's reducer issues each bucket from C++ in backward, then asks for its future: those
    # calls are issued without waking the communicator's thread (get_future wakes it); a
    # Python-API call made in backward (from a tensor hook) wakes it at once.
    held = []
    waking_later = OrderedRunner.waking_later
    OrderedRunner.waking_later = lambda self: (held.append(1), waking_later(self))[1]
    try:
        model = make_model(0 if r == 0 else 100 + r)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1e-4)
        close(ck, "DDP on ddl", train(ddp, xs, ys, shard), ref)
        ck.true("DDP's buckets are issued waking the thread later", len(held) >= STEPS, f"{len(held)} held")
        before = len(held)
        x = torch.ones(3, requires_grad=True)
        summed = []

        def python_api_in_backward(grad):
            summed.append(dist.all_reduce(grad.clone(), async_op=True).get_future().wait()[0])
            return grad

        y = x * 2
        y.register_hook(python_api_in_backward)
        y.sum().backward()
        ck.equal("all_reduce from a hook in backward", summed[0], torch.full((3,), float(w)))  # grad of y.sum() is 1
        ck.true("a Python-API call in backward wakes the thread at once", len(held) == before,
                f"{len(held) - before} held")
    finally:
        OrderedRunner.waking_later = waking_later

    # DDP on gloo, with the plain allreduce comm hook, through the shared default store.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    gloo = dist.new_group(backend="gloo")
    ddp = torch.nn.parallel.DistributedDataParallel(make_model(0 if r == 0 else 200 + r), process_group=gloo)
    ddp.register_comm_hook(gloo, default_hooks.allreduce_hook)
    close(ck, "DDP on gloo (allreduce hook)", train(ddp, xs, ys, shard), ref)

    # FSDP2 on "ddl": every rank holds a shard of each parameter; full_tensor() gathers them.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (w,))
    model = make_model(0)
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train(model, xs, ys, shard)
    full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    close(ck, "FSDP2 on ddl", full, ref)
    ck.true("FSDP2 parameters are sharded", all(v.to_local().numel() < v.numel() for v in model.parameters()) or w == 1)


def run_train(ck: Checker) -> None:
    world = MPI.COMM_WORLD
    r, w = world.Get_rank(), world.Get_size()
    port = None
    if r == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("ddl", init_method="env://", rank=r, world_size=w)
    check_training(ck, r, w)
    dist.destroy_process_group()


def main() -> int:
    """``torch_backend_worker.py [MODE[,MODE]]``: ops, train, or both in one launch (ops first: it
    needs no MASTER_ADDR, which train sets), each mode with its own checker and report."""
    status = 0
    for mode in (sys.argv[1] if len(sys.argv) > 1 else "ops").split(","):
        ck = Checker()
        ck.run(lambda: {"ops": run_ops, "train": run_train}[mode](ck))
        status |= ck.report(f"torch_backend_worker: {MPI.COMM_WORLD.Get_size()} ranks, {mode}")
    return status


if __name__ == "__main__":
    sys.exit(main())
