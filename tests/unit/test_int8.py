"""The int8 kernels (ddl_triton/kernels/int8.py: quantize_int8, dequantize_int8, reduce_int8) against
their torch references (bitwise), a float64 oracle and the stated error bound.

Every check runs twice, through the ``backend`` fixture: on the Triton kernels (under
TRITON_INTERPRET=1, set in conftest.py) and on the torch path, with every output poisoned
(tests/support/kernel_checks.py).
"""
from __future__ import annotations

import pytest
import torch

import ddl_triton.kernels as K
from support.kernel_checks import (DTYPES, SIZES, assert_bitwise, assert_within, backend, gamma,  # noqa: F401
                                   make, poison_empty, poisoned)

INT8_SLACK = 0.5 + 2.0 ** -16  # the stated int8 bound, in units of the block's scale


# ------------------------------------------------------------------------------------------
# int8 quantization
# ------------------------------------------------------------------------------------------

def _int8_oracle(x: torch.Tensor, block: int):
    """Scales and q from float64 arithmetic (fp64 -> fp32 double rounding of a quotient of fp32
    values is innocuous: 53 >= 2*24 + 2), rounding where the contract rounds."""
    n = x.numel()
    nb = (n + block - 1) // block
    xd = torch.zeros(nb * block, dtype=torch.float64)
    xd[:n] = x.reshape(-1).double()
    xb = xd.view(nb, block)
    s = (xb.abs().amax(dim=1) / 127).float().double()
    s[s < 2.0 ** -126] = 0.0
    v = (xb / torch.where(s > 0, s, 1.0)[:, None]).float().double()
    q = torch.round(v).clamp(-127, 127)  # round half to even
    return q.reshape(-1)[:n], s


