"""Compressed allreduce: int8, 1-bit and 16-bit gradients on the wire, reduced through the compression kernels.

These are the allreduces the rows of ddl_triton/compression_methods.py name (the fp16 and bf16
rows both run ``allreduce_16bit``); the rows give each method's wire layout, and ``wire_bytes``
its exact bytes.

Three lossy allreduces on a :class:`~ddl_triton.Communicator` (and int4.py's), each a *two-shot* exchange:

    1. compress this rank's tensor chunk by chunk      (chunk q will be reduced by rank q)
    2. all_to_all: rank q receives chunk q of every rank, compressed
    3. rank q reduces its n received chunks in rank order and compresses the result once
    4. all_gather: every rank receives every reduced chunk, compressed
    5. decompress into the caller's tensor              (in place)

or, on **two ranks**, a *gathered* one (one exchange, nothing compressed twice):

    1. compress this rank's whole tensor               (the worker step below, on one chunk)
    2. all_gather: each rank receives the other's compressed tensor
    3. decompress both in rank order, sum in fp32 [* 1/n], round once into the caller's tensor

Two ranks send the same bytes either way (each sends its compressed tensor once: half before
the reduction and half after, or all of it at once), so the gathered form saves one exchange's
latency and machinery and the server's requantization (for 16-bit, whose server step only
rounds, the result is the same). Every rank decompresses the same gathered bytes with the same
operations, so the results are bitwise identical on all ranks. The compressors are the kernels
of ``ddl_triton.kernels``:

``allreduce_int8`` (block-quantized, error feedback)
    worker:  v = x + residual; q, s = quantize_int8(v, block); residual = v - dequantize(q, s)
    server:  reduce_int8(q_0..q_{n-1}) = quantize(sum_p dequant(q_p) [* 1/n for avg])  (fused)
    Chunk boundaries are multiples of ``block``, so no quantization block spans two chunks.
    Error: per element, the worker's step loses at most s_w*(1/2 + 2**-16) (kept in the residual
    and sent at a later call); the server's requantization adds at most s_r*(1/2 + 2**-16), where
    s_w, s_r are the absmax/127 of the element's block before and after the reduction.
    Two ranks (gathered): the mean of the two workers' dequantized values, in fp32: the
    worker's error alone.

``allreduce_int4`` (4-bit values, two a byte, error feedback on both sides)
    int8's two-shot with kernels/int4.py's compressor: runtime/compression/int4.py.

``allreduce_onebit`` (DeepSpeed 1-bit Adam style, error feedback on both sides)
    worker:  per chunk, bits, scale = sign_compress(x + residual)   (residual keeps the error)
    server:  avg = sum_p sign_decompress(bits_p, scale_p) [* 1/n]; sign_compress(avg + server_residual)
    Each value leaves as +-scale of its chunk (scale = mean |v| over the chunk; optionally one
    scale per ``groups`` segment): one call is crude, but what it loses is re-sent later. Over
    T calls, sum_t y_t = sum_t mean_t - mean_p(residual_p) - server_residual exactly, up to fp32
    rounding (tests/multirank/hooks_worker.py checks this identity).
    Two ranks (gathered): avg = the mean of the two decompressed tensors, not compressed again,
    so the server residual is not used (it stays as passed: zeros keep the identity).

``allreduce_16bit`` (fp16 or bf16 on the wire; inputs and result each rounded once to it)
    worker:  the tensor rounded once to ``wire_dtype``
    server:  fp32 sum in rank order [* 1/n], rounded once to ``wire_dtype``
    Unlike ``Communicator.allreduce`` on a 16-bit tensor (which carries fp32 partial sums on
    multi-hop schedules, i.e. 4 bytes per element), this sends 2 bytes per element both ways.

Bytes each rank sends (payload, as counted by ``comm.transport_bytes``), n ranks, N elements,
chunk C elements (``chunk_bounds``), against a bandwidth-optimal fp32 allreduce's 2(n-1)/n * 4N:

    int8   2(n-1) * (C + 4*C/block)       ~ 2(n-1)/n * N * (1 + 4/block)   (3.94x fewer, block 256)
    int4   2(n-1) * (C/2 + 4*C/block)     ~ 2(n-1)/n * N * (1/2 + 4/block) (7.76x fewer, block 256)
    1-bit  2(n-1) * (C/8 + 4*S)           ~ 2(n-1)/n * N/8                 (~32x fewer)
    16-bit 2(n-1) * 2C                    ~ 2(n-1)/n * 2N                  (2x fewer)

(S: scales per chunk, 1 unless ``groups`` is given; two ranks send one slot of the whole
tensor, C = N rounded up to the alignment, as the same ~N/2 * 2 figure.) ``wire_bytes`` gives
the exact figure.
C rounds N/n up to a multiple of the block (int8), of 32 (1-bit) or of 1 (16-bit): on small
tensors the padding shows (int8, N = 10_000, n = 4: C = 2560, 3.85x fewer rather than 3.94x;
N = 138_698: 3.94x, 3.93x, 3.92x at 2, 3, 4 ranks).

Worked example (N = 8, block = 4, op "avg", no residual):
    rank 0: x = [1, 2, 3, 4,   8, 0, 0, 0]     rank 1: x = [3, 2, 1, 0,   0, 0, 0, -8]
    block 0 leaves rank 0 as q = [32, 64, 95, 127], s = 4/127 and rank 1 as q = [127, 85, 42, 0], s = 3/127;
    block 1 as [127, 0, 0, 0] and [0, 0, 0, -127], s = 8/127 (exact).
    Two ranks (gathered): both dequantize both and average:
      [2.003937, 2.011811, 1.992126, 2.0,   4.0, 0.0, 0.0, -4.0]
    (exact mean [2, 2, 2, 2, 4, 0, 0, -4]; every element within s_w(1/2 + 2**-16) of it).
    In a two-shot (more ranks, the same two inputs among them), the rank reducing chunk [0, 4)
    gets that mean from reduce_int8 requantized: q = [127, 127, 126, 126], s = 2.011811/127, so
    every rank ends with [2.011811, 2.011811, 1.995970, 1.995970] there: within
    (s_w + s_r)(1/2 + 2**-16).

Asynchrony: with ``async_op=True`` the functions return a :class:`~ddl_triton.Work` right after
issuing both collectives (all_to_all, then all_gather; two ranks: the all_gather alone) on
``comm``'s ordered queue; a synchronous call runs them on the calling thread. The server
reduction runs in the all_to_all's done-callback, which the queue runs before it starts the next
collective, so the all_gather always reads the reduced chunk (``ddl_triton.work``: callbacks run
inside the job's completion, before the queue moves on). Issue these calls in the same order on
every rank, as any collective. Until the call completes, the tensor's contents are undefined
(the int8 path keeps scratch values in it). The message buffers of a call come from
``scratch_pool`` and go back to it when the call succeeds, so a training loop's calls reuse the
same pages. Should the server step raise on one rank (a bug, memory), that rank's Work reports
the error; its peers are not told and receive that chunk unreduced (zeros).
"""
from __future__ import annotations

