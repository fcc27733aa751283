"""CUDA test tier: the compiled Triton kernels on CUDA tensors, bitwise against their torch references.

The CPU tier (tests/unit/test_kernels.py, test_int8.py, test_onebit.py) runs the same kernels under
TRITON_INTERPRET=1; this module runs them compiled on a GPU, at sizes the interpreter cannot reach:
2**24+3 elements for reduce, 2**24+5 for the int8 and 1-bit kernels, and 2**31+17 fp16 elements
(int64 offsets) when the GPU has >= 40 GiB. The references run on the same CUDA tensors, the comparison the kernels' docstrings
promise ("bitwise-identical results on one device"). Outputs are poisoned (NaN / sentinel values),
including the ones the launchers allocate, so an element a kernel never writes cannot pass.

tests/conftest.py sets TRITON_INTERPRET=1 for the whole session, which would run these kernels
under the interpreter, so on a GPU machine run this file without it:

    env -u TRITON_INTERPRET python -m pytest -q --noconftest tests/gpu/test_gpu.py

(bench/gpu_check.py does exactly that.) On a machine without CUDA every test skips. The default
tests are sized to take well under a minute on an H200, Triton compilation included.
"""
from __future__ import annotations

import pytest
import torch

import ddl_triton.kernels as K
from ddl_triton.kernels._dispatch import interpreting
from support.sentinels import real_empty, sentinel

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA GPU: the Triton kernels run on CUDA only here; their CPU coverage is "
                              "tests/unit/test_kernels.py, test_int8.py and test_onebit.py under TRITON_INTERPRET=1"),
    pytest.mark.skipif(torch.cuda.is_available() and interpreting(),
                       reason="TRITON_INTERPRET is set (tests/conftest.py sets it for the CPU tier), so the kernels "
                              "would run under the interpreter, not compiled: run `env -u TRITON_INTERPRET python -m "
                              "pytest --noconftest tests/gpu/test_gpu.py`, or bench/gpu_check.py"),
]

DEVICE = "cuda"
LARGE = 2 ** 24 + 3        # reduce: odd, so the last program is partial
LARGE_INT8 = 2 ** 24 + 5   # int8 / 1-bit: a short last int8 block and a partial last sign byte
REDUCE_SIZES = [0, 1, 4097, LARGE]
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
REDUCE_DTYPES = FLOATS + [torch.int32, torch.int64]
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ------------------------------------------------------------------------------------------
# fixtures and helpers
# ------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def triton_backend():
    """Every launcher takes the Triton kernel, whatever DDL_KERNELS says."""
    K.set_backend("triton")
    yield
    K.set_backend("auto")






@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """The launchers allocate their outputs with torch.empty: make unwritten elements visible."""
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: sentinel(real_empty(*args, **kwargs)))


def poisoned(n: int, dtype: torch.dtype) -> torch.Tensor:
    return sentinel(real_empty(n, dtype=dtype, device=DEVICE))


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal bits: -0.0 vs 0.0 and NaN (an unwritten, poisoned element) count as differences."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        f"{what}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}"
    a = actual.contiguous().view(_INT_VIEW[actual.element_size()])
    e = expected.contiguous().view(_INT_VIEW[expected.element_size()])
    if not torch.equal(a, e):
        bad = (a != e).nonzero()
        i = int(bad[0, 0]) if actual.dim() else 0
        pytest.fail(f"{what}: {bad.shape[0]} of {actual.numel()} elements differ; first at [{i}]: "
                    f"{actual.reshape(-1)[i].item()!r} vs {expected.reshape(-1)[i].item()!r}")


def make(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random data on the GPU: normal floats over a few binades, integers that cannot overflow a sum of 10."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.randn(n, generator=g, device=DEVICE) * 2.0 ** torch.randint(-6, 7, (n,), generator=g, device=DEVICE)
        return x.to(dtype)
    bound = 2 ** 20 if dtype == torch.int32 else 2 ** 40
    return torch.randint(-bound, bound, (n,), generator=g, device=DEVICE, dtype=dtype)


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------------
# reduce
# ------------------------------------------------------------------------------------------

def check_reduce(inputs: list[torch.Tensor], op: str, scale: float | None, what: str) -> None:
    n, dtype = inputs[0].numel(), inputs[0].dtype
    expected = K.reduce_reference(poisoned(n, dtype), inputs, op=op, scale=scale)
    out = K.reduce(poisoned(n, dtype), inputs, op=op, scale=scale)
    assert_bitwise(out, expected, what)


@pytest.mark.parametrize("n", REDUCE_SIZES)
@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", K.REDUCE_OPS)
def test_reduce_sizes_dtypes(n, dtype, op):
    inputs = [make(n, dtype, seed) for seed in range(3)]
    check_reduce(inputs, op, None, f"reduce {op} k=3 {dtype} n={n}")


# Each distinct arity is another compiled kernel (and autotuning run): these cover one input,
# the one-launch arities up to the 8 pointer slots, and 9 and 10, which chain through an fp32
# accumulator beside the 16-bit inputs.
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 9, 10])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_reduce_arity(k, dtype):
    inputs = [make(4097, dtype, seed) for seed in range(k)]
    check_reduce(inputs, "sum", None, f"reduce sum k={k} {dtype}")
    check_reduce(inputs, "sum", 0.25, f"reduce sum k={k} {dtype} scale=0.25")


