"""The framework-neutral gradient floor (ddl_triton/gradients/) without ranks: the planner, the
residual store's reset rules, and the reducer's choices, byte rule and input checks, on fake
communicators. tests/multirank/test_gradients_across_frameworks.py runs it through the three rooms at 2 ranks."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddl_triton.gradients import Reducer, Residuals, plan
from ddl_triton.gradients.buckets import check_bucket_bytes


def _comm(rank: int = 0, node_of_rank: tuple[int, ...] = (0, 1), section=None):
    on_node = tuple(r for r, n in enumerate(node_of_rank) if n == node_of_rank[rank])
    calls = []
    comm = SimpleNamespace(rank=rank, size=len(node_of_rank), calls=calls,
                           placement=SimpleNamespace(node_of_rank=node_of_rank, on_node=on_node),
                           allreduce=lambda t, op: calls.append((op, tuple(t.shape))))
    if section is not None:
        comm.planner = SimpleNamespace(table=SimpleNamespace(compression=section))
    return comm


def _section():  # full precision wins at 4 KiB, int8 at 1 MiB: the boundary is 64 KiB
    return {"entries": [{"bytes": 4096, "by_method": {"none": 10.0, "int8": 20.0}},
                        {"bytes": 1 << 20, "by_method": {"none": 1000.0, "int8": 100.0}}]}


# -- the planner -----------------------------------------------------------------------------------
def test_the_planner_fuses_in_order_per_key_up_to_the_cap():
    assert plan(["f"] * 3, [12, 16, 20], 32) == [[0, 1], [2]]                  # the module doc's example
    assert plan(["f32", "i32", "f32"], [12, 8, 16], 64) == [[0, 2], [1]]      # one key per bucket
    assert plan(["f"] * 3, [10, 40, 10], 32) == [[0], [1], [2]]               # a tensor past the cap: alone
    assert plan(["f", "f"], [0, 100], 4) == [[0, 1]]                          # an empty bucket is never closed
    assert plan([], [], 4) == []
    assert plan(["a", "b", "a"], [4, 4, 40], 8) == [[0], [1], [2]]            # listed by first tensor


def test_the_planner_refuses_a_bad_cap_naming_the_rank():
    for bad in (0, -1, 2.5, "1"):
        with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
            plan(["f"], [4], bad)
    with pytest.raises(ValueError, match=r"rank 3: GradientReducer: bucket_bytes must be a positive int, got 0"):
        check_bucket_bytes(0, "GradientReducer", 3)


# -- the residual store -----------------------------------------------------------------------------
def test_residuals_reset_on_a_size_or_method_change_and_on_clear():
    store = Residuals()
    w, s = store.get(0, "int8", 10)
    assert s is None and w.dtype == torch.float32 and w.tolist() == [0.0] * 10
    w.fill_(1.0)
    assert store.get(0, "int8", 10)[0] is w and store.resets == 0            # same signature: the same tensors
    assert store.get(0, "int8", 11)[0].sum() == 0 and store.resets == 1      # the bucket changed size
    assert store.get(0, "onebit", 11, 6)[1].numel() == 6 and store.resets == 2  # the method changed
    store.clear()                                                            # a world change
    assert len(store) == 0 and store.get(0, "onebit", 11, 6)[0].sum() == 0 and store.resets == 2


def test_residuals_drop_the_least_recently_used_beyond_max_keys_and_snapshots_are_copies():
    store = Residuals(max_keys=2)
    a = store.get("a", "int8", 1)[0]
    store.get("b", "int8", 1)
    store.get("a", "int8", 1)
    store.get("c", "int8", 1)                                                # drops "b", used least recently
    assert store.get("a", "int8", 1)[0] is a and len(store) == 2
    a.fill_(2.0)
    snap = store.snapshot()
    a.fill_(3.0)
    assert snap["a"][0] == "int8" and snap["a"][1].tolist() == [2.0] and snap["a"][1] is not a
    store.load(snap)
    assert store.get("a", "int8", 1)[0].tolist() == [2.0] and store.resets == 0


# -- the reducer ----------------------------------------------------------------------------------
def test_the_reducer_refuses_bad_settings_naming_the_rank():
    with pytest.raises(ValueError, match=r"rank 1: GradientReducer must be one of none, int8.*auto, got 'zip'"):
        Reducer(_comm(1), "zip", who="GradientReducer")
    with pytest.raises(ValueError, match=r"rank 1: X: block must be a power of two in \[4, 65536\], got 3"):
        Reducer(_comm(1), "int8", block=3, who="X")
    with pytest.raises(ValueError, match="rank 0: compression: named must be one of world, levels"):
        Reducer(_comm(), "int8", named="hosts")
    with pytest.raises(ValueError, match=r"rank 0: compression: a compressed allreduce \('int8'\) averages or sums"):
        Reducer(_comm(), "int8").reduce(np.zeros(4, np.float32), 0, "int8", op="max")


def test_one_byte_rule_fp32_equivalent_bytes_whatever_the_dtype():
    r = Reducer(_comm(section=_section()), "auto")
    # 20000 float16 elements: 40000 real bytes (nearer 4 KiB: none) but 80000 fp32-equivalent (int8)
    assert r.decide_bucket(20000, np.float16).method == "int8"
    assert r.decide_bucket(20000, torch.bfloat16).method == "int8" and list(r.decisions) == [80000]
    assert r.decide_bucket(1000, "float32").method == "none" and "tuning table" in r.decisions[4000].reason
    assert r._speeds is None  # the table answered: nothing probed


def test_what_is_never_compressed_and_where_a_named_method_runs():
    r = Reducer(_comm(), "int8")
    assert r.decide_bucket(100, np.float64).method == "none"
    assert r.decide_bucket(100, torch.int32).method == "none"
    assert r.decide_bucket(0, np.float32).method == "none"
    assert r.decide_bucket(100, np.float32).method == "int8"                # world: the method everywhere
    assert Reducer(_comm(node_of_rank=(0,)), "int8").decide_bucket(100, np.float32).method == "none"  # one rank
    one_host = Reducer(_comm(node_of_rank=(0, 0)), "onebit", named="levels")
    assert one_host.decide(400).method == "none" and "one host" in one_host.decide(400).reason
    assert Reducer(_comm(), "onebit", named="levels").decide(400).method == "onebit"  # two hosts: between them
    assert Reducer(_comm(node_of_rank=(0, 0)), "auto").decide(64 << 20).method == "none"


def test_an_uncompressed_list_is_fused_and_handed_to_the_communicator():
    comm = _comm()
    r = Reducer(comm, "none")
    arrays = [np.arange(3, dtype=np.float32), np.arange(2, dtype=np.int64), np.ones((2, 2), np.float32)]
    out, methods = r.reduce_list(arrays, "sum", 1 << 20)
    assert methods == ["none", "none"] and comm.calls == [("sum", (7,)), ("sum", (2,))]
    assert [o.shape for o in out] == [(3,), (2,), (2, 2)] and [o.dtype for o in out] == [a.dtype for a in arrays]
    assert np.array_equal(out[2], arrays[2]) and np.array_equal(out[1], arrays[1])  # a fake allreduce: unchanged