import torch

from . import gathered
from ... import compression_methods
from ..calls import gpu_path, scratch_pool
from .layout import ONEBIT_ALIGN, chunk_bounds, chunk_elems, nbytes, segments, slot_words, whole_slot_words
from ...kernels import sixteen_bit
from ...kernels import (dequantize_int8, quantize_int8, quantize_int8_keep_error, reduce_int8, sign_compress,
                       sign_decompress)
from ..calls.work import Work

__all__ = ["allreduce_16bit", "allreduce_int8", "allreduce_onebit", "chunk_bounds", "latency_steps",
           "wire_bytes"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def wire_bytes(kind: str, numel: int, size: int, *, block: int = 256, groups=None) -> int:
    """Exact payload bytes one rank sends for one call of method ``kind`` on ``numel`` elements.

    kind: a method of ddl_triton/compression_methods.py ("int8" with ``block``, "onebit" with its
    ``groups``, if any, "fp16", "bf16"; "16bit" names fp16 and bf16's shared layout), whose row
    gives the layout. 0 when size == 1 or numel == 0.
    Example: wire_bytes("int8", 1 << 20, 4) -> 6 * 4 * (65536 + 1024) = 1_597_440
             (fp32 ring: 2*3/4 * 4 MiB = 6_291_456 bytes, 3.94x more);
             wire_bytes("int8", 1 << 20, 2) -> 4 * (262144 + 4096) = 1_064_960 (one slot of all of it).
    """
    row = compression_methods.layout(kind)
    if size == 1 or numel == 0:
        return 0
    if size == 2 and row.gathered:  # gathered: each rank sends its one slot of the whole tensor
        return whole_slot_words(kind, numel, block, groups) * row.word_bytes
    bounds = chunk_bounds(numel, size, row.align(block))
    scales = max(len(g) for g in segments(bounds, groups)) if row.scale_groups else 1
    words = row.slot_words(chunk_elems(numel, size, row.align(block)), block, scales)
    return 2 * (size - 1) * words * row.word_bytes


def latency_steps(size: int) -> int:
    """Messages in a row one call waits for, each paying the link's latency: the two-shot's
    all_to_all and all_gather, (size - 1) each; two ranks' one all_gather, 1; none on one rank."""
    return 0 if size == 1 else 1 if size == 2 else 2 * (size - 1)


def allreduce_int8(comm, tensor: torch.Tensor, *, op: str = "avg", block: int = 256,
                   residual: torch.Tensor | None = None, async_op: bool = False):
    """Allreduce ``tensor`` in place with int8 block quantization on the wire (see module doc).

    tensor: fp32/fp16/bf16, on the CPU or (with CUDA available) a GPU. op: "avg" or "sum".
    block: quantization block, a power of two in [4, 65536]. residual: fp32 with tensor.numel()
    elements on the tensor's device, the error feedback, updated in place (None: no error
    feedback). Returns ``tensor``, or a Work resolving to it.
    Example (2 ranks, no residual): rank 0 x = [1, 2, 3, 4], rank 1 x = [3, 2, 1, 0], block 4
             -> both [2.003937, 2.011811, 1.992126, 2.0] (exact mean: 2, each within 2/127).
    """
    flat, size, n = _prepare(comm, tensor, op, "allreduce_int8", residual)
    if not isinstance(block, int) or block < 4 or block > (1 << 16) or block & (block - 1):
        raise ValueError(f"rank {comm.rank}: allreduce_int8: block must be a power of two in [4, 65536], "
                         f"got {block!r}")
    if n == 0:
        return _done(tensor, async_op)
    if size == 2:
        return gathered.int8(comm, tensor, flat, op, block, residual, async_op)
    c = chunk_elems(n, size, block)
    words = slot_words("int8", c, block)
    sq = c // 4  # where a slot's scales start, in words
    bounds = chunk_bounds(n, size, block)
    buffers, send, recv, gin, gout = _message_buffers(size, words, torch.int32, flat.device)
    sb, sf = send.view(torch.int8), send.view(torch.float32)
    if residual is not None:
        residual.add_(flat)  # v = x + residual: x upcast exactly
    for p, (a, b) in enumerate(bounds):  # chunk p straight into slot p: values, then scales
        nb = -(-(b - a) // block)
        qp, sp = sb[p * words * 4: p * words * 4 + b - a], sf[p * words + sq: p * words + sq + nb]
        if residual is not None:
            quantize_int8_keep_error(residual[a:b], block=block, out=(qp, sp))  # what it lost is sent next call
        else:
            quantize_int8(flat[a:b], block=block, out=(qp, sp))
    a, b = bounds[comm.rank]
    mine, nbm = b - a, -(-(b - a) // block)
    scale = 1.0 / size if op == "avg" else None

    def server() -> None:
        rb, rf = recv.view(torch.int8), recv.view(torch.float32)
        qs = [rb[p * words * 4: p * words * 4 + mine] for p in range(size)]
        ss = [rf[p * words + sq: p * words + sq + nbm] for p in range(size)]
        reduce_int8(qs, ss, block=block, scale=scale,
                    out=(gin.view(torch.int8)[:mine], gin.view(torch.float32)[sq: sq + nbm]))

    def finish() -> None:
        ob, of = gout.view(torch.int8), gout.view(torch.float32)
        for p, (a, b) in enumerate(bounds):
            nb = -(-(b - a) // block)
            dequantize_int8(ob[p * words * 4: p * words * 4 + b - a], of[p * words + sq: p * words + sq + nb],
                            out=flat[a:b], block=block)

    return _two_shot(comm, tensor, flat, buffers, send, recv, gin, gout, server, finish,
                     f"allreduce_int8({op}, {n} x {tensor.dtype}, block {block})", async_op)


def allreduce_onebit(comm, tensor: torch.Tensor, *, op: str = "avg", residual: torch.Tensor | None = None,
                     server_residual: torch.Tensor | None = None, groups=None, async_op: bool = False):
    """Allreduce ``tensor`` in place with 1 bit per element on the wire (see module doc).

    tensor: fp32/fp16/bf16, on the CPU or (with CUDA available) a GPU. op: "avg" or "sum".
    residual: fp32, tensor.numel() elements on the tensor's device, the worker error feedback.
    server_residual: fp32 with as many elements as this rank's chunk
    (``chunk_bounds(numel, size, 32)[rank]``), the server error feedback. Both are updated in
    place; None: no error feedback on that side. groups: element offsets where a new scale
    starts (e.g. where each parameter of a DDP bucket starts), rounded down to a multiple of 8;
    chunk boundaries always start one. Default: one scale per chunk. Each scale is 4 more bytes
    on the wire. Returns ``tensor``, or a Work resolving to it.
    Example (2 ranks, no residuals, N = 4):
             rank 0 x = [0.5, -1.5, 2.0, 0.0] -> +-1.0 (scale mean|x| = 1.0), signs + - + +
             rank 1 x = [1.0,  1.0, 1.0, 1.0] -> +-1.0,                         signs + + + +
             -> both ranks: the avg of the decompressed, [1.0, 0.0, 1.0, 1.0]
             (more ranks, two-shot: the server compresses that avg again, scale 0.75, signs + + + +,
             and every rank gets [0.75, 0.75, 0.75, 0.75])
    """
    flat, size, n = _prepare(comm, tensor, op, "allreduce_onebit", residual)
    bounds = chunk_bounds(n, size, ONEBIT_ALIGN)
    a, b = bounds[comm.rank]
    mine = b - a
    if server_residual is not None:
        _check_residual(comm, server_residual, mine, "allreduce_onebit: server_residual", tensor.device)
    if n == 0:
        return _done(tensor, async_op)
    if size == 2:
        return gathered.onebit(comm, tensor, flat, op, residual, groups, async_op)
    c = chunk_elems(n, size, ONEBIT_ALIGN)
    segs = segments(bounds, groups)
    words = slot_words("onebit", c, 0, max(len(g) for g in segs))
    ss = c // 32  # the word holding a slot's first scale
    worker = residual if residual is not None else torch.zeros(n, dtype=torch.float32, device=flat.device)
    buffers, send, recv, gin, gout = _message_buffers(size, words, torch.int32, flat.device)
    su, sf = send.view(torch.uint8), send.view(torch.float32)
    for p, (a, _) in enumerate(bounds):
        for j, (s, e) in enumerate(segs[p]):
            bits = p * words * 4 + (s - a) // 8
            _, sc = sign_compress(flat[s:e], worker[s:e], out=su[bits: bits + nbytes(e - s)])
            sf[p * words + ss + j].copy_(sc[0])
    inv = torch.tensor(1.0 / size, dtype=torch.float32, device=flat.device) if op == "avg" else None
    a0, mysegs = bounds[comm.rank][0], segs[comm.rank]

    def server() -> None:
        ru, rf = recv.view(torch.uint8), recv.view(torch.float32)
        acc = torch.zeros(mine, dtype=torch.float32, device=flat.device)
        for p in range(size):  # rank order: the same sum wherever it is computed
            for j, (s, e) in enumerate(mysegs):
                bits = p * words * 4 + (s - a0) // 8
                acc[s - a0: e - a0].add_(sign_decompress(ru[bits: bits + nbytes(e - s)],
                                                         rf[p * words + ss + j: p * words + ss + j + 1], e - s))
        if inv is not None:
            acc.mul_(inv)
        srv = server_residual if server_residual is not None else \
            torch.zeros(mine, dtype=torch.float32, device=flat.device)
        gu, gf = gin.view(torch.uint8), gin.view(torch.float32)
        for j, (s, e) in enumerate(mysegs):
            bits = (s - a0) // 8
            _, sc = sign_compress(acc[s - a0: e - a0], srv[s - a0: e - a0], out=gu[bits: bits + nbytes(e - s)])
            gf[ss + j].copy_(sc[0])

    def finish() -> None:
        ou, of = gout.view(torch.uint8), gout.view(torch.float32)
        for p, (a, _) in enumerate(bounds):
            for j, (s, e) in enumerate(segs[p]):
                bits = p * words * 4 + (s - a) // 8
                sign_decompress(ou[bits: bits + nbytes(e - s)], of[p * words + ss + j: p * words + ss + j + 1],
                                e - s, out=flat[s:e])

    return _two_shot(comm, tensor, flat, buffers, send, recv, gin, gout, server, finish,
                     f"allreduce_onebit({op}, {n} x {tensor.dtype})", async_op)


def allreduce_16bit(comm, tensor: torch.Tensor, *, wire_dtype=torch.float16, op: str = "avg",
                    async_op: bool = False):
    """Allreduce ``tensor`` in place with ``wire_dtype`` (torch.float16 / torch.bfloat16, or their names)
    values on the wire: the fp16 and bf16 methods.

    The result is the fp32 sum in rank order of the inputs rounded to ``wire_dtype`` ([* fp32(1/n)]
    for "avg"), rounded once to ``wire_dtype``, then stored in tensor's dtype: bitwise identical
    on every rank. Returns ``tensor``, or a Work resolving to it.
    Example (2 ranks, bf16): rank 0 [1.0, 3.0], rank 1 [1.00390625, 0.1]
             -> bf16 inputs [1.0, 3.0] and [1.0, 0.10009765625]; fp32 mean [1.0, 1.550048828125]
             -> both ranks [1.0, 1.546875] (the nearest bf16).
    """
    try:
        wire_dtype = sixteen_bit.wire_dtype(wire_dtype)  # a torch dtype, or its name (the fp16 / bf16 rows)
    except TypeError:
        raise TypeError(f"rank {comm.rank}: allreduce_16bit: wire_dtype must be float16 or bfloat16, "
                        f"got {wire_dtype}") from None
    flat, size, n = _prepare(comm, tensor, op, "allreduce_16bit", None)
    if n == 0:
        return _done(tensor, async_op)
    if size == 2:
        return gathered.sixteen_bit(comm, tensor, flat, wire_dtype, op, async_op)
    c = chunk_elems(n, size, 1)
    buffers, send, recv, gin, gout = _message_buffers(size, c, wire_dtype, flat.device)
    sixteen_bit.compress_16bit(flat, wire_dtype, out=send[:n])  # the one rounding of the inputs
    a, b = chunk_bounds(n, size, 1)[comm.rank]
    mine = b - a
    inv = torch.tensor(1.0 / size, dtype=torch.float32, device=flat.device) if op == "avg" else None

    def server() -> None:
        acc = recv[:mine].to(torch.float32)
        for p in range(1, size):
            acc.add_(recv[p * c: p * c + mine])  # upcast exactly, added in fp32
        if inv is not None:
            acc.mul_(inv)
        gin[:mine].copy_(acc)  # the one rounding of the result

    def finish() -> None:
        flat.copy_(gout[:n])  # chunks are laid end to end: the padding is all at the end

    return _two_shot(comm, tensor, flat, buffers, send, recv, gin, gout, server, finish,
                     f"allreduce_16bit({op}, {n} x {tensor.dtype} as {wire_dtype})", async_op)


# ------------------------------------------------------------------------------------------------
# private helpers
# ------------------------------------------------------------------------------------------------

def _prepare(comm, tensor, op, name, residual):
    """Validate before any communication; return (flat contiguous work tensor, size, numel)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"rank {comm.rank}: {name}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _FLOATS:
        raise TypeError(f"rank {comm.rank}: {name}: tensor must be float32, float16 or bfloat16, got {tensor.dtype}")
    if not tensor.is_cpu and not (tensor.is_cuda and gpu_path.available()):
        raise ValueError(f"rank {comm.rank}: {name}: tensor is on {tensor.device}; only CPU and (with CUDA "
                         "available) CUDA tensors are supported")
    if op not in ("avg", "sum"):
        raise ValueError(f"rank {comm.rank}: {name}: op must be 'avg' or 'sum', got {op!r}")
    n = tensor.numel()
    if residual is not None:
        _check_residual(comm, residual, n, f"{name}: residual", tensor.device)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    return flat, comm.size, n


def _check_residual(comm, residual, n: int, what: str, device: torch.device) -> None:
    if not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32 or residual.device != device:
        raise TypeError(f"rank {comm.rank}: {what} must be an fp32 tensor on {device}, like the tensor")
    if residual.numel() != n or not residual.is_contiguous():
        raise ValueError(f"rank {comm.rank}: {what} must be contiguous with {n} elements, "
                         f"has {residual.numel()}")


def _done(tensor: torch.Tensor, async_op: bool):
    if not async_op:
        return tensor
    work = Work("compressed allreduce of 0 elements")
    work.set_result(tensor)
    return work


def _message_buffers(size: int, words: int, dtype: torch.dtype, device: torch.device):
    """(buffers, send, recv, gin, gout): one call's message buffers, taken from the scratch pool.

    send, recv and gout hold ``size`` slots of ``words`` elements, gin one slot; ``buffers`` lists
    the four, to give back. send and gin are zeroed: the padding of a slot goes on the wire, and
    must not carry an earlier call's bytes. (Four tensors, not views of one: a collective refuses
    an output that shares storage with its input.)
    """
    take = scratch_pool.pool.take
    send, recv, gout = (take(size * words, dtype, device) for _ in range(3))
    gin = take(words, dtype, device)
    send.zero_()
    gin.zero_()
    return (send, recv, gin, gout), send, recv, gin, gout


def _two_shot(comm, tensor, flat, buffers, send, recv, gin, gout, server, finish, description: str,
              async_op: bool):
    """all_to_all(recv <- send); server() fills gin; all_gather(gout <- gin); finish() decompresses.

    Both collectives are issued now, in this order, on comm's queue. server() runs in the
    all_to_all's done-callback: on the queue's thread before the queue starts the all_gather, or
    here, before the all_gather is issued, if the all_to_all is already complete. ``buffers`` (the
    four) go back to the scratch pool once the call has succeeded; after an error a receive may
    still land in one, so they are dropped.
    """
    result = Work(description)
    failed: list[BaseException] = []

    def after_exchange(work) -> None:
        try:  # never raise into the queue's thread
            work.wait()
            server()
        except BaseException as e:  # noqa: BLE001 - delivered through result
            failed.append(e)

    def after_gather(work) -> None:
        try:
            if failed:
                raise failed[0]
            work.wait()
            finish()
            if flat.data_ptr() != tensor.data_ptr():
                tensor.copy_(flat.view(tensor.shape))  # a strided tensor went through a contiguous copy
        except BaseException as e:  # noqa: BLE001
            result.set_exception(e)
        else:
            for buffer in buffers:
                scratch_pool.pool.give(buffer)
            result.set_result(tensor)

    comm.all_to_all(recv, send, async_op=True).add_done_callback(after_exchange)
    gather = comm.all_gather(gout, gin, async_op=True)
    gather.add_done_callback(after_gather)
    if not async_op:
        gather.run_here()  # both collectives on this thread, as a synchronous call's are: no hand-off
    return result if async_op else result.wait()
