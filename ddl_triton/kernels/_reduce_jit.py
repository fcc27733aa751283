"""The ``@triton.jit`` kernel of reduce.py (its docstring has the semantics), imported on first use
through _lazy_kernels.py so that importing the launcher does not import triton."""
import triton
import triton.language as tl

from ._rounding import round_to


@triton.jit
def _combine(acc, x, OP: tl.constexpr):
    if OP == 0:
        return acc + x
    elif OP == 1:
        return tl.minimum(acc, x)
    else:
        return tl.maximum(acc, x)


@triton.jit
def _reduce_kernel(out_ptr, in0, in1, in2, in3, in4, in5, in6, in7, n_elements, scale_ptr,
                   NUM_INPUTS: tl.constexpr, OP: tl.constexpr, HAS_SCALE: tl.constexpr,
                   ACC_FP32: tl.constexpr, BLOCK: tl.constexpr):
    # int64 offsets: a > 2**31-element bucket must not wrap.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    acc = tl.load(in0 + offsets, mask=mask)
    if ACC_FP32:
        acc = acc.to(tl.float32)
    # static_range unrolls: unused pointer slots are never touched.
    for i in tl.static_range(1, NUM_INPUTS):
        if i == 1:
            ptr = in1
        elif i == 2:
            ptr = in2
        elif i == 3:
            ptr = in3
        elif i == 4:
            ptr = in4
        elif i == 5:
            ptr = in5
        elif i == 6:
            ptr = in6
        else:
            ptr = in7
        x = tl.load(ptr + offsets, mask=mask)
        if ACC_FP32:
            x = x.to(tl.float32)
        acc = _combine(acc, x, OP)
    if HAS_SCALE:
        # Loaded from memory in the accumulator dtype: a Python float argument would be
        # truncated to fp32, which would differ from the torch path for fp64.
        acc = acc * tl.load(scale_ptr)
    tl.store(out_ptr + offsets, round_to(acc, out_ptr.dtype.element_ty), mask=mask)
