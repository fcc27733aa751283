"""bench/'s side of the timing harness. ``time_per_call`` is ddl_triton/tuning/timing.py's one
measurement, as every benchmark here and ``ddl-tune`` take it: a warm call, a barrier so that
the ranks start together, ``iters`` back-to-back calls, and the slowest rank's time per call
(an allreduce MAX over the ranks); the bench scripts import it from here. Also the DDP comm
hook that communicates nothing, the baseline against which the benchmarks time DDP's
communication."""
from __future__ import annotations

from ddl_triton.tuning.timing import time_per_call

__all__ = ["time_per_call", "unchanged_bucket_hook"]


def unchanged_bucket_hook(state, bucket):
    """A DDP comm hook that communicates nothing: DDP's own bucket work, timed alone."""
    import torch
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future
