"""fp32 -> storage dtype conversion, rounded to nearest even on every backend."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    # fp32 -> DTYPE, round to nearest even. bf16 by hand: the Triton 3.9 interpreter truncates
    # fp32 -> bf16 casts (its cast_impl passes no rounding mode), while a GPU's cvt.rn and torch
    # round to nearest even; the bit trick below is what both compute, on either.
    if DTYPE == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)  # a carry into the exponent is the correct rounding
        b = tl.where(x != x, 0x7FC00000, b)  # keep NaN a NaN (payload bits may be low only)
        return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)
