"""The simulator across shaped host links (clusters/testbed.toml, simulation/shaped_link.py and
simulation/across_hosts.py): the cluster file parses with a source for every number, the token
bucket passes a burst then the rate, schedules put the bytes they should on each host's link, and
an allreduce or a training step across the testbed is predicted from the link, not fitted to it.
No testbed, no ranks: the fitted model is replaced by the built-in one."""
from __future__ import annotations

import pytest

from ddl_triton import schedules
from ddl_triton.planning.costmodel import DEFAULT, CostModel, Link
from ddl_triton.simulation import across_hosts, cli, iteration
from ddl_triton.simulation.cluster import load
from ddl_triton.simulation.shaped_link import ShapedLink, TokenBucket, host_link_bytes, schedule_seconds
from ddl_triton.simulation.workload import Layer

RATE = 1e9 / 8 * 0.9564  # 1 Gbit/s of frames, in TCP payload bytes per second


@pytest.fixture
def testbed():
    return load("testbed")


@pytest.fixture
def fitted(monkeypatch):
    """The built-in cost model stands in for this host's fitted one (no probe, no tuning cache)."""
    model = CostModel(mpi=Link(alpha=20e-6, beta=1 / 2e9))
    monkeypatch.setattr(across_hosts, "local_model", lambda ranks, topology, probe=True, refresh=False:
                        (model, f"stand-in for {ranks} ranks on {topology}"))
    return model


def test_the_testbed_file_parses_and_every_number_has_a_source(testbed):
    assert testbed.calibrated and not testbed.overlap
    inter = testbed.links["inter"]
    assert inter["shaped"] == ShapedLink(rate=pytest.approx(RATE), burst=pytest.approx(250_000 * 0.9564))
    assert 1e-6 < inter["alpha"] < 1e-4 and inter["same_host_alpha_us"] < inter["alpha"]
    for key in ("alpha_us", "bandwidth_gbps", "shaped_gbit", "goodput_share", "burst_bytes", "same_host_alpha_us",
                "same_host_gbps"):
        assert str(testbed.sources[f"links.inter.{key}"]).strip()


def test_another_rate_scales_the_rate_and_the_testbeds_burst(testbed):
    slow = across_hosts.with_rate(testbed, "100mbit").links["inter"]["shaped"]
    assert slow.rate == pytest.approx(RATE / 10)
    assert slow.burst == pytest.approx((64 << 10) * 0.9564)  # the testbed's least burst: 64 KiB
    with pytest.raises(ValueError, match="not like '1gbit'"):
        across_hosts.with_rate(testbed, "fast")


def test_a_token_bucket_passes_its_burst_at_once_then_the_rate_and_refills_when_idle():
    bucket = TokenBucket(ShapedLink(rate=1000.0, burst=100.0))
    assert bucket.transfer(0.0, 60) == 0.0            # within the burst: through at once
    assert bucket.transfer(0.0, 540) == pytest.approx(0.5)   # 40 tokens left, 500 bytes at the rate
    assert bucket.transfer(0.1, 10) == pytest.approx(0.51)   # FIFO: behind the previous, bucket empty
    assert bucket.transfer(5.0, 100) == 5.0           # refilled, never past the burst
    assert bucket.transfer(5.0, 1) == pytest.approx(5.001)


@pytest.mark.parametrize("per_host, name, share", [(1, "ring", 1.0), (1, "one_shot", 1.0), (2, "ring", 1.5),
                                                   (2, "one_shot", 4.0), (2, "hierarchical", 1.0)])
