"""Several ranks' collectives on CUDA tensors: the GPU path end to end (run by bench/gpu_check.py).

    mpiexec -n 2 python tests/gpu/cuda_ranks_worker.py [--device cuda|cpu]

Each rank binds ``cuda:(rank % device_count)`` (several ranks may share one GPU, as on a
one-GPU test machine), and every collective goes through the communicator's GPU path
(ddl_triton/runtime/calls/gpu_path.py): the executor queueing chunk steps on the stream, the
compiled Triton reductions, and the transport ``DDL_TRANSPORT`` selects (``mpi``: host-staged
MPI, transports/mpi_device.py; ``nvshmem``: symmetric memory, transports/nvshmem.py).

What it checks, exactly (integer-valued data, so every reduction order gives one answer):
- allreduce for every registered schedule, with small chunks (many pipelined steps, every slot
  reused), sizes 0, 1, primes and sizes not divisible by the ranks or the chunk, every dtype and
  op pair covered; each result ``==`` the exact answer and bitwise identical on every rank;
- reduce_scatter, all_gather, broadcast from every root, all_to_all, an async allreduce;
- the compressed allreduces (int8 and 1-bit, with error feedback, two calls each): the compiled
  kernels' result is bitwise the torch reference kernels' on the same device (their promise),
  int8's also bitwise the CPU path's, and identical on every rank;
- DDP on the "ddl" backend with CUDA parameters: after two steps the gradients are bitwise the
  mean of the ranks' own gradients, and the parameters identical on every rank.
Then it times a few allreduce sizes (information only, printed as a table).

``--device cpu`` runs the same checks on CPU tensors, so this file's logic is exercised on a
machine without a GPU (tests/gpu/test_gpu_check.py). Prints one line
``cuda ranks: ..., K checks, F failures``; exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))                  # tests/, for support/
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))        # bench/, for gpu_check

from gpu_check import make_project_importable  # noqa: E402

make_project_importable()

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import ddl_triton as ddl  # noqa: E402
from ddl_triton import schedules  # noqa: E402
from ddl_triton.runtime.compression.compressed import allreduce_int8, allreduce_onebit  # noqa: E402
from support.checker import Checker  # noqa: E402
from support.report import print_line  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64]
SIZES = [0, 1, 7, 4099, (1 << 18) + 3]
CHUNK_BYTES = 1 << 16        # small chunks: a 1 MiB allreduce is 16+ pipelined steps per rank
TIMED_BYTES = [8, 4096, 1 << 20, 1 << 24]


def rank_data(count: int, rank: int, size: int, dtype: torch.dtype, op: str, device) -> torch.Tensor:
    """Small integers, distinct per rank and element; multiples of ``size`` for avg (exact means)."""
    base = (torch.arange(count, dtype=torch.int64) * 7 + 3 * rank) % 23 - 11
    if op == "avg":
        base = base * size
    return base.to(dtype).to(device)


def expected(count: int, size: int, dtype: torch.dtype, op: str, device) -> torch.Tensor:
    stack = torch.stack([rank_data(count, q, size, torch.int64, op, "cpu") for q in range(size)])
    r = {"sum": lambda: stack.sum(0), "avg": lambda: stack.sum(0) // size,
         "min": lambda: stack.min(0).values, "max": lambda: stack.max(0).values}[op]()
    return r.to(dtype).to(device)


def covering_cases():
    """Every (dtype, size) once, the op turning with the pair's position (every op meets every size)."""
    for j, dtype in enumerate(DTYPES):
        ops = ["sum", "avg", "min", "max"] if dtype.is_floating_point else ["sum", "min", "max"]
        for i, count in enumerate(SIZES):
            yield dtype, ops[(i + j) % len(ops)], count


def identical(ck: Checker, what: str, t: torch.Tensor) -> None:
    ck.identical(what, t.detach().cpu())


def check_schedules(ck: Checker, world, device) -> None:
    for name in schedules.names():
        comm = ddl.init(world.Dup(), schedule=name, chunk_bytes=CHUNK_BYTES)
        n, r = comm.size, comm.rank
        for dtype, op, count in covering_cases():
            t = rank_data(count, r, n, dtype, op, device)
            comm.allreduce(t, op=op)
            what = f"{name} allreduce {op} {dtype} n={count}"
            ck.equal(what, t.cpu(), expected(count, n, dtype, op, "cpu"))
            ck.true(what, t.device == torch.device(device) or t.device.type == device, f"moved to {t.device}")
            identical(ck, what, t)
        comm.close()


