"""bench/_exposure.py: the exposed time of a step from its hand-offs and completions, the per-step
figure over ranks, the quartiles and the last bucket's bytes on each host's link (pure Python)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _exposure  # noqa: E402
from ddl_triton.runtime.compression.compressed import wire_bytes  # noqa: E402


def test_exposed_is_last_completion_after_last_handoff():
    # an early bucket that completes late is what the step waits for, not the last one's own time
    assert _exposure.exposed([1.0, 2.0], [3.5, 2.25]) == pytest.approx(1.5)
    assert _exposure.exposed([1.0, 2.0], [1.5, 2.25]) == pytest.approx(0.25)
    assert _exposure.exposed([1.0, 2.0], [1.5]) is None  # a bucket not completed: no figure
    assert _exposure.exposed([], []) is None


def test_per_step_keeps_the_last_and_first_rank_and_drops_partial_steps():
    lows, highs = _exposure.per_step([[0.010, 0.030, None], [0.050, 0.020, 0.1]])
    assert lows == [0.010, 0.020] and highs == [0.050, 0.030]


def test_quartiles():
    assert _exposure.quartiles([]) is None
    assert _exposure.quartiles([2.0]) == (2.0, 2.0, 2.0)
    assert _exposure.quartiles([4.0, 1.0, 3.0, 2.0, 5.0]) == (2.0, 3.0, 4.0)


def test_wire_bytes_last():
    assert _exposure.wire_bytes_last(2_000_000, "none", 2, 1) == 2_000_000
    assert _exposure.wire_bytes_last(2_000_000, "none", 4, 2) == 3_000_000
    assert _exposure.wire_bytes_last(2_000_000, "none", 1, 2) == 0
    # compressed: each of the host's ranks sends its shard's compressed slots between hosts
    assert _exposure.wire_bytes_last(4_000_000, "int8", 2, 2) == 2 * wire_bytes("int8", 500_000, 2)
    assert _exposure.wire_bytes_last(4_000_000, "int8", 2, 1) < 4_000_000 / 3.5
    line = "2115712 B: int8 between hosts (saves 9 ms; x; y); 2115712 B: none between hosts (hidden)"
    assert _exposure.method_of(line, 2115712) == "none" and _exposure.method_of(line, 7) == "none"
    assert _exposure.method_of("16 B: onebit between hosts (z)", 16) == "onebit"
    assert _exposure.wire_bytes_last(2_000_000, "2000000 B: none between hosts (fast)", 2, 1) == 2_000_000


class _Bucket:
    def buffer(self):
        return torch.ones(4)


def test_wrap_records_handoff_and_completion_per_step():
    exposure = _exposure.Exposure()
    pending = []

    def hook(state, bucket):
        fut = torch.futures.Future()
        pending.append(fut)
        return fut

    timed = exposure.wrap(hook)
    exposure.begin_step()
    timed(None, _Bucket())
    timed(None, _Bucket())
    pending[1].set_result(1)
    assert exposure.take(wait_s=0.01) == [None]  # the first bucket never completed
    exposure.begin_step()
    timed(None, _Bucket())
    pending[2].set_result(1)
    (one,) = exposure.take()
    assert one is not None and 0 <= one < 1.0
