"""``DiLoCo(sync_every="auto")``: per-step averaging or outer sync, as the planner chooses from measurements.

The planner is ddl_triton/planning/outer_sync.py's ``plan_sync`` (numbers in, a ``SyncPlan`` out); this
module measures what it needs and runs what it chose:

1. **measuring** (the first ``MEASURED_STEPS`` + 1 inner steps): the gradients are averaged across
   the replicas before every inner step, in fp32 (per-step data parallelism: the training math of
   synchronous training, and the replicas stay identical). The compute step time is the time
   between two inner steps' ends less the time the averaging took; each rank takes the median of
   its ``MEASURED_STEPS`` intervals (the first step, with its warm-up, is not one), and every rank
   the largest, so every rank plans alike. In the same steps, and agreed the same way (one
   allreduce, op max, of every figure): the exposed time of one per-step fp32 average (each
   ``before_inner_step`` timed whole: flattening, the Reducer's call, copy-back; the median), and,
   where the ranks span hosts, each compressed candidate's codec: the median of
   ``_CODEC_REPS`` timed calls of its registry row's ``roundtrip`` (ddl_triton/compression_methods.py,
   what tuning/auto_compression.py's probe times) on the model's size (at most ``_CODEC_MAX_ELEMENTS``
   elements, scaled per byte), after one untimed call; the candidates are
   ``plan_sync``'s per-step methods for the user's ``compression``, which include every method it
   may price for the pseudo-gradients.
2. **planning**: ``plan_sync`` with the model's fp32 bytes, that step time, the hosts and ranks per
   host of the communicator's placement, the link between hosts the init probe measured
   (``comm.planner.link``: ddl_triton/runtime/setup/link_probe.py, planning/measured_link.py; where
   init did not measure it but the ranks span hosts, the compression rule's probe,
   tuning/auto_compression.py, times it now: every rank, same step), ``max_sync_every`` and the
   user's ``compression`` and ``fragments``, and the measured ``per_step_fp32_s`` and
   ``codec_s_per_byte`` (planning/outer_sync.py's module doc: what each prices). Rank 0 prints
   ``plan.why`` once (with the measured terms).
3. **running** it: "per-step" keeps averaging the gradients before every inner step, with the
   plan's compression (per level: ddl_triton/gradients' Reducer); "outer" starts DiLoCo with the
   plan's H from the parameters of this step (identical on every rank), fragments as asked and,
   for more than one, the largest ``fragment_sync_delay`` (H / fragments - 1: what the planner
   assumed) unless one was given.
"""
from __future__ import annotations

import math
import statistics
import time

import torch

from .. import compression_methods
from ..gradients import Reducer

__all__ = ["MEASURED_STEPS", "AutoSync"]

MEASURED_STEPS = 4
_CODEC_REPS = 3
_CODEC_MAX_ELEMENTS = 1 << 18  # 1 MiB of fp32, the compression probe's size: a per-byte figure, cheap for any model


def planner():
    """``plan_sync``, or None where this build has no outer-sync planner."""
    try:
        from ..planning.outer_sync import plan_sync
    except ImportError:
        return None
    return plan_sync


