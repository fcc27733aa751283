"""The link between hosts measured at init: the probe's math, the model priced with it, the
planner's picks on the testbed's figures, and compression="auto" reading the same measurement."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from ddl_triton.options import Options
from ddl_triton.planning import measured_link
from ddl_triton.planning.costmodel import CALL_KINDS, DEFAULT
from ddl_triton.planning.measured_link import MeasuredLink, agree, price, rate
from ddl_triton.planning.planner import Planner
from ddl_triton.planning.topology import parse
from ddl_triton.runtime.setup import link_probe
from ddl_triton.tuning import auto_compression

# The testbed: 1 Gbit/s links (0.118 GB/s as TCP sees them), 10 us one way.
_TESTBED = 0.118e9


def test_rate_is_the_difference_of_two_transfers():
    # Both transfers pay 300 us of latency and a burst; the difference is the rate alone.
    assert rate(1 << 20, 300e-6 + (1 << 20) / 1e8, 2 << 20, 300e-6 + (2 << 20) / 1e8) == pytest.approx(1e8)
    with pytest.raises(ValueError, match="cannot measure a rate"):
        rate(1 << 20, 5e-3, 2 << 20, 5e-3)


def test_every_rank_agrees_on_the_slowest_link_and_the_mean_share():
    every = [[10e-6, 0.12e9, 0.9, 1, 0.1], [None, None, 0.3, 0, 0.12], [30e-6, 0.10e9, 0.6, 1, 0.09]]
    link = agree(every)
    assert (link.alpha, link.bytes_per_s, link.links, link.seconds) == (30e-6, 0.10e9, 2, 0.12)
    assert link.cpu_share == pytest.approx(0.6)
    assert agree(list(reversed(every))) == link  # the same answer whatever the order


@pytest.mark.parametrize("bad", [[math.nan, 1e8, 1.0, 1, 0.1], [1e-5, -1.0, 1.0, 1, 0.1], [1e-5, 1e8, 0.0, 1, 0.1],
                                 [1e-5, "fast", 1.0, 1, 0.1], [1e-5, True, 1.0, 1, 0.1]])
def test_a_figure_that_is_not_a_positive_number_is_refused(bad):
    with pytest.raises(ValueError, match="not a finite positive number"):
        agree([bad, [None, None, 1.0, 0, 0.1]])
    with pytest.raises(ValueError, match="no rank measured"):
        agree([[None, None, 1.0, 0, 0.1]])


def test_price_shares_the_host_link_and_charges_waiting_steps_only_where_ranks_share_cores():
    alone = price(DEFAULT, MeasuredLink(10e-6, 1e8, 1.0), ranks_per_node=1)
    assert (alone.mpi.alpha, alone.mpi.beta, alone.step_overhead) == (10e-6, 1e-8, DEFAULT.step_overhead)
    shared = price(DEFAULT, MeasuredLink(10e-6, 1e8, 0.5), ranks_per_node=2)
    assert shared.mpi.beta == 2e-8  # two ranks of a node receive over one host link at once
    assert shared.step_overhead == pytest.approx(DEFAULT.step_overhead + measured_link.STEP_WAIT)
    general = CALL_KINDS.index("allreduce")
    assert shared.calls[general] == pytest.approx(2 * measured_link.GENERAL_CALL)
    assert shared.calls[CALL_KINDS.index("allreduce_small")] == 0.0  # the small path's own cost stays
    assert (shared.shm, shared.gamma, shared.beta_copy) == (DEFAULT.shm, DEFAULT.gamma, DEFAULT.beta_copy)


def _planner(per_host: int, link: MeasuredLink | None) -> Planner:
    size = 2 * per_host
    planner = Planner(rank=0, size=size, topology=parse(f"{per_host}x2", size), forced="", slot_bytes=2 << 20,
                      link_of=lambda a, b: "shm" if a // per_host == b // per_host else "mpi",
                      wire_chunk_bytes=512 << 10, link=link)
    planner.group_engines = True
    planner.small_path = lambda nbytes, dtype: nbytes <= 64 << 10  # small_allreduce_two_sided.LIMIT_BYTES
    return planner


def _picks(planner: Planner, sizes) -> list[str]:
    return [planner.plan("allreduce", n, torch.float32).schedule for n in sizes]


def test_at_2x2_the_measured_link_moves_32_kib_up_off_one_shot_and_keeps_the_small_path_below():
    sizes = [8, 2048, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 1 << 20, 16 << 20]
    # Without the probe: one_shot to 128 KiB (2.1-4.4 ms measured, where hierarchical took 1.1).
    assert _picks(_planner(2, None), sizes)[:6] == ["one_shot"] * 6
    measured = _planner(2, MeasuredLink(10e-6, _TESTBED, 0.5))
    # MPI's own allreduce between the hosts up to 1 MiB (0.63-0.94 ms at 32-128 KiB measured, the
    # fastest), then hierarchical, whose node phases overlap the link.
    assert _picks(measured, sizes) == ["one_shot"] * 3 + ["hierarchical_native"] * 4 + ["hierarchical"]
    # The link alone, without the waiting steps (the reverted try): the general path at 8 KiB.
    assert _picks(_planner(2, MeasuredLink(10e-6, _TESTBED, 1.0)), [8 << 10, 16 << 10]) != ["one_shot"] * 2
    plan = measured.plan("allreduce", 64 << 10, torch.float32)
    assert "link between hosts measured at init: 0.118 GB/s each way, 10 us; 0.50 of a core" in plan.reason


def test_at_2x1_the_small_path_then_mpis_own_allreduce():
    picks = _picks(_planner(1, MeasuredLink(10e-6, _TESTBED, 1.0)), [8, 2048, 64 << 10, 128 << 10, 16 << 20])
    assert picks == ["one_shot"] * 3 + ["hierarchical_native"] * 2


def _placement(hosts, links=None, kind="mpi"):
    size = len(hosts)
    links = links or tuple("self" if p == 0 else ("shm" if hosts[p] == hosts[0] else "mpi") for p in range(size))
    from ddl_triton.runtime.setup.placement import Placement
    return Placement(0, size, parse(f"{hosts.count(0)}x{size // hosts.count(0)}", size), tuple(hosts), tuple(hosts),
                     tuple(r for r in range(size) if hosts[r] == 0), links, "auto", bootstrap_kind=kind)


def test_the_probe_runs_only_across_hosts_without_a_fitted_model():
    across, on = _placement((0, 0, 2, 2)), Options()
    assert link_probe.wanted(across, on, None) == ""
    assert link_probe.wanted(_placement((0, 0)), on, None) == "one host"
    assert link_probe.wanted(across, Options(link_probe=False), None) == "DDL_LINK_PROBE=0"
    assert link_probe.wanted(across, on, SimpleNamespace(model=object())) == "the tuning table's fitted model"
    assert link_probe.wanted(across, on, SimpleNamespace(model=None)) == ""  # entries only: the model still plans
    # torchrun / env://: measured too, once the transports are open (over gloo's process group).
    stored = _placement((0, 0, 2, 2), kind="store")
    assert link_probe.wanted(stored, on, None) == ""
    assert (link_probe.before_wiring(across), link_probe.before_wiring(stored)) == (True, False)
    everything_mpi = _placement((0, 0, 2, 2))
    object.__setattr__(everything_mpi, "transport", "mpi")
    assert link_probe.wanted(everything_mpi, on, None) == "ranks of one host talk over MPI"
    object.__setattr__(stored, "transport", "mpi")  # DDL_TRANSPORT: every peer over the two-sided transport
    assert link_probe.wanted(stored, on, None) == "ranks of one host talk over gloo"
    assert Options.from_env({"DDL_LINK_PROBE": "0"}).link_probe is False


def test_host_leaders_pair_up_and_an_odd_host_pairs_with_the_first():
    assert link_probe._pairs([0, 2]) == [(0, 2)]
    assert link_probe._pairs([0, 2, 4, 6]) == [(0, 2), (4, 6)]
    assert link_probe._pairs([0, 1, 2]) == [(0, 1), (0, 2)]


def test_auto_compression_reads_the_planners_measurement_instead_of_timing_the_link(monkeypatch):
    timed = []
    monkeypatch.setattr(auto_compression, "_time_allreduce", lambda comm, n: timed.append(n) or 1e-3)
    monkeypatch.setattr(auto_compression, "_time_compressor", lambda m, n: 1e-3 if n > 4096 else 1e-5)

    class Comm:
        planner = SimpleNamespace(link=MeasuredLink(10e-6, _TESTBED, 1.0))

        def allreduce(self, t, op="sum"):
            return t

    link, speed = auto_compression.probe(SimpleNamespace(comm=Comm(), cross=None, hosts=2, local_size=1))
    assert timed == [] and link.bytes_per_s == _TESTBED and link.latency_us == pytest.approx(10.0)
    assert "measured at init" in link.source and speed.fixed_us
    # Two ranks per host: two cross groups share the host link, as timing them at once measured.
    link, _ = auto_compression.probe(SimpleNamespace(comm=Comm(), cross=None, hosts=2, local_size=2))
    assert link.bytes_per_s == _TESTBED / 2
    Comm.planner = SimpleNamespace(link=None)
    auto_compression.probe(SimpleNamespace(comm=Comm(), cross=None, hosts=2, local_size=1))
    assert timed == [8, 1 << 20]  # no measurement to share: it times the link itself


def test_a_link_measured_after_the_planner_was_made_prices_its_model_unless_a_table_fitted_one():
    # A store bootstrap measures once the transports are open: the planner made before takes it then.
    later = _planner(2, None)
    later.use_link(MeasuredLink(10e-6, _TESTBED, 0.5))
    at_once = _planner(2, MeasuredLink(10e-6, _TESTBED, 0.5))
    assert (later.model, later.model_source, later.link) == (at_once.model, at_once.model_source, at_once.link)
    assert "measured at init: 0.118 GB/s" in later.model_source
    assert later.model != _planner(2, None).model
    fitted = _planner(2, None)
    fitted.table = SimpleNamespace(model=DEFAULT)
    model = fitted.model
    fitted.use_link(MeasuredLink(10e-6, _TESTBED, 0.5))
    assert fitted.model is model and fitted.link is not None  # auto still reads the measurement


class _ThreadClocks:
    """A clock per thread, standing in for ``time`` in link_probe: a transfer advances the clock of
    the thread that waited for it, so each side times exactly what the modelled link takes."""

    def __init__(self):
        import threading
        self.local = threading.local()

    def perf_counter(self) -> float:
        return getattr(self.local, "now", 0.0)

    def advance(self, seconds: float) -> None:
        self.local.now = self.perf_counter() + seconds


class _FakeWire:
    """One side of a point-to-point pair whose transfers take ``latency + bytes / rate`` (both
    directions at once, as the probe sends them), for ``link_probe._exchange`` on two threads."""

    def __init__(self, inbox, outbox, latency: float, rate: float, sizes: list, clocks: _ThreadClocks):
        self.inbox, self.outbox, self.latency, self.rate, self.sizes = inbox, outbox, latency, rate, sizes
        self.clocks = clocks

    def send(self, buf, tag: int):
        self.outbox.put((tag, buf.clone()))
        return ("send", buf.numel())

    def recv(self, buf, tag: int):
        return ("recv", buf, tag)

    def wait(self, requests, timeout: float, what: str) -> None:
        for kind, *rest in requests:
            if kind == "recv":
                buf, tag = rest
                got_tag, data = self.inbox.get(timeout=timeout)
                assert got_tag == tag and data.numel() == buf.numel(), (what, got_tag, tag, data.numel(), buf.numel())
                buf.copy_(data)
                self.sizes.append(buf.numel())
                self.clocks.advance(self.latency + buf.numel() / self.rate)


@pytest.mark.parametrize("rate,scaled", [(0.4e9, True), (0.09e9, False)])
def test_the_probe_times_transfers_that_outlast_a_fast_links_burst_and_both_sides_agree(monkeypatch, rate, scaled):
    import queue
    import threading
    clocks = _ThreadClocks()
    monkeypatch.setattr(link_probe, "time", clocks)  # _exchange reads only perf_counter
    a_to_b, b_to_a = queue.Queue(), queue.Queue()
    seen: dict[bool, list] = {True: [], False: []}
    results: dict[bool, tuple] = {}

    def side(first: bool):
        wire = _FakeWire(b_to_a if first else a_to_b, a_to_b if first else b_to_a, 50e-6, rate, seen[first], clocks)
        results[first] = link_probe._exchange(wire, 0 if first else 1, 1 if first else 0, first, 10.0, str)

    threads = [threading.Thread(target=side, args=(f,)) for f in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(results) == {True, False}
    # The same transfers on both sides, in the same order (the lower rank's 1-byte words only go up).
    data = {f: [n for n in seen[f] if n > 1] for f in seen}
    assert data[True] == data[False] and len(seen[False]) > len(data[False])
    big = max(data[True])
    assert big == (link_probe._BIG * link_probe._SCALE if scaled else link_probe._BIG)
    alpha, measured = results[True]
    assert measured == pytest.approx(rate, rel=1e-9)  # the difference of two transfers: latency cancels
    assert alpha == pytest.approx((50e-6 + 8 / rate) / 2, rel=1e-9)  # half the fastest 8-byte round trip
