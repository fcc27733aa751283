"""1-bit sign compression of gradients with error feedback: ``sign_compress``, ``sign_decompress``.

DeepSpeed 1-bit Adam style:
    v        = fp32(x) + residual               # fp32
    scale    = sum(|v|) / n                     # one fp32 scalar: torch, per 4096-row, then rows
    bit[i]   = v[i] >= 0                        # bit i of byte j is element 8j+i; pad bits are 0
    d[i]     = +scale if bit[i] else -scale     # what sign_decompress returns
    residual = fp32(v - d)                      # written in place
Exactness: ``d + residual == v`` holds exactly wherever scale/2 <= |v| <= 2*scale, or v == 0
(Sterbenz: the fp32 difference of two same-sign values within a factor 2 is exact). Elsewhere v - d may need
more than 24 bits and fp32 rounds it: |(d + residual) - v| <= 2**-24 * |v - d|. No fp32 residual
can do better there; the tests check both statements element by element.

Worked example:
    x = tensor([0.5, -1.5, 2.0, 0.0]), residual = zeros(4)
    bits, scale = sign_compress(x, residual)
      scale = (0.5 + 1.5 + 2.0 + 0.0) / 4 = 1.0
      bits = tensor([0b1101], uint8) = [13]             # elements 0, 2, 3 are >= 0
      residual -> [-0.5, -0.5, 1.0, -1.0]
    sign_decompress(bits, scale, 4) -> [1.0, -1.0, 1.0, 1.0]

Each launcher's Triton kernel and torch reference produce bitwise-identical results on one
device: the same fp32 operations in the same order, 16-bit stores rounded by hand
(``_rounding.round_to``), and the one whole-tensor reduction (the scale) done by the same torch
call on both paths, because a Triton tree reduction would sum in another order. (Checked under
the interpreter, and compiled on an H200: bench/results/gpu.md.) Across devices the scale's
sum runs in another order (torch's CPU and CUDA reductions differ), so a CPU and a GPU rank
would not agree bit for bit: a job's ranks must share one kind of device.

The Triton path is three passes: v = x + residual (kernel), the scale (torch), then signs,
bits and the new residual (kernel). Traffic: x read once, the fp32 residual (then v) read three
times and written twice, n/8 bytes of bits written.

Payload per n fp32 elements: ceil(n/8) + 4 bytes (~32x smaller). The int8 compressor is int8.py.
"""
from __future__ import annotations

import torch

from . import launch_configs
from ._compression import OUT_DTYPES, QUANT_DTYPES, check_contiguous, compiled, tuned
from ._dispatch import use_triton
from ._lazy_kernels import LazyKernels, cdiv


# --------------------------------------------------------------------------------------------
# Triton kernels: in _onebit_jit.py, loaded on first use (see _lazy_kernels.py)
# --------------------------------------------------------------------------------------------

_KERNELS = LazyKernels(__name__, "._onebit_jit", ["_add_into_kernel", "_sign_pack_kernel", "_sign_unpack_kernel"])
__getattr__ = _KERNELS.module_getattr  # onebit._add_into_kernel etc.: the @triton.jit kernels, loaded on first use

# Launch configurations (BLOCK / BYTES, num_warps, num_stages) are data: launch_configs.py. Here:
# each kernel's name there, its @triton.jit kernel's name in _KERNELS, and its autotuning
# arguments. reset_to_zero is not needed: every output element is written by exactly one program.
# The add_into and sign_pack kernels rewrite an input in place, so autotuning must restore it
# between trials.
_AUTOTUNE = {
    "add_into": ("_add_into_kernel", dict(key=["n_elements"], restore_value=["r_ptr"])),
    "sign_pack": ("_sign_pack_kernel", dict(key=["n_elements"], restore_value=["v_ptr"])),
    "sign_unpack": ("_sign_unpack_kernel", dict(key=["n_elements"])),
}
# The interpreter's fixed sizes, unless the kernel is pinned (launch_configs.interpreter_meta).
_INTERPRETER_BYTES = 512
_INTERPRETER_BLOCK = 4096


def _tuned(kernel: str):
    """The autotuned wrapper of ``kernel`` over its launch configurations as they are now."""
    return tuned(_KERNELS, _AUTOTUNE, kernel)


def _interpreted_bytes(kernel: str) -> int:
    return launch_configs.interpreter_meta(kernel, BYTES=_INTERPRETER_BYTES)["BYTES"]


# --------------------------------------------------------------------------------------------
# references and launchers
# --------------------------------------------------------------------------------------------

_SCALE_ROW = 4096


