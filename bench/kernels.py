"""Bandwidth of the ddl_triton kernels against the equivalent plain torch ops.

GB/s = (bytes the operation must read + write) / median time; p20/p50/p80 of repeated runs.
Sizes are those of the fp32 input (1 MiB .. 64 MiB). Each kernel runs through its public
launcher, so on a CPU it takes the torch fast path (the Triton kernels only run there under the
interpreter, ~100x slower: ``--backend triton`` measures that, at small sizes only), and on a
GPU the Triton kernel. "torch ops" is what one would write without this package: a torch.add
chain, abs/amax/div/round for int8, torch.cat, a where/sum for the sign bits.

On a GPU the script also measures device copy bandwidth (clone of a 1 GiB tensor) as the
roofline and times with triton.testing.do_bench; on a CPU with time.perf_counter loops (do_bench
needs a GPU), and a CPU clone at each size stands in for the roofline.

It ends with the payload bytes of a 1M-element fp32 tensor compressed to int8 (q + scales) and
1-bit (bits + scale), and checks the ratios (>= 3.9x, >= 25x); the exit status is 1 if not.

    python bench/kernels.py --quick                 # about a minute on 2 CPU cores
    python bench/kernels.py --json bench/results/kernels.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import ddl_triton.kernels as K  # noqa: E402

MIB = 1 << 20
BLOCK = 256  # int8 block


def _percentiles(samples_ms: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(samples_ms, n=10, method="inclusive") if len(samples_ms) > 1 else samples_ms * 9
    return q[1], statistics.median(samples_ms), q[7]


def time_cpu(fns: list[Callable[[], object]], reps: int, min_seconds: float) -> list[tuple[float, float, float]]:
    """p20/p50/p80 in ms of single calls of each fn, after one warm-up call each.

    The fns alternate call by call, so a burst of load from elsewhere on the machine (common on
    a shared 2-core box) lands on both sides of a comparison rather than on one.
    """
    for fn in fns:
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while len(samples[0]) < reps or (time.perf_counter() - start < min_seconds and len(samples[0]) < 10 * reps):
        for fn, acc in zip(fns, samples):
            t0 = time.perf_counter()
            fn()
            acc.append((time.perf_counter() - t0) * 1e3)
    return [_percentiles(acc) for acc in samples]


def time_gpu(fns: list[Callable[[], object]], reps: int, min_seconds: float) -> list[tuple[float, float, float]]:
    import triton.testing
    return [tuple(triton.testing.do_bench(fn, warmup=25, rep=max(100, int(min_seconds * 1e3)),
                                          quantiles=[0.2, 0.5, 0.8])) for fn in fns]


def quantize_int8_torch_ops(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 block quantization written with plain torch ops: the comparison for quantize_int8."""
    xb = x.view(-1, block)
    sc = xb.abs().amax(dim=1, keepdim=True) / 127
    return torch.round(xb / sc).to(torch.int8), sc