@pytest.mark.parametrize("n", [4097, LARGE])
@pytest.mark.parametrize("dtype", FLOATS + [torch.float64], ids=dtype_id)
@pytest.mark.parametrize("op,scale", [("sum", 1 / 3), ("max", 1 / 7)])
def test_reduce_with_scale(n, dtype, op, scale):
    inputs = [make(n, dtype, seed) for seed in range(4)]
    check_reduce(inputs, op, scale, f"reduce {op} scale={scale} {dtype} n={n}")


@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("k", [2, 9])
def test_reduce_out_aliases_first_input(dtype, k):
    """In-place accumulation, as the ring does it: out is inputs[0]."""
    n = 4097
    inputs = [make(n, dtype, seed) for seed in range(k)]
    scale = 0.5 if dtype.is_floating_point else None
    expected = K.reduce_reference(poisoned(n, dtype), [x.clone() for x in inputs], op="sum", scale=scale)
    out = K.reduce(inputs[0], inputs, op="sum", scale=scale)
    assert out.data_ptr() == inputs[0].data_ptr()
    assert_bitwise(out, expected, f"reduce sum k={k} {dtype} into inputs[0]")


_BEYOND_INT32 = 2 ** 31 + 17
_LARGE_CASE_MEMORY = 40 * 2 ** 30


def _gpu_memory() -> int:
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0


@pytest.mark.skipif(torch.cuda.is_available() and _gpu_memory() < _LARGE_CASE_MEMORY,
                    reason=f"needs a GPU with >= 40 GiB: three {_BEYOND_INT32}-element fp16 tensors take ~12 GiB "
                           f"(this one has {_gpu_memory() / 2 ** 30:.0f} GiB)")
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_beyond_int32_offsets(op):
    """2**31+17 elements: the kernel's int64 offsets must not wrap at 2**31.

    Integer-valued inputs in [-512, 512) make every fp16 sum exact (|a + b| <= 1024 < 2048), so the
    reference computed on slices is the whole truth there; slices avoid a second 12 GiB. The last
    1M elements straddle index 2**31, where int32 offsets would wrap.
    """
    n = _BEYOND_INT32
    g = torch.Generator(device=DEVICE).manual_seed(7)
    a = real_empty(n, dtype=torch.float16, device=DEVICE).random_(-512, 512, generator=g)
    b = real_empty(n, dtype=torch.float16, device=DEVICE).random_(-512, 512, generator=g)
    out = poisoned(n, torch.float16)
    K.reduce(out, [a, b], op=op)
    window = 2 ** 20
    samples = {"first 1M": slice(0, window), "last 1M": slice(n - window, n),
               "every 4099th": slice(0, n, 4099), "around 2**31": slice(2 ** 31 - 4096, 2 ** 31 + 17)}
    for name, where in samples.items():
        sa, sb = a[where].contiguous(), b[where].contiguous()
        expected = K.reduce_reference(torch.empty_like(sa), [sa, sb], op=op)
        assert_bitwise(out[where].contiguous(), expected, f"reduce {op} n=2**31+17, {name}")
    del a, b, out
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------
# int8
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS, ids=dtype_id)
def test_quantize_int8_large(dtype):
    x = make(LARGE_INT8, dtype, 11)
    q_ref, s_ref = K.quantize_int8_reference(x, block=256)
    q, s = K.quantize_int8(x, block=256)
    assert_bitwise(q, q_ref, f"quantize_int8 q {dtype}")
    assert_bitwise(s, s_ref, f"quantize_int8 scales {dtype}")


@pytest.mark.parametrize("block", [1, 8, 64, 4096, 1 << 16])
def test_quantize_int8_block_sizes(block):
    x = make(65537, torch.float32, 12)
    x[:block] = 0.0  # an all-zero block: scale 0, q 0
    q_ref, s_ref = K.quantize_int8_reference(x, block=block)
    q, s = K.quantize_int8(x, block=block)
    assert_bitwise(q, q_ref, f"quantize_int8 q block={block}")
    assert_bitwise(s, s_ref, f"quantize_int8 scales block={block}")