def _mean_abs(v: torch.Tensor) -> torch.Tensor:
    """sum(|v|) / n as a 1-element fp32 tensor. Shared by both paths so the scale is bitwise equal.

    Two levels: the 1-norm of each row of 4096 elements, then the sum of those. One flat fp32
    vector_norm accumulates naively on CPU (5e-3 relative error at 16M elements, measured);
    rows keep it near 1e-7 at the same speed, and never materialize |v| as abs().sum() would.
    """
    n = v.numel()
    if n == 0:
        return torch.zeros(1, dtype=torch.float32, device=v.device)
    full = n - n % _SCALE_ROW
    parts = []
    if full:
        parts.append(torch.linalg.vector_norm(v[:full].view(-1, _SCALE_ROW), ord=1, dim=1))
    if full < n:
        parts.append(torch.linalg.vector_norm(v[full:], ord=1).reshape(1))
    total = parts[0].sum() if len(parts) == 1 else torch.cat(parts).sum()
    return (total / n).reshape(1)


_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_BYTE_BITS: dict[torch.device, torch.Tensor] = {}
# Gathers byte i of an int64 into bit 56+i: the 64 partial products are distinct powers of two
# (8i - 7j == 8k - 7l forces i == k, j == l over 0..7), so nothing carries into the top byte.
_GATHER_BITS = 0x0102040810204080


def _bit_weights(device: torch.device) -> torch.Tensor:
    if device not in _BIT_WEIGHTS:
        _BIT_WEIGHTS[device] = (1 << torch.arange(8, device=device)).to(torch.uint8)
    return _BIT_WEIGHTS[device]


def _byte_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: bit i of byte value b."""
    if device not in _BYTE_BITS:
        _BYTE_BITS[device] = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1 != 0
    return _BYTE_BITS[device]


def _pack_signs(pos: torch.Tensor, out: torch.Tensor) -> None:
    """out[j] = sum_i pos[8j+i] << i, padding bits 0."""
    n = pos.numel()
    full = n // 8
    if full:
        # 8 bools (0/1 bytes) read as one little-endian int64 word, then one multiply and a shift
        # collect them into a byte: 3x faster on a CPU than a weighted sum over rows of 8. The
        # product wraps mod 2**64 as torch's integer multiply does; only the top byte is kept.
        words = pos[: 8 * full].view(torch.uint8).view(torch.int64)
        out[:full].copy_(((words * _GATHER_BITS) >> 56) & 0xFF)
    if full * 8 < n:
        tail = pos[8 * full:].to(torch.uint8) * _bit_weights(pos.device)[: n - 8 * full]
        out[full:].copy_(tail.sum(dtype=torch.uint8).reshape(1))


def sign_compress_reference(x: torch.Tensor, residual: torch.Tensor, *,
                            out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch-ops implementation of :func:`sign_compress`; also the CPU fast path."""
    n = x.numel()
    v = residual.view(-1)
    v.add_(x.reshape(-1))  # fp32 += x, x upcast exactly
    # -0.0 -> +0.0, every other value unchanged: -0.0 counts as positive (v >= 0, as the kernel
    # tests), so its d must be +scale, and copysign below reads the sign bit.
    v.add_(0.0)
    scale = _mean_abs(v)
    pos = v >= 0
    # d = +-scale by v's sign, then v - d rounded once, as the kernel: copysign is ~15x faster on a
    # CPU than where(pos, scale, -scale), whose bool-masked select torch does not vectorize.
    v.sub_(torch.copysign(scale, v))  # the new residual
    if out is None:
        out = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    _pack_signs(pos, out)
    return out, scale


def sign_decompress_reference(bits: torch.Tensor, scale: torch.Tensor, n: int, *,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """Torch-ops implementation of :func:`sign_decompress`; also the CPU fast path."""
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=bits.device)
    if n:
        # A 256 x 8 table of +-scale, rounded once to out's dtype, gathered by byte value:
        # ~10x faster on a CPU than unpacking bits and a where() over n elements.
        table = torch.where(_byte_bits(bits.device), scale, -scale).to(out.dtype)
        full = n // 8
        of = out.view(-1)
        if full:
            torch.index_select(table, 0, bits[:full].long(), out=of[: 8 * full].view(full, 8))
        if 8 * full < n:
            of[8 * full:].copy_(table[int(bits[full])][: n - 8 * full])
    return out


