"""bench/_outer_sync_table.py: the outer-sync benchmark's arithmetic (names, time to target, rows, best
row, measured crossover), on made-up results: no ranks, no hosts, no timing."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _outer_sync_table import (best, markdown, measured_crossover, parse_config, planner_config,  # noqa: E402
                               rows, time_to_target)


def test_configuration_names():
    assert parse_config("no-comm") == {"kind": "local"}
    assert parse_config("gloo fp32") == {"kind": "per-step", "backend": "gloo", "compression": "none"}
    assert parse_config("ddl auto") == {"kind": "per-step", "backend": "ddl", "compression": "auto"}
    assert parse_config("ddl fp32")["compression"] == "none"
    assert parse_config("diloco H=32") == {"kind": "outer", "sync_every": 32, "fragments": 1, "delay": 0,
                                           "compression": None}
    assert parse_config("streaming int4 H=32 F=4") == {"kind": "outer", "sync_every": 32, "fragments": 4,
                                                       "delay": 7, "compression": "int4"}
    for bad in ("diloco H=32 F=4", "streaming int4 H=32", "streaming int4 H=30 F=4", "gloo int8", "ddl", "H=8"):
        with pytest.raises(ValueError, match="configuration"):
            parse_config(bad)
    # the planner's choice round-trips through a name
    assert planner_config("per-step", "none", 1, 1) == "ddl fp32"
    assert planner_config("per-step", "int8", 1, 4) == "ddl int8"
    assert planner_config("outer", "none", 64, 1) == "diloco H=64"
    assert planner_config("outer", "int4", 32, 4) == "streaming int4 H=32 F=4"
    assert parse_config(planner_config("outer", "none", 8, 4))["fragments"] == 4


def test_time_to_target_is_where_the_loss_stays_at_or_below_it():
    curve = [[16, 1.0, 0.9], [32, 2.0, 0.5], [48, 3.0, 0.6], [64, 4.0, 0.4]]
    assert time_to_target(curve, 0.6) == 2.0
    assert time_to_target(curve, 0.5) == 4.0   # the dip at 2.0 s did not hold
    assert time_to_target(curve, 0.45) == 4.0
    assert time_to_target(curve, 0.1) is None
    assert time_to_target(curve + [[80, 5.0, 0.7]], 0.6) is None  # reached, then diverged


def _result(name, train_s, losses, digests=("a", "a"), tx=(1_000_000, 1_000_000), **extra):
    curve = [[16 * (i + 1), train_s * (i + 1) / len(losses), loss] for i, loss in enumerate(losses)]
    return {"config": name, "train_s": train_s, "steps": 32, "curve": curve, "final_eval_loss": losses[-1],
            "digests": list(digests), "tx_bytes_per_host": list(tx), **extra}


def test_rows_best_and_markdown():
    job = {"results": [
        _result("no-comm", 2.0, [0.9, 0.8], digests=("a", "b"), tx=(0, 0)),
        _result("gloo fp32", 8.0, [0.6, 0.4]),                       # the reference: target 0.42
        _result("diloco H=8", 2.5, [0.41, 0.41]),
        _result("planner", 2.2, [0.7, 0.5], digests=("a", "c"), planned="diloco H=32"),
    ]}
    table = rows(job)
    by = {r["config"]: r for r in table}
    assert by["gloo fp32"]["time_to_target_s"] == 8.0 and by["gloo fp32"]["vs_per_step"] == 0.0
    assert by["diloco H=8"]["time_to_target_s"] == 1.25
    assert by["diloco H=8"]["vs_per_step"] == pytest.approx(0.41 / 0.4 - 1)
    assert by["diloco H=8"]["utilisation"] == pytest.approx(0.8) and by["diloco H=8"]["mb_sent"] == 2.0
    assert by["planner: diloco H=32"]["time_to_target_s"] is None
    assert by["planner: diloco H=32"]["identical"] is False  # differing hashes are reported, not hidden
    assert by["no-comm"]["identical"] is None and by["no-comm"]["utilisation"] is None
    assert best(table)["config"] == "diloco H=8"
    text = markdown(table)
    assert "| diloco H=8 | 1.25 | 2.50 | 0.4100 | +2.5% | 80.0% | 2.00 | yes |" in text
    assert "| planner: diloco H=32 | - (not reached) |" in text and "| NO |" in text


def _row(config, seconds):
    return {"config": config, "time_to_target_s": seconds, "identical": True}


def test_measured_crossover():
    per_rate = {1e9: [_row("gloo fp32", 5.0), _row("diloco H=8", 6.0)],
                1e8: [_row("gloo fp32", 9.0), _row("ddl auto", 7.0), _row("planner: diloco H=32", 6.5)],
                1e7: [_row("gloo fp32", 90.0), _row("streaming int4 H=32 F=4", 8.0)]}
    assert measured_crossover(per_rate) == "between 100 Mbit/s (outer wins) and 1 Gbit/s (per-step wins)"
    assert measured_crossover({1e7: per_rate[1e7]}) == "outer sync wins at every rate measured (up to 10 Mbit/s)"
    assert measured_crossover({1e9: per_rate[1e9]}) == "per-step wins at every rate measured (down to 1 Gbit/s)"
    assert measured_crossover({1e9: [_row("gloo fp32", None)]}) == "no configuration reached the target"


def test_utilisation_is_against_the_no_comm_rows_mean():
    job = {"results": [_result("no-comm", 2.0, [0.9], tx=(0, 0)), _result("gloo fp32", 6.0, [0.4]),
                       _result("no-comm again", 4.0, [0.9], tx=(0, 0))]}
    by = {r["config"]: r for r in rows(job)}
    assert by["gloo fp32"]["utilisation"] == pytest.approx(0.5)
    assert by["no-comm again"]["identical"] is None and by["no-comm again"]["utilisation"] is None
