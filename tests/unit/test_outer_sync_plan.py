"""planning/outer_sync.py: per-step allreduce or outer sync (DiLoCo), from numbers (no ranks, no timing)."""
from __future__ import annotations

import dataclasses
import math

import pytest

from ddl_triton import compression_methods
from ddl_triton.planning.outer_sync import SyncPlan, allreduce_seconds, format_rate, plan_sync

MBIT = 1e6 / 8  # bytes per second of one Mbit/s
# The issue's example: 100 Mbit/s between 2 hosts, a 4 ms step, per-step fp32 exposing 310 ms
# (3.875 MB: 2(n-1)/n = 1 of it crosses each host's link), int8 about 80 ms.
ISSUE = dict(model_bytes=3_875_000, step_s=0.004, hosts=2, ranks_per_host=1, link_bytes_per_s=100 * MBIT,
             link_latency_s=0.0, max_sync_every=128)


def _exposed(plan: SyncPlan, name: str) -> float:
    return dict(plan.candidates)[name]


def test_the_issues_example_numbers():
    plan = plan_sync(**ISSUE)
    assert _exposed(plan, "per-step fp32") == pytest.approx(0.310)
    assert _exposed(plan, "per-step int8") == pytest.approx(0.310 * 8.125 / 32)  # 78.7 ms: the issue's "80 ms"
    # only the methods "auto" may choose are proposed per step unasked (int8), and a method named
    assert "per-step onebit" not in dict(plan.candidates) and "per-step fp16" not in dict(plan.candidates)
    assert _exposed(plan_sync(**ISSUE, compression="onebit"), "per-step onebit") == pytest.approx(0.310 / 32)
    assert plan.why.startswith("100 Mbit/s between hosts: per-step fp32 exposes 310 ms of a 4 ms step; "
                               "int8 78.7 ms; ")
    # blocking fp32 sync needs H >= 698 to expose <= 0.444 ms per step: the bound, 128, is not enough
    assert (plan.mode, plan.sync_every, plan.compression) == ("outer", 128, "none")
    assert plan.exposed_s == pytest.approx(0.310 / 128)
    assert plan.utilisation == pytest.approx(0.004 / (0.004 + 0.310 / 128))
    assert "nothing reaches 90%" in plan.why and "outer H=128 fp32" in plan.why


def test_streaming_and_compression_hide_it_with_the_smallest_h():
    # int8 pseudo-gradients, 4 fragments, each overlapped with H/4 - 1 steps:
    # max(0, 78.7 ms - 4 ms * (H - 4)) / H <= 0.444 ms from H = 21.3
    plan = plan_sync(**ISSUE, compression="int8", fragments=4)
    assert (plan.mode, plan.sync_every, plan.compression, plan.fragments) == ("outer", 32, "int8", 4)
    assert plan.utilisation >= 0.9
    assert "DiLoCo H=32 (int8 pseudo-gradients, 4 fragments overlapped) hides it" in plan.why
    assert _exposed(plan, "outer H=16 int8") > 0.004 / 9  # the next smaller H does not reach 90%
    # fp32, 4 fragments: 310 ms + 16 ms <= 4.444 ms * H from H = 73.4
    assert plan_sync(**ISSUE, fragments=4).sync_every == 128
    # "auto": every method tried for the pseudo-gradients: onebit reaches 90% at the smallest H; at
    # H = F = 4 nothing overlaps (a delay of H/F - 1 = 0 steps): 9.69 ms / 4 exposed
    auto = plan_sync(**ISSUE, compression="auto", fragments=4)
    assert (auto.sync_every, auto.compression) == (8, "onebit")
    assert _exposed(auto, "outer H=4 onebit") == pytest.approx(0.310 / 32 / 4)
    assert {"outer H=4 fp32", "outer H=4 int8", "outer H=4 onebit"} <= dict(auto.candidates).keys()
    # a fragment per step at most: no candidate with H < fragments
    assert "outer H=2 int8" not in dict(plan.candidates)


