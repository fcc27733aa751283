"""The ``@triton.jit`` kernels of int8.py (its docstring has the semantics and the error bound),
imported on first use through _lazy_kernels.py so that importing the launchers does not import triton."""
import triton
import triton.language as tl

from ._rounding import round_to as _round_to


@triton.jit
def _round_half_even(v):
    # No libdevice.rint under the interpreter: round |v| with floor and compares, then restore
    # the sign. a - floor(a) is exact (Sterbenz for a >= 1, trivially for a < 1), so every
    # decision below sees the true fraction; the int32 parity test is exact for |v| < 2**31.
    a = tl.abs(v)
    r = tl.floor(a)
    frac = a - r
    odd = (r.to(tl.int32) & 1) == 1
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    r = tl.where(up, r + 1.0, r)
    return tl.where(v < 0, -r, r)


@triton.jit
def _quantize_tile(x):
    # x: [ROWS, QBLOCK] fp32, zero where masked; returns (q int8 [ROWS, QBLOCK], s fp32 [ROWS]).
    absmax = tl.max(tl.abs(x), axis=1)
    # div_rn: Triton's "/" is an approximate division on NVIDIA; torch's is IEEE-rounded.
    s = tl.math.div_rn(absmax, tl.full(absmax.shape, 127.0, tl.float32))
    s = tl.where(s >= 2.0 ** -126, s, 0.0)
    # Divide by 1 in flushed blocks: |x| < 2**-119 there, so it rounds to 0 like the reference.
    safe = tl.where(s > 0.0, s, 1.0)
    v = tl.math.div_rn(x, tl.broadcast_to(safe[:, None], x.shape))
    q = _round_half_even(v)
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    return q.to(tl.int8), s


@triton.jit
def _block_tile(n_elements, n_blocks, QBLOCK: tl.constexpr, TILE: tl.constexpr):
    """This program's tile of whole blocks: ROWS = ceil(TILE / QBLOCK) blocks of QBLOCK elements.
    Returns (rows, offsets, mask, rmask): the block indices [ROWS], the element offsets
    [ROWS, QBLOCK], and which of them exist."""
    ROWS: tl.constexpr = (TILE + QBLOCK - 1) // QBLOCK
    # int64 offsets: a > 2**31-element bucket must not wrap.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offsets = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    return rows, offsets, offsets < n_elements, rows < n_blocks


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, n_elements, n_blocks,
                     QBLOCK: tl.constexpr, TILE: tl.constexpr):
    # One program quantizes ROWS whole blocks (a [ROWS, QBLOCK] tile of about TILE elements).
    rows, offsets, mask, rmask = _block_tile(n_elements, n_blocks, QBLOCK, TILE)
    # other=0: padding of the short last block must not raise its absmax.
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    q, s = _quantize_tile(x)
    tl.store(q_ptr + offsets, q, mask=mask)
    tl.store(s_ptr + rows, s, mask=rmask)


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, n_elements, n_blocks,
                       QBLOCK: tl.constexpr, TILE: tl.constexpr):
    rows, offsets, mask, rmask = _block_tile(n_elements, n_blocks, QBLOCK, TILE)
    q = tl.load(q_ptr + offsets, mask=mask, other=0).to(tl.float32)
    s = tl.load(s_ptr + rows, mask=rmask, other=0.0)
    # fp32 product first, then one rounding to the out dtype: the reference does the same.
    d = q * s[:, None]
    tl.store(out_ptr + offsets, _round_to(d, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_int8_kernel(q_table, s_table, num_inputs, q_out, s_out, n_elements, n_blocks, scale_ptr,
                        HAS_SCALE: tl.constexpr, QBLOCK: tl.constexpr, TILE: tl.constexpr):
    # The inputs arrive as tables of data_ptr() values (int64), cast back to typed pointers:
    # any number of inputs in one launch, read once each. Works under TRITON_INTERPRET=1 for
    # CPU tensors (the interpreter dereferences raw host addresses).
    ROWS: tl.constexpr = (TILE + QBLOCK - 1) // QBLOCK
    rows, offsets, mask, rmask = _block_tile(n_elements, n_blocks, QBLOCK, TILE)
    acc = tl.zeros([ROWS, QBLOCK], dtype=tl.float32)  # 0 + d0 == d0 exactly
    for i in range(num_inputs):  # list order: the same order on every rank
        qp = tl.load(q_table + i).to(tl.pointer_type(tl.int8))
        sp = tl.load(s_table + i).to(tl.pointer_type(tl.float32))
        q = tl.load(qp + offsets, mask=mask, other=0).to(tl.float32)
        s = tl.load(sp + rows, mask=rmask, other=0.0)
        acc = acc + q * s[:, None]  # launched with fma contraction off: two roundings, as torch
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr)
    q, s = _quantize_tile(acc)
    tl.store(q_out + offsets, q, mask=mask)
    tl.store(s_out + rows, s, mask=rmask)
