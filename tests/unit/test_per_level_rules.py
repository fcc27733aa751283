"""Per-level compression without ranks: the option's parsing, the auto rule, the table section, the groups' arithmetic.

- ``Options.compression`` / ``DDL_COMPRESSION``: "none" by default, every choice (none, each method, auto) accepted, anything
  else refused with an error naming the variable; a bad setting handed to the torch side names the rank;
- ``tuning_table.auto_compression.decide``: never compresses on one host or on unequal hosts; on a slow link a
  bucket compresses and a small tensor does not; on a fast link nothing does; the docstring's figures;
- ``from_table``: the entry measured nearest in log size decides; a table's section round-trips through
  JSON and a malformed one is refused;
- a bucket with backward behind it: its link time hides, its kernels' does not (``behind_us``, in the
  rule and the table), and ``LevelCompression`` measures that time from the previous backward pass
  (``BackwardPositions``, under real autograd) and agrees on it once per bucket;
- ``per_level.Levels`` on a fake communicator: unequal hosts build no groups and ``allreduce`` refuses
  with the rank and the counts; one rank per host sizes the residuals like ``compressed``.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from ddl_triton.options import Options
from ddl_triton.runtime.compression import compressed, per_level
from ddl_triton.planning import tuning_table
from ddl_triton.tuning.auto_compression import CompressorSpeed, Decision, LinkSpeed, decide, exposed_us, from_table, predict_us

GBIT = LinkSpeed(150.0, 0.114e9, "test")           # 1 Gbit/s through tbf, as the testbed measures it
FAST = LinkSpeed(5.0, 10e9, "test")                 # a link faster than the compressor
SPEED = CompressorSpeed({"int8": 1e9, "onebit": 1e9}, {"int8": 40.0, "onebit": 40.0})


def test_compression_option_parses_and_refuses():
    assert Options().compression == "none"
    for value in ("none", "int8", "onebit", "fp16", "bf16", "int4", "auto"):
        assert Options.from_env({"DDL_COMPRESSION": value}).compression == value
    with pytest.raises(ValueError, match="DDL_COMPRESSION.*none, int8, onebit, fp16, bf16, int4, auto.*'int2'"):
        Options.from_env({"DDL_COMPRESSION": "int2"})
    with pytest.raises(ValueError, match="compression"):
        Options(compression="16bit")  # the 16-bit layout's name, not a method


def test_a_bad_setting_on_the_torch_side_names_the_rank():
    from ddl_triton.torch.level_compression import LevelCompression

    with pytest.raises(ValueError, match="rank 3: compression must be one of none, int8, onebit, fp16, bf16, int4, auto"):
        LevelCompression(SimpleNamespace(rank=3), "zstd")


def test_auto_never_compresses_on_one_host_or_unequal_hosts():
    for nbytes in (0, 8, 1 << 20, 1 << 30):
        assert decide(nbytes, 1, 4, None, None).method == "none"
        assert "one host" in decide(nbytes, 1, 4, None, None).reason
        assert decide(nbytes, 2, 2, GBIT, SPEED, uniform=False).method == "none"


def test_auto_compresses_a_bucket_on_a_slow_link_only():
    big, small = decide(2 << 20, 2, 1, GBIT, SPEED), decide(4096, 2, 1, GBIT, SPEED)
    assert (big.method, small.method) == ("int8", "none")
    # two hosts exchange once (compressed.latency_steps): one 150 us latency each
    assert round(big.estimates_us["none"] / 1000, 1) == 18.5 and round(big.estimates_us["int8"] / 1000, 1) == 9.1
    assert round(small.estimates_us["none"]) == 186 and round(small.estimates_us["int8"]) == 247
    assert "0.114 GB/s" in big.reason and "int8" in big.reason
    assert decide(64 << 20, 2, 2, FAST, SPEED).method == "none"
    # 1-bit only when a caller allows it: it is never auto's pick by default
    assert decide(64 << 20, 2, 1, GBIT, SPEED).method == "int8"
    assert decide(64 << 20, 2, 1, GBIT, SPEED, methods=("int8", "onebit")).method == "onebit"


def test_a_bucket_with_backward_behind_it_pays_only_its_kernels_and_the_link_time_left_over():
    # 2 MiB at 1 Gbit/s: fp32 18.5 ms on the link; int8 4.3 ms of kernels (2 x (40 us + 2 MiB / 1 GB/s))
    # and 4.8 ms on the link
    n = 2 << 20
    kernels = 2 * (40.0 + n / 1e9 * 1e6)
    for m in ("none", "int8", "onebit"):
        assert exposed_us(m, n, 2, 1, GBIT, SPEED, 0.0) == pytest.approx(predict_us(m, n, 2, 1, GBIT, SPEED))
    assert exposed_us("int8", n, 2, 1, GBIT, SPEED, 20e3) == pytest.approx(kernels)   # its link time hidden
    assert exposed_us("none", n, 2, 1, GBIT, SPEED, 20e3) == 0.0
    assert decide(n, 2, 1, GBIT, SPEED, behind_us=0.0) == decide(n, 2, 1, GBIT, SPEED)
    hidden = decide(n, 2, 1, GBIT, SPEED, behind_us=20e3)  # fp32 fits behind it: compressing only adds kernels
    assert hidden.method == "none" and "20.0 ms of backward behind it" in hidden.reason
    assert hidden.estimates_us == {"none": 0.0, "int8": pytest.approx(kernels)}
    assert decide(n, 2, 1, GBIT, SPEED, behind_us=15e3).method == "none"   # 3.5 ms of fp32 left < 4.3 ms
    assert decide(n, 2, 1, GBIT, SPEED, behind_us=10e3).method == "int8"   # 8.5 ms left > 4.3 ms
    # a table's times are whole calls: the backward behind one is taken off every method alike
    s = _section()
    assert from_table(s, 3 << 20, 2, behind_us=40e3).method == "none"     # fp32's 38 ms fits
    late = from_table(s, 3 << 20, 2, behind_us=30e3)
    assert late.method == "int8" and late.estimates_us == {"none": 8000.0, "int8": 0.0}
    assert "30.0 ms of backward" in late.reason and "not known" in late.reason


def _backward_calling(first, last, gap_s: float) -> None:
    """One real backward pass that calls ``first()``, then, ``gap_s`` later, ``last()``, from
    gradient hooks (as DDP issues its buckets)."""
    import time

    x = torch.ones(4, requires_grad=True)
    reached_last = x * 2                 # a chain: backward reaches the tensor nearer the loss first
    reached_first = reached_last * 3

    def later(grad) -> None:
        time.sleep(gap_s)
        last()

    reached_first.register_hook(lambda grad: first())
    reached_last.register_hook(later)
    reached_first.sum().backward()


def test_backward_positions_measure_the_backward_after_each_call_from_the_previous_pass():
    from ddl_triton.torch.backward_position import BackwardPositions

    positions, seen = BackwardPositions(), []

    def call_b():  # the pass's first call, 2000 B
        seen.append(positions.observe(2000))

    def call_a():  # its second and last, 1000 B, 60 ms later
        seen.append(positions.observe(1000))

    def one_pass():
        _backward_calling(call_b, call_a, gap_s=0.06)

    assert positions.observe(2000) == (None, None)  # not in backward: nothing known
    one_pass()
    assert seen == [((0, 2000), None), ((1, 1000), None)]  # no pass completed yet
    seen.clear()
    one_pass()
    (b, behind_b), (a, behind_a) = seen
    assert (b, a) == ((0, 2000), (1, 1000)) and behind_a == 0.0 and behind_b >= 60e3  # A came last, 60 ms after B
    assert behind_b < 10e6


def test_level_compression_decides_a_bucket_by_its_place_in_backward_once_and_alike_on_every_rank():
    from ddl_triton.torch.level_compression import LevelCompression

    agreed = []
    comm = _fake(0, (0, 1))
    comm.planner = SimpleNamespace(table=SimpleNamespace(compression=_section()))
    comm.allreduce = lambda t, op: agreed.append((op, float(t[0])))  # the other rank: the same figure
    lc = LevelCompression(comm, "auto")
    n = 3 << 20  # the table: fp32 38 ms, int8 12 ms
    methods = []

    def early_bucket():
        methods.append(("early", lc.decide(n, calling=True).method))

    def last_bucket():  # 50 ms later
        methods.append(("last", lc.decide(n, calling=True).method))

    def one_pass():
        _backward_calling(early_bucket, last_bucket, gap_s=0.05)

    one_pass()
    assert methods == [("early", "int8"), ("last", "int8")] and agreed == []  # by size, until a pass is known
    methods.clear()
    one_pass()
    assert methods == [("early", "none"), ("last", "int8")]  # 50 ms of backward hides fp32's 38 ms
    assert [op for op, _ in agreed] == ["min", "min"] and agreed[0][1] >= 50e3 and agreed[1][1] == 0.0
    methods.clear()
    one_pass()
    assert methods == [("early", "none"), ("last", "int8")] and len(agreed) == 2  # decided once per bucket
    said = lc.explain(n)
    assert "none between hosts" in said and "int8 between hosts" in said and "of backward" in said
    # a named method, or a call outside backward, is decided by size alone
    assert LevelCompression(comm, "int8").decide(n, calling=True).method == "int8"
    assert lc.decide(n, calling=True).method == "int8"


def _section():
    return {"levels": {"inter": {"what": "inter-host", "ranks": 2, "latency_us": 150.0, "bytes_per_s": 1.1e8}},
            "entries": [{"bytes": 65536, "by_method": {"none": 900.0, "int8": 1400.0, "onebit": 1300.0}},
                        {"bytes": 4 << 20, "by_method": {"none": 38000.0, "int8": 12000.0, "onebit": 6000.0}}]}


def test_the_table_decides_by_the_nearest_measured_size():
    s = _section()
    assert from_table(s, 60000, 2).method == "none"
    assert from_table(s, 3 << 20, 2).method == "int8"  # onebit is faster there, but auto does not pick it
    assert "measured at 4194304 B" in from_table(s, 3 << 20, 2).reason
    assert from_table(s, 3 << 20, 1).method == "none"
    assert from_table({"entries": []}, 3 << 20, 2) is None


def test_the_table_section_round_trips_and_is_checked():
    t = tuning_table.TuningTable(key={"world_size": 2}, options={"chunk_bytes": 1 << 21, "pipeline_depth": 4}, entries={},
                           compression=_section())
    back = tuning_table.from_json(json.loads(json.dumps(t.to_json())))
    assert back.compression == _section() and back.digest() == t.digest()
    plain = tuning_table.TuningTable(key={"world_size": 2}, options=dict(t.options), entries={})
    assert "compression" not in plain.to_json() and plain.digest() != t.digest()
    bad = t.to_json()
    bad["compression"]["entries"][0]["by_method"] = {"int8": 5.0}
    with pytest.raises(tuning_table.TuningTableError, match="compression.entries"):
        tuning_table.from_json(bad)


def _fake(rank: int, node_of_rank: tuple[int, ...]):
    on_node = tuple(r for r, n in enumerate(node_of_rank) if n == node_of_rank[rank])
    return SimpleNamespace(rank=rank, size=len(node_of_rank),
                           placement=SimpleNamespace(node_of_rank=node_of_rank, on_node=on_node))


def test_unequal_hosts_build_no_groups_and_refuse():
    lv = per_level.Levels(_fake(2, (0, 0, 1)))
    assert (lv.uniform, lv.hosts, lv.node, lv.cross) == (False, 2, None, None)
    with pytest.raises(ValueError, match=r"rank 2: .*same number of ranks on every host, got \[2, 1\]"):
        per_level.allreduce(lv, torch.ones(8))
    with pytest.raises(ValueError, match="rank 2: .*one of int8, onebit"):
        per_level.allreduce(lv, torch.ones(8), method="zfp")


def test_one_rank_per_host_sizes_residuals_like_compressed():
    for rank in range(3):
        lv = per_level.Levels(_fake(rank, (0, 1, 2)))
        assert lv.cross is lv.comm and lv.cross_rank == rank
        for n in (1, 31, 1000, 4099):
            a, b = compressed.chunk_bounds(n, 3, 32)[rank]
            assert per_level.residual_sizes(lv, "onebit", n) == (n, b - a)
            assert per_level.residual_sizes(lv, "int8", n) == (n, None)
            assert per_level.wire_bytes(lv, "int8", n) == {"intra": 0, "inter": compressed.wire_bytes("int8", n, 3)}
    one = per_level.Levels(_fake(1, (0, 0)))
    assert one.node is one.comm and per_level.residual_sizes(one, "int8", 1000) == (0, None)


def test_the_decision_type_carries_its_reason():
    d = Decision("none", "why")
    assert (d.method, d.reason, d.estimates_us) == ("none", "why", {})


def test_level_compression_follows_the_communicators_table_then_a_named_method():
    from ddl_triton.torch.level_compression import LevelCompression

    comm = _fake(0, (0, 1))
    comm.planner = SimpleNamespace(table=SimpleNamespace(compression=_section()))
    auto = LevelCompression(comm, "auto")
    assert auto.decide(3 << 20).method == "int8" and "tuning table" in auto.explain(3 << 20)
    assert auto.decide(70000).method == "none" and auto._speeds is None  # the table answered: no probe
    named = LevelCompression(comm, "onebit")
    assert named.decide(4096).method == "onebit"
    one_host = _fake(0, (0, 0))
    one_host.planner = comm.planner
    assert LevelCompression(one_host, "int8").decide(64 << 20).method == "none"
    lc = LevelCompression(comm, "int8")
    a, _ = lc.residuals("k", "int8", 1000)
    assert lc.residuals("k", "int8", 1000)[0] is a and lc.residual_resets == 0
    assert lc.residuals("k", "int8", 999)[0] is not a and lc.residual_resets == 1
