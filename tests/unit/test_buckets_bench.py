"""bench/buckets_across_hosts.py's table, from known samples: medians, the host link's bound
(per host, not per rank) and the ratio to gloo. (The timed run itself needs the testbed and
torchrun on two hosts: bench/results/train_scaling_across_hosts.md has its figures.)"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("buckets_across_hosts", ROOT / "bench" / "buckets_across_hosts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_takes_medians_the_host_links_bound_and_the_ratio_to_gloo(bench, tmp_path, capsys):
    nbytes, rate = 1_000_000, 10**9  # the bound at 2 hosts: 1 MB x 8 / 1 Gbit/s = 8 ms, whatever the ranks
    samples = {  # (wall, cpu, caller) seconds per call, one tuple per round
        (nbytes, "gloo"): [(0.010, 0.002, 0.001), (0.030, 0.002, 0.001), (0.009, 0.001, 0.001)],
        (nbytes, "ddl"): [(0.016, 0.004, 0.003), (0.008, 0.003, 0.002), (0.012, 0.005, 0.004)],
    }
    out = tmp_path / "b.json"
    bench._report(samples, [nbytes], ["gloo", "ddl"], 4, 2, rate, str(out))
    rows = {r["peer"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["gloo"]["ms"] == pytest.approx(10.0) and rows["ddl"]["ms"] == pytest.approx(12.0)
    assert rows["gloo"]["of_bound"] == pytest.approx(0.8) and rows["ddl"]["of_bound"] == pytest.approx(8 / 12)
    assert rows["ddl"]["vs_gloo"] == pytest.approx(1.2)
    assert rows["ddl"]["cpu_ms"] == pytest.approx(4.0) and rows["ddl"]["caller_cpu_ms"] == pytest.approx(3.0)
    assert rows["ddl"]["rounds"] == [0.016, 0.008, 0.012]
    printed = capsys.readouterr().out
    assert "1.200x" in printed and "66.7%" in printed, printed
