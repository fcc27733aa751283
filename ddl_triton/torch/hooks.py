"""DDP communication hooks that move gradients through a ddl_triton Communicator, compressed or not.

Every hook has DDP's signature ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``
and averages the bucket over the ranks of ``state.comm``:

    hook                   on the wire (per element)   result
    allreduce_hook         fp32                        lossless: like DDP's own (grad * 1/n, then summed)
    fp16_compress_hook     fp16                        the mean rounded to fp16 (fp32 accumulation)
    bf16_compress_hook     bf16                        the mean rounded to bf16 (works on the CPU)
    int8_compress_hook     int8 + fp32 scale / block   block-quantized, error feedback
    onebit_compress_hook   1 bit + fp32 scale / chunk  1-bit Adam style, error feedback on both sides
    auto_compress_hook     fp32 on shm inside a host;  per-level: compressed only where the link is slow,
                           int8 (or 1-bit) between     as ``state.compression`` says ("auto": decided per size)
    compress_hook(name)    any method's wire format    the hook of any row of ddl_triton/compression_methods.py
                                                       (the four named hooks above are those of the built-in rows)

The hooks talk over ``state.comm`` (default ``ddl_triton.init()``, i.e. MPI.COMM_WORLD), not over
DDP's process group, so they work the same whether DDP runs on gloo or on the "ddl" backend; the
ranks of the communicator must be the ranks of DDP's group, in the same order. The compressed
ones are ``ddl_triton.compressed``'s two-shot allreduces (all_to_all of compressed chunks, a
fused reduction per chunk, all_gather of the compressed results): every rank decompresses the
same bytes, so the replicas stay bitwise identical.

Example::

    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ddl_triton.torch.hooks import HookState, int8_compress_hook

    dist.init_process_group("gloo", rank=rank, world_size=size)   # or "ddl"
    model = DDP(net)
    state = HookState()                                   # comm = ddl_triton.init()
    model.register_comm_hook(state, int8_compress_hook)
    ...                                                   # train as usual
    print(state.calls, state.grad_bytes, state.sent_bytes())

The futures are real ``torch.futures.Future``s, resolved (with the bucket tensor, reduced in
place) by the communicator's background thread when the last collective of the bucket ends;
DDP waits for them at the end of backward, so buckets overlap with the rest of the backward pass.

Error feedback: the int8 and 1-bit hooks keep, per bucket, what compression lost (an fp32
tensor the size of the bucket, plus for 1-bit the size of this rank's chunk) and add it to the
next gradient of that bucket, so that over many steps the updates sum to the lossless ones up to
the current residual. Residuals are keyed by ``bucket.index()`` and checked against the bucket's
size: when DDP rebuilds its buckets (after the first iteration) a bucket whose size changed
starts again from zero, counted in ``state.residual_resets``.
"""
import torch
import torch.distributed as dist

import ddl_triton

from .. import compression_methods
from ..gradients.residuals import Residuals
from ..runtime.compression import compressed, per_level
from .level_compression import LevelCompression

__all__ = ["HookState", "allreduce_hook", "auto_compress_hook", "bf16_compress_hook", "compress_hook",
           "fp16_compress_hook", "int8_compress_hook", "onebit_compress_hook"]