def cases(n: int, device: torch.device) -> list[tuple[str, int, Callable[[], object], Callable[[], object]]]:
    """(name, bytes moved, our launcher, the plain torch ops) for n fp32 elements."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, generator=g).to(device)
    ys = [torch.randn(n, generator=g).to(device) for _ in range(3)]
    out = torch.empty(n, device=device)
    nb = (n + BLOCK - 1) // BLOCK
    q, s = K.quantize_int8(x, block=BLOCK)
    q2, s2 = K.quantize_int8(ys[0], block=BLOCK)
    residual = torch.zeros(n, device=device)
    residual_b = torch.zeros(n, device=device)
    bits, scale = K.sign_compress(x, residual.clone())
    weights = (1 << torch.arange(8, device=device)).to(torch.uint8)
    # A DDP-like bucket: 48 tensors of mixed sizes totalling n.
    sizes = [max(1, n // 96)] * 32 + [n // 32] * 15
    sizes.append(n - sum(sizes))
    parts = [torch.randn(m, generator=g).to(device) for m in sizes]
    flat = torch.empty(n, device=device)

    def reduce4():
        K.reduce(out, [x] + ys, op="sum", scale=0.25)

    def add_chain():
        torch.add(x, ys[0], out=out)
        for y in ys[1:]:
            out.add_(y)
        out.mul_(0.25)

    def dequant_ops():
        return (q.view(-1, BLOCK).float() * s[:, None]).view(-1)

    def reduce_int8_ops():
        acc = q.view(-1, BLOCK).float() * s[:, None] + q2.view(-1, BLOCK).float() * s2[:, None]
        sc = acc.abs().amax(dim=1, keepdim=True) / 127
        return torch.round(acc / sc).to(torch.int8), sc

    def sign_ops():
        v = x + residual_b
        sc = v.abs().mean()
        pos = v >= 0
        torch.sub(v, torch.where(pos, sc, -sc), out=residual_b)
        return (pos.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8), sc

    def sign_decompress_ops():
        b = (bits[:, None] & weights) != 0
        return torch.where(b.view(-1), scale, -scale)

    def unpack_ops():
        for p, c in zip(parts, flat.split(sizes)):
            p.copy_(c)

    return [
        ("reduce sum k=4 scale", 5 * 4 * n, reduce4, add_chain),
        ("quantize_int8", 4 * n + n + 4 * nb, lambda: K.quantize_int8(x, block=BLOCK),
         lambda: quantize_int8_torch_ops(x, BLOCK)),
        ("dequantize_int8", n + 4 * nb + 4 * n, lambda: K.dequantize_int8(q, s, out=out, block=BLOCK), dequant_ops),
        ("reduce_int8 k=2", 3 * (n + 4 * nb), lambda: K.reduce_int8([q, q2], [s, s2], block=BLOCK), reduce_int8_ops),
        ("sign_compress", 3 * 4 * n + n // 8, lambda: K.sign_compress(x, residual), sign_ops),
        ("sign_decompress", n // 8 + 4 * n, lambda: K.sign_decompress(bits, scale, n, out=out), sign_decompress_ops),
        ("pack 48 tensors", 2 * 4 * n, lambda: K.pack(parts, out=flat), lambda: torch.cat(parts)),
        ("unpack 48 tensors", 2 * 4 * n, lambda: K.unpack(flat, parts), unpack_ops),
        ("copy (clone)", 2 * 4 * n, lambda: x.clone(), lambda: x.clone()),
    ]


def payload(n: int = 1 << 20) -> dict:
    x = torch.randn(n)
    q, s = K.quantize_int8_reference(x, block=BLOCK)
    bits, scale = K.sign_compress_reference(x, torch.zeros(n))
    fp32 = 4 * n
    int8 = q.numel() * q.element_size() + s.numel() * s.element_size()
    sign = bits.numel() * bits.element_size() + scale.numel() * scale.element_size()
    return {"n": n, "fp32_bytes": fp32, "int8_bytes": int8, "int8_ratio": fp32 / int8,
            "sign_bytes": sign, "sign_ratio": fp32 / sign,
            "int8_ok": fp32 / int8 >= 3.9, "sign_ok": fp32 / sign >= 25}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="sizes 1, 8, 64 MiB and fewer repetitions")
    ap.add_argument("--sizes", type=float, nargs="*", help="input sizes in MiB (default 1 4 16 64)")
    ap.add_argument("--reps", type=int, help="timed calls per case (default 25, 9 with --quick)")
    ap.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    args = ap.parse_args()

    K.set_backend(args.backend)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if args.backend == "triton" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--backend triton on a CPU needs TRITON_INTERPRET=1")
    sizes = args.sizes or ([1, 8, 64] if args.quick else [1, 4, 16, 64])
    reps = args.reps or (9 if args.quick else 25)
    min_seconds = 0.1 if args.quick else 0.5
    timer = time_gpu if cuda else time_cpu
    name = torch.cuda.get_device_name() if cuda else f"{platform.processor() or platform.machine()} " \
                                                    f"({torch.get_num_threads()} torch threads)"
    print(f"device: {name}; backend {K.get_backend()}; torch {torch.__version__}; timer "
          f"{'triton.testing.do_bench' if cuda else 'time.perf_counter'}; reps {reps}")

    results = []
    roofline = None
    if cuda:
        big = torch.empty(1 << 28, device=device)  # 1 GiB of fp32
        ((_, p50, _),) = timer([lambda: big.clone()], reps, min_seconds)
        roofline = 2 * big.numel() * 4 / (p50 * 1e-3) / 1e9
        del big
        print(f"device copy bandwidth (clone of 1 GiB): {roofline:.1f} GB/s")

    header = f"{'kernel':<20} {'MiB':>5} {'ours GB/s':>10} {'torch GB/s':>11} {'ours/torch':>10}   ours p20/p50/p80 ms"
    print(header)
    print("-" * len(header))
    for mib in sizes:
        n = int(mib * MIB) // 4 // 256 * 256  # whole int8 blocks, whole sign bytes
        for kernel, nbytes, ours, ops in cases(n, device):
            t_ours, t_ops = timer([ours, ops], reps, min_seconds)
            g_ours = nbytes / (t_ours[1] * 1e-3) / 1e9
            g_ops = nbytes / (t_ops[1] * 1e-3) / 1e9
            print(f"{kernel:<20} {mib:>5g} {g_ours:>10.2f} {g_ops:>11.2f} {g_ours / g_ops:>10.2f}   "
                  f"{t_ours[0]:.3f}/{t_ours[1]:.3f}/{t_ours[2]:.3f}")
            for impl, t, gb in (("ours", t_ours, g_ours), ("torch_ops", t_ops, g_ops)):
                results.append({"kernel": kernel, "impl": impl, "size_mib": mib, "n": n, "bytes": nbytes,
                                "p20_ms": t[0], "p50_ms": t[1], "p80_ms": t[2], "gbps": gb,
                                "fraction_of_copy": gb / roofline if roofline else None})

    pl = payload()
    print(f"\npayload of {pl['n']} fp32 elements ({pl['fp32_bytes']} bytes):")
    print(f"  int8 (q + scales, block {BLOCK}): {pl['int8_bytes']:>8} bytes  {pl['int8_ratio']:6.2f}x  "
          f"(>= 3.9x: {'ok' if pl['int8_ok'] else 'FAIL'})")
    print(f"  1-bit (bits + scale):          {pl['sign_bytes']:>8} bytes  {pl['sign_ratio']:6.2f}x  "
          f"(>= 25x: {'ok' if pl['sign_ok'] else 'FAIL'})")

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        doc = {"device": name, "cuda": cuda, "backend": K.get_backend(), "torch": torch.__version__,
               "quick": args.quick, "reps": reps, "copy_gbps_1gib": roofline, "results": results, "payload": pl}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if pl["int8_ok"] and pl["sign_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
