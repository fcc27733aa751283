"""The scale-out simulator: cluster specs, workloads, the decomposition at scale, the iteration
model and the CLI; link emulation's parsing and pacing (no ranks)."""
from __future__ import annotations

import time

import pytest
import torch

from ddl_triton.simulation import iteration, cli
from ddl_triton.simulation.cluster import load
from ddl_triton.planning.costmodel import PARAMETERS
from ddl_triton.transports.link_emulation import LinkSpec, Pacer, parse
from ddl_triton.simulation.workload import Layer, layers_from_module, load_layers


@pytest.mark.parametrize("name", ["minsky", "bigbasin", "local", "testbed"])
def test_every_number_of_a_cluster_spec_carries_a_source(name):
    cluster = load(name)
    assert cluster.sources and all(str(src).strip() for src in cluster.sources.values())


def test_a_spec_without_a_source_is_refused(tmp_path):
    spec = tmp_path / "bad.toml"
    spec.write_text('name = "bad"\n[levels]\ngpus_per_node = { value = 4 }\nnodes_per_rack = { value = 1, source = "x" }\n')
    with pytest.raises(ValueError, match="levels.gpus_per_node has no source"):
        load(str(spec))
    with pytest.raises(ValueError, match="unknown cluster 'nope'; known: bigbasin, local, minsky, testbed"):
        load("nope")


def test_layer_tables_match_the_published_parameter_counts():
    assert sum(l.params for l in load_layers("resnet50")) == 25_557_032
    assert sum(l.params for l in load_layers("resnet101")) == 44_549_160


def test_layers_traced_on_the_meta_device_count_parameters_and_multiply_adds():
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 4 * 4, 10))
    layers = layers_from_module(net, (3, 4, 4))
    assert [(l.params, l.fwd_macs) for l in layers] == [(8 * 27 + 8, 8 * 16 * 27), (0, 128), (1290, 1280)]
    assert next(net.parameters()).device.type == "cpu"  # the caller's module is left alone


def test_grids_fill_nodes_then_racks():
    minsky = load("minsky")
    assert [minsky.grid(g) for g in (4, 8, 64, 256, 1024)] == [(4,), (4, 2), (4, 16), (4, 16, 4), (4, 16, 16)]


@pytest.mark.parametrize("dims", [(2, 2), (4, 2), (2, 4)])
def test_per_dimension_lines_agree_with_walking_the_whole_multidim_schedule(dims, monkeypatch):
    """The decomposition used beyond 32 GPUs, checked against the full walk where both run."""
    minsky = load("minsky")
    gpus = dims[0] * dims[1]
    cluster = minsky.__class__(**{**minsky.__dict__, "gpus_per_node": dims[0], "nodes_per_rack": dims[1]})
    nbytes = 8 << 20
    walked, how = iteration.allreduce_time(cluster, gpus, nbytes, "multidim")
    assert how == "full schedule walk"
    monkeypatch.setattr(iteration, "_WALK_LIMIT", 1)
    iteration._LINES.clear()
    lines, how = iteration.allreduce_time(cluster, gpus, nbytes, "multidim")
    assert how.startswith("per-dimension lines")
    # The lines ignore cross-level pipelining: never faster, and within a factor 1.6.
    assert walked <= lines * 1.001 and lines < 1.6 * walked, (walked, lines)


def test_1024_gpus_are_predicted_in_seconds_for_every_schedule():
    minsky, layers = load("minsky"), load_layers("resnet50")
    compute = iteration.compute_seconds(minsky, layers, 32)
    t0 = time.monotonic()
    effs = {s: iteration.iteration(minsky, layers, 1024, s, batch=32, compute=compute).efficiency for s in iteration.SCHEDULES}
    assert time.monotonic() - t0 < 60
    assert all(0.5 < e <= 1.0 for e in effs.values()), effs
    assert effs["multidim"] > effs["ring"]  # log-depth across 256 nodes beats a 1024-step ring


def test_the_engines_inter_node_ring_is_never_slower_than_ours_at_any_scale():
    # hierarchical_native's group step is hierarchical's inter-node ring minus the executor's
    # per-step overhead and staging copies: walked whole up to 32 GPUs, by lines beyond.
    minsky = load("minsky")
    for gpus in (8, 32, 64, 1024):
        native, how = iteration.allreduce_time(minsky, gpus, 100 << 20, "hierarchical_native")
        ours, _ = iteration.allreduce_time(minsky, gpus, 100 << 20, "hierarchical")
        assert native < ours, (gpus, native, ours)
        assert ("engine's ring x" in how) == (gpus > 32), how
    # at 1024 GPUs, 256 nodes: 2 x 255 steps of overhead gone from the inter-node ring
    native, _ = iteration.allreduce_time(minsky, 1024, 100 << 20, "hierarchical_native")
    ours, _ = iteration.allreduce_time(minsky, 1024, 100 << 20, "hierarchical")
    assert ours - native > 2 * 255 * minsky.step_overhead * 0.9, (ours, native)


