"""The GB/s of a kernel: the one bandwidth measurement of bench/kernels.py and bench/gpu_check.py.

``measure(fns, nbytes, device=...)`` times single calls of each fn, where each fn does the same
work (say, our kernel and the same operation in plain torch ops), and returns one
``Measurement`` per fn: p20/p50/p80 of the time of one call, in ms, and
``gbps = nbytes / p50 / 1e9``, where ``nbytes`` is what the work must read plus write (the
definition nccl-tests uses for algbw).

How a call is timed:

- CUDA device: by a pair of CUDA events recorded on the current stream around the call, after
  zeroing a 256 MiB buffer so that no input is served from L2 (as ``triton.testing.do_bench``
  does). The events measure GPU time, not the CPU's launch overhead around it.
- CPU: by ``time.perf_counter`` around the call (a CPU call is synchronous).

The fns alternate call by call (a round calls each once, in order), so a burst of load from
elsewhere on the machine, or a GPU clock change, lands on every side of a comparison rather than on
one. Before timing, each fn is called once (compilation, autotuning, allocation), then rounds run
untimed for ``warmup_s``. Rounds are then timed until every fn has ``min_calls`` calls and
``min_seconds`` have passed, or 10 x ``min_calls`` calls, whichever comes first.

Example::

    ours, theirs = measure([lambda: K.reduce(out, [a, b]), lambda: torch.add(a, b, out=out)],
                           nbytes=3 * a.numel() * 4, device=a.device)
    ours.gbps / theirs.gbps     # how much faster ours is at the median
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

L2_FLUSH_BYTES = 256 << 20  # larger than any GPU's L2 (an H200 has 60 MiB)
CLOCKS = {"cuda": "CUDA events, L2 flushed before each call", "cpu": "time.perf_counter"}


@dataclass(frozen=True)
class Measurement:
    """One fn's timings: percentiles of single calls (ms), how many calls, and GB/s at the median."""
    p20_ms: float
    p50_ms: float
    p80_ms: float
    calls: int
    nbytes: int
    gbps: float


def measure(fns: Sequence[Callable[[], object]], nbytes: int, *, device: torch.device | str,
            min_calls: int = 25, min_seconds: float = 0.5, warmup_s: float = 0.025) -> list[Measurement]:
    """Time each of ``fns`` (the same ``nbytes`` of work, done on ``device``); see the module docstring."""
    if not fns:
        raise ValueError("measure: no functions to time")
    if min_calls < 1:
        raise ValueError(f"measure: min_calls must be at least 1, got {min_calls}")
    device = torch.device(device)
    timed_round = _CudaRound(device) if device.type == "cuda" else _wall_clock_round
    for fn in fns:
        fn()
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        timed_round(fns)
    samples: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while len(samples[0]) < min_calls or (time.perf_counter() - start < min_seconds
                                          and len(samples[0]) < 10 * min_calls):
        for acc, ms in zip(samples, timed_round(fns)):
            acc.append(ms)
    return [_measurement(acc, nbytes) for acc in samples]


def _measurement(samples_ms: list[float], nbytes: int) -> Measurement:
    deciles = (statistics.quantiles(samples_ms, n=10, method="inclusive") if len(samples_ms) > 1
               else samples_ms * 9)
    p50 = statistics.median(samples_ms)
    gbps = nbytes / (p50 * 1e-3) / 1e9 if p50 > 0 else float("inf")  # below the clock's resolution
    return Measurement(p20_ms=deciles[1], p50_ms=p50, p80_ms=deciles[7], calls=len(samples_ms), nbytes=nbytes,
                       gbps=gbps)


def _wall_clock_round(fns: Sequence[Callable[[], object]]) -> list[float]:
    """Each fn called once, each call timed by the wall clock (ms)."""
    times = []
    for fn in fns:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


class _CudaRound:
    """Each fn called once, each call timed by CUDA events (ms), with L2 flushed before each."""

    def __init__(self, device: torch.device):
        self.device = device
        self.flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)

    def __call__(self, fns: Sequence[Callable[[], object]]) -> list[float]:
        events = []
        for fn in fns:
            self.flush.zero_()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            events.append((begin, end))
        # One wait per round: the events need their work done; the time between rounds is not timed.
        torch.cuda.synchronize(self.device)
        return [begin.elapsed_time(end) for begin, end in events]
