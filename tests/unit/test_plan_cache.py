"""The plan cache (ddl_triton/runtime/calls/plan_cache.py) with a real planner and no ranks, and its
plans run on an in-process world (tests/support/inprocess_world.py).

What it must do: ask the planner once per call shape and keep the answer until ``forget`` (or the
bound); avg is a sum scaled by 1/size on the final step; 16-bit sums on a multi-hop schedule carry
fp32 partial sums in chunks of the same bytes; the small path is taken only where the planner chose
one_shot and the path serves the size, and registers the shape for the fast entry under the op as
spelled. Every rank's cache gives the same schedule for a shape, and it runs exact on every rank.
"""
from __future__ import annotations

import pytest
import torch

from ddl_triton import schedules
from ddl_triton.planning.planner import Planner
from ddl_triton.planning.topology import detect
from ddl_triton.runtime.calls.plan_cache import PlanCache
from support.inprocess_world import ThreadWorld

SLOT_BYTES = 256


def _planner(n: int, rank: int = 0, forced: str = "") -> Planner:
    planner = Planner(rank=rank, size=n, topology=detect([0] * n), link_of=lambda a, b: "shm", forced=forced,
                      slot_bytes=SLOT_BYTES)
    asked = []
    plan = planner.plan
    planner.plan = lambda *args: asked.append(args) or plan(*args)
    planner.asked = asked
    return planner


def test_the_planner_is_asked_once_per_shape_until_forget():
    planner = _planner(3)
    cache = PlanCache(planner, 0, 3, debug=False)
    first = cache.prepare("allreduce", 10, 10, torch.float32, "sum", 0)
    assert cache.prepare("allreduce", 10, 10, torch.float32, "sum", 0) is first
    assert len(planner.asked) == 1
    cache.prepare("allreduce", 11, 11, torch.float32, "sum", 0)   # another shape: asked again
    cache.prepare("broadcast", 10, 10, torch.float32, "sum", 2)   # another root and collective
    assert len(planner.asked) == 3
    cache.forget()
    assert cache.prepare("allreduce", 10, 10, torch.float32, "sum", 0) is not first
    assert len(planner.asked) == 4


def test_the_cache_is_bounded():
    planner = _planner(2, forced="one_shot")  # the cheapest schedule to build: the bound is what is tested
    cache = PlanCache(planner, 0, 2, debug=False)
    for count in range(260):
        cache.prepare("allreduce", count, count, torch.int32, "sum", 0)
    asked = len(planner.asked)
    cache.prepare("allreduce", 0, 0, torch.int32, "sum", 0)  # the first shape fell out when it started over
    assert len(planner.asked) == asked + 1


