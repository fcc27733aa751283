"""Bandwidth of the ddl_triton kernels against the equivalent plain torch ops.

GB/s = (bytes the operation must read + write) / median time; p20/p50/p80 of repeated runs.
Sizes are those of the fp32 input (1 MiB .. 64 MiB). Each kernel runs through its public
launcher, so on a CPU it takes the torch fast path (the Triton kernels only run there under the
interpreter, ~100x slower: ``--backend triton`` measures that, at small sizes only), and on a
GPU the Triton kernel. "torch ops" is what one would write without this package: a torch.add
chain, abs/amax/div/round for int8 (and int4, with a shift/or packing two values a byte), torch.cat,
a where/sum for the sign bits.

The cases come in sections, which ``--sections`` selects: reduce, int8 (quantize, dequantize,
reduce_int8), int4 (quantize_int4, dequantize_int4, reduce_int4), onebit (sign_compress,
sign_decompress), pack (pack, unpack) and copy (a clone at each size, the CPU's stand-in for a
roofline). Every time comes from ddl_triton/kernels/bandwidth.py, the
measurement bench/gpu_check.py uses too: CUDA events on a GPU (L2 flushed before each call),
time.perf_counter on a CPU, ours and the torch ops alternating call by call. On a GPU the script
also measures device copy bandwidth (clone of a 1 GiB tensor) as the roofline.

It ends with the payload bytes of a 1M-element fp32 tensor compressed to int8 (q + scales), int4
(packed values + scales) and onebit (bits + scale), and checks the ratios (>= 3.9x, >= 7.7x, >= 25x);
the exit status is 1 if not.

    python bench/kernels.py --quick                 # about a minute on 2 CPU cores
    python bench/kernels.py --quick --sections int8 onebit
    python bench/kernels.py --sizes 1 --sections int8 int4   # the int4 column beside int8's
    python bench/kernels.py --json bench/results/kernels.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import ddl_triton.kernels as K  # noqa: E402
from ddl_triton.kernels import int4 as K4  # noqa: E402
from ddl_triton.kernels.bandwidth import CLOCKS, measure  # noqa: E402

MIB = 1 << 20
BLOCK = 256  # int8 block
SECTIONS = ("reduce", "int8", "int4", "onebit", "pack", "copy")


def quantize_int8_torch_ops(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 block quantization written with plain torch ops: the comparison for quantize_int8."""
    xb = x.view(-1, block)
    sc = xb.abs().amax(dim=1, keepdim=True) / 127
    return torch.round(xb / sc).to(torch.int8), sc