def check_int8_bound(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: int, what: str) -> None:
    """The stated bound: |fp32(q*s) - x| <= s*(1/2 + 2**-16); flushed blocks (s = 0) hold |x| < 2**-119."""
    n = x.numel()
    sd = s.double().repeat_interleave(block)[:n]
    d = (q.reshape(-1).double() * sd).float().double()  # fp32(q*s): exact product, one rounding
    xd = x.reshape(-1).double()
    bound = torch.where(sd > 0, sd * INT8_SLACK, torch.full_like(sd, 2.0 ** -119))
    assert_within(d, xd, bound, what)
    flushed = sd == 0
    assert bool((q.reshape(-1)[flushed] == 0).all()), f"{what}: q != 0 in a block with scale 0"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_int8(backend, n, dtype):
    x = make(n, dtype, 1).reshape(-1, 1) if n else make(n, dtype, 1)
    q, s = K.quantize_int8(x, block=256)
    assert q.shape == x.shape and q.dtype == torch.int8
    assert s.shape == ((n + 255) // 256,) and s.dtype == torch.float32
    q_ref, s_ref = K.quantize_int8_reference(x, block=256)
    assert_bitwise(q, q_ref, "q vs reference")
    assert_bitwise(s, s_ref, "scales vs reference")
    q_or, s_or = _int8_oracle(x, 256)
    assert_bitwise(s, s_or.float(), "scales vs float64 oracle")
    assert_bitwise(q.reshape(-1), q_or.to(torch.int8), "q vs float64 oracle")
    check_int8_bound(x, q, s, 256, "int8 error bound")


@pytest.mark.parametrize("block", [1, 8, 64, 4096])
def test_quantize_int8_block_sizes(backend, block):
    x = make(4097, torch.float32, 2)
    q, s = K.quantize_int8(x, block=block)
    q_ref, s_ref = K.quantize_int8_reference(x, block=block)
    assert_bitwise(q, q_ref, "q vs reference")
    assert_bitwise(s, s_ref, "scales vs reference")
    check_int8_bound(x, q, s, block, "int8 error bound")
    d = poisoned(4097, torch.float32)
    K.dequantize_int8(q, s, out=d, block=block)
    assert_bitwise(d, (q.double() * s.double().repeat_interleave(block)[:4097]).float(), "dequant vs oracle")


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_int8_special_blocks(backend, dtype):
    block = 8
    big = {torch.float32: 3.0e38, torch.float16: 65504.0, torch.bfloat16: 3.0e38}[dtype]
    tiny = {torch.float32: 1e-38, torch.float16: 6e-8, torch.bfloat16: 1e-38}[dtype]
    rows = [
        [0.0] * 8,                                             # all zero: scale 0, q 0
        [127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5],         # scale 1: ties to even
        [big, -big, big / 3, 0.0, 1.0, -1.0, big / 7, -big],   # largest finite magnitudes
        [tiny, -tiny, 0.0, tiny, tiny, 0.0, 0.0, -tiny],       # fp32/bf16: scale would be subnormal
        [-1.0, 1.0, 0.25, -0.125, 0.0, 0.75, 0.5, 0.375],      # -x and x at the absmax
        [1.0, 2.0, 3.0],                                       # short last block
    ]
    x = torch.tensor([v for r in rows for v in r], dtype=torch.float64).to(dtype)
    q, s = K.quantize_int8(x, block=block)
    q_ref, s_ref = K.quantize_int8_reference(x, block=block)
    assert_bitwise(q, q_ref, "q vs reference")
    assert_bitwise(s, s_ref, "scales vs reference")
    q_or, s_or = _int8_oracle(x, block)
    assert_bitwise(s, s_or.float(), "scales vs float64 oracle")
    assert_bitwise(q, q_or.to(torch.int8), "q vs float64 oracle")
    check_int8_bound(x, q, s, block, "int8 error bound")
    assert q[:8].tolist() == [0] * 8 and s[0].item() == 0.0
    assert s[1].item() == 1.0 and q[8:16].tolist() == [127, 2, 4, -2, -4, 0, 0, 2]
    if dtype != torch.float16:  # fp16's smallest values still give a normal fp32 scale
        assert s[3].item() == 0.0 and q[24:32].tolist() == [0] * 8
    assert q[16].item() == 127 and q[17].item() == -127 and q[23].item() == -127
    assert q[32].item() == -127 and q[33].item() == 127
    assert q[40:43].tolist() == [42, 85, 127]


def test_int8_bound_needs_the_fp32_slack(backend):
    # Found by search: t = x/s is just below 67.5, fp32(t) = 67.5 rounds (to even) up to 68, and
    # fp32(q*s) rounds further out: the error exceeds s/2 by 5.5e-6*s, inside s*(1/2 + 2**-16).
    x = torch.tensor([float.fromhex("0x1.7497e2p+0"), float.fromhex("0x1.8c105p-1")], dtype=torch.float32)
    q, s = K.quantize_int8(x, block=2)
    assert q.tolist() == [127, 68]
    d = (q.double() * s.double()).float().double()
    err = abs(d[1].item() - x[1].double().item())
    assert err > s.item() / 2
    assert err <= s.item() * INT8_SLACK
    check_int8_bound(x, q, s, 2, "int8 error bound")


def test_int8_bound_checker_can_fail():
    x = make(4097, torch.float32, 3)
    q, s = K.quantize_int8_reference(x)
    check_int8_bound(x, q, s, 256, "unperturbed")
    bad = q.clone()
    i = int((bad.abs() < 100).nonzero()[7, 0])
    bad[i] += 1
    with pytest.raises(AssertionError, match="out of bound"):
        check_int8_bound(x, bad, s, 256, "perturbed")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("out_dtype", [None, torch.float64] + DTYPES)
def test_dequantize_int8(backend, n, out_dtype):
    x = make(n, torch.float32, 4)
    q, s = K.quantize_int8_reference(x)
    out = None if out_dtype is None else poisoned(n, out_dtype)
    d = K.dequantize_int8(q, s, out=out)
    assert out is None or d is out
    assert d.dtype == (out_dtype or torch.float32) and d.shape == q.shape
    ref = K.dequantize_int8_reference(q, s, out=None if out is None else poisoned(n, out_dtype))
    assert_bitwise(d, ref, "dequant vs reference")
    # The oracle: the exact product (8 x 24 bits fits float64), rounded to fp32, then to out once.
    d32 = (q.double() * s.double().repeat_interleave(256)[:n]).float()
    assert_bitwise(d, d32.to(d.dtype), "dequant vs float64 oracle")
    check_int8_bound(x, q, s, 256, "int8 error bound")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("k,scale", [(1, None), (2, None), (2, 0.5), (3, 1 / 3), (10, 0.1)])
def test_reduce_int8(backend, n, k, scale):
    block = 256
    xs = [make(n, torch.float32, 300 + i, spread=2) for i in range(k)]
    pairs = [K.quantize_int8_reference(x, block=block) for x in xs]
    qs, ss = [p[0] for p in pairs], [p[1] for p in pairs]
    q, s = K.reduce_int8(qs, ss, block=block, scale=scale)
    q_ref, s_ref = K.reduce_int8_reference(qs, ss, block=block, scale=scale)
    assert_bitwise(q, q_ref, "q vs reference")
    assert_bitwise(s, s_ref, "scales vs reference")
    # Oracle: the exact sum of the exact products; the fp32 pipeline adds gamma_{k+1} (k product
    # roundings folded with k-1 sums, plus the multiply), then the int8 bound of the result.
    terms = [qi.double() * si.double().repeat_interleave(block)[:n] for qi, si in zip(qs, ss)]
    exact = sum(terms[1:], terms[0].clone())
    mag = sum((t.abs() for t in terms[1:]), terms[0].abs())
    if scale is not None:
        exact, mag = exact * scale, mag * abs(scale)
    d = (q.double() * s.double().repeat_interleave(block)[:n]).float().double()
    bound = gamma(k + 2) * mag + s.double().repeat_interleave(block)[:n] * INT8_SLACK
    assert_within(d, exact, bound, "reduce_int8 vs float64 oracle")


def test_reduce_int8_rejects_mismatch(backend):
    q, s = K.quantize_int8_reference(torch.ones(300))
    with pytest.raises(ValueError, match="elements"):
        K.reduce_int8([q, q[:10]], [s, s[:1]])
    with pytest.raises(ValueError, match="scales"):
        K.reduce_int8([q], [s[:1]])
    with pytest.raises(ValueError, match="contiguous"):
        K.quantize_int8(torch.zeros(8, 2)[:, 0])
    with pytest.raises(ValueError, match="power of two"):
        K.quantize_int8(torch.zeros(8), block=100)


def test_int8_payload_ratio():
    n = 1 << 20
    int8_bytes = n + 4 * ((n + 255) // 256)
    assert 4 * n / int8_bytes >= 3.9
    q, s = K.quantize_int8_reference(torch.zeros(n))
    assert q.numel() * q.element_size() + s.numel() * s.element_size() == int8_bytes


@pytest.mark.parametrize("n", [0, 1, 257, 1031])
def test_quantize_and_reduce_int8_write_into_out(backend, n):
    """out=(q, scales) receives exactly what the returned tensors would hold, and is returned."""
    x = make(n, torch.float32, 7)
    nb = (n + 255) // 256
    q_new, s_new = K.quantize_int8(x)
    q_out, s_out = poisoned(n, torch.int8), poisoned(nb, torch.float32)
    q, s = K.quantize_int8(x, out=(q_out, s_out))
    assert q is q_out and s is s_out
    assert_bitwise(q_out, q_new, "quantize out= q")
    assert_bitwise(s_out, s_new, "quantize out= scales")
    qs, ss = [q_new, q_new], [s_new, s_new]
    r_new = K.reduce_int8(qs, ss, scale=0.5)
    r_out = (poisoned(n, torch.int8), poisoned(nb, torch.float32))
    assert K.reduce_int8(qs, ss, scale=0.5, out=r_out)[0] is r_out[0]
    assert_bitwise(r_out[0], r_new[0], "reduce out= q")
    assert_bitwise(r_out[1], r_new[1], "reduce out= scales")


@pytest.mark.parametrize("n", SIZES)
def test_quantize_int8_keep_error_is_quantize_then_subtract_bitwise(backend, n):
    """Error feedback's step equals quantize_int8 then v -= dequantize_int8(q, s), bit for bit,
    including a block flushed to scale 0 (its values stay in v whole)."""
    v = make(n, torch.float32, 11)
    if n > 300:
        v[256:300] *= 1e-38  # a block of tiny values: scale 0, q 0
    expect_q, expect_s = K.quantize_int8(v)
    expect_v = v - K.dequantize_int8(expect_q, expect_s)
    nb = (n + 255) // 256
    out = (poisoned(n, torch.int8), poisoned(nb, torch.float32))
    got = v.clone()
    q, s = K.quantize_int8_keep_error(got, out=out)
    assert q is out[0] and s is out[1]
    assert_bitwise(q, expect_q, "keep_error q")
    assert_bitwise(s, expect_s, "keep_error scales")
    assert_bitwise(got, expect_v, "keep_error: what is left in v")
    with pytest.raises(TypeError, match="fp32"):
        K.quantize_int8_keep_error(v.to(torch.float16), out=(torch.empty(n, dtype=torch.int8), torch.empty(nb)))


def test_int8_out_is_checked(backend):
    x = torch.ones(300)
    with pytest.raises(TypeError, match=r"out must be \(int8, fp32\)"):
        K.quantize_int8(x, out=(torch.empty(300), torch.empty(2)))
    with pytest.raises(ValueError, match="300 values and 2 scales, got 300 and 1"):
        K.quantize_int8(x, out=(torch.empty(300, dtype=torch.int8), torch.empty(1)))
    with pytest.raises(TypeError, match="tuple"):
        K.quantize_int8(x, out=torch.empty(300, dtype=torch.int8))
    with pytest.raises(ValueError, match="contiguous"):
        K.quantize_int8(x, out=(torch.empty(600, dtype=torch.int8)[::2], torch.empty(2)))
    q, s = K.quantize_int8_reference(x)
    with pytest.raises(ValueError, match="300 values and 2 scales"):
        K.reduce_int8([q], [s], out=(torch.empty(299, dtype=torch.int8), torch.empty(2)))


def test_interpreted_kernels_may_launch_from_two_threads_at_once(monkeypatch):
    # The interpreter patches triton.language while a kernel runs: two threads interpreting at
    # once (a background thread's dequantize beside the next bucket's quantize) failed with
    # "Did you forget to add @triton.jit ?". Launches through LazyKernels take turns instead.
    import threading

    from ddl_triton.kernels import _dispatch
    monkeypatch.setattr(_dispatch, "_backend", "triton")
    inputs = [torch.randn(8192, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    alone = [K.dequantize_int8(*K.quantize_int8(x)) for x in inputs]
    results, errors = {}, []

    def work(i):
        try:
            for _ in range(4):
                results[i] = K.dequantize_int8(*K.quantize_int8(inputs[i]))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    for i in range(2):
        assert torch.equal(results[i], alone[i])