def test_blocking_outer_sync_divides_the_transfer_by_h():
    plan = plan_sync(**{**ISSUE, "max_sync_every": 1024})
    assert (plan.mode, plan.sync_every) == ("outer", 1024)  # 0.310 / 1024 = 0.30 ms <= 0.444 ms; 512 is not
    assert _exposed(plan, "outer H=512 fp32") == pytest.approx(0.310 / 512)
    assert plan.utilisation >= 0.9 and "DiLoCo H=1024 (fp32 pseudo-gradients) hides it" in plan.why


def test_per_step_first_and_full_precision_before_compression():
    fast = plan_sync(**{**ISSUE, "link_bytes_per_s": 1e12})  # 3.9 us of a 4 ms step
    assert (fast.mode, fast.compression, fast.sync_every) == ("per-step", "none", 1)
    assert fast.why.endswith("per-step fp32")
    # 1 Gbit/s: fp32 31 ms of a 30 ms step is 49%; int8 7.9 ms (79%); onebit 0.97 ms (97%), but only
    # where named: unnamed, outer sync (blocking fp32: 31 ms / H <= 3.33 ms from H = 16)
    mid = plan_sync(**{**ISSUE, "link_bytes_per_s": 1000 * MBIT, "step_s": 0.030})
    assert (mid.mode, mid.sync_every, mid.compression) == ("outer", 16, "none")
    named = plan_sync(**{**ISSUE, "link_bytes_per_s": 1000 * MBIT, "step_s": 0.030}, compression="onebit")
    assert (named.mode, named.compression) == ("per-step", "onebit")
    # a 100 ms step: fp16 15.5 ms reaches 86.6%: no; int8 7.9 ms reaches 92.7%: the most bits that reach
    slow_step = plan_sync(**{**ISSUE, "link_bytes_per_s": 1000 * MBIT, "step_s": 0.100})
    assert (slow_step.mode, slow_step.compression) == ("per-step", "int8")
    assert "per-step int8 reaches 90%" in slow_step.why
    # per-step is kept even where outer sync would expose less: the training math is unchanged
    assert _exposed(slow_step, "outer H=128 fp32") < slow_step.exposed_s


def test_edge_cases_zero_model_bound_one_huge_link_one_host():
    zero = plan_sync(**{**ISSUE, "model_bytes": 0, "link_latency_s": 1e-3})
    assert (zero.mode, zero.compression, zero.exposed_s, zero.utilisation) == ("per-step", "none", 0.0, 1.0)
    bound = plan_sync(**{**ISSUE, "max_sync_every": 1})
    assert bound.mode == "per-step" and bound.sync_every == 1
    assert not any(name.startswith("outer") for name, _ in bound.candidates)
    assert bound.compression == "int8" and "nothing reaches 90%: per-step int8 still exposes 78.7 ms" in bound.why
    huge = plan_sync(**{**ISSUE, "link_bytes_per_s": math.inf, "link_latency_s": 10e-6})
    assert (huge.mode, huge.compression) == ("per-step", "none")
    assert huge.exposed_s == pytest.approx(2 * 10e-6) and "an unlimited link" in huge.why
    one = plan_sync(**{**ISSUE, "hosts": 1, "ranks_per_host": 4})
    assert (one.mode, one.exposed_s) == ("per-step", 0.0) and one.why.startswith("one host (4 ranks)")
    # a bound that is no power of two is itself a candidate
    odd = plan_sync(**{**ISSUE, "max_sync_every": 100})
    assert odd.sync_every == 100 and "outer H=64 fp32" in dict(odd.candidates)


def test_ring_cost_model():
    # 4 hosts: 2(n-1)/n = 1.5 of the bytes, 6 latency terms; fragments pay the latency each
    assert allreduce_seconds(1e6, hosts=4, link_bytes_per_s=1e6, link_latency_s=1e-3) == pytest.approx(1.5 + 6e-3)
    assert allreduce_seconds(1e6, hosts=4, link_bytes_per_s=1e6, link_latency_s=1e-3,
                             latency_terms=4) == pytest.approx(1.5 + 24e-3)
    assert allreduce_seconds(1e6, hosts=1, link_bytes_per_s=1.0, link_latency_s=1.0) == 0.0
    four = plan_sync(**{**ISSUE, "hosts": 4, "link_latency_s": 1e-3})
    assert _exposed(four, "per-step fp32") == pytest.approx(0.310 * 1.5 + 6e-3)
    assert format_rate(12.5e6) == "100 Mbit/s" and format_rate(1.25e8) == "1 Gbit/s"
    assert format_rate(1.25e6) == "10 Mbit/s"