class HookState:
    """What the hooks share across calls: the communicator, error-feedback residuals, byte counters.

    comm: the Communicator to reduce over (default ``ddl_triton.init()``, the world).
    error_feedback: keep and re-send what the int8 / 1-bit compression lost (default True).
    block: the int8 quantization block (a power of two in [4, 65536]; default 256).
    onebit_param_scales: 1-bit (and any method whose row takes scale groups) sends one scale per
    chunk (default) or, when True, one per parameter within each chunk (4 bytes more per
    parameter; a layer of small gradients then is not sent at the scale of a layer of large ones).
    compression: what ``auto_compress_hook`` sends between hosts: "auto" (default: decided per
    bucket size, ddl_triton/tuning/auto_compression.py), a method of ddl_triton/compression_methods.py
    (int8, int4, onebit, fp16, bf16, or one registered) or "none" (fp32 everywhere).
    Counters: ``calls`` (hook invocations), ``grad_bytes`` (bucket bytes handed to the hooks),
    ``payload_bytes`` (bytes the hooks' algorithms send from this rank, computed from their
    layouts; for allreduce_hook that of a bandwidth-optimal ring, 2(n-1)/n * bytes),
    ``residual_resets``; ``sent_bytes()`` and ``received_bytes()`` *measure* the bytes this rank's
    communicator has moved since the state was made (all its traffic, from ``comm.transport_bytes``,
    and that of the per-level groups ``auto_compress_hook`` made).
    Example: state = HookState(); ... two steps of a 1000-element fp32 bucket, 4 ranks, int8_compress_hook
             -> state.calls == 2, state.grad_bytes == 8000, state.payload_bytes == 2 * 6 * 4 * (64 + 1)
    """

    __slots__ = ("comm", "error_feedback", "block", "onebit_param_scales", "compression", "calls", "grad_bytes",
                 "payload_bytes", "_residuals", "_at_start", "_levels")

    def __init__(self, comm=None, error_feedback: bool = True, block: int = 256, onebit_param_scales: bool = False,
                 compression: str = "auto"):
        self.comm = comm if comm is not None else ddl_triton.init()
        self.error_feedback = bool(error_feedback)
        if not isinstance(block, int) or block < 4 or block > (1 << 16) or block & (block - 1):
            raise ValueError(f"HookState: block must be a power of two in [4, 65536], got {block!r}")
        self.block = block
        self._levels = LevelCompression(self.comm, compression, block=block, error_feedback=error_feedback)
        self.compression = compression
        self.onebit_param_scales = bool(onebit_param_scales)
        self.calls = 0
        self.grad_bytes = 0
        self.payload_bytes = 0
        self._residuals = Residuals()  # the framework-neutral store (ddl_triton/gradients/residuals.py)
        self._at_start = self._moved("sent"), self._moved("received")

    def sent_bytes(self) -> int:
        """Bytes this rank has sent over all transports of ``comm`` since this state was made.

        The shm transport counts a slot published to k readers as k sends, so a schedule whose
        readers each take part of a slot (two_shot) counts more than crosses; ``received_bytes``
        counts what was read."""
        return self._moved("sent") - self._at_start[0]

    def received_bytes(self) -> int:
        """Bytes this rank has received over all transports of ``comm`` since this state was made."""
        return self._moved("received") - self._at_start[1]

    @property
    def residual_resets(self) -> int:
        """Buckets whose residual restarted from zero because their size, method or device changed."""
        return self._residuals.resets

    def reset_residuals(self) -> None:
        """Forget all error-feedback residuals (e.g. after loading a checkpoint)."""
        self._residuals.clear()

    def follow(self, comm) -> None:
        """Reduce over ``comm`` from now on (an elastic job's new world). The int8 hook's residuals
        are kept (they are sized by the bucket); the 1-bit hook's start again from zero at their next
        use (its server residual is sized by the world), as do ``auto_compress_hook``'s, whose
        per-level groups are made again for ``comm``."""
        self.comm = comm
        self._levels = LevelCompression(comm, self.compression, block=self.block, error_feedback=self.error_feedback)

    def residuals_snapshot(self) -> dict:
        """A copy of the error-feedback residuals (an elastic commit keeps it; ``load_residuals``)."""
        return self._residuals.snapshot()

    def load_residuals(self, snapshot: dict) -> None:
        """Put residuals from ``residuals_snapshot`` back (copied again: the snapshot stays as it was)."""
        self._residuals.load(snapshot)

    def explain(self, nbytes: int) -> str:
        """What ``auto_compress_hook`` sends between hosts for a bucket of ``nbytes``, and why
        (the first call is collective: it builds the per-level groups, and may probe the link)."""
        return self._levels.explain(nbytes)

    def close(self) -> None:
        """Close the per-level groups ``auto_compress_hook`` made (never ``comm``)."""
        self._levels.close()

    def __repr__(self) -> str:
        return (f"HookState(rank={self.comm.rank}, size={self.comm.size}, error_feedback={self.error_feedback}, "
                f"calls={self.calls}, grad_bytes={self.grad_bytes}, payload_bytes={self.payload_bytes})")

    # -- private -----------------------------------------------------------------------------
    def _moved(self, what: str) -> int:
        # auto_compress_hook's bytes travel on the per-level groups' communicators: counted too
        return sum(t[what] for c in (self.comm, *self._levels.groups) for t in c.transport_bytes.values())

    def _count(self, buf: torch.Tensor, payload: int) -> None:
        self.calls += 1
        self.grad_bytes += buf.numel() * buf.element_size()
        self.payload_bytes += payload

    def _residual(self, bucket, kind: str, numel: int, server_numel: int | None = None):
        """(worker, server) residuals of this bucket, zeros when new, resized or of another kind;
        they live beside the gradients (CPU or GPU)."""
        return self._residuals.get(bucket.index(), kind, numel, server_numel, device=bucket.buffer().device)


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket losslessly: each rank's gradient times fp32(1/n), then summed.

    The same arithmetic as DDP's built-in reduction (which scales while copying into the bucket,
    then sums), so on 2 ranks, or on a backend that sums in the communicator's order, the result
    is bitwise equal to DDP without a hook.
    Example (2 ranks): bucket [1.0, 4.0] and [3.0, 0.0] -> both [2.0, 2.0].
    """
    buf = bucket.buffer()
    n = state.comm.size
    state._count(buf, 2 * (n - 1) * buf.numel() * buf.element_size() // n)
    buf.mul_(1.0 / n)
    return _future(lambda: state.comm.allreduce(buf, op="sum", async_op=True))


def fp16_compress_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Cast the bucket to fp16, average (fp32 accumulation, one rounding), cast back. 2 bytes/element.

    Inputs beyond fp16's range (|g| > 65504) become inf, as with torch's fp16_compress_hook.
    Example (2 ranks): [1.0, 0.1] and [1.0, 0.3] -> both [1.0, 0.199951171875] (the fp16 nearest 0.2).
    """
    return _compressed(state, bucket, "fp16")


