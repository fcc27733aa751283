"""The reduce and pack kernels against their torch references (bitwise) and a float64 oracle (stated
error bounds), and the bandwidth measurement; the compression kernels are tests/unit/test_int8.py
and test_onebit.py.

Every check runs twice, through the ``backend`` fixture: on the Triton kernels (under
TRITON_INTERPRET=1, set in conftest.py) and on the torch path, with every output poisoned
(tests/support/kernel_checks.py).
"""
from __future__ import annotations

import importlib
import time

import pytest
import torch

import ddl_triton.kernels as K
from ddl_triton.kernels._dispatch import interpreting
from support.kernel_checks import (DTYPES, SIZES, assert_bitwise, assert_within, backend, gamma,  # noqa: F401
                                   make, poison_empty, poisoned)

pack_mod = importlib.import_module("ddl_triton.kernels.pack")  # K.pack is the function, not the module

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
SMALLEST_SUBNORMAL = {torch.float32: 2.0 ** -149, torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133}


# ------------------------------------------------------------------------------------------
# reduce (existing kernel)
# ------------------------------------------------------------------------------------------

def _reduce_oracle(inputs, op, scale):
    o = inputs[0].double()
    mag = o.abs()
    for x in inputs[1:]:
        x = x.double()
        if op == "sum":
            o = o + x
            mag = mag + x.abs()
        else:
            o = torch.minimum(o, x) if op == "min" else torch.maximum(o, x)
            mag = torch.maximum(mag, x.abs())
    if scale is not None:
        o = o * scale
        mag = mag * abs(scale)
    return o, mag


def _check_reduce(out, inputs, op, scale, dtype, backend):
    """Bitwise against reduce_reference; within fp32-accumulation + one final rounding of the oracle."""
    ref = poisoned(out.shape, dtype)
    K.reduce_reference(ref, [x.clone() for x in inputs], op=op, scale=scale)
    assert_bitwise(out, ref, f"reduce {op} vs reference")
    o, mag = _reduce_oracle(inputs, op, scale)
    k = len(inputs)
    # k-1 fp32 adds, the fp32 rounding of scale and the multiply: gamma_{k+1}; then one rounding
    # to the out dtype, relative to the value or, below its normal range, half its subnormal step.
    acc_err = (gamma(k + 1) if op == "sum" else gamma(2)) * mag
    u = UNIT_ROUNDOFF[dtype]
    bound = acc_err * (1 + u) + u * o.abs() + SMALLEST_SUBNORMAL[dtype] / 2
    assert_within(out, o, bound, f"reduce {op} vs float64 oracle")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,scale", [("sum", None), ("sum", 1 / 3), ("min", None), ("max", 0.25)])
def test_reduce_sizes_dtypes(backend, n, dtype, op, scale):
    inputs = [make(n, dtype, seed) for seed in range(3)]
    out = poisoned(n, dtype)
    assert K.reduce(out, inputs, op=op, scale=scale) is out
    _check_reduce(out, inputs, op, scale, dtype, backend)


@pytest.mark.parametrize("k", range(1, 11))
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_arity(backend, k, op):
    # k > 8 chains kernel passes through an fp32 accumulator; rounding must still happen once.
    dtype, n = torch.bfloat16, 4097
    inputs = [make(n, dtype, 100 + seed) for seed in range(k)]
    scale = 1 / k if op == "sum" else None
    out = poisoned(n, dtype)
    K.reduce(out, inputs, op=op, scale=scale)
    _check_reduce(out, inputs, op, scale, dtype, backend)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [2, 9])
def test_reduce_out_aliases_first_input(backend, dtype, k):
    n = 4097
    inputs = [make(n, dtype, 200 + seed) for seed in range(k)]
    originals = [x.clone() for x in inputs]
    K.reduce(inputs[0], inputs, op="sum", scale=0.5)
    _check_reduce(inputs[0], originals, "sum", 0.5, dtype, backend)
    for i in range(1, k):
        assert_bitwise(inputs[i], originals[i], f"reduce must not write inputs[{i}]")


def test_reduce_16bit_rounds_once(backend):
    # fp16: 2048 + 1 + 1 is 2050 with one rounding, 2048 when every partial sum is rounded to fp16.
    inputs = [torch.full((5,), v, dtype=torch.float16) for v in (2048.0, 1.0, 1.0)]
    out = poisoned(5, torch.float16)
    K.reduce(out, inputs)
    assert out.tolist() == [2050.0] * 5