def test_a_registered_method_is_a_candidate():
    int8 = compression_methods.get("int8")
    compression_methods.register(dataclasses.replace(int8, name="test_four_bit", bits=lambda block: 4 + 32 / block,
                                                     auto=False))
    try:
        plan = plan_sync(**ISSUE, compression="test_four_bit", fragments=4)
        assert _exposed(plan, "per-step test_four_bit") == pytest.approx(0.310 * 4.125 / 32)
        # 40 ms overlapped behind H - 4 steps of 4 ms: H = 16 hides it (the issue's "DiLoCo H=16")
        assert (plan.mode, plan.sync_every, plan.compression) == ("outer", 16, "test_four_bit")
    finally:
        compression_methods.unregister("test_four_bit")


def test_bad_numbers_are_refused_by_name():
    with pytest.raises(ValueError, match="step_s must be a finite number of seconds > 0, got 0"):
        plan_sync(**{**ISSUE, "step_s": 0})
    with pytest.raises(ValueError, match=r"model_bytes must be.*; hosts must be an integer >= 1, got 0"):
        plan_sync(**{**ISSUE, "model_bytes": -1, "hosts": 0})
    with pytest.raises(ValueError, match="max_sync_every must be an integer >= 1, got 0"):
        plan_sync(**{**ISSUE, "max_sync_every": 0})
    with pytest.raises(ValueError, match="link_bytes_per_s must be a number > 0"):
        plan_sync(**{**ISSUE, "link_bytes_per_s": 0})
    with pytest.raises(ValueError, match="fragments must be an integer >= 1, got True"):
        plan_sync(**ISSUE, fragments=True)
    with pytest.raises(ValueError, match="unknown compression method 'int3'"):
        plan_sync(**ISSUE, compression="int3")
    with pytest.raises(TypeError):
        plan_sync(3_875_000, 0.004)  # keywords only: the DiLoCo engineer's contract
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan_sync(**ISSUE).sync_every = 2


def test_the_simulators_crossover_is_where_the_plan_switches():
    from ddl_triton.simulation.outer_sync_crossover import crossover

    numbers = dict(model_bytes=3_875_000, step_s=0.004, hosts=2, link_latency_s=50e-6)
    result = crossover(**numbers)
    rates = dict(result.rates)
    assert rates["fp32"] == pytest.approx(3_875_000 / (0.004 / 9 - 2 * 50e-6))
    assert rates["int8"] == pytest.approx(rates["fp32"] * 8.125 / 32)
    assert result.planner == rates["int8"]  # the per-step candidates unasked: fp32 and int8
    assert crossover(**numbers, compression="onebit").planner == rates["onebit"] == min(rates.values())
    plan = dict(model_bytes=3_875_000, step_s=0.004, hosts=2, ranks_per_host=1, link_latency_s=50e-6,
                max_sync_every=128)
    assert plan_sync(**plan, link_bytes_per_s=result.planner * 1.001).mode == "per-step"
    assert plan_sync(**plan, link_bytes_per_s=result.planner * 0.999).mode == "outer"
    assert crossover(**numbers, per_step_compression=False).rates == (("fp32", rates["fp32"]),)
    assert crossover(**{**numbers, "link_latency_s": 1e-3}).planner is None  # the latency alone exceeds 0.44 ms
    assert crossover(**{**numbers, "hosts": 1}).planner == 0.0
    assert crossover(**{**numbers, "model_bytes": 0}).planner == 0.0


