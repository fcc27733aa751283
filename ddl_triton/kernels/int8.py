"""Blockwise int8 quantization of gradients: ``quantize_int8``, ``dequantize_int8``, ``reduce_int8``
(and ``quantize_int8_keep_error``, error feedback's quantize-and-subtract).

Per block of ``block``
consecutive elements of the flattened tensor (the last block may be short):
    xf    = x as fp32                           # exact for fp16/bf16 inputs
    s     = absmax(xf[block]) / 127             # fp32, IEEE-rounded division
    s     = 0 if s < 2**-126 else s             # a subnormal scale would break the clamp-free
                                                # bound below: such blocks (absmax < ~1.5e-36) go to 0
    q     = clamp(rne(xf / s), -127, 127)       # rne: round half to even; q = 0 where s == 0
    dequant(q, s) = round_out(fp32(q * s))      # rounded once to the out dtype

Error bound, per element, for finite x (proof below the worked example; the tests enforce it):
    s > 0:  |fp32(q*s) - x| <= s * (1/2 + 2**-16)
    s = 0:  q = 0 and |x| < 2**-119
The exact-arithmetic bound is s/2; the 2**-16 covers the two fp32 roundings (of x/s and of q*s),
and it is needed: tests/unit/test_int8.py holds an input that exceeds s/2 by 5.5e-6*s (2**-17.5*s).
16-bit x enters exactly (fp16/bf16 -> fp32 is exact), so the bound holds against x itself.
Dequantized into a 16-bit out, the value is fp32(q*s) rounded once more (to nearest even), so
add half an ulp of the out dtype there: |v|*2**-11 for fp16, |v|*2**-8 for bf16 (normal range).

Worked example (block=4):
    x = tensor([1.0, -0.5, 0.25, 0.0,   3.0, 0.0, 0.0, 0.0,   -254.0])
    q, s = quantize_int8(x, block=4)
      s = [1/127, 3/127, 2.0]   (fp32: 0.007874016, 0.023622047, 2.0)
      q = [127, -64, 32, 0,   127, 0, 0, 0,   -127]      # -0.5*127 = -63.5000... -> -64
    dequantize_int8(q, s, block=4)
      -> [1.0, -0.503937, 0.251969, 0.0,   3.0, 0.0, 0.0, 0.0,   -254.0]

Proof (u = 2**-24, the fp32 unit roundoff; s >= 2**-126, so q*s is never subnormal):
t = x/s (real). s = (absmax/127)(1+e) with |e| <= u, so |t| <= 127/(1-u) and rne(fp32(t)) <= 127:
the clamp never binds for finite x. v = fp32(t): |v - t| <= max(u*|t|, 2**-150) < 2**-17.
|q - v| <= 1/2, so |q*s - x| = s*|q - t| <= s*(1/2 + 2**-17). fp32(q*s) adds at most u*|q*s| <= 127*u*s < 2**-17*s.
Flushed blocks: fp32(absmax/127) < 2**-126 means absmax < 127*2**-126*(1+u) < 2**-119, and
q = rne(x/1) = 0 since |x| < 1/2.

``reduce_int8`` is one hop of a compressed ring, fused into one pass:
    acc = dequant(qs[0], scales[0])             # fp32
    for q, s in zip(qs[1:], scales[1:]):        # strictly in list order
        acc = acc + dequant(q, s)               # product and sum each rounded to fp32 (no fma)
    if scale is not None: acc = acc * fp32(scale)
    return quantize_int8(acc)
so the requantized result carries the int8 bound above relative to the fp32 ``acc``.
With q, s from the worked example, three equal inputs averaged-then-tripled:
    reduce_int8([q, q, q], [s, s, s], block=4, scale=0.5)
      -> q = [127, -64, 32, 0,   127, 0, 0, 0,   -127], scales = 1.5 * s = [0.011811024, 0.035433073, 3.0]

Each launcher's Triton kernel and torch reference produce bitwise-identical results on one
device: the same fp32 operations in the same order, IEEE division (``div_rn``, not Triton's
approximate ``/``), no fma contraction, bf16 stores rounded by hand (``_rounding.round_to``).
(Checked under the interpreter, and compiled on an H200 by tests/gpu/test_gpu.py: bench/results/gpu.md.)

Payload per n fp32 elements: n + 4*ceil(n/block) bytes (~3.94x smaller at block=256). The 1-bit
compressor, ~32x smaller, is onebit.py.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from . import launch_configs
from ._compression import OUT_DTYPES, QUANT_DTYPES, check_contiguous, compiled, tuned
from ._dispatch import interpreting, use_triton
from ._lazy_kernels import LazyKernels, cdiv

_QMAX = 127.0  # symmetric range [-127, 127]: -128 is never produced, so negation is safe
_MIN_NORMAL = 2.0 ** -126  # smallest normal fp32; smaller scales are flushed to 0
_MAX_QBLOCK = 1 << 16


# --------------------------------------------------------------------------------------------
# Triton kernels: in _int8_jit.py, loaded on first use (see _lazy_kernels.py)
# --------------------------------------------------------------------------------------------

_KERNELS = LazyKernels(__name__, "._int8_jit", ["_quantize_kernel", "_dequantize_kernel", "_reduce_int8_kernel"])
__getattr__ = _KERNELS.module_getattr  # int8._quantize_kernel etc.: the @triton.jit kernels, loaded on first use

# Launch configurations (TILE, num_warps, num_stages) are data: launch_configs.py. Here: each
# kernel's name there, its @triton.jit kernel's name in _KERNELS, and its autotuning arguments.
# reset_to_zero is not needed: every output element is written by exactly one program.
_AUTOTUNE = {
    "quantize_int8": ("_quantize_kernel", dict(key=["n_elements", "QBLOCK"])),
    "dequantize_int8": ("_dequantize_kernel", dict(key=["n_elements", "QBLOCK"])),
    "reduce_int8": ("_reduce_int8_kernel", dict(key=["n_elements", "QBLOCK"])),
}
# The interpreter's fixed size, unless the kernel is pinned (launch_configs.interpreter_meta).
_INTERPRETER_TILE = 4096


def _tuned(kernel: str):
    """The autotuned wrapper of ``kernel`` over its launch configurations as they are now."""
    return tuned(_KERNELS, _AUTOTUNE, kernel)


def _launch(kernel: str, like: torch.Tensor, n_blocks: int, block: int, args: tuple, *,
            compile_options: dict | None = None, **meta) -> None:
    """Run ``kernel`` (named as in launch_configs) over ``n_blocks`` blocks of ``block`` elements,
    each program a tile of whole blocks: autotuned over its launch configurations when compiled
    (``compile_options`` go to the compiler), else at the interpreter's tile (pinned, or
    ``_INTERPRETER_TILE``)."""
    if compiled(like):
        grid = lambda m: (cdiv(n_blocks, max(1, m["TILE"] // block)),)  # noqa: E731
        _tuned(kernel)[grid](*args, QBLOCK=block, **meta, **(compile_options or {}))
        return
    tile = launch_configs.interpreter_meta(kernel, TILE=_INTERPRETER_TILE)["TILE"]
    jitted = _KERNELS[_AUTOTUNE[kernel][0]]
    jitted[(cdiv(n_blocks, max(1, tile // block)),)](*args, QBLOCK=block, TILE=tile, **meta)


# --------------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------------

def _n_blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def quantize_int8_reference(x: torch.Tensor, *, block: int = 256,
                            out: tuple[torch.Tensor, torch.Tensor] | None = None,
                            _keep_error: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch-ops implementation of :func:`quantize_int8`; also the CPU fast path (and, with
    ``_keep_error``, :func:`quantize_int8_keep_error`'s).

    torch.round is round-half-to-even, the rule the kernel implements with floor and compares.
    """
    n = x.numel()
    flat = x.reshape(-1).to(torch.float32)
    full = n // block * block
    q, s = out if out is not None else (torch.empty(x.shape, dtype=torch.int8, device=x.device),
                                        torch.empty(_n_blocks(n, block), dtype=torch.float32, device=x.device))
    q_flat = q.view(-1)
    # The whole blocks as a view and the short last block on its own: padding a copy of the
    # tensor to whole blocks cost more than the quantization itself (0.6 of 1.4 ms at 2 MB).
    if full:
        _quantize_blocks(flat[:full].view(-1, block), q_flat[:full].view(-1, block), s[: full // block], _keep_error)
    if full < n:
        _quantize_blocks(flat[full:].view(1, -1), q_flat[full:].view(1, -1), s[full // block:], _keep_error)
    return q, s


_QMAX_TENSORS: dict[torch.device, torch.Tensor] = {}


def _qmax_on(device: torch.device) -> torch.Tensor:
    """127.0 as a 0-dim fp32 tensor on ``device`` (one per device, made once)."""
    t = _QMAX_TENSORS.get(device)
    if t is None:
        t = _QMAX_TENSORS[device] = torch.tensor(_QMAX, dtype=torch.float32, device=device)
    return t


def _quantize_blocks(xb: torch.Tensor, qb: torch.Tensor, s: torch.Tensor, keep_error: bool = False) -> None:
    """Quantize the rows of ``xb`` (one block each) into ``qb``, their scales into ``s``; with
    ``keep_error`` (xb fp32), subtract the dequantized values from ``xb``."""
    # max(amax, -amin) is |x|'s max exactly, without the fp32 temporary abs() would write.
    # The divisor is a tensor on the data's device, not a Python number: CUDA torch divides by a
    # CPU scalar as a multiplication by its reciprocal (up to one bit off the IEEE quotient the
    # kernel computes with div_rn; the first GPU run found scales one ulp apart).
    torch.div(torch.maximum(xb.amax(dim=1), xb.amin(dim=1).neg_()), _qmax_on(xb.device), out=s)
    s.masked_fill_(s < _MIN_NORMAL, 0.0)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    v = torch.div(xb, safe[:, None])
    qb.copy_(v.round_().clamp_(-_QMAX, _QMAX))  # in place: one fp32 temporary, not three
    if keep_error:
        # v holds q exactly (integers up to 127), so v * s is dequantize_int8's fp32(q * s), bit
        # for bit, without converting q back from int8.
        xb.sub_(v.mul_(s[:, None]))


def dequantize_int8_reference(q: torch.Tensor, scales: torch.Tensor, *, out: torch.Tensor | None = None,
                              block: int = 256) -> torch.Tensor:
    """Torch-ops implementation of :func:`dequantize_int8`; also the CPU fast path."""
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    n = q.numel()
    full = n // block * block
    qf, of = q.reshape(-1), out.view(-1)
    if out.dtype == torch.float32:
        # int8 -> fp32 is exact, so converting first and scaling in place rounds once, as the mul
        # below does; it runs at about twice its speed (the mixed-dtype mul is not vectorized).
        of.copy_(qf)
        if full:
            of[:full].view(-1, block).mul_(scales[: full // block, None])
        if full < n:
            of[full:].mul_(scales[-1])
        return out
    # mul computes in fp32 (int8 x fp32 promotes to fp32) and rounds once into out's dtype,
    # writing out directly: no fp32 temporary.
    if full:
        torch.mul(qf[:full].view(-1, block), scales[: full // block, None], out=of[:full].view(-1, block))
    if full < n:
        torch.mul(qf[full:], scales[-1], out=of[full:])
    return out


def reduce_int8_reference(qs: Sequence[torch.Tensor], scales_list: Sequence[torch.Tensor], *,
                          block: int = 256, scale: float | None = None,
                          out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch-ops implementation of :func:`reduce_int8`; also the CPU fast path."""
    acc = dequantize_int8_reference(qs[0], scales_list[0], block=block)
    term = torch.empty_like(acc) if len(qs) > 1 else None  # one temporary for every input, not one each
    for q, s in zip(qs[1:], scales_list[1:]):
        acc.add_(dequantize_int8_reference(q, s, out=term, block=block))
    if scale is not None:
        # An fp32 tensor, as the kernel loads it: no doubt about how a Python float is rounded.
        acc.mul_(torch.tensor(float(scale), dtype=torch.float32, device=acc.device))
    return quantize_int8_reference(acc, block=block, out=out)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------

def quantize_int8(x: torch.Tensor, *, block: int = 256,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise symmetric int8: returns ``(q, scales)``, q int8 shaped like x, scales fp32 [ceil(n/block)].

    x: contiguous fp16/bf16/fp32 of any shape, finite. ``block``: a power of two <= 65536.
    out: ``(q, scales)`` to write instead of new tensors (contiguous, on x's device, q int8 with
    x's number of elements, scales fp32 with one per block), as torch.max's ``out=(values, indices)``:
    a caller quantizes straight into its message buffer.
    Example: quantize_int8(tensor([1.0, -0.5, 0.25, 0.0, 3.0]), block=4)
             -> (tensor([127, -64, 32, 0, 127], dtype=int8), tensor([0.007874016, 0.023622047]))
    """
    _check_block("quantize_int8", block)
    if x.dtype not in QUANT_DTYPES:
        raise TypeError(f"quantize_int8: unsupported dtype {x.dtype}; valid: fp16, bf16, fp32")
    check_contiguous("quantize_int8", x=x)
    n = x.numel()
    nb = _n_blocks(n, block)
    if out is not None:
        _check_out("quantize_int8", out, n, nb, x.device)
    if not use_triton(x):
        return quantize_int8_reference(x, block=block, out=out)
    q, s = out if out is not None else (torch.empty(x.shape, dtype=torch.int8, device=x.device),
                                        torch.empty(nb, dtype=torch.float32, device=x.device))
    if n == 0:
        return q, s
    _launch("quantize_int8", x, nb, block, (x, q, s, n, nb))
    return q, s


def quantize_int8_keep_error(v: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor],
                             block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Error feedback's step: ``quantize_int8(v, out=out)``, then ``v -= dequantize_int8(q, s)``,
    so that ``v`` keeps what the quantization lost (to be sent with the next call). Returns out.

    v: contiguous fp32, overwritten. The same bits as the two calls. On the CPU fast path it
    reuses the rounded values quantize_int8 computes, instead of converting q back from int8
    into a temporary: with the residual's add before it, 2.27 against 2.68 ms for a 2.1 MB
    bucket on this project's CPU VM (interleaved medians).
    Example (block=4): v = [1.0, -0.5, 0.25, 0.0] -> q = [127, -64, 32, 0], s = [1/127],
             v = [0.0, 0.003937, -0.001969, 0.0]
    """
    _check_block("quantize_int8_keep_error", block)
    if v.dtype != torch.float32:
        raise TypeError(f"quantize_int8_keep_error: v must be fp32 (it keeps the error), got {v.dtype}")
    check_contiguous("quantize_int8_keep_error", v=v)
    _check_out("quantize_int8_keep_error", out, v.numel(), _n_blocks(v.numel(), block), v.device)
    if not use_triton(v):
        return quantize_int8_reference(v, block=block, out=out, _keep_error=True)
    q, s = quantize_int8(v, block=block, out=out)
    v.sub_(dequantize_int8(q, s, block=block))
    return q, s


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, *, out: torch.Tensor | None = None,
                    block: int = 256) -> torch.Tensor:
    """``out = q * scales[i // block]``, fp32 by default or rounded once to ``out.dtype``. Returns out.

    Example: dequantize_int8(tensor([127, -64, 32, 0, 127], dtype=int8), tensor([1/127, 3/127]), block=4)
             -> tensor([1.0, -0.503937, 0.251969, 0.0, 3.0])
    """
    _check_block("dequantize_int8", block)
    _check_q_scales("dequantize_int8:", q, scales, block)
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    else:
        if out.dtype not in OUT_DTYPES:
            raise TypeError(f"dequantize_int8: out must be floating, got {out.dtype}")
        if out.numel() != q.numel():
            raise ValueError(f"dequantize_int8: out has {out.numel()} elements, q has {q.numel()}")
        if out.device != q.device:
            raise ValueError(f"dequantize_int8: out is on {out.device}, q on {q.device}")
    check_contiguous("dequantize_int8", q=q, scales=scales, out=out)
    if not use_triton(q, scales, out):
        return dequantize_int8_reference(q, scales, out=out, block=block)
    n = q.numel()
    if n == 0:
        return out
    nb = scales.numel()
    _launch("dequantize_int8", q, nb, block, (q, scales, out, n, nb))
    return out


def reduce_int8(qs: Sequence[torch.Tensor], scales_list: Sequence[torch.Tensor], *, block: int = 256,
                scale: float | None = None,
                out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One compressed-ring hop: ``quantize_int8(sum_i dequant(qs[i], scales_list[i]) * scale)``.

    Inputs: equally long lists of contiguous int8 tensors (one number of elements) and their fp32
    scales. Sums in fp32 in list order; one launch, each input read once. Returns ``(q, scales)``,
    q shaped like ``qs[0]``, or written into ``out=(q, scales)`` (as :func:`quantize_int8`'s).
    Example (block=2): qs = [tensor([127, 0]), tensor([-127, 127])], scales_list = [[1.0], [0.5]]
             -> acc = [127 - 63.5, 63.5] = [63.5, 63.5]; q = [127, 127], scales = [0.5]
    """
    _check_block("reduce_int8", block)
    if len(qs) == 0:
        raise ValueError("reduce_int8: needs at least one input")
    if len(qs) != len(scales_list):
        raise ValueError(f"reduce_int8: {len(qs)} q tensors but {len(scales_list)} scale tensors")
    n = qs[0].numel()
    for i, (q, s) in enumerate(zip(qs, scales_list)):
        _check_q_scales(f"reduce_int8: input {i}:", q, s, block)
        if q.numel() != n:
            raise ValueError(f"reduce_int8: qs[{i}] has {q.numel()} elements, qs[0] has {n}")
        if q.device != qs[0].device or s.device != qs[0].device:
            raise ValueError(f"reduce_int8: input {i} is not on {qs[0].device}")
        check_contiguous("reduce_int8", **{f"qs[{i}]": q, f"scales_list[{i}]": s})
    device = qs[0].device
    nb = _n_blocks(n, block)
    if out is not None:
        _check_out("reduce_int8", out, n, nb, device)
    if not use_triton(*qs, *scales_list):
        return reduce_int8_reference(qs, scales_list, block=block, scale=scale, out=out)
    q_out, s_out = out if out is not None else (torch.empty(qs[0].shape, dtype=torch.int8, device=device),
                                                torch.empty(nb, dtype=torch.float32, device=device))
    if n == 0:
        return q_out, s_out
    _refuse_interpreted_device_pointers("reduce_int8", qs[0])
    q_table = torch.tensor([q.data_ptr() for q in qs], dtype=torch.int64, device=device)
    s_table = torch.tensor([s.data_ptr() for s in scales_list], dtype=torch.int64, device=device)
    scale_value = torch.full((1,), 1.0 if scale is None else float(scale), dtype=torch.float32, device=device)
    args = (q_table, s_table, len(qs), q_out, s_out, n, nb, scale_value)
    # enable_fp_fusion=False: an fma of acc + q*s would round once where torch rounds twice.
    _launch("reduce_int8", qs[0], nb, block, args, HAS_SCALE=scale is not None,
            compile_options={"enable_fp_fusion": False})
    return q_out, s_out


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------

def roundtrip_int8(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One compress + decompress of ``x`` into ``out`` at block 256, the cost the tuner's probe times
    (the int8 row of ddl_triton/compression_methods.py names it)."""
    q, s = quantize_int8(x, block=256)
    return dequantize_int8(q, s, out=out, block=256)

def _check_block(name: str, block: int) -> None:
    if not isinstance(block, int) or block < 1 or block > _MAX_QBLOCK or block & (block - 1):
        # tl.arange needs a power of two, and one block is one row of a program's tile.
        raise ValueError(f"{name}: block must be a power of two in [1, {_MAX_QBLOCK}], got {block!r}")


def _check_out(name: str, out, n: int, n_blocks: int, device: torch.device) -> None:
    """``out=(q, scales)`` of a quantizing function: int8 of n elements and fp32 of n_blocks, contiguous, on device."""
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise TypeError(f"{name}: out must be a (q, scales) tuple of tensors, got {type(out).__name__}")
    q, s = out
    if q.dtype != torch.int8 or s.dtype != torch.float32:
        raise TypeError(f"{name}: out must be (int8, fp32) tensors, got ({q.dtype}, {s.dtype})")
    if q.numel() != n or s.numel() != n_blocks:
        raise ValueError(f"{name}: out must hold {n} values and {n_blocks} scales, "
                         f"got {q.numel()} and {s.numel()}")
    if q.device != device or s.device != device:
        raise ValueError(f"{name}: out is on ({q.device}, {s.device}), the input on {device}")
    check_contiguous(name, **{"out q": q, "out scales": s})


def _check_q_scales(name: str, q: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    if q.dtype != torch.int8:
        raise TypeError(f"{name} q must be int8, got {q.dtype}")
    if scales.dtype != torch.float32:
        raise TypeError(f"{name} scales must be fp32, got {scales.dtype}")
    nb = _n_blocks(q.numel(), block)
    if scales.numel() != nb:
        raise ValueError(f"{name} {q.numel()} elements in blocks of {block} need {nb} scales, got {scales.numel()}")
    if scales.device != q.device:
        raise ValueError(f"{name} scales are on {scales.device}, q on {q.device}")


def _refuse_interpreted_device_pointers(name: str, t: torch.Tensor) -> None:
    if t.is_cuda and interpreting():
        # The interpreter copies kernel arguments to the host, but not memory reached through a
        # table of device addresses.
        raise RuntimeError(f"{name}: TRITON_INTERPRET=1 cannot follow CUDA pointer tables; use CPU tensors")

