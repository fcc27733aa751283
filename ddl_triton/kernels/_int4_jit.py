"""The ``@triton.jit`` kernels of int4.py (its docstring has the semantics, the packing and the error
bound), imported on first use through _lazy_kernels.py so that importing the launchers does not import
triton.

Both kernels see a program's tile of whole blocks as [ROWS, QBLOCK // 2] *pairs*: element 2k is a
byte's low nibble, element 2k + 1 its high nibble, so packing needs no reshape in the kernel (the
interpreter and the compiler agree on plain loads at even and odd offsets)."""
import triton
import triton.language as tl

from ._int8_jit import _round_half_even
from ._rounding import round_to as _round_to


@triton.jit
def _pair_tile(n_elements, n_blocks, QBLOCK: tl.constexpr, TILE: tl.constexpr):
    """This program's blocks as pairs: (rows [ROWS], byte offsets [ROWS, HALF], even element
    offsets [ROWS, HALF], row mask). ROWS = ceil(TILE / QBLOCK) blocks, HALF = QBLOCK // 2 bytes each."""
    ROWS: tl.constexpr = (TILE + QBLOCK - 1) // QBLOCK
    HALF: tl.constexpr = QBLOCK // 2
    # int64 offsets: a > 2**31-element bucket must not wrap.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    bytes_ = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]
    return rows, bytes_, bytes_ * 2, rows < n_blocks


@triton.jit
def _quantize_pack_kernel(x_ptr, p_ptr, s_ptr, scale_ptr, n_elements, n_blocks,
                          HAS_SCALE: tl.constexpr, QBLOCK: tl.constexpr, TILE: tl.constexpr):
    rows, bytes_, even, rmask = _pair_tile(n_elements, n_blocks, QBLOCK, TILE)
    odd = even + 1
    # other=0: the padding of a short last block (or of an odd last byte) must not raise its
    # absmax, and quantizes to 0 (nibble 8), as the reference pads.
    xe = tl.load(x_ptr + even, mask=even < n_elements, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + odd, mask=odd < n_elements, other=0.0).to(tl.float32)
    if HAS_SCALE:  # the server's 1/n, applied to the fp32 sum before quantizing, as the reference
        scale = tl.load(scale_ptr)
        xe = xe * scale
        xo = xo * scale
    absmax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
    # div_rn: Triton's "/" is an approximate division on NVIDIA; torch's is IEEE-rounded.
    s = tl.math.div_rn(absmax, tl.full(absmax.shape, 7.0, tl.float32))
    s = tl.where(s >= 2.0 ** -126, s, 0.0)
    safe = tl.broadcast_to(tl.where(s > 0.0, s, 1.0)[:, None], xe.shape)
    qe = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(xe, safe)), -7.0), 7.0)
    qo = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(xo, safe)), -7.0), 7.0)
    byte = (qe + 8.0).to(tl.int32) | ((qo + 8.0).to(tl.int32) << 4)
    tl.store(p_ptr + bytes_, byte.to(tl.uint8), mask=even < n_elements)
    tl.store(s_ptr + rows, s, mask=rmask)


@triton.jit
def _unpack_dequantize_kernel(p_ptr, s_ptr, out_ptr, n_elements, n_blocks,
                              ACCUMULATE: tl.constexpr, QBLOCK: tl.constexpr, TILE: tl.constexpr):
    rows, bytes_, even, rmask = _pair_tile(n_elements, n_blocks, QBLOCK, TILE)
    odd = even + 1
    emask = even < n_elements
    omask = odd < n_elements
    b = tl.load(p_ptr + bytes_, mask=emask, other=8).to(tl.int32)
    s = tl.load(s_ptr + rows, mask=rmask, other=0.0)[:, None]
    # fp32 product first, then (accumulate: one fp32 add; launched with fma contraction off) one
    # rounding to the out dtype: the reference does the same.
    de = ((b & 15) - 8).to(tl.float32) * s
    do = ((b >> 4) - 8).to(tl.float32) * s
    if ACCUMULATE:  # out is fp32 here (the launcher checks)
        de = tl.load(out_ptr + even, mask=emask, other=0.0) + de
        do = tl.load(out_ptr + odd, mask=omask, other=0.0) + do
    tl.store(out_ptr + even, _round_to(de, out_ptr.dtype.element_ty), mask=emask)
    tl.store(out_ptr + odd, _round_to(do, out_ptr.dtype.element_ty), mask=omask)
