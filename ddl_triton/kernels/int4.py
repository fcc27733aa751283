"""Blockwise 4-bit quantization of gradients, two values per byte: ``quantize_int4``,
``dequantize_int4`` (optionally accumulating), ``reduce_int4`` and ``quantize_int4_keep_error``
(error feedback's quantize-and-subtract). The int4 row of ddl_triton/compression_methods.py.

Per block of ``block`` consecutive elements of the flattened tensor (the last block may be short),
as int8.py's with 7 in place of 127:
    xf    = x as fp32 [* fp32(scale)]           # exact for fp16/bf16 inputs; scale: reduce_int4's 1/n
    s     = absmax(xf[block]) / 7               # fp32, IEEE-rounded division
    s     = 0 if s < 2**-126 else s             # such blocks (absmax < 2**-123) go to 0
    q     = clamp(rne(xf / s), -7, 7)           # rne: round half to even; q = 0 where s == 0
    dequant(q, s) = round_out(fp32(q * s))      # rounded once to the out dtype
Round to nearest, not stochastic rounding: the same input gives the same bits on every rank and
every device, which the allreduce needs (every rank decodes the same reduced chunk).
-8 is never produced, so the range is symmetric and negation is safe.

Packing: element 2k is byte k's low nibble, element 2k + 1 its high nibble, each stored as q + 8
(1..15; 8 is 0), so ``packed`` holds ceil(n/2) uint8 and an odd tensor's last high nibble is 8
(a padding 0). Seen as little-endian int32 words (the wire), a word holds 8 consecutive values.
Blocks hold an even number of elements (``block`` >= 2), so no byte spans two blocks.

Error bound, per element, for finite x (the tests enforce it), the same form as int8's:
    s > 0:  |fp32(q*s) - x| <= s * (1/2 + 2**-16)
    s = 0:  q = 0 and |x| < 2**-123
Proof (u = 2**-24): s = (absmax/7)(1+e), |e| <= u, so t = x/s has |t| <= 7/(1-u) and fp32(t)
rounds to at most 7: the clamp never binds. |fp32(t) - t| <= 8u, so |q - t| <= 1/2 + 8u and
|q*s - x| <= s(1/2 + 8u); fp32(q*s) adds at most 7u*s. 15u < 2**-16, which leaves room for the
allreduce's fp32 sums (compressed.py). Into a 16-bit out, add half an ulp of the out dtype.
A block whose values are all integer multiples k*m of one m with max |k| = 7 (as in
[7m, -3m, 0, 1m]) is exact: s = fp32(7m/7) = m, and q = k.

Worked example (block=4):
    x = tensor([7.0, -3.0, 1.0, 0.5,   0.1, 0.0, 0.0])
    packed, s = quantize_int4(x, block=4)
      s = [1.0, 0.1/7 = 0.014285714]
      q = [7, -3, 1, 0,   7, 0, 0]                # 0.5 ties to even: 0
      packed = [0xF | 0x5 << 4, 0x9 | 0x8 << 4, 0xF | 0x8 << 4, 0x8 | 0x8 << 4] = [95, 137, 143, 136]
    dequantize_int4(packed, s, numel=7, block=4)
      -> [7.0, -3.0, 1.0, 0.0,   0.1, 0.0, 0.0]    # the 0.5 is lost: within s/2

``reduce_int4`` is the two-shot server's step: fp32 sum of the dequantized inputs in list order
(each product and sum rounded to fp32, no fma), times fp32(scale), quantized again.

Each launcher's Triton kernel (_int4_jit.py: quantize-and-pack, unpack-and-dequantize with an
optional accumulate) and torch path produce bitwise-identical results: the same fp32 operations
in the same order, IEEE division (``div_rn``), no fma (``enable_fp_fusion=False``), bf16 stores
rounded by hand. The kernels launch one fixed tile (4096 elements, 8 warps): they are not in
launch_configs.py's autotuned table yet (no GPU measurement of them exists).

Payload per n elements: n/2 + 4*ceil(n/block) bytes (~7.76x smaller than fp32 at block 256).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from ._compression import OUT_DTYPES, QUANT_DTYPES, check_contiguous, compiled
from ._dispatch import use_triton
from ._lazy_kernels import LazyKernels, cdiv

_QMAX = 7.0  # symmetric range [-7, 7]
_MIN_NORMAL = 2.0 ** -126  # smallest normal fp32; smaller scales are flushed to 0
_MAX_QBLOCK = 1 << 16
_TILE = 4096      # elements per program (rounded up to whole blocks)
_NUM_WARPS = 8    # compiled launches only
# On a little-endian host a byte pair seen as one int16 holds element 2k in its low byte: the torch
# path packs and unpacks with contiguous int16 ops there (about 1.6x and 1.8x faster than strided
# uint8 ops on 256K elements, one thread), and with strided uint8 ops elsewhere. The same bytes.
_INT16_PAIRS = sys.byteorder == "little"

_KERNELS = LazyKernels(__name__, "._int4_jit", ["_quantize_pack_kernel", "_unpack_dequantize_kernel"])
__getattr__ = _KERNELS.module_getattr  # int4._quantize_pack_kernel etc.: loaded on first use


def _n_blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def _grid(n_blocks: int, block: int) -> tuple[int]:
    return (cdiv(n_blocks, max(1, _TILE // block)),)


def _compile_options(t: torch.Tensor) -> dict:
    # num_warps and fma contraction off (an fma of out + q*s rounds once where torch rounds twice);
    # the interpreter takes neither.
    return {"num_warps": _NUM_WARPS, "enable_fp_fusion": False} if compiled(t) else {}


# --------------------------------------------------------------------------------------------
# torch path (the CPU fast path, and the reference the kernels are tested against)
# --------------------------------------------------------------------------------------------

_QMAX_TENSORS: dict[torch.device, torch.Tensor] = {}


def _qmax_on(device: torch.device) -> torch.Tensor:
    """7.0 as a 0-dim fp32 tensor on ``device``: a tensor divisor, as int8.py explains (CUDA torch
    divides by a Python scalar as a multiplication by its reciprocal)."""
    t = _QMAX_TENSORS.get(device)
    if t is None:
        t = _QMAX_TENSORS[device] = torch.tensor(_QMAX, dtype=torch.float32, device=device)
    return t


def _quantize_rows(xb: torch.Tensor, qb: torch.Tensor, s: torch.Tensor) -> None:
    """Quantize the rows of fp32 ``xb`` (one block each) into fp32 ``qb`` (the values -7..7) and
    their scales into ``s``."""
    torch.div(torch.maximum(xb.amax(dim=1), xb.amin(dim=1).neg_()), _qmax_on(xb.device), out=s)
    s.masked_fill_(s < _MIN_NORMAL, 0.0)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    torch.div(xb, safe[:, None], out=qb)
    qb.round_().clamp_(-_QMAX, _QMAX)  # torch.round: half to even


def quantize_int4_reference(x: torch.Tensor, *, block: int = 256, scale: float | None = None,
                            out: tuple[torch.Tensor, torch.Tensor] | None = None,
                            _keep_error: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch-ops implementation of :func:`quantize_int4`; also the CPU fast path (and, with
    ``_keep_error``, :func:`quantize_int4_keep_error`'s: x fp32, overwritten with x - dequant)."""
    n = x.numel()
    packed, s = out if out is not None else _new_out(n, block, x.device)
    if n == 0:
        return packed, s
    flat = x.reshape(-1).to(torch.float32)
    if scale is not None:
        flat = flat * torch.tensor(float(scale), dtype=torch.float32, device=x.device)
    full = n // block * block
    q = torch.empty(n + (n & 1), dtype=torch.float32, device=x.device)  # the padding value of an odd tail: 0
    if n & 1:
        q[n] = 0.0
    if full:
        _quantize_rows(flat[:full].view(-1, block), q[:full].view(-1, block), s[: full // block])
    if full < n:
        _quantize_rows(flat[full:].view(1, -1), q[full:n].view(1, -1), s[full // block:])
    nibbles = q.add(8.0).to(torch.uint8)  # 1..15, and 8 for the padding
    if _INT16_PAIRS:
        pairs = nibbles.view(torch.int16)  # lo + 256*hi: (pairs >> 4) | pairs has lo | hi << 4 in its low byte
        packed.copy_(pairs.bitwise_right_shift(4).bitwise_or_(pairs))  # int16 -> uint8 keeps the low byte
    else:
        torch.bitwise_or(nibbles[0::2], nibbles[1::2].bitwise_left_shift(4), out=packed)
    if _keep_error:
        x.view(-1).sub_(_scaled(q[:n], s, block))
    return packed, s


def _scaled(q: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    """fp32(q * s[i // block]) for fp32 q (in place on q)."""
    n = q.numel()
    full = n // block * block
    if full:
        q[:full].view(-1, block).mul_(s[: full // block, None])
    if full < n:
        q[full:].mul_(s[-1])
    return q


def dequantize_int4_reference(packed: torch.Tensor, scales: torch.Tensor, *, numel: int | None = None,
                              out: torch.Tensor | None = None, block: int = 256,
                              accumulate: bool = False) -> torch.Tensor:
    """Torch-ops implementation of :func:`dequantize_int4`; also the CPU fast path."""
    n = out.numel() if out is not None else numel
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=packed.device)
    if n == 0:
        return out
    # nibble pairs side by side, then flat: element 2k low, 2k + 1 high
    if _INT16_PAIRS:
        pairs = packed.to(torch.int16)  # lo in the low byte, hi moved to the high one
        q = pairs.bitwise_and(15).bitwise_or_(pairs.bitwise_left_shift(4).bitwise_and_(0xF00)).view(torch.uint8)[:n]
    else:
        q = torch.stack((packed.bitwise_and(15), packed.bitwise_right_shift(4)), dim=1).view(-1)[:n]
    o = out.view(-1)
    if out.dtype == torch.float32 and not accumulate:  # straight into out: no temporary
        _scaled(o.copy_(q).sub_(8.0), scales, block)  # exact ints, one rounding per product
        return out
    d = _scaled(q.to(torch.float32).sub_(8.0), scales, block)
    if accumulate:
        o.add_(d)
    else:
        o.copy_(d)  # the one rounding to out's dtype
    return out


def reduce_int4_reference(packs: Sequence[torch.Tensor], scales_list: Sequence[torch.Tensor], *, numel: int,
                          block: int = 256, scale: float | None = None,
                          out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch-ops implementation of :func:`reduce_int4`; also the CPU fast path."""
    acc = dequantize_int4_reference(packs[0], scales_list[0], numel=numel, block=block)
    for p, s in zip(packs[1:], scales_list[1:]):
        dequantize_int4_reference(p, s, out=acc, block=block, accumulate=True)
    return quantize_int4_reference(acc, block=block, scale=scale, out=out)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------

def quantize_int4(x: torch.Tensor, *, block: int = 256, scale: float | None = None,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise symmetric 4-bit: returns ``(packed, scales)``, packed uint8 [ceil(n/2)] (two values a
    byte, module doc), scales fp32 [ceil(n/block)].

    x: contiguous fp16/bf16/fp32 of any shape, finite. ``block``: a power of two in [2, 65536].
    scale: multiply the fp32 values by fp32(scale) first (None: no multiplication).
    out: ``(packed, scales)`` to write instead of new tensors (contiguous, on x's device).
    Example: quantize_int4(tensor([7.0, -3.0, 1.0, 0.5]), block=4)
             -> (tensor([95, 137], dtype=uint8), tensor([1.0]))
    """
    _check_block("quantize_int4", block)
    if x.dtype not in QUANT_DTYPES:
        raise TypeError(f"quantize_int4: unsupported dtype {x.dtype}; valid: fp16, bf16, fp32")
    check_contiguous("quantize_int4", x=x)
    n = x.numel()
    if out is not None:
        _check_out("quantize_int4", out, n, block, x.device)
    if not use_triton(x):
        return quantize_int4_reference(x, block=block, scale=scale, out=out)
    packed, s = out if out is not None else _new_out(n, block, x.device)
    if n == 0:
        return packed, s
    nb = _n_blocks(n, block)
    scale_value = torch.full((1,), 1.0 if scale is None else float(scale), dtype=torch.float32, device=x.device)
    _KERNELS["_quantize_pack_kernel"][_grid(nb, block)](
        x, packed, s, scale_value, n, nb, HAS_SCALE=scale is not None, QBLOCK=block, TILE=_TILE,
        **_compile_options(x))
    return packed, s


def quantize_int4_keep_error(v: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor],
                             block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Error feedback's step: ``quantize_int4(v, out=out)``, then ``v -= dequantize_int4(...)``, so that
    ``v`` keeps what the quantization lost (sent with the next call). Returns out.

    v: contiguous fp32, overwritten. The same bits as the two calls.
    Example (block=4): v = [7.0, -3.0, 1.0, 0.5] -> q = [7, -3, 1, 0], s = [1.0], v = [0.0, 0.0, 0.0, 0.5]
    """
    _check_block("quantize_int4_keep_error", block)
    if v.dtype != torch.float32:
        raise TypeError(f"quantize_int4_keep_error: v must be fp32 (it keeps the error), got {v.dtype}")
    check_contiguous("quantize_int4_keep_error", v=v)
    _check_out("quantize_int4_keep_error", out, v.numel(), block, v.device)
    if not use_triton(v):
        return quantize_int4_reference(v, block=block, out=out, _keep_error=True)
    packed, s = quantize_int4(v, block=block, out=out)
    v.sub_(dequantize_int4(packed, s, numel=v.numel(), block=block))
    return packed, s


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, *, numel: int | None = None,
                    out: torch.Tensor | None = None, block: int = 256, accumulate: bool = False) -> torch.Tensor:
    """``out[i] = q[i] * scales[i // block]`` (fp32 product, rounded once to ``out.dtype``; fp32 by
    default), q unpacked from ``packed``; with ``accumulate``, ``out[i] += ...`` instead (fp32 out).
    The element count is ``out.numel()``, or ``numel`` without ``out``. Returns out.

    Example: dequantize_int4(tensor([95, 137], dtype=uint8), tensor([1.0]), numel=4, block=4)
             -> tensor([7.0, -3.0, 1.0, 0.0])
    """
    _check_block("dequantize_int4", block)
    if out is None:
        if accumulate:
            raise ValueError("dequantize_int4: accumulate needs an out to add into")
        if not isinstance(numel, int) or numel < 0:
            raise ValueError(f"dequantize_int4: pass out, or numel (the element count), got numel={numel!r}")
        n = numel
    else:
        n = out.numel()
        if numel is not None and numel != n:
            raise ValueError(f"dequantize_int4: numel {numel} but out has {n} elements")
        if out.dtype not in OUT_DTYPES:
            raise TypeError(f"dequantize_int4: out must be floating, got {out.dtype}")
        if accumulate and out.dtype != torch.float32:
            raise TypeError(f"dequantize_int4: accumulate adds into an fp32 out, got {out.dtype}")
        if out.device != packed.device:
            raise ValueError(f"dequantize_int4: out is on {out.device}, packed on {packed.device}")
    _check_packed_scales("dequantize_int4:", packed, scales, n, block)
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=packed.device)
    check_contiguous("dequantize_int4", packed=packed, scales=scales, out=out)
    if not use_triton(packed, scales, out):
        return dequantize_int4_reference(packed, scales, out=out, block=block, accumulate=accumulate)
    if n == 0:
        return out
    nb = scales.numel()
    _KERNELS["_unpack_dequantize_kernel"][_grid(nb, block)](
        packed, scales, out, n, nb, ACCUMULATE=accumulate, QBLOCK=block, TILE=_TILE, **_compile_options(out))
    return out


def reduce_int4(packs: Sequence[torch.Tensor], scales_list: Sequence[torch.Tensor], *, numel: int,
                block: int = 256, scale: float | None = None,
                out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-shot server's step: ``quantize_int4(sum_i dequant(packs[i], scales_list[i]), scale=scale)``,
    summed in fp32 in list order. Returns ``(packed, scales)`` (new, or written into ``out``).

    Example (block=2): packs = [[0xF8], [0x1F]] ([0, 7] and [7, -7]), scales [[1.0], [0.5]]
             -> acc = [3.5, 3.5]; with scale 0.5: [1.75, 1.75] -> q = [7, 7], scales = [0.25]
    """
    _check_block("reduce_int4", block)
    if len(packs) == 0:
        raise ValueError("reduce_int4: needs at least one input")
    if len(packs) != len(scales_list):
        raise ValueError(f"reduce_int4: {len(packs)} packed tensors but {len(scales_list)} scale tensors")
    device = packs[0].device
    for i, (p, s) in enumerate(zip(packs, scales_list)):
        _check_packed_scales(f"reduce_int4: input {i}:", p, s, numel, block)
        if p.device != device or s.device != device:
            raise ValueError(f"reduce_int4: input {i} is not on {device}")
        check_contiguous("reduce_int4", **{f"packs[{i}]": p, f"scales_list[{i}]": s})
    if out is not None:
        _check_out("reduce_int4", out, numel, block, device)
    if not use_triton(*packs, *scales_list):
        return reduce_int4_reference(packs, scales_list, numel=numel, block=block, scale=scale, out=out)
    # The kernels in the reference's order: dequantize the first, accumulate the others, quantize.
    acc = dequantize_int4(packs[0], scales_list[0], numel=numel, block=block)
    for p, s in zip(packs[1:], scales_list[1:]):
        dequantize_int4(p, s, out=acc, block=block, accumulate=True)
    return quantize_int4(acc, block=block, scale=scale, out=out)


def roundtrip_int4(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One compress + decompress of ``x`` into ``out`` at block 256, the cost the tuner's probe times
    (the int4 row of ddl_triton/compression_methods.py names it)."""
    packed, s = quantize_int4(x, block=256)
    return dequantize_int4(packed, s, out=out, block=256)


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------

def _new_out(n: int, block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((n + 1) // 2, dtype=torch.uint8, device=device),
            torch.empty(_n_blocks(n, block), dtype=torch.float32, device=device))


def _check_block(name: str, block: int) -> None:
    if not isinstance(block, int) or block < 2 or block > _MAX_QBLOCK or block & (block - 1):
        # tl.arange needs a power of two, and a block must fill whole bytes (two values each).
        raise ValueError(f"{name}: block must be a power of two in [2, {_MAX_QBLOCK}], got {block!r}")


def _check_out(name: str, out, n: int, block: int, device: torch.device) -> None:
    """``out=(packed, scales)``: uint8 of ceil(n/2) and fp32 of ceil(n/block), contiguous, on device."""
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise TypeError(f"{name}: out must be a (packed, scales) tuple of tensors, got {type(out).__name__}")
    p, s = out
    if p.dtype != torch.uint8 or s.dtype != torch.float32:
        raise TypeError(f"{name}: out must be (uint8, fp32) tensors, got ({p.dtype}, {s.dtype})")
    if p.numel() != (n + 1) // 2 or s.numel() != _n_blocks(n, block):
        raise ValueError(f"{name}: out must hold {(n + 1) // 2} bytes and {_n_blocks(n, block)} scales, "
                         f"got {p.numel()} and {s.numel()}")
    if p.device != device or s.device != device:
        raise ValueError(f"{name}: out is on ({p.device}, {s.device}), the input on {device}")
    check_contiguous(name, **{"out packed": p, "out scales": s})


def _check_packed_scales(name: str, packed: torch.Tensor, scales: torch.Tensor, n: int, block: int) -> None:
    if packed.dtype != torch.uint8:
        raise TypeError(f"{name} packed must be uint8, got {packed.dtype}")
    if scales.dtype != torch.float32:
        raise TypeError(f"{name} scales must be fp32, got {scales.dtype}")
    if packed.numel() != (n + 1) // 2:
        raise ValueError(f"{name} {n} elements need {(n + 1) // 2} packed bytes, got {packed.numel()}")
    if scales.numel() != _n_blocks(n, block):
        raise ValueError(f"{name} {n} elements in blocks of {block} need {_n_blocks(n, block)} scales, "
                         f"got {scales.numel()}")
    if scales.device != packed.device:
        raise ValueError(f"{name} scales are on {scales.device}, packed on {packed.device}")
