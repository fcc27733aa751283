"""torch.compile on a DDP model over the "ddl" backend, under torchrun (compile_worker.py).

Before ddl_triton/torch/compile_boundary.py, the compiled forward failed on its second step:
DDP's reducer rebuilt its buckets through our Python ProcessGroup, Dynamo tried to trace the
group's broadcast and raised UnsafeScriptObjectError (a ProcessGroup is opaque to it).
"""
from __future__ import annotations

import json
import subprocess

from support.launch import TESTS, TORCHRUN, ddl_segments, torch_launcher_env


def _results(*modes: str) -> dict[str, dict]:
    before = ddl_segments()
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "multirank/compile_worker.py", "ddl",
                           *modes], env=torch_launcher_env(), cwd=str(TESTS), capture_output=True, text=True,
                          timeout=240, stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-6000:]}"
    assert not ddl_segments() - before, f"shared memory left behind: {sorted(ddl_segments() - before)}"
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            results[r["mode"]] = r
    assert sorted(results) == sorted(modes), out[-4000:]
    return results


def test_compiled_ddp_on_ddl_trains_to_the_eager_weights_with_identical_replicas():
    # aot_eager runs the same aten ops as eager, so the weights must be the same bits. Compiled
    # autograd traces backward too (DDP's Python reducer); our allreduce_hook averages as DDP's own.
    r = _results("eager", "aot_eager", "compiled_autograd", "aot_eager+hook")
    for mode, result in r.items():
        assert result["identical"], f"{mode}: the replicas differ"
    for mode in ("aot_eager", "compiled_autograd", "aot_eager+hook"):
        assert r[mode]["sha"] == r["eager"]["sha"], f"{mode}: weights {r[mode]['sha']} != eager's {r['eager']['sha']}"
        assert r[mode]["graphs"] >= 1, f"{mode}: Dynamo compiled no graph: {r[mode]}"
    # The DDPOptimizer split the forward at the four 1 MiB buckets' boundaries.
    assert r["aot_eager"]["ddp_buckets"] == [4] and r["aot_eager+hook"]["ddp_buckets"] == [4], r["aot_eager"]
