"""The int4 compressed allreduce on real ranks (tests/multirank/test_int4_across_ranks.py), run under
mpiexec on 2, 3 or 4 ranks:

1. every rank ends with the same bits, for sizes 0, 1, primes and sizes no block, chunk or world
   size divides, in fp32, fp16 and bf16, "avg" and "sum";
2. exact where the inputs are representable: each block on each rank is k * m_p (the same
   k, max |k| = 7, an integer m_p per rank and block), so the compressed sum is the exact sum
   (and "avg" the exact mean on 2 and 4 ranks, where 1/n is a power of two);
3. elsewhere (fp32) within the row's bound, (mean_p s_w,p + s_r)(1/2 + 2**-16) for "avg" and
   (sum_p s_w,p + s_r)(1/2 + 2**-16) for "sum", s_r = 0 on 2 ranks;
4. error feedback over 20 calls with both residuals: sum_t y_t == sum_t mean_t - mean_p(residual_p)
   - server residual, up to fp32 rounding (all ranks' residuals gathered by rank 0's check);
5. bad input (a residual of the wrong size, a float64 tensor) refused on every rank, naming it.

Prints "int4_worker: N ranks, M checks, 0 failures" on rank 0.
"""
from __future__ import annotations

import sys

import torch
from mpi4py import MPI

import ddl_triton as ddl
from ddl_triton import compression_methods as cm
from ddl_triton.kernels.int4 import quantize_int4_reference
from ddl_triton.runtime.compression import compressed
from ddl_triton.runtime.compression.int4 import allreduce_int4
from support.checker import Checker

SLACK = 0.5 + 2.0 ** -16
BLOCK = 64


def _rank_input(n: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-2, 3, (n,), generator=g))


def _every_rank(x: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Every rank's copy of x (fp64 buffers through mpi4py's buffer method, no pickling)."""
    out = torch.empty(size * x.numel(), dtype=torch.float64)
    MPI.COMM_WORLD.Allgather(x.double().contiguous().numpy(), out.numpy())
    return list(out.view(size, -1))


def _scales(v: torch.Tensor) -> torch.Tensor:
    return quantize_int4_reference(v.float(), block=BLOCK)[1].double().repeat_interleave(BLOCK)[: v.numel()]


def check_results(ck: Checker, comm) -> None:
    size, rank = comm.size, comm.rank
    for n in (0, 1, 13, 1003, 4099):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for op in ("avg", "sum"):
                x = _rank_input(n, rank, n).to(dtype)
                y = cm.get("int4").run(comm, x.clone(), op=op, block=BLOCK)
                what = f"n={n} {dtype} {op}"
                ck.identical(f"{what}: identical on every rank", y)
                if dtype != torch.float32 or n == 0:
                    continue
                xs = _every_rank(x, size)
                want = torch.stack(xs).sum(0) / (size if op == "avg" else 1)
                worker_scales = torch.stack([_scales(v) for v in xs])  # "sum": each rank's error adds up
                s_w = worker_scales.sum(0) if op == "sum" else worker_scales.mean(0)
                s_r = 0.0 if size == 2 else _scales(y) * (1 + 2.0 ** -20)
                err = (y.double() - want).abs()
                bound = (s_w + s_r) * SLACK
                ck.true(f"{what}: within the bound", bool((err <= bound).all()),
                        f"max excess {(err - bound).max().item():.3e}")


def check_exact(ck: Checker, comm) -> None:
    size, rank = comm.size, comm.rank
    for n, block in ((1, 8), (13, 8), (1003, 8), (4099, 64)):
        k = torch.tensor([7, -3, 0, 1, -7, 5, 2, -1], dtype=torch.float64).repeat(n // 8 + 1)[:n]
        ms = [torch.randint(1, 1000, (-(-n // block),), generator=torch.Generator().manual_seed(7 * p + n))
              .double().repeat_interleave(block)[:n] for p in range(size)]
        for op in ("sum", "avg"):
            if op == "avg" and size not in (2, 4):
                continue
            y = allreduce_int4(comm, (k * ms[rank]).float(), op=op, block=block)
            want = (k * sum(ms) / (size if op == "avg" else 1)).float()
            ck.equal(f"n={n} block={block} {op}: representable inputs come back exact", y, want)


def check_error_feedback(ck: Checker, comm) -> None:
    size, rank = comm.size, comm.rank
    n, block = 1003, 8
    a, b = compressed.chunk_bounds(n, size, 8)[rank]
    worker, server = torch.zeros(n), torch.zeros(b - a)
    total_y = torch.zeros(n, dtype=torch.float64)
    total_mean = torch.zeros(n, dtype=torch.float64)
    for t in range(20):
        x = _rank_input(n, rank, 50 + t).float()
        y = allreduce_int4(comm, x.clone(), op="avg", block=block, residual=worker, server_residual=server)
        total_y += y.double()
        total_mean += torch.stack(_every_rank(x, size)).mean(0)
    kept = torch.stack(_every_rank(worker, size)).mean(0)
    servers = _every_rank(torch.cat([server, torch.zeros(n - server.numel())]), size)
    if size > 2:  # two ranks have no server step: the server residual stays zero
        kept += torch.cat([servers[p][: q - p0] for p, (p0, q) in enumerate(compressed.chunk_bounds(n, size, 8))])
    gap = (total_y - total_mean + kept).abs().max().item()
    ck.true("error feedback: sum y == sum mean - residuals", gap < 1e-3, f"gap {gap:.3e}")
    ck.true("error feedback: the residuals hold something", worker.abs().sum().item() > 0)


def check_bad_input(ck: Checker, comm) -> None:
    ck.raises("a residual of the wrong size", ValueError,
              lambda: allreduce_int4(comm, torch.ones(10), residual=torch.zeros(9)),
              f"rank {comm.rank}: allreduce_int4: residual must be contiguous with 10 elements")
    ck.raises("a float64 tensor", TypeError, lambda: cm.get("int4").run(comm, torch.ones(4, dtype=torch.float64)),
              f"rank {comm.rank}: compression 'int4' takes float32, float16, bfloat16 tensors")


def main() -> int:
    torch.set_num_threads(1)
    comm = ddl.init()
    ck = Checker(MPI.COMM_WORLD)
    ck.run(lambda: (check_results(ck, comm), check_exact(ck, comm), check_error_feedback(ck, comm),
                    check_bad_input(ck, comm)))
    status = ck.report(f"int4_worker: {comm.size} ranks")
    ddl.finalize()
    return status


if __name__ == "__main__":
    sys.exit(main())
