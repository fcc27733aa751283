"""bench/'s side of the timing harness. ``time_per_call`` is ddl_triton/tuning/timing.py's one
measurement, as every benchmark here and ``ddl-tune`` take it: a warm call, a barrier so that
the ranks start together, ``iters`` back-to-back calls, and the slowest rank's time per call
(an allreduce MAX over the ranks); the bench scripts import it from here. Also the DDP comm
hook that communicates nothing, the baseline against which the benchmarks time DDP's
communication, and a "ddl" group with a given compression."""
from __future__ import annotations

from ddl_triton.tuning.timing import time_per_call

__all__ = ["time_per_call", "unchanged_bucket_hook"]


def unchanged_bucket_hook(state, bucket):
    """A DDP comm hook that communicates nothing: DDP's own bucket work, timed alone."""
    import torch
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def ddl_group_with_compression(setting: str):
    """A "ddl" process group over every rank whose communicator has Options.compression = setting:
    a new group reads the DDL_* variables when it is made, so DDL_COMPRESSION is set for that moment
    (train_scaling.py's compressed modes, _outer_sync_rank.py's "ddl" rows)."""
    import os

    import torch.distributed as dist
    before = os.environ.get("DDL_COMPRESSION")
    os.environ["DDL_COMPRESSION"] = setting
    try:
        return dist.new_group(backend="ddl")
    finally:
        if before is None:
            del os.environ["DDL_COMPRESSION"]
        else:
            os.environ["DDL_COMPRESSION"] = before
