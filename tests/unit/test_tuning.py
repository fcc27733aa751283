"""The tuning table, the planner's order of sources, the least-squares fit and the sweep's
decisions, with no ranks (tests/multirank/test_tune_multirank.py runs ddl-tune itself)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from ddl_triton import schedules
from ddl_triton.planning import tuning_table
from ddl_triton.tuning.candidates import candidates
from ddl_triton.tuning.cli import parse_bytes
from ddl_triton.tuning.decisions import choose_layout, entries
from ddl_triton.tuning.sweep import geometric_sizes
from ddl_triton.tuning.timing import iterations, quantile
from ddl_triton.planning.costmodel import PARAMETERS, CostModel, Link
from ddl_triton.tuning.fit import Sample, fit
from ddl_triton.planning.planner import Planner
from ddl_triton.planning.topology import Topology

KEY = {"world_size": 2, "topology": "2", "transports": {"intra": "shm", "inter": "mpi"}, "device": "cpu",
       "cpu": "test cpu", "cores": 2, "ddl_triton": "0.1.0", "torch": "2.13.0", "mpi": "MPICH Version: 5"}


def _row(nbytes, schedule, times, chunk=1 << 20, runner_up=None):
    row = {"bytes": nbytes, "schedule": schedule, "chunk_bytes": chunk, "algos": None, "time_us": times[schedule],
           "p20_us": times[schedule], "p80_us": times[schedule], "by_schedule": times}
    if runner_up:
        row["runner_up"] = runner_up
    return row


def _table_json(**changes):
    data = {"format": tuning_table.FORMAT, "version": tuning_table.VERSION, "key": KEY,
            "options": {"chunk_bytes": 4 << 20, "pipeline_depth": 4},
            "entries": {"allreduce": {"float32": [
                _row(1024, "one_shot", {"one_shot": 10.0, "ring": 20.0}),
                _row(4096, "one_shot", {"one_shot": 12.0, "ring": 22.0}),
                _row(1 << 20, "ring", {"one_shot": 300.0, "ring": 100.0}, chunk=256 << 10,
                     runner_up={"schedule": "one_shot", "chunk_bytes": 4 << 20, "algos": None, "time_us": 300.0}),
            ]}},
            "model": {"parameters": CostModel().to_dict()}}
    data.update(changes)
    return data


def _write(tmp_path, data, name="t.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


# -- the table ------------------------------------------------------------------------------------
def test_a_measured_size_takes_its_winner_with_the_evidence():
    table = tuning_table.from_json(_table_json())
    choice = table.choose("allreduce", "float32", 4096)
    assert (choice.schedule, choice.chunk_bytes) == ("one_shot", 1 << 20)
    assert choice.evidence == "measured one_shot 12 us, ring 22 us"


def test_between_measured_sizes_schedules_are_interpolated_log_log():
    table = tuning_table.from_json(_table_json())
    # Halfway (in log size) between 4096 B and 1 MiB: one_shot ~ sqrt(12*300) = 60, ring ~ sqrt(22*100) = 46.9.
    mid = int(math.sqrt(4096 * (1 << 20)))
    choice = table.choose("allreduce", "float32", mid)
    assert choice.schedule == "ring"
    assert choice.chunk_bytes == 256 << 10  # the parameters ring won with at the nearer measured size
    assert "interpolated between 4096 B and 1048576 B: ring ~47 us, one_shot ~60 us" in choice.evidence
    # Nearer the small end one_shot is still ahead.
    assert table.choose("allreduce", "float32", 8192).schedule == "one_shot"


def test_the_table_is_silent_outside_its_range_and_for_what_it_never_measured():
    table = tuning_table.from_json(_table_json())
    assert table.choose("allreduce", "float32", 512) is None
    assert table.choose("allreduce", "float32", 2 << 20) is None
    assert table.choose("allreduce", "float16", 4096) is None
    assert table.choose("broadcast", "float32", 4096) is None


@pytest.mark.parametrize("text,message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"format": "something else"}), "not a ddl_triton tuning table"),
    (json.dumps(_table_json(version=99)), "format version 99"),
    (json.dumps(_table_json(entries={"allreduce": {"float32": [{"bytes": 8}]}})), "has no valid 'schedule'"),
    (json.dumps(_table_json(entries={"allgather": {}})), "unknown collective 'allgather'"),
    (json.dumps(_table_json(options={"chunk_bytes": 0, "pipeline_depth": 4})), "options.chunk_bytes"),
    (json.dumps(_table_json(model={"parameters": {"gamma": 1}})), "model parameters"),
])
def test_a_corrupt_table_is_refused_naming_the_file_and_the_problem(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(tuning_table.TuningTableError, match=message) as err:
        tuning_table.load(path)
    assert str(path) in str(err.value)


def test_a_named_table_that_is_missing_or_corrupt_refuses_but_a_cached_one_is_ignored(tmp_path, monkeypatch):
    with pytest.raises(tuning_table.TuningTableError, match="no such file"):
        tuning_table.resolve(str(tmp_path / "typo.json"), KEY)
    monkeypatch.setenv("DDL_TUNING_DIR", str(tmp_path))
    tuning_table.cache_path(KEY).write_text("{broken")
    resolved = tuning_table.resolve("", KEY)
    assert resolved.table is None and "ignoring cached" in resolved.note and "not valid JSON" in resolved.note


def test_a_table_from_elsewhere_is_ignored_naming_every_differing_key(tmp_path):
    path = _write(tmp_path, _table_json(key=dict(KEY, world_size=4, topology="2x2")))
    resolved = tuning_table.resolve(str(path), KEY)
    assert resolved.table is None
    assert "world_size: table 4, here 2" in resolved.note and "topology: table '2x2', here '2'" in resolved.note


def test_entries_naming_unknown_schedules_are_dropped_with_their_names(tmp_path):
    data = _table_json()
    data["entries"]["allreduce"]["float32"].append(_row(4 << 20, "mystery", {"mystery": 1.0, "ring": 2.0}))
    resolved = tuning_table.resolve(str(_write(tmp_path, data)), KEY)
    assert resolved.table is not None and "mystery" in resolved.note
    assert [r["bytes"] for r in resolved.table.entries["allreduce"]["float32"]] == [1024, 4096, 1 << 20]


def test_the_cache_finds_a_table_by_its_key_and_off_uses_none(tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_TUNING_DIR", str(tmp_path))
    assert tuning_table.resolve("", KEY).table is None  # nothing cached yet: silent
    tuning_table.from_json(_table_json()).save(tuning_table.cache_path(KEY))
    found = tuning_table.resolve("", KEY)
    assert found.table is not None and found.source.endswith(", from the cache")
    assert tuning_table.resolve("off", KEY).table is None


def test_saving_and_loading_round_trips_and_the_digest_follows_the_content(tmp_path):
    table = tuning_table.from_json(_table_json())
    table.save(tmp_path / "a.json")
    again = tuning_table.load(tmp_path / "a.json")
    assert again.digest() == table.digest()
    again.entries["allreduce"]["float32"][0]["schedule"] = "ring"
    assert again.digest() != table.digest()


# -- the planner ----------------------------------------------------------------------------------
def _planner(table=None, forced="", slot=2 << 20):
    return Planner(rank=0, size=2, topology=Topology((2,), "test"), link_of=lambda a, b: "shm", forced=forced,
                   slot_bytes=slot, table=table, table_source="t.json" if table else "")


@pytest.mark.parametrize("links,wire,expected", [
    ("mpi", 512 << 10, 512 << 10),      # a peer over MPI or gloo: the wire chunk
    ("shm", 512 << 10, 2 << 20),        # every peer on shm: the slot
    ("mpi", 4 << 20, 2 << 20),          # never more than a slot
    ("mpi", 0, 2 << 20),                # no cap given (the simulator's own planners)
])
def test_an_untuned_plan_across_a_wire_takes_the_wire_chunk(links, wire, expected):
    link = (lambda a, b: "shm") if links == "shm" else (lambda a, b: "shm" if a // 2 == b // 2 else "mpi")
    for rank in range(4):  # every rank of the communicator picks the same chunk
        planner = Planner(rank=rank, size=4, topology=Topology((2, 2), "test"), link_of=link, forced="",
                          slot_bytes=2 << 20, wire_chunk_bytes=wire)
        assert planner.plan("allreduce", 64 << 20, torch.float32).chunk_elems * 4 == expected
        forced = Planner(rank=rank, size=4, topology=Topology((2, 2), "test"), link_of=link, forced="ring",
                         slot_bytes=2 << 20, wire_chunk_bytes=wire)
        assert forced.plan("allreduce", 64 << 20, torch.float32).chunk_elems * 4 == expected


def test_planner_order_is_forced_then_table_then_model():
    table = tuning_table.from_json(_table_json())
    assert _planner(table, forced="tree").plan("allreduce", 4096, torch.float32).reason.startswith("forced")
    tuned = _planner(table).plan("allreduce", 1 << 20, torch.float32)
    assert tuned.schedule == "ring" and tuned.reason == "tuned (t.json): measured ring 100 us, one_shot 300 us"
    assert tuned.chunk_elems == (256 << 10) // 4
    silent = _planner(table).plan("allreduce", 64 << 20, torch.float32)
    assert silent.reason.startswith("cost model fitted from t.json: fastest of")
    plain = _planner().plan("allreduce", 64 << 20, torch.float32)
    assert plain.reason.startswith("cost model (built-in defaults): fastest of")


def test_a_forced_schedule_that_lacks_the_collective_falls_through_and_says_so():
    plan = _planner(forced="two_shot").plan("broadcast", 4096, torch.float32)
    assert plan.reason.startswith("forced two_shot does not implement broadcast; cost model")


def test_a_table_chunk_larger_than_the_slot_is_clamped_to_it():
    table = tuning_table.from_json(_table_json())
    plan = _planner(table, slot=64 << 10).plan("allreduce", 4096, torch.float32)
    assert plan.chunk_elems == (64 << 10) // 4


# -- the fit --------------------------------------------------------------------------------------
@pytest.mark.slow  # seconds: make check, the inner loop, leaves it out
def test_the_fit_recovers_known_parameters_from_exact_times():
    """Times made by a known model on real schedules: least squares must give it back."""
    truth = CostModel(step_overhead=4e-6, shm=Link(3e-6, 1 / 9e9), mpi=Link(20e-6, 1 / 2e9), gamma=1 / 30e9,
                      beta_copy=1 / 15e9, calls=(6e-6, 2e-6, 7e-6, 8e-6, 5e-6, 9e-6), mem_beta=0.0)
    link = lambda a, b: "shm" if a // 2 == b // 2 else "mpi"  # noqa: E731
    planner = Planner(rank=0, size=4, topology=Topology((2, 2), "test"), link_of=link, forced="",
                      slot_bytes=1 << 20)
    samples = []
    for collective in schedules.COLLECTIVES:
        for name in [n for n in schedules.names() if schedules.supports(n, collective)]:
            grid = (2, 2) if schedules.uses_grid(name) else None
            for count in (1, 100, 10_000, 300_000):
                for chunk in (4096, 65536):
                    def terms(model, name=name, collective=collective, count=count, chunk=chunk, grid=grid):
                        return planner.model_terms(name, collective, count, chunk, 4, grid,
                                                   ("ring", "ring") if name == "multidim" else None, model)
                    samples.append(Sample(terms, terms(truth)[0]))
    report = fit(samples, CostModel(mem_beta=0.0))
    assert report.median_abs_rel_error < 1e-6 and report.max_abs_rel_error < 1e-3
    # No sample takes the small-message path: its two parameters stay as they started. (The
    # largest all_to_all outgrows the cache, so mem_beta is fitted: to the truth's 0.)
    assert set(report.not_fitted) == {"call_allreduce_small", "stage_allreduce_small"}
    for name, got, want in zip(PARAMETERS, report.model.vector(), truth.vector()):
        if name not in report.not_fitted:
            assert got == pytest.approx(want, rel=1e-3, abs=1e-15), name


def test_the_fit_refuses_nonsense():
    with pytest.raises(ValueError, match="no samples"):
        fit([], CostModel())
    with pytest.raises(ValueError, match="positive"):
        fit([Sample(lambda m: (0.0, (0.0,) * 21), 0.0)], CostModel())


# -- the sweep's decisions -----------------------------------------------------------------------
def test_sizes_are_geometric_and_end_at_the_top_of_the_range():
    assert geometric_sizes(8, 256 << 20, 4)[-2:] == [128 << 20, 256 << 20]
    assert geometric_sizes(8, 128, 4) == [8, 32, 128]
    assert parse_bytes("64K") == 65536 and parse_bytes("256MiB") == 256 << 20


def test_the_timing_harness_quantiles_interpolate_like_numpy_and_iterations_fill_the_target():
    import numpy as np

    sample = [5.0, 1.0, 4.0, 2.0, 3.0, 9.0, 7.0]
    for q in (0.0, 0.2, 0.5, 0.8, 1.0):
        assert quantile(sample, q) == pytest.approx(float(np.quantile(sample, q)), rel=1e-12)
    assert quantile(sample, 0.5) == 4.0 and quantile([2.0, 1.0], 0.5) == 1.5  # the median, as statistics has it
    assert quantile(sample, 0.2) <= quantile(sample, 0.5) <= quantile(sample, 0.8)
    with pytest.raises(ValueError):
        quantile([], 0.5)
    assert iterations(0.010, 0.001) == 10 and iterations(0.010, 1.0) == 1 and iterations(1.0, 0.0) == 2000
    assert iterations(0.010, 0.003) == 4  # at least the target: rounded up


def test_candidates_cover_every_layout_and_multidims_algorithms():
    small = candidates("allreduce", 16, 4, (2,), [256 << 10, 1 << 20], [4])
    assert {(c.schedule, c.chunk_bytes) for c in small} == {(s, k) for s in ("ring", "one_shot", "two_shot", "rhd",
                                                                              "tree") for k in (256 << 10, 1 << 20)}
    big = candidates("allreduce", 16 << 20, 4, (2,), [256 << 10, 1 << 20, 4 << 20], [2, 4])
    assert {c.chunk_bytes for c in big} == {256 << 10, 1 << 20, 4 << 20} and {c.depth for c in big} == {2, 4}
    grid = candidates("allreduce", 1000, 4, (2, 2), [1 << 20], [4])
    assert {c.algos for c in grid if c.schedule == "multidim"} == {(a, b) for a in ("ring", "rhd", "direct")
                                                                   for b in ("ring", "rhd", "direct")}


def _measured(collective, nbytes, schedule, chunk, depth, us, finalist=True):
    return {"collective": collective, "dtype": "float32", "bytes": nbytes, "schedule": schedule,
            "chunk_bytes": chunk, "algos": None, "depth": depth, "median_us": us, "p20_us": us, "p80_us": us,
            "rounds": 7, "finalist": finalist}


def test_the_layout_best_overall_wins_and_entries_keep_winner_runner_up_and_every_schedule():
    rows = [_measured("allreduce", 8, "one_shot", 1 << 20, 2, 10.0), _measured("allreduce", 8, "ring", 1 << 20, 2, 30),
            _measured("allreduce", 8, "one_shot", 1 << 20, 4, 11.0), _measured("allreduce", 8, "ring", 1 << 20, 4, 25),
            _measured("allreduce", 4096, "one_shot", 1 << 20, 2, 40.0), _measured("allreduce", 4096, "ring", 1 << 20, 4, 20),
            _measured("allreduce", 4096, "tree", 1 << 20, 4, 5.0, finalist=False)]
    assert choose_layout(rows) == (1 << 20, 4)  # 10% worse at 8 B, 2x better at 4 KiB
    e = entries(rows, (1 << 20, 4))["allreduce"]["float32"]
    assert [(x["bytes"], x["schedule"]) for x in e] == [(8, "one_shot"), (4096, "ring")]
    # A pruned candidate's time (one round) is evidence, not a winner: finalists win.
    assert e[1]["by_schedule"] == {"ring": 20, "tree": 5.0} and e[1]["runner_up"]["schedule"] == "tree"
    assert e[0]["runner_up"] == {"schedule": "ring", "chunk_bytes": 1 << 20, "algos": None, "time_us": 25}
