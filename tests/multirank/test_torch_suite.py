"""torch's own distributed test suite on "ddl": a representative handful here; all of it with `make torch-suite`.

tests/multirank/torch_suite.py runs torch's DistributedTest._DistTestBase through torch's
MultiProcessTestCase (ranks spawned by torch.multiprocessing, file:// init, no MPI launcher).
The whole suite takes about 20 minutes per backend on 2 cores, so `make test` runs a few of
its tests: collectives on the default group (async, coalesced) and DDP on CPU. They must pass.
"""
from __future__ import annotations

import json
import subprocess
import sys

from support.launch import TESTS, ddl_segments

# Names (substrings) of torch's tests run here: every one must pass, none may be skipped.
SUBSET = ("test_all_reduce_sum_async", "test_broadcast_full_group", "test_all_gather_coalesced_simple",
          "test_DistributedDataParallelCPU_grad_is_view")


def test_torch_suite_subset_passes_on_ddl(tmp_path):
    before = ddl_segments()
    out = tmp_path / "ddl.json"
    args = [sys.executable, str(TESTS / "multirank" / "torch_suite.py"), "--backend", "ddl", "--json", str(out)]
    for name in SUBSET:
        args += ["-k", name]
    proc = subprocess.run(args, cwd=str(TESTS), capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    lines = "\n".join(ln for ln in proc.stdout.splitlines() if ln[:4] in ("PASS", "SKIP", "FAIL", "torc"))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{lines}\n{proc.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert result["counts"]["fail"] == 0 and result["counts"]["skip"] == 0, lines
    assert result["counts"]["pass"] >= len(SUBSET), lines
    assert not ddl_segments() - before, "shared memory left behind"
