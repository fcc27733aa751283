"""The int4 compressed allreduce: 4-bit values two a byte and an fp32 scale per block on the wire
(kernels/int4.py), for Streaming DiLoCo's pseudo-gradients; the int4 row of
ddl_triton/compression_methods.py names ``allreduce_int4``. compressed.py's two-shot (its module
doc: the exchange, asynchrony, scratch buffers), with int4's worker and server steps:

    worker:  v = x + residual; packed, s = quantize_int4(v, block); residual = v - dequant(packed, s)
    server:  acc = sum_p dequant(packed_p, s_p) in rank order [* fp32(1/n) for avg] [+ server_residual];
             quantize_int4(acc), and with a server residual, server_residual = acc - dequant(...)

Round to nearest everywhere, so every rank decodes the same reduced chunk into the same bits.
Chunk boundaries are multiples of max(block, 8): whole blocks and whole int32 words of 8 values.
On two ranks, ``gathered.int4``: each rank's whole tensor once, nothing quantized twice.

Error, per element, with s_w the ranks' mean block absmax/7 (of x + residual) and s_r the
reduced block's absmax/7: within (s_w + s_r)(1/2 + 2**-16) of the mean of the ranks' x +
residual, plus the server residual when one is kept ("sum": n * s_w in place of s_w); the fp32
sums' roundings fit in the 2**-16 up to 32 ranks. Two ranks: s_w(1/2 + 2**-16).
Error feedback: over T calls with both residuals, sum_t y_t = sum_t mean_t - mean_p(residual_p)
- server_residual up to fp32 rounding, a drift bounded by the residuals' (s_w + s_r)(1/2 + ...).
Why a server residual (int8 keeps none): on 3+ ranks the server requantizes the mean, and a mean
that rounds the same way every call would be lost every call however well the workers re-send
their own errors (tests/unit/test_int4.py shows the drift). It is optional: without it, the
requantization error is not re-sent.

Bytes one rank sends, n ranks, chunk C: 2(n-1) * (C/2 + 4*C/block) ~ 2(n-1)/n * N * (1/2 + 4/block)
(7.76x fewer than a bandwidth-optimal fp32 allreduce at block 256); ``compressed.wire_bytes("int4", ...)``.
"""
from __future__ import annotations

import torch

from . import gathered
from ... import compression_methods
from .compressed import _check_residual, _done, _message_buffers, _prepare, _two_shot
from .layout import chunk_bounds, chunk_elems, slot_words
from ...kernels.int4 import dequantize_int4, quantize_int4, quantize_int4_keep_error, reduce_int4

__all__ = ["allreduce_int4"]


def allreduce_int4(comm, tensor: torch.Tensor, *, op: str = "avg", block: int = 256,
                   residual: torch.Tensor | None = None, server_residual: torch.Tensor | None = None,
                   async_op: bool = False):
    """Allreduce ``tensor`` in place with 4-bit block quantization on the wire (see module doc):
    ``allreduce_int8``'s two-shot with ``kernels.int4``'s compressor, two values a byte.

    tensor: fp32/fp16/bf16, on the CPU or (with CUDA available) a GPU; a non-contiguous tensor
    goes through a contiguous copy, written back. op: "avg" or "sum". block: quantization
    block, a power of two in [4, 65536]. residual: fp32 with tensor.numel() elements on the
    tensor's device, the worker error feedback. server_residual: fp32 with as many elements as
    this rank's chunk (``chunk_bounds(numel, size, max(block, 8))[rank]``), the server error
    feedback: the requantization error of the chunk this rank reduces, added to it next call
    (two ranks have no server step: it stays as passed). Both are updated in place; None: no
    error feedback on that side. Returns ``tensor``, or a Work resolving to it.
    Example (2 ranks, no residual, block 4): rank 0 x = [7, -7, 0, 1], rank 1 x = [7, 7, 7, 7]: both
             blocks are whole multiples of their absmax/7 (1.0), so both ranks end with the exact
             mean [7.0, 0.0, 3.5, 4.0]. A server step (3+ ranks) requantizing that mean (s_r = 1)
             would round 3.5 to even: [7.0, 0.0, 4.0, 4.0], within s_r/2.
    """
    flat, size, n = _prepare(comm, tensor, op, "allreduce_int4", residual)
    if not isinstance(block, int) or block < 4 or block > (1 << 16) or block & (block - 1):
        raise ValueError(f"rank {comm.rank}: allreduce_int4: block must be a power of two in [4, 65536], "
                         f"got {block!r}")
    align = compression_methods.get("int4").align(block)  # whole blocks and whole words of 8 values
    bounds = chunk_bounds(n, size, align)
    a, b = bounds[comm.rank]
    mine = b - a
    if server_residual is not None:
        _check_residual(comm, server_residual, mine, "allreduce_int4: server_residual", tensor.device)
    if n == 0:
        return _done(tensor, async_op)
    if size == 2:
        return gathered.int4(comm, tensor, flat, op, block, residual, async_op)
    c = chunk_elems(n, size, align)
    words = slot_words("int4", c, block)
    sq = c // 8  # where a slot's scales start, in words
    buffers, send, recv, gin, gout = _message_buffers(size, words, torch.int32, flat.device)
    sb, sf = send.view(torch.uint8), send.view(torch.float32)

    def slot(bytes_view, floats_view, p: int, length: int):
        """Slot p's packed values and scales, for a chunk of ``length`` elements."""
        return (bytes_view[p * words * 4: p * words * 4 + (length + 1) // 2],
                floats_view[p * words + sq: p * words + sq + -(-length // block)])

    if residual is not None:
        residual.add_(flat)  # v = x + residual: x upcast exactly
    for p, (a, b) in enumerate(bounds):  # chunk p straight into slot p
        if residual is not None:
            quantize_int4_keep_error(residual[a:b], block=block, out=slot(sb, sf, p, b - a))  # re-sent next call
        else:
            quantize_int4(flat[a:b], block=block, out=slot(sb, sf, p, b - a))
    scale = 1.0 / size if op == "avg" else None

    def server() -> None:
        rb, rf = recv.view(torch.uint8), recv.view(torch.float32)
        ins = [slot(rb, rf, p, mine) for p in range(size)]
        out = slot(gin.view(torch.uint8), gin.view(torch.float32), 0, mine)
        if server_residual is None:
            reduce_int4([i[0] for i in ins], [i[1] for i in ins], numel=mine, block=block, scale=scale, out=out)
            return
        # reduce_int4's sum and scaling, then + server_residual, quantized keeping the error
        acc = dequantize_int4(*ins[0], numel=mine, block=block)
        for p in range(1, size):  # rank order: the same sum wherever it is computed
            dequantize_int4(*ins[p], out=acc, block=block, accumulate=True)
        if scale is not None:
            acc.mul_(torch.tensor(scale, dtype=torch.float32, device=acc.device))
        acc.add_(server_residual)
        quantize_int4_keep_error(acc, block=block, out=out)
        server_residual.copy_(acc)  # what the requantization lost: sent with the next call

    def finish() -> None:
        ob, of = gout.view(torch.uint8), gout.view(torch.float32)
        for p, (a, b) in enumerate(bounds):
            dequantize_int4(*slot(ob, of, p, b - a), out=flat[a:b], block=block)

    return _two_shot(comm, tensor, flat, buffers, send, recv, gin, gout, server, finish,
                     f"allreduce_int4({op}, {n} x {tensor.dtype}, block {block})", async_op)