class AutoSync:
    """The measuring and per-step phases of ``sync_every="auto"`` (module doc) for ``params`` over ``comm``."""

    def __init__(self, comm, params: list, max_sync_every: int, compression: str | None, fragments: int,
                 block: int, error_feedback: bool):
        self.comm, self.params = comm, params
        self.max_sync_every, self.fragments = max_sync_every, fragments
        self.compression = compression
        self.plan = None
        self.steps = 0
        self._reducer = Reducer(comm, compression_methods.NONE, named="levels", block=block,
                                error_feedback=error_feedback, who="DiLoCo per-step")
        self._block, self._error_feedback = block, error_feedback
        self._last_end: float | None = None
        self._averaging_s = 0.0
        self._intervals: list[float] = []
        self._averages: list[float] = []  # each measured step's per-step fp32 average, seconds

    @property
    def per_step(self) -> bool:
        """Whether the gradients are averaged before each inner step (measuring, or the plan's per-step)."""
        return self.plan is None or self.plan.mode == "per-step"

    def before_inner_step(self) -> None:
        """Average every parameter's gradient across the replicas (a missing one counts as zeros)."""
        t0 = time.perf_counter()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.detach().reshape(-1) for g in grads])
        method = self._reducer.decide_bucket(flat.numel(), flat.dtype).method
        self._reducer.reduce(flat, "gradients", method, op="avg")
        o = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[o: o + n].view_as(p).to(p.dtype, copy=True)
            o += n
        self._averaging_s += time.perf_counter() - t0

    def after_inner_step(self):
        """Count the step; on the step that decides, return the plan (else None)."""
        self.steps += 1
        now = time.perf_counter()
        if self._last_end is not None:
            self._intervals.append(now - self._last_end - self._averaging_s)
            self._averages.append(self._averaging_s)
        self._last_end, self._averaging_s = now, 0.0
        if self.plan is not None or len(self._intervals) < MEASURED_STEPS:
            return None
        self.plan = self._decide()
        if self.plan.mode == "per-step" and self.plan.compression != compression_methods.NONE:
            self._reducer.close()
            self._reducer = Reducer(self.comm, self.plan.compression, named="levels", block=self._block,
                                    error_feedback=self._error_feedback, who="DiLoCo per-step")
        return self.plan

    def follow(self, comm) -> None:
        """Average over ``comm`` from now on (an elastic job's new world)."""
        setting = self._reducer.setting
        try:
            self._reducer.close()
        except Exception:  # noqa: BLE001 - the old world's groups: nothing of them is needed any more
            pass
        self.comm = comm
        self._reducer = Reducer(comm, setting, named="levels", block=self._block, error_feedback=self._error_feedback,
                                who="DiLoCo per-step")

    def close(self) -> None:
        """Close the groups made for the per-step averages (never ``comm``)."""
        self._reducer.close()

    def _decide(self):
        from ..planning.outer_sync import per_step_methods

        comm = self.comm
        nodes = comm.placement.node_of_rank
        hosts = len(set(nodes))
        ranks_per_host = max(nodes.count(n) for n in set(nodes))
        numel = sum(p.numel() for p in self.params)
        # the same list on every rank (it depends on the user's compression only): the same figures, in order
        methods = [m for m in per_step_methods(self.compression) if m != compression_methods.NONE]
        codecs = [_codec_seconds_per_byte(m, numel) if hosts > 1 else 0.0 for m in methods]
        figures = torch.tensor([max(statistics.median(self._intervals), 1e-6), statistics.median(self._averages),
                                *codecs], dtype=torch.float64)
        comm.allreduce(figures, op="max")  # every rank plans with the same (the slowest rank's) figures
        step_s, fp32_s, *codecs = figures.tolist()
        rate, latency = self._link(hosts)
        plan = planner()(model_bytes=numel * 4, step_s=step_s, hosts=hosts,
                         ranks_per_host=ranks_per_host, link_bytes_per_s=rate, link_latency_s=latency,
                         max_sync_every=self.max_sync_every, compression=self.compression, fragments=self.fragments,
                         codec_s_per_byte=dict(zip(methods, codecs)), per_step_fp32_s=fp32_s)
        if comm.rank == 0:
            print(f"ddl_triton DiLoCo(sync_every='auto'): {plan.why}", flush=True)
        return plan

    def _link(self, hosts: int) -> tuple[float, float]:
        """The link between hosts (bytes/s each way, one-way latency s): init's measurement, else
        the compression rule's probe (collective), else no limit on one host."""
        measured = getattr(getattr(self.comm, "planner", None), "link", None)
        if measured is not None:
            return measured.bytes_per_s, measured.alpha
        if hosts == 1:
            return math.inf, 0.0
        from ..runtime.compression import per_level
        from ..tuning import auto_compression
        levels = per_level.Levels(self.comm)
        try:
            link, _ = auto_compression.probe(levels)
        finally:
            levels.close()
        return link.bytes_per_s * max(1, levels.local_size), link.latency_us * 1e-6


def _codec_seconds_per_byte(method: str, numel: int) -> float:
    """Seconds per fp32 byte of one compress + decompress with ``method``'s registry ``roundtrip``
    on this machine, at ``numel`` elements (at most ``_CODEC_MAX_ELEMENTS``): the median of
    ``_CODEC_REPS`` calls after one untimed call (module doc)."""
    n = max(1, min(numel, _CODEC_MAX_ELEMENTS))
    roundtrip = compression_methods.resolve(compression_methods.get(method).roundtrip)
    x = torch.linspace(-1, 1, n, dtype=torch.float32)
    out = torch.empty_like(x)
    roundtrip(x, out)  # untimed: first-call costs (allocation, kernel set-up) are not per byte
    times = []
    for _ in range(_CODEC_REPS):
        t0 = time.perf_counter()
        roundtrip(x, out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / (4 * n)
