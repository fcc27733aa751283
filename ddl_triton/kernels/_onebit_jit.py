"""The ``@triton.jit`` kernels of onebit.py (its docstring has the semantics), imported on first use
through _lazy_kernels.py so that importing the launchers does not import triton."""
import triton
import triton.language as tl

from ._rounding import round_to as _round_to


@triton.jit
def _add_into_kernel(x_ptr, r_ptr, n_elements, BLOCK: tl.constexpr):
    # r = fp32(x) + r, in place: the 1-bit compressor's v, needed whole before its scale exists.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    r = tl.load(r_ptr + offsets, mask=mask)
    tl.store(r_ptr + offsets, r + x, mask=mask)


@triton.jit
def _sign_pack_kernel(v_ptr, bits_ptr, scale_ptr, n_elements, n_bytes, BYTES: tl.constexpr):
    # One program packs BYTES bytes: a [BYTES, 8] tile of v, one row per output byte.
    byte_idx = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    lane = tl.arange(0, 8)
    offsets = byte_idx[:, None] * 8 + lane[None, :]
    mask = offsets < n_elements
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0)
    s = tl.load(scale_ptr)
    pos = v >= 0.0
    d = tl.where(pos, s, -s)
    tl.store(v_ptr + offsets, v - d, mask=mask)  # the new residual, in place over v
    # Masked lanes must be 0 bits, or the padding of the last byte would depend on memory.
    bit = (pos & mask).to(tl.int32) << lane[None, :]
    byte = tl.sum(bit, axis=1)  # distinct powers of two: the sum is the bitwise or
    tl.store(bits_ptr + byte_idx, byte.to(tl.uint8), mask=byte_idx < n_bytes)


@triton.jit
def _sign_unpack_kernel(bits_ptr, scale_ptr, out_ptr, n_elements, n_bytes, BYTES: tl.constexpr):
    byte_idx = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    lane = tl.arange(0, 8)
    offsets = byte_idx[:, None] * 8 + lane[None, :]
    byte = tl.load(bits_ptr + byte_idx, mask=byte_idx < n_bytes, other=0).to(tl.int32)
    bit = (byte[:, None] >> lane[None, :]) & 1
    s = tl.load(scale_ptr)
    d = tl.where(bit != 0, s, -s)
    tl.store(out_ptr + offsets, _round_to(d, out_ptr.dtype.element_ty), mask=offsets < n_elements)
