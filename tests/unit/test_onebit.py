"""The 1-bit kernels (ddl_triton/kernels/onebit.py: sign_compress, sign_decompress) against their
torch references (bitwise), a float64 / numpy oracle and the stated exactness of error feedback.

Every check runs twice, through the ``backend`` fixture: on the Triton kernels (under
TRITON_INTERPRET=1, set in conftest.py) and on the torch path, with every output poisoned
(tests/support/kernel_checks.py).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import ddl_triton.kernels as K
from support.kernel_checks import (DTYPES, SIZES, assert_bitwise, assert_within, backend, gamma,  # noqa: F401
                                   make, poison_empty, poisoned)


# ------------------------------------------------------------------------------------------
# 1-bit sign compression
# ------------------------------------------------------------------------------------------

def _pack_bits_oracle(v32: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.packbits((v32 >= 0).numpy(), bitorder="little"))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sign_compress(backend, n, dtype):
    x = make(n, dtype, 5, spread=3)
    r_old = make(n, torch.float32, 6, spread=3) * 0.5
    residual = r_old.clone()
    bits, scale = K.sign_compress(x, residual)
    r_ref = r_old.clone()
    bits_ref, scale_ref = K.sign_compress_reference(x, r_ref)
    assert bits.dtype == torch.uint8 and bits.shape == ((n + 7) // 8,)
    assert_bitwise(bits, bits_ref, "bits vs reference")
    assert_bitwise(scale, scale_ref, "scale vs reference")
    assert_bitwise(residual, r_ref, "residual vs reference")

    # Oracle. v = fp32(x + r): the float64 sum is exact here (exponents within 29 bits).
    v64 = x.double() + r_old.double()
    v32 = v64.float()
    assert_bitwise(bits, _pack_bits_oracle(v32), "bits vs numpy.packbits oracle")
    mean = v32.double().abs().mean().item() if n else 0.0
    # Worst case of the two-level fp32 sum (4096 per row, then the rows), and the division.
    assert abs(scale.item() - mean) <= gamma(4096 + 64) * mean, (scale.item(), mean)
    assert abs(scale.item() - mean) <= 1e-6 * mean, (scale.item(), mean)  # what it does in practice
    d64 = torch.where(v32 >= 0, scale.double(), -scale.double())
    assert_bitwise(residual, (v32.double() - d64).float(), "residual == fp32(v - d)")
    # Exact where Sterbenz applies (scale/2 <= |v| <= 2*scale); elsewhere within one fp32 rounding.
    s = scale.double().item()
    sterbenz = (v32.double().abs() >= s / 2) & (v32.double().abs() <= 2 * s) | (v32 == 0)
    recon = d64 + residual.double()
    assert bool((recon[sterbenz] == v32.double()[sterbenz]).all()), "d + residual != v where Sterbenz applies"
    assert_within(recon, v32.double(), 2.0 ** -24 * (v32.double() - d64).abs(), "d + residual vs v")

    out = poisoned(n, torch.float32)
    assert K.sign_decompress(bits, scale, n, out=out) is out
    assert_bitwise(out, d64.float(), "sign_decompress vs oracle")
    assert_bitwise(K.sign_decompress(bits, scale, n), d64.float(), "sign_decompress (own out) vs oracle")
    if dtype != torch.float32:
        out16 = poisoned(n, dtype)
        K.sign_decompress(bits, scale, n, out=out16)
        assert_bitwise(out16, d64.float().to(dtype), "sign_decompress to 16-bit")
        assert_bitwise(out16, K.sign_decompress_reference(bits, scale, n, out=poisoned(n, dtype)), "vs reference")


def test_sign_compress_counts_signed_zeros_as_positive(backend):
    # v = x + residual is -0.0 where both are -0.0 (a ReLU's gradient can be -0.0): v >= 0 holds
    # there, so its bit is 1 and its residual v - scale; a sign-bit test would flip both.
    x = torch.tensor([-0.0, -0.0, 0.0, -0.0, 1.5, -2.5, -0.0, 3.0, -0.0])
    r_old = torch.tensor([-0.0, 0.0, -0.0, 0.5, -0.0, 0.0, -0.0, -0.0, -1.0])
    residual = r_old.clone()
    bits, scale = K.sign_compress(x, residual)
    v32 = x + r_old
    assert_bitwise(bits, _pack_bits_oracle(v32), "bits vs numpy.packbits oracle")
    d64 = torch.where(v32 >= 0, scale.double(), -scale.double())
    assert_bitwise(residual, (v32.double() - d64).float(), "residual == fp32(v - d)")
    r_ref = r_old.clone()
    bits_ref, _ = K.sign_compress_reference(x, r_ref)
    assert_bitwise(bits, bits_ref, "bits vs reference")
    assert_bitwise(residual, r_ref, "residual vs reference")


def test_sign_compress_exactness_claim_is_not_universal(backend):
    # |v| far below the scale: v - d needs more than 24 bits, so no fp32 residual reconstructs v.
    x = torch.tensor([1e-10, 4.0, -4.0, 1.0])
    residual = torch.zeros(4)
    bits, scale = K.sign_compress(x, residual)
    assert scale.item() == pytest.approx(2.25)
    assert bits.tolist() == [0b1011]
    d = K.sign_decompress(bits, scale, 4)
    assert (d + residual)[0].item() != 1e-10 and (d + residual)[3].item() == 1.0


def test_sign_compress_out_and_padding(backend):
    n = 13  # the second byte has 3 pad bits, which must be 0 even when out held 1s
    x = torch.ones(n)
    out = torch.full((2,), 0xFF, dtype=torch.uint8)
    bits, _ = K.sign_compress(x, torch.zeros(n), out=out)
    assert bits is out and out.tolist() == [0xFF, 0x1F]


def test_sign_error_feedback_telescopes(backend):
    # Over steps, sum(decompressed) + final residual tracks sum(x): nothing is lost but rounding.
    n, steps = 127, 6
    residual = torch.zeros(n)
    total_x, total_d = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    mags = torch.zeros(n, dtype=torch.float64)
    for t in range(steps):
        x = make(n, torch.float32, 700 + t, spread=2)
        bits, scale = K.sign_compress(x, residual)
        d = K.sign_decompress(bits, scale, n).double()
        total_x += x.double()
        total_d += d
        mags += x.double().abs() + d.abs() + residual.double().abs()
    drift = (total_d + residual.double() - total_x).abs()
    assert bool((drift <= 4 * 2.0 ** -24 * mags).all())


def test_sign_rejects_bad_input(backend):
    with pytest.raises(TypeError, match="fp32"):
        K.sign_compress(torch.zeros(8), torch.zeros(8, dtype=torch.float16))
    with pytest.raises(ValueError, match="elements"):
        K.sign_compress(torch.zeros(8), torch.zeros(9))
    with pytest.raises(ValueError, match="contiguous"):
        K.sign_compress(torch.zeros(8, 2)[:, 0], torch.zeros(8))
    with pytest.raises(ValueError, match="bytes"):
        K.sign_decompress(torch.zeros(3, dtype=torch.uint8), torch.ones(1), 8)


def test_onebit_payload_ratio():
    n = 1 << 20
    sign_bytes = (n + 7) // 8 + 4
    assert 4 * n / sign_bytes >= 25
    assert math.isclose(4 * n / sign_bytes, 32, rel_tol=1e-4)