def test_the_iteration_overlaps_backward_or_not_as_the_cluster_says():
    layers = [Layer("a", 1_000_000, 1000), Layer("b", 1_000_000, 1000)]
    minsky, local = load("minsky"), load("local")
    fixed = lambda nbytes: 0.001  # noqa: E731 - 1 ms per bucket
    overlapped = iteration.iteration(minsky, layers, 2, "ring", batch=1, compute=0.03, bucket_mb=4, allreduce=fixed,
                                 bucket_overhead=0.0)
    serial = iteration.iteration(local, layers, 2, "ring", batch=1, compute=0.03, bucket_mb=4, allreduce=fixed,
                             bucket_overhead=0.0)
    assert overlapped.buckets == 2 and overlapped.iteration == pytest.approx(0.03 + 0.001)  # the first hides
    assert serial.iteration == pytest.approx(0.03 + 0.002)
    assert iteration.straggler_factor(1, 0.03) == 1.0 and iteration.straggler_factor(256, 0.03) > 1.08


def test_a_bucket_issued_during_backward_pays_the_overlapped_overhead_and_the_last_the_tail_one():
    layers = [Layer("a", 1_000_000, 1000), Layer("b", 250_000, 1000)]
    local = load("local")
    fixed = lambda nbytes: 0.001  # noqa: E731
    it = iteration.iteration(local, layers, 2, "ring", batch=1, compute=0.03, bucket_mb=0.5, allreduce=fixed,
                         bucket_overhead=lambda nbytes: nbytes * 1e-9, overlapped_overhead=0.005)
    # layer b's 1 MB bucket is issued mid-backward (overlapped), layer a's 4 MB one last (tail)
    assert it.buckets == 2 and it.iteration == pytest.approx(0.03 + 0.001 + 0.005 + 0.001 + 4e6 * 1e-9)
    same = iteration.iteration(local, layers, 2, "ring", batch=1, compute=0.03, bucket_mb=0.5, allreduce=fixed,
                           bucket_overhead=0.002)
    assert same.iteration == pytest.approx(0.03 + 2 * (0.001 + 0.002))


def test_compression_sends_fewer_bytes_and_pays_its_kernels():
    minsky = load("minsky")
    plain, _ = iteration.allreduce_time(minsky, 256, 100 << 20, "multidim")
    int8, _ = iteration.allreduce_time(minsky, 256, 100 << 20, "multidim", compress="int8")
    assert int8 < plain
    with pytest.raises(ValueError, match="unknown compression"):
        iteration.allreduce_time(minsky, 256, 1 << 20, "multidim", compress="zip")