@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=lambda d: "default" if d is None else dtype_id(d))
def test_dequantize_int8_large(out_dtype):
    q, s = K.quantize_int8_reference(make(LARGE_INT8, torch.float32, 13), block=256)
    if out_dtype is None:
        expected = K.dequantize_int8_reference(q, s, block=256)
        out = K.dequantize_int8(q, s, block=256)
    else:
        expected = K.dequantize_int8_reference(q, s, out=poisoned(LARGE_INT8, out_dtype), block=256)
        out = K.dequantize_int8(q, s, out=poisoned(LARGE_INT8, out_dtype), block=256)
    assert_bitwise(out, expected, f"dequantize_int8 -> {out_dtype}")


@pytest.mark.parametrize("k,scale", [(1, None), (2, None), (2, 0.5), (3, 1 / 3), (10, 0.1)])
def test_reduce_int8_large(k, scale):
    pairs = [K.quantize_int8_reference(make(LARGE_INT8, torch.float32, 20 + i), block=256) for i in range(k)]
    qs, scales = [q for q, _ in pairs], [s for _, s in pairs]
    q_ref, s_ref = K.reduce_int8_reference(qs, scales, block=256, scale=scale)
    q, s = K.reduce_int8(qs, scales, block=256, scale=scale)
    assert_bitwise(q, q_ref, f"reduce_int8 q k={k} scale={scale}")
    assert_bitwise(s, s_ref, f"reduce_int8 scales k={k} scale={scale}")


# ------------------------------------------------------------------------------------------
# 1-bit
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS, ids=dtype_id)
def test_sign_compress_large(dtype):
    x = make(LARGE_INT8, dtype, 30)
    residual = make(LARGE_INT8, torch.float32, 31) * 0.01  # a carried-over error, as after a step
    residual_ref = residual.clone()
    bits_ref, scale_ref = K.sign_compress_reference(x, residual_ref)
    bits, scale = K.sign_compress(x, residual)
    assert_bitwise(bits, bits_ref, f"sign_compress bits {dtype}")
    assert_bitwise(scale, scale_ref, f"sign_compress scale {dtype}")
    assert_bitwise(residual, residual_ref, f"sign_compress residual {dtype}")


@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: "default" if d is None else dtype_id(d))
def test_sign_decompress_large(out_dtype):
    n = LARGE_INT8
    g = torch.Generator(device=DEVICE).manual_seed(40)
    bits = torch.randint(0, 256, ((n + 7) // 8,), generator=g, device=DEVICE, dtype=torch.uint8)
    scale = torch.tensor([0.3125], device=DEVICE)
    if out_dtype is None:
        expected = K.sign_decompress_reference(bits, scale, n)
        out = K.sign_decompress(bits, scale, n)
    else:
        expected = K.sign_decompress_reference(bits, scale, n, out=poisoned(n, out_dtype))
        out = K.sign_decompress(bits, scale, n, out=poisoned(n, out_dtype))
    assert_bitwise(out, expected, f"sign_decompress -> {out_dtype}")


# ------------------------------------------------------------------------------------------
# pack / unpack
# ------------------------------------------------------------------------------------------

# 48 tensors of odd sizes, as in a DDP bucket: tiny ones, one of exactly 1, and a few over a block.
BUCKET_SIZES = [1] + [2 * i * i + 3 for i in range(44)] + [4097, 65537, 1_000_003]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int8], ids=dtype_id)
def test_pack_unpack_48_odd_tensors(dtype):
    assert len(BUCKET_SIZES) == 48
    sources = []
    for i, m in enumerate(BUCKET_SIZES):
        t = make(m, torch.float32 if dtype.is_floating_point else torch.int32, 50 + i)
        sources.append(t.to(dtype))  # int8: wraps, which is fine for a copy
    total = sum(BUCKET_SIZES)

    expected = K.pack_reference(sources)
    assert_bitwise(K.pack(sources, out=poisoned(total, dtype)), expected, f"pack {dtype} into out")
    assert_bitwise(K.pack(sources), expected, f"pack {dtype}, out allocated")

    flat = make(total, torch.float32 if dtype.is_floating_point else torch.int32, 99).to(dtype)
    targets = [poisoned(m, dtype) for m in BUCKET_SIZES]
    targets_ref = [poisoned(m, dtype) for m in BUCKET_SIZES]
    K.unpack(flat, targets)
    K.unpack_reference(flat, targets_ref)
    for i, (t, r) in enumerate(zip(targets, targets_ref)):
        assert_bitwise(t, r, f"unpack {dtype} tensor {i} ({BUCKET_SIZES[i]} elements)")
