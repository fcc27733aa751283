"""The int4 compression method (ddl_triton/kernels/int4.py and compressed.allreduce_int4), without
mpiexec:

- the kernels: quantize-and-pack, unpack-and-dequantize (and accumulate), the server's reduce and
  error feedback's keep-error step, each run twice through the ``backend`` fixture (the Triton
  kernels under TRITON_INTERPRET=1, and the torch CPU path: bitwise the same), against a float64
  oracle, the documented packing and the stated bound s*(1/2 + 2**-16); small sizes (the
  interpreter is ~100x slower);
- the allreduce on 1 to 4 ranks that are threads of this process (``_ThreadComm``: the all_to_all
  and all_gather it needs, through shared slots): bitwise identical on every rank, exact where the
  inputs are representable, within the row's bound elsewhere, sizes 0, 1, primes and sizes no
  block, chunk or world size divides; non-contiguous tensors handled; bad input refused naming
  the rank;
- error feedback: over repeated calls the running sum of the outputs tracks the running sum of
  the exact means (drift within the residuals' bound), and without residuals it does not;
- the registry's users: the gradients floor's Reducer, ``compress_hook("int4")`` and per-level
  compression (one rank per host: int4 between hosts, with the residuals it sizes).
tests/multirank/test_int4_across_ranks.py runs the allreduce on real ranks.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from ddl_triton import compression_methods as cm
from ddl_triton.kernels import int4 as K4
from ddl_triton.runtime.calls.work import Work
from ddl_triton.runtime.compression import compressed
from ddl_triton.runtime.compression.int4 import allreduce_int4
from support.kernel_checks import (DTYPES, assert_bitwise, assert_within, backend, bits_of, make,  # noqa: F401
                                   poison_empty, poisoned)

SLACK = 0.5 + 2.0 ** -16  # the stated bound, in units of the block's scale
SMALL = [0, 1, 2, 7, 127, 521]  # 521: a prime


# ------------------------------------------------------------------------------------------
# oracles
# ------------------------------------------------------------------------------------------

def _oracle(x: torch.Tensor, block: int):
    """(q, s) from float64 arithmetic, rounding where the contract rounds (as test_int8's)."""
    n = x.numel()
    nb = (n + block - 1) // block
    xd = torch.zeros(nb * block, dtype=torch.float64)
    xd[:n] = x.reshape(-1).double()
    xb = xd.view(nb, block)
    s = (xb.abs().amax(dim=1) / 7).float().double()
    s[s < 2.0 ** -126] = 0.0
    v = (xb / torch.where(s > 0, s, 1.0)[:, None]).float().double()
    return torch.round(v).clamp(-7, 7).reshape(-1)[:n], s


def _unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The documented packing read back by hand: element 2k the low nibble of byte k, 2k+1 the high, each q + 8."""
    out = []
    for byte in packed.tolist():
        out += [(byte & 15) - 8, (byte >> 4) - 8]
    if n & 1:
        assert out[-1] == 0, "an odd tensor's last high nibble must be the padding 0 (8)"
    return torch.tensor(out[:n], dtype=torch.float64)


def check_bound(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: int, what: str) -> None:
    """|fp32(q*s) - x| <= s*(1/2 + 2**-16); flushed blocks (s = 0) hold |x| < 2**-123 and q = 0."""
    n = x.numel()
    sd = s.double().repeat_interleave(block)[:n]
    d = (q.double() * sd).float().double()
    bound = torch.where(sd > 0, sd * SLACK, torch.full_like(sd, 2.0 ** -123))
    assert_within(d, x.reshape(-1).double(), bound, what)
    assert bool((q[sd == 0] == 0).all()), f"{what}: q != 0 in a block with scale 0"


# ------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", SMALL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_int4(backend, n, dtype):
    x = make(n, dtype, 1)
    packed, s = K4.quantize_int4(x, block=64)
    assert packed.dtype == torch.uint8 and packed.shape == ((n + 1) // 2,)
    assert s.dtype == torch.float32 and s.shape == ((n + 63) // 64,)
    p_ref, s_ref = K4.quantize_int4_reference(x, block=64)
    assert_bitwise(packed, p_ref, "packed vs torch path")
    assert_bitwise(s, s_ref, "scales vs torch path")
    q_or, s_or = _oracle(x, 64)
    assert_bitwise(s, s_or.float(), "scales vs float64 oracle")
    q = _unpack(packed, n)
    assert torch.equal(q, q_or), "q vs float64 oracle"
    check_bound(x, q, s, 64, "int4 error bound")


@pytest.mark.parametrize("block", [2, 8, 4096])
def test_quantize_int4_block_sizes(backend, block):
    x = make(1001, torch.float32, 2)
    packed, s = K4.quantize_int4(x, block=block)
    p_ref, s_ref = K4.quantize_int4_reference(x, block=block)
    assert_bitwise(packed, p_ref, "packed vs torch path")
    assert_bitwise(s, s_ref, "scales vs torch path")
    q = _unpack(packed, 1001)
    check_bound(x, q, s, block, "int4 error bound")
    d = poisoned(1001, torch.float32)
    K4.dequantize_int4(packed, s, out=d, block=block)
    assert_bitwise(d, (q * s.double().repeat_interleave(block)[:1001]).float(), "dequant vs oracle")


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_int4_special_blocks(backend, dtype):
    big = {torch.float32: 3.0e38, torch.float16: 65504.0, torch.bfloat16: 3.0e38}[dtype]
    tiny = {torch.float32: 1e-38, torch.float16: 6e-8, torch.bfloat16: 1e-38}[dtype]
    rows = [
        [0.0] * 8,                                             # all zero: scale 0, q 0
        [7.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5],           # scale 1: ties to even
        [big, -big, big / 3, 0.0, 1.0, -1.0, big / 7, -big],   # largest finite magnitudes
        [tiny, -tiny, 0.0, tiny, tiny, 0.0, 0.0, -tiny],       # fp32/bf16: scale would be subnormal
        [-12.0, 12.0, 4.0, -8.0, 0.0, 20.0, 28.0, -28.0],      # multiples of 28/7 = 4: exact
        [1.0, 2.0, 3.0],                                       # short last block, odd length
    ]
    x = torch.tensor([v for r in rows for v in r], dtype=torch.float64).to(dtype)
    packed, s = K4.quantize_int4(x, block=8)
    p_ref, s_ref = K4.quantize_int4_reference(x, block=8)
    assert_bitwise(packed, p_ref, "packed vs torch path")
    assert_bitwise(s, s_ref, "scales vs torch path")
    q_or, s_or = _oracle(x, 8)
    q = _unpack(packed, x.numel())
    assert_bitwise(s, s_or.float(), "scales vs float64 oracle")
    assert torch.equal(q, q_or), "q vs float64 oracle"
    check_bound(x, q, s, 8, "int4 error bound")
    assert q[:8].tolist() == [0] * 8 and s[0].item() == 0.0
    assert s[1].item() == 1.0 and q[8:16].tolist() == [7, 2, 4, -2, -4, 0, 0, 2]
    if dtype != torch.float16:
        assert s[3].item() == 0.0 and q[24:32].tolist() == [0] * 8
    assert q[16].item() == 7 and q[17].item() == -7 and q[23].item() == -7
    assert s[4].item() == 4.0 and q[32:40].tolist() == [-3, 3, 1, -2, 0, 5, 7, -7]
    exact = K4.dequantize_int4(packed, s, numel=x.numel(), block=8)
    assert exact[32:40].tolist() == rows[4], "a block of multiples of absmax/7 comes back exact"
    assert q[40:43].tolist() == [2, 5, 7]


def test_the_docstrings_worked_examples(backend):
    x = torch.tensor([7.0, -3.0, 1.0, 0.5, 0.1, 0.0, 0.0])
    packed, s = K4.quantize_int4(x, block=4)
    assert packed.tolist() == [95, 137, 143, 136]
    assert s.tolist() == [1.0, torch.tensor(0.1 / 7, dtype=torch.float32).item()]
    d = K4.dequantize_int4(packed, s, numel=7, block=4)
    assert d[:4].tolist() == [7.0, -3.0, 1.0, 0.0] and d[5:].tolist() == [0.0, 0.0]
    q, sc = K4.reduce_int4([torch.tensor([0xF8], dtype=torch.uint8), torch.tensor([0x1F], dtype=torch.uint8)],
                           [torch.tensor([1.0]), torch.tensor([0.5])], numel=2, block=2, scale=0.5)
    assert q.tolist() == [0xFF] and sc.tolist() == [0.25]
    v = torch.tensor([7.0, -3.0, 1.0, 0.5])
    K4.quantize_int4_keep_error(v, out=(poisoned(2, torch.uint8), poisoned(1, torch.float32)), block=4)
    assert v.tolist() == [0.0, 0.0, 0.0, 0.5]


def test_the_bound_checker_can_fail():
    x = make(521, torch.float32, 3)
    packed, s = K4.quantize_int4_reference(x, block=64)
    q = _unpack(packed, 521)
    check_bound(x, q, s, 64, "unperturbed")
    i = int((q.abs() < 6).nonzero()[7, 0])
    q[i] += 1
    with pytest.raises(AssertionError, match="out of bound"):
        check_bound(x, q, s, 64, "perturbed")


@pytest.mark.parametrize("n", [1, 7, 521])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_dequantize_int4_and_accumulate(backend, n, out_dtype):
    x = make(n, torch.float32, 4)
    packed, s = K4.quantize_int4_reference(x, block=8)
    d = K4.dequantize_int4(packed, s, out=poisoned(n, out_dtype), block=8)
    exact = _unpack(packed, n) * s.double().repeat_interleave(8)[:n]
    assert_bitwise(d, exact.float().to(out_dtype), "dequant vs float64 oracle")  # fp32 product, rounded once
    if out_dtype == torch.float32:
        acc = make(n, torch.float32, 5)
        want = acc + exact.float()  # fp32 product, then an fp32 add
        K4.dequantize_int4(packed, s, out=acc, block=8, accumulate=True)
        assert_bitwise(acc, want, "accumulate")


@pytest.mark.parametrize("scale", [None, 1.0 / 3])
def test_reduce_int4(backend, scale):
    n, block = 521, 16
    ins = [K4.quantize_int4_reference(make(n, torch.float32, 10 + i), block=block) for i in range(3)]
    packed, s = K4.reduce_int4([p for p, _ in ins], [sc for _, sc in ins], numel=n, block=block, scale=scale)
    acc = torch.zeros(n, dtype=torch.float32)
    for p, sc in ins:  # fp32 sum in list order of the fp32 products
        acc += (_unpack(p, n) * sc.double().repeat_interleave(block)[:n]).float()
    if scale is not None:
        acc *= torch.tensor(scale, dtype=torch.float32)
    p_want, s_want = K4.quantize_int4_reference(acc, block=block)
    assert_bitwise(packed, p_want, "reduce vs sum then quantize")
    assert_bitwise(s, s_want, "reduce scales")
    check_bound(acc, _unpack(packed, n), s, block, "reduce: int4 bound against the fp32 sum")


@pytest.mark.parametrize("n", [1, 127, 521])
def test_keep_error_leaves_what_was_lost(backend, n):
    x = make(n, torch.float32, 6)
    v = x.clone()
    packed, s = K4.quantize_int4_keep_error(v, out=(poisoned((n + 1) // 2, torch.uint8),
                                                    poisoned((n + 31) // 32, torch.float32)), block=32)
    p_ref, s_ref = K4.quantize_int4_reference(x, block=32)
    assert_bitwise(packed, p_ref, "packed")
    assert_bitwise(s, s_ref, "scales")
    assert_bitwise(v, x - K4.dequantize_int4_reference(p_ref, s_ref, numel=n, block=32), "residual")


def test_the_kernels_refuse_bad_input():
    x = torch.ones(10)
    with pytest.raises(ValueError, match="block must be a power of two in \\[2, 65536\\], got 3"):
        K4.quantize_int4(x, block=3)
    with pytest.raises(TypeError, match="unsupported dtype torch.int32"):
        K4.quantize_int4(torch.ones(4, dtype=torch.int32), block=4)
    with pytest.raises(ValueError, match="x must be contiguous"):
        K4.quantize_int4(torch.ones(4, 4).t(), block=4)
    with pytest.raises(ValueError, match="out must hold 5 bytes and 3 scales, got 4 and 3"):
        K4.quantize_int4(x, block=4, out=(torch.empty(4, dtype=torch.uint8), torch.empty(3)))
    with pytest.raises(ValueError, match="10 elements need 5 packed bytes, got 4"):
        K4.dequantize_int4(torch.zeros(4, dtype=torch.uint8), torch.ones(3), numel=10, block=4)
    with pytest.raises(TypeError, match="accumulate adds into an fp32 out"):
        K4.dequantize_int4(torch.zeros(2, dtype=torch.uint8), torch.ones(1), out=torch.zeros(4).half(), block=4,
                           accumulate=True)
    with pytest.raises(TypeError, match="v must be fp32"):
        K4.quantize_int4_keep_error(x.half(), out=(torch.empty(5, dtype=torch.uint8), torch.empty(3)), block=4)


# ------------------------------------------------------------------------------------------
# the allreduce, on ranks that are threads
# ------------------------------------------------------------------------------------------

class _ThreadComm:
    """Rank ``rank`` of ``size`` threads of this process: all_to_all and all_gather through shared
    slots and a barrier, each returning a completed Work (what the compressed allreduces call),
    counting the bytes sent to peers as a transport does; one rank per host."""

    def __init__(self, rank: int, shared: dict):
        self.rank, self.size, self._shared = rank, shared["size"], shared
        self.transport_bytes = {"threads": {"sent": 0, "received": 0}}
        self.placement = SimpleNamespace(node_of_rank=list(range(self.size)), on_node=[rank])

    def _meet(self, t: torch.Tensor) -> list[torch.Tensor]:
        self._shared["slots"][self.rank] = t.clone()
        self._shared["barrier"].wait(30)
        got = list(self._shared["slots"])
        self._shared["barrier"].wait(30)
        return got

    def all_to_all(self, out, inp, async_op=False):
        self.transport_bytes["threads"]["sent"] += (self.size - 1) * inp.numel() // self.size * inp.element_size()
        slots = self._meet(inp)
        out.view(self.size, -1).copy_(torch.stack([s.view(self.size, -1)[self.rank] for s in slots]))
        return self._done(out)

    def all_gather(self, out, inp, async_op=False):
        self.transport_bytes["threads"]["sent"] += (self.size - 1) * inp.numel() * inp.element_size()
        out.copy_(torch.cat(self._meet(inp)))
        return self._done(out)

    @staticmethod
    def _done(value):
        work = Work("thread exchange")
        work.set_result(value)
        return work


def _world(size: int) -> list[_ThreadComm]:
    shared = {"size": size, "slots": [None] * size, "barrier": threading.Barrier(size)}
    return [_ThreadComm(r, shared) for r in range(size)]


def _on_ranks(comms, fn):
    """fn(comm) on every rank at once, each on its own thread; results in rank order."""
    results, errors = [None] * len(comms), []

    def run(c):
        try:
            results[c.rank] = fn(c)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            c._shared["barrier"].abort()

    threads = [threading.Thread(target=run, args=(c,)) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def _scales(v: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block scale absmax/7 (float64), as the worker computes it."""
    return K4.quantize_int4_reference(v, block=block)[1].double().repeat_interleave(block)[: v.numel()]


def _check_bound(y: torch.Tensor, vs: list[torch.Tensor], block: int, size: int, what: str) -> None:
    """The row's bound: |y - mean_p v_p| <= (mean_p s_w,p + s_r)(1/2 + 2**-16), s_r = 0 on two ranks,
    else the result's block absmax/7 (taken from y, widened by 2**-20 for y's own rounding)."""
    mean = torch.stack([v.double() for v in vs]).mean(0)
    s_w = torch.stack([_scales(v, block) for v in vs]).mean(0)
    s_r = 0.0 if size <= 2 else _scales(y.float(), block) * (1 + 2.0 ** -20)
    assert_within(y.reshape(-1), mean, (s_w + s_r) * SLACK, what)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_allreduce_int4_bound_and_identical_ranks(size):
    for n in (0, 1, 7, 13, 1000, 4099):  # primes, and sizes no block / chunk / world size divides
        for dtype in (torch.float32, torch.bfloat16):
            xs = [make(n, dtype, 100 + 7 * r + n, spread=2) for r in range(size)]
            ys = _on_ranks(_world(size), lambda c: cm.get("int4").run(c, xs[c.rank].clone(), op="avg", block=64))
            for r in range(1, size):
                assert torch.equal(bits_of(ys[r]), bits_of(ys[0])), f"{size} ranks, n={n}: rank {r} differs"
            if dtype == torch.float32 and n:
                _check_bound(ys[0], [x.float() for x in xs], 64, size, f"{size} ranks, n={n}")


@pytest.mark.parametrize("size", [2, 3, 4])
def test_allreduce_int4_is_exact_where_the_inputs_are_representable(size):
    # Every block on every rank is k_i * m with the same k (max |k| = 7) and an integer m per rank
    # and block: each rank's block is exact (s = m), and so is the sum (scale sum m), so "sum"
    # comes back exactly, and "avg" too where 1/n is a power of two.
    n, block = 1003, 8
    k = torch.tensor([7, -3, 0, 1, -7, 5, 2, -1] * (n // 8 + 1), dtype=torch.float64)[:n]
    ms = [torch.randint(1, 1000, ((n + block - 1) // block,), generator=torch.Generator().manual_seed(r))
          .double().repeat_interleave(block)[:n] for r in range(size)]
    xs = [(k * m).float() for m in ms]
    for op in ("sum", "avg"):
        ys = _on_ranks(_world(size), lambda c: allreduce_int4(c, xs[c.rank].clone(), op=op, block=block))
        want = k * sum(ms) / (size if op == "avg" else 1)
        if op == "sum" or size in (2, 4):
            for r, y in enumerate(ys):
                assert torch.equal(y.double(), want), f"{size} ranks, {op}: rank {r} not exact"


def test_allreduce_int4_through_the_triton_kernels():
    # The same call on the Triton kernels (interpreted) and on the torch path: the same bits.
    from ddl_triton import kernels

    xs = [make(77, torch.float32, 90 + r) for r in range(3)]

    def call(c):
        residual = torch.linspace(-0.1, 0.1, 77)
        a, b = compressed.chunk_bounds(77, 3, 8)[c.rank]
        server = torch.full((b - a,), 0.01)
        y = allreduce_int4(c, xs[c.rank].clone(), block=8, residual=residual, server_residual=server)
        return y, residual, server

    got = {}
    for backend_name in ("torch", "triton"):
        kernels.set_backend(backend_name)
        try:
            got[backend_name] = _on_ranks(_world(3), call)
        finally:
            kernels.set_backend("auto")
    for r in range(3):
        for a, b in zip(got["torch"][r], got["triton"][r]):
            assert_bitwise(b, a, f"rank {r}: triton vs torch")


def test_allreduce_int4_async_returns_a_work_with_the_same_result():
    xs = [make(300, torch.float32, 60 + r) for r in range(3)]
    sync = _on_ranks(_world(3), lambda c: allreduce_int4(c, xs[c.rank].clone(), block=8))
    works = _on_ranks(_world(3), lambda c: allreduce_int4(c, xs[c.rank].clone(), block=8, async_op=True))
    for y, w in zip(sync, works):
        assert torch.equal(w.wait(), y)


def test_allreduce_int4_handles_non_contiguous_tensors():
    base = [make(64, torch.float32, 50 + r).view(8, 8) for r in range(3)]
    contiguous = _on_ranks(_world(3), lambda c: allreduce_int4(c, base[c.rank].t().contiguous(),
                                                                          block=8))

    def strided(c):
        t = base[c.rank].clone().t()  # a transposed view: copied in, the result written back through it
        assert not t.is_contiguous()
        return allreduce_int4(c, t, block=8)

    for a, b in zip(contiguous, _on_ranks(_world(3), strided)):
        assert torch.equal(a, b)


def test_allreduce_int4_refuses_bad_input_naming_the_rank():
    c = _world(3)[1]  # validation comes before any exchange: one rank alone raises
    with pytest.raises(TypeError, match="rank 1: allreduce_int4: tensor must be float32, float16 or bfloat16"):
        allreduce_int4(c, torch.ones(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="rank 1: allreduce_int4: residual must be contiguous with 8 elements, "
                                         "has 7"):
        allreduce_int4(c, torch.ones(8), residual=torch.zeros(7))
    with pytest.raises(TypeError, match="rank 1: allreduce_int4: residual must be an fp32 tensor"):
        allreduce_int4(c, torch.ones(8), residual=torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="rank 1: allreduce_int4: server_residual must be contiguous with 8"):
        allreduce_int4(c, torch.ones(20), block=8, server_residual=torch.zeros(3))
    with pytest.raises(ValueError, match="rank 1: allreduce_int4: block must be a power of two in \\[4, 65536\\]"):
        allreduce_int4(c, torch.ones(8), block=2)
    with pytest.raises(ValueError, match="rank 1: allreduce_int4: op must be 'avg' or 'sum'"):
        allreduce_int4(c, torch.ones(8), op="max")
    with pytest.raises(TypeError, match="rank 1: compression 'int4' takes float32, float16, bfloat16 tensors, "
                                        "got float64"):
        cm.get("int4").run(c, torch.ones(8, dtype=torch.float64))


def _running_drift(size: int, feedback: bool, steps: int = 40, server_feedback: bool = True) -> tuple[float, float]:
    """(max |sum_t y_t - sum_t mean_t| over the steps, the residuals' bound at the end) for inputs
    that int4 rounds the same way every call: most of each block is 0.3 of its absmax/7."""
    n, block = 200, 8
    comms = _world(size)
    worker = [torch.zeros(n) for _ in range(size)]
    server = [torch.zeros(b - a) for a, b in compressed.chunk_bounds(n, size, max(block, 8))]
    state = {"y": torch.zeros(n, dtype=torch.float64), "mean": torch.zeros(n, dtype=torch.float64), "drift": 0.0}

    def step(c, t):
        x = torch.full((n,), 0.3 + 0.01 * c.rank)
        x[::block] = 7.0 + c.rank
        x *= 1 + t % 3
        y = allreduce_int4(c, x.clone(), op="avg", block=block,
                                      residual=worker[c.rank] if feedback else None,
                                      server_residual=server[c.rank] if feedback and server_feedback else None)
        return x, y

    for t in range(steps):
        out = _on_ranks(comms, lambda c: step(c, t))
        state["y"] += out[0][1].double()
        state["mean"] += torch.stack([x.double() for x, _ in out]).mean(0)
        gap = state["y"] - state["mean"]
        state["drift"] = max(state["drift"], gap.abs().max().item())
        if feedback and server_feedback:  # the identity, step by step (fp32 roundings aside)
            kept = torch.stack([w.double() for w in worker]).mean(0) + torch.cat(server).double()
            assert (gap + kept).abs().max().item() < 1e-3, f"step {t}: sum y != sum mean - residuals"
    # sum y = sum mean - mean_p(worker residual) - server residual (up to fp32 rounding): each
    # residual is within its last step's bound, s*(1/2 + 2**-16) with s <= 3*(7 + size)/7.
    bound = 2 * 3 * (7 + size) / 7 * SLACK + 1e-3
    return state["drift"], bound


@pytest.mark.parametrize("size", [2, 3])
def test_error_feedback_keeps_the_running_sum_on_track(size):
    drift, bound = _running_drift(size, feedback=True)
    assert drift <= bound, f"{size} ranks, with residuals: drift {drift} > {bound}"
    drift, bound = _running_drift(size, feedback=False)
    assert drift > 3 * bound, f"{size} ranks, without residuals the drift should grow: {drift} vs {bound}"


@pytest.mark.slow
def test_without_the_server_residual_the_servers_rounding_drifts():
    # Why the int4 row keeps a server residual: on 3+ ranks the server requantizes the mean, and
    # a mean that rounds the same way every call is lost every call, however well the workers
    # re-send their own errors.
    drift, bound = _running_drift(3, feedback=True, server_feedback=False, steps=120)
    assert drift > 2 * bound, f"worker residuals only: the drift should grow: {drift} vs {bound}"


def test_the_gradients_reducer_runs_int4_with_its_residuals():
    from ddl_triton.gradients import Reducer

    size = 3
    xs = [make(1000, torch.float32, 70 + r, spread=2) for r in range(size)]
    comms = _world(size)
    reducers = [Reducer(c, "int4") for c in comms]
    ys = _on_ranks(comms, lambda c: reducers[c.rank].reduce(xs[c.rank].clone(), "k", "int4"))
    assert all(torch.equal(y, ys[0]) for y in ys)
    _check_bound(ys[0], xs, 256, size, "Reducer int4")
    kind, worker, server = reducers[1].residuals.snapshot()["k"]
    a, b = compressed.chunk_bounds(1000, size, 256)[1]
    assert kind == "int4" and worker.numel() == 1000 and server.numel() == b - a  # the row's two residuals
    assert worker.abs().sum() > 0 and server.abs().sum() > 0, "the residuals kept what quantization lost"


def test_compress_hook_int4_reduces_a_bucket_on_two_ranks():
    from ddl_triton.torch.hooks import HookState, compress_hook

    xs = [torch.tensor([7.0, -7.0, 0.0, 1.0] * 64), torch.tensor([7.0] * 256)]

    def hook(c):
        buf = xs[c.rank].clone()
        state = HookState(c, compression="int4")
        bucket = SimpleNamespace(buffer=lambda: buf, index=lambda: 0, parameters=lambda: [buf])
        out = compress_hook("int4")(state, bucket).wait()
        return out, state.payload_bytes, state.sent_bytes()

    (y0, payload, sent), (y1, _, _) = _on_ranks(_world(2), hook)
    assert torch.equal(y0, y1) and y0.tolist() == [7.0, 0.0, 3.5, 4.0] * 64  # representable: exact
    assert payload == sent == compressed.wire_bytes("int4", 256, 2) == 128 + 4


def test_per_level_compression_runs_int4_between_hosts():
    # One rank per host (the threads' placement): the per-level allreduce is int4 between hosts,
    # with the residuals residual_sizes gives (the worker's, and the server's chunk).
    from ddl_triton.runtime.compression import per_level

    size, n = 3, 1000
    xs = [make(n, torch.float32, 80 + r, spread=2) for r in range(size)]

    def call(c):
        levels = per_level.Levels(c)
        w, s = per_level.residual_sizes(levels, "int4", n, block=64)
        assert w == n
        x = xs[c.rank].clone()
        per_level.allreduce(levels, x, method="int4", block=64, residual=torch.zeros(w),
                            server_residual=torch.zeros(s))
        return x, s, per_level.wire_bytes(levels, "int4", n, block=64)["inter"]

    out = _on_ranks(_world(size), call)
    assert all(torch.equal(x, out[0][0]) for x, _, _ in out)
    assert [s for _, s, _ in out] == [b - a for a, b in compressed.chunk_bounds(n, size, 64)]
    assert out[0][2] == compressed.wire_bytes("int4", n, size, block=64)
    _check_bound(out[0][0], xs, 64, size, "per-level int4")


def test_the_torch_paths_two_packings_give_the_same_bytes(monkeypatch):
    # The torch path packs with int16 ops on a little-endian host and strided uint8 ops elsewhere.
    x = make(1001, torch.float32, 8)
    fast = K4.quantize_int4_reference(x, block=8)
    fast_d = K4.dequantize_int4_reference(*fast, numel=1001, block=8)
    monkeypatch.setattr(K4, "_INT16_PAIRS", not K4._INT16_PAIRS)
    other = K4.quantize_int4_reference(x, block=8)
    assert_bitwise(other[0], fast[0], "packed")
    assert_bitwise(K4.dequantize_int4_reference(*other, numel=1001, block=8), fast_d, "dequantized")
