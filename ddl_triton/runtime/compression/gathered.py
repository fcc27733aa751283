"""Compressed allreduce on two ranks: one all_gather of each rank's whole compressed tensor.

Semantics (``compressed.allreduce_int8`` / ``_int4`` / ``_onebit`` / ``_16bit`` call these when
``comm.size == 2``; compressed.py's module doc has the compressors):

    1. compress this rank's whole tensor, as the two-shot worker compresses a chunk (error
       feedback in ``residual``), into one slot
    2. all_gather: each rank receives the other's slot
    3. decompress slot 0, then slot 1, summed in fp32 [* fp32(1/2) for "avg"], rounded once into
       the caller's tensor (16-bit: rounded to the wire dtype first, as the two-shot server rounds)

Both ranks run step 3 on the same bytes with the same operations: bitwise identical results.
Nothing is compressed twice, so int8 and int4 lose only the workers' s_w(1/2 + 2**-16) per
element, and 1-bit and int4 need no server residual. Why: on two ranks the two-shot's
all_to_all and all_gather each move half of the compressed tensor, so one all_gather of all of
it sends the same bytes with one exchange's latency and machinery fewer, and no server step.

int8 (and int4) "avg" multiplies each slot's scales by the fp32(1/2) instead of the sum: a
power of two, so every product is the same number (but for blocks of scale below 2**-125, whose
halves are subnormal and may differ in the last bit; both ranks compute the same bits either
way), and the sum costs one pass over the tensor fewer (the two decompresses and their sum of a 2.1 MB
bucket: 1.29 against 1.55 ms back to back on the project's CPU VM, interleaved medians).

Example (int8, block 4, "avg"): rank 0 [1, 2, 3, 4], rank 1 [3, 2, 1, 0] -> q [32, 64, 95, 127]
s 4/127 and q [127, 85, 42, 0] s 3/127 -> both ranks [2.003937, 2.011811, 1.992126, 2.0].
The slot layout is compressed_layout.py's (``whole_slot_words``: the whole tensor as one chunk).
"""
from __future__ import annotations

import torch

from ..calls import scratch_pool
from .layout import ONEBIT_ALIGN, chunk_elems, nbytes, segments, slot_words
from ...kernels import dequantize_int8, quantize_int8, quantize_int8_keep_error, sign_compress, sign_decompress
from ...kernels.int4 import dequantize_int4, quantize_int4, quantize_int4_keep_error
from ..calls.work import Work


def int8(comm, tensor, flat, op, block, residual, async_op):
    """``allreduce_int8`` on two ranks (its arguments, checked there; ``flat``: tensor's flat work view)."""
    n = flat.numel()
    c = chunk_elems(n, 1, block)
    words, sq, nb = slot_words("int8", c, block), c // 4, -(-n // block)
    gin, gout = _buffers(comm.size, words, torch.int32, flat.device)
    qb, sf = gin.view(torch.int8)[:n], gin.view(torch.float32)[sq: sq + nb]
    if residual is not None:
        residual.add_(flat)  # v = x + residual, as the two-shot worker
        quantize_int8_keep_error(residual, block=block, out=(qb, sf))  # what it lost is sent next call
    else:
        quantize_int8(flat, block=block, out=(qb, sf))

    half = torch.tensor(0.5, dtype=torch.float32, device=flat.device) if op == "avg" else None

    def decompress(p: int, out: torch.Tensor) -> None:
        ob, of = gout.view(torch.int8), gout.view(torch.float32)
        scales = of[p * words + sq: p * words + sq + nb]
        dequantize_int8(ob[p * words * 4: p * words * 4 + n], scales if half is None else scales * half,
                        out=out, block=block)

    # "avg" is in the scales (module doc): the sum is not scaled again
    return _exchange(comm, tensor, flat, gin, gout, decompress, "sum",
                     f"allreduce_int8({op}, {n} x {tensor.dtype}, block {block}, gathered)", async_op)