def test_the_simulate_commands_print_the_plan_and_the_crossover(capsys):
    from ddl_triton.simulation.cli import main

    assert main(["outer-sync", "--model-bytes", "3875000", "--step-ms", "4", "--hosts", "2", "--rate", "100mbit",
                 "--compression", "int8", "--fragments", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("100 Mbit/s between hosts: per-step fp32 exposes 310 ms of a 4 ms step; int8 78.7 ms;")
    assert "# plan: outer, compression int8, sync_every 32, fragments 4" in out
    assert "outer H=16 int8" in out
    assert main(["crossover", "--params", "968.75k", "--step-ms", "4", "--hosts", "2", "--latency-us", "50"]) == 0
    out = capsys.readouterr().out
    assert "per-step fp32  90 Gbit/s" in out
    assert "switches to outer sync below 22.9 Gbit/s" in out  # int8's: fp32 and int8 are the candidates


# -- the measured terms: the codec's CPU and the per-step call's overhead (module doc) ----------------------
def test_a_measured_codec_cost_sends_per_step_int8_outer():
    # 1 Gbit/s, a 100 ms step: on the link alone per-step int8 exposes 7.87 ms (92.7%): per-step int8
    # (as before, and with no codec priced). Its codec measured at 1 ns per fp32 byte adds 2 round trips
    # x 3.875 MB = 7.75 ms: 15.6 ms (86.5%) misses 90%, so outer sync: blocking fp32 31 ms / H <= 11.1 ms
    # from H = 4.
    numbers = {**ISSUE, "link_bytes_per_s": 1000 * MBIT, "step_s": 0.100}
    for unpriced in (plan_sync(**numbers), plan_sync(**numbers, codec_s_per_byte={}),
                     plan_sync(**numbers, codec_s_per_byte=None, per_step_fp32_s=None)):
        assert (unpriced.mode, unpriced.compression) == ("per-step", "int8") and "codec" not in unpriced.why
    plan = plan_sync(**numbers, codec_s_per_byte={"int8": 1e-9})
    assert _exposed(plan, "per-step int8") == pytest.approx(0.310 * 8.125 / 32 / 10 + 2 * 1e-9 * 3_875_000)
    assert (plan.mode, plan.sync_every, plan.compression) == ("outer", 4, "none")
    assert "; int8 15.6 ms (codec 7.75 ms); DiLoCo H=4 (fp32 pseudo-gradients) hides it" in plan.why
    # a compressed pseudo-gradient pays its codec once per H steps, fragments or not
    int8 = plan_sync(**numbers, compression="int8", codec_s_per_byte={"int8": 1e-9})
    assert _exposed(int8, "outer H=8 int8") == pytest.approx((0.310 * 8.125 / 32 / 10 + 7.75e-3) / 8)
    streaming = plan_sync(**numbers, compression="int8", fragments=4, codec_s_per_byte={"int8": 1e-9})
    assert _exposed(streaming, "outer H=8 int8") == pytest.approx(7.75e-3 / 8)  # the transfer hides behind 4 steps
    # one host: nothing crosses a slow link, so no codec runs
    assert plan_sync(**{**numbers, "hosts": 1}, codec_s_per_byte={"int8": 1e-9}).exposed_s == 0.0


def test_the_measured_per_step_fp32s_overhead_counts_for_every_candidate():
    # an unlimited link predicts 0 exposed: per-step fp32. Measured 2 ms of a 4 ms step (67%): every
    # per-step call pays those 2 ms, so outer sync: 2 ms / H <= 0.444 ms from H = 8.
    fast = {**ISSUE, "link_bytes_per_s": math.inf}
    assert plan_sync(**fast).mode == "per-step"
    plan = plan_sync(**fast, per_step_fp32_s=0.002)
    assert _exposed(plan, "per-step fp32") == pytest.approx(0.002)
    assert _exposed(plan, "per-step int8") == pytest.approx(0.002)  # the per-call overhead, wire 0
    assert (plan.mode, plan.sync_every) == ("outer", 8) and _exposed(plan, "outer H=4 fp32") == pytest.approx(0.0005)
    assert plan.why.startswith("an unlimited link between hosts: per-step fp32 exposes 2 ms (measured) of a 4 ms step")
    # a measurement below the link model's prediction lowers nothing: the prediction, no overhead
    low = plan_sync(**ISSUE, per_step_fp32_s=0.2)
    assert _exposed(low, "per-step fp32") == pytest.approx(0.310)
    assert _exposed(low, "per-step int8") == pytest.approx(0.310 * 8.125 / 32)


def test_the_issues_example_text_with_the_measured_terms():
    # the issue's example, measured: per-step fp32 took 320 ms (10 ms over the link model: per call),
    # int8's codec 1 ns per byte (2 x 3.875 ms): int8 78.7 + 7.75 + 10 = 96.5 ms
    plan = plan_sync(**ISSUE, compression="int8", fragments=4, per_step_fp32_s=0.320,
                     codec_s_per_byte={"int8": 1e-9})
    assert plan.why.startswith("100 Mbit/s between hosts: per-step fp32 exposes 320 ms (measured) of a 4 ms step; "
                               "int8 96.5 ms (codec 7.75 ms, per call 10 ms); DiLoCo H=")
    assert plan.mode == "outer" and "per call" in plan.why.split("hides it")[1]
    assert plan_sync(**ISSUE).why.startswith("100 Mbit/s between hosts: per-step fp32 exposes 310 ms of a 4 ms step; "
                                             "int8 78.7 ms; ")  # no measured terms: the text as before


def test_bad_measured_terms_are_refused_by_name():
    with pytest.raises(ValueError, match="codec_s_per_byte names 'int3', no compression method"):
        plan_sync(**ISSUE, codec_s_per_byte={"int3": 1e-9})
    with pytest.raises(ValueError, match=r"codec_s_per_byte\['int8'\] must be a finite number of seconds >= 0"):
        plan_sync(**ISSUE, codec_s_per_byte={"int8": -1.0})
    with pytest.raises(ValueError, match="codec_s_per_byte must be a mapping"):
        plan_sync(**ISSUE, codec_s_per_byte=1e-9)
    with pytest.raises(ValueError, match="per_step_fp32_s must be a finite number of seconds >= 0 or None, got nan"):
        plan_sync(**ISSUE, per_step_fp32_s=float("nan"))


def test_diloco_auto_measures_and_passes_the_codec_and_the_per_step_average(monkeypatch):
    # DiLoCo(sync_every="auto") on a stand-in for 2 hosts: the codec figure it times (stubbed: 1 us per
    # byte) and its warm-up's fp32 averages reach plan_sync, agreed through one allreduce of every figure
    from types import SimpleNamespace

    import torch

    from ddl_triton.torch import diloco_auto

    class TwoHosts:
        rank, size = 0, 1
        placement = SimpleNamespace(node_of_rank=(0, 1))
        planner = SimpleNamespace(link=SimpleNamespace(bytes_per_s=1e12, alpha=0.0))
        reduced: list = []

        def allreduce(self, t, op="sum", async_op=False):
            self.reduced.append((t.numel(), op))
            return t

        def broadcast(self, t, root=0, async_op=False):
            return t

    timed = []
    monkeypatch.setattr(diloco_auto, "_codec_seconds_per_byte", lambda m, n: timed.append((m, n)) or 1e-6)
    comm = TwoHosts()
    params = [torch.nn.Parameter(torch.ones(250))]
    auto = diloco_auto.AutoSync(comm, params, max_sync_every=8, compression="int8", fragments=1, block=256,
                                error_feedback=True)
    plan = None
    for _ in range(diloco_auto.MEASURED_STEPS + 1):
        params[0].grad = torch.ones(250)
        auto.before_inner_step()
        plan = auto.after_inner_step() or plan
    assert timed == [("int8", 250)]
    assert (3, "max") in comm.reduced  # the step, the fp32 average, int8's codec: the slowest rank's
    assert dict(plan.candidates)["per-step int8"] >= 2 * 1e-6 * 1000
    assert "(measured)" in plan.why
    auto.close()


def test_the_simulate_command_takes_the_measured_terms(capsys):
    from ddl_triton.simulation.cli import main

    assert main(["outer-sync", "--model-bytes", "3875000", "--step-ms", "4", "--hosts", "2", "--rate", "100mbit",
                 "--compression", "int8", "--fragments", "4", "--codec", "int8=1", "--per-step-fp32-ms", "320"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("100 Mbit/s between hosts: per-step fp32 exposes 320 ms (measured) of a 4 ms step; "
                          "int8 96.5 ms (codec 7.75 ms, per call 10 ms);")
    with pytest.raises(SystemExit):
        main(["outer-sync", "--params", "1M", "--step-ms", "4", "--rate", "100mbit", "--codec", "int8"])
    assert "--codec wants METHOD=NS_PER_BYTE (e.g. int8=1.5), got 'int8'" in capsys.readouterr().err