def quantize_int4_torch_ops(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 block quantization and packing written with plain torch ops: the comparison for quantize_int4."""
    xb = x.view(-1, block)
    sc = xb.abs().amax(dim=1, keepdim=True) / 7
    nib = (torch.round(xb / sc) + 8).to(torch.uint8).view(-1)
    return nib[0::2] | (nib[1::2] << 4), sc


def cases(n: int, device: torch.device) -> list[tuple[str, str, int, Callable[[], object], Callable[[], object]]]:
    """(section, name, bytes moved, our launcher, the plain torch ops) for n fp32 elements."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, generator=g).to(device)
    ys = [torch.randn(n, generator=g).to(device) for _ in range(3)]
    out = torch.empty(n, device=device)
    nb = (n + BLOCK - 1) // BLOCK
    q, s = K.quantize_int8(x, block=BLOCK)
    q2, s2 = K.quantize_int8(ys[0], block=BLOCK)
    p4, s4 = K4.quantize_int4(x, block=BLOCK)
    p4b, s4b = K4.quantize_int4(ys[0], block=BLOCK)
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

    def unpack4(p):
        return torch.stack((p & 15, p >> 4), dim=1).view(-1, BLOCK).float() - 8

    def dequant4_ops():
        return (unpack4(p4) * s4[:, None]).view(-1)

    def reduce_int4_ops():
        acc = unpack4(p4) * s4[:, None] + unpack4(p4b) * s4b[:, None]
        return quantize_int4_torch_ops(acc.view(-1), BLOCK)

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
        ("reduce", "reduce sum k=4 scale", 5 * 4 * n, reduce4, add_chain),
        ("int8", "quantize_int8", 4 * n + n + 4 * nb, lambda: K.quantize_int8(x, block=BLOCK),
         lambda: quantize_int8_torch_ops(x, BLOCK)),
        ("int8", "dequantize_int8", n + 4 * nb + 4 * n, lambda: K.dequantize_int8(q, s, out=out, block=BLOCK),
         dequant_ops),
        ("int8", "reduce_int8 k=2", 3 * (n + 4 * nb), lambda: K.reduce_int8([q, q2], [s, s2], block=BLOCK),
         reduce_int8_ops),
        ("int4", "quantize_int4", 4 * n + n // 2 + 4 * nb, lambda: K4.quantize_int4(x, block=BLOCK),
         lambda: quantize_int4_torch_ops(x, BLOCK)),
        ("int4", "dequantize_int4", n // 2 + 4 * nb + 4 * n,
         lambda: K4.dequantize_int4(p4, s4, out=out, block=BLOCK), dequant4_ops),
        ("int4", "reduce_int4 k=2", 3 * (n // 2 + 4 * nb),
         lambda: K4.reduce_int4([p4, p4b], [s4, s4b], numel=n, block=BLOCK), reduce_int4_ops),
        ("onebit", "sign_compress", 3 * 4 * n + n // 8, lambda: K.sign_compress(x, residual), sign_ops),
        ("onebit", "sign_decompress", n // 8 + 4 * n, lambda: K.sign_decompress(bits, scale, n, out=out),
         sign_decompress_ops),
        ("pack", "pack 48 tensors", 2 * 4 * n, lambda: K.pack(parts, out=flat), lambda: torch.cat(parts)),
        ("pack", "unpack 48 tensors", 2 * 4 * n, lambda: K.unpack(flat, parts), unpack_ops),
        ("copy", "copy (clone)", 2 * 4 * n, lambda: x.clone(), lambda: x.clone()),
    ]


def payload(n: int = 1 << 20) -> dict:
    x = torch.randn(n)
    q, s = K.quantize_int8_reference(x, block=BLOCK)
    p4, s4 = K4.quantize_int4_reference(x, block=BLOCK)
    bits, scale = K.sign_compress_reference(x, torch.zeros(n))
    fp32 = 4 * n
    int8 = q.numel() * q.element_size() + s.numel() * s.element_size()
    int4 = p4.numel() * p4.element_size() + s4.numel() * s4.element_size()
    onebit = bits.numel() * bits.element_size() + scale.numel() * scale.element_size()
    return {"n": n, "fp32_bytes": fp32, "int8_bytes": int8, "int8_ratio": fp32 / int8,
            "int4_bytes": int4, "int4_ratio": fp32 / int4, "onebit_bytes": onebit, "onebit_ratio": fp32 / onebit,
            "int8_ok": fp32 / int8 >= 3.9, "int4_ok": fp32 / int4 >= 7.7, "onebit_ok": fp32 / onebit >= 25}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="sizes 1, 8, 64 MiB and fewer repetitions")
    ap.add_argument("--sizes", type=float, nargs="*", help="input sizes in MiB (default 1 4 16 64)")
    ap.add_argument("--reps", type=int, help="timed calls per case, at least (default 25, 9 with --quick)")
    ap.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="which cases to time (default: all)")
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
    name = torch.cuda.get_device_name() if cuda else f"{platform.processor() or platform.machine()} " \
                                                    f"({torch.get_num_threads()} torch threads)"
    print(f"device: {name}; backend {K.get_backend()}; torch {torch.__version__}; timer "
          f"{CLOCKS[device.type]}; reps {reps}")

    results = []
    roofline = None
    if cuda:
        big = torch.empty(1 << 28, device=device)  # 1 GiB of fp32
        (copy,) = measure([lambda: big.clone()], 2 * big.numel() * 4, device=device, min_calls=reps,
                          min_seconds=min_seconds)
        roofline = copy.gbps
        del big
        print(f"device copy bandwidth (clone of 1 GiB): {roofline:.1f} GB/s")

    header = (f"{'section':<7} {'kernel':<20} {'MiB':>5} {'ours GB/s':>10} {'torch GB/s':>11} {'ours/torch':>10}"
              "   ours p20/p50/p80 ms")
    print(header)
    print("-" * len(header))
    for mib in sizes:
        n = int(mib * MIB) // 4 // 256 * 256  # whole int8 blocks, whole sign bytes
        for section, kernel, nbytes, ours, ops in cases(n, device):
            if section not in args.sections:
                continue
            t_ours, t_ops = measure([ours, ops], nbytes, device=device, min_calls=reps, min_seconds=min_seconds)
            print(f"{section:<7} {kernel:<20} {mib:>5g} {t_ours.gbps:>10.2f} {t_ops.gbps:>11.2f} "
                  f"{t_ours.gbps / t_ops.gbps:>10.2f}   {t_ours.p20_ms:.3f}/{t_ours.p50_ms:.3f}/{t_ours.p80_ms:.3f}")
            for impl, t in (("ours", t_ours), ("torch_ops", t_ops)):
                results.append({"section": section, "kernel": kernel, "impl": impl, "size_mib": mib, "n": n,
                                "bytes": nbytes, "p20_ms": t.p20_ms, "p50_ms": t.p50_ms, "p80_ms": t.p80_ms,
                                "calls": t.calls, "gbps": t.gbps,
                                "fraction_of_copy": t.gbps / roofline if roofline else None})

    pl = payload()
    print(f"\npayload of {pl['n']} fp32 elements ({pl['fp32_bytes']} bytes):")
    print(f"  int8 (q + scales, block {BLOCK}): {pl['int8_bytes']:>8} bytes  {pl['int8_ratio']:6.2f}x  "
          f"(>= 3.9x: {'ok' if pl['int8_ok'] else 'FAIL'})")
    print(f"  int4 (q/2 + scales, block {BLOCK}): {pl['int4_bytes']:>7} bytes  {pl['int4_ratio']:6.2f}x  "
          f"(>= 7.7x: {'ok' if pl['int4_ok'] else 'FAIL'})")
    print(f"  onebit (bits + scale):         {pl['onebit_bytes']:>8} bytes  {pl['onebit_ratio']:6.2f}x  "
          f"(>= 25x: {'ok' if pl['onebit_ok'] else 'FAIL'})")

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        doc = {"device": name, "cuda": cuda, "backend": K.get_backend(), "torch": torch.__version__,
               "timer": CLOCKS[device.type], "quick": args.quick, "reps": reps, "sections": args.sections,
               "copy_gbps_1gib": roofline, "results": results, "payload": pl}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if pl["int8_ok"] and pl["int4_ok"] and pl["onebit_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
