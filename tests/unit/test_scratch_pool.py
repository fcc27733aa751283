"""ddl_triton/runtime/calls/scratch_pool.py: buffers given back are reused, never shared, and bounded."""
from __future__ import annotations

import torch

from ddl_triton.runtime.calls.scratch_pool import ScratchPool

CPU = torch.device("cpu")


def test_a_buffer_given_back_is_taken_again_and_one_in_use_never_is():
    pool = ScratchPool()
    a = pool.take(1000, torch.int32, CPU)
    b = pool.take(1000, torch.int32, CPU)
    assert a.data_ptr() != b.data_ptr() and a.shape == (1000,) and a.dtype == torch.int32
    pool.give(a)
    assert pool.idle_bytes == 4000
    assert pool.take(1000, torch.int32, CPU) is a
    assert pool.take(1000, torch.int32, CPU) is not b  # b is still held: a fresh one
    assert pool.idle_bytes == 0


def test_shape_dtype_and_device_must_all_match():
    pool = ScratchPool()
    a = pool.take(64, torch.int32, CPU)
    pool.give(a)
    assert pool.take(64, torch.float32, CPU) is not a
    assert pool.take(32, torch.int32, CPU) is not a
    assert pool.take(64, torch.int32, CPU) is a


def test_idle_buffers_are_bounded_per_shape_and_in_bytes():
    pool = ScratchPool(per_shape=2, max_bytes=10_000)
    bufs = [pool.take(100, torch.int32, CPU) for _ in range(3)]
    for b in bufs:
        pool.give(b)
    assert pool.idle_bytes == 800  # the third was dropped: two per shape
    big = pool.take(2500, torch.int32, CPU)  # 10,000 bytes: over the bound with the 800 idle
    pool.give(big)
    assert pool.idle_bytes == 800
    pool.clear()
    fresh = pool.take(100, torch.int32, CPU)
    assert pool.idle_bytes == 0 and all(fresh is not b for b in bufs)