def check_other_collectives(ck: Checker, comm, device) -> None:
    n, r = comm.size, comm.rank
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for m in (0, 1, 13, 4099):
            inp = rank_data(n * m, r, n, dtype, "sum", device)
            out = torch.full((m,), 99, dtype=dtype, device=device)
            comm.reduce_scatter(out, inp, op="sum")
            full = expected(n * m, n, dtype, "sum", "cpu")
            ck.equal(f"reduce_scatter {dtype} m={m}", out.cpu(), full[r * m:(r + 1) * m])
            inp = rank_data(m, r, n, dtype, "sum", device)
            out = torch.full((n * m,), 99, dtype=dtype, device=device)
            comm.all_gather(out, inp)
            want = torch.cat([rank_data(m, q, n, dtype, "sum", "cpu") for q in range(n)])
            ck.equal(f"all_gather {dtype} m={m}", out.cpu(), want)
            identical(ck, f"all_gather {dtype} m={m}", out)
            inp = (torch.arange(n * m) + 1000 * r).to(dtype).to(device)
            out = torch.full((n * m,), 99, dtype=dtype, device=device)
            comm.all_to_all(out, inp)
            want = torch.cat([torch.arange(r * m, (r + 1) * m) + 1000 * q for q in range(n)]).to(dtype)
            ck.equal(f"all_to_all {dtype} m={m}", out.cpu(), want)
            for root in range(n):
                t = rank_data(m, r, n, dtype, "sum", device) if r == root else \
                    torch.full((m,), 77, dtype=dtype, device=device)
                comm.broadcast(t, root=root)
                ck.equal(f"broadcast root={root} {dtype} m={m}", t.cpu(), rank_data(m, root, n, dtype, "sum", "cpu"))
    t = rank_data(100_003, r, n, torch.float32, "sum", device)
    work = comm.allreduce(t, async_op=True)
    work.wait()
    ck.equal("async allreduce n=100003", t.cpu(), expected(100_003, n, torch.float32, "sum", "cpu"))


def check_compressed(ck: Checker, comm, device) -> None:
    """The compressed allreduces over two calls (the residual carries): on ``device`` with the
    compiled kernels, bitwise the same allreduce with the torch reference kernels on the same
    device (the kernels' promise), and for int8 also bitwise the CPU path's (its scale is an IEEE
    division and its sums run in rank order on every backend; the 1-bit scale is a torch
    reduction, whose order differs between CPU and GPU, so 1-bit is compared on one device)."""
    import ddl_triton.kernels as K
    n, r = comm.size, comm.rank
    on_gpu = device != "cpu"
    for count in (1, 255, 4099, (1 << 18) + 5):
        g = torch.Generator().manual_seed(100 + 17 * r + count)
        steps = [torch.randn(count, generator=g) for _ in range(2)]
        for kind, fn in (("int8", allreduce_int8), ("onebit", allreduce_onebit)):
            refs = {"torch kernels": device} if on_gpu else {}
            if kind == "int8" or not on_gpu:
                refs["the CPU path"] = "cpu"
            residual = torch.zeros(count, device=device)
            ref_residuals = {name: torch.zeros(count, device=where) for name, where in refs.items()}
            for k, x in enumerate(steps):
                what = f"allreduce_{kind} n={count} call {k}"
                mine = x.to(device, copy=True)
                fn(comm, mine, op="avg", residual=residual)
                identical(ck, what, mine)
                for name, where in refs.items():
                    other = x.to(where, copy=True)
                    K.set_backend("torch" if name == "torch kernels" else "auto")
                    try:
                        fn(comm, other, op="avg", residual=ref_residuals[name])
                    finally:
                        K.set_backend("auto")
                    ck.true(f"{what} vs {name}", torch.equal(mine.cpu().view(torch.int32), other.cpu().view(torch.int32)),
                            f"differs from {name} in {int((mine.cpu() != other.cpu()).sum())} of {count} elements")
                    ck.true(f"{what} residual vs {name}", torch.equal(residual.cpu(), ref_residuals[name].cpu()),
                            f"residual differs from {name}'s")