def test_reduce_bf16_rounds_to_nearest_on_triton():
    # Triton 3.9's interpreter truncates fp32 -> bf16 casts; the kernels round by hand (_rounding.py).
    K.set_backend("triton")
    try:
        out = poisoned(4, torch.bfloat16)
        K.reduce(out, [torch.ones(4, dtype=torch.bfloat16), torch.full((4,), 3 * 2.0 ** -9, dtype=torch.bfloat16)])
    finally:
        K.set_backend("auto")
    assert out.tolist() == [1.0 + 2.0 ** -7] * 4


def test_reduce_rejects_non_contiguous(backend):
    x = torch.zeros(8, 2)[:, 0]
    with pytest.raises(ValueError, match="contiguous"):
        K.reduce(torch.zeros(8), [x, x])


# ------------------------------------------------------------------------------------------
# pack / unpack
# ------------------------------------------------------------------------------------------

def _split_sizes(n: int) -> list[int]:
    """Mixed sizes totalling n, with empties and singletons among them."""
    if n < 3:
        return [n, 0]
    return [n // 2, 0, 1, n - n // 2 - 2, 1]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES + [torch.int64])
def test_pack_unpack(backend, n, dtype):
    sizes = _split_sizes(n)
    tensors = [make(m, torch.float64, 400 + i).mul(1000).to(dtype) for i, m in enumerate(sizes)]
    tensors[0] = tensors[0].reshape(-1, 1) if sizes[0] else tensors[0]  # any shape, contiguous
    out = poisoned(n, dtype)
    assert K.pack(tensors, out=out) is out
    assert_bitwise(out, K.pack_reference(tensors), "pack vs torch.cat")
    # Oracle: element-wise, by explicit offsets.
    start = 0
    for t in tensors:
        assert_bitwise(out[start:start + t.numel()], t.reshape(-1), "pack slice")
        start += t.numel()
    assert_bitwise(K.pack(tensors), out, "pack (own out)")
    targets = [poisoned(t.shape, dtype) for t in tensors]
    K.unpack(out, targets)
    for t, u in zip(tensors, targets):
        assert_bitwise(u, t, "unpack")


def test_pack_many_small_tensors(backend):
    g = torch.Generator().manual_seed(9)
    sizes = torch.randint(0, 300, (60,), generator=g).tolist() + [3000]
    tensors = [torch.randn(m, generator=g) for m in sizes]
    flat = K.pack(tensors)
    assert_bitwise(flat, torch.cat(tensors), "pack")
    targets = [poisoned(m, torch.float32) for m in sizes]
    K.unpack(flat, targets)
    for t, u in zip(tensors, targets):
        assert_bitwise(u, t, "unpack")
    # The cached table must follow new buffers of the same sizes.
    other = [t + 1 for t in tensors]
    assert_bitwise(K.pack(other), torch.cat(other), "pack of new buffers")


def test_pack_rejects_bad_input(backend):
    a, b = torch.zeros(4), torch.zeros(3)
    with pytest.raises(ValueError, match="elements"):
        K.pack([a, b], out=torch.zeros(6))
    with pytest.raises(TypeError):
        K.pack([a, b.double()])
    with pytest.raises(ValueError, match="contiguous"):
        K.pack([torch.zeros(4, 2)[:, 0]])
    flat = torch.zeros(7)
    with pytest.raises((ValueError, RuntimeError), match="overlap|same memory|single memory"):
        K.pack([flat[:4], b], out=flat)  # torch.cat's own check on the torch path
    if backend == "triton":  # the torch path copies in list order: defined, so allowed
        with pytest.raises(ValueError, match="overlap"):
            K.unpack(flat, [flat[:4], b])
        with pytest.raises(ValueError, match="overlap"):
            big = torch.zeros(10)
            K.unpack(torch.zeros(7), [big[:4], big[2:5]])


def test_pointer_table_reaches_memory_outside_the_arguments():
    # The design premise of pack and reduce_int8, checked directly: under the interpreter, a
    # data_ptr() table cast with tl.pointer_type reads and writes tensors not passed as arguments.
    if not interpreting():
        pytest.skip("interpreter-only check")
    K.set_backend("triton")
    try:
        src = [torch.arange(5, dtype=torch.float32), torch.arange(3, dtype=torch.float32) + 10]
        dst = [poisoned(5, torch.float32), poisoned(3, torch.float32)]
        flat = poisoned(8, torch.float32)
        pack_mod._launch(flat, src, unpack=False)
        assert flat.tolist() == [0, 1, 2, 3, 4, 10, 11, 12]
        pack_mod._launch(flat, dst, unpack=True)
        assert dst[0].tolist() == [0, 1, 2, 3, 4] and dst[1].tolist() == [10, 11, 12]
    finally:
        K.set_backend("auto")


# ------------------------------------------------------------------------------------------
# the bandwidth measurement (ddl_triton/kernels/bandwidth.py)
# ------------------------------------------------------------------------------------------

class FakeClock:
    """Stands in for bandwidth.py's ``time`` module: time moves only when a timed function says so."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def spend(self, ms: float):
        return lambda: setattr(self, "now", self.now + ms * 1e-3)


@pytest.fixture
def clock(monkeypatch):
    from ddl_triton.kernels import bandwidth
    fake = FakeClock()
    monkeypatch.setattr(bandwidth, "time", fake)
    return fake


def test_bandwidth_alternates_the_functions_and_reports_the_median(clock):
    from ddl_triton.kernels import bandwidth
    calls = []
    spent = {"fast": iter([0.5] + [1, 2, 1, 9, 1, 1, 3]), "slow": iter([50] + [4, 4, 5, 4, 6, 4, 4])}

    def timed(name):
        def run():
            calls.append(name)
            clock.spend(next(spent[name]))()
        return run

    t_fast, t_slow = bandwidth.measure([timed("fast"), timed("slow")], 10 ** 6, device="cpu", min_calls=7,
                                       min_seconds=0.0, warmup_s=0.0)
    assert calls == ["fast", "slow"] * 8  # one untimed warm call each, then 7 timed rounds, alternating
    assert (t_fast.calls, t_slow.calls) == (7, 7)
    assert (t_fast.p50_ms, t_slow.p50_ms) == (pytest.approx(1.0), pytest.approx(4.0))  # the warm calls are left out
    for t in (t_fast, t_slow):
        assert t.nbytes == 10 ** 6 and t.p20_ms <= t.p50_ms <= t.p80_ms
        assert t.gbps == 10 ** 6 / (t.p50_ms * 1e-3) / 1e9
    assert t_slow.gbps == pytest.approx(0.25)


def test_bandwidth_times_for_min_seconds_up_to_ten_times_min_calls(clock):
    from ddl_triton.kernels import bandwidth
    (t,) = bandwidth.measure([lambda: None], 1, device="cpu", min_calls=3, min_seconds=60.0, warmup_s=0.0)
    assert t.calls == 30  # no time passes: the cap ends it
    (t,) = bandwidth.measure([clock.spend(1000)], 1, device="cpu", min_calls=2, min_seconds=5.0, warmup_s=0.0)
    assert t.calls == 5  # 1 s per call: 5 s of timed rounds
    warm = []
    bandwidth.measure([lambda: (warm.append(1), clock.spend(10)())], 1, device="cpu", min_calls=1,
                      min_seconds=0.0, warmup_s=0.035)
    assert len(warm) == 1 + 4 + 1  # the warm call, 35 ms of untimed rounds at 10 ms each, one timed call
    with pytest.raises(ValueError, match="no functions"):
        bandwidth.measure([], 1, device="cpu")


def test_bandwidth_on_cuda_times_each_call_by_events_after_flushing_l2(monkeypatch, clock):
    # No GPU here: CUDA events and synchronize are stood in for (recording the fake clock), to check
    # the CUDA round's logic: flush, an event pair around the call, one wait per round, times in ms.
    from ddl_triton.kernels import bandwidth
    waits = []

    class Event:
        def __init__(self, enable_timing: bool):
            assert enable_timing

        def record(self):
            self.at = clock.now

        def elapsed_time(self, end) -> float:
            assert waits, "elapsed_time before synchronize"
            return (end.at - self.at) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    monkeypatch.setattr(bandwidth, "L2_FLUSH_BYTES", 64)
    timed_round = bandwidth._CudaRound(torch.device("cpu"))
    flushed = []

    def kernel(ms):
        def run():
            flushed.append(bool((timed_round.flush == 0).all()))
            timed_round.flush.fill_(7)  # what a kernel's traffic would leave in L2
            clock.spend(ms)()
        return run

    assert timed_round([kernel(0.5), kernel(3.0)]) == [0.5, 3.0]
    assert flushed == [True, True] and waits == [torch.device("cpu")]