def sign_compress(x: torch.Tensor, residual: torch.Tensor, *,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit compress ``x + residual`` with error feedback. Returns ``(bits, scale)``.

    x: contiguous fp16/bf16/fp32, finite. residual: contiguous fp32 with x.numel() elements,
    updated in place to the compression error. bits (``out`` if given): uint8 [ceil(n/8)].
    scale: fp32 [1]. Traffic on the Triton path: x read, residual read and written (v), v read
    (scale), v read and written (residual), n/8 bytes written.
    Example: sign_compress(tensor([0.5, -1.5, 2.0, 0.0]), residual=zeros(4))
             -> (tensor([13], dtype=uint8), tensor([1.0])); residual = [-0.5, -0.5, 1.0, -1.0]
    """
    if x.dtype not in QUANT_DTYPES:
        raise TypeError(f"sign_compress: unsupported dtype {x.dtype}; valid: fp16, bf16, fp32")
    if residual.dtype != torch.float32:
        raise TypeError(f"sign_compress: residual must be fp32, got {residual.dtype}")
    n = x.numel()
    if residual.numel() != n:
        raise ValueError(f"sign_compress: residual has {residual.numel()} elements, x has {n}")
    if residual.device != x.device:
        raise ValueError(f"sign_compress: residual is on {residual.device}, x on {x.device}")
    if out is not None:
        if out.dtype != torch.uint8 or out.numel() != (n + 7) // 8:
            raise ValueError(f"sign_compress: out must be uint8 with {(n + 7) // 8} elements")
        if out.device != x.device:
            raise ValueError(f"sign_compress: out is on {out.device}, x on {x.device}")
    check_contiguous("sign_compress", x=x, residual=residual, **({} if out is None else {"out": out}))
    if not use_triton(x, residual):
        return sign_compress_reference(x, residual, out=out)
    if out is None:
        out = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    if n == 0:
        return out, torch.zeros(1, dtype=torch.float32, device=x.device)
    n_bytes = out.numel()
    if compiled(x):
        _tuned("add_into")[lambda meta: (cdiv(n, meta["BLOCK"]),)](x, residual, n)
        scale = _mean_abs(residual)
        _tuned("sign_pack")[lambda meta: (cdiv(n_bytes, meta["BYTES"]),)](residual, out, scale, n, n_bytes)
    else:
        block = launch_configs.interpreter_meta("add_into", BLOCK=_INTERPRETER_BLOCK)["BLOCK"]
        _KERNELS["_add_into_kernel"][(cdiv(n, block),)](x, residual, n, BLOCK=block)
        scale = _mean_abs(residual)
        bytes_per_program = _interpreted_bytes("sign_pack")
        _KERNELS["_sign_pack_kernel"][(cdiv(n_bytes, bytes_per_program),)](
            residual, out, scale, n, n_bytes, BYTES=bytes_per_program)
    return out, scale


def sign_decompress(bits: torch.Tensor, scale: torch.Tensor | float, n: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = +scale if bit i else -scale`` for i < n; fp32 by default, else rounded to out.dtype.

    Example: sign_decompress(tensor([13], dtype=uint8), tensor([1.0]), 4) -> tensor([1.0, -1.0, 1.0, 1.0])
    """
    if bits.dtype != torch.uint8:
        raise TypeError(f"sign_decompress: bits must be uint8, got {bits.dtype}")
    if bits.numel() != (n + 7) // 8:
        raise ValueError(f"sign_decompress: {n} elements need {(n + 7) // 8} bytes, bits has {bits.numel()}")
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor([float(scale)], dtype=torch.float32, device=bits.device)
    if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device != bits.device:
        raise ValueError("sign_decompress: scale must be one fp32 element on the device of bits")
    scale = scale.reshape(1)
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=bits.device)
    else:
        if out.dtype not in OUT_DTYPES:
            raise TypeError(f"sign_decompress: out must be floating, got {out.dtype}")
        if out.numel() != n:
            raise ValueError(f"sign_decompress: out has {out.numel()} elements, n is {n}")
        if out.device != bits.device:
            raise ValueError(f"sign_decompress: out is on {out.device}, bits on {bits.device}")
    check_contiguous("sign_decompress", bits=bits, out=out)
    if not use_triton(bits, out):
        return sign_decompress_reference(bits, scale, n, out=out)
    if n == 0:
        return out
    n_bytes = bits.numel()
    if compiled(bits):
        _tuned("sign_unpack")[lambda meta: (cdiv(n_bytes, meta["BYTES"]),)](bits, scale, out, n, n_bytes)
    else:
        bytes_per_program = _interpreted_bytes("sign_unpack")
        _KERNELS["_sign_unpack_kernel"][(cdiv(n_bytes, bytes_per_program),)](
            bits, scale, out, n, n_bytes, BYTES=bytes_per_program)
    return out


def roundtrip_onebit(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One compress + decompress of ``x`` into ``out`` (a zero residual, updated in scratch), the cost
    the tuner's probe times (the onebit row of ddl_triton/compression_methods.py names it)."""
    bits, scale = sign_compress(x, torch.zeros_like(x, dtype=torch.float32))
    return sign_decompress(bits, scale, x.numel(), out=out)