def bf16_compress_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Cast the bucket to bf16, average (fp32 accumulation, one rounding), cast back. Works on the CPU.

    Example (2 ranks): [1.0, 0.1] and [1.0, 0.3] -> both [1.0, 0.2001953125] (the bf16 nearest 0.2).
    """
    return _compressed(state, bucket, "bf16")


def int8_compress_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with int8 block quantization on the wire (``compressed.allreduce_int8``).

    With ``state.error_feedback`` each rank quantizes gradient + residual and keeps what was lost.
    Per element the result is within (s_w + s_r)(1/2 + 2**-16) of the mean of the rank's
    (gradient + residual), s_w and s_r being the block's absmax/127 before and after the reduction.
    Bytes sent per rank: about 2(n-1)/n * N * (1 + 4/block), 3.94x fewer than fp32 at block 256.
    Example (2 ranks, block 4): [1, 2, 3, 4] and [3, 2, 1, 0] -> both [2.0118, 2.0118, 1.9960, 1.9960].
    """
    return _compressed(state, bucket, "int8")


def onebit_compress_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with 1 bit per element on the wire (``compressed.allreduce_onebit``).

    DeepSpeed 1-bit Adam's compressed allreduce: each rank sends sign bits and one scale
    (mean |v|) per chunk of gradient + worker residual; rank q averages chunk q, compresses it
    again with its server residual, and the results are gathered. With ``state.error_feedback``
    both residuals are kept; one step is crude (every element is +-scale), but the errors are
    re-sent, so the sum of the updates tracks the lossless one. Bytes: ~2(n-1)/n * N/8 (~32x fewer).
    ``state.onebit_param_scales`` sends one scale per parameter of the bucket instead.
    Pair it with plain SGD: under heavy-ball momentum the re-sent errors are amplified
    and training oscillates (examples/train_cnn.py, momentum 0.9: test accuracy 0.71 against 0.98).
    Example (2 ranks, 4 elements): [0.5, -1.5, 2.0, 0.0] and [1, 1, 1, 1] -> both [0.75] * 4.
    """
    return _compressed(state, bucket, "onebit")


def compress_hook(method: str):
    """The DDP hook that averages each bucket with compression ``method`` on the wire: any row of
    ddl_triton/compression_methods.py, a registered one included (the named hooks above are these
    for the built-in rows). Error feedback where the row keeps it (``state.error_feedback``), one
    scale per parameter where it takes scale groups (``state.onebit_param_scales``).
    Example: model.register_comm_hook(HookState(), compress_hook("bf16"))  # as bf16_compress_hook
    """
    compression_methods.get(method)  # an unknown name fails here, listing the valid ones

    def hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return _compressed(state, bucket, method)

    # not "<method>_compress_hook": DDP refuses hooks named as torch's own bf16/fp16 ones without NCCL
    hook.__name__ = hook.__qualname__ = f"ddl_compress_hook_{method}"
    return hook


def auto_compress_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in full precision inside each host and compressed between hosts.

    ``ddl_triton.runtime.compression.per_level.allreduce``: an fp32 reduce_scatter over shm inside the host,
    an int8 (or 1-bit) allreduce of this rank's shard with the same-index ranks of the other
    hosts, an fp32 all_gather over shm. The inter-host method is ``state.compression``: "auto"
    decides per bucket, by its size and its place in backward (``state.explain(nbytes)`` says
    why; never on one host; ddl_triton/torch/level_compression.py), "int8" or
    "onebit" name one, "none" is fp32 throughout. Error feedback (``state.error_feedback``)
    keeps, per bucket, what the inter-host phase lost: 1/L of the bucket (L ranks per host).
    On one host, or where auto finds compression does not pay, it is ``allreduce_hook``.
    Bytes per rank: 2(L-1)/L * 4N on shm, and on the link ``compressed.wire_bytes`` of the
    shard: ~2(H-1)/H * N/L * (1 + 4/block) for int8 (H hosts), against 2(H-1)/H * 4N/L in fp32.
    Example (2 hosts x 2 ranks, int8): buckets [r, -r, 2r] on rank r -> all [1.5, -1.5, 3.0].
    """
    buf = bucket.buffer()
    lc = state._levels
    method = lc.decide(buf.numel() * 4, calling=True).method  # by its size and its place in backward
    if method == compression_methods.NONE or buf.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return allreduce_hook(state, bucket)
    levels = lc.levels
    state._count(buf, sum(per_level.wire_bytes(levels, method, buf.numel(), block=state.block).values()))
    worker = server = None
    if state.error_feedback:
        w, s = per_level.residual_sizes(levels, method, buf.numel(), block=state.block)
        worker, server = state._residual(bucket, "per-level " + method, w, s)
    return _future(lambda: per_level.allreduce(levels, buf, method=method, op="avg", block=state.block,
                                               residual=worker, server_residual=server, async_op=True))