def check_ddp(ck: Checker, device, rank: int, size: int) -> None:
    """Two DDP steps on the "ddl" backend: gradients bitwise the mean of the ranks' own."""
    import torch.distributed as dist
    import ddl_triton.torch  # noqa: F401 - registers "ddl"
    dist.init_process_group("ddl")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
    plain.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
    for step in range(2):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 64, generator=g).to(device)
        ddp.zero_grad()
        plain.zero_grad()
        ddp(x).square().mean().backward()
        plain(x).square().mean().backward()
        for i, (p, q) in enumerate(zip(model.parameters(), plain.parameters())):
            own = q.grad.detach().cpu().contiguous()
            every = torch.empty((size,) + tuple(own.shape))
            MPI.COMM_WORLD.Allgather(own.numpy(), every.numpy())
            # DDP divides each gradient by the world size, then sums: for 2 ranks a/2 + b/2 == (a + b)/2
            # exactly; in general sum_q (g_q / n) in rank order, as a one-shot sum does.
            want = torch.zeros_like(own)
            for q in range(size):
                want = want + every[q] / size
            what = f"ddp step {step} grad {i}"
            ck.true(what, torch.allclose(p.grad.cpu(), want, rtol=0, atol=0) if size <= 2 else
                    torch.allclose(p.grad.cpu(), want, rtol=1e-6, atol=1e-7),
                    f"max |diff| {float((p.grad.cpu() - want).abs().max()):.3g}")
            identical(ck, what, p.grad)
        with torch.no_grad():
            for p, q in zip(model.parameters(), plain.parameters()):
                p -= 0.1 * p.grad
                q.copy_(p)
    for i, p in enumerate(model.parameters()):
        identical(ck, f"ddp params {i}", p.data)
    dist.destroy_process_group()


def time_allreduce(comm, device) -> list[tuple[int, float]]:
    rows = []
    for nbytes in TIMED_BYTES:
        t = torch.ones(nbytes // 4, device=device)
        for _ in range(3):
            comm.allreduce(t)
        times = []
        for _ in range(10):
            comm.barrier()
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            comm.allreduce(t)
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rows.append((nbytes, statistics.median(times) * 1e6))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--no-ddp", action="store_true", help="skip the DDP check")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    device = args.device
    if device == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        device = f"cuda:{index}"
    ck = Checker(world)
    comm = None
    timings: list = []

    def body() -> None:
        nonlocal comm, timings
        comm = ddl.init()
        stage = os.environ.get("CUDA_RANKS_STAGES", "schedules,others,compressed,ddp,timing").split(",")
        if "schedules" in stage:
            check_schedules(ck, world, device)
        if "others" in stage:
            check_other_collectives(ck, comm, device)
        if "compressed" in stage:
            check_compressed(ck, comm, device)
        if "timing" in stage:
            timings = time_allreduce(comm, device)
        if "ddp" in stage and not args.no_ddp:
            check_ddp(ck, device, rank, size)

    ck.run(body)
    transport = os.environ.get("DDL_TRANSPORT", "auto")
    gpu = getattr(comm, "_gpu", None)
    path = gpu.intra_node if gpu is not None else "-"
    if rank == 0:
        print_line(f"allreduce on {device} x {size} ranks, DDL_TRANSPORT={transport}, intra-node: {path or '-'}"
                   + (f" ({gpu.why})" if gpu is not None and gpu.why else ""))
        for nbytes, us in timings:
            print_line(f"  {nbytes:>10} B  {us:10.1f} us  {nbytes / us / 1e3:8.3f} GB/s algbw")
        if path == "nvshmem":
            import nvshmem.core  # noqa: PLC0415 - only where the path uses it
            print_line(f"NVSHMEM init status: {nvshmem.core.init_status()}")
    status = ck.report(f"cuda ranks: {size} ranks on {device}, DDL_TRANSPORT={transport}")
    ddl.finalize()
    return status


if __name__ == "__main__":
    sys.exit(main())