@pytest.mark.parametrize("count", [1 << 16, 65_537])
def test_each_schedule_puts_its_bytes_on_the_busiest_host_link(per_host, name, share, count):
    """2 hosts: ring and one_shot on one rank each send S each way; at 2 x 2 a ring crosses each host's
    link with 2 (N-1)/N S = 1.5 S, one_shot sends S to each of 2 far ranks from each of 2 ranks (4 S),
    hierarchical puts the bound 2 (H-1)/H S = S on each host's link."""
    size = 2 * per_host
    grid = (per_host, 2) if schedules.uses_grid(name) else None
    built = schedules.build(name, "allreduce", size, count, chunk_elems=1 << 14, grid=grid)
    got = host_link_bytes(built, lambda r: r // per_host, 4)
    assert got == pytest.approx(share * count * 4, rel=1e-3)


def test_a_stream_of_calls_runs_at_the_rate_and_calls_after_an_idle_spell_get_the_burst(testbed):
    link = testbed.links["inter"]["shaped"]
    ring = schedules.build("ring", "allreduce", 2, 1 << 20, chunk_elems=1 << 19)  # 4 MiB
    host_of = lambda r: r  # noqa: E731
    link_of = lambda a, b: "mpi"  # noqa: E731
    steady = schedule_seconds(DEFAULT, ring, link_of, host_of, 4, link)
    assert steady == pytest.approx((4 << 20) / RATE, rel=1e-3)  # every byte at the rate, none free
    assert DEFAULT.time(ring, link_of, 4) < steady / 5          # the unshaped walk knows no bucket
    once = schedule_seconds(DEFAULT, ring, link_of, host_of, 4, link, calls=1)
    assert once == pytest.approx(((4 << 20) - link.burst) / RATE, rel=0.02)


def test_a_tree_pays_the_link_twice_because_its_two_directions_take_turns(testbed):
    """Reduce up, then broadcast down: each direction carries S, but one after the other, so the
    time is about 2 S at the rate, where a bound of bytes over rate says S."""
    link = testbed.links["inter"]["shaped"]
    nbytes = 4 << 20
    tree = schedules.build("tree", "allreduce", 2, nbytes // 4, chunk_elems=nbytes // 4)
    assert host_link_bytes(tree, lambda r: r, 4) == nbytes
    took = schedule_seconds(DEFAULT, tree, lambda a, b: "mpi", lambda r: r, 4, link)
    assert 1.8 * nbytes / RATE < took < 2.1 * nbytes / RATE


def test_the_fitted_mpi_link_is_moved_onto_the_testbeds(testbed, fitted):
    model, source = across_hosts.hosts_model(testbed, 2, 2)
    inter = testbed.links["inter"]
    assert model.mpi.alpha == pytest.approx(fitted.mpi.alpha - inter["same_host_alpha_us"] + inter["alpha"])
    assert model.mpi.beta >= inter["beta"] and model.shm == fitted.shm and model.calls == fitted.calls
    assert "stand-in for 4 ranks on 2x2" in source


def test_a_model_fitted_across_the_hosts_themselves_is_taken_as_it_is(testbed):
    across = CostModel(mpi=Link(alpha=7e-6, beta=1 / 1e9))
    assert across_hosts.hosts_model(testbed, 1, 2, fitted=(across, "probed")) == (across, "probed")


@pytest.mark.parametrize("per_host", [1, 2])
def test_allreduce_predictions_across_hosts_are_latency_then_the_link(testbed, fitted, per_host):
    model, _ = across_hosts.hosts_model(testbed, per_host, 2)
    name = "hierarchical" if per_host == 2 else "ring"
    small = across_hosts.hosts_allreduce(testbed, model, per_host, 2, 8, name)
    assert small.seconds == pytest.approx(small.unshaped) and small.seconds < 1e-3  # 8 B: no bucket runs dry
    assert across_hosts.hosts_allreduce(testbed, model, per_host, 2, 0, name).seconds < small.seconds
    for nbytes in (1 << 20, 3 * 1_000_003, 16 << 20):
        big = across_hosts.hosts_allreduce(testbed, model, per_host, 2, nbytes, name)
        assert big.link_bytes == pytest.approx(nbytes, rel=1e-3)
        assert big.seconds >= big.unshaped and big.seconds == pytest.approx(nbytes / RATE, rel=0.05)
    ring = across_hosts.hosts_allreduce(testbed, model, per_host, 2, 16 << 20, "ring")
    assert ring.seconds == pytest.approx((1.5 if per_host == 2 else 1.0) * (16 << 20) / RATE, rel=0.05)


def test_the_cli_predicts_across_the_testbeds_hosts(fitted, capsys):
    assert cli.main(["allreduce", "--cluster", "testbed", "--ranks", "4", "--topology", "2x2", "--bytes",
                          str(4 << 20), "--schedule", "hierarchical", "--rate", "100mbit"]) == 0
    out = capsys.readouterr().out
    assert "hierarchical allreduce of 4194304 B on 2 hosts x 2 of testbed at 100mbit" in out
    predicted = float(out.split(": ")[1].split(" us")[0]) * 1e-6
    assert predicted == pytest.approx((4 << 20) / (RATE / 10), rel=0.05)
    with pytest.raises(SystemExit, match="--topology must be XxH"):
        cli.main(["allreduce", "--cluster", "testbed", "--ranks", "4", "--topology", "3x2", "--bytes", "8"])


def _step(testbed, **kw):
    # 10 layers of 0.2 MB each, backward 100 ms in all; DDP-style buckets of 1 MB after a first of 0.4 MB
    layers = [Layer(f"l{i}", 50_000, 1_000_000) for i in range(10)]
    return iteration.iteration(testbed, layers, 2, "ring", batch=32, compute=0.150, bucket_mb=1.0,
                           allreduce=lambda n: 1e-3, bucket_overhead=0.0, **kw)


def test_a_training_step_waits_for_the_last_buckets_bytes_through_the_shaped_link(testbed):
    link = testbed.links["inter"]["shaped"]
    plain = _step(testbed, first_bucket_mb=0.4)
    assert plain.buckets == 3 and plain.iteration == pytest.approx(0.150 + 3e-3)  # no link: CPU time adds
    shaped = _step(testbed, first_bucket_mb=0.4, link=link, link_bytes=lambda n: n)
    # The last bucket (0.6 MB), issued when backward ends, finds the bucket full again (backward
    # computed 40 ms since the 1 MB before it went): 0.6 MB less the burst at the rate.
    last = (600_000 - link.burst) / RATE
    assert shaped.iteration == pytest.approx(0.150 + 2e-3 + max(1e-3, last), rel=1e-3)
    slow = across_hosts.with_rate(testbed, "100mbit").links["inter"]["shaped"]
    crawling = _step(testbed, first_bucket_mb=0.4, link=slow, link_bytes=lambda n: n)
    # 12 MB/s: the link is the step. The middle bucket (issued at 121 ms, 1 ms of the first
    # bucket's CPU time later than backward reached it) finds the burst refilled; the last queues
    # behind it, with nothing left in the bucket.
    assert crawling.iteration == pytest.approx(0.121 + (1_000_000 - slow.burst) / slow.rate + 600_000 / slow.rate)


def test_the_walk_settles_however_many_chunks_cross_the_link(testbed):
    """The hand-over order settles a chunk per walk or so: 32 chunks of a 2 x 2 hierarchical need
    about 30 walks. The prediction is the settled one (walking far longer changes nothing), and
    smaller chunks of the same call are not predicted slower than its 2 MiB ones by more than the
    extra steps' cost (with 12 walks at most, 512 KiB chunks came out 33% slower: 220 ms vs 166)."""
    from ddl_triton.simulation import shaped_link
    cluster = across_hosts.with_rate(testbed, "1gbit")
    model = CostModel(mpi=Link(alpha=125e-6, beta=1.3e-9), step_overhead=34e-6)

    def predict(chunk_bytes):
        return across_hosts.hosts_allreduce(cluster, model, 2, 2, 16 << 20, "hierarchical",
                                            chunk_bytes=chunk_bytes).seconds

    small, large = predict(512 << 10), predict(2 << 20)
    bound = shaped_link._SETTLE_PASSES
    try:
        shaped_link._SETTLE_PASSES = 1000
        assert predict(512 << 10) == small
    finally:
        shaped_link._SETTLE_PASSES = bound
    assert small < 1.05 * large, (small, large)