# DDP refuses any hook *named* "bf16_compress_hook" unless CUDA and NCCL >= 2.10 are present (it
# checks hook.__name__, meaning torch's own); this one runs anywhere, so it goes by another name there.
bf16_compress_hook.__name__ = bf16_compress_hook.__qualname__ = "ddl_bf16_compress_hook"


def _compressed(state: HookState, bucket, method: str) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with ``method``'s allreduce (its row says which residuals and keywords)."""
    row = compression_methods.get(method)
    buf = bucket.buffer()
    comm = state.comm
    n = buf.numel()
    groups = _param_starts(bucket) if row.scale_groups and state.onebit_param_scales else None
    state._count(buf, compressed.wire_bytes(method, n, comm.size, block=state.block, groups=groups))
    worker = server = None
    if state.error_feedback and row.worker_residual:
        server_numel = None
        if row.server_residual:  # the server residual covers this rank's chunk
            a, b = compressed.chunk_bounds(n, comm.size, row.align(state.block))[comm.rank]
            server_numel = b - a
        worker, server = state._residual(bucket, method, n, server_numel)
    return _future(lambda: row.run(comm, buf, op="avg", block=state.block, residual=worker, server_residual=server,
                                   groups=groups, async_op=True))


def _param_starts(bucket) -> list[int]:
    """Offsets in the bucket buffer where each of its parameters starts."""
    starts, offset = [], 0
    for p in bucket.parameters():
        starts.append(offset)
        offset += p.numel()
    return starts


def _future(issue) -> torch.futures.Future[torch.Tensor]:
    """A torch Future resolved with the result (or the error) of the Work that ``issue()`` returns,
    when it completes. The Future is made before the collective is issued: once issued, the
    communicator's thread competes for the GIL, and DDP's backward would wait for it."""
    fut: torch.futures.Future = torch.futures.Future()
    work = issue()

    def resolve(w) -> None:
        try:  # runs on the communicator's thread: never raise there
            err = w.exception()
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(w.wait())
        except BaseException as e:  # noqa: BLE001
            try:
                fut.set_exception(e)
            except BaseException:  # noqa: BLE001 - already resolved
                pass

    work.add_done_callback(resolve)
    return fut