def int4(comm, tensor, flat, op, block, residual, async_op):
    """``allreduce_int4`` on two ranks: as ``int8``, with 4-bit values two a byte."""
    n = flat.numel()
    c = chunk_elems(n, 1, max(block, 8))
    words, sq, nb = slot_words("int4", c, block), c // 8, -(-n // block)
    gin, gout = _buffers(comm.size, words, torch.int32, flat.device)
    packed, sf = gin.view(torch.uint8)[: (n + 1) // 2], gin.view(torch.float32)[sq: sq + nb]
    if residual is not None:
        residual.add_(flat)  # v = x + residual, as the two-shot worker
        quantize_int4_keep_error(residual, block=block, out=(packed, sf))  # what it lost is sent next call
    else:
        quantize_int4(flat, block=block, out=(packed, sf))

    half = torch.tensor(0.5, dtype=torch.float32, device=flat.device) if op == "avg" else None

    def decompress(p: int, out: torch.Tensor) -> None:
        ob, of = gout.view(torch.uint8), gout.view(torch.float32)
        scales = of[p * words + sq: p * words + sq + nb]
        dequantize_int4(ob[p * words * 4: p * words * 4 + (n + 1) // 2], scales if half is None else scales * half,
                        out=out, block=block)

    # "avg" is in the scales (as int8's): the sum is not scaled again
    return _exchange(comm, tensor, flat, gin, gout, decompress, "sum",
                     f"allreduce_int4({op}, {n} x {tensor.dtype}, block {block}, gathered)", async_op)


def onebit(comm, tensor, flat, op, residual, groups, async_op):
    """``allreduce_onebit`` on two ranks: one scale per ``groups`` segment of the whole tensor."""
    n = flat.numel()
    c = chunk_elems(n, 1, ONEBIT_ALIGN)
    segs = segments([(0, n)], groups)[0]
    words, ss = slot_words("onebit", c, 0, len(segs)), c // 32
    worker = residual if residual is not None else torch.zeros(n, dtype=torch.float32, device=flat.device)
    gin, gout = _buffers(comm.size, words, torch.int32, flat.device)
    gu, gf = gin.view(torch.uint8), gin.view(torch.float32)
    for j, (s, e) in enumerate(segs):  # segments start at multiples of 8: whole bytes of bits
        _, sc = sign_compress(flat[s:e], worker[s:e], out=gu[s // 8: s // 8 + nbytes(e - s)])
        gf[ss + j].copy_(sc[0])

    def decompress(p: int, out: torch.Tensor) -> None:
        ou, of = gout.view(torch.uint8), gout.view(torch.float32)
        for j, (s, e) in enumerate(segs):
            bits = p * words * 4 + s // 8
            sign_decompress(ou[bits: bits + nbytes(e - s)], of[p * words + ss + j: p * words + ss + j + 1], e - s,
                            out=out[s:e])

    return _exchange(comm, tensor, flat, gin, gout, decompress, op,
                     f"allreduce_onebit({op}, {n} x {tensor.dtype}, gathered)", async_op)


def sixteen_bit(comm, tensor, flat, wire_dtype, op, async_op):
    """``allreduce_16bit`` on two ranks: the same result as its two-shot, one exchange fewer."""
    n = flat.numel()
    gin, gout = _buffers(comm.size, n, wire_dtype, flat.device)
    gin.copy_(flat)  # the one rounding of the inputs

    def decompress(p: int, out: torch.Tensor) -> None:
        out.copy_(gout[p * n: (p + 1) * n])  # upcast exactly

    # The fp32 mean rounded once to the wire dtype, as the two-shot server rounds it, then stored.
    return _exchange(comm, tensor, flat, gin, gout, decompress, op,
                     f"allreduce_16bit({op}, {n} x {tensor.dtype} as {wire_dtype}, gathered)", async_op,
                     round_to=wire_dtype)


def _buffers(size: int, words: int, dtype: torch.dtype, device: torch.device):
    """(gin, gout) from the scratch pool: this rank's slot (zeroed: its padding goes on the wire)
    and every rank's."""
    take = scratch_pool.pool.take
    gin, gout = take(words, dtype, device), take(size * words, dtype, device)
    gin.zero_()
    return gin, gout


def _exchange(comm, tensor, flat, gin, gout, decompress, op: str, description: str, async_op: bool,
              round_to: torch.dtype | None = None):
    """all_gather(gout <- gin); then, in rank order, decompress(p, fp32 out) of every slot, summed
    in fp32, [* fp32(1/n)], [rounded to ``round_to``], stored into ``tensor``. The buffers and the
    fp32 temporaries go back to the scratch pool once the call has succeeded (after an error a
    receive may still land)."""
    result = Work(description)
    n, size = flat.numel(), comm.size
    temporaries: list = []

    def after_gather(work) -> None:
        take = scratch_pool.pool.take
        try:
            work.wait()
            # fp32 temporaries from the pool, as the message buffers: a bucket's call reuses the pages
            acc = flat if flat.dtype == torch.float32 else take(n, torch.float32, flat.device)
            decompress(0, acc)
            term = take(n, torch.float32, flat.device)
            temporaries.append(term)
            if acc is not flat:
                temporaries.append(acc)
            for p in range(1, size):  # rank order: the same sum on every rank
                decompress(p, term)
                acc.add_(term)
            if op == "avg":
                acc.mul_(torch.tensor(1.0 / size, dtype=torch.float32, device=acc.device))
            if round_to is not None:
                flat.copy_(acc.to(round_to))
            elif acc is not flat:
                flat.copy_(acc)
            if flat.data_ptr() != tensor.data_ptr():
                tensor.copy_(flat.view(tensor.shape))  # a strided tensor went through a contiguous copy
        except BaseException as e:  # noqa: BLE001 - delivered through result
            result.set_exception(e)
        else:
            for buffer in (gin, gout, *temporaries):
                scratch_pool.pool.give(buffer)
            result.set_result(tensor)

    gather = comm.all_gather(gout, gin, async_op=True)
    gather.add_done_callback(after_gather)
    if not async_op:
        gather.run_here()  # on this thread, as a synchronous call runs: no hand-off
    return result if async_op else result.wait()