def test_avg_is_a_sum_scaled_by_one_over_the_world_size():
    _, _, ctx = PlanCache(_planner(4), 0, 4, debug=False).prepare("allreduce", 8, 8, torch.float32, "avg", 0)
    assert (ctx.collective, ctx.op, ctx.scale) == ("allreduce", "sum", 0.25)
    _, _, ctx = PlanCache(_planner(4), 0, 4, debug=False).prepare("allreduce", 8, 8, torch.float32, "max", 0)
    assert (ctx.op, ctx.scale) == ("max", None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sixteen_bit_sums_on_a_multi_hop_schedule_carry_fp32_in_chunks_of_the_same_bytes(dtype):
    count = 1000
    schedule, run_dtype, _ = PlanCache(_planner(3, forced="ring"), 0, 3, debug=False).prepare(
        "allreduce", count, count, dtype, "sum", 0)
    assert run_dtype is torch.float32 and schedule.name == "ring"
    chunk = SLOT_BYTES // dtype.itemsize
    assert schedule.params["chunk_elems"] == chunk * dtype.itemsize // 4
    assert max(step.count for steps in schedule.steps for step in steps) <= chunk * dtype.itemsize // 4
    # A single-pass schedule (one_shot) rounds once anyway: it runs in the data's dtype.
    schedule, run_dtype, _ = PlanCache(_planner(3, forced="one_shot"), 0, 3, debug=False).prepare(
        "allreduce", count, count, dtype, "sum", 0)
    assert run_dtype is dtype and schedule.single_pass
    # Neither does max: no partial sums travel.
    _, run_dtype, _ = PlanCache(_planner(3, forced="ring"), 0, 3, debug=False).prepare(
        "allreduce", count, count, dtype, "max", 0)
    assert run_dtype is dtype


class _SmallPath:
    """The small-message path's interface as the plan cache uses it: serves up to ``limit`` bytes."""

    def __init__(self, limit: int):
        self.limit = limit
        self.shapes: list[tuple] = []

    def serves(self, nbytes: int, dtype) -> bool:
        return nbytes <= self.limit

    def shape(self, op, dtype, numel, fingerprint):
        self.shapes.append((op, dtype, numel, fingerprint))
        return ("shape", op, dtype, numel)


def test_the_small_path_is_taken_only_for_one_shot_plans_it_serves():
    small = _SmallPath(limit=64)
    one_shot = PlanCache(_planner(2, forced="one_shot"), 0, 2, debug=False)
    assert one_shot.takes_small_path(small, 16, torch.float32)          # 64 bytes: served
    assert not one_shot.takes_small_path(small, 17, torch.float32)      # 68 bytes: not served
    assert not one_shot.takes_small_path(None, 1, torch.float32)        # no small path at all
    ring = PlanCache(_planner(2, forced="ring"), 0, 2, debug=False)
    assert not ring.takes_small_path(small, 1, torch.float32)           # the planner chose otherwise


def test_a_small_shape_is_registered_for_the_fast_entry_under_the_op_as_spelled():
    small = _SmallPath(limit=64)
    cache = PlanCache(_planner(2, forced="one_shot"), 0, 2, debug=False)
    flat = torch.zeros(5, dtype=torch.int32)
    shape = cache.small_shape(small, "sum", flat, "SUM")
    assert shape == ("shape", "sum", torch.int32, 5)
    assert cache.fast[("sum", torch.int32, 5)][0] is shape and cache.fast[("SUM", torch.int32, 5)][0] is shape
    assert cache.small_shape(small, "sum", flat, "sum") is shape and len(small.shapes) == 1
    assert cache.small_shape(small, "sum", torch.zeros(100, dtype=torch.int32), "sum") is None  # too large
    view = cache.fast_view(flat, shape)
    assert cache.fast_view(flat, shape) is view and view.shape == (5,)
    cache.forget()
    assert cache.fast == {}


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"])
def test_every_ranks_plan_is_the_same_and_runs_exact(collective, n):
    """Each rank plans on its own (a cache and a planner per rank, as in a job); the plans agree,
    and running them on the in-process world gives the exact result on every rank."""
    world = ThreadWorld(n)
    from ddl_triton.runtime.calls.executor import Executor
    caches = [PlanCache(_planner(n, r), r, n, debug=False) for r in range(n)]
    executors = [Executor(r, n, world.route(r), timeout=10.0, depth=2) for r in range(n)]
    for seq, count in enumerate((0, 1, 5, 37, 131), start=1):
        root = count % n
        per_rank_in = count * n if collective in ("reduce_scatter", "all_to_all") else count

        def rank_body(rank: int):
            schedule, run_dtype, ctx = caches[rank].prepare(collective, count, per_rank_in, torch.int64, "sum", root)
            inbuf = torch.arange(per_rank_in, dtype=torch.int64) + 1000 * rank
            out = inbuf if collective in ("allreduce", "broadcast") else \
                torch.full((schedule.out_count,), -1, dtype=torch.int64)
            executors[rank].run_widened(schedule, inbuf, out, ctx, seq, run_dtype)
            return schedule.name, out

        results = world.run(rank_body, timeout=10.0)
        assert len({name for name, _ in results}) == 1, results
        inputs = [torch.arange(per_rank_in, dtype=torch.int64) + 1000 * r for r in range(n)]
        for rank, (_, out) in enumerate(results):
            want = {"allreduce": lambda: sum(inputs),
                    "reduce_scatter": lambda: sum(inputs)[rank * count:(rank + 1) * count],
                    "all_gather": lambda: torch.cat(inputs),
                    "broadcast": lambda: inputs[root],
                    "all_to_all": lambda: torch.cat([x[rank * count:(rank + 1) * count] for x in inputs])}[collective]()
            assert torch.equal(out, want), f"{collective} n={n} count={count} rank {rank}"
        assert world.unreleased() == []