def test_the_train_cli_prints_a_table_per_schedule(capsys, tmp_path):
    png = tmp_path / "eff.png"
    assert cli.main(["train", "--cluster", "minsky", "--model", "resnet50", "--gpus", "8,64,1024",
                          "--schedule", "multidim,ring", "--baseline", "4", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "multidim:" in out and "ring:" in out and "eff vs 4" in out and png.stat().st_size > 5000
    assert cli.main(["allreduce", "--cluster", "minsky", "--ranks", "256", "--bytes", "1048576",
                          "--schedule", "multidim"]) == 0
    assert "multidim allreduce of 1048576 B on 256 GPUs of minsky" in capsys.readouterr().out


def test_the_local_cluster_predicts_from_a_fitted_model():
    seconds, source = cli.local_allreduce(2, "", 1 << 20, "ring", probe=False)
    assert seconds > 0 and source  # no table in the test cache: the built-in defaults, said so
    slower, _ = cli.local_allreduce(4, "2x2", 1 << 20, "ring", link_emulation="mpi:bw=100MB/s,lat=1ms",
                                         probe=False)
    faster, _ = cli.local_allreduce(4, "2x2", 1 << 20, "ring", probe=False)
    assert slower > faster + 2 * (1 << 20) / 4 / 100e6  # at least the emulated wire time of two ring steps


def test_a_prediction_never_tunes_unless_asked_and_says_which_figures_it_used(monkeypatch, capsys):
    """No side effects: without --tune, no ddl-tune runs and no table is written (the test session's
    tuning cache is empty, so the built-in model stands in, said so); --tune probes, with progress."""
    from ddl_triton.simulation import cluster

    probes = []
    monkeypatch.setattr(cluster, "_probe", lambda ranks, topology, extra, why: probes.append((ranks, topology)))
    assert cli.main(["allreduce", "--cluster", "local", "--ranks", "2", "--bytes", "4096"]) == 0
    assert cli.main(["allreduce", "--cluster", "testbed", "--ranks", "2", "--topology", "1x2", "--bytes", "4096"]) == 0
    out = capsys.readouterr().out
    assert probes == [], "a prediction ran ddl-tune without --tune"
    assert out.count("the built-in defaults of ddl_triton/planning/costmodel.py: no ddl-tune table for 2 ranks") == 2
    assert "--tune measures this host" in out and "link figures: " in out and "testbed.toml" in out
    assert cli.main(["allreduce", "--cluster", "minsky", "--ranks", "8", "--bytes", "4096"]) == 0
    assert "figures: " in capsys.readouterr().out  # the cluster file named
    assert cli.main(["allreduce", "--cluster", "local", "--ranks", "2", "--bytes", "4096", "--tune"]) == 0
    assert probes == [(2, "")]


def test_the_probe_shows_ddl_tunes_progress(monkeypatch):
    from ddl_triton.simulation import cluster

    ran = []
    monkeypatch.setattr(cluster.subprocess, "run", lambda command, **kw: ran.append((command, kw)))
    cluster._probe(2, "", [], "no ddl-tune table")
    command, kw = ran[0]
    assert "ddl_triton.tune" in command and "--quiet" not in command  # its progress bar, on stderr
    assert "stderr" not in kw  # inherited: the user sees it


def test_a_fresh_probe_serves_this_process_and_leaves_the_tuning_cache_alone(monkeypatch):
    import dataclasses

    from ddl_triton.simulation import cluster
    from ddl_triton.planning import tuning_table
    from ddl_triton.planning.costmodel import DEFAULT

    probed = dataclasses.replace(DEFAULT, step_overhead=1.25e-3)  # a model no real probe would fit
    calls = []

    def fake_probe(ranks, topology, extra, why):
        calls.append(extra)
        out = extra[extra.index("--out") + 1]
        key = tuning_table.machine_key(world_size=ranks, topology=topology or str(ranks), transport="auto")
        tuning_table.TuningTable(key=key, options={"chunk_bytes": 1 << 20, "pipeline_depth": 4}, entries={},
                           model=probed).save(out)

    monkeypatch.setattr(cluster, "_probe", fake_probe)
    monkeypatch.setattr(cluster, "_refreshed", {})
    model, source = cluster.local_model(3, "", refresh=True)
    assert model.step_overhead == 1.25e-3 and "afresh" in source
    assert calls and "--no-cache" in calls[0]  # the user's cached table is never replaced
    assert cluster.local_model(3, "")[0] is model  # later predictions in this process use it
    assert cluster.local_model(3, "1x3", probe=False)[0] is not model  # another layout: not this one


# -- link emulation --------------------------------------------------------------------------------
def test_link_specs_parse_with_units_and_bad_ones_say_what_is_wrong():
    spec = parse("mpi:bw=1GB/s,lat=50us")
    assert spec.bandwidth == 1e9 and spec.latency == pytest.approx(50e-6, rel=1e-12)
    assert parse("mpi:bw=512MiB/s") == LinkSpec(512 * (1 << 20), 0.0)
    assert parse("") is None
    for bad, why in (("shm:bw=1GB/s", "only the mpi transport"), ("mpi:bw=fast", "cannot read 'bw=fast'"),
                     ("mpi:lat=5us", "needs a positive bw")):
        with pytest.raises(ValueError, match=why):
            parse(bad)


def test_the_pacer_holds_messages_for_their_wire_time_without_blocking():
    pacer = Pacer(LinkSpec(bandwidth=1e6, latency=0.01))   # 1 MB/s: 10 kB take 10 ms, plus 10 ms latency
    posted = []
    t0 = time.monotonic()
    pacer.submit(10_000, lambda: posted.append(time.monotonic() - t0))
    pacer.submit(10_000, lambda: posted.append(time.monotonic() - t0))
    assert time.monotonic() - t0 < 0.005 and posted == []  # submit never waits
    while not pacer.pump():
        time.sleep(0.001)
    assert 0.019 <= posted[0] < 0.06 and 0.029 <= posted[1] < 0.07  # the second queued behind the first


def test_cost_model_charges_whole_messages_over_mpi():
    from ddl_triton import schedules
    from ddl_triton.planning.costmodel import CostModel
    s = schedules.build("two_shot", "allreduce", 2, 1000, chunk_elems=1000)
    shm = CostModel().terms(s, lambda a, b: "shm", 4)[1]
    mpi = CostModel().terms(s, lambda a, b: "mpi", 4)[1]
    assert mpi[PARAMETERS.index("mpi_beta")] >= shm[PARAMETERS.index("shm_beta")]


def test_an_emulated_link_slows_real_messages_and_keeps_results_exact():
    import re

    from support.launch import run_ranks
    proc = run_ranks(2, "multirank/simulator_worker.py", env={"DDL_TOPOLOGY": "1x2",
                                                     "DDL_LINK_EMULATION": "mpi:bw=10MB/s,lat=20ms"}, timeout=120)
    rows = re.findall(r"EMULATED rank=(\d) exact=(\w+) seconds=([\d.]+)", proc.stdout)
    assert proc.returncode == 0 and sorted(r for r, _, _ in rows) == ["0", "1"], proc.stdout + proc.stderr  # both ranks
    # At least half the 2 MB crosses the 10 MB/s link (0.1 s) after 20 ms of latency.
    assert all(exact == "True" and float(sec) >= 0.12 for _, exact, sec in rows), rows
